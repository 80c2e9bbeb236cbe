"""The drafter: train/inference parity, the objective by hand, checkpoint format, and that it can learn."""

import copy
import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F

import fp8
import loss
from attention import build_masks
from loss import (LossBatch, LossOptions, Tables, block_labels, dflash_loss, dpace_weights,
                  sample_anchors)
from model import (DFlashDrafter, DrafterConfig, build_target_layer_ids, drafter_config_from_target,
                   load_drafter, rope_inv_freq, save_drafter, to_float8)

V, D = 96, 64


def tiny_cfg(layer_types=("full_attention", "full_attention"), window=None, K=4):
    return DrafterConfig(hidden_size=D, intermediate_size=112, num_hidden_layers=len(layer_types),
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=V, block_size=K,
                         rope_theta=10000.0, target_layer_ids=[1, 3, 5], num_target_layers=8, mask_token_id=7,
                         layer_types=list(layer_types), sliding_window=window)


def blocks_input(cfg, embed, ids, anchors, keep):
    """What dflash_loss feeds the drafter: [anchor, mask, ...] embedded, at positions anchor + k."""
    B, N, K = *anchors.shape, cfg.block_size
    blk = torch.full((B, N, K), cfg.mask_token_id)
    blk[:, :, 0] = torch.where(keep, ids.gather(1, anchors), cfg.mask_token_id)
    pos = anchors[:, :, None] + torch.arange(K)
    return F.embedding(blk.view(B, N * K), embed), pos.view(B, N * K), blk


@pytest.mark.parametrize("layer_types,window", [
    (("full_attention", "full_attention"), None),
    (("sliding_attention", "full_attention", "sliding_attention"), 5),
])
def test_train_inference_parity(layer_types, window):
    """Every block of one masked training forward == the inference-style forward of that block alone, whose
    context is the target states before the anchor (fresh cache, and a cache filled in two steps)."""
    torch.manual_seed(0)
    cfg = tiny_cfg(layer_types, window)
    drafter = DFlashDrafter(cfg).eval()
    B, S, N, K = 2, 23, 7, cfg.block_size
    embed = torch.randn(V, D)
    ids = torch.randint(0, V, (B, S))
    hidden = torch.randn(B, S, 3 * D)
    anchors = torch.tensor([[0, 1, 3, 9, 10, 20, 0], [2, 5, 6, 13, 21, 0, 0]])  # overlapping, near the end, p=0
    keep = torch.tensor([[1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 0, 0]]).bool()
    x, pos, blk = blocks_input(cfg, embed, ids, anchors, keep)
    with torch.no_grad():
        out = drafter(x, hidden, pos, build_masks(anchors, keep, S, K, cfg.layer_types, window, "sdpa"))
        out = out.view(B, N, K, D)
        assert torch.isfinite(out).all()  # padding blocks see no key at all: zero attention, never NaN
        checked = 0
        for b in range(B):
            for n in range(N):
                if not keep[b, n]:
                    continue
                p = int(anchors[b, n])
                xb = F.embedding(blk[b:b + 1, n], embed)
                ref, _ = drafter.forward_cached(xb, hidden[b:b + 1, :p], None, p)
                torch.testing.assert_close(out[b, n], ref[0], atol=1e-5, rtol=1e-5)
                # the same block after the cache was filled in two rounds, as decoding does (cropped to start)
                half = p // 2
                _, cache = drafter.forward_cached(xb, hidden[b:b + 1, :half], None, half)
                ref2, cache = drafter.forward_cached(xb, hidden[b:b + 1, half:p], cache, p)
                torch.testing.assert_close(out[b, n], ref2[0], atol=1e-5, rtol=1e-5)
                assert cache[0][0].shape[2] == p  # block K/V never stay in the context cache
                checked += 1
        assert checked == int(keep.sum())


def test_labels_and_weights_by_hand():
    S, K, gamma = 12, 4, 7.0
    ids = torch.arange(100, 112)[None]  # token at position t is 100 + t
    lm = torch.zeros(1, S, dtype=torch.long)
    lm[0, 3:12] = 1  # response = positions 3..11
    lm[0, 7] = 0  # one unsupervised hole inside the response
    anchors = torch.tensor([[3, 5, 9, 0]])
    keep = torch.tensor([[True, True, True, False]])
    labels, valid, w = block_labels(ids, lm, anchors, keep, K, gamma)
    e1, e2 = math.exp(-1 / gamma), math.exp(-2 / gamma)
    # anchor 3: offsets 1..3 -> positions 4,5,6, labels 104..106, weights 1, e^-1/7, e^-2/7
    assert labels[0, 0, 1:].tolist() == [104, 105, 106]
    assert valid[0, 0].tolist() == [False, True, True, True]
    torch.testing.assert_close(w[0, 0], torch.tensor([0, 1, e1, e2]))
    # anchor 5: positions 6,7,8; position 7 is not supervised (mask read at the LABEL position)
    assert labels[0, 1, 1:].tolist() == [106, 107, 108]
    torch.testing.assert_close(w[0, 1], torch.tensor([0, 1, 0, e2]))
    # anchor 9: positions 10, 11, 12 -> 12 >= S is dropped
    assert valid[0, 2].tolist() == [False, True, True, False]
    torch.testing.assert_close(w[0, 2], torch.tensor([0, 1, e1, 0]))
    # padding block: nothing
    assert not valid[0, 3].any() and (w[0, 3] == 0).all()


def test_dpace_weights_by_hand():
    """q = 0.8, 0.5, 0.2 at offsets 1..3, alpha 0.5: q~ = 0.9, 0.75, 0.6, prefix products 0.9, 0.675, 0.405, and
    w_k = the sum of those from k on. An unsupervised offset passes the chain through (q~ = 1) and adds nothing."""
    ce = -torch.log(torch.tensor([1.0, 0.8, 0.5, 0.2] * 2))
    valid = torch.tensor([0, 1, 1, 1, 0, 1, 0, 1.0])
    w = dpace_weights(ce, valid, 4, 0.5).view(2, 4)
    torch.testing.assert_close(w[0], torch.tensor([0, 0.9 + 0.675 + 0.405, 0.675 + 0.405, 0.405]))
    torch.testing.assert_close(w[1], torch.tensor([0, 0.9 + 0.9 * 0.6, 0, 0.9 * 0.6]))
    torch.testing.assert_close(dpace_weights(ce, valid, 4, 1.0).view(2, 4)[0], torch.tensor([0, 3.0, 2, 1]))


