"""Identities, layouts, empty rows, softmax_dx and packing_bounds (float64 unless stated)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import golden

F64 = dict(rtol=1e-10, atol=1e-10)


def _sinks(bs, h, n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(bs, h, n, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("with_sinks", [False, True])
def test_rowsum_p_dp_equals_rowsum_o_do(ref, with_sinks):
    """sum_j P_ij dP_ij == sum_d O_id dO_id (the kernels' shortcut for D_i)."""
    q, k, v, dy = ref.make_inputs(2, 4, 2, 64, 256, 256, seed=11)
    sinks = _sinks(2, 4, 2, 12) if with_sinks else None
    bmin, bmax = golden.packing_bounds(torch.tensor([0, 70, 130, 230]), seqlen_q=256)
    o, _, probs = golden.compute_o_lse(q, k, v, use_causal_mask=True, sinks=sinks,
                                       bound_min=bmin, bound_max=bmax)
    v_rows = v.transpose(-1, -2).repeat_interleave(2, dim=1)          # [b, h, sk, d]
    dp = dy.transpose(-1, -2) @ v_rows.transpose(-1, -2)             # [b, h, sq, sk]
    lhs = (probs[..., :256] * dp).sum(-1)
    rhs = (o * dy).sum(dim=2)                                         # over d_head
    torch.testing.assert_close(lhs, rhs, **F64)


def test_lse_layout_round_trip(ref):
    """lse[b, h, p, t] is the log-sum-exp of query row t * 128 + p."""
    q, k, v, _ = ref.make_inputs(1, 2, 2, 64, 384, 384, seed=13)
    _, lse = golden.attention_fwd_torch_ref(q, k, v, use_causal_mask=True)
    assert lse.shape == (1, 2, 128, 3) and lse.dtype == torch.float64
    scores = (q.transpose(-1, -2) @ k) / math.sqrt(64)               # [b, h, sq, sk]
    for b, h, p, t in [(0, 0, 0, 0), (0, 1, 5, 1), (0, 0, 127, 2), (0, 1, 64, 2), (0, 0, 1, 0)]:
        r = t * 128 + p
        want = torch.logsumexp(scores[b, h, r, : r + 1], dim=0)      # causal: keys 0..r
        torch.testing.assert_close(lse[b, h, p, t], want, **F64)
    # Full inverse map, written with explicit integer indexing.
    rows = torch.empty(1, 2, 384, dtype=torch.float64)
    for r in range(384):
        rows[..., r] = lse[..., r % 128, r // 128]
    causal = torch.ones(384, 384, dtype=torch.bool).tril()
    want_rows = torch.logsumexp(scores.masked_fill(~causal, float("-inf")), dim=-1)
    torch.testing.assert_close(rows, want_rows, **F64)


@pytest.mark.parametrize("sink_shape", ["bh", "bhn"])
def test_dsinks_identity(ref, sink_shape):
    """dsinks[b, h, n] == -sum_i P_sink[b, h, i, n] * D_i with D_i = sum_d O * dO."""
    q, k, v, dy = ref.make_inputs(2, 4, 1, 64, 256, 256, seed=21)
    sinks = _sinks(2, 4, 2, 22)
    if sink_shape == "bh":
        sinks = sinks[..., 0]
    o, lse, probs = golden.compute_o_lse(q, k, v, use_causal_mask=True, sinks=sinks,
                                         sliding_window=40)
    got = golden.attention_bwd_torch_ref(q, k, v, o, dy, lse, sinks_ref=sinks,
                                         use_causal_mask=True, sliding_window=40)
    D = (o * dy).sum(dim=2)                                           # [b, h, sq]
    p_sink = probs[..., 256:]                                         # [b, h, sq, n]
    want = -(p_sink * D[..., None]).sum(dim=2).reshape(sinks.shape)
    torch.testing.assert_close(got["out_dsinks_ref"], want, **F64)


def test_sinks_numeric_example():
    """The worked example of docs/semantics.md: scores [1, 2], one sink of logit 0."""
    q = torch.ones(1, 1, 1, 128, dtype=torch.float64)                 # d_head = 1
    k = torch.tensor([1.0, 2.0], dtype=torch.float64).reshape(1, 1, 1, 2)  # seqlen_k = 2
    v = torch.tensor([10.0, 20.0], dtype=torch.float64).reshape(1, 1, 1, 2)
    o, lse, probs = golden.compute_o_lse(q, k, v, use_causal_mask=False, softmax_scale=1.0,
                                         sinks=torch.zeros(1, 1, dtype=torch.float64))
    z = math.e + math.e ** 2 + 1.0
    assert probs[0, 0, 0].tolist() == pytest.approx([math.e / z, math.e ** 2 / z, 1.0 / z])
    assert float(lse[0, 0, 0, 0]) == pytest.approx(math.log(z))
    assert float(o[0, 0, 0, 0]) == pytest.approx((10 * math.e + 20 * math.e ** 2) / z)
    # The rounded numbers quoted in the doc.
    assert [round(x, 4) for x in probs[0, 0, 0].tolist()] == [0.2447, 0.6652, 0.09]
    assert round(float(lse[0, 0, 0, 0]), 4) == 2.4076
    assert round(float(o[0, 0, 0, 0]), 4) == 15.7521
    # Without the sink: softmax([1, 2]) = [0.2689, 0.7311], o = 17.3106.
    o2, _, _ = golden.compute_o_lse(q, k, v, use_causal_mask=False, softmax_scale=1.0)
    assert round(float(o2[0, 0, 0, 0]), 4) == 17.3106
    # dO = 1 on every row: D_i = O_i = 15.7521, each of the 128 identical
    # rows adds -p_sink * D_i = -1.4182 to dsinks.
    sinks = torch.zeros(1, 1, dtype=torch.float64)
    got = golden.attention_bwd_torch_ref(q, k, v, o, torch.ones_like(q), lse, sinks_ref=sinks,
                                         softmax_scale=1.0)
    assert round(float(got["out_dsinks_ref"][0, 0]) / 128, 4) == -1.4182


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mixed", [False, True])
def test_empty_rows_convention(ref, dtype, mixed):
    """No visible key (and no sink): o = 0, lse = +inf, zero grads, no NaN anywhere."""
    q, k, v, dy = ref.make_inputs(1, 4, 2, 64, 256, 256, dtype=dtype, seed=31)
    # 3 sequences in 200 rows, rows 200..255 are padding; with causal, the
    # bounds [i + 1, ...) of row 7 leave nothing either.
    bmin, bmax = golden.packing_bounds(torch.tensor([0, 20, 90, 200]), seqlen_q=256)
    bmin[7] = 8.0
    o, lse = golden.attention_fwd_torch_ref(q, k, v, bound_min=bmin, bound_max=bmax,
                                            use_causal_mask=True, mixed_precision=mixed)
    rows = ref.lse_rows(lse)
    empty = [7] + list(range(200, 256))
    assert torch.all(o[..., empty] == 0)
    assert torch.all(rows[..., empty] == float("inf"))
    assert torch.isfinite(rows[..., :7]).all() and torch.isfinite(rows[..., 8:200]).all()
    got = golden.attention_bwd_torch_ref(q, k, v, o, dy, lse, bound_min=bmin, bound_max=bmax,
                                         use_causal_mask=True, mixed_precision=mixed)
    assert torch.all(got["out_dq_ref"][..., empty] == 0)
    for t in (o, *got.values()):
        assert torch.isfinite(t).all()
    # Keys only padding rows could see (none: padding sees nothing) get no
    # gradient; keys 200.. are outside every sequence.
    assert torch.all(got["out_dk_ref"][..., 200:] == 0)
    assert torch.all(got["out_dv_ref"][..., 200:] == 0)


def test_all_rows_empty_gives_all_zero(ref):
    q, k, v, dy = ref.make_inputs(1, 2, 2, 64, 128, 128, seed=32)
    zero = torch.zeros(128, dtype=torch.float32)
    o, lse = golden.attention_fwd_torch_ref(q, k, v, bound_min=zero, bound_max=zero)
    assert torch.all(o == 0) and torch.all(lse == float("inf"))
    got = golden.attention_bwd_torch_ref(q, k, v, o, dy, lse, bound_min=zero, bound_max=zero)
    for t in got.values():
        assert torch.all(t == 0)


def test_row_with_only_sinks(ref):
    """With sinks an otherwise empty row is not empty: o = 0, lse = logsumexp(sinks)."""
    q, k, v, dy = ref.make_inputs(1, 2, 2, 64, 128, 128, seed=33)
    sinks = _sinks(1, 2, 2, 34)
    zero = torch.zeros(128, dtype=torch.float32)
    o, lse = golden.attention_fwd_torch_ref(q, k, v, sinks_ref=sinks, bound_min=zero,
                                            bound_max=zero)
    assert torch.all(o == 0)
    want = torch.logsumexp(sinks, dim=-1)[..., None].expand(1, 2, 128)
    torch.testing.assert_close(ref.lse_rows(lse), want, **F64)
    got = golden.attention_bwd_torch_ref(q, k, v, o, dy, lse, sinks_ref=sinks,
                                         bound_min=zero, bound_max=zero)
    # o does not depend on the sinks here, so neither does the loss.
    assert torch.all(got["out_dsinks_ref"] == 0)


@pytest.mark.parametrize("dim", [-1, 1])
def test_softmax_dx_matches_autograd(dim):
    g = torch.Generator().manual_seed(41)
    x = torch.randn(3, 5, 7, generator=g, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(3, 5, 7, generator=g, dtype=torch.float64)
    y = torch.softmax(x, dim=dim)
    y.backward(dy)
    got = golden.softmax_dx(dy, y.detach(), dim=dim)
    torch.testing.assert_close(got, x.grad, **F64)


def test_softmax_dx_dtypes():
    y = torch.softmax(torch.randn(4, 8), -1).to(torch.bfloat16)
    dy = torch.randn(4, 8).to(torch.bfloat16)
    assert golden.softmax_dx(dy, y, -1).dtype == torch.bfloat16
    assert golden.softmax_dx(dy, y, -1, mixed_precision=True).dtype == torch.float32
    assert golden.softmax_dx(dy.double(), y.double(), -1, True).dtype == torch.float64
    with pytest.raises(ValueError, match="dy.shape"):
        golden.softmax_dx(dy[:, :4], y, -1)


# ---------------------------------------------------------------- packing_bounds


def test_packing_bounds_doc_example():
    """cu_seqlens [0, 3, 5, 8] (the table in docs/semantics.md), padded to 10 rows."""
    bmin, bmax = golden.packing_bounds(torch.tensor([0, 3, 5, 8], dtype=torch.int32),
                                       seqlen_q=10)
    assert bmin.dtype == torch.float32 and bmax.dtype == torch.float32
    assert bmin.tolist() == [0, 0, 0, 3, 3, 5, 5, 5, 0, 0]
    assert bmax.tolist() == [3, 3, 3, 5, 5, 8, 8, 8, 0, 0]
    bmin2, bmax2 = golden.packing_bounds([0, 3, 5, 8])
    assert bmin2.tolist() == bmin.tolist()[:8] and bmax2.tolist() == bmax.tolist()[:8]


def test_packing_bounds_cross_and_empty_sequence():
    bmin, bmax = golden.packing_bounds(torch.tensor([0, 2, 2, 4]), torch.tensor([0, 5, 9, 10]))
    # Sequence 1 has no queries, so its keys 5..8 are seen by no one.
    assert bmin.tolist() == [0, 0, 9, 9]
    assert bmax.tolist() == [5, 5, 10, 10]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 6), min_size=1, max_size=5),
       st.lists(st.integers(0, 6), min_size=1, max_size=5), st.integers(0, 4))
