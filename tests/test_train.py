"""The pipeline: the real main() under torchrun on CPU (gloo), topology invariance, capture parity, exact resume,
and a rank failure that ends the whole job. A tiny random Qwen3 target with the SmolLM2 tokenizer."""

import json
import os
from pathlib import Path

import pytest
import torch

import train
from conftest import free_port, job, run_train
from model import build_target_layer_ids
from target import load_for_capture


def metrics(out):
    return [json.loads(x) for x in open(Path(out) / "r" / "metrics.jsonl")]


def test_assign_roles_and_config():
    cfg = train.Config()
    assert train.assign_roles(8, cfg) == ([0, 1, 2, 3, 4], [5, 6, 7])
    assert train.assign_roles(1, cfg) == ([0], [0])
    with pytest.raises(ValueError, match="must equal the world size"):
        train.assign_roles(4, cfg)
    c = train.parse_config(["--lr=3e-4", "--batch_size=2", "--skip_invalid=true", "--target=x"])
    assert (c.lr, c.batch_size, c.skip_invalid, c.target) == (3e-4, 2, True, "x")
    with pytest.raises(SystemExit, match="unknown config field"):
        train.parse_config(["--lrr=1"])
    with pytest.raises(SystemExit, match="expected"):
        train.parse_config(["--batch_size=two"])
    assert train.parse_config(["--preset=demo"]).mask_token == "<empty_output>"


@pytest.mark.parametrize("capability,bf16,amx,dtype", [
    ("AVX2", False, False, torch.float32),  # AVX2-only EPYC: emulated bf16, ~100x slower than fp32
    ("AVX2", True, False, torch.float32),  # ATEN_CPU_CAPABILITY=avx2 on a bf16 CPU: emulated too
    ("AVX512", False, False, torch.float32),  # AVX512 without its bf16 extension
    ("AVX512", True, False, torch.bfloat16),
    ("AVX512", False, True, torch.bfloat16),
    ("DEFAULT", False, False, torch.float32)])
def test_cpu_dtype_follows_the_cpu(monkeypatch, tiny_target, capability, bf16, amx, dtype):
    """dtype=auto on a CPU: bf16 only with native bf16 matmuls, said in the start-up line;
    --dtype overrides; CUDA is bf16. Training (train.main), eval and regeneration
    (target.load_for_generation) choose alike."""
    import target
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    name = str(dtype).removeprefix("torch.")
    cfg, why = train.resolve_dtype(train.parse_config(["--preset=demo", "--device=cpu"]))
    assert cfg.dtype == name and why.startswith(f"dtype: {name} (CPU capability {capability}")
    assert ("native bf16" in why and "no native" not in why) == (dtype == torch.bfloat16)
    assert target.default_dtype("cpu")[0] == dtype
    assert next(target.load_for_generation(tiny_target, "cpu")[0].parameters()).dtype == dtype
    for given in ("float32", "bfloat16"):
        assert train.resolve_dtype(train.Config(device="cpu", dtype=given)) == (
            train.Config(device="cpu", dtype=given), f"dtype: {given} (--dtype)")
    assert target.default_dtype("cuda:0") == (torch.bfloat16, "CUDA")


def test_validate_reports_every_error_before_gpu_work(tiny_target, tmp_path):
    from transformers import AutoConfig, AutoTokenizer
    tc, tok = AutoConfig.from_pretrained(tiny_target), AutoTokenizer.from_pretrained(tiny_target)
    cfg = train.Config(target=str(tiny_target), data=str(tmp_path / "missing.jsonl"), drafter_layers=2,
                       target_features=9, sliding_layers=3, block_size=1, mask_token="<empty_output>")
    with pytest.raises(ValueError) as e:
        train.validate(cfg, 4, tc, tok)
    msg = str(e.value)
    for part in ("world size (4)", "target_features=9", "block_size=1", "sliding_layers=3", "missing.jsonl"):
        assert part in msg, part
    cfg = train.Config(target=str(tiny_target), data=str(tmp_path), mask_token="")  # SmolLM2: no free row
    with pytest.raises(ValueError, match="no free embedding row"):
        train.validate(cfg, 1, tc, tok)