def _loss_and_grads(drafter, tables, batch, opts=LossOptions()):
    """dflash_loss's terms and the gradients of loss_sum by parameter name."""
    drafter.zero_grad()
    r = dflash_loss(drafter, tables, batch, opts)
    r["loss_sum"].backward()
    return r, {n: p.grad.clone() for n, p in drafter.named_parameters()}


def _forward(drafter, tables, batch, gamma=7.0):
    """The training forward of the batch's blocks written out here, for references in autograd
    -> (out [B, N*K, D], labels, valid, decay weights [B, N, K])."""
    cfg, (ids, lm, hidden, anchors, keep) = drafter.cfg, batch[:5]
    x, pos, _ = blocks_input(cfg, tables.embed_VD, ids, anchors, keep)
    out = drafter(x, hidden, pos, build_masks(anchors, keep, 30, cfg.block_size, cfg.layer_types, 6,
                                              "sdpa"))
    return out, *block_labels(ids, lm, anchors, keep, cfg.block_size, gamma)


def _same_loss_and_gradients(drafter, r, grads, ref):
    drafter.zero_grad()
    ref.backward()
    torch.testing.assert_close(r["loss_sum"], ref.detach(), atol=1e-4, rtol=1e-5)
    for n, p in drafter.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("chunk", [0, 2])
def test_dpace_loss_matches_direct_formula(chunk):
    """weighting="dpace": loss_sum = sum over supervised offsets of w_k * CE_k, w from each block's
    detached confidences (written out here), gradients those of that sum with w held constant,
    weight_sum = kept blocks; the same in chunks of blocks."""
    drafter, tables, batch = _loss_setup(2)
    K, anchors = drafter.cfg.block_size, batch.anchors_BN
    r, grads = _loss_and_grads(drafter, tables, batch,
                               LossOptions(chunk_blocks=chunk, weighting="dpace", alpha=0.3))
    out, labels, valid, _ = _forward(drafter, tables, batch)
    ce = F.cross_entropy(out.reshape(-1, D) @ tables.head_VD.t(), labels.reshape(-1),
                         reduction="none").view(2, -1, K)
    q = torch.exp(-ce.detach())
    ref = 0.0
    for b in range(2):
        for n in range(anchors.shape[1]):
            run, prefix = 1.0, []
            for k in range(K):
                run *= float(0.7 * q[b, n, k] + 0.3) if valid[b, n, k] else 1.0
                prefix.append(run if valid[b, n, k] else 0.0)
            for k in range(K):
                if valid[b, n, k]:
                    ref = ref + sum(prefix[k:]) * ce[b, n, k]
    assert r["weight_sum"] == batch.keep_BN.sum() and valid.sum() > 10
    _same_loss_and_gradients(drafter, r, grads, ref)


@pytest.mark.parametrize("chunk", [0, 3])
def test_markov_head_loss_and_gradients_match_autograd(chunk):
    """A Markov head of rank 8: loss_sum = sum_k w_k CE(lm_head(h_k) + w2(w1[true token k-1])), the
    anchor being offset 1's previous token; every gradient, the head's included, equals autograd's
    through unchunked logits."""
    drafter, tables, batch = _loss_setup(5, markov_rank=8)
    K, ids, anchors = drafter.cfg.block_size, batch.input_ids_BS, batch.anchors_BN
    r, grads = _loss_and_grads(drafter, tables, batch, LossOptions(chunk_blocks=chunk))
    out, labels, _, w = _forward(drafter, tables, batch)
    prev = torch.tensor([[[int(ids[b, min(int(a) + max(k - 1, 0), 29)]) for k in range(K)]
                          for a in anchors[b]] for b in range(2)])  # the token at anchor + k - 1
    bias = drafter.markov_head.markov_w2(drafter.markov_head.markov_w1(prev)).view(-1, V)
    logits = out.reshape(-1, D) @ tables.head_VD.t() + bias
    ref = (F.cross_entropy(logits, labels.reshape(-1), reduction="none") * w.reshape(-1)).sum()
    _same_loss_and_gradients(drafter, r, grads, ref)
    assert all(grads[f"markov_head.markov_w{i}.weight"].abs().sum() > 0 for i in (1, 2))


class _Float8Logits(torch.autograd.Function):
    """The FP8 head's two matmuls as autograd sees them, for the reference: forward
    Float8Head.logits, backward Float8Head.input_grad (the e4m3 rounding of both operands)."""

    @staticmethod
    def forward(ctx, x_MD, head):
        ctx.head, ctx.dtype = head, x_MD.dtype
        return head.logits(x_MD)

    @staticmethod
    def backward(ctx, g_MV):
        return ctx.head.input_grad(g_MV, ctx.dtype), None


def _autograd_loss(drafter, tables, batch, opts):
    """The reference: loss.chunk_loss over the same chunks in plain torch autograd (the logits
    kept for the backward, nothing computed by hand) -> dflash_loss's terms."""
    rows = loss.draft_rows(drafter, tables.embed_VD, batch, opts)
    head = tables.head_VD
    logits_of = ((lambda x: _Float8Logits.apply(x, head)) if isinstance(head, fp8.Float8Head)
                 else (lambda x: x @ head.t()))
    teacher = opts.kd != "none" or drafter.cfg.confidence_head
    total, correct = 0.0, []
    for i in range(0, rows.labels_M.shape[0], rows.chunk_rows):
        chunk = rows.take(slice(i, i + rows.chunk_rows))
        t = logits_of(chunk.teacher_MD).detach() if teacher else None
        l, ok = loss.chunk_loss(chunk, logits_of(chunk.out_MD), t, drafter, opts)
        total, correct = total + l, correct + [ok]
    return loss.block_stats(total, torch.cat(correct), rows, batch.keep_BN, opts)


def _autograd_grads(drafter, tables, batch, opts):
    drafter.zero_grad()
    r = _autograd_loss(drafter, tables, batch, opts)
    r["loss_sum"].backward()
    return r, {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}


def _toy_tv(logits_MV, w_M, rows):
    """A user term from outside loss.py: sum_m w_m TV(softmax(logits_m), a fixed distribution)."""
    q_VV = torch.linspace(1, 2, V * V).view(V, V).softmax(-1)
    return (w_M * 0.5 * (logits_MV.float().softmax(-1) - q_VV[rows.labels_M]).abs().sum(-1)).sum()


