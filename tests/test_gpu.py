"""CUDA-only checks of the compiled flex path (skipped without a GPU; run on the GPU machine:
python -m pytest -q tests/test_gpu.py). The CPU suite covers the same rule through SDPA and eager flex."""

import json
import math

import pytest
import torch

from conftest import run_train
from attention import attend, compile_count, configure_compile, dense_mask, dflash_block_mask
from loss import LossBatch, LossOptions, Tables, dflash_loss, sample_anchors
from model import DFlashDrafter, DrafterConfig

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
@pytest.mark.parametrize("window", [None, 256])
def test_compiled_flex_equals_sdpa_cuda_bf16(window):
    """Forward and gradients of compiled flex vs SDPA on the same dense rule, bf16, 27B-drafter head layout."""
    configure_compile()
    torch.manual_seed(0)
    B, S, N, K, H, Hkv, d = 2, 1000, 64, 16, 32, 8, 128
    lm = torch.zeros(B, S, device="cuda")
    lm[:, 200:] = 1
    lm[1, 240:] = 0  # a short response: fewer candidates than anchors, so padding blocks
    anchors, keep = sample_anchors(lm, N)
    assert not keep.all()
    q = torch.randn(B, H, N * K, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, Hkv, S + N * K, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(B, Hkv, S + N * K, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(B, H, N * K, d, device="cuda", dtype=torch.bfloat16)
    outs, grads = [], []
    for mask in (dflash_block_mask(anchors, keep, S, K, window), dense_mask(anchors, keep, S, K, window)):
        out = attend(q, k, v, mask)
        (out.float() * g).sum().backward()
        outs.append(out.float())
        grads.append([t.grad.float().clone() for t in (q, k, v)])
        for t in (q, k, v):
            t.grad = None
    assert torch.isfinite(outs[0]).all()
    torch.testing.assert_close(outs[0], outs[1], atol=2e-2, rtol=2e-2)
    for a, b in zip(grads[0], grads[1]):
        torch.testing.assert_close(a, b, atol=5e-2, rtol=5e-2)


@cuda
def test_flex_loss_equals_sdpa_loss_and_no_recompiles():
    """The whole objective through compiled flex vs SDPA (fp32 weights, so differences are kernel-only),
    then new sequence lengths after warm-up compile nothing."""
    configure_compile()
    torch.manual_seed(0)
    cfg = DrafterConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=64, vocab_size=1000, block_size=16, mask_token_id=3,
                        target_layer_ids=[1, 2, 3], num_target_layers=6,
                        layer_types=["sliding_attention", "full_attention"], sliding_window=128)
    drafter = DFlashDrafter(cfg).cuda()
    embed, head = torch.randn(2, 1000, 256, device="cuda").unbind(0)

    def run(S, backend):
        torch.manual_seed(S)
        ids = torch.randint(0, 1000, (1, S), device="cuda")
        lm = torch.zeros(1, S, device="cuda")
        lm[:, S // 4:] = 1
        hidden = torch.randn(1, S, 3 * 256, device="cuda")
        anchors, keep = sample_anchors(lm, 64, torch.Generator("cuda").manual_seed(S))
        drafter.zero_grad()
        r = dflash_loss(drafter, Tables(embed, head), LossBatch(ids, lm, hidden, anchors, keep),
                        LossOptions(backend=backend))
        r["loss_sum"].backward()
        return r["loss_sum"].item(), [p.grad.clone() for p in drafter.parameters()]

    for S in (512, 640):
        lf, gf = run(S, "flex")
        ls, gs = run(S, "sdpa")
        assert lf == pytest.approx(ls, rel=1e-3)
        for a, b in zip(gf, gs):
            torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-2)
    warm = compile_count()
    for S in (768, 1024, 896, 512):
        run(S, "flex")
    assert compile_count() == warm


@cuda
@pytest.mark.parametrize("head", [[], ["--domino_gru_dim=16"], ["--markov_rank=16", "--confidence_head=true",
                                  "--kd_loss=l1"]], ids=["dflash", "domino", "dspark"])
def test_train_colocated_cuda_compiled_layers(tiny_target, convs, tmp_path, head):
    """train.py on one GPU, bf16, compiled drafter layers with flex inside (and a Domino head's GRU
    beside them, whose blend weight changes every step; or DSpark's heads and L1 term): it runs, the
    loss is finite and falls, and after warm-up no step compiles anything (the log line would say
    RECOMPILES=)."""
    # 32 anchors x 4 = 128 block tokens: every length has >= 2 KV tiles (one tile is a graph of its own,
    # tests/test_attention.py::test_compiled_block_mask_single_kv_tile_compiles_once_more)
    p, _ = run_train(tiny_target, convs, tmp_path, 1, "--device=cuda", "--dtype=bfloat16", "--max_steps=12",
                     "--max_length=96", "--num_anchors=32", "--batch_size=2", "--pad_multiple=16", *head,
                     timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(x) for x in open(tmp_path / "r" / "metrics.jsonl")]
    assert len(rows) == 12 and all(math.isfinite(r["loss"]) for r in rows)
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert all(r["recompiles"] == 0 for r in rows), [r["recompiles"] for r in rows]
    assert "RECOMPILES" not in p.stdout


@cuda
@pytest.mark.parametrize("weighting,markov_rank,domino,kd", [
    ("dpace", 0, 0, "none"), ("decay", 16, 0, "none"), ("dpace", 16, 0, "l1"), ("dpace", 0, 64, "none"),
    ("decay", 0, 64, "kl"), ("dpace", 0, "64-shifted", "none")])
def test_loss_variants_on_cuda_equal_cpu(weighting, markov_rank, domino, kd):
    """D-PACE weights, the Markov head, a Domino head (cuDNN's GRU; aligned, and shifted: SGLang's
    layout) and the target-distribution term inside the compiled chunk loss of the bridge on CUDA
    give the CPU loss and gradients (fp32 weights, chunked). Fresh compile caches: earlier tests'
    graphs count toward the recompile limit."""
    shifted = domino == "64-shifted"
    domino = 64 if shifted else domino
    torch._dynamo.reset()
    configure_compile()
    torch.manual_seed(0)
    cfg = DrafterConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=64, vocab_size=1000, block_size=16, mask_token_id=999,
                        target_layer_ids=[1, 3], num_target_layers=4, markov_rank=markov_rank,
                        domino_gru_dim=domino, domino_shift_label=shifted, domino_prefix_len=int(shifted))
    cpu = DFlashDrafter(cfg)
    gpu = DFlashDrafter(cfg).cuda()
    gpu.load_state_dict(cpu.state_dict())
    ids, lm, hidden = torch.randint(0, 999, (2, 256)), torch.ones(2, 256), torch.randn(2, 256, 512)
    final = torch.randn(2, 256, 256) if kd != "none" else None
    embed, head = (torch.randn(1000, 256) * 0.05 for _ in "eh")
    anchors, keep = sample_anchors(lm, 32, torch.Generator().manual_seed(0))
    out = []
    for d, dev, backend in ((cpu, "cpu", "sdpa"), (gpu, "cuda", "flex")):
        e, h, *batch = [t.to(dev) for t in (embed, head, ids, lm, hidden, anchors, keep)]
        batch.append(final if final is None else final.to(dev))
        opts = LossOptions(weighting=weighting, chunk_blocks=8, backend=backend, kd=kd,
                           base_weight=0.3 if domino else 0.0)
        r = dflash_loss(d, Tables(e, h), LossBatch(*batch), opts)
        r["loss_sum"].backward()
        out.append((r["loss_sum"].item(), r["weight_sum"].item(), [p.grad.cpu() for p in d.parameters()]))
    assert out[1][0] == pytest.approx(out[0][0], rel=1e-4) and out[1][1] == pytest.approx(out[0][1], rel=1e-5)
    for a, b in zip(out[0][2], out[1][2]):
        torch.testing.assert_close(b, a, atol=1e-3, rtol=1e-2)


@cuda
def test_fla_short_conv_on_cuda_equals_the_reference(monkeypatch):
    """fla's Triton short convolution (target.fla_short_conv, as train.py loads a Gated-DeltaNet
    target) against transformers' reference path, bf16 on CUDA: the same decoder output up to bf16
    rounding."""
    import sys
    pytest.importorskip("fla", reason="flash-linear-attention (requirements-cuda.txt) not installed")
    from target import fla_short_conv
    from test_train import tiny_gated_deltanet
    dec = tiny_gated_deltanet().to("cuda", torch.bfloat16)
    module = sys.modules[type(dec.layers[0].linear_attn).__module__]
    monkeypatch.setattr(module, "causal_conv1d_fn", module.causal_conv1d_fn)
    ids = torch.randint(0, 256, (2, 300), device="cuda")
    with torch.no_grad():
        ref = dec(input_ids=ids).last_hidden_state.float()
        assert fla_short_conv(dec) == [module.__name__]
        got = dec(input_ids=ids).last_hidden_state.float()
    rel = ((got - ref).norm() / ref.norm()).item()
    assert 0 <= rel < 2e-2, rel
