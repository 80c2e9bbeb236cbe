"""The training objective, in one home: the DFlash loss (arXiv 2602.06036 §4.2, Eq. 4) and every
optional arm on top of it, each written once in torch autograd, and the bridge that runs them fast.

- The arms' heads (their weights are drafter weights, saved in its checkpoint; model.DFlashDrafter
  builds them from DrafterConfig): DSpark's Markov head and confidence head (deepseek-ai/DeepSpec),
  Domino's GRU correction (arXiv 2605.29707).
- A micro-batch's blocks: anchors, labels, the decay and D-PACE (arXiv 2605.18810) weights,
  `draft_rows` (the drafter's forward over every block -> Rows).
- `chunk_loss`: THE loss. Given one chunk's logits it writes every term: the CE under its weights,
  the Markov and Domino biases and Domino's blend, the target-distribution term (KL / L1) and the
  confidence head's BCE, and a user term (LossOptions.extra). A new loss is an edit here, or an
  `extra` from outside; it is fast at once, with no gradient written by hand.
- `HeadBridge`: what makes chunk_loss fast (the pattern of torchtitan's chunked loss). The frozen
  LM head's [rows, V] logits are the costly part: per chunk the bridge computes them once (bf16,
  or the FP8 head's e4m3 matmul), runs chunk_loss forward and backward at once by autograd with
  respect to the logits, the chunk's differentiable row inputs and the drafter's parameters, turns
  the logits' gradient into the input gradient by the head's second matmul, and keeps only these
  gradients for the backward. The logits exist once and are never recomputed; one chunk's exist at
  a time. chunk_loss is compiled per chunk on CUDA.

Test: python -m pytest -q tests/test_model.py -k "loss or bridge or markov or kd or confidence or domino or fp8"
"""

from dataclasses import dataclass, fields, replace
from typing import Callable, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from attention import build_masks, compile_on_first_call
from fp8 import Float8Head, Head


# ----------------------------------------------------------------------------- the arms' heads
class MarkovHead(nn.Module):
    """DSpark's sequential correction (deepseek-ai/DeepSpec): logits_k = lm_head(h_k) + w2(w1[token_{k-1}]). Training
    feeds the true previous token (draft_rows); drafting goes left to right
    (model.DFlashDrafter.draft_tokens)."""

    def __init__(self, vocab_size, rank):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)

    def forward(self, prev_ids):
        return self.markov_w2(self.markov_w1(prev_ids))


class ConfidenceHead(nn.Module):
    """DSpark's acceptance predictor (deepseek-ai/DeepSpec `AcceptRatePredictor`): per drafted
    position a logit whose sigmoid estimates the chance the target accepts that token given the
    prefix was accepted; the engines plan how many drafted tokens to verify from its cumulative
    product. Input [h ; markov_w1[previous token]], weights `confidence_head.proj.{weight,bias}`."""

    def __init__(self, input_dim):
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)

    def forward(self, h_MD, markov_MR):
        x = torch.cat([h_MD, markov_MR.to(h_MD.dtype)], -1)  # [M, D + r]
        return self.proj(x).float().squeeze(-1)


def domino_head(hidden, gru_dim, emb_dim, vocab):
    """Domino's causal correction (SpecForge `DominoDraftModel`) -> (prefix_gru, embed_proj):
    offset k's logits get embed_proj([h_k ; g_k]) (DFlashDrafter.domino_bias), g_k the state of a
    GRU (no biases) that has read the target's embeddings of the block's tokens at offsets 0..k-1,
    embed_proj = Linear(D + G, E), SiLU, Linear(E, V). Training feeds the true tokens (draft_rows);
    drafting goes left to right (DFlashDrafter.draft_tokens). The drafter holds the two under
    these flat names, as the released checkpoints do: prefix_gru.weight_{ih,hh}_l0,
    embed_proj.{0,2}.weight."""
    return (nn.GRU(hidden, gru_dim, num_layers=1, batch_first=True, bias=False),
            nn.Sequential(nn.Linear(hidden + gru_dim, emb_dim, bias=False), nn.SiLU(),
                          nn.Linear(emb_dim, vocab, bias=False)))