BRIDGE_CASES = {  # name -> (drafter fields, LossOptions fields): every term and combination
    "ce": ({}, {}),
    "dpace": ({}, dict(weighting="dpace", alpha=0.4)),
    "markov": (dict(markov_rank=8), {}),
    "markov-dpace": (dict(markov_rank=8), dict(weighting="dpace")),
    "domino-blend": (dict(domino_gru_dim=12, domino_emb_dim=20), dict(base_weight=0.4)),
    "domino-dpace": (dict(domino_gru_dim=12, domino_emb_dim=20), dict(weighting="dpace")),
    "domino-shifted": (dict(domino_gru_dim=12, domino_emb_dim=20, domino_shift_label=True,
                            domino_prefix_len=1), dict(weighting="dpace", base_weight=0.2)),
    "kl": ({}, dict(kd="kl", kd_weight=0.5)),
    "l1-dpace": ({}, dict(kd="l1", weighting="dpace")),
    "l1-markov-confidence": (dict(markov_rank=8, confidence_head=True),
                             dict(kd="l1", weighting="dpace", confidence_weight=0.7)),
    "confidence-detached": (dict(markov_rank=8, confidence_head=True),
                            dict(confidence_detached=True)),
    "domino-l1-extra": (dict(domino_gru_dim=12, domino_emb_dim=20),
                        dict(kd="l1", base_weight=0.3, extra=_toy_tv)),
    "extra": ({}, dict(extra=_toy_tv)),
}


@pytest.mark.parametrize("fp8_head", [False, True], ids=["bf16-head", "fp8-head"])
@pytest.mark.parametrize("case", list(BRIDGE_CASES))
def test_bridge_equals_autograd(case, fp8_head):
    """loss.head_loss (HeadBridge: per chunk the logits once, chunk_loss's backward inside the
    forward, the input gradient by the head's second matmul) gives plain autograd's terms and
    gradients for every term and combination, in chunks of 3 blocks: hidden states (every drafter
    weight behind them), the Domino GRU's row input, every small head's parameters. fp32
    tolerance: the summation order only (loss 1e-5 relative, gradients 1e-4 relative + 1e-5).
    fp8_head: the FP8 LM head emulated on CPU (torch._scaled_mm's real e4m3 rounding) in both."""
    fields, opt_fields = BRIDGE_CASES[case]
    drafter, tables, batch = _teacher_setup(11)
    torch.manual_seed(11)
    drafter = DFlashDrafter(dataclasses.replace(drafter.cfg, **fields))
    if drafter.cfg.domino_gru_dim:
        with torch.no_grad():  # a correction that matters next to the LM head's logits
            drafter.embed_proj[2].weight.normal_(0, 1.0)
    if fp8_head:
        tables = tables._replace(head_VD=fp8.Float8Head(tables.head_VD))
    opts = LossOptions(chunk_blocks=3, **opt_fields)
    rp, gp = _autograd_grads(drafter, tables, batch, opts)
    rb, gb = _loss_and_grads(drafter, tables, batch, opts)
    torch.testing.assert_close(rb["loss_sum"], rp["loss_sum"], atol=1e-4, rtol=1e-5)
    for key in ("weight_sum", "correct_K", "count_K", "tau_sum", "blocks"):
        assert torch.equal(rb[key], rp[key]), key
    assert set(gp) <= set(gb) and all(not gb[n].any() for n in set(gb) - set(gp))
    for n in gp:
        torch.testing.assert_close(gb[n], gp[n], atol=1e-5, rtol=1e-4, msg=n)
    heads = [n for n in gp if n.startswith(("markov", "confidence", "prefix_gru", "embed_proj"))]
    want = (2 * bool(fields.get("markov_rank")) + 2 * bool(fields.get("confidence_head"))
            + 4 * bool(fields.get("domino_gru_dim")))
    assert len(heads) == want and all(gp[n].abs().sum() > 0 for n in heads), heads
    if opt_fields.get("confidence_detached"):  # the BCE moves the head alone
        r0, g0 = _loss_and_grads(drafter, tables, batch, dataclasses.replace(opts, confidence_weight=0))
        for n in g0:
            same = torch.allclose(g0[n], gb[n], atol=1e-6)
            assert same != n.startswith("confidence_head"), n


def test_a_new_loss_through_the_one_seam():
    """A logit-dependent loss added from a test file, with no edit of a production file, through
    LossOptions.extra: the total variation to a stand-in target distribution per row (the shape
    of a distillation term), under the CE's weights, on the fast path (the bridge). dflash_loss
    adds exactly that term, summed over chunks; its gradients are finite, non-zero and not the
    CE's; one AdamW step lowers the combined loss."""
    drafter, tables, batch = _loss_setup(6)
    q_VV = torch.randn(V, V).softmax(-1)  # a fixed distribution for each label: the "target"

    def tv(logits_MV, w_M, rows):  # sum_m w_m TV(p_m, q_m)
        p_MV = logits_MV.float().softmax(-1)
        return (w_M * 0.5 * (p_MV - q_VV[rows.labels_M]).abs().sum(-1)).sum()

    ce_only = LossOptions(chunk_blocks=3)
    with_tv = dataclasses.replace(ce_only, extra=tv)
    r0, g0 = _loss_and_grads(drafter, tables, batch, ce_only)
    r1, g1 = _loss_and_grads(drafter, tables, batch, with_tv)
    out, labels, _, w = _forward(drafter, tables, batch)
    p = (out.reshape(-1, D) @ tables.head_VD.t()).softmax(-1)
    want = (w.reshape(-1) * 0.5 * (p - q_VV[labels.reshape(-1)]).abs().sum(-1)).sum().item()
    assert want > 1 and (r1["loss_sum"] - r0["loss_sum"]).item() == pytest.approx(want, rel=1e-4)
    for n in g1:
        assert torch.isfinite(g1[n]).all() and g1[n].abs().sum() > 0, n
        assert not torch.allclose(g1[n], g0[n], rtol=1e-3, atol=0), n
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-3)
    drafter.zero_grad()
    before = r1["loss_sum"] / r1["weight_sum"]
    dflash_loss(drafter, tables, batch, with_tv)["loss_sum"].div(r1["weight_sum"]).backward()
    opt.step()
    after = dflash_loss(drafter, tables, batch, with_tv)
    assert after["loss_sum"] / after["weight_sum"] < before


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_drafter_linears(recipe, tmp_path):
    """to_float8: every drafter linear but the Markov head's becomes torchao's Float8Linear
    (emulated on CPU); the loss moves by FP8 rounding only, the gradients keep their direction, the
    state dict keeps its names, and the saved checkpoint loads as a plain drafter with the same
    weights."""
    from torchao.float8.float8_linear import Float8Linear
    drafter, tables, batch = _loss_setup(4, markov_rank=16)
    ref, keys = copy.deepcopy(drafter), list(drafter.state_dict())
    to_float8(drafter, recipe, emulate=True)
    fp8 = {n for n, m in drafter.named_modules() if isinstance(m, Float8Linear)}
    linears = {n for n, m in ref.named_modules() if isinstance(m, torch.nn.Linear)}
    assert fp8 == linears - {"markov_head.markov_w2"} and len(fp8) == 1 + 7 * 2  # fc + 7 per layer
    assert list(drafter.state_dict()) == keys
    r8, r = (dflash_loss(m, tables, batch, LossOptions()) for m in (drafter, ref))
    for x in (r8, r):
        x["loss_sum"].backward()
    assert 0 < abs(r8["loss_sum"].item() / r["loss_sum"].item() - 1) < 0.02  # rounded, a little
    for (n, p8), p in zip(drafter.named_parameters(), ref.parameters()):
        assert F.cosine_similarity(p8.grad.flatten(), p.grad.flatten(), dim=0) > 0.98, n
    save_drafter(drafter, tmp_path, dtype=None)
    loaded = load_drafter(tmp_path)
    assert not any(isinstance(m, Float8Linear) for m in loaded.modules())
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(),
                                                 ref.state_dict().values()))


