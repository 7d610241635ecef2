"""The corners fuzzing found, through the public API in every dtype: the LSE of a row that sees no key when every
sink of its head is -inf and the forward's exponent factor is large (soft-capping, or a power-of-two scale of 4
or more), and S_dmask being a probability distribution; and the ALiBi slope rule."""
import math

import pytest
import torch

import nki_attn
from nki_attn import kernel_api

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
NEG_INF = float("-inf")


def _qkv(dt, b=1, sq=4, sk=2, h=1, hk=1, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, sq, h, d, generator=g).to(dt), torch.randn(b, sk, hk, d, generator=g).to(dt),
            torch.randn(b, sk, hk, d, generator=g).to(dt))


@pytest.mark.parametrize("dt", DTYPES, ids=str)
@pytest.mark.parametrize("kw", [dict(softcap=10.0), dict(softmax_scale=4.0), dict(softcap=50.0, softmax_scale=0.3),
                                dict(softcap=3.0)], ids=str)
@pytest.mark.parametrize("sinks", [torch.tensor([NEG_INF]), torch.tensor([[NEG_INF, NEG_INF]])], ids=["1", "2"])
def test_empty_rows_with_all_inf_sinks_have_infinite_lse(dt, kw, sinks):
    """The reported repro (causal, 4 queries, 2 keys: the first two rows see no key) and its relatives: lse +inf
    and o 0 on empty rows, whatever the exponent factor; the other rows as without sinks, dsinks 0."""
    q, k, v = _qkv(dt)
    s = sinks.clone().requires_grad_()
    o, lse = nki_attn.flash_attn_func(q, k, v, causal=True, sinks=s, return_lse=True, **kw)
    o_ref, lse_ref = nki_attn.flash_attn_func(q, k, v, causal=True, return_lse=True, **kw)
    assert torch.equal(lse[0, 0, :2], torch.full((2,), math.inf)), lse
    assert torch.equal(o[0, :2], torch.zeros_like(o[0, :2]))
    assert torch.equal(lse, lse_ref) and torch.equal(o, o_ref)
    o.float().sum().backward()
    assert torch.equal(s.grad, torch.zeros_like(s))


