"""float64 golden vs the naive float64 reference + torch.autograd, feature by feature.

With float64 inputs the golden IS the float64 reference, so forward and
backward must agree with autograd to ~1e-10 (both sides are float64; the
only differences are summation order, ~1e-15 relative).
"""

import pytest
import torch

import golden

F64 = dict(rtol=1e-10, atol=1e-10)

# name -> case.  Fields: bs, h, hk, d, sq, sk, causal, window, scale,
# cu (packing cu_seqlens_q, cu_seqlens_k or None), bounds (custom callable
# (sq, sk) -> (bmin, bmax)), sinks (None | "bh" | int num_sinks).
BASE = dict(bs=1, h=2, hk=2, d=64, sq=128, sk=128, causal=False, window=None, scale=None,
            cu=None, bounds=None, sinks=None)


def _empty_row_bounds(sq, sk):
    """Full-width bounds except for rows built to see nothing.

    row 5: [7, 7) empty interval; row 6: min > max; row 200: bounds entirely
    past every key; rows 130..139: [i + 1, i + 10), which is empty only once
    the causal mask (j <= i) is applied as well.
    """
    bmin = torch.zeros(sq, dtype=torch.float32)
    bmax = torch.full((sq,), float(sk), dtype=torch.float32)
    bmin[5], bmax[5] = 7, 7
    bmin[6], bmax[6] = 9, 3
    bmin[200], bmax[200] = sk + 5, sk + 50
    for i in range(130, 140):
        bmin[i], bmax[i] = i + 1, i + 10
    return bmin, bmax


def _fractional_bounds(sq, sk):
    """Non-integer bounds: key j is visible iff bmin <= j < bmax, e.g. [2.5, 7.5) -> 3..7."""
    i = torch.arange(sq, dtype=torch.float32)
    return (i * 0.5 - 0.5).clamp(min=0) + 0.25, i * 0.75 + 2.5


CASES = {
    "plain": dict(bs=2),
    "causal": dict(causal=True, sq=256, sk=256),
    "window_1": dict(causal=True, window=1),
    "window_17": dict(causal=True, window=17, sq=256, sk=256),
    "window_wider_than_seq": dict(causal=True, window=1000),
    "gqa_4to1": dict(h=8, hk=2, causal=True),
    "mqa": dict(h=4, hk=1, sk=256),
    "mqa_causal": dict(h=3, hk=1, causal=True, sq=256, sk=256),
    "packing_3seq": dict(sq=256, sk=256, cu=([0, 50, 170, 256], None)),
    "packing_3seq_causal": dict(sq=256, sk=256, causal=True, cu=([0, 50, 170, 256], None)),
    "packing_3seq_causal_window": dict(sq=256, sk=256, causal=True, window=20,
                                       cu=([0, 50, 170, 256], None)),
    "packing_padding_rows": dict(sq=256, sk=256, cu=([0, 40, 100, 200], None)),
    "packing_cross": dict(sq=256, sk=384, cu=([0, 100, 128, 256], [0, 30, 200, 384])),
    "sinks_1_bh": dict(causal=True, sinks="bh"),
    "sinks_1_bh1": dict(sinks=1, sk=256),
    "sinks_2": dict(h=4, hk=2, causal=True, sinks=2),
    "sinks_with_empty_rows": dict(sq=256, sk=256, cu=([0, 40, 100, 200], None), sinks=2),
    "scale": dict(scale=0.3, causal=True),
    "scale_large": dict(scale=1.0),
    "sq_lt_sk": dict(sq=128, sk=384),
    "sq_gt_sk": dict(sq=256, sk=128, h=2, hk=1),
    "sk_not_multiple_of_128": dict(sq=128, sk=200),
    "empty_rows": dict(sq=256, sk=256, causal=True, bounds=_empty_row_bounds),
    "fractional_bounds": dict(sq=128, sk=256, bounds=_fractional_bounds),
    "d96": dict(d=96, causal=True),
    "d128": dict(d=128),
    "d256": dict(d=256, causal=True),
    "everything": dict(bs=2, h=4, hk=2, d=96, sq=256, sk=256, causal=True, window=33,
                       scale=0.2, cu=([0, 60, 61, 256], None), sinks=2),
}


