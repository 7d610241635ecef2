"""Focused kernel tests the matrix cannot express: exact values (empty rows, sinks of empty rows, the pre-dropout
LSE), bit-identical results across targets, core counts and K/V sections, and what the instruction trace must hold
(tile skipping, one row sum per query tile, what each variant adds). Accuracy checks use conftest.py's criterion.
"""
import numpy as np
import pytest
import torch

from golden.dropout import make_seed
from nki_attn import kernel_api
from nki_attn.kernels.attention_fwd import attention_fwd
from nki_attn.sim import trace
from nki_attn.sim.errors import NkiValidationError

from .conftest import Case, empty_rows, run_bwd_case, run_fwd_case


def _bits(x):
    """The bytes of a kernel output (torch or numpy), so equal means bit-identical (signed zeros, NaN payloads)."""
    if isinstance(x, torch.Tensor):
        return x.detach().contiguous().view(torch.uint8).numpy()
    return np.ascontiguousarray(x).view(np.uint8)


def _same(outs_a, outs_b):
    assert len(outs_a) == len(outs_b)
    for a, b in zip(outs_a, outs_b):
        assert np.array_equal(_bits(a), _bits(b))


# ----------------------------------------------------------------------------------------------- exact values
@pytest.mark.parametrize("causal", [False, True])
def test_fwd_rows_with_no_visible_key(causal):
    # padding rows 450..511 see nothing (packing_bounds gives them [0, 0)); row 7 is emptied by hand
    c = Case(h=2, sq=512, seed=3, causal=causal, mixed=True, cu=[0, 100, 333, 450])
    c.opts["bound_min"][7], c.opts["bound_max"][7] = 50.0, 50.0   # the kernel keywords hold the same tensors
    o, lse = c.fwd()
    _, lse_ref = c.check_fwd(o, lse)
    empty = empty_rows(lse)
    assert torch.equal(empty, empty_rows(lse_ref))
    assert empty[0, 0, 7] and empty[0, 0, 450:].all() and empty.sum() == 2 * 63
    o_rows = o.transpose(-1, -2)  # [bs, h, sq, d]
    assert torch.equal(o_rows[empty], torch.zeros_like(o_rows[empty]))


def test_fwd_sinks_with_empty_rows():
    # a row with no visible key but a sink is not empty: o = 0, lse = the sink logit
    c, o, lse = run_fwd_case(sinks=1, sink_value=0.7, cu=[0, 200], mixed=True)
    assert torch.isfinite(lse).all()
    rows = lse.transpose(-1, -2).reshape(-1)
    assert torch.allclose(rows[200:], torch.full((56,), 0.7), atol=1e-6)
    assert torch.equal(o[..., 200:], torch.zeros_like(o[..., 200:]))


def test_fwd_softcap_changes_the_result():
    c = Case(h=2, q_mul=6.0, seed=3)
    o1, _ = c.fwd(softcap=2.0)
    o0, _ = c.fwd()
    assert (o1 - o0).abs().max() > 1e-2


def test_fwd_dropout_lse_is_pre_dropout_and_mask_matters():
    c = Case(h=2, causal=True, seed=20)
    o0, lse0 = c.fwd()
    o1, lse1 = c.fwd(dropout_p=0.3, dropout_seed=make_seed(1234, 7))
    o2, _ = c.fwd(dropout_p=0.3, dropout_seed=make_seed(1234, 8))
    assert torch.equal(lse0, lse1)  # the LSE is the pre-dropout one, bit for bit
    assert (o1 - o0).abs().max() > 1e-2 and (o1 - o2).abs().max() > 1e-2  # the mask, and the seed, matter
    o3, _ = c.fwd(dropout_p=0.3, dropout_seed=make_seed(1234, 7))
    assert torch.equal(o1, o3)  # deterministic given the seed


def test_bwd_dropout_sections_and_seed():
    c = Case(dropout_p=0.25, causal=True, sq=384, h=2, hk=1)
    out = c.bwd(k_section_len=128)
    c.check_bwd(out)
    # another seed gives other gradients (the mask is really applied)
    other = Case(dropout_p=0.25, causal=True, sq=384, h=2, hk=1, dropout_seed=(99, 0))
    assert not np.array_equal(np.asarray(other.bwd()[2]), np.asarray(out[2]))


