"""The fused LM head + weighted cross-entropy: model.plain_head_loss's loss and gradients from one
hand-written autograd function (HeadCE), faster and lighter, and the FP8 LM head it can run on.

Why fused: HeadCE's forward computes each chunk's CE and, from the same [rows, V] logits, their
gradient w * (softmax - onehot); the second LM-head matmul turns that into the input gradient,
and only this [rows, D] result is kept for the backward, which scales it. The logits exist once.
Plain autograd keeps every chunk's logits until the backward, or (model.py, under checkpoint)
recomputes them there: a third LM-head matmul. New losses start in model.py's plain path; a loss
moves here once it is worth the speed.

The target-distribution term (KL or L1 to the target's softmax) and the confidence head's label
moved here too (_kd_chunk): on the plain path they cost +56-66% of the 27B step (BENCHMARKS.md),
the target's logits computed twice and every [rows, V] term kept for autograd.

Used by train.py when Config.loss_impl is "fused" (the default): LossOptions(head_loss=head_loss).
Test: python -m pytest -q tests/test_model.py -k "fused or fp8" (equal to the plain path)
"""

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from attention import compile_on_first_call
from model import dpace_weights

E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max


def _rows_fp8(x):
    """x in e4m3 with one fp32 scale per row (x ~ x8 * scale): the operand form of
    torch._scaled_mm's rowwise mode (also the FP8 target's, target.Float8Frozen)."""
    scale = x.abs().amax(-1, keepdim=True).float().clamp(min=1e-12) / E4M3_MAX
    return (x.float() / scale).to(torch.float8_e4m3fn), scale


def _ce_chunk(logits_MV, labels_M, w_M, dpace=None, fp8=False):
    """Weighted CE of one chunk and its gradient w.r.t. the logits, in fp32, returned in the
    logits' dtype: d(sum_m w_m CE_m)/dlogits = w * (softmax - onehot). dpace = (K, alpha): w_M is
    the 0/1 mask and the weights are D-PACE's (model.dpace_weights) over this chunk's whole blocks
    of K rows. fp8: the gradient in e4m3 with a scale per row instead. No entry of a row exceeds
    its label's own, w * (1 - p_label) (the other probabilities sum to 1 - p_label), so the scale
    comes from the CE, with no pass for the row maxima. Compiled on CUDA into a few fused passes
    over [M, V]."""
    x = logits_MV.float()
    lse = torch.logsumexp(x, dim=-1)
    ce = lse - x.gather(1, labels_M[:, None]).squeeze(1)
    if dpace is not None:
        w_M = dpace_weights(ce.detach(), w_M, *dpace)
    grad = torch.exp(x - lse[:, None]) * w_M[:, None]
    grad = grad.scatter_add(1, labels_M[:, None], -w_M[:, None])
    scale = ((w_M.abs() * -torch.expm1(-ce.clamp(min=0))).clamp(min=1e-12)[:, None] / E4M3_MAX
             if fp8 else None)
    return (ce * w_M).sum(), x.argmax(-1) == labels_M, _grad_out(grad, scale, logits_MV.dtype)


