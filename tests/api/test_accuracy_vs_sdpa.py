"""The PyTorch API's bf16 accuracy against torch's own SDPA math path, the comparator FlashAttention-2 is measured
against (docs/validation.md, "The softmax scale" and "Where the backward's error comes from").

The comparator is ``aten._scaled_dot_product_attention_math`` in its default mode
(``allow_fp16_bf16_reduction_math_sdp(False)``): it upcasts bf16 q, k, v to float32, computes the forward and its
autograd backward in float32 and rounds o and each gradient to bf16 once. Its error is the floor of any
implementation with bf16 outputs. Errors are relative Frobenius norms against float64 computed from the same
bf16-rounded inputs.
"""
import math

import pytest
import torch

import nki_attn

D = 128
SCALE = D ** -0.5  # 0.0884: not a power of two


def _grads(fn, q, k, v, dy, dtype):
    """o, dq, dk, dv of ``fn(q, k, v)`` ``[b, h, s, d]`` computed from leaves cast to ``dtype``, in float64."""
    leaves = [x.to(dtype).detach().requires_grad_(True) for x in (q, k, v)]
    o = fn(*leaves)
    o.backward(dy.to(dtype))
    return [t.detach().double() for t in (o, *(x.grad for x in leaves))]


@pytest.mark.parametrize("causal", [False, True])
def test_backward_is_within_one_rounding_of_torch_sdpa_math(causal):
    # FlashAttention-2's backward, and ours through the PyTorch API (mixed_precision=True in both kernels), round
    # to bf16 where torch's float32 path does not: P as the PV and dV operand and dS as the dK and dQ operand.
    # For dq = scale dS K and dk = scale dS^T Q the only extra rounding is dS's: each element's relative
    # rounding error has the same rms (2^-8 / sqrt(12) times the mantissa factor) as that of the output's
    # elements, both spread smoothly over several binades, and the sum over keys (or queries) adds them with
    # random signs, so their relative contribution to the Frobenius norm equals the output rounding's: the
    # expected ratio to the comparator is sqrt(2). (D from the bf16 o adds a share that falls as 1 / (a row's
    # keys): nothing without a mask; with a causal mask the backward sums D exactly on the rows of the first
    # 128-key chunk, which carry nearly all of it, tests/kernels/test_bwd_exact_d.py.) The
    # float64 rounding model of docs/validation.md gives 1.41-1.43 at this head dim. Sampling: the ratio of two
    # root-mean-squares over n = heads * seqlen rows (rows counted as independent) spreads by 1/sqrt(n); three
    # of those. Bound sqrt(2) (1 + 3 / sqrt(1024)) = 1.547. A backward that also computed dS from the bf16 P
    # (the kernel's own mixed_precision=False) measures 1.67-1.76 and fails, as would any further rounding of
    # dS or a bf16 partial sum of dq or dk. o = P V / l and dv = P^T dO have P's rounding as their one extra, by
    # the same argument: the same bound.
    h, s = 4, 256
    g = torch.Generator().manual_seed(3)
    q, k, v, dy = (torch.randn(1, h, s, D, generator=g, dtype=torch.float64).bfloat16() for _ in range(4))

    def sdpa_math(*x):
        return torch.ops.aten._scaled_dot_product_attention_math(*x, None, 0.0, causal, scale=SCALE)[0]
    ref = _grads(sdpa_math, q, k, v, dy, torch.float64)
    was = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(False)
    try:
        torch_f32 = _grads(sdpa_math, q, k, v, dy, torch.bfloat16)
    finally:
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(was)
    ours = _grads(lambda *x: nki_attn.scaled_dot_product_attention(*x, is_causal=causal, scale=SCALE),
                  q, k, v, dy, torch.bfloat16)

    def rel(t, r):
        return float((t - r).norm() / r.norm())
    bound = math.sqrt(2) * (1 + 3 / math.sqrt(h * s))
    for name, got, low, r in zip(("o", "dq", "dk", "dv"), ours, torch_f32, ref):
        ratio = rel(got, r) / rel(low, r)
        assert ratio <= bound, (name, ratio, bound)