def test_lr_schedule():
    cfg = train.Config(lr=1.0, warmup_ratio=0.1)
    lrs = [train.lr_at(cfg, s, 100) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0) and lrs[10] == pytest.approx(1.0)
    assert lrs[55] == pytest.approx(0.5, abs=0.02) and lrs[-1] < 0.001
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))


def test_bench_counts_what_the_optimizer_holds():
    """bench.py's memory row splits the peak: the optimizer's fp32 masters and flat gradient (4 + 4
    bytes a parameter of a bf16 drafter) before the first step, AdamW's two moments (8 more) after."""
    from bench import optimizer_bytes
    from ranks import Dist
    model = torch.nn.Linear(8, 4).to(torch.bfloat16)
    d = Dist(0, 1, torch.device("cpu"), [0], [0], 1, None, None, None)
    optim = train.Optimizer(train.Config(), model, d)
    n = sum(p.numel() for p in model.parameters())
    assert optimizer_bytes(optim) == 8 * n
    model(torch.ones(2, 8, dtype=torch.bfloat16)).float().sum().backward()
    optim.step(1e-3, 1.0)
    steps = sum(torch.is_tensor(s.get("step")) for s in optim.opt.state.values())
    assert optimizer_bytes(optim) == 16 * n + 4 * steps  # + AdamW's step counters (fp32 scalars)


def test_schedule_is_lazy_up_to_the_largest_max_steps():
    """The per-rank schedule is a generator: max_steps at its limit costs no memory up front (a list would not fit)."""
    from types import SimpleNamespace
    from ranks import drafter_schedule
    d = SimpleNamespace(drafters=[1, 2, 3], rank=2)  # the second of 3 drafter ranks, 2 micro-batches each per step
    it = drafter_schedule(d, 2, 5, train.MAX_STEPS)
    assert [next(it) for _ in range(4)] == [31, 34, 37, 40]  # steps 5, 6: 6 micro-batches a step, every 3rd from 1


SHARDS, CAPTURED = ("fsdp", "replicate"), [0, 2, 3]


def _capture(rank, world, ports, tiny_target, ids, out, shards):
    """One rank of a job of `world - 1` target ranks and a drafter: each target rank captures `ids` under each
    sharding in turn (a process group per sharding) and saves what it got, and its rows of a weight, to
    out/SHARD-RANK.pt."""
    for shard, port in zip(shards, ports):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
        cfg = train.Config(target=str(tiny_target), device="cpu", target_ranks=world - 1, drafter_ranks=1,
                           target_shard=shard, mask_token="<empty_output>", drafter_layers=2, target_features=3,
                           sliding_layers=0, dtype="float32")
        d = train.setup_dist(cfg, train.torchrun_env())
        if d.is_target:
            cap = load_for_capture(cfg.target, CAPTURED, torch.float32, d.device,
                                   lambda dec: train.shard_target(dec, d.target_mesh))
            w = cap.base.layers[0].mlp.up_proj.weight
            rows = (w.to_local().shape[0] if shard == "fsdp" else None, w.shape[0])
            torch.save({"got": cap(ids), "rows": rows}, out / f"{shard}-{rank}.pt")
        train.teardown_dist(d)


@pytest.fixture(scope="module")
def captured_by_3_processes(tiny_target, tmp_path_factory):
    """ids, {shard: what each target rank of one 3-process job captured}: one job serves both shardings."""
    out = tmp_path_factory.mktemp("capture")
    ids = torch.randint(0, 49152, (2, 20), generator=torch.Generator().manual_seed(0))
    torch.multiprocessing.spawn(_capture, args=(3, [free_port(), free_port()], tiny_target, ids, out, SHARDS),
                                nprocs=3)
    return ids, {shard: [torch.load(out / f"{shard}-{r}.pt") for r in (0, 1)] for shard in SHARDS}