@pytest.mark.parametrize("weighting", ["decay", "dpace"])
def test_fp8_lm_head(weighting):
    """Float8Head: the loss's two LM-head matmuls in e4m3 (torch._scaled_mm, real FP8 rounding on CPU
    too) move the loss and the gradients by rounding only, with a Markov head beside it; the head's
    FP8 copies are per-row scaled both ways, so dequantized they are the head within e4m3's 2^-4
    relative step (2^-9 of the row's scale for the subnormals)."""
    drafter, tables, batch = _loss_setup(5, markov_rank=16)
    h8 = fp8.Float8Head(tables.head_VD)
    for w, s, h in ((h8.w_VD, h8.s_V1, tables.head_VD), (h8.w_DV, h8.s_D1, tables.head_VD.t())):
        assert w.dtype == torch.float8_e4m3fn
        assert torch.all((w.float() * s - h).abs() <= 2 ** -4 * h.abs() + 2 ** -9 * s)
    opts = LossOptions(weighting=weighting)
    r, g = _loss_and_grads(drafter, tables, batch, opts)
    r8, g8 = _loss_and_grads(drafter, tables._replace(head_VD=h8), batch, opts)
    # logits of ~10 rounded at up to 2^-5 of each product's operands
    assert 0 < abs(r8["loss_sum"].item() / r["loss_sum"].item() - 1) < 0.05
    for n in g:
        assert F.cosine_similarity(g[n].flatten(), g8[n].flatten(), dim=0) > 0.98, n


def test_float8_frozen_is_the_linear_on_rounded_operands():
    """target.Float8Frozen (train.py --target_fp8) computes exactly x8 @ w8^T + bias on the e4m3
    operands it makes (weight per output row, activation per row), up to the bf16 output;
    target_to_float8 swaps only linears."""
    from target import Float8Frozen, target_to_float8
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 48).to(torch.bfloat16)
    x = torch.randn(2, 5, 64, dtype=torch.bfloat16)
    y = Float8Frozen(lin)(x)
    (w8, s_w), (x8, s_x) = fp8.rows_fp8(lin.weight.detach()), fp8.rows_fp8(x.reshape(10, 64))
    ref = (x8.float() * s_x) @ (w8.float() * s_w).t() + lin.bias.float()
    assert y.shape == (2, 5, 48) and y.dtype == torch.bfloat16
    assert torch.allclose(y.float().reshape(10, 48), ref, rtol=2 ** -7, atol=2 ** -7 * ref.abs().max().item())
    assert (y.float() - lin(x).float()).abs().max() > 0  # and it is rounded: not the bf16 linear
    layers = torch.nn.Module()
    layers.layers = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.Linear(16, 8),
                                                             torch.nn.LayerNorm(8))])
    assert target_to_float8(layers) == 1  # 16 -> 8 is not a size the FP8 kernels take
    assert [type(m).__name__ for m in layers.layers[0]] == ["Float8Frozen", "Linear", "LayerNorm"]

def test_sample_anchors():
    lm = torch.zeros(3, 12, dtype=torch.long)
    lm[:, 3:12] = 1
    lm[1, 7] = 0
    lm[2] = 0
    lm[2, 5:7] = 1  # exactly one candidate
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(12)
    for _ in range(400):
        a, keep = sample_anchors(lm, 6, g)
        assert a.shape == (3, 6) and keep.shape == (3, 6)
        for b in range(3):
            real = a[b][keep[b]]
            assert torch.equal(real, real.sort().values) and len(set(real.tolist())) == len(real)
            assert all(lm[b, p] and lm[b, p + 1] for p in real.tolist())
            assert keep[b].tolist() == sorted(keep[b].tolist(), reverse=True)  # padding at the end
        assert int(keep[2].sum()) == 1 and a[2, 0] == 5
        counts += torch.bincount(a[0][keep[0]], minlength=12)
    # row 0: candidates 3..10 (8 of them), 6 drawn each time -> each drawn with prob 3/4
    freq = counts[3:11] / 400
    assert ((freq - 0.75).abs() < 0.1).all() and counts[:3].sum() == 0 and counts[11] == 0
    # more anchors than positions: padded, never out of range
    a, keep = sample_anchors(lm[:1], 20)
    assert int(keep.sum()) == 8 and a.max() < 12


def _loss_setup(seed=0, markov_rank=0):
    """A drafter (a sliding and a full layer), its frozen tables, one batch of 2 x 30 tokens."""
    torch.manual_seed(seed)
    cfg = tiny_cfg(("sliding_attention", "full_attention"), window=6)
    drafter = DFlashDrafter(dataclasses.replace(cfg, markov_rank=markov_rank))
    B, S = 2, 30
    ids = torch.randint(0, V, (B, S))
    lm = torch.zeros(B, S)
    lm[:, 8:] = 1
    anchors, keep = sample_anchors(lm, 9, torch.Generator().manual_seed(seed))
    tables = Tables(torch.randn(V, D), torch.randn(V, D))
    return drafter, tables, LossBatch(ids, lm, torch.randn(B, S, 3 * D), anchors, keep)