# ----------------------------------------------------------------------------- a micro-batch's blocks (paper §4.2, Eq. 4)
def sample_anchors(loss_mask_BS, num_anchors, generator=None):
    """Uniform without replacement among positions p with loss_mask[p] and loss_mask[p+1] (a response token whose
    first label is supervised), sorted, padded to num_anchors with keep=False: fixed shapes, no recompiles, no sync."""
    B, S = loss_mask_BS.shape
    lm = loss_mask_BS.bool()
    cand = torch.zeros_like(lm)
    cand[:, :-1] = lm[:, :-1] & lm[:, 1:]
    keys = torch.rand(B, max(S, num_anchors), device=lm.device, generator=generator)
    keys[:, :S][~cand] = 2.0  # non-candidates sort last
    keys[:, S:] = 2.0
    top = keys.topk(num_anchors, dim=1, largest=False)
    keep = top.values < 2.0
    anchors = torch.where(keep, top.indices, max(S, num_anchors))  # padding sorts after every real anchor
    anchors, order = anchors.sort(dim=1)
    keep = keep.gather(1, order)
    return torch.where(keep, anchors, 0), keep


def block_labels(input_ids_BS, loss_mask_BS, anchors_BN, keep_BN, K, gamma, shift=0):
    """Labels at the SAME position (shift 0, the paper's): block offset k predicts input_ids[anchor+k];
    offset 0 (the clean anchor) is unsupervised. shift 1 (SpecForge's shift_label, the layout SGLang
    serves Domino in): offset k predicts input_ids[anchor+k+1], offset 0 included. Positions >= S
    are unsupervised; the loss mask is read at the label position, not the anchor. Returns labels
    [B,N,K], valid [B,N,K] bool, weights [B,N,K] = valid * exp(-(j-1)/gamma) where j = k + shift is
    the label's distance from the anchor (w = 1 for the first drafted token, Eq. 4)."""
    (B, S), N = input_ids_BS.shape, anchors_BN.shape[1]
    k = torch.arange(K, device=input_ids_BS.device)
    pos_BNK = anchors_BN[:, :, None] + k + shift
    idx = pos_BNK.clamp(max=S - 1).view(B, N * K)
    labels = input_ids_BS.gather(1, idx).view(B, N, K)
    valid = (keep_BN[:, :, None] & (pos_BNK < S) & (k + shift > 0)
             & loss_mask_BS.gather(1, idx).view(B, N, K).bool())
    decay = torch.exp(-(k + shift - 1).clamp(min=0).float() / gamma)
    return labels, valid, valid.float() * decay


def dpace_weights(ce_M, valid_M, K, alpha):
    """D-PACE (arXiv 2605.18810) loss weights, detached: with q_i the drafter's probability of label i, smoothed
    q~_i = (1 - alpha) q_i + alpha, and 1 where nothing is supervised (the chain passes through), offset k weighs
    w_k = sum over supervised m >= k of prod_{i<=m} q~_i: the expected accepted length that getting k right buys."""
    q = torch.where(valid_M > 0, (1 - alpha) * torch.exp(-ce_M) + alpha, 1.0).view(-1, K)
    run = torch.cumprod(q, -1) * valid_M.view(-1, K)
    return run.flip(-1).cumsum(-1).flip(-1).reshape(-1) * valid_M


class Tables(NamedTuple):
    """The frozen target's tables that the drafter borrows (not drafter weights)."""
    embed_VD: torch.Tensor  # embeds the block tokens
    head_VD: object  # the LM head [V, D], or an fp8.Float8Head (fp8_head: its e4m3 copies)