def test_bwd_section_count_does_not_change_results():
    c = Case(sq=512, causal=True, h=2, hk=1)
    one = c.bwd()
    two = c.bwd(k_section_len=256)
    c.check_bwd(two)
    # only the grouping of the dQ partial sums changes (fp32 rounding)
    for a, b in zip(one, two):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------------------------- targets, cores
@pytest.mark.parametrize("tgt", ["trn1", "trn2", "trn3"])
def test_fwd_targets(tgt, target):
    target(tgt)
    run_fwd_case(h=2, sq=512, seed=11, mixed=True, cu=[0, 100, 333, 450], causal=True, window=120, sinks=1)
    run_fwd_case(d=96, dtype="bfloat16", mixed=True, seed=12, causal=True)


@pytest.mark.parametrize("tgt", ["trn1", "trn3"])
def test_fwd_bands_on_other_generations(tgt, target):
    # trn1 masks by affine_select (no range_select); trn3 like trn2
    target(tgt)
    run_fwd_case(h=2, sq=512, sk=384, seed=11, mixed=True, window_size=(60, 30))
    run_fwd_case(h=2, sq=256, sk=512, seed=12, mixed=True, alibi=True, causal=True, softcap=10.0)


@pytest.mark.parametrize("tgt", ["trn1", "trn2", "trn3"])
def test_bwd_targets(tgt, target):
    target(tgt)
    run_bwd_case(cu=[0, 100, 250, 384], sq=384, causal=True, window=120, h=2, hk=1, sinks=1)
    run_bwd_case(causal=True, dtype="bfloat16")


def test_fwd_trn1_packing_fallback_matches_range_select(target):
    c = Case(h=2, sq=512, seed=13, causal=True, mixed=True, cu=[0, 100, 333, 450])
    out = {}
    for tgt in ("trn1", "trn2"):
        target(tgt)
        out[tgt] = c.fwd()
    _same(out["trn1"], out["trn2"])


@pytest.mark.parametrize("tgt", ["trn2", "trn3"])
def test_fwd_lnc2_bit_identical(tgt, target):
    target(tgt)
    # bs * nheads_kv = 3 work items: an uneven split between the two cores
    c = Case(h=6, hk=3, sq=384, seed=14, mixed=True, cu=[0, 150, 384], causal=True, sinks=1)
    one = c.fwd()
    _same(one, c.fwd(lnc=1))
    _same(one, c.fwd(lnc=2))


def test_fwd_lnc2_more_cores_than_work(target):
    target("trn2")
    c = Case(seed=15, mixed=True)  # one work item: core 1 idles
    _same(c.fwd(), c.fwd(lnc=2))


@pytest.mark.parametrize("tgt", ["trn2", "trn3"])
@pytest.mark.parametrize("kw", [dict(bs=2, h=2, hk=1, causal=True, sinks=1, sq=128),
                                dict(bs=3, h=2, hk=1, sq=128, dtype="bfloat16", mixed=True)],
                         ids=["even-items", "odd-items"])
def test_bwd_lnc2_bit_identical(tgt, kw, target):
    target(tgt)
    c = Case(**kw)
    single = c.bwd()
    c.check_bwd(single)
    _same(single, c.bwd(lnc=2))


def test_bwd_trn1_refuses_lnc2(target):
    target("trn1")
    with pytest.raises(NkiValidationError, match="LNC2"):
        Case(sq=128).bwd(lnc=2)


def test_kernel_api_launches_the_kernel_unchanged():
    c = Case(bs=2, h=2, hk=1, dtype="bfloat16", causal=True, mixed=True)
    want = attention_fwd[2](c.q, c.k, c.v, use_causal_mask=True)
    got = kernel_api.attention_fwd[2](c.q, c.k, c.v, use_causal_mask=True)
    _same(want, got)


# ----------------------------------------------------------------------------------------------- forward trace
def _matmuls(c, **kw):
    with trace.recording() as rec:
        c.fwd(**kw)
    return rec.count("nc_matmul")