@pytest.mark.parametrize("world,shard", [(1, "replicate"), (3, "fsdp"), (3, "replicate")])
def test_capture_matches_output_hidden_states(tiny_target, world, shard, request, tmp_path):
    """Features at id k == HF output_hidden_states[k+1] (output of decoder layer k), concatenated in id order, on
    every target rank."""
    from transformers import AutoModelForCausalLM
    if world == 1:
        ids = torch.randint(0, 49152, (2, 20))
        _capture(0, 1, [0], tiny_target, ids, tmp_path, [shard])
        ranks = [torch.load(tmp_path / f"{shard}-0.pt")]
    else:
        ids, by_shard = request.getfixturevalue("captured_by_3_processes")
        ranks = by_shard[shard]
    hf = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32)
    with torch.no_grad():
        hs = hf(ids, output_hidden_states=True).hidden_states
    ref = torch.cat([hs[k + 1] for k in CAPTURED], dim=-1)
    for rank in ranks:
        torch.testing.assert_close(rank["got"], ref, atol=1e-5, rtol=1e-5)
        if shard == "fsdp":  # really sharded: this rank holds only its chunk of each weight
            local, whole = rank["rows"]
            assert local < whole


def test_target_fp8_captures_within_fp8_rounding(tiny_target):
    """--target_fp8: every linear of the loaded layers becomes target.Float8Frozen (e4m3 weights
    scaled per output row, activations per row; torch._scaled_mm rounds for real on CPU too), and
    the captured states stay within FP8's rounding of the bf16 target's, far from unrelated states.
    Whether tau keeps is a GPU measurement."""
    from target import Float8Frozen
    ids, got = torch.randint(0, 49152, (2, 20)), {}
    for fp8 in (False, True):
        cap = load_for_capture(str(tiny_target), [0, 2, 3], torch.bfloat16, "cpu", fp8=fp8)
        linears = (torch.nn.Linear, Float8Frozen)
        kinds = {type(m) for m in cap.base.layers.modules() if isinstance(m, linears)}
        assert kinds == ({Float8Frozen} if fp8 else {torch.nn.Linear})
        got[fp8] = cap(ids).float()
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()
    # e4m3 keeps 3 mantissa bits: ~5% per matmul; measured on this target, whose random weights (std 0.2) amplify
    # it: layer 0 ~11%, layer 3 ~15% (bf16 alone: 1-2% against fp32)
    assert 0 < rel(got[True][..., :64], got[False][..., :64]) < 0.15 and rel(got[True], got[False]) < 0.25
    assert rel(got[False][:1], got[False][1:]) > 1  # what a real difference of states measures

def tiny_gated_deltanet(seed=0):
    """A random Qwen3.5-style decoder: 3 Gated-DeltaNet layers and 1 full-attention layer (the 27B's pattern)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    c = AutoConfig.for_model("qwen3_5_text", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                             linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                             linear_conv_kernel_dim=4, layer_types=["linear_attention"] * 3 + ["full_attention"])
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(c).eval().get_decoder()


def test_fla_short_conv_keeps_the_gated_deltanet_layer(monkeypatch, tiny_target):
    """target.fla_short_conv points the Gated-DeltaNet layers' short convolution at a kernel with
    fla's layout (x [B, T, D], weight [D, W], SiLU fused), here a stand-in written to that contract,
    on CPU: the decoder's output stays the reference path's, the stand-in ran in every such layer, a
    second call patches nothing, and a decoder without such layers is left alone. On the GPU,
    tests/test_gpu.py runs fla's own kernel."""
    import sys
    import torch.nn.functional as F
    from target import fla_short_conv
    dec, ids, calls = tiny_gated_deltanet(), torch.randint(0, 256, (2, 37)), []
    module = sys.modules[type(dec.layers[0].linear_attn).__module__]
    monkeypatch.setattr(module, "causal_conv1d_fn", module.causal_conv1d_fn)  # restored after the test

    def conv(x_BTD, weight_DW, bias=None, activation=None):
        calls.append(x_BTD.shape)
        W, T = weight_DW.shape[1], x_BTD.shape[1]
        xp = F.pad(x_BTD, (0, 0, W - 1, 0))  # causal: W - 1 zeros before the first step
        y = sum(xp[:, k:k + T] * weight_DW[:, k] for k in range(W)) + (0 if bias is None else bias)
        return (F.silu(y) if activation in ("silu", "swish") else y), None
    with torch.no_grad():
        ref = dec(input_ids=ids).last_hidden_state
        assert fla_short_conv(dec, conv, "cpu") == [module.__name__]
        got = dec(input_ids=ids).last_hidden_state
    assert calls == [(2, 37, 2 * 2 * 16 + 4 * 16)] * 3
    assert torch.allclose(got, ref, atol=1e-5) and ref.abs().max() > 1
    assert fla_short_conv(dec, conv, "cpu") == []  # already patched
    from transformers import AutoModelForCausalLM
    llama = AutoModelForCausalLM.from_pretrained(tiny_target).get_decoder()
    assert fla_short_conv(llama, conv, "cpu") == []