def _grad_out(grad, scale, dtype):
    """The logits' fp32 gradient as HeadCE's second matmul takes it: in `dtype`, or (scale [M, 1])
    in e4m3 with that scale per row."""
    if scale is None:
        return grad.to(dtype)
    return (grad / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def _kd_chunk(logits_MV, teacher_MV, labels_M, w_M, dpace=None, fp8=False, kd=("none", 0.0)):
    """_ce_chunk with the target's distribution p = softmax(teacher logits) beside the CE, as
    model.chunk_loss computes it: per row (1 - lam) CE + lam KD (kd = (kl | l1 | none, lam); none:
    the CE alone, p only for the label) -> (sum_m w_m (that), correct, the gradient w.r.t. the
    logits, the confidence label 1 - TV(p, q) (model.target_terms), the row weights w). Per row, the
    gradient over w is (1 - lam) (q - onehot) + lam g_KD with kl = KL(p || q): q - p and
    l1 = sum_v |q_v - p_v|: q (s - <s, q>), s = sign(q - p). fp8: a scale per row from the row's
    largest entry (the CE's bound on it no longer holds)."""
    x = logits_MV.float()
    lse = torch.logsumexp(x, dim=-1)
    logq = x - lse[:, None]
    q = logq.exp()
    ce = lse - x.gather(1, labels_M[:, None]).squeeze(1)
    if dpace is not None:
        w_M = dpace_weights(ce.detach(), w_M, *dpace)
    p = torch.softmax(teacher_MV.float(), dim=-1)
    diff = q - p
    l1 = diff.abs().sum(-1)
    kd, lam = kd[0], (kd[1] if kd[0] != "none" else 0.0)
    if kd == "kl":
        kd_M, g_kd = (torch.xlogy(p, p) - p * logq).sum(-1), diff
    elif kd == "l1":
        sign = torch.sign(diff)
        kd_M, g_kd = l1, q * (sign - (sign * q).sum(-1, keepdim=True))
    else:
        kd_M, g_kd = torch.zeros_like(ce), torch.zeros_like(q)
    grad = ((1 - lam) * q + lam * g_kd) * w_M[:, None]
    grad = grad.scatter_add(1, labels_M[:, None], -(1 - lam) * w_M[:, None])
    scale = grad.abs().amax(-1, keepdim=True).clamp(min=1e-12) / E4M3_MAX if fp8 else None
    loss = (((1 - lam) * ce + lam * kd_M) * w_M).sum()
    return (loss, x.argmax(-1) == labels_M, _grad_out(grad, scale, logits_MV.dtype),
            (1 - 0.5 * l1).clamp(0, 1), w_M)


_ce_chunk_compiled = compile_on_first_call(_ce_chunk, dynamic=False)  # fixed shapes per run
_kd_chunk_compiled = compile_on_first_call(_kd_chunk, dynamic=False)
# one pass for the row maxima, one to scale and cast
_rows_fp8_compiled = compile_on_first_call(_rows_fp8, dynamic=False)


class Head:
    """The LM head [V, D] as it is, behind Float8Head's interface: HeadCE has one loop for both."""
    fp8 = False

    def __init__(self, head_VD):
        self.head_VD = head_VD

    def logits(self, x_MD):
        return x_MD @ self.head_VD.t()

    def input_grad(self, g_MV, dtype):
        return (g_MV @ self.head_VD).to(dtype)


class Float8Head:
    """The frozen LM head [V, D] for HeadCE's two matmuls in FP8 (e4m3, a scale per row of each
    operand): kept twice, scaled along D for the logits and along V for the input gradient,
    2 bytes per weight in all, as in bf16."""
    fp8 = True

    def __init__(self, head_VD):
        self.w_VD, self.s_V1 = _rows_fp8(head_VD)
        self.w_DV, self.s_D1 = _rows_fp8(head_VD.t().contiguous())

    def _mm(self, x8_s, w, s_w, dtype):  # x8 [M, k] @ w.t(): w [n, k] row-major, w.t() column-major
        return torch._scaled_mm(x8_s[0], w.t(), scale_a=x8_s[1], scale_b=s_w.t(),
                                out_dtype=torch.bfloat16).to(dtype)

    def logits(self, x_MD):
        x8_s = (_rows_fp8_compiled if x_MD.is_cuda else _rows_fp8)(x_MD)
        return self._mm(x8_s, self.w_VD, self.s_V1, x_MD.dtype)

    def input_grad(self, g8_s, dtype):  # g8_s: the gradient in e4m3 with its row scales (_ce_chunk)
        return self._mm(g8_s, self.w_DV, self.s_D1, dtype)

    def logits_autograd(self, x_MD):
        """`logits` in torch autograd, for model.py's plain path: x rounded per row to e4m3 as
        `logits` rounds it, its gradient passing straight through (HeadCE's input gradient ignores
        that rounding too), times the e4m3 head (exact in bf16) and its row scales, written in
        bf16 as torch._scaled_mm writes it. Its backward differs from HeadCE's only in HeadCE's e4m3
        rounding of the logits' gradient and of the head's copy scaled along V."""
        x8, s_M1 = _rows_fp8(x_MD.detach())
        x_MD = x_MD + ((x8.float() * s_M1).to(x_MD.dtype) - x_MD).detach()
        logits_MV = (x_MD @ self.w_VD.to(x_MD.dtype).t()) * self.s_V1.t()
        return logits_MV.to(torch.bfloat16).to(x_MD.dtype)


@dataclass(frozen=True)
class HeadTask:
    """What HeadCE needs beside the tensors it differentiates (Function.apply: positional only)."""
    head: Head | Float8Head
    labels_M: torch.Tensor
    w_M: torch.Tensor  # the weights, or under D-PACE the 0/1 mask they are computed on
    prev_M: torch.Tensor  # the Markov head's input (model.Rows.prev_M)
    chunk_rows: int
    dpace: tuple | None = None  # (K, alpha): D-PACE's weights, per chunk (_ce_chunk)
    # the target's final states [M, D] at the rows' positions - 1: its distribution beside the CE
    # (_kd_chunk), or None (the CE alone)
    teacher_MD: torch.Tensor | None = None
    kd: str = "none"  # none | kl | l1 (model.LossOptions.kd)
    kd_weight: float = 0.9


class HeadCE(torch.autograd.Function):
    """Frozen LM head + weighted cross-entropy, chunked over rows, the input gradient computed in
    the forward: each chunk's [rows, V] logits exist once, never recomputed (no third LM-head
    matmul), never all in fp32. The head gets no gradient. A Markov head (w1, w2 [V, r]; None
    without one) adds its bias w2(w1[prev]) and gets its gradients. With task.teacher_MD the
    target's logits join each chunk (_kd_chunk), and the confidence labels and row weights come
    back beside the loss and the argmax hits (zeros without it)."""

    @staticmethod
    def forward(ctx, out_MD, w1_Vr, w2_Vr, task):
        head, markov, teacher = task.head, w1_Vr is not None, task.teacher_MD is not None
        if teacher:
            fn = _kd_chunk_compiled if out_MD.is_cuda else _kd_chunk
            ce = partial(fn, kd=(task.kd, task.kd_weight))
        else:
            ce = _ce_chunk_compiled if out_MD.is_cuda else _ce_chunk
        loss, grad = torch.zeros((), device=out_MD.device), torch.empty_like(out_MD)
        M = out_MD.shape[0]
        correct = torch.empty(M, dtype=torch.bool, device=out_MD.device)
        label_M, w_M = (torch.zeros(M, device=out_MD.device) for _ in range(2))  # teacher's only
        if markov:
            g1, g2 = (torch.zeros_like(w, dtype=torch.float32) for w in (w1_Vr, w2_Vr))
        for i in range(0, M, task.chunk_rows):
            j = slice(i, i + task.chunk_rows)
            logits = head.logits(out_MD[j])
            if markov:
                e_Mr = F.embedding(task.prev_M[j], w1_Vr)
                logits = logits + e_Mr @ w2_Vr.t()
            if teacher:
                loss_j, correct[j], g, label_M[j], w_M[j] = ce(
                    logits, head.logits(task.teacher_MD[j]), task.labels_M[j], task.w_M[j],
                    task.dpace, head.fp8)
            else:
                loss_j, correct[j], g = ce(logits, task.labels_M[j], task.w_M[j], task.dpace,
                                           head.fp8)
            loss += loss_j
            grad[j] = head.input_grad(g, grad.dtype)
            if markov:  # the Markov factors' gradients, under fp8 from the dequantized rows
                g = g[0].to(logits.dtype) * g[1].to(logits.dtype) if head.fp8 else g
                g2 += (g.t() @ e_Mr).float()
                g1.index_add_(0, task.prev_M[j], (g @ w2_Vr).float())
        ctx.save_for_backward(grad, *((g1.to(w1_Vr.dtype), g2.to(w2_Vr.dtype)) if markov else ()))
        ctx.mark_non_differentiable(correct, label_M, w_M)
        return loss, correct, label_M, w_M

    @staticmethod
    def backward(ctx, g_loss, *_):
        grad, *markov = ctx.saved_tensors
        g1, g2 = (g * g_loss.to(g.dtype) for g in markov) if markov else (None, None)
        return grad * g_loss.to(grad.dtype), g1, g2, None


def head_loss(rows, head, drafter, opts):
    """model.plain_head_loss's (loss_sum, correct_M) through HeadCE: the same loss and gradients
    (tests/test_model.py states the tolerance), the target-distribution term (opts.kd) and the
    confidence head's label computed beside the CE in the same pass over each chunk's logits; the
    confidence head's BCE (a [D + r] -> 1 projection) in autograd here. head: the LM head [V, D]
    or a Float8Head."""
    if opts.extra is not None:
        raise ValueError("LossOptions.extra: the fused loss computes its own terms only; use the "
                         "plain path (train.py --loss_impl=plain, or LossOptions(head_loss=None))")
    cfg = drafter.cfg
    if cfg.domino_gru_dim:
        raise ValueError("a Domino head trains on the plain path (train.py --loss_impl=plain, or "
                         "LossOptions(head_loss=None)): the fused loss has no term for it")
    teacher = opts.kd != "none" or cfg.confidence_head
    if teacher and rows.teacher_MD is None:
        raise ValueError("kd / confidence_head need the target's final hidden states "
                         "(LossBatch.final_BSD)")
    m = drafter.markov_head if cfg.markov_rank else None
    dpace = (rows.K, opts.alpha) if opts.weighting == "dpace" else None
    task = HeadTask(head if isinstance(head, Float8Head) else Head(head), rows.labels_M,
                    rows.valid_M.float() if dpace else rows.decay_M, rows.prev_M, rows.chunk_rows,
                    dpace, rows.teacher_MD if teacher else None, opts.kd, opts.kd_weight)
    w1, w2 = (m.markov_w1.weight, m.markov_w2.weight) if m else (None, None)
    loss, correct, label_M, w_M = HeadCE.apply(rows.out_MD, w1, w2, task)
    if cfg.confidence_head:  # as model.chunk_loss: + confidence_weight * BCE, under the row weights
        z_M = drafter.confidence_logits(rows.out_MD, rows.prev_M)
        bce_M = F.binary_cross_entropy_with_logits(z_M, label_M, reduction="none")
        loss = loss + opts.confidence_weight * (w_M * bce_M).sum()
    return loss, correct