def test_packing_bounds_brute_force(lens_q, lens_k, pad):
    n = min(len(lens_q), len(lens_k))
    cu_q = [0]
    cu_k = [0]
    for a, b in zip(lens_q[:n], lens_k[:n]):
        cu_q.append(cu_q[-1] + a)
        cu_k.append(cu_k[-1] + b)
    seqlen_q = cu_q[-1] + pad
    bmin, bmax = golden.packing_bounds(torch.tensor(cu_q), torch.tensor(cu_k), seqlen_q)
    assert bmin.shape == (seqlen_q,)
    for i in range(seqlen_q):
        owners = [s for s in range(n) if cu_q[s] <= i < cu_q[s + 1]]
        want = (cu_k[owners[0]], cu_k[owners[0] + 1]) if owners else (0, 0)
        assert (bmin[i].item(), bmax[i].item()) == want


def test_masks_drawn_in_docs(ref):
    """The 4x4 matrices drawn in docs/semantics.md (1 = visible)."""
    assert ref.allowed_matrix(4, 4, causal=True).int().tolist() == [
        [1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    assert ref.allowed_matrix(4, 4, causal=True, window=2).int().tolist() == [
        [1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]
    # And the golden draws the same matrices: key j of row i is probs > 0.
    q = torch.zeros(1, 1, 8, 128, dtype=torch.float64)
    k = torch.zeros(1, 1, 8, 128, dtype=torch.float64)
    for window, want in [(None, ref.allowed_matrix(128, 128, causal=True)),
                         (2, ref.allowed_matrix(128, 128, causal=True, window=2))]:
        _, _, probs = golden.compute_o_lse(q, k, k, use_causal_mask=True, sliding_window=window)
        assert torch.equal(probs[0, 0] > 0, want)