# Every plain training run of this module's tests, started together in the background when the module starts (the
# `runs` fixture of conftest, two at a time), so that both cores stay busy; each test reads its own by name.
DPACE = ("--max_steps=1", "--loss_weighting=dpace", "--dpace_alpha=0.4")
TWO_DRAFTERS = ("--grad_accum=2", "--target_ranks=2", "--drafter_ranks=2")
KD = ("--max_steps=6", "--lr=3e-3")
FP8 = ("--fp8=tensorwise", "--fp8_head=true")
RUNS = {
    # one process, 4 micro-batches a step, 3 steps, the default decay weighting: the reference run of both
    # split-invariance tests (its step-1 loss comes before any update, so max_steps does not change it)
    "colocated": job(1, "--max_steps=3", "--grad_accum=4"),
    "two-drafters": job(4, "--max_steps=3", *TWO_DRAFTERS),
    "dpace-colocated": job(1, *DPACE, "--grad_accum=4"),
    "dpace-two-drafters": job(4, *DPACE, *TWO_DRAFTERS),
    "kd-l1": job(3, *KD, "--kd_loss=l1", "--markov_rank=8", "--confidence_head=true", "--target_ranks=2",
                 "--drafter_ranks=1"),
    "kd-kl": job(1, *KD, "--kd_loss=kl", "--kd_weight=0.5", "--loss_weighting=dpace"),
    "kd-ce": job(1, *KD, "--loss_weighting=dpace"),
    "markov": job(3, "--max_steps=6", "--markov_rank=8", "--target_ranks=2", "--drafter_ranks=1", "--lr=3e-3"),
    "domino": job(1, "--max_steps=6", "--domino_gru_dim=8", "--domino_emb_dim=16", "--lr=3e-3"),
    "fp8": job(1, "--max_steps=3", *FP8),
    "fp8-ref": job(1, "--max_steps=3"),
    "fp8-all": job(1, "--max_steps=3", *FP8, "--target_fp8=true"),
    "resume-straight": job(1, "--max_steps=6", "--batch_size=2"),
    "resume-ckpt": job(1, "--max_steps=6", "--batch_size=2", "--ckpt_every=3"),
    "rank-failure": job(3, "--max_steps=50", "--target_ranks=2", "--drafter_ranks=1", fail="2:2", timeout=120),
}


@pytest.mark.runs("colocated", "two-drafters")
def test_torchrun_3_and_4_processes_and_topology_invariance(runs, split_reference):
    """Same seed, same global batch (4 sequences per step): world 1 colocated, 2 targets + 1 drafter (the
    split_reference run, which the two-node test compares against too), and 2 targets + 2 data-parallel drafters
    give the same step-1 loss and grad norm."""
    by_world = {}
    for nproc, (p, out, _) in ((1, runs["colocated"]), (3, split_reference), (4, runs["two-drafters"])):
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        by_world[nproc] = metrics(out)
        assert len(by_world[nproc]) == 3
        assert (out / "r" / "ckpt-0000003" / "model.safetensors").exists()
        assert (out / "r" / "curves.png").exists() and (out / "r" / "config.json").exists()
    for nproc in (3, 4):
        for key in ("loss", "grad_norm", "acc", "tau_est"):
            assert by_world[nproc][0][key] == pytest.approx(by_world[1][0][key], rel=1e-4, abs=1e-6), (nproc, key)
    assert "balanced split" in p.stdout  # each side's capacity is reported
    from model import load_drafter
    d = load_drafter(out / "r" / "ckpt-0000003")
    assert d.cfg.target_layer_ids == build_target_layer_ids(6, 3) and d.cfg.mask_token_id == 16