@pytest.mark.parametrize("opts", [LossOptions(), LossOptions(weighting="dpace")], ids=["decay", "dpace"])
def test_chunked_loss_equals_unchunked(opts):
    drafter, tables, batch = _loss_setup()
    results = [_loss_and_grads(drafter, tables, batch, dataclasses.replace(opts, chunk_blocks=c))
               for c in (0, 2, 4)]
    (r0, g0), *chunked = results
    for r, g in chunked:
        for key in r:
            torch.testing.assert_close(r[key], r0[key], atol=1e-5, rtol=1e-5)
        for n in g:
            torch.testing.assert_close(g[n], g0[n], atol=1e-5, rtol=1e-5)


def test_loss_matches_direct_formula():
    """loss_sum = sum_k w_k * CE(lm_head(out), label) over valid positions, from an independent
    computation; the statistics likewise."""
    drafter, tables, batch = _loss_setup(1)
    (ids, lm, _, anchors, keep), K = batch[:5], drafter.cfg.block_size
    r = dflash_loss(drafter, tables, batch, LossOptions(gamma=5.0, chunk_blocks=0))
    logits = _forward(drafter, tables, batch)[0] @ tables.head_VD.t()
    want, wsum, n_correct, tau = 0.0, 0.0, 0, 0.0
    for b in range(2):
        for n in range(anchors.shape[1]):
            run = True  # tau_est: leading correct predictions; unsupervised offsets pass through
            for k in range(1, K):
                p = int(anchors[b, n]) + k
                if keep[b, n] and p < 30 and lm[b, p]:
                    wk = math.exp(-(k - 1) / 5.0)
                    want += wk * F.cross_entropy(logits[b, n * K + k], ids[b, p]).item()
                    wsum += wk
                    ok = bool(logits[b, n * K + k].argmax() == ids[b, p])
                    n_correct += ok
                    run = run and ok
                    tau += run
            tau += bool(keep[b, n])
    assert r["loss_sum"].item() == pytest.approx(want, rel=1e-5)
    assert r["weight_sum"].item() == pytest.approx(wsum, rel=1e-6)
    assert r["correct_K"].sum().item() == n_correct
    assert r["blocks"].item() == keep.sum().item()
    assert r["tau_sum"].item() == pytest.approx(tau)


def test_save_load_roundtrip_and_config(tmp_path):
    cfg = tiny_cfg(("sliding_attention", "full_attention"), window=6)
    drafter = DFlashDrafter(cfg)
    save_drafter(drafter, tmp_path, dtype=None)
    back = load_drafter(tmp_path)
    assert back.cfg == cfg
    for (k1, v1), (k2, v2) in zip(drafter.state_dict().items(), back.state_dict().items()):
        assert k1 == k2 and torch.equal(v1, v2)
    assert back.inv_freq.dtype == torch.float32
    from safetensors import safe_open
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_proj.weight",
            "layers.1.self_attn.k_norm.weight", "layers.0.mlp.down_proj.weight",
            "layers.1.post_attention_layernorm.weight"} <= keys
    assert not any("embed" in k or "lm_head" in k or "inv_freq" in k for k in keys)
    c = json.loads((tmp_path / "config.json").read_text())
    for name in ("architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps",
                 "attention_bias", "attention_dropout", "rope_theta", "rope_scaling", "max_position_embeddings",
                 "vocab_size", "tie_word_embeddings", "layer_types", "use_sliding_window", "sliding_window",
                 "max_window_layers", "dtype", "block_size", "num_target_layers", "dflash_config", "rope_parameters"):
        assert name in c, name
    assert c["architectures"] == ["DFlashDraftModel"] and c["model_type"] == "qwen3"
    assert "auto_map" not in c  # it would name a dflash.py that is not shipped
    assert c["dflash_config"] == {"mask_token_id": 7, "target_layer_ids": [1, 3, 5], "block_size": c["block_size"]}
    assert c["layer_types"] == ["sliding_attention", "full_attention"] and c["use_sliding_window"] is True
    # transformers reads it as a Qwen3 config with the same layout
    from transformers import Qwen3Config
    q = Qwen3Config.from_dict(c)
    assert q.layer_types == c["layer_types"] and q.sliding_window == 6 and q.head_dim == 16
    # bf16 export (the default) keeps rope in fp32 after loading, and stays loadable
    save_drafter(drafter, tmp_path / "bf16")
    assert load_drafter(tmp_path / "bf16").fc.weight.dtype == torch.bfloat16


def test_load_errors_name_the_key(tmp_path):
    from safetensors.torch import load_file, save_file
    drafter = DFlashDrafter(tiny_cfg())
    save_drafter(drafter, tmp_path, dtype=None)
    sd = load_file(tmp_path / "model.safetensors")
    bad = dict(sd)
    bad["layers.0.self_attn.q_proj.weight"] = torch.zeros(3, 3)
    save_file(bad, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"layers\.0\.self_attn\.q_proj\.weight has shape \(3, 3\)"):
        load_drafter(tmp_path)
    bad = dict(sd)
    bad["layers.0.self_attn.qq_proj.weight"] = bad.pop("layers.0.self_attn.q_proj.weight")
    save_file(bad, tmp_path / "model.safetensors")
    with pytest.raises(KeyError, match=r"missing keys \['layers\.0\.self_attn\.q_proj\.weight'\].*qq_proj"):
        load_drafter(tmp_path)
    # released exports sometimes prefix model.: accepted
    save_file({"model." + k: v for k, v in sd.items()}, tmp_path / "model.safetensors")
    load_drafter(tmp_path)
    c = json.loads((tmp_path / "config.json").read_text())
    del c["dflash_config"]["mask_token_id"]
    (tmp_path / "config.json").write_text(json.dumps(c))
    with pytest.raises(ValueError, match="mask_token_id is missing"):
        load_drafter(tmp_path)


