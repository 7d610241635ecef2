"""The attention variants of the golden against an independent float64 attention + torch.autograd.

Soft-capping, ALiBi (bottom-right aligned), two-sided windows, causal with seqlen_q != seqlen_k, d_qk != d_v,
head dims 1..256 and dropout (through an explicit keep mask), alone and combined with the older features
(GQA, sinks, packing bounds, empty rows).

The reference here shares no code with ``golden``: per-row key intervals written as loops, the ALiBi distance
from ``torch.cdist`` of the query's aligned position and the key position, soft-capping as ``c * tanh(S / c)``
left to autograd (so the golden's hand-written chain rule ``1 - tanh^2`` is checked against autograd's), dropout
as ``P * keep / (1 - p)``. With float64 inputs the golden IS the float64 reference, so everything agrees to
~1e-10 (summation order only).
"""

import importlib.util
import math

import pytest
import torch

import golden
from golden.attention_fwd_torch import alibi_bias, visibility_mask

F64 = dict(rtol=1e-10, atol=1e-10)


# ---------------------------------------------------------------------------------------------- reference
def allowed(sq, sk, causal=False, sliding_window=None, window_size=None, bound_min=None, bound_max=None):
    """Bool [sq, sk] from per-row key intervals [lo, hi) (loops, not broadcast comparisons)."""
    off = sk - sq
    out = torch.zeros(sq, sk, dtype=torch.bool)
    for i in range(sq):
        diag = i + off  # query i's aligned key position (may lie outside [0, sk))
        lo, hi = 0, sk
        if causal:
            hi = min(hi, diag + 1)
        if sliding_window is not None:
            lo = max(lo, diag - sliding_window + 1)
        if window_size is not None:
            left, right = window_size
            if left >= 0:
                lo = max(lo, diag - left)
            if right >= 0:
                hi = min(hi, diag + right + 1)
        if bound_min is not None:
            lo = max(lo, math.ceil(float(bound_min[i])))
            hi = min(hi, math.ceil(float(bound_max[i])))
        if lo < hi:
            out[i, max(lo, 0):max(hi, 0)] = True
    return out


def alibi_reference(slopes, sq, sk):
    """[b, h, sq, sk] = -slope * |i + off - j|, the distance from cdist of 1-D positions."""
    off = sk - sq
    rows = (torch.arange(sq, dtype=torch.float64) + off)[:, None]
    cols = torch.arange(sk, dtype=torch.float64)[:, None]
    dist = torch.cdist(rows, cols, p=1)
    return -slopes.to(torch.float64)[:, :, None, None] * dist


def reference(q, k, v, dy, *, causal=False, sliding_window=None, window_size=None, softcap=0.0, slopes=None,
              keep=None, p=0.0, sinks=None, bound_min=None, bound_max=None, scale=None, lscale=None):
    """float64 forward + autograd backward on kernel-layout inputs ([b, h, d, s]).

    Returns dict(o, lse [b, h, sq], dq, dk, dv, dsinks, dlscale) in kernel layout.
    """
    Q, K, V = (x.detach().to(torch.float64).transpose(-1, -2).clone().requires_grad_(True) for x in (q, k, v))
    S = None if sinks is None else sinks.detach().to(torch.float64).clone().requires_grad_(True)
    L = None if lscale is None else lscale.detach().to(torch.float64).clone().requires_grad_(True)
    b, h, sq, d = Q.shape
    sk = K.shape[2]
    group = h // K.shape[1]
    Kr, Vr = K.repeat_interleave(group, 1), V.repeat_interleave(group, 1)
    scale = 1 / math.sqrt(d) if scale is None else scale
    scores = torch.einsum("bhqd,bhkd->bhqk", Q, Kr) * scale
    if L is not None:
        scores = scores * L[:, :, None, None]
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if slopes is not None:
        scores = scores + alibi_reference(slopes, sq, sk)
    vis = allowed(sq, sk, causal, sliding_window, window_size, bound_min, bound_max)
    scores = scores.masked_fill(~vis, float("-inf"))
    if S is not None:
        scores = torch.cat([scores, S.reshape(b, h, 1, -1).expand(b, h, sq, -1)], dim=-1)
        empty = torch.zeros(sq, dtype=torch.bool)
    else:
        empty = ~vis.any(1)
    # all -inf rows would be NaN (and poison autograd through a where): dummy finite scores, zeroed after
    scores = torch.where(empty[:, None], torch.zeros_like(scores), scores)
    probs = torch.where(empty[:, None], torch.zeros_like(scores), torch.softmax(scores, -1))
    lse = torch.where(empty, torch.full((sq,), math.inf, dtype=torch.float64), torch.logsumexp(scores, -1))
    pk = probs[..., :sk]
    if keep is not None:
        pk = pk * keep.to(torch.float64) / (1 - p)
    o = torch.einsum("bhqk,bhkd->bhqd", pk, Vr)
    o.backward(dy.detach().to(torch.float64).transpose(-1, -2))
    t = lambda x: x.detach().transpose(-1, -2)  # noqa: E731
    # p-weighted logit size max_i sum_j p_ij |S_ij| (masked and empty entries have p = 0): what rounding a
    # logit by a relative u moves a softmax output by (see the low-precision test below)
    pd = probs.detach()
    weighted = torch.where(pd > 0, pd * scores.detach().abs(), torch.zeros_like(pd)).sum(-1)
    return dict(o=t(o), lse=lse.detach(), dq=t(Q.grad), dk=t(K.grad), dv=t(V.grad),
                dsinks=None if S is None else S.grad.detach(), dlscale=None if L is None else L.grad.detach(),
                s_eff=float(weighted.max()))