class LossBatch(NamedTuple):
    """One micro-batch as the objective reads it: B sequences of S tokens, N blocks each."""
    input_ids_BS: torch.Tensor
    loss_mask_BS: torch.Tensor  # 1 where a token is supervised (the response)
    hidden_BSC: torch.Tensor  # the target's states at target_layer_ids, concatenated: C = ids * D
    anchors_BN: torch.Tensor  # sample_anchors
    keep_BN: torch.Tensor
    # the target's FINAL hidden states (after its final norm) [B, S, D]: through the LM head, its
    # next-token distribution (kd, the confidence head's label); None when neither is used
    final_BSD: torch.Tensor | None = None


@dataclass(frozen=True)
class LossOptions:
    """How dflash_loss weighs and computes the objective (train.loss_options: from Config)."""
    weighting: str = "decay"  # over block offsets: decay, exp(-(k-1)/gamma) (Eq. 4) | dpace
    gamma: float = 7.0  # decay's scale
    alpha: float = 0.5  # dpace's smoothing of the drafter's confidence, (1 - alpha) q + alpha
    chunk_blocks: int = 64  # blocks per LM-head chunk (0: one sequence's blocks)
    backend: str = "sdpa"  # attention: sdpa (any device) | flex (compiled BlockMask kernel, CUDA)
    # extra(logits_MV, weights_M, rows) -> a term added to the chunk's loss: a new logit-dependent
    # loss without editing this file (rows: the chunk's Rows; logits with the heads' biases)
    extra: Callable | None = None
    # the target's distribution p as a target beside the CE (needs LossBatch.final_BSD). kd: none |
    # kl = KL(p || q) | l1 = sum_v |q_v - p_v| (= 2 TV, DSpark's L1); per row (1 - kd_weight) CE +
    # kd_weight KD, under the row's weight (decay or D-PACE)
    kd: str = "none"
    kd_weight: float = 0.9  # with l1: DSpark's CE 0.1 + L1 0.9 (DeepSpec's recipes)
    # the confidence head's BCE, added under the same row weights (DSpark: 1.0)
    confidence_weight: float = 1.0
    # the confidence head reads detached features (the drafter's hidden state and the Markov
    # table's row): its BCE then trains the head alone and cannot move what the drafter drafts
    confidence_detached: bool = False
    # a Domino head's blend, per row (1 - base_weight) CE(corrected logits) + base_weight CE(the
    # LM head's alone); train.domino_base_weight decays it over the run, as SpecForge does
    base_weight: float = 0.0

    def __post_init__(self):
        if self.weighting not in ("decay", "dpace") or self.backend not in ("sdpa", "flex"):
            raise ValueError(f"LossOptions: weighting={self.weighting!r} (decay | dpace), "
                             f"backend={self.backend!r} (sdpa | flex)")
        if self.kd not in ("none", "kl", "l1") or not 0 <= self.kd_weight <= 1:
            raise ValueError(f"LossOptions: kd={self.kd!r} (none | kl | l1), "
                             f"kd_weight={self.kd_weight} (in [0, 1])")
        if not 0 <= self.base_weight <= 1:
            raise ValueError(f"LossOptions: base_weight={self.base_weight} (in [0, 1])")


@dataclass(frozen=True)
class Rows:
    """The drafted rows of one micro-batch, flattened in block order: row m = (b, n, k),
    M = B*N*K, a block's K rows consecutive. Every tensor field has one entry per row."""
    out_MD: torch.Tensor  # the drafter's normed hidden states (differentiable)
    labels_M: torch.Tensor  # the token each row predicts (block_labels)
    valid_M: torch.Tensor  # bool: supervised
    decay_M: torch.Tensor  # valid * exp(-(k-1)/gamma)
    prev_M: torch.Tensor  # the true token before the row's: the Markov head's input
    # the Domino head's GRU state after the block's true tokens before the row's [M, G] (offset
    # 0: zeros, unsupervised); None without one
    prefix_MG: torch.Tensor | None
    # the target's final state at the row's label position - 1 (whose next-token distribution is
    # the label's), [M, D]; None without LossBatch.final_BSD
    teacher_MD: torch.Tensor | None
    K: int  # block size
    chunk_rows: int  # rows per LM-head chunk, whole blocks
    shift: int = 0  # the layout: offset k's label is the token at anchor+k+shift (block_labels)

    def take(self, j):
        """These rows for slice j (of whole blocks)."""
        return replace(self, **{f.name: getattr(self, f.name)[j] for f in fields(self)
                                if isinstance(getattr(self, f.name), torch.Tensor)})


