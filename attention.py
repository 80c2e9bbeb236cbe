"""The DFlash training attention: who may look at whom, and two executors of that one rule.

Layout. For a batch row with S context tokens and N anchored blocks of K tokens:
  queries  Q = N*K rows    [block_0 | block_1 | ... | block_{N-1}]     (context is never a query)
  keys    KV = S + N*K     [context 0..S-1 | block_0 | ... | block_{N-1}]
Query (block n, offset j) with anchor p sees
  - context keys kv < p, STRICTLY (at inference the anchor's own target feature does not exist yet);
  - its own block: all of it on full-attention layers (bidirectional), offsets <= j on sliding layers (causal);
  - on sliding layers the context is also window-bounded: kv >= p + j - (W - 1) (SpecForge/vLLM semantics);
  - nothing at all if the block is padding (keep=False): such rows give exact zeros, never NaN.

Executors:
  - CUDA: compiled `flex_attention` with a BlockMask built straight from the sorted anchors (`dflash_block_mask`):
    a few small tensor ops on [B, Q/128, KV/128] tiles (one compiled graph), no dense Q x KV mask, no sync.
  - CPU: the same rule as a dense boolean mask fed to `scaled_dot_product_attention` (flex has no CPU backward).
Both executors evaluate the same `dflash_mask_mod`, so they cannot disagree on the rule.

Test: python -m pytest -q tests/test_attention.py
"""

import functools

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend
from torch.nn.attention.flex_attention import BlockMask, flex_attention

TILE = 128  # flex_attention's default BlockMask granularity (rows and columns)

# SDPA backends for decoding (eval.py, data.py's regeneration): all but cuDNN, which plans on the host for each new
# q/k/v/mask shape, and decoding grows the key length every step (~3x slower on an H200, BENCHMARKS.md).
NO_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH, SDPBackend.OVERRIDEABLE]