def lse_rows(lse):
    b, h, p, n = lse.shape
    return lse.transpose(-1, -2).reshape(b, h, n * p)


def inputs(bs, h, hk, d_qk, sq, sk, d_v=None, seed=0, q_mult=1.0):
    g = torch.Generator().manual_seed(seed)
    d_v = d_qk if d_v is None else d_v
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    return r(bs, h, d_qk, sq) * q_mult, r(bs, hk, d_qk, sk), r(bs, hk, d_v, sk), r(bs, h, d_v, sq)


# ---------------------------------------------------------------------------------------------- cases
# Fields: bs, h, hk, d (d_qk), dv, sq, sk, causal, sw (sliding_window), ws (window_size), cap (softcap),
# alibi (True = random slopes in [0, 0.3), as FlashAttention's tests), drop (p; a random keep mask),
# sinks (num sinks), cu (packing cu_seqlens for q = k), q_mult (scale q to push logits into the cap), lscale
# (True = a random per-head logit scale in [0.5, 2)).
BASE = dict(bs=1, h=2, hk=2, d=64, dv=None, sq=128, sk=128, causal=False, sw=None, ws=None, cap=0.0,
            alibi=False, drop=0.0, sinks=0, cu=None, q_mult=1.0, scale=None, lscale=False)

CASES = {
    # soft-capping, including saturated logits (q * 50 as FlashAttention's tests: qk / sqrt(d) ~ 50)
    "softcap_50": dict(cap=50.0, q_mult=50.0),
    "softcap_5_causal": dict(cap=5.0, causal=True, scale=1.0),
    "softcap_sinks_gqa": dict(cap=2.0, h=4, hk=2, sinks=2, scale=0.5),
    # ALiBi, causal and not, bottom-right alignment both ways
    "alibi": dict(alibi=True, bs=2),
    "alibi_causal": dict(alibi=True, causal=True),
    "alibi_sq_lt_sk": dict(alibi=True, sq=128, sk=300),
    "alibi_sq_gt_sk": dict(alibi=True, sq=256, sk=100, h=4, hk=1),
    "alibi_causal_sq_lt_sk": dict(alibi=True, causal=True, sq=128, sk=384),
    # causal with seqlen_q != seqlen_k (bottom-right), incl. fully masked leading rows when sq > sk
    "causal_sq_lt_sk": dict(causal=True, sq=128, sk=384),
    "causal_sq_gt_sk": dict(causal=True, sq=384, sk=200),
    "sliding_window_sq_gt_sk": dict(causal=True, sw=37, sq=256, sk=130),
    "sliding_window_sq_lt_sk": dict(causal=True, sw=130, sq=128, sk=512),
    # two-sided windows (FlashAttention's window_size), causal or not
    "window_64_64": dict(ws=(64, 64), sq=256, sk=256),
    "window_3_5_sq_lt_sk": dict(ws=(3, 5), sq=128, sk=333),
    "window_sq_gt_sk_empty_rows": dict(ws=(2, 0), sq=384, sk=128),
    "window_0_0": dict(ws=(0, 0), sq=256, sk=256),
    "window_left_only": dict(ws=(17, -1), sq=256, sk=200),
    "window_right_only": dict(ws=(-1, 9), sq=128, sk=256),
    "window_unbounded": dict(ws=(-1, -1), sq=128, sk=200),
    "window_causal_right_ignored": dict(ws=(20, 50), causal=True, sq=256, sk=300),
    # d_qk != d_v, any head_dim
    "dqk192_dv128": dict(d=192, dv=128, causal=True),
    "dqk64_dv32_gqa": dict(d=64, dv=32, h=4, hk=2, sinks=1),
    "dqk16_dv200": dict(d=16, dv=200, sq=128, sk=256),
    "d1": dict(d=1, scale=1.0),
    "d72": dict(d=72, causal=True),
    "d80": dict(d=80),
    "d160": dict(d=160, causal=True),
    "d199": dict(d=199, ws=(30, 30)),
    "d256_dv1": dict(d=256, dv=1),
    # dropout through the explicit keep mask
    "dropout_0.1": dict(drop=0.1),
    "dropout_0.5_causal_sinks": dict(drop=0.5, causal=True, sinks=2, h=4, hk=1),
    "dropout_window_sq_gt_sk": dict(drop=0.17, ws=(10, 3), sq=256, sk=128),
    # the per-head logit scale, alone and before soft-capping and ALiBi
    "logit_scale": dict(lscale=True, bs=2, h=4, hk=2),
    "logit_scale_cap_alibi_sinks": dict(lscale=True, cap=3.0, alibi=True, sinks=1, causal=True, sq=256, sk=384,
                                        q_mult=2.0),
    "logit_scale_dropout_packing": dict(lscale=True, drop=0.2, cu=[0, 60, 61, 230], sq=256, sk=256),
    # everything at once
    "everything": dict(bs=2, h=4, hk=2, d=96, dv=40, sq=256, sk=384, causal=True, ws=(100, 7), cap=20.0,
                       alibi=True, drop=0.2, sinks=2, scale=0.3, q_mult=4.0),
    "everything_packing": dict(h=2, hk=1, d=48, dv=80, sq=256, sk=256, ws=(30, 30), cap=10.0, alibi=True,
                               drop=0.3, sinks=1, cu=[0, 60, 61, 230]),
}