def draft_rows(drafter, embed_VD, batch, opts):
    """The drafter's forward over every block of the micro-batch, and each row's label and weight
    -> Rows. A block is [anchor token, mask, ..., mask] at absolute positions anchor + k; its rows
    predict the tokens after the anchor as block_labels lays them out (the drafter's
    domino_shift_label: one position later)."""
    ids_BS, mask_BS, hidden_BSC, anchors_BN, keep_BN, final_BSD = batch
    cfg, (B, S), N, dev = drafter.cfg, ids_BS.shape, anchors_BN.shape[1], ids_BS.device
    K, shift = cfg.block_size, int(cfg.domino_shift_label)
    anchor_BN = ids_BS.gather(1, anchors_BN)
    block_BNK = torch.full((B, N, K), cfg.mask_token_id, device=dev, dtype=ids_BS.dtype)
    block_BNK[:, :, 0] = torch.where(keep_BN, anchor_BN, cfg.mask_token_id)
    # positions may run past S-1: they place the block, they never index a label
    pos_BQ = (anchors_BN[:, :, None] + torch.arange(K, device=dev)).view(B, N * K)  # Q = N*K
    x_BQD = F.embedding(block_BNK.view(B, N * K), embed_VD).to(hidden_BSC.dtype)
    masks = build_masks(anchors_BN, keep_BN, S, K, cfg.layer_types, cfg.sliding_window,
                        opts.backend)
    out_BQD = drafter(x_BQD, hidden_BSC, pos_BQ, masks)
    labels, valid, decay = block_labels(ids_BS, mask_BS, anchors_BN, keep_BN, K, opts.gamma, shift)
    # the true token before each row's label: the anchor, then the labels (shift 0: offset 0's is
    # unsupervised, any token does)
    prev = torch.cat([anchor_BN[:, :, None], labels[:, :, :-1]], -1)
    prefix = None
    if cfg.domino_gru_dim:  # the GRU reads the true tokens from the anchor on, up to the one before
        # the last row's label; a row's state is the one after the token before its label
        # (shift 0: offset 0 has none, zeros, unsupervised)
        e = F.embedding(prev[:, :, 1 - shift:].reshape(B * N, K - 1 + shift), embed_VD)
        g = drafter.prefix_gru(e.to(out_BQD.dtype))[0]  # [B*N, K-1+shift, G]
        if not shift:
            g = torch.cat([g.new_zeros(B * N, 1, g.shape[-1]), g], 1)
        prefix = g.reshape(B * N * K, -1)
    teacher = None
    if final_BSD is not None:  # a label at position p is the target's prediction at p-1
        at_BQ = (pos_BQ + shift - 1).clamp(0, S - 1)  # shift 0's offset 0 (unsupervised): anchor-1
        teacher = final_BSD.gather(1, at_BQ[:, :, None].expand(-1, -1, final_BSD.shape[-1]))
        teacher = teacher.reshape(B * N * K, -1)
    return Rows(out_MD=out_BQD.reshape(B * N * K, -1), labels_M=labels.view(-1),
                valid_M=valid.view(-1), decay_M=decay.view(-1), prev_M=prev.view(-1), prefix_MG=prefix,
                teacher_MD=teacher, K=K, chunk_rows=(opts.chunk_blocks or N) * K, shift=shift)


