"""The DFlash mask rule, its BlockMask and its two executors, against a reference written here from the spec."""

import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention

from attention import (TILE, attend, build_masks, compile_count, configure_compile, dense_mask, dflash_block_mask,
                       dflash_block_masks)
from loss import sample_anchors


def reference_mask(anchors, keep, S, K, window):
    """Independent statement of the mask rule (the layout in attention.py's docstring), one query row at a time."""
    B, N = anchors.shape
    m = torch.zeros(B, 1, N * K, S + N * K, dtype=torch.bool)
    for b in range(B):
        for n in range(N):
            if not keep[b, n]:
                continue
            p = int(anchors[b, n])
            for j in range(K):
                row = n * K + j
                lo = 0 if window is None else max(0, p + j - window + 1)
                m[b, 0, row, lo:p] = True  # context strictly before the anchor
                hi = K if window is None else j + 1  # whole block, or causal on sliding layers
                m[b, 0, row, S + n * K:S + n * K + hi] = True
    return m


def random_case(B, S, N, K, seed, pad=2):
    """Sorted random anchors, some overlapping (closer than K), the last `pad` blocks invalid."""
    g = torch.Generator().manual_seed(seed)
    anchors = torch.sort(torch.randint(0, S - 1, (B, N), generator=g), dim=1).values
    anchors[:, 1] = anchors[:, 0] + 1  # force an overlap
    keep = torch.ones(B, N, dtype=torch.bool)
    keep[:, N - pad:] = False
    anchors[:, N - pad:] = 0
    return anchors, keep


@pytest.mark.parametrize("window", [None, 7, 64])
@pytest.mark.parametrize("K", [4, 16, 10])
def test_mask_matches_reference(window, K):
    anchors, keep = random_case(B=2, S=97, N=9, K=K, seed=K)
    got = dense_mask(anchors, keep, 97, K, window)
    assert torch.equal(got, reference_mask(anchors, keep, 97, K, window))
    # invalid blocks see nothing; every valid row sees at least its anchor token
    rows = got.any(-1)[:, 0].view(2, 9, K)
    assert torch.equal(rows, keep[:, :, None].expand_as(rows))