def build(name, seed=0, spec=None):
    """Inputs and keyword arguments for case ``name`` of CASES (or the fields ``spec``): ((q, k, v, dy, sinks),
    golden keywords, reference keywords), all float64."""
    c = dict(BASE, **(CASES[name] if spec is None else spec))
    q, k, v, dy = inputs(c["bs"], c["h"], c["hk"], c["d"], c["sq"], c["sk"], c["dv"], seed, c["q_mult"])
    g = torch.Generator().manual_seed(seed + 99)
    gkw = dict(use_causal_mask=c["causal"], sliding_window=c["sw"], window_size=c["ws"], softcap=c["cap"],
               softmax_scale=c["scale"])
    rkw = dict(causal=c["causal"], sliding_window=c["sw"], window_size=c["ws"], softcap=c["cap"],
               scale=c["scale"])
    if c["alibi"]:
        slopes = torch.rand(c["bs"], c["h"], generator=g, dtype=torch.float32) * 0.3
        gkw["alibi_slopes"] = slopes
        rkw["slopes"] = slopes
    if c["drop"]:
        keep = torch.rand(c["bs"], c["h"], c["sq"], c["sk"], generator=g) >= c["drop"]
        gkw.update(dropout_p=c["drop"], dropout_mask=keep)
        rkw.update(keep=keep, p=c["drop"])
    sinks = None
    if c["sinks"]:
        sinks = torch.randn(c["bs"], c["h"], c["sinks"], generator=g, dtype=torch.float64)
    if c["lscale"]:
        lam = 0.5 + 1.5 * torch.rand(c["bs"], c["h"], generator=g, dtype=torch.float32)
        gkw["logit_scale"] = lam
        rkw["lscale"] = lam
    if c["cu"] is not None:
        bmin, bmax = golden.packing_bounds(torch.tensor(c["cu"]), seqlen_q=c["sq"])
        gkw.update(bound_min=bmin, bound_max=bmax)
        rkw.update(bound_min=bmin, bound_max=bmax)
    return (q, k, v, dy, sinks), gkw, rkw


@pytest.mark.parametrize("name", list(CASES))
def test_variant_forward_and_backward_match_autograd(name):
    (q, k, v, dy, sinks), gkw, rkw = build(name)
    want = reference(q, k, v, dy, sinks=sinks, **rkw)
    o, lse = golden.attention_fwd_torch_ref(q, k, v, sinks_ref=sinks, **gkw)
    assert o.shape == dy.shape and o.dtype == torch.float64
    torch.testing.assert_close(o, want["o"], **F64)
    torch.testing.assert_close(lse_rows(lse), want["lse"], **F64)
    got = golden.attention_bwd_torch_ref(q, k, v, o, dy, lse, sinks_ref=sinks, **gkw)
    assert got["out_dq_ref"].shape == q.shape and got["out_dk_ref"].shape == k.shape
    assert got["out_dv_ref"].shape == v.shape
    torch.testing.assert_close(got["out_dq_ref"], want["dq"], **F64)
    torch.testing.assert_close(got["out_dk_ref"], want["dk"], **F64)
    torch.testing.assert_close(got["out_dv_ref"], want["dv"], **F64)
    if sinks is not None:
        torch.testing.assert_close(got["out_dsinks_ref"], want["dsinks"], **F64)
    assert ("out_dlogit_scale_ref" in got) == (want["dlscale"] is not None)
    if want["dlscale"] is not None:
        torch.testing.assert_close(got["out_dlogit_scale_ref"], want["dlscale"], **F64)
    for t in (o, *got.values()):
        assert torch.isfinite(t).all()
    assert not torch.isnan(lse).any()


def test_cases_exercise_what_they_claim():
    """Guards for the table: the saturating softcap case really saturates, the empty-row cases have empty rows,
    the causal window case has a right side that causal overrides."""
    (q, k, _, _, _), gkw, _ = build("softcap_50")
    s = (q.transpose(-1, -2) @ k) / 8.0
    assert float((s.abs() > 50).float().mean()) > 0.3  # tanh's flat part carries a real share of the logits
    for name in ("causal_sq_gt_sk", "window_sq_gt_sk_empty_rows", "sliding_window_sq_gt_sk"):
        c = dict(BASE, **CASES[name])
        vis = allowed(c["sq"], c["sk"], c["causal"], c["sw"], c["ws"])
        assert (~vis.any(1)).sum() > 0, name
    vis_causal = allowed(256, 300, True, None, (20, 50))
    assert torch.equal(vis_causal, allowed(256, 300, True, None, (20, 0)))
    assert not torch.equal(vis_causal, allowed(256, 300, False, None, (20, 50)))


