"""FP8 operands for frozen matmuls: e4m3 with one fp32 scale per row (torch._scaled_mm's rowwise
mode), and the frozen LM head in that form. The frozen target's FP8 linears (target.Float8Frozen)
and the loss's FP8 LM head (loss.py, train.py --fp8_head) both use `rows_fp8`. The drafter's own
trainable linears go through torchao.float8 instead (model.to_float8).

Test: python -m pytest -q tests/test_model.py -k fp8
"""

import torch

from attention import compile_on_first_call

E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max


def rows_fp8(x):
    """x in e4m3 with one fp32 scale per row (x ~ x8 * scale)."""
    scale = x.abs().amax(-1, keepdim=True).float().clamp(min=1e-12) / E4M3_MAX
    return (x.float() / scale).to(torch.float8_e4m3fn), scale


rows_fp8_compiled = compile_on_first_call(rows_fp8, dynamic=False)  # one pass for the maxima, one to cast


class Head:
    """The frozen LM head [V, D] as it is, behind Float8Head's interface (loss.HeadBridge has one
    loop for both): logits = x @ head^T; the input gradient = g @ head."""
    fp8 = False

    def __init__(self, head_VD):
        self.head_VD = head_VD

    def logits(self, x_MD):
        return x_MD @ self.head_VD.t()

    def input_grad(self, g_MV, dtype):
        return (g_MV.to(self.head_VD.dtype) @ self.head_VD).to(dtype)


class Float8Head:
    """The frozen LM head [V, D] for both of the loss's LM-head matmuls in FP8 (e4m3, a scale per
    row of each operand): kept twice, scaled along D for the logits and along V for the input
    gradient, 2 bytes per weight in all, as in bf16. The logits are written in bf16."""
    fp8 = True

    def __init__(self, head_VD):
        self.w_VD, self.s_V1 = rows_fp8(head_VD)
        self.w_DV, self.s_D1 = rows_fp8(head_VD.t().contiguous())

    def _mm(self, x_MK, w, s_w, dtype):  # x [M, k] @ w.t(): w [n, k] row-major, w.t() column-major
        x8, s_x = (rows_fp8_compiled if x_MK.is_cuda else rows_fp8)(x_MK)
        return torch._scaled_mm(x8, w.t(), scale_a=s_x, scale_b=s_w.t(),
                                out_dtype=torch.bfloat16).to(dtype)

    def logits(self, x_MD):
        return self._mm(x_MD, self.w_VD, self.s_V1, x_MD.dtype)

    def input_grad(self, g_MV, dtype):
        """The logits' gradient [M, V] rounded per row to e4m3, times the head's copy scaled along V."""
        return self._mm(g_MV, self.w_DV, self.s_D1, dtype)