# ----------------------------------------------------------------------------- the one loss
def target_terms(logits_MV, p_MV, kd):
    """Per row, from the drafter's logits and the target's distribution p (fp32, detached)
    -> (KD term or None, the confidence head's label). KD: kl = sum_v p_v (log p_v - log q_v),
    l1 = sum_v |q_v - p_v|. Label: 1 - TV(p, q) = clamp(1 - l1 / 2, 0, 1), the chance that
    rejection sampling accepts a draft from q; detached (DeepSpec `_compute_accept_rate_3d`)."""
    logq_MV = F.log_softmax(logits_MV.float(), -1)
    l1_M = (logq_MV.exp() - p_MV).abs().sum(-1)
    label_M = (1 - 0.5 * l1_M.detach()).clamp(0, 1)
    if kd == "kl":
        return (torch.xlogy(p_MV, p_MV) - p_MV * logq_MV).sum(-1), label_M  # 0 log 0 = 0
    return (l1_M if kd == "l1" else None), label_M


def chunk_loss(rows, logits_MV, teacher_MV, drafter, opts):
    """THE loss of one chunk of whole blocks, every term written here once -> (its sum, correct_M).
    logits: the frozen LM head's [M, V] for rows.out_MD; teacher: the LM head's logits of the
    target's own final states (rows.teacher_MD), or None when no term reads them. Terms: the
    Markov or Domino head's bias on the logits, the weights (decay's, or D-PACE's from the detached
    CE), sum_m w_m CE_m, Domino's blend with the LM head's own CE, the target-distribution term,
    the confidence BCE and opts.extra. HeadBridge differentiates it; compiled per chunk on CUDA."""
    cfg = drafter.cfg
    if cfg.markov_rank:
        logits_MV = logits_MV + drafter.markov_head(rows.prev_M)
    base_MV = logits_MV
    if cfg.domino_gru_dim:
        bias_MV = drafter.domino_bias(rows.out_MD, rows.prefix_MG).to(logits_MV.dtype)
        if cfg.domino_prefix_len:  # pure_draft_prefix_len: the leading offsets keep the LM head's alone
            k_M = torch.arange(bias_MV.shape[0], device=bias_MV.device) % rows.K
            bias_MV = bias_MV * (k_M >= cfg.domino_prefix_len)[:, None].to(bias_MV.dtype)
        logits_MV = logits_MV + bias_MV
    ce_M = F.cross_entropy(logits_MV.float(), rows.labels_M, reduction="none")  # fp32
    if opts.weighting == "dpace":
        w_M = dpace_weights(ce_M.detach(), rows.valid_M.float(), rows.K, opts.alpha)
    else:
        w_M = rows.decay_M
    per_row_M = ce_M
    if cfg.domino_gru_dim:  # Domino's blend: the LM head alone is supervised too (also at weight
        # 0, where it adds nothing: one graph for the whole run, its weight an input, not a constant)
        base_ce_M = F.cross_entropy(base_MV.float(), rows.labels_M, reduction="none")
        per_row_M = (1 - opts.base_weight) * ce_M + opts.base_weight * base_ce_M
    if teacher_MV is not None:
        p_MV = torch.softmax(teacher_MV.float(), -1)  # the target's distribution, fp32
        kd_M, label_M = target_terms(logits_MV, p_MV, opts.kd)
        if kd_M is not None:
            per_row_M = (1 - opts.kd_weight) * per_row_M + opts.kd_weight * kd_M
        if cfg.confidence_head:
            h_MD, e_MR = rows.out_MD, drafter.markov_head.markov_w1(rows.prev_M)
            if opts.confidence_detached:
                h_MD, e_MR = h_MD.detach(), e_MR.detach()
            z_M = drafter.confidence_head(h_MD, e_MR)
            bce_M = F.binary_cross_entropy_with_logits(z_M, label_M, reduction="none")
            per_row_M = per_row_M + opts.confidence_weight * bce_M
    loss = (w_M * per_row_M).sum()
    if opts.extra is not None:
        loss = loss + opts.extra(logits_MV, w_M, rows)
    return loss, logits_MV.argmax(-1) == rows.labels_M