# ---------------------------------------------------------------------------------------------- rules
def test_empty_rows_of_variants_are_zero_with_infinite_lse():
    (q, k, v, dy, _), gkw, _ = build("causal_sq_gt_sk")
    o, lse = golden.attention_fwd_torch_ref(q, k, v, **gkw)
    rows = lse_rows(lse)
    # sq = 384, sk = 200, off = -184: queries 0..183 see no key
    assert bool(torch.isposinf(rows[..., :184]).all()) and bool(torch.isfinite(rows[..., 184:]).all())
    assert torch.equal(o[..., :184], torch.zeros_like(o[..., :184]))
    got = golden.attention_bwd_torch_ref(q, k, v, o, dy, lse, **gkw)
    assert torch.equal(got["out_dq_ref"][..., :184], torch.zeros_like(got["out_dq_ref"][..., :184]))


def test_softcap_chain_rule_factor():
    """dS through the cap is dS_capped * (1 - tanh^2(S / c)): with the cap, the gradient of a saturated logit
    vanishes; a huge cap is the identity."""
    q, k, v, dy = inputs(1, 1, 1, 8, 128, 128, seed=4, q_mult=30.0)
    o, lse = golden.attention_fwd_torch_ref(q, k, v, softcap=1e9)
    o0, lse0 = golden.attention_fwd_torch_ref(q, k, v)
    torch.testing.assert_close(o, o0, rtol=1e-9, atol=1e-9)
    g = golden.attention_bwd_torch_ref(q, k, v, o, dy, lse, softcap=1e9)
    g0 = golden.attention_bwd_torch_ref(q, k, v, o0, dy, lse0)
    for key in g:
        torch.testing.assert_close(g[key], g0[key], rtol=1e-7, atol=1e-7)
    # A small cap on large logits: the capped model's dq is much smaller (tanh' ~ 0 where |S| >> c).
    o1, lse1 = golden.attention_fwd_torch_ref(q, k, v, softcap=0.5)
    g1 = golden.attention_bwd_torch_ref(q, k, v, o1, dy, lse1, softcap=0.5)
    assert float(g1["out_dq_ref"].abs().max()) < 0.05 * float(g0["out_dq_ref"].abs().max())


def test_softcap_worked_example():
    """docs/semantics.md: with c = 50 the scaled scores 10, 100, -200 become 9.8688, 48.2014, -49.9665."""
    c = 50.0
    got = [c * math.tanh(s / c) for s in (10.0, 100.0, -200.0)]
    assert [round(x, 4) for x in got] == [9.8688, 48.2014, -49.9665]
    # ... and the golden applies exactly that: d = 1, scale 1, one query against three keys.
    q = torch.zeros(1, 1, 1, 128, dtype=torch.float64)
    q[..., 0] = 1.0
    k = torch.tensor([10.0, 100.0, -200.0], dtype=torch.float64).reshape(1, 1, 1, 3)
    v = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64).reshape(1, 1, 1, 3)
    _, lse, probs = golden.compute_o_lse(q, k, v, use_causal_mask=False, softmax_scale=1.0, softcap=c)
    torch.testing.assert_close(lse[0, 0, 0, 0], torch.logsumexp(torch.tensor(got, dtype=torch.float64), 0),
                               **F64)


def test_alibi_worked_example():
    """docs/semantics.md: seqlen_q = 2, seqlen_k = 4, slope 0.5: off = 2, bias = -0.5 * |i + 2 - j|."""
    bias = alibi_bias(torch.tensor([[0.5]]), 2, 4)
    want = torch.tensor([[-1.0, -0.5, 0.0, -0.5],
                         [-1.5, -1.0, -0.5, 0.0]])
    assert torch.equal(bias[0, 0], want)
    # seqlen_q > seqlen_k: off = -2, the first query's aligned position (-2) lies before every key
    assert torch.equal(alibi_bias(torch.tensor([[1.0]]), 4, 2)[0, 0],
                       -torch.tensor([[2.0, 3.0], [1.0, 2.0], [0.0, 1.0], [1.0, 0.0]]))


def test_alibi_causal_differs_from_flashattention_kernel_bias_by_a_row_constant():
    """FlashAttention's CUDA kernel (and its test reference) uses slope * (j - seqlen_k + 1) for causal ALiBi.
    Within the causal band that is our bias minus slope * (seqlen_q - 1 - i), a per-row constant: o and the
    gradients are equal, and our LSE is FlashAttention's plus exactly that constant."""
    q, k, v, dy = inputs(1, 2, 2, 32, 128, 384, seed=8)
    slopes = torch.tensor([[0.25, 0.0625]], dtype=torch.float32)
    o, lse, _ = golden.compute_o_lse(q, k, v, use_causal_mask=True, alibi_slopes=slopes)
    fa_bias = (torch.arange(-383, 1, dtype=torch.float64) * slopes.double()[..., None, None]).expand(1, 2, 128, 384)
    o_fa, lse_fa, _ = golden.compute_o_lse(q, k, v, use_causal_mask=True, logit_bias=fa_bias)
    torch.testing.assert_close(o, o_fa, **F64)
    i = torch.arange(128, dtype=torch.float64)
    torch.testing.assert_close(lse_rows(lse) - lse_rows(lse_fa),
                               slopes.double()[..., None] * (128 - 1 - i), **F64)