def grouped_decode_sdpa(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA attention (its attention-function signature: query [B, H, T, D], key and
    value [B, G, L, D] -> ([B, T, H, D], None)) where a decoding step of a grouped-query model does
    not copy the KV cache: the r = H / G query heads that share key head g become r query rows
    of g (q [B, G, r, D], the padding mask [B, 1, 1, L], boolean or additive, repeated over them),
    and one SDPA call attends with the cache as it is. transformers' own SDPA path repeats every
    key and value head r times when the batch has a padding mask (the memory-efficient kernel has
    no GQA): on an H200, SmolLM2-135M (r = 3) at 256 rows, 43% of a step's GPU time
    (docs/LOG.md). Everything else (a prefill, no mask, no grouping) goes to transformers' path."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    B, H, T, D = query.shape
    G, L = key.shape[1], key.shape[2]
    if T != 1 or G == H or attention_mask is None or attention_mask.shape[1] != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    r = H // G
    mask = attention_mask[:, :, :, :L].expand(B, 1, 1, L).repeat(1, 1, r, 1)  # [B, 1, r, L]
    out = F.scaled_dot_product_attention(query.reshape(B, G, r, D), key, value, attn_mask=mask,
                                         scale=kwargs.get("scaling"))
    return out.reshape(B, H, 1, D).transpose(1, 2).contiguous(), None


def compile_on_first_call(fn, **options):
    """torch.compile(fn, **options), made when first called. Making the handle imports inductor:
    ~0.9 s of CPU per process that a CPU run never uses (the CPU tests start ~100 processes)."""
    handle = []

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if not handle:
            handle.append(torch.compile(fn, **options))
        return handle[0](*args, **kwargs)
    return call


# ----------------------------------------------------------------------------- the rule
def dflash_mask_mod(anchors_BN, keep_BN, S, K, window=None):
    """Mask rule as a flex `mask_mod(b, h, q_idx, kv_idx) -> bool`. Also works on broadcast aranges.
    S is a 0-d integer tensor (or int): as a tensor it is an input of the compiled kernel, not a constant,
    so a new sequence length does not force a new specialization of the closure."""
    N = anchors_BN.shape[1]

    def mask_mod(b, h, q_idx, kv_idx):
        n, j = (q_idx // K).clamp(max=N - 1), q_idx % K  # Q padded to whole tiles: padded rows reuse the last block
        p, is_ctx = anchors_BN[b, n], kv_idx < S
        ctx = is_ctx & (kv_idx < p)
        blk = ~is_ctx & ((kv_idx - S) // K == n)
        if window is not None:
            ctx = ctx & (kv_idx >= p + j - (window - 1))
            blk = blk & ((kv_idx - S) % K <= j)
        return keep_BN[b, n] & (ctx | blk)

    return mask_mod


def dense_mask(anchors_BN, keep_BN, S, K, window=None):
    """The rule evaluated everywhere: bool [B, 1, N*K, S+N*K]. CPU/SDPA path and tests only (O(Q*KV) memory)."""
    (B, N), dev = anchors_BN.shape, anchors_BN.device
    b = torch.arange(B, device=dev).view(B, 1, 1, 1)
    q = torch.arange(N * K, device=dev).view(1, 1, -1, 1)
    kv = torch.arange(S + N * K, device=dev).view(1, 1, 1, -1)
    return dflash_mask_mod(anchors_BN, keep_BN, S, K, window)(b, 0, q, kv)


# -------------------------------------------------- BlockMask from the anchors, without evaluating the rule per element
def _row_intervals(anchors_BN, keep_BN, S, K, window, Q_pad):
    """Every query row's allowed keys are two intervals, [ctx_lo, ctx_hi) and [blk_lo, blk_hi).
    Returns four int64 tensors [B, Q_pad]; empty intervals (padding blocks) are [0, 0)."""
    B, N = anchors_BN.shape
    q = torch.arange(Q_pad, device=anchors_BN.device)
    n, j = (q // K).clamp(max=N - 1), q % K  # same clamp as the mask_mod, so padded rows agree with the kernel
    p = anchors_BN[:, n]  # [B, Q_pad], also ctx_hi
    ctx_lo = (p + j - (window - 1)).clamp(min=0) if window is not None else torch.zeros_like(p)
    blk_lo = (S + n * K).expand(B, -1)
    blk_hi = blk_lo + (j + 1 if window is not None else K)
    keep, zero = keep_BN[:, n], torch.zeros_like(p)
    return [torch.where(keep, t, zero) for t in (torch.minimum(ctx_lo, p), p, blk_lo, blk_hi)]


def _tiles_to_ordered(tiles_BQT):
    """bool [B, QT, KVT] -> (num [B,1,QT] int32, indices [B,1,QT,KVT] int32), used tiles first, ascending."""
    KVT = tiles_BQT.shape[-1]
    col = torch.arange(KVT, device=tiles_BQT.device)
    order = torch.sort(torch.where(tiles_BQT, col, col + KVT), dim=-1).indices
    return tiles_BQT.sum(-1, dtype=torch.int32).unsqueeze(1), order.to(torch.int32).unsqueeze(1)


def _block_mask(anchors_BN, keep_BN, S_t, K, KV, window, mask_mod):
    """The DFlash BlockMask over KV = S + N*K keys from its tile tables. A KV tile is 'partial' if
    any row of the Q tile may see any key in it (union of the rows' intervals, by a difference
    array), and 'full' if every row sees all of it (intersection of intervals), so the kernel skips
    mask evaluation there. Pure tensor ops, no host sync; from_kv_blocks also derives the transposed
    (per KV tile) tables of the backward."""
    B, dev = anchors_BN.shape[0], anchors_BN.device
    Q = anchors_BN.shape[1] * K
    QT, KVT = -(-Q // TILE), -(-KV // TILE)  # query tiles, key tiles
    lo_hi = _row_intervals(anchors_BN, keep_BN, S_t, K, window, QT * TILE)
    diff = torch.zeros(B, QT * (KVT + 1), dtype=torch.int32, device=dev)
    qtile = (torch.arange(QT * TILE, device=dev) // TILE).expand(B, -1)
    start = torch.arange(KVT, device=dev) * TILE
    full_BQT = torch.zeros(B, QT, KVT, dtype=torch.bool, device=dev)
    for lo, hi in (lo_hi[0:2], lo_hi[2:4]):
        # union: +1 at the first tile of each non-empty interval, -1 after its last tile, cumsum > 0
        nonempty = (hi > lo).int()
        diff.scatter_add_(1, qtile * (KVT + 1) + lo // TILE, nonempty)
        diff.scatter_add_(1, qtile * (KVT + 1) + (hi - 1).clamp(min=0) // TILE + 1, -nonempty)
        # intersection: tile c is full if, for every row, one interval covers [c*TILE, (c+1)*TILE)
        lo_max, hi_min = lo.view(B, QT, TILE).amax(-1, keepdim=True), hi.view(B, QT, TILE).amin(-1, keepdim=True)
        full_BQT |= (start >= lo_max) & (start + TILE <= hi_min)
    any_BQT = diff.view(B, QT, KVT + 1).cumsum(-1)[..., :KVT] > 0
    tables = (*_tiles_to_ordered(any_BQT & ~full_BQT), *_tiles_to_ordered(full_BQT))
    return BlockMask.from_kv_blocks(*tables, BLOCK_SIZE=TILE, mask_mod=mask_mod, seq_lengths=(Q, KV))


def _block_masks(anchors_BN, keep_BN, S_t, K, KV, windows, mask_mods):
    return [_block_mask(anchors_BN, keep_BN, S_t, K, KV, w, m) for w, m in zip(windows, mask_mods)]


# On CUDA one compiled graph for all the layer types' masks of a step: eager, ~60 small kernel launches per type the GPU
# waits for at the start of every step (BENCHMARKS.md). Dynamic shapes: one graph per tuple of window values, whatever
# the length (a single KV tile, S + N*K <= 128, is specialized: one more). The mask_mod closures are made outside and
# passed in, as with a compiled create_block_mask.
_block_masks_compiled = compile_on_first_call(_block_masks, dynamic=True)


def dflash_block_masks(anchors_BN, keep_BN, S, K, windows, compiled=None):
    """Exact BlockMasks for the DFlash rule, one per window in `windows` (None: full attention), built from row
    intervals in O(B * Q) + O(B * QT * KVT): no dense Q x KV mask, no create_block_mask. Anchors need not be sorted
    for correctness; sorting them (sample_anchors does) keeps each Q tile's visible context a short prefix, which is
    where the speed is. compiled: default on CUDA tensors; True works on CPU too (tests compare both)."""
    Q, S_t = anchors_BN.shape[1] * K, torch.as_tensor(S, device=anchors_BN.device)
    build = _block_masks_compiled if (anchors_BN.is_cuda if compiled is None else compiled) else _block_masks
    mask_mods = [dflash_mask_mod(anchors_BN, keep_BN, S_t, K, w) for w in windows]
    return build(anchors_BN, keep_BN, S_t, K, S + Q, tuple(windows), mask_mods)


def dflash_block_mask(anchors_BN, keep_BN, S, K, window=None, compiled=None):
    return dflash_block_masks(anchors_BN, keep_BN, S, K, [window], compiled)[0]


def build_masks(anchors_BN, keep_BN, S, K, layer_types, window, backend):
    """{layer type: its mask} for each distinct type: a BlockMask ("flex") or a dense bool [B,1,Q,KV] ("sdpa")."""
    if backend not in ("flex", "sdpa"):
        raise ValueError(f"attention backend must be 'flex' or 'sdpa', got {backend!r}")
    types = sorted(set(layer_types))
    windows = [window if t == "sliding_attention" else None for t in types]
    masks = (dflash_block_masks(anchors_BN, keep_BN, S, K, windows) if backend == "flex" else
             [dense_mask(anchors_BN, keep_BN, S, K, w) for w in windows])
    return dict(zip(types, masks))


# ----------------------------------------------------------------------------- executors
# The compiled flex kernel, once per process (one per GPU: no compiled code is shared between threads); lazy.
flex_compiled = compile_on_first_call(flex_attention)


def configure_compile(recompile_limit=16):
    """Make a recompile storm loud: past the limit dynamo would silently run flex eagerly, materializing
    the full Q x KV score matrix (out of memory at training shapes); with fail_on_recompile_limit_hit it raises."""
    import torch._dynamo
    torch._dynamo.config.recompile_limit = recompile_limit
    torch._dynamo.config.fail_on_recompile_limit_hit = True


def compile_count():
    """Graphs compiled by dynamo in this process so far. Steady-state training must not move it."""
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]


def attend(q_BHQd, k_BHkvd, v_BHkvd, mask):
    """Attention of block queries over [context; blocks] keys. GQA: H query heads share H/Hkv K/V heads.
    mask is a BlockMask (compiled flex, CUDA) or a dense bool [B,1,Q,KV] (SDPA, any device)."""
    if isinstance(mask, BlockMask):  # inside a compiled layer: the plain op, traced into that graph
        flex = flex_attention if torch.compiler.is_compiling() else flex_compiled
        return flex(q_BHQd, k_BHkvd, v_BHkvd, block_mask=mask, enable_gqa=True)
    # SDPA on a row with no allowed key returns NaN; let such rows see everything, then zero them
    row_ok = mask.any(-1, keepdim=True)  # [B,1,Q,1]
    out = F.scaled_dot_product_attention(q_BHQd, k_BHkvd, v_BHkvd, attn_mask=mask | ~row_ok, enable_gqa=True)
    return out * row_ok