def test_target_layer_ids_rule():
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert build_target_layer_ids(40, 5) == [1, 10, 19, 28, 37]
    assert build_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]
    assert build_target_layer_ids(24, 5) == [1, 6, 11, 16, 21]
    assert build_target_layer_ids(30, 5) == [1, 8, 14, 20, 27]  # SmolLM2-135M
    assert build_target_layer_ids(32, 8) == [1, 5, 9, 13, 17, 21, 25, 29]
    assert build_target_layer_ids(32, 5) == [1, 8, 15, 22, 29]  # Qwen3.5-4B
    assert build_target_layer_ids(36, 1) == [18]


def _tokenizer(n_tokens):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    vocab = {f"t{i}": i for i in range(n_tokens)}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")))
    tok.unk_token = "t0"
    return tok


def test_config_from_target():
    from transformers import LlamaConfig, Qwen3Config
    t = Qwen3Config(hidden_size=128, intermediate_size=256, num_hidden_layers=36, num_attention_heads=8,
                    num_key_value_heads=4, head_dim=32, vocab_size=200, rope_theta=1e6, max_position_embeddings=4096)
    c = drafter_config_from_target(t, _tokenizer(150))
    assert (c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == \
        (128, 256, 8, 4, 32)
    assert c.target_layer_ids == [1, 9, 17, 25, 33] and c.num_target_layers == 36
    assert c.mask_token_id == 150  # first unused embedding row = len(tokenizer)
    assert c.rope_theta == 1e6 and c.rope_scaling is None and c.vocab_size == 200
    # no free row: explicit token required, and used
    with pytest.raises(ValueError, match="no free embedding row"):
        drafter_config_from_target(t, _tokenizer(200))
    assert drafter_config_from_target(t, _tokenizer(200), mask_token="t16").mask_token_id == 16
    with pytest.raises(ValueError, match="not a token"):
        drafter_config_from_target(t, _tokenizer(200), mask_token="<nope>")
    # Llama 3.1 style rope scaling is carried over
    l = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=16, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=300, rope_theta=5e5,
                    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    c = drafter_config_from_target(l, _tokenizer(250), num_hidden_layers=3,
                                   layer_types=["sliding_attention"] * 3, sliding_window=64)
    assert c.rope_scaling["rope_type"] == "llama3" and c.target_layer_ids == [1, 7, 13] and c.head_dim == 16


@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 4.0},
                                     {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}])
def test_rope_matches_transformers(scaling):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    cfg = LlamaConfig(hidden_size=512, num_attention_heads=4, rope_theta=5e5, rope_scaling=scaling,
                      max_position_embeddings=131072)
    ref = LlamaRotaryEmbedding(cfg).inv_freq
    torch.testing.assert_close(rope_inv_freq(128, 5e5, scaling), ref, atol=0, rtol=1e-6)
    with pytest.raises(ValueError, match="rope_type='yarn'"):
        rope_inv_freq(128, 5e5, {"rope_type": "yarn", "factor": 2.0})


def test_bf16_cast_keeps_fp32_rope():
    d = DFlashDrafter(tiny_cfg()).to(torch.bfloat16)
    assert d.inv_freq.dtype == torch.float32 and d.layers[0].self_attn.inv_freq is d.inv_freq
    torch.testing.assert_close(d.inv_freq, rope_inv_freq(16, 10000.0), atol=0, rtol=0)


def test_tiny_drafter_overfits_fixed_batch():
    torch.manual_seed(0)
    drafter, tables, batch = _loss_setup(3)
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    losses = []
    for _ in range(150):
        r = dflash_loss(drafter, tables, batch, LossOptions())
        loss = r["loss_sum"] / r["weight_sum"]
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.1 * losses[0], (losses[0], losses[-1])
    assert r["correct_K"].sum() / r["count_K"].sum() > 0.9


def test_target_distribution_terms_and_gradients_by_hand():
    """loss.target_terms on two rows of V = 3, worked out here. Drafter logits (0, ln 2, 0): q =
    (1/4, 1/2, 1/4). Row 0, target p = (0.6, 0.3, 0.1): KL(p || q) = sum p ln(p / q), its gradient
    in the logits q - p = (-0.35, 0.2, 0.15); L1 = 0.35 + 0.2 + 0.15 = 0.7, its gradient
    q_j (s_j - sum_v s_v q_v) with s = sign(q - p) = (-1, 1, 1), sum s q = 0.5: (-0.375, 0.25,
    0.125); the confidence label 1 - L1 / 2 = 0.65 = sum_v min(p_v, q_v). Row 1, p one-hot on
    token 0: KL = -ln q_0 = ln 4 (the CE; 0 ln 0 counts 0), L1 = 2 (1 - q_0) = 1.5, label 0.25."""
    p = torch.tensor([[0.6, 0.3, 0.1], [1.0, 0.0, 0.0]])
    for kd, want, grad in (("kl", [0.6 * math.log(2.4) + 0.3 * math.log(0.6) + 0.1 * math.log(0.4),
                                   math.log(4)], [-0.35, 0.2, 0.15]),
                           ("l1", [0.7, 1.5], [-0.375, 0.25, 0.125])):
        z = torch.tensor([[0.0, math.log(2), 0.0]] * 2, requires_grad=True)
        kd_M, label_M = loss.target_terms(z, p, kd)
        torch.testing.assert_close(kd_M, torch.tensor(want))
        torch.testing.assert_close(label_M, torch.tensor([0.65, 0.25]))
        assert not label_M.requires_grad  # a fixed target for the BCE, as DeepSpec detaches it
        kd_M[0].backward()
        torch.testing.assert_close(z.grad[0], torch.tensor(grad))
        assert torch.isfinite(z.grad).all() and (z.grad[1] == 0).all()
    assert loss.target_terms(z, p, "none")[0] is None


def _teacher_setup(seed, markov_rank=0, confidence_head=False):
    """_loss_setup plus the target's final states [B, S, D] in the batch."""
    drafter, tables, batch = _loss_setup(seed, markov_rank)
    if confidence_head:
        drafter = DFlashDrafter(dataclasses.replace(drafter.cfg, confidence_head=True))
    final = torch.randn(*batch.input_ids_BS.shape, D)
    return drafter, tables, batch._replace(final_BSD=final)