def test_dropout_scales_kept_probabilities_and_leaves_lse():
    q, k, v, dy = inputs(1, 2, 2, 32, 128, 128, seed=9)
    ones = torch.ones(1, 2, 128, 128, dtype=torch.bool)
    o, lse = golden.attention_fwd_torch_ref(q, k, v, dropout_p=0.5, dropout_mask=ones)
    o0, lse0 = golden.attention_fwd_torch_ref(q, k, v)
    torch.testing.assert_close(o, 2 * o0, **F64)
    assert torch.equal(lse, lse0)
    g = torch.Generator().manual_seed(10)
    keep = torch.rand(1, 2, 128, 128, generator=g) >= 0.25
    o1, lse1 = golden.attention_fwd_torch_ref(q, k, v, dropout_p=0.25, dropout_mask=keep)
    assert torch.equal(lse1, lse0)
    # compute_o_lse's raw mask path, with 1/(1-p) put in by hand, is the same computation
    o2, _, _ = golden.compute_o_lse(q, k, v, use_causal_mask=False, dropout_mask=keep.double() / 0.75)
    torch.testing.assert_close(o1, o2, **F64)


def test_dropout_worked_example():
    """docs/semantics.md: p = 0.5, probabilities [0.2, 0.3, 0.5], keep [1, 0, 1] -> [0.4, 0, 1.0] (one query, three
    keys whose logits give those probabilities; the values read the dropped probabilities back out)."""
    probs = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    q = torch.zeros(1, 1, 1, 128, dtype=torch.float64)
    q[..., 0] = 1.0
    k = torch.log(probs).reshape(1, 1, 1, 3)
    v = torch.eye(3, dtype=torch.float64).reshape(1, 1, 3, 3)    # d_v = 3: o[:, i] is the dropped row itself
    keep = torch.zeros(1, 1, 128, 3, dtype=torch.bool)
    keep[0, 0, 0] = torch.tensor([True, False, True])
    o, _ = golden.attention_fwd_torch_ref(q, k, v, softmax_scale=1.0, dropout_p=0.5, dropout_mask=keep)
    torch.testing.assert_close(o[0, 0, :, 0], torch.tensor([0.4, 0.0, 1.0], dtype=torch.float64), **F64)


def test_dropout_backward_uses_dropped_o_in_d():
    """dS = P * (dP * M / (1 - p) - D) with D = rowsum(dO * O) of the DROPPED output (the kernels' shortcut)."""
    q, k, v, dy = inputs(1, 1, 1, 16, 128, 128, seed=11)
    keep = torch.rand(1, 1, 128, 128, generator=torch.Generator().manual_seed(12)) >= 0.3
    o, lse, probs = golden.compute_o_lse(q, k, v, use_causal_mask=True, dropout_mask=keep.double() / 0.7)
    got = golden.attention_bwd_torch_ref(q, k, v, o, dy, lse, use_causal_mask=True, dropout_p=0.3,
                                         dropout_mask=keep)
    dp = dy.transpose(-1, -2) @ v                                  # [b, h, sq, sk]
    D = (o * dy).sum(2)[..., None]
    ds = probs * (dp * keep.double() / 0.7 - D)
    dq = (ds / 4.0) @ k.transpose(-1, -2)                          # scale = 1/sqrt(16)
    torch.testing.assert_close(got["out_dq_ref"], dq.transpose(-1, -2), **F64)


def test_dropout_seed_path():
    """The seed path regenerates the mask with golden.dropout.keep_mask (written by the dropout work); until
    that module exists the golden says so and names dropout_mask as the way in."""
    q, k, v, _ = inputs(1, 2, 2, 16, 128, 128, seed=13)
    seed = torch.tensor([1234], dtype=torch.int32)
    if importlib.util.find_spec("golden.dropout") is None:
        with pytest.raises(ValueError, match=r"dropout_seed = .*golden\.dropout .*dropout_mask"):
            golden.attention_fwd_torch_ref(q, k, v, dropout_p=0.1, dropout_seed=seed)
        return
    from golden.dropout import keep_mask
    mask = keep_mask(seed, 0.1, 1, 2, 128, 128)
    o_seed, lse_seed = golden.attention_fwd_torch_ref(q, k, v, dropout_p=0.1, dropout_seed=seed)
    o_mask, lse_mask = golden.attention_fwd_torch_ref(q, k, v, dropout_p=0.1, dropout_mask=mask)
    assert torch.equal(o_seed, o_mask) and torch.equal(lse_seed, lse_mask)