def _build(ref, name, seed=0):
    c = dict(BASE, **CASES[name])
    q, k, v, dy = ref.make_inputs(c["bs"], c["h"], c["hk"], c["d"], c["sq"], c["sk"], seed=seed)
    g = torch.Generator().manual_seed(seed + 1000)
    sinks = None
    if c["sinks"] == "bh":
        sinks = torch.randn(c["bs"], c["h"], generator=g, dtype=torch.float64)
    elif c["sinks"]:
        sinks = torch.randn(c["bs"], c["h"], c["sinks"], generator=g, dtype=torch.float64)
    golden_kw = dict(use_causal_mask=c["causal"], sliding_window=c["window"],
                     softmax_scale=c["scale"])
    naive_kw = dict(causal=c["causal"], window=c["window"], scale=c["scale"])
    if c["cu"] is not None:
        cu_q, cu_k = c["cu"]
        bmin, bmax = golden.packing_bounds(torch.tensor(cu_q),
                                           None if cu_k is None else torch.tensor(cu_k),
                                           seqlen_q=c["sq"])
        golden_kw.update(bound_min=bmin, bound_max=bmax)
        # The naive side builds the block mask from cu_seqlens directly, so
        # packing_bounds is checked end to end here too.
        naive_kw["cu_seqlens"] = (cu_q, cu_q if cu_k is None else cu_k)
    if c["bounds"] is not None:
        bmin, bmax = c["bounds"](c["sq"], c["sk"])
        golden_kw.update(bound_min=bmin, bound_max=bmax)
        naive_kw.update(bound_min=bmin, bound_max=bmax)
    return (q, k, v, dy, sinks), golden_kw, naive_kw