def _teacher_reference(drafter, tables, batch, weighting="decay"):
    """Per row, written out here: the drafter's logits, CE, the target's distribution p from the
    final state at label position - 1 (anchor + k - 1), and the row weights (decay, or D-PACE's
    from the detached CE); -> (logits, ce, p, w, prev) flattened over B N K."""
    K, ids, anchors = drafter.cfg.block_size, batch.input_ids_BS, batch.anchors_BN
    out, labels, valid, decay = _forward(drafter, tables, batch)
    prev = torch.tensor([[[int(ids[b, min(int(a) + max(k - 1, 0), 29)]) for k in range(K)]
                          for a in anchors[b]] for b in range(2)]).view(-1)
    logits = out.reshape(-1, D) @ tables.head_VD.t()
    if drafter.cfg.markov_rank:
        logits = logits + drafter.markov_head(prev)
    ce = F.cross_entropy(logits, labels.reshape(-1), reduction="none")
    at = torch.tensor([[max(int(a) + k - 1, 0) for a in anchors[b] for k in range(K)]
                       for b in range(2)])
    teacher = torch.stack([batch.final_BSD[b, at[b].clamp(max=29)] for b in range(2)]).view(-1, D)
    p = (teacher @ tables.head_VD.t()).softmax(-1)
    w = decay.reshape(-1)
    if weighting == "dpace":
        w = dpace_weights(ce.detach(), valid.reshape(-1).float(), K, 0.5)
    return logits, ce, p, w, prev, out.reshape(-1, D)


@pytest.mark.parametrize("weighting", ["decay", "dpace"])
@pytest.mark.parametrize("kd", ["kl", "l1"])
def test_kd_loss_and_gradients_match_the_formula(kd, weighting):
    """kd with kd_weight 0.3, chunks of 3 blocks: loss_sum = sum_m w_m (0.7 CE_m + 0.3 KD_m), KD
    against the target's distribution at the label's position - 1, written out here; w decay's or
    D-PACE's (from the CE alone); every gradient equals autograd's of that sum. The CE-only loss
    differs, and the statistics (weights, accuracy) are the CE run's."""
    drafter, tables, batch = _teacher_setup(7)
    opts = LossOptions(weighting=weighting, chunk_blocks=3, kd=kd, kd_weight=0.3)
    r, grads = _loss_and_grads(drafter, tables, batch, opts)
    logits, ce, p, w, _, _ = _teacher_reference(drafter, tables, batch, weighting)
    q = logits.softmax(-1)
    kd_M = ((p * (p.log() - q.log())).sum(-1) if kd == "kl" else (q - p).abs().sum(-1))
    ref = (w * (0.7 * ce + 0.3 * kd_M)).sum()
    _same_loss_and_gradients(drafter, r, grads, ref)
    r0 = dflash_loss(drafter, tables, batch, dataclasses.replace(opts, kd="none"))
    assert abs(r0["loss_sum"].item() - r["loss_sum"].item()) > 1e-2
    for key in ("weight_sum", "correct_K", "count_K", "tau_sum"):
        assert torch.equal(r0[key], r[key]), key
    with pytest.raises(ValueError, match="final hidden states"):
        dflash_loss(drafter, tables, batch._replace(final_BSD=None), opts)


def test_confidence_head_loss_labels_and_gradients():
    """A confidence head on a Markov drafter (rank 8): loss_sum = sum_m w_m (CE_m + 0.5 BCE(z_m,
    1 - TV(p_m, q_m))) with z_m = proj([h_m ; markov_w1[previous true token]]), written out here;
    gradients equal autograd's (the label held fixed) and reach the head, markov_w1 and the
    backbone. Labels on hand-made blocks: test_target_distribution_terms_and_gradients_by_hand."""
    drafter, tables, batch = _teacher_setup(8, markov_rank=8, confidence_head=True)
    opts = LossOptions(chunk_blocks=2, confidence_weight=0.5)
    r, grads = _loss_and_grads(drafter, tables, batch, opts)
    logits, ce, p, w, prev, h = _teacher_reference(drafter, tables, batch)
    label = (1 - 0.5 * (logits.softmax(-1) - p).abs().sum(-1)).clamp(0, 1).detach()
    z = drafter.confidence_head.proj(torch.cat([h, drafter.markov_head.markov_w1(prev)], -1))
    bce = F.binary_cross_entropy_with_logits(z.squeeze(-1), label, reduction="none")
    _same_loss_and_gradients(drafter, r, grads, (w * (ce + 0.5 * bce)).sum())
    assert grads["confidence_head.proj.weight"].abs().sum() > 0
    assert grads["confidence_head.proj.bias"] != 0
    assert 0 < float(label[w > 0].min()) and float(label.max()) < 1


@pytest.mark.parametrize("rank,confidence,layers", [(0, False, None), (8, False, None),
                                                    (8, True, ["sliding_attention", "full_attention"])])
def test_num_params_counts_the_built_drafter(rank, confidence, layers):
    """The memory plan's parameter count (from the config alone) is the built drafter's."""
    cfg = DrafterConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=8, vocab_size=50, target_layer_ids=[0, 2, 3],
                        markov_rank=rank, confidence_head=confidence, layer_types=layers,
                        sliding_window=4 if layers else None)
    assert cfg.num_params() == sum(p.numel() for p in DFlashDrafter(cfg).parameters())


def _gru_by_hand(x_TD, w_ih, w_hh):
    """torch's GRU without biases, step by step: gates (r, z, n) in that row order, h_0 = 0."""
    G, h, out = w_hh.shape[1], x_TD.new_zeros(w_hh.shape[1]), []
    for x in x_TD:
        (ir, iz, i_n), (hr, hz, hn) = (x @ w_ih.t()).split(G), (h @ w_hh.t()).split(G)
        r, z = torch.sigmoid(ir + hr), torch.sigmoid(iz + hz)
        h = (1 - z) * torch.tanh(i_n + r * hn) + z * h
        out.append(h)
    return torch.stack(out)


def _domino_setup(seed):
    drafter, tables, batch = _loss_setup(seed)
    torch.manual_seed(seed)
    drafter = DFlashDrafter(dataclasses.replace(drafter.cfg, domino_gru_dim=12, domino_emb_dim=20))
    with torch.no_grad():  # a correction that matters next to the LM head's logits
        drafter.embed_proj[2].weight.normal_(0, 1.0)
    return drafter, tables, batch