# The worked mask examples of docs/semantics.md, verbatim (1 = visible).
MASK_EXAMPLES = [
    ("causal sq=4 sk=6", dict(seqlen_q=4, seqlen_k=6, causal=True),
     ["111000", "111100", "111110", "111111"]),
    ("causal sq=4 sk=2", dict(seqlen_q=4, seqlen_k=2, causal=True),
     ["00", "00", "10", "11"]),
    ("window (1, 1) sq=sk=5", dict(seqlen_q=5, seqlen_k=5, window_size=(1, 1)),
     ["11000", "11100", "01110", "00111", "00011"]),
    ("window (1, 0) sq=4 sk=6", dict(seqlen_q=4, seqlen_k=6, window_size=(1, 0)),
     ["011000", "001100", "000110", "000011"]),
    ("window (0, 2) sq=4 sk=4", dict(seqlen_q=4, seqlen_k=4, window_size=(0, 2)),
     ["1110", "0111", "0011", "0001"]),
    ("sliding window W=2 sq=3 sk=5", dict(seqlen_q=3, seqlen_k=5, causal=True, window=2),
     ["01100", "00110", "00011"]),
    ("window (2, -1) causal sq=4 sk=4", dict(seqlen_q=4, seqlen_k=4, causal=True, window_size=(2, -1)),
     ["1000", "1100", "1110", "0111"]),
]


@pytest.mark.parametrize("name,kw,rows", MASK_EXAMPLES, ids=[m[0] for m in MASK_EXAMPLES])
def test_mask_worked_examples(name, kw, rows):
    got = visibility_mask(**kw)
    want = torch.tensor([[c == "1" for c in r] for r in rows])
    assert torch.equal(got, want), f"{name}:\n{got.int()}"
    # the independent interval reference agrees
    ref = allowed(kw["seqlen_q"], kw["seqlen_k"], kw.get("causal", False), kw.get("window"),
                  kw.get("window_size"))
    assert torch.equal(ref, want)


def test_visibility_mask_matches_interval_reference_exhaustively():
    """Every small (sq, sk) and window description: the golden's broadcast formulation equals the loops."""
    for sq in range(1, 7):
        for sk in range(1, 7):
            for causal in (False, True):
                for ws in [None, (-1, -1), (0, 0), (1, -1), (-1, 1), (2, 1), (0, 3), (5, 5)]:
                    got = visibility_mask(sq, sk, causal, None, None, None, ws)
                    assert torch.equal(got, allowed(sq, sk, causal, None, ws)), (sq, sk, causal, ws)
                if causal:
                    for w in (1, 2, 4):
                        got = visibility_mask(sq, sk, True, w)
                        assert torch.equal(got, allowed(sq, sk, True, w)), (sq, sk, w)


# ---------------------------------------------------------------------------------------------- low precision
# The golden in float32 / bfloat16 / float16 (mixed and pure statistics) against the float64 reference on the
# same rounded inputs. Tolerance per output X with reference Xr, as in test_golden_low_precision.py:
#
#     |X - Xr| <= max|Xr| * ((8 + extra + 2 * s_eff) * u  +  2 * sqrt(n) * u32)
#
# u = eps(dtype) / 2, u32 = 2**-24, n the longest contraction. The variants add roundings in the statistics
# dtype on the way to an output: soft-capping three (S / c, tanh, c * ...; the chain-rule factor 1 - tanh^2 on
# the backward is bounded by the same three), ALiBi one (the add), dropout two (1 / (1 - p) and the product),
# hence ``extra``. s_eff = max_i sum_j p_ij |S_ij| replaces the older test's largest |logit|: a logit S_ij
# rounded by a relative u moves output i by at most 2 u p_ij |S_ij| max|V| (softmax's Jacobian), so large
# logits with negligible probability (ALiBi's far keys) do not inflate the bound. Soft-capping does not enlarge
# it either: rounding the uncapped S by u moves c tanh(S / c) by u S sech^2(S / c) <= u |c tanh(S / c)|.
LOW_CASES = {
    "softcap_window_sq_lt_sk": dict(d=128, sq=256, sk=384, cap=5.0, ws=(50, 20), q_mult=4.0, scale=None),
    "alibi_causal_sq_gt_sk_gqa_sinks": dict(h=4, hk=1, d=64, sq=256, sk=200, causal=True, alibi=True, sinks=2),
    "dqk199_dv128_dropout_causal": dict(d=199, dv=128, sq=256, sk=256, causal=True, drop=0.1),
}


def _assert_scaled(name, got, want, rel):
    got = got.to(torch.float64)
    finite = torch.isfinite(want)
    assert torch.equal(got[~finite], want[~finite]), name  # +inf LSE of empty rows, exactly
    m = want[finite].abs().max().item()
    err = (got[finite] - want[finite]).abs().max().item()
    assert err <= rel * m, f"{name}: max err {err:.3g} > {rel:.3g} * max|ref| {m:.3g}"
    return err / m