def tiles(m, reduce):
    """Dense mask [B,1,Q,KV] -> per 128x128 tile any/all, [B,1,QT,KVT] (padding counts as allowed for 'all')."""
    B, _, Q, KV = m.shape
    QT, KVT = -(-Q // TILE), -(-KV // TILE)
    pad = torch.zeros(B, 1, QT * TILE, KVT * TILE, dtype=torch.bool)
    pad[..., :Q, :KV] = m
    if reduce == "all":  # padded q rows/kv cols of a tile never make it non-full... except past KV (flex bounds)
        pad[..., Q:, :] = True
    t = pad.view(B, 1, QT, TILE, KVT, TILE)
    return t.any(3).any(-1) if reduce == "any" else t.all(3).all(-1)


def to_dense_full(bm):
    QT, KVT = bm.full_kv_indices.shape[-2:]
    out = torch.zeros(bm.full_kv_indices.shape[:2] + (QT, KVT), dtype=torch.bool)
    for b in range(out.shape[0]):
        for q in range(QT):
            out[b, 0, q, bm.full_kv_indices[b, 0, q, :bm.full_kv_num_blocks[b, 0, q]].long()] = True
    return out


@pytest.mark.parametrize("window", [None, 200])
@pytest.mark.parametrize("S,N,K", [(300, 20, 16), (700, 40, 16), (513, 30, 10)])
def test_block_mask_tiles_match_reference(window, S, N, K):
    anchors, keep = random_case(B=2, S=S, N=N, K=K, seed=S)
    ref = reference_mask(anchors, keep, S, K, window)
    bm = dflash_block_mask(anchors, keep, S, K, window)
    assert bm.seq_lengths == (N * K, S + N * K)
    assert torch.equal(bm.to_dense().bool(), tiles(ref, "any"))  # partial + full == tiles with any allowed key
    full = to_dense_full(bm)
    if window is None:
        assert full.any(), "sorted anchors must leave some fully visible context tiles"
    # full tiles are exactly the tiles whose every (real) entry is allowed, never the ragged last KV tile
    ref_full = tiles(ref, "all")
    if (S + N * K) % TILE:
        ref_full[..., -1] = False
    assert torch.equal(full, ref_full)


@pytest.mark.parametrize("window", [None, 24])
def test_flex_equals_sdpa_cpu(window):
    torch.manual_seed(0)
    B, S, N, K, H, Hkv, d = 2, 150, 12, 16, 4, 2, 16
    anchors, keep = random_case(B, S, N, K, seed=1)
    q = torch.randn(B, H, N * K, d)
    k, v = torch.randn(2, B, Hkv, S + N * K, d).unbind(0)
    bm = dflash_block_mask(anchors, keep, S, K, window)
    flex = flex_attention(q, k, v, block_mask=bm, enable_gqa=True)  # eager flex: forward only on CPU
    sdpa = attend(q, k, v, dense_mask(anchors, keep, S, K, window))
    assert torch.isfinite(sdpa).all()
    assert (sdpa.view(B, H, N, K, d)[~keep[:, None, :, None, None].expand(B, H, N, K, d)] == 0).all()
    torch.testing.assert_close(flex, sdpa, atol=1e-5, rtol=1e-5)


def test_sdpa_invalid_rows_have_zero_finite_grads():
    B, S, N, K = 1, 40, 4, 4
    anchors, keep = random_case(B, S, N, K, seed=3, pad=2)
    q = torch.randn(B, 2, N * K, 8, requires_grad=True)
    k = torch.randn(B, 2, S + N * K, 8, requires_grad=True)
    v = torch.randn(B, 2, S + N * K, 8, requires_grad=True)
    out = attend(q, k, v, dense_mask(anchors, keep, S, K))
    out.sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert (q.grad[:, :, (N - 2) * K:] == 0).all()  # padded blocks: no gradient flows through them


def test_build_masks_per_layer_type():
    anchors, keep = random_case(1, 50, 4, 4, seed=4)
    m = build_masks(anchors, keep, 50, 4, ["sliding_attention", "full_attention", "sliding_attention"], 8, "sdpa")
    assert set(m) == {"sliding_attention", "full_attention"}
    assert torch.equal(m["sliding_attention"], reference_mask(anchors, keep, 50, 4, 8))
    assert torch.equal(m["full_attention"], reference_mask(anchors, keep, 50, 4, None))
    anchors, keep = random_case(1, 1000, 24, 16, seed=4)  # long enough that the two types' tiles differ
    flex = build_masks(anchors, keep, 1000, 16, ["full_attention", "sliding_attention"], 200, "flex")
    dense = {w: tiles(reference_mask(anchors, keep, 1000, 16, w), "any").int() for w in (200, None)}
    assert not torch.equal(dense[200], dense[None])
    for t, w in (("sliding_attention", 200), ("full_attention", None)):  # each type its own window, in any order
        assert torch.equal(flex[t].to_dense(), dense[w]), t
    with pytest.raises(ValueError, match="backend"):
        build_masks(anchors, keep, 50, 4, ["full_attention"], None, "dense")


def test_compiled_flex_no_recompile_after_warmup_cpu():
    """The compiled kernel the trainer uses: after two warm-up lengths (static, then dynamic), new sequence
    lengths and new anchors reuse the compiled graph. CPU compile is forward-only, which is all we need here."""
    configure_compile()
    torch.manual_seed(0)
    B, N, K, H, d = 1, 8, 16, 2, 16

    def step(S):
        lm = torch.zeros(B, S)
        lm[:, S // 3:] = 1
        anchors, keep = sample_anchors(lm, N)
        bm = dflash_block_mask(anchors, keep, S, K, None)
        q = torch.randn(B, H, N * K, d)
        k, v = torch.randn(2, B, H, S + N * K, d).unbind(0)
        out = attend(q, k, v, bm)
        torch.testing.assert_close(out, attend(q, k, v, dense_mask(anchors, keep, S, K)), atol=1e-5, rtol=1e-5)

    step(256)
    step(384)
    warm = compile_count()
    for S in (512, 640, 256, 896):
        step(S)
    assert compile_count() == warm


def test_compiled_block_mask_equals_eager_no_recompiles():
    """The compiled BlockMask construction (CUDA's default; also runs on CPU) gives the same tables, forward and
    transposed, as the eager one, for both layer types, one at a time or both in one call (as build_masks does on
    CUDA), and new lengths; after two lengths nothing recompiles."""
    configure_compile()
    names = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
             "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")
    warm = None
    for i, S in enumerate((300, 430, 700, 513, 1000)):
        anchors, keep = random_case(B=2, S=S, N=24, K=16, seed=S)
        both = dflash_block_masks(anchors, keep, S, 16, (None, 200), compiled=True)
        for window, m in zip((None, 200), both):
            a, b = (dflash_block_mask(anchors, keep, S, 16, window, compiled=c) for c in (False, True))
            assert tuple(b.seq_lengths) == tuple(m.seq_lengths) == a.seq_lengths == (24 * 16, S + 24 * 16)
            for n in names:
                assert torch.equal(getattr(a, n), getattr(b, n)) and torch.equal(getattr(a, n), getattr(m, n)), (S, n)
            assert torch.equal(b.to_dense(), tiles(reference_mask(anchors, keep, S, 16, window), "any").int())
        if i == 1:
            warm = compile_count()
    assert compile_count() == warm


def test_compiled_block_mask_single_kv_tile_compiles_once_more():
    """Dynamo specializes a size of 1, so a length whose KV (S + N*K) fits one 128-token tile has its own graph: the
    first length crossing between 1 and >= 2 KV tiles compiles once per window value, then nothing does. Real
    shapes never have one KV tile (the demo's N*K alone is 4096); tests/test_gpu.py keeps N*K >= 128 for that."""
    configure_compile()
    counts = []
    for S in (48, 64, 32, 80, 96, 48, 300):  # N*K = 64: KV tiles 1, 1, 1, 2, 2, 1, 3
        anchors, keep = random_case(B=2, S=S, N=16, K=4, seed=S)
        for window in (None, 16):
            dflash_block_mask(anchors, keep, S, 4, window, compiled=True)
        counts.append(compile_count())
    assert counts[1:3] == [counts[0]] * 2 and counts[3] == counts[0] + 2 and counts[4:] == [counts[3]] * 3, counts



@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_grouped_decode_sdpa_equals_repeated_heads(kind):
    """attention.grouped_decode_sdpa at a decoding step (one query, 6 query heads on 2 key heads,
    rows padded on the left by different amounts) equals attention over the key/value heads
    repeated per query head, written out here, with a boolean or an additive padding mask; a
    prefill step (T > 1) is transformers' own path, unchanged."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from attention import grouped_decode_sdpa
    torch.manual_seed(0)
    B, H, G, L, D = 3, 6, 2, 9, 8
    q, k, v = torch.randn(B, H, 1, D), torch.randn(B, G, L, D), torch.randn(B, G, L, D)
    keep = torch.arange(L)[None, :] >= torch.tensor([0, 2, 5])[:, None]  # [B, L]
    mask = keep[:, None, None, :]
    if kind == "additive":
        mask = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = H // G, False  # as transformers sets them
    out, _ = grouped_decode_sdpa(module, q, k, v, mask, scaling=0.3)
    kr, vr = (x.repeat_interleave(H // G, dim=1) for x in (k, v))  # head h reads key head h // 3
    w = ((q @ kr.transpose(-1, -2)) * 0.3).masked_fill(~keep[:, None, None, :], float("-inf"))
    want = (w.softmax(-1) @ vr).transpose(1, 2)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    q3 = torch.randn(B, H, 4, D)
    m3 = torch.ones(B, 1, 4, L, dtype=torch.bool)
    got, _ = grouped_decode_sdpa(module, q3, k, v, m3, scaling=0.3)
    torch.testing.assert_close(got, sdpa_attention_forward(module, q3, k, v, m3, scaling=0.3)[0])
