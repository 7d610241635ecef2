"""The softmax-scale convention of both kernels (``nki_attn.kernels.steps``, "The scale convention"): the scale is
applied in float32 (the exponent's ``scale``, the dK and dQ evictions), never to a bfloat16 operand, so

* the forward's LSE is the log-sum-exp of exactly the float32 ``scale * S`` the backward's recompute feeds its
  exponent (bit-exact, checked on rows whose one visible key makes both sides computable on the host), and
* a scale that is not a power of two costs no accuracy: the error at 1/sqrt(128) is within the statistical
  spread of the error at the power-of-two scale 1/8 on inputs whose logits have the same distribution.
"""
import math

import torch

from nki_attn.kernel_api import attention_bwd, attention_fwd

D = 128
SCALE = D ** -0.5  # 0.0884: not a power of two


def _integer_inputs(h, s, seed):
    """bfloat16 q, k, v, dy ``[1, h, D, s]`` holding small integers: every dot product of 128 of them is exact in
    float32 whatever the summation order, so the host knows the kernel's S bit for bit."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(-3, 4, (1, h, D, s), generator=g).to(torch.bfloat16) for _ in range(4)]


def test_lse_is_bit_exactly_what_the_backward_recomputes():
    # sliding window 1: query i sees key i only, so lse_i = log(exp(0)) + scale * S_ii = fl32(scale * S_ii) and
    # the backward's P_ii = exp(scale * S_ii - lse_i) = 1, dV_i = P_ii dO_i = dO_i (dO is bfloat16, exact).
    # A forward that rounded scale * q to bfloat16 (or a backward with another scale placement) misses both.
    h, s = 2, 256
    q, k, v, dy = _integer_inputs(h, s, seed=1)
    o, lse = attention_fwd(q, k, v, use_causal_mask=True, sliding_window=1, softmax_scale=SCALE)
    s_ii = (q.float() * k.float()).sum(dim=2)  # [1, h, s], exact integers
    want = torch.tensor(SCALE, dtype=torch.float32) * s_ii  # the float32 product, rounded once
    lse = torch.as_tensor(lse)  # [1, h, 128, s / 128]: row t * 128 + p at [p, t]
    got = lse.permute(0, 1, 3, 2).reshape(1, h, s)
    assert torch.equal(got, want)
    dq, dk, dv = attention_bwd(q, k, v, o, dy, lse, use_causal_mask=True, sliding_window=1,
                               softmax_scale=SCALE)[:3]
    assert torch.equal(torch.as_tensor(dv), dy)


def _rel_errors(q, k, v, dy, scale):
    """Relative Frobenius errors of o, dq, dk, dv (forward, then backward on its own o and LSE) against float64
    computed from the same bfloat16 inputs."""
    leaves = [x.transpose(-1, -2).double().requires_grad_(True) for x in (q, k, v)]
    p = torch.softmax(scale * leaves[0] @ leaves[1].transpose(-1, -2), dim=-1)
    ref_o = p @ leaves[2]
    ref_o.backward(dy.transpose(-1, -2).double())
    refs = [t.transpose(-1, -2) for t in (ref_o.detach(), *(x.grad for x in leaves))]
    o, lse = attention_fwd(q, k, v, softmax_scale=scale)
    got = (o, *attention_bwd(q, k, v, o, dy, lse, softmax_scale=scale)[:3])
    return [float((torch.as_tensor(g).double() - r).norm() / r.norm()) for g, r in zip(got, refs)]


def test_non_power_of_two_scale_is_as_accurate_as_a_power_of_two():
    # The same standard normal draw at scale 1/sqrt(128) and, with q multiplied by sqrt(128) / 8 before its
    # rounding, at scale 1/8: the logits have the same distribution, only the scale's value differs. In float32
    # the scale adds one rounding of 2^-24 relative to each scaled score, nothing next to bfloat16's 2^-9, so the
    # two errors differ only by sampling. Bound: each error is a root-mean-square over n = h * s rows whose
    # errors are treated as independent (the elements of a row share its LSE, D and dS and are counted as one),
    # so each norm's relative spread is 1 / sqrt(2 n) and the ratio of two independent ones 1 / sqrt(n); three
    # of those: 1 + 3 / sqrt(n) = 1.094 at n = 1024. Folding the scale into q in bfloat16 (one more rounding of
    # every score) measured 1.16-1.43 on these outputs at this head dim.
    h, s = 4, 256
    g = torch.Generator().manual_seed(7)
    base = [torch.randn(1, h, D, s, generator=g, dtype=torch.float64) for _ in range(4)]
    k, v, dy = (x.bfloat16() for x in base[1:])
    p2 = 0.125
    err_s = _rel_errors(base[0].bfloat16(), k, v, dy, SCALE)
    err_p = _rel_errors((base[0] * (SCALE / p2)).bfloat16(), k, v, dy, p2)
    bound = 1 + 3 / math.sqrt(h * s)
    for name, es, ep in zip(("o", "dq", "dk", "dv"), err_s, err_p):
        assert es <= bound * ep, (name, es, ep, es / ep, bound)