@pytest.mark.parametrize("mixed", [True, False], ids=["mixed", "pure"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", list(LOW_CASES))
def test_variant_low_precision_against_float64(name, dtype, mixed):
    (q, k, v, dy, sinks), gkw, rkw = build(name, seed=21, spec=LOW_CASES[name])
    q, k, v, dy = (x.to(dtype) for x in (q, k, v, dy))
    if sinks is not None:
        sinks = sinks.to(torch.float32)
    want = reference(q, k, v, dy, sinks=sinks, **rkw)
    o, lse = golden.attention_fwd_torch_ref(q, k, v, sinks_ref=sinks, mixed_precision=mixed, **gkw)
    got = golden.attention_bwd_torch_ref(q, k, v, o, dy, lse, sinks_ref=sinks, mixed_precision=mixed, **gkw)
    assert o.dtype == dtype and lse.dtype == torch.float32
    c = dict(BASE, **LOW_CASES[name])
    extra = 3 * (c["cap"] > 0) + 1 * c["alibi"] + 2 * (c["drop"] > 0)
    n = max(c["d"], c["sk"], c["sq"] * c["h"] // c["hk"])
    u = torch.finfo(dtype).eps / 2
    rel = (8 + extra + 2 * want["s_eff"]) * u + 2 * math.sqrt(n) * 2.0 ** -24
    _assert_scaled("o", o, want["o"], rel)
    _assert_scaled("lse", lse_rows(lse), want["lse"], rel)
    for key in ("dq", "dk", "dv"):
        _assert_scaled(key, got[f"out_{key}_ref"], want[key], rel)
    if sinks is not None:
        _assert_scaled("dsinks", got["out_dsinks_ref"], want["dsinks"], rel)


def test_low_precision_bound_catches_misaligned_alibi_and_missing_cap():
    """The bound above is tight enough to see the mistakes this issue invites: ALiBi aligned top-left instead of
    bottom-right, or a backward that ignores the soft-cap, exceed it in bfloat16 by far."""
    spec = LOW_CASES["alibi_causal_sq_gt_sk_gqa_sinks"]
    (q, k, v, dy, sinks), gkw, rkw = build("x", seed=21, spec=spec)
    q, k, v = (x.to(torch.bfloat16) for x in (q, k, v))
    sinks = sinks.to(torch.float32)
    want = reference(q, k, v, dy.to(torch.bfloat16), sinks=sinks, **rkw)
    u = torch.finfo(torch.bfloat16).eps / 2
    rel = (9 + 2 * want["s_eff"]) * u + 2 * math.sqrt(1024) * 2.0 ** -24
    slopes = gkw["alibi_slopes"]
    top_left = -(slopes.double()[..., None, None]
                 * (torch.arange(256.0)[:, None] - torch.arange(200.0)[None, :]).abs())
    o_bug, _, _ = golden.compute_o_lse(q, k, v, use_causal_mask=True, sinks=sinks, logit_bias=top_left)
    err = (o_bug.double() - want["o"]).abs().max() / want["o"].abs().max()
    assert err > 5 * rel
    # soft-capping: gradients of the uncapped model where the capped one was asked for
    spec = LOW_CASES["softcap_window_sq_lt_sk"]
    (q, k, v, dy, _), gkw, rkw = build("x", seed=21, spec=spec)
    q, k, v, dy = (x.to(torch.bfloat16) for x in (q, k, v, dy))
    want = reference(q, k, v, dy, **rkw)
    no_cap = dict(gkw, softcap=0.0)
    o_nc, lse_nc = golden.attention_fwd_torch_ref(q, k, v, **no_cap)
    got = golden.attention_bwd_torch_ref(q, k, v, o_nc, dy, lse_nc, **no_cap)
    rel = (11 + 2 * want["s_eff"]) * u + 2 * math.sqrt(384) * 2.0 ** -24
    err = (got["out_dq_ref"].double() - want["dq"]).abs().max() / want["dq"].abs().max()
    assert err > 5 * rel


# ---------------------------------------------------------------------------------------------- bad input
Q, K, V = (torch.zeros(1, 4, 8, 128, dtype=torch.float64), torch.zeros(1, 2, 8, 128, dtype=torch.float64),
           torch.zeros(1, 2, 8, 128, dtype=torch.float64))
LSE = torch.zeros(1, 4, 128, 1)
SLOPES = torch.zeros(1, 4)


def fwd(**kw):
    return golden.attention_fwd_torch_ref(**dict(dict(q=Q, k=K, v=V), **kw))


def bwd(**kw):
    return golden.attention_bwd_torch_ref(**dict(dict(q_ref=Q, k_ref=K, v_ref=V, o_ref=Q, dy_ref=Q,
                                                      lse_ref=LSE), **kw))


BAD = [
    ("softcap_negative", lambda: fwd(softcap=-1.0), r"softcap = -1\.0: must be finite and >= 0"),
    ("softcap_inf", lambda: fwd(softcap=math.inf), r"softcap = inf"),
    ("softcap_nan_bwd", lambda: bwd(softcap=math.nan), r"attention_bwd_torch_ref: softcap = nan"),
    ("softcap_string", lambda: fwd(softcap="50"), r"softcap = '50': must be a real number"),
    ("softcap_bool", lambda: fwd(softcap=True), r"softcap = True"),
    ("alibi_1d", lambda: fwd(alibi_slopes=torch.zeros(4)),
     r"alibi_slopes\.shape = \(4,\): must be \[bs, nheads\] = \[1, 4\]"),
    ("alibi_kv_heads", lambda: fwd(alibi_slopes=torch.zeros(1, 2)), r"alibi_slopes\.shape = \(1, 2\)"),
    ("alibi_float64", lambda: fwd(alibi_slopes=SLOPES.double()), r"alibi_slopes\.dtype = torch\.float64"),
    ("alibi_nan", lambda: fwd(alibi_slopes=torch.full((1, 4), math.nan)), r"alibi_slopes = .*finite"),
    ("alibi_list", lambda: fwd(alibi_slopes=[0.5] * 4), r"alibi_slopes = list: must be a torch\.Tensor"),
    ("window_int", lambda: fwd(window_size=3), r"window_size = 3: must be a pair"),
    ("window_triple", lambda: fwd(window_size=(1, 2, 3)), r"window_size = \(1, 2, 3\)"),
    ("window_float_entry", lambda: fwd(window_size=(1.5, 2)), r"window_size = \(1\.5, 2\)"),
    ("window_bool_entry", lambda: fwd(window_size=(True, 2)), r"window_size = \(True, 2\)"),
    ("window_below_minus_one", lambda: fwd(window_size=(-2, 0)),
     r"window_size = \(-2, 0\): entries must be >= -1"),
    ("window_and_sliding_window", lambda: fwd(use_causal_mask=True, sliding_window=4, window_size=(3, 0)),
     r"window_size = \(3, 0\): give either sliding_window \(= 4\) or window_size"),
    ("dropout_p_one", lambda: fwd(dropout_p=1.0, dropout_mask=torch.ones(1, 4, 128, 128, dtype=torch.bool)),
     r"dropout_p = 1\.0: must be in \[0, 1\)"),
    ("dropout_p_negative", lambda: fwd(dropout_p=-0.1), r"dropout_p = -0\.1"),
    ("dropout_p_string", lambda: fwd(dropout_p="0.1"), r"dropout_p = '0\.1': must be a real number"),
    ("dropout_no_seed", lambda: fwd(dropout_p=0.1), r"dropout_seed = None: dropout_p = 0\.1 needs dropout_seed"),
    ("dropout_seed_without_p", lambda: fwd(dropout_seed=torch.tensor([1])),
     r"dropout_seed = .*must be None when dropout_p = 0"),
    ("dropout_mask_without_p", lambda: fwd(dropout_mask=torch.ones(1, 4, 128, 128, dtype=torch.bool)),
     r"dropout_mask = a tensor: must be None when dropout_p = 0"),
    ("dropout_seed_and_mask", lambda: fwd(dropout_p=0.1, dropout_seed=torch.tensor([1]),
                                          dropout_mask=torch.ones(1, 4, 128, 128, dtype=torch.bool)),
     r"dropout_mask = a tensor: give dropout_seed or dropout_mask, not both"),
    ("dropout_mask_shape_bwd", lambda: bwd(dropout_p=0.1, dropout_mask=torch.ones(1, 2, 128, 128, dtype=torch.bool)),
     r"attention_bwd_torch_ref: dropout_mask\.shape = \(1, 2, 128, 128\)"),
    ("dropout_mask_float", lambda: fwd(dropout_p=0.1, dropout_mask=torch.ones(1, 4, 128, 128)),
     r"dropout_mask\.dtype = torch\.float32: must be bool"),
    ("v_batch", lambda: fwd(v=torch.zeros(2, 2, 8, 128, dtype=torch.float64)),
     r"v\.shape\[0\] = 2: batch size must equal k\.shape\[0\] = 1"),
    ("v_seqlen", lambda: fwd(v=torch.zeros(1, 2, 16, 256, dtype=torch.float64)), r"v\.shape\[3\] = 256"),
]


@pytest.mark.parametrize("call, pattern", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_variant_input_raises_value_error(call, pattern):
    with pytest.raises(ValueError, match=pattern):
        call()


def test_good_variant_arguments_are_accepted():
    """Guard for the table: each new keyword at a valid value goes through (and the shapes come out right)."""
    fwd(softcap=30.0, alibi_slopes=SLOPES, window_size=(5, -1))
    fwd(use_causal_mask=True, window_size=(-1, -1), dropout_p=0.1,
        dropout_mask=torch.ones(1, 4, 128, 128, dtype=torch.bool))
    o, _ = fwd(k=torch.zeros(1, 2, 8, 256, dtype=torch.float64), v=torch.zeros(1, 2, 3, 256, dtype=torch.float64),
               use_causal_mask=True)
    assert o.shape == (1, 4, 3, 128)
    bwd(v_ref=torch.zeros(1, 2, 3, 128, dtype=torch.float64), o_ref=torch.zeros(1, 4, 3, 128, dtype=torch.float64),
        dy_ref=torch.zeros(1, 4, 3, 128, dtype=torch.float64), softcap=1.0, alibi_slopes=SLOPES)