_chunk_loss_compiled = compile_on_first_call(chunk_loss, dynamic=False)  # fixed shapes per run


# ----------------------------------------------------------------------------- the bridge
@dataclass(frozen=True)
class BridgeJob:
    """What HeadBridge needs beside the tensors it differentiates (Function.apply: positional)."""
    rows: "Rows"
    head: Head | Float8Head
    drafter: nn.Module
    opts: LossOptions
    names: tuple  # the Rows fields passed as differentiable inputs, out_MD first
    params: tuple  # the drafter's trainable parameters, passed after them


class HeadBridge(torch.autograd.Function):
    """chunk_loss over every chunk of rows, its backward run inside the forward: per chunk the
    LM head's logits once, autograd of chunk_loss with respect to them, the chunk's row inputs and
    the parameters, the input gradient by the head's second matmul. Only the gradients are kept
    (row inputs [M, ...], parameters in fp32); the backward scales them by the loss's gradient."""

    @staticmethod
    def forward(ctx, job, *inputs):
        rows, n, dev = job.rows, len(job.names), job.rows.out_MD.device
        run = _chunk_loss_compiled if dev.type == "cuda" else chunk_loss
        M, teacher = rows.labels_M.shape[0], rows.teacher_MD is not None
        loss, correct = torch.zeros((), device=dev), torch.empty(M, dtype=torch.bool, device=dev)
        g_rows = [torch.zeros_like(t) for t in inputs[:n]]
        g_params = [None] * len(job.params)
        for i in range(0, M, rows.chunk_rows):
            j = slice(i, i + rows.chunk_rows)
            leaves = {k: t[j].detach().requires_grad_() for k, t in zip(job.names, inputs)}
            chunk = replace(rows.take(j), **leaves)
            logits_MV = job.head.logits(chunk.out_MD.detach()).requires_grad_()
            teacher_MV = job.head.logits(chunk.teacher_MD) if teacher else None
            with torch.enable_grad():
                loss_j, correct[j] = run(chunk, logits_MV, teacher_MV, job.drafter, job.opts)
                wrt = (logits_MV, *leaves.values(), *job.params)
                g_logits, *grads = torch.autograd.grad(loss_j, wrt, allow_unused=True)
            loss += loss_j.detach()
            for g_all, g in zip(g_rows, grads[:n]):
                if g is not None:
                    g_all[j] = g
            if g_logits is not None and job.names[:1] == ("out_MD",):
                g_rows[0][j] += job.head.input_grad(g_logits, g_rows[0].dtype)
            for k, g in enumerate(grads[n:]):
                if g is not None:
                    g_params[k] = g.float() if g_params[k] is None else g_params[k] + g.float()
        g_params = [g if g is None else g.to(p.dtype) for g, p in zip(g_params, job.params)]
        ctx.save_for_backward(*g_rows, *g_params)
        ctx.mark_non_differentiable(correct)
        return loss, correct

    @staticmethod
    def backward(ctx, g_loss, _):
        return None, *(g if g is None else g * g_loss.to(g.dtype) for g in ctx.saved_tensors)