@pytest.mark.runs("dpace-colocated", "dpace-two-drafters", "colocated")
def test_dpace_normalization_is_split_invariant(runs):
    """--loss_weighting=dpace: its denominator (kept blocks) is summed over micro-batches and drafter ranks, so one
    process with 4 micro-batches and 2 data-parallel drafters with 2 each give the same step-1 loss and grad norm
    (a rank-local denominator would not), and the loss differs from the decay objective's (the same run with
    decay: the topology test's colocated run)."""
    first = {}
    for name in ("dpace-colocated", "dpace-two-drafters", "colocated"):  # the last: decay, the topology test's
        p, out, _ = runs[name]
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        first[name] = metrics(out)[0]
    for key in ("loss", "grad_norm", "acc", "tau_est"):
        assert first["dpace-two-drafters"][key] == pytest.approx(first["dpace-colocated"][key], rel=1e-4,
                                                                  abs=1e-6), key
    assert first["dpace-colocated"]["loss"] != pytest.approx(first["colocated"]["loss"], rel=1e-3)


def test_capture_final_state_is_the_lm_heads_input(tiny_target):
    """Ids ending in FINAL: the whole decoder is built and the capture appends its output after the
    final norm, D wide, after the layers' states; through the LM head it gives the target's own
    logits. Without FINAL the decoder stops at the deepest captured layer, as before."""
    from transformers import AutoModelForCausalLM
    from target import FINAL
    hf = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32)
    ids = torch.randint(0, 49152, (2, 20))
    with torch.no_grad():
        out = hf(ids, output_hidden_states=True)
    cap = load_for_capture(str(tiny_target), [0, 2, 3, FINAL], torch.float32, torch.device("cpu"))
    got = cap(ids)
    assert got.shape == (2, 20, 4 * 64) and len(cap.base.layers) == 6
    layers = torch.cat([out.hidden_states[k + 1] for k in (0, 2, 3)], -1)
    torch.testing.assert_close(got[..., :192], layers)
    torch.testing.assert_close(hf.lm_head(got[..., 192:]), out.logits, atol=1e-4, rtol=1e-4)
    plain = load_for_capture(str(tiny_target), [0, 2, 3], torch.float32, torch.device("cpu"))
    assert len(plain.base.layers) == 4 and torch.equal(plain(ids), got[..., :192])


@pytest.mark.runs("kd-l1", "kd-kl", "kd-ce")
def test_kd_and_confidence_head_train_through_train_py(runs):
    """The target-distribution loss and the confidence head through the real main(): under torchrun
    (2 targets + 1 drafter: the final states travel with the layers') --kd_loss=l1 with a Markov
    and a confidence head, and in one process --kd_loss=kl under D-PACE. Both end, the loss falls, the checkpoint carries the head (its
    weights moved from their init), and the kl run's loss differs from the CE-only run's on the
    same data and seed."""
    from model import load_drafter
    for name in ("kd-l1", "kd-kl", "kd-ce"):
        p, out, _ = runs[name]
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        rows = metrics(out)
        assert rows[-1]["loss"] < rows[0]["loss"], name
    init, last = (load_drafter(runs["kd-l1"].out / "r" / n) for n in ("init", "ckpt-0000006"))
    assert last.cfg.confidence_head and init.cfg == last.cfg
    assert not torch.equal(init.confidence_head.proj.weight, last.confidence_head.proj.weight)
    kl, ce = (metrics(runs[name].out)[0]["loss"] for name in ("kd-kl", "kd-ce"))
    assert kl != pytest.approx(ce, rel=1e-3)


@pytest.mark.runs("markov")
def test_markov_head_trains_through_train_py(runs):
    """--markov_rank=8 under torchrun (2 targets + 1 drafter): the run ends, its checkpoint is a DSpark drafter that
    loads with the head, the head's weights moved from their init, and the loss fell."""
    from model import load_drafter
    p, out, _ = runs["markov"]
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    init, last = (load_drafter(out / "r" / n) for n in ("init", "ckpt-0000006"))
    assert last.cfg.markov_rank == 8 and init.cfg == last.cfg
    assert not torch.equal(init.markov_head.markov_w1.weight, last.markov_head.markov_w1.weight)
    rows = metrics(out)
    assert rows[-1]["loss"] < rows[0]["loss"]