def test_empty_rows_with_all_inf_sinks_through_the_kernels():
    """The same corner on the kernels' own layout (aligned lengths, no padding): a head with all sinks -inf, one
    with a finite sink, causal with seqlen_q > seqlen_k so the first 128 rows see no key."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 2, 16, 256, generator=g)
    k, v = torch.randn(1, 1, 16, 128, generator=g), torch.randn(1, 1, 16, 128, generator=g)
    sinks = torch.tensor([[NEG_INF, 0.5]])
    o, lse = kernel_api.attention_fwd(q, k, v, sinks, use_causal_mask=True, softcap=10.0)
    rows = lse.permute(0, 1, 3, 2).reshape(1, 2, 256)  # row t * 128 + p at [p, t]
    assert torch.isinf(rows[0, 0, :128]).all() and (rows[0, 0, :128] > 0).all()
    assert torch.allclose(rows[0, 1, :128], torch.full((128,), 0.5))  # only the sink: lse = the sink's logit
    assert torch.isfinite(rows[:, :, 128:]).all()


@pytest.mark.parametrize("dt", DTYPES, ids=str)
@pytest.mark.parametrize("kw", [dict(causal=True, softcap=5.0), dict(window_size=(3, 9), alibi_slopes=None),
                                dict(causal=True, dropout_p=0.3, dropout_seed=11)], ids=["softcap", "window",
                                                                                          "dropout"])
def test_s_dmask_rows_sum_to_one_within_float32_rounding(dt, kw):
    """S_dmask is normalised in float32: a row that sees n keys sums to 1 within n float32 roundings in every
    dtype (the kernel's 16-bit LSE would leave rows at 0.97-1.02); a row that sees one key is exactly 1; masked
    entries are 0; with dropout the magnitudes (the sign only marks dropped entries) sum to 1."""
    q, k, v = _qkv(dt, b=2, sq=150, sk=150, h=4, hk=2, d=48)
    if "alibi_slopes" in kw:
        kw = dict(kw, alibi_slopes=torch.tensor([0.1, -0.05, 0.2, 0.0]))
    out, lse, p = nki_attn.flash_attn_func(q, k, v, return_attn_probs=True, **kw)
    assert p.dtype == torch.float32
    seen = (p != 0).sum(-1)
    sums = p.abs().sum(-1)
    assert (seen > 0).all()
    assert ((sums - 1).abs() <= seen * 2.0 ** -23).all(), (sums - 1).abs().max()
    if kw.get("causal"):
        assert torch.equal(p.abs()[:, :, 0, 0], torch.ones_like(p[:, :, 0, 0]))  # row 0 sees key 0 only
        assert torch.equal(p[:, :, 0, 1:], torch.zeros_like(p[:, :, 0, 1:]))
    if "dropout_p" in kw:
        assert (p < 0).any() and (p > 0).any()


@pytest.mark.parametrize("dt", DTYPES, ids=str)
def test_s_dmask_with_sinks_and_empty_rows(dt):
    """With sinks a row's S_dmask plus its sinks' share sums to 1 (the sinks' share computed in float64 from the
    same float32 scores); all-(-inf) sinks change nothing; rows that see no key are 0."""
    q, k, v = _qkv(dt, sq=40, sk=20, h=2, hk=1, d=16)
    sinks = torch.tensor([0.7, NEG_INF])
    _, _, p = nki_attn.flash_attn_func(q, k, v, causal=True, sinks=sinks, return_attn_probs=True)
    _, _, p0 = nki_attn.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert torch.equal(p[0, :, :20], torch.zeros_like(p[0, :, :20]))  # causal, sq > sk: rows 0-19 see no key
    assert torch.equal(p[:, 1], p0[:, 1])
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.expand(-1, -1, 2, -1).float()).double() * 16 ** -0.5
    vis = torch.ones(40, 20, dtype=torch.bool).tril(-20)
    s = s[:, 0, 20:].masked_fill(~vis[20:], NEG_INF)
    share = torch.exp(0.7 - torch.logsumexp(torch.cat([s, torch.full((1, 20, 1), 0.7, dtype=torch.float64)], -1), -1))
    total = p[:, 0, 20:].double().sum(-1) + share
    assert ((total - 1).abs() <= 21 * 2.0 ** -23).all(), (total - 1).abs().max()


def test_alibi_slopes_of_either_sign_are_accepted_and_non_finite_refused():
    """A negative slope is FlashAttention's bias -slope * distance with the sign it has (favouring distant keys);
    NaN or inf is refused with an error naming alibi_slopes."""
    q, k, v = _qkv(torch.float32, sq=30, sk=30, h=2, hk=2, d=16)
    slopes = torch.tensor([-0.2, 0.15])
    out = nki_attn.flash_attn_func(q, k, v, alibi_slopes=slopes).double()
    i = torch.arange(30)
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * 0.25
    s = s - slopes.double()[None, :, None, None] * (i[:, None] - i[None, :]).abs()
    ref = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v.double())
    assert (out - ref).abs().max() < 1e-5
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="alibi_slopes.*finite"):
            nki_attn.flash_attn_func(q, k, v, alibi_slopes=torch.tensor([0.1, bad]))


def test_api_row_whose_packed_sequences_are_all_empty():
    """Packing in which every sequence is empty (no query row sees a key) with sinks, through the API: o = 0,
    lse = logsumexp(sinks), and dsinks 0 although the API's graph never reaches the sinks (no grad at all)."""
    from nki_attn.harness.cases import Case
    from nki_attn.harness.runner import KernelCandidate, run_case
    case = Case(name="fuzz1-154", batch=1, heads=1, kv_heads=1, seqlen_q=7, seqlen_k=7, d_head=48, d_v=25,
                dtype="float32", causal=True, num_sinks=3, sinks_inf="head", cu_seqlens=(0, 0, 0, 0, 0))
    row = run_case(case, KernelCandidate())
    assert row["status"] == "pass", row.get("error")
    assert row["outputs"]["dsinks"]["max_abs"] == 0.0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_gradients_that_cancel_to_exactly_zero_get_a_floor(dtype):
    """One query and one key: P = 1, so dP = D and the float64 dq, dk are exactly 0, while any float32
    implementation leaves a rounding residue. Their floor is measured by the size the cancelling terms would
    add up to (runner.zero_scale), not by max|ref| = 0: our kernels pass, and the bound stays a small fraction
    of that size (FLOOR[dtype] plus the accumulation term)."""
    from nki_attn.harness import tolerance
    from nki_attn.harness.cases import Case
    from nki_attn.harness.runner import KernelCandidate, make_inputs, run_case, zero_scale
    case = Case(name="fuzz1-e", batch=1, heads=2, kv_heads=2, seqlen_q=1, seqlen_k=1, d_head=8, dtype=dtype)
    row = run_case(case, KernelCandidate())
    assert row["status"] == "pass", row
    ins = make_inputs(case)
    for name in ("dq", "dk"):
        out = row["outputs"][name]
        zs = zero_scale(name, ins, case, out["n"])
        assert out["bound"] == pytest.approx(tolerance.floor_rel(dtype, out["n"]) * zs + out["residue_floor"])
        assert 0 < out["bound"] < 0.01 * zs


def _saturated_case():
    """fuzz1-701: float16, scale 4 at head_dim 128 (a saturated softmax: every row is in effect one key), signed
    ALiBi, 9 packed tokens."""
    from nki_attn.harness import fuzz
    return fuzz.draw(1, 701)


def test_residue_floor_covers_a_float32_running_sum_where_ds_cancels():
    """Where the softmax saturates, dP_ij = dO_i . V_j and D_i = dO_i . O_i are nearly equal and dq, dk are what
    is left of their difference: far below the float32 rounding of either. Evaluating dS with both reductions as
    float32 running sums (the worst common order) leaves a dq / dk error that the rule-1 floor relative to
    max|ref| does not cover, and that the derived residue term (runner.residue_scales) does."""
    import numpy as np
    from nki_attn.harness import runner, tolerance
    case = _saturated_case()
    ins = runner.make_inputs(case)
    ref = runner.reference(ins, case, torch.float64)
    res = runner.residue_scales(ins, ref, case)
    f32 = np.float32
    o, dy = ref["o"].numpy().astype(f32), ins["dy"].float().numpy()
    q, k, v = (ins[n].double().numpy() for n in ("q", "k", "v"))
    scale = case.scale
    group = case.heads // case.kv_heads
    dd = np.cumsum(o * dy, axis=2, dtype=f32)[:, :, -1, :]                                    # D [b, h, sq]
    for hq, g, p, _, _, _ in runner._softmax_groups(ins, ref, case, torch.float64):
        p = p.numpy()
        hs = slice(hq.start, hq.stop)
        dp = np.cumsum(dy[:, hs, :, :, None] * ins["v"].float().numpy()[:, g, None, :, None, :], axis=2,
                       dtype=f32)[:, :, -1]                                                   # dP [b, h, sq, sk]
        ds = p * (dp.astype(np.float64) - dd[:, hs, :, None].astype(np.float64))
        dq = np.einsum("bhqk,bdk->bhdq", ds, k[:, g]) * scale
        dk = np.einsum("bhqk,bhdq->bdk", ds, q[:, hs]) * scale
        for name, got, r in (("dq", dq, ref["dq"][:, hs]), ("dk", dk, ref["dk"][:, g])):
            err = float(np.abs(got - r.numpy()).max())
            floor_old = tolerance.floor_rel(case.dtype, tolerance.reduction_lengths(case)[name]) * \
                float(ref[name].abs().max())
            assert floor_old < err <= tolerance.LAMBDA * tolerance.U_ACC * res[name], (name, g, err, floor_old)
    assert group == 1


def test_saturated_softmax_row_passes_with_the_residue_floor():
    """The fuzz row that failed before the residue term (dq, dk at 1.9 times the bound without it): our kernels pass
    it, and the residue term is what carries dq's and dk's bound (their max|ref| is 1e-7)."""
    from nki_attn.harness.runner import KernelCandidate, run_case
    row = run_case(_saturated_case(), KernelCandidate())
    assert row["status"] == "pass", row
    for name in ("dq", "dk"):
        out = row["outputs"][name]
        assert out["residue_floor"] > 0.5 * out["bound"]