def head_loss(rows, head, drafter, opts):
    """The LM head and chunk_loss over all rows, through HeadBridge -> (loss_sum, correct_M).
    head: the LM head [V, D] or a fp8.Float8Head."""
    teacher = opts.kd != "none" or drafter.cfg.confidence_head
    if teacher and rows.teacher_MD is None:
        raise ValueError("kd / confidence_head need the target's final hidden states "
                         "(LossBatch.final_BSD)")
    rows = rows if teacher else replace(rows, teacher_MD=None)
    names = tuple(f.name for f in fields(rows) if isinstance(getattr(rows, f.name), torch.Tensor)
                  and getattr(rows, f.name).requires_grad)
    params = tuple(p for p in drafter.parameters() if p.requires_grad)
    # the blend's weight changes every step: a tensor, so that the compiled chunk_loss reads it as
    # an input instead of compiling anew for each value
    opts = replace(opts, base_weight=torch.tensor(float(opts.base_weight), device=rows.out_MD.device))
    job = BridgeJob(rows, head if isinstance(head, Float8Head) else Head(head), drafter, opts,
                    names, params)
    return HeadBridge.apply(job, *(getattr(rows, k) for k in names), *params)


def block_stats(loss_sum, correct_M, rows, keep_BN, opts):
    """dflash_loss's additive terms (see there) from the loss sum and each row's argmax hit."""
    shift = rows.shift  # the rows that draft: offsets 1..K-1, or 0..K-2 when shifted
    valid = rows.valid_M.view(*keep_BN.shape, rows.K)  # B N K
    correct = correct_M.view(valid.shape) & valid
    # training-time acceptance estimate over the K-1 rows that draft: accepted = sum_j prod_{i<=j}
    # correct_i over supervised positions, unsupervised ones count as correct inside the product
    # (SpecForge compute_accept_len), tau = 1 + accepted
    drafted = slice(1 - shift, rows.K - shift)
    run = torch.cumprod((correct | ~valid)[:, :, drafted].float(), dim=-1)
    accepted = (run * valid[:, :, drafted]).sum(-1)
    blocks = keep_BN.sum().float()
    by_distance = (shift, 0)  # correct_K / count_K by the label's distance from the anchor, 0..K-1+shift
    return dict(
        loss_sum=loss_sum,
        weight_sum=blocks if opts.weighting == "dpace" else rows.decay_M.sum().detach(),
        correct_K=F.pad(correct.sum((0, 1)).float(), by_distance),
        count_K=F.pad(valid.sum((0, 1)).float(), by_distance),
        tau_sum=((1 + accepted) * keep_BN).sum(), blocks=blocks,
    )


def dflash_loss(drafter, tables, batch, opts=LossOptions()):
    """DFlash objective for one micro-batch (Tables, LossBatch, LossOptions). Returns additive terms
    so that normalization stays exact across ranks and micro-batches: loss_sum (differentiable),
    weight_sum, per-offset correct_K / count_K, tau_sum / blocks. The caller divides: loss =
    loss_sum / (global weight_sum). weighting "decay": weight_sum is the sum of the weights;
    "dpace": the kept blocks (dividing by the D-PACE weights' own sum would cancel the credit they
    give; a count summed over all ranks and micro-batches cannot depend on the split)."""
    rows = draft_rows(drafter, tables.embed_VD, batch, opts)
    loss_sum, correct_M = head_loss(rows, tables.head_VD, drafter, opts)
    return block_stats(loss_sum, correct_M, rows, batch.keep_BN, opts)


# ----------------------------------------------------------------------------- what the arms ask of the rest
def final_states(cfg, dcfg):
    """Does this run need the target's final hidden states (after its final norm)? For the
    target-distribution term (Config.kd_loss) and the confidence head's label."""
    return cfg.kd_loss != "none" or dcfg.confidence_head


def domino_bytes(dcfg, rows, chunk, b):
    """A Domino head's memory on a drafter rank (ranks.memory_estimate), b bytes an element: the
    GRU's inputs, gates and states and the MLP's per block row; per chunk of rows its logits, their
    sum with the LM head's, the base CE's fp32 softmax."""
    G, E, D, V = dcfg.domino_gru_dim, dcfg.domino_emb_dim, dcfg.hidden_size, dcfg.vocab_size
    return bool(G) * (rows * (D + 5 * G + 2 * E) * b + chunk * V * (2 * b + 4))