@pytest.mark.runs("domino")
def test_domino_head_trains_through_train_py(runs):
    """--domino_gru_dim=8, one process: the run ends, its checkpoint is a
    Domino drafter in the shifted layout that loads with the head, whose weights moved from their init once the LM
    head's own CE stopped weighing everything (1, 2/3, 1/3, then 0 over 6 steps at decay 0.5), and
    the loss fell."""
    from model import load_drafter
    assert [train.domino_base_weight(train.Config(domino_gru_dim=8), s, 6) for s in range(6)] == \
        pytest.approx([1, 2 / 3, 1 / 3, 0, 0, 0])
    assert train.domino_base_weight(train.Config(domino_gru_dim=8, domino_base_start=0.5), 1, 10) == \
        pytest.approx(0.4)
    assert train.domino_base_weight(train.Config(), 0, 6) == 0  # no Domino head
    p, out, _ = runs["domino"]
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    init, last = (load_drafter(out / "r" / n) for n in ("init", "ckpt-0000006"))
    assert last.cfg.domino_gru_dim == 8 and last.cfg.domino_emb_dim == 16 and init.cfg == last.cfg
    # the layout SGLang serves, by default (--domino_layout=shifted)
    assert last.cfg.domino_shift_label is True and last.cfg.domino_prefix_len == 1
    for name in ("prefix_gru.weight_ih_l0", "embed_proj.2.weight"):
        assert not torch.equal(init.state_dict()[name], last.state_dict()[name]), name
    rows = metrics(out)
    assert rows[-1]["loss"] < rows[0]["loss"]


@pytest.mark.runs("fp8", "fp8-ref", "fp8-all")
def test_fp8_trains_through_train_py(runs):
    """--fp8=tensorwise (emulated on CPU) with --fp8_head (real e4m3 matmuls): the run ends, its losses stay within
    FP8 rounding of the run without them (same seed and data) while differing from them, and its checkpoint is a
    plain released-format drafter. --target_fp8 on top trains on the FP8 target's states: it ends, loss near too."""
    from model import load_drafter
    losses = {}
    for name, run in (("fp8", "fp8"), ("ref", "fp8-ref"), ("all", "fp8-all")):
        p, out, _ = runs[run]
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        losses[name] = [r["loss"] for r in metrics(out)]
    assert losses["fp8"] != losses["ref"] and losses["fp8"] == pytest.approx(losses["ref"], rel=0.02)
    assert losses["all"] != losses["fp8"] and losses["all"] == pytest.approx(losses["ref"], rel=0.1)
    assert "linears in FP8" in p.stdout
    fp8, ref = (load_drafter(runs[name].out / "r" / "ckpt-0000003") for name in ("fp8", "fp8-ref"))
    assert fp8.cfg == ref.cfg and list(fp8.state_dict()) == list(ref.state_dict())


@pytest.mark.runs("resume-straight", "resume-ckpt")
def test_resume_is_exact(tiny_target, convs, tmp_path, runs):
    p, a, _ = runs["resume-straight"]
    assert p.returncode == 0, p.stderr[-3000:]
    straight = [r["loss"] for r in metrics(a)]
    q, b, _ = runs["resume-ckpt"]
    assert q.returncode == 0
    ck = b / "r" / "ckpt-0000003"
    # a second run dir resumed from the step-3 checkpoint of the first
    p, _ = run_train(tiny_target, convs, tmp_path / "c", 1, "--max_steps=6", "--batch_size=2", f"--resume={ck}")
    assert p.returncode == 0, p.stderr[-3000:]
    resumed = [r["loss"] for r in metrics(tmp_path / "c")]
    assert [r["step"] for r in metrics(tmp_path / "c")] == [4, 5, 6]
    assert resumed == straight[3:]  # bit-identical in fp32


@pytest.mark.runs("rank-failure")
def test_rank_failure_ends_job_fast(runs):
    p, _, secs = runs["rank-failure"]
    assert p.returncode != 0
    assert "[rank 2 (drafter)] FAILED" in p.stderr and "injected failure" in p.stderr
    assert secs < 60, secs