@pytest.mark.parametrize("name", list(CASES))
def test_forward_matches_naive(ref, name):
    (q, k, v, dy, sinks), gkw, nkw = _build(ref, name)
    want = ref.run(q, k, v, sinks=sinks, **nkw)
    o, lse, probs = golden.compute_o_lse(q, k, v, mixed_precision=True, sinks=sinks, **gkw)
    assert o.dtype == torch.float64 and lse.dtype == torch.float64
    assert lse.shape == (q.shape[0], q.shape[1], 128, q.shape[3] // 128)
    torch.testing.assert_close(o, want["o"], **F64)
    torch.testing.assert_close(ref.lse_rows(lse), want["lse"], **F64)
    torch.testing.assert_close(probs, want["probs"], **F64)
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()

    # The kernel-signature wrapper is the same computation.
    o2, lse2 = golden.attention_fwd_torch_ref(q, k, v, sinks_ref=sinks, **gkw)
    assert torch.equal(o2, o) and torch.equal(lse2, lse)


@pytest.mark.parametrize("name", list(CASES))
def test_backward_matches_autograd(ref, name):
    (q, k, v, dy, sinks), gkw, nkw = _build(ref, name)
    want = ref.run(q, k, v, dy, sinks=sinks, **nkw)
    o, lse = golden.attention_fwd_torch_ref(q, k, v, sinks_ref=sinks, **gkw)
    got = golden.attention_bwd_torch_ref(q, k, v, o, dy, lse, sinks_ref=sinks, **gkw)
    assert set(got) == {"out_dq_ref", "out_dk_ref", "out_dv_ref"} | (
        {"out_dsinks_ref"} if sinks is not None else set())
    torch.testing.assert_close(got["out_dq_ref"], want["dq"], **F64)
    torch.testing.assert_close(got["out_dk_ref"], want["dk"], **F64)
    torch.testing.assert_close(got["out_dv_ref"], want["dv"], **F64)
    assert got["out_dk_ref"].shape == k.shape and got["out_dv_ref"].shape == v.shape
    if sinks is not None:
        assert got["out_dsinks_ref"].shape == sinks.shape
        assert got["out_dsinks_ref"].dtype == torch.float64
        torch.testing.assert_close(got["out_dsinks_ref"], want["dsinks"], **F64)
    for t in got.values():
        assert torch.isfinite(t).all()


@pytest.mark.parametrize("name", ["plain", "everything", "empty_rows"])
def test_backward_ignores_o_and_lse_values(ref, name):
    """o_ref / lse_ref are shape-checked only: the golden recomputes the forward."""
    (q, k, v, dy, sinks), gkw, _ = _build(ref, name)
    o, lse = golden.attention_fwd_torch_ref(q, k, v, sinks_ref=sinks, **gkw)
    good = golden.attention_bwd_torch_ref(q, k, v, o, dy, lse, sinks_ref=sinks, **gkw)
    junk = golden.attention_bwd_torch_ref(q, k, v, torch.full_like(o, 7.0), dy,
                                          torch.full_like(lse, -3.0), sinks_ref=sinks, **gkw)
    for key in good:
        assert torch.equal(good[key], junk[key])


def test_compute_o_lse_causal_default_is_true(ref):
    (q, k, v, _, _), _, _ = _build(ref, "causal")
    o_default, _, _ = golden.compute_o_lse(q, k, v)
    o_causal, _, _ = golden.compute_o_lse(q, k, v, use_causal_mask=True)
    assert torch.equal(o_default, o_causal)


@pytest.mark.parametrize("bias_shape", ["full", "per_key", "per_head_query"])
def test_logit_bias(ref, bias_shape):
    q, k, v, _ = ref.make_inputs(2, 2, 1, 64, 128, 256, seed=3)
    g = torch.Generator().manual_seed(4)
    shape = {"full": (2, 2, 128, 256), "per_key": (256,), "per_head_query": (1, 2, 128, 1)}
    bias = torch.randn(*shape[bias_shape], generator=g, dtype=torch.float64)
    want = ref.run(q, k, v, bias=bias, scale=0.5)
    o, lse, probs = golden.compute_o_lse(q, k, v, use_causal_mask=False, softmax_scale=0.5,
                                         logit_bias=bias)
    torch.testing.assert_close(o, want["o"], **F64)
    torch.testing.assert_close(ref.lse_rows(lse), want["lse"], **F64)
    torch.testing.assert_close(probs, want["probs"], **F64)


@pytest.mark.parametrize("mask_kind", ["bool", "scaled_float"])
def test_dropout_mask(ref, mask_kind):
    """o = (probs * mask) @ v; lse and probs are the pre-dropout softmax."""
    q, k, v, _ = ref.make_inputs(1, 2, 2, 64, 128, 128, seed=5)
    g = torch.Generator().manual_seed(6)
    keep = torch.rand(1, 2, 128, 128, generator=g) >= 0.1
    # A caller wanting inverted dropout puts 1/(1-p) into the mask itself.
    mask = keep if mask_kind == "bool" else keep.to(torch.float64) / 0.9
    sinks = torch.randn(1, 2, 2, generator=g, dtype=torch.float64)
    want = ref.run(q, k, v, sinks=sinks, causal=True, dropout_mask=mask.to(torch.float64))
    no_drop = ref.run(q, k, v, sinks=sinks, causal=True)
    o, lse, probs = golden.compute_o_lse(q, k, v, use_causal_mask=True, dropout_mask=mask,
                                         sinks=sinks)
    torch.testing.assert_close(o, want["o"], **F64)
    torch.testing.assert_close(ref.lse_rows(lse), no_drop["lse"], **F64)
    torch.testing.assert_close(probs, no_drop["probs"], **F64)