def test_fwd_causal_tile_skipping_is_exact():
    # query tile t (128 rows) needs 512-key tiles 0..t//4 (one QK matmul each) and 128-key chunks 0..t (one PV
    # matmul each); nothing else may be computed
    nq = 8
    want_causal = sum(t // 4 + 1 for t in range(nq)) + sum(t + 1 for t in range(nq))
    want_full = nq * 2 + nq * 8
    assert _matmuls(Case(sq=1024, seed=16, causal=True)) == want_causal
    assert _matmuls(Case(sq=1024, seed=16)) == want_full


def test_fwd_window_tile_skipping_is_exact():
    # W = 128: query tile t needs chunks t-1 and t (chunk 0 only for t = 0)
    nq, w = 8, 128
    want = 0
    for t in range(nq):
        chunks = [c for c in range(8) if c <= t and (c + 1) * 128 - 1 >= t * 128 - w + 1]
        want += len({c // 4 for c in chunks}) + len(chunks)
    assert _matmuls(Case(sq=1024, seed=16, causal=True, window=w)) == want


def test_fwd_window_tile_skipping_is_linear_in_seqlen():
    # a bounded two-sided window computes only the band's tiles: every 1024 more tokens add the same number of
    # matmuls (the edges are constant), and the non-causal window costs far less than full attention
    counts = {s: _matmuls(Case(d=32, sq=s, seed=13), window_size=(64, 64)) for s in (1024, 2048, 3072)}
    assert counts[3072] - counts[2048] == counts[2048] - counts[1024]
    assert counts[2048] < 0.35 * _matmuls(Case(d=32, sq=2048, seed=13))


def test_fwd_default_launch_has_no_variant_steps():
    c = Case(h=2, causal=True)
    with trace.recording() as rec:
        c.fwd()
    assert rec.count("iota") <= 1  # the causal key bounds only
    with trace.recording() as rec2:
        c.fwd(softcap=0.0, alibi_slopes=None, window_size=None)
    assert rec2.count() == rec.count()


def test_fwd_softcap_adds_one_activation_per_score_tile():
    c = Case(sq=512)
    with trace.recording() as r0:
        c.fwd()
    with trace.recording() as r1:
        c.fwd(softcap=10.0)

    def tanh_like(rec):  # ScalarE activations from the PSUM scores into a float32 [128, 512] SBUF tile: only the
        # soft-cap's (a float32 P^T eviction on ScalarE has 512 elements too, as a [128, 4, 128] tile)
        return sum(1 for r in rec.records if r.instr == "activation" and r.srcs[0].buffer == "psum"
                   and r.dst.dtype == "float32" and r.dst.free_elems == 512 and len(r.dst.shape) == 2)
    n_tiles = 512 // 128  # one 512-key score tile per query tile
    assert tanh_like(r0) == 0 and tanh_like(r1) == n_tiles
    assert r1.count("nc_matmul") == r0.count("nc_matmul")
    # the tanh makes ScalarE the busiest engine: the Q scaling and O finishing moved to VectorE
    assert r1.counts_by_engine()["ScalarE"] < r0.counts_by_engine()["ScalarE"] + n_tiles


@pytest.mark.parametrize("sq,sk,window,h,hk", [(256, 2560, None, 4, 1), (384, 384, 100, 2, 2),
                                                (256, 640, None, 16, 1)])
def test_fwd_alibi_causal_bf16_by_tensor_engine(sq, sk, window, h, hk):
    # causal bf16 adds the bias's key part in PSUM by a matmul (the row part folded into the LSE): one more
    # matmul per computed score tile; across key blocks, with a window, and with a group of 16 heads (two blocks
    # per query tile)
    c = Case(h=h, hk=hk, sq=sq, sk=sk, alibi=True, dtype="bfloat16", mixed=True, seed=sq + h, causal=True,
             window=window)
    with trace.recording() as rec:
        o, lse = c.fwd()
    c.check_fwd(o, lse)
    with trace.recording() as base:
        c.fwd(alibi_slopes=None)
    # one score tile = one eviction (tensor_scalar_reduce when fully visible, range_select otherwise, trn2)
    n_score = base.count("tensor_scalar_reduce") + base.count("range_select")
    assert rec.count("nc_matmul") - base.count("nc_matmul") == n_score
    assert rec.count("tensor_scalar_reduce") == base.count("tensor_scalar_reduce")  # no extra VectorE pass


# ----------------------------------------------------------------------------------------------- backward trace
def _exp_count(rec):
    """exp activations: the only activations with a tensor bias (-LSE, or the sink logit); the dQ and dS^T
    copies on ScalarE have none."""
    return sum(1 for r in rec.records if r.instr == "activation" and len(r.srcs) == 2)


def _bwd_trace(c, **extra):
    with trace.recording() as rec:
        c.bwd(**extra)
    return rec


def _mm_columns(rec):
    return sum(r.dst.free_elems for r in rec.records if r.instr == "nc_matmul" and not r.is_transpose)


def _d_matmuls(rec):
    """The ones-vector matmuls that sum O*dO over the head dim: the kernel's only matmuls with one column."""
    return sum(1 for r in rec.records if r.instr == "nc_matmul" and r.dst.free_elems == 1)


def test_bwd_section_length_argument():
    c = Case(sq=384, causal=True, sinks=1)
    with trace.recording() as rec:
        out = c.bwd(k_section_len=256)
    c.check_bwd(out)
    # sections [0, 256) and [256, 384): query tile 2 needs both, so 3 + 1 exps of P, and one for the sink (all
    # the query rows of the head at once)
    assert _exp_count(rec) == 4 + 1


def test_bwd_rowsum_once_per_query_tile_whatever_the_sections():
    c = Case(sq=512, h=2, hk=1, causal=True, sinks=1)
    full = _bwd_trace(c)
    split = _bwd_trace(c, k_section_len=128)
    n_rows = 2 * 512 // 128  # query heads x query tiles
    assert _d_matmuls(full) == _d_matmuls(split) == n_rows
    # one exp per visible (query tile, key tile) pair and one per (head, sink) for the sinks
    assert _exp_count(full) == 4 * 2 + 2                 # one 512-key tile per query tile
    assert _exp_count(split) == (1 + 2 + 3 + 4) * 2 + 2  # causal: query tile i sees sections 0..i


def test_bwd_causal_tiles_are_skipped():
    base = _bwd_trace(Case(sq=512))
    causal = _bwd_trace(Case(sq=512, causal=True))
    # 4 query tiles x 1 key tile of 512: non-causal 4 pairs, causal the same 4 pairs trimmed to 1..4 chunks
    assert _exp_count(base) == _exp_count(causal) == 4
    # TensorE work: matmul columns streamed (a diagonal pair computes only its visible 128-key chunks)
    assert _mm_columns(causal) < 0.65 * _mm_columns(base)
    window = _bwd_trace(Case(sq=512, causal=True, window=128))
    assert _mm_columns(window) < _mm_columns(causal)


def _instrs(rec):
    out = {}
    for r in rec.records:
        out[r.instr] = out.get(r.instr, 0) + 1
    return out


def test_bwd_variants_add_their_steps_only():
    rec0 = _bwd_trace(Case(causal=True, h=2, hk=1))
    rec1 = _bwd_trace(Case(causal=True, h=2, hk=1, softcap=2.0))
    rec2 = _bwd_trace(Case(causal=True, h=2, hk=1, alibi=True))
    i0, i1, i2 = _instrs(rec0), _instrs(rec1), _instrs(rec2)
    # one exp per visit: the only activations with a tensor bias (-LSE)
    visits = _exp_count(rec0)
    assert visits > 0 and "iota" not in i0
    # soft-capping: one tanh activation per visit, one t^2 (GpSimdE) and one VectorE op per visit
    assert i1["activation"] == i0["activation"] + visits
    assert i1["tensor_tensor"] == i0.get("tensor_tensor", 0) + visits
    assert i1["scalar_tensor_tensor"] == i0["scalar_tensor_tensor"] + visits
    # ALiBi: one iota and one VectorE op per visit (causal: no tile needs |x|), two ops per work item
    assert i2["iota"] == visits
    assert i2["scalar_tensor_tensor"] == i0["scalar_tensor_tensor"] + visits
    assert i2["nc_matmul"] == i0["nc_matmul"]