@pytest.mark.parametrize("chunk", [0, 3])
@pytest.mark.parametrize("base_weight", [0.0, 0.4, 1.0])
def test_domino_head_loss_and_gradients_match_a_hand_written_gru(base_weight, chunk):
    """A Domino head (GRU 12, MLP 20): offset k's logits = lm_head(h_k) + W2 silu(W1 [h_k ; g_k]),
    g_k the GRU state (written out here, step by step) after the target's embeddings of the true
    tokens at anchor + 0..k-1; loss_sum = sum_k w_k ((1 - b) CE(corrected) + b CE(LM head alone)).
    Every gradient equals autograd's of that sum; at b = 1 the head gets none."""
    drafter, tables, batch = _domino_setup(3)
    K, ids, anchors = drafter.cfg.block_size, batch.input_ids_BS, batch.anchors_BN
    opts = LossOptions(chunk_blocks=chunk, base_weight=base_weight)
    r, grads = _loss_and_grads(drafter, tables, batch, opts)
    out, labels, _, w = _forward(drafter, tables, batch)
    w_ih, w_hh = drafter.prefix_gru.weight_ih_l0, drafter.prefix_gru.weight_hh_l0
    g = []
    for b in range(2):
        for a in anchors[b]:
            toks = [int(ids[b, min(int(a) + j, 29)]) for j in range(K - 1)]
            g.append(torch.cat([torch.zeros(1, 12), _gru_by_hand(tables.embed_VD[toks], w_ih, w_hh)]))
    h = out.reshape(-1, D)
    base = h @ tables.head_VD.t()
    w1, w2 = drafter.embed_proj[0].weight, drafter.embed_proj[2].weight
    fixed = base + F.silu(torch.cat([h, torch.cat(g)], -1) @ w1.t()) @ w2.t()
    ce = [F.cross_entropy(x, labels.reshape(-1), reduction="none") for x in (fixed, base)]
    ref = (((1 - base_weight) * ce[0] + base_weight * ce[1]) * w.reshape(-1)).sum()
    _same_loss_and_gradients(drafter, r, grads, ref)
    head = [n for n in grads if n.startswith(("prefix_gru", "embed_proj"))]
    assert sorted(head) == ["embed_proj.0.weight", "embed_proj.2.weight", "prefix_gru.weight_hh_l0",
                            "prefix_gru.weight_ih_l0"]
    assert all((grads[n].abs().sum() > 0) == (base_weight < 1) for n in head)
    # the statistics count the corrected logits' argmax
    hit = (fixed.argmax(-1) == labels.reshape(-1)) & _forward(drafter, tables, batch)[2].reshape(-1)
    assert r["correct_K"].sum() == hit.sum()


@pytest.mark.parametrize("base_weight", [0.0, 0.4])
def test_domino_shifted_layout_matches_a_hand_written_reference(base_weight):
    """SpecForge's shift_label true, pure_draft_prefix_len 1 (the layout SGLang serves Domino in),
    written out here: block offset j (0..K-1, the anchor's own included) predicts the token at
    anchor+j+1, weighted exp(-j/gamma) where supervised; the GRU reads the target's embeddings of
    the true tokens anchor..anchor+K-1, offset j's state the one after anchor+j; offset 0 keeps
    the LM head's logits, offsets >= 1 add embed_proj([h_j ; g_j]); the blend as in the aligned
    layout. The same weights in the aligned layout give another loss; the statistics count by the
    label's distance from the anchor, and the acceptance estimate runs over offsets 0..K-2."""
    aligned, tables, batch = _domino_setup(3)
    drafter = DFlashDrafter(dataclasses.replace(aligned.cfg, domino_shift_label=True, domino_prefix_len=1))
    drafter.load_state_dict(aligned.state_dict())
    K, gamma, (ids, lm, _, anchors, keep) = drafter.cfg.block_size, 7.0, batch[:5]
    S = ids.shape[1]
    opts = LossOptions(chunk_blocks=3, base_weight=base_weight, gamma=gamma)
    r, grads = _loss_and_grads(drafter, tables, batch, opts)
    out = _forward(drafter, tables, batch)[0]
    w_ih, w_hh = drafter.prefix_gru.weight_ih_l0, drafter.prefix_gru.weight_hh_l0
    g, labels, w = [], [], []
    for b in range(2):
        for n, a in enumerate(anchors[b].tolist()):
            toks = [int(ids[b, min(a + j, S - 1)]) for j in range(K)]
            g.append(_gru_by_hand(tables.embed_VD[toks], w_ih, w_hh))  # K states, offset j's after anchor+j
            for j in range(K):
                p = a + j + 1
                ok = bool(keep[b, n]) and p < S and bool(lm[b, p])
                labels.append(int(ids[b, min(p, S - 1)]))
                w.append(math.exp(-j / gamma) if ok else 0.0)
    h, labels, w = out.reshape(-1, D), torch.tensor(labels), torch.tensor(w)
    base = h @ tables.head_VD.t()
    w1, w2 = drafter.embed_proj[0].weight, drafter.embed_proj[2].weight
    on = (torch.arange(len(labels)) % K >= 1).float()[:, None]  # offset 0: the LM head alone
    fixed = base + on * (F.silu(torch.cat([h, torch.cat(g)], -1) @ w1.t()) @ w2.t())
    ce = [F.cross_entropy(x, labels, reduction="none") for x in (fixed, base)]
    ref = (((1 - base_weight) * ce[0] + base_weight * ce[1]) * w).sum()
    _same_loss_and_gradients(drafter, r, grads, ref)
    assert r["weight_sum"].item() == pytest.approx(w.sum().item(), rel=1e-6)
    hit = ((fixed.argmax(-1) == labels) & (w > 0)).view(-1, K)
    assert r["count_K"].tolist() == [0.0, *(w > 0).view(-1, K).sum(0).float().tolist()]
    assert r["correct_K"].tolist() == [0.0, *hit.sum(0).float().tolist()]
    ok = (w > 0).view(-1, K)[:, :K - 1]
    run = torch.cumprod((hit[:, :K - 1] | ~ok).float(), -1)
    assert r["tau_sum"].item() == pytest.approx(((1 + (run * ok).sum(-1)) * keep.view(-1)).sum().item())
    r_aligned, _ = _loss_and_grads(aligned, tables, batch, opts)
    assert not torch.allclose(r_aligned["loss_sum"], r["loss_sum"])


def test_domino_needs_one_head():
    with pytest.raises(ValueError, match="markov_rank 0"):
        dataclasses.replace(tiny_cfg(), domino_gru_dim=8, markov_rank=4)
    with pytest.raises(ValueError, match="base_weight"):
        LossOptions(base_weight=1.5)
