"""Each simulated instruction against a numpy formula (hypothesis where cheap), including rounding on write."""
import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from simtools import BF16, empty, tile, val

from nki_attn.sim import NkiValidationError
from nki_attn.sim import isa as nisa
from nki_attn.sim import language as nl

FMIN = -3.4028235e38
finite = st.floats(-1e3, 1e3, width=32, allow_nan=False)


def arrays(p=8, f=16):
    return hnp.arrays(np.float32, (p, f), elements=finite)


# ------------------------------------------------------------------ tensor_tensor / tensor_scalar / stt
BINARY = {
    nl.add: np.add, nl.subtract: np.subtract, nl.multiply: np.multiply, nl.maximum: np.maximum,
    nl.minimum: np.minimum, nl.greater_equal: lambda a, b: (a >= b).astype(np.float32),
    nl.less: lambda a, b: (a < b).astype(np.float32), nl.equal: lambda a, b: (a == b).astype(np.float32),
}


@settings(max_examples=25, deadline=None)
@given(a=arrays(), b=arrays(), op=st.sampled_from(list(BINARY)))
def test_tensor_tensor_matches_numpy(a, b, op):
    dst = empty(a.shape)
    nisa.tensor_tensor(dst=dst, data1=tile(a), data2=tile(b), op=op)
    np.testing.assert_array_equal(val(dst), BINARY[op](a, b).astype(np.float32))


def test_tensor_tensor_rounds_result_to_bf16_nearest_even():
    # 1 + 2^-8 is half-way between bf16 neighbours 1 and 1 + 2^-7: ties go to the even mantissa (1.0);
    # 1 + 3*2^-8 is half-way between 1 + 2^-7 (odd) and 1 + 2^-6 (even).
    a = np.array([[1.0, 1.0, 1.0]], np.float32)
    b = np.array([[2.0 ** -8, 3 * 2.0 ** -8, 2.0 ** -9]], np.float32)
    dst = empty((1, 3), nl.bfloat16)
    nisa.tensor_tensor(dst=dst, data1=tile(a), data2=tile(b), op=nl.add)
    np.testing.assert_array_equal(val(dst), [[1.0, 1.0 + 2.0 ** -6, 1.0]])


def test_precise_fp_off_keeps_float32(monkeypatch):
    monkeypatch.setenv("NKI_PRECISE_FP", "0")
    a = np.array([[1.0]], np.float32)
    dst = empty((1, 1), nl.bfloat16)
    nisa.tensor_tensor(dst=dst, data1=tile(a), data2=tile(np.array([[2.0 ** -9]], np.float32)), op=nl.add)
    assert val(dst)[0, 0] == 1.0 + 2.0 ** -9


def test_tensor_tensor_rejects_two_psum_inputs():
    a = tile(np.ones((4, 4), np.float32), buffer=nl.psum)
    b = tile(np.ones((4, 4), np.float32), buffer=nl.psum)
    with pytest.raises(NkiValidationError, match="tensor_tensor: data2.*both inputs are in PSUM"):
        nisa.tensor_tensor(dst=empty((4, 4)), data1=a, data2=b, op=nl.add)


def test_tensor_tensor_pairs_by_partition_and_free_size():
    a = np.arange(32, dtype=np.float32).reshape(4, 8)
    dst = empty((4, 2, 4))
    nisa.tensor_tensor(dst=dst, data1=tile(a), data2=tile(a.reshape(4, 2, 4)), op=nl.add)
    np.testing.assert_array_equal(val(dst).reshape(4, 8), 2 * a)
    with pytest.raises(NkiValidationError, match="does not match dst"):
        nisa.tensor_tensor(dst=empty((4, 8)), data1=tile(a), data2=tile(a[:, :4]), op=nl.add)


def test_bitvec_ops_need_integers():
    a = np.array([[0b1100, 0b1010]], np.int32)
    b = np.array([[0b1010, 0b0110]], np.int32)
    dst = empty((1, 2), nl.int32)
    nisa.tensor_tensor(dst=dst, data1=tile(a), data2=tile(b), op=nl.bitwise_and, engine=nisa.engine.vector)
    np.testing.assert_array_equal(val(dst), [[0b1000, 0b0010]])
    with pytest.raises(NkiValidationError, match="needs integer dtypes"):
        nisa.tensor_tensor(dst=empty((1, 2)), data1=tile(a.astype(np.float32)), data2=tile(b.astype(np.float32)),
                           op=nl.bitwise_and)


@settings(max_examples=20, deadline=None)
@given(a=arrays(), s0=finite, s1=finite, rev0=st.booleans(), rev1=st.booleans())
def test_tensor_scalar_two_ops_and_reverse(a, s0, s1, rev0, rev1):
    dst = empty(a.shape)
    nisa.tensor_scalar(dst=dst, data=tile(a), op0=nl.subtract, operand0=s0, reverse0=rev0,
                       op1=nl.multiply, operand1=s1, reverse1=rev1)
    t = (np.float32(s0) - a) if rev0 else (a - np.float32(s0))
    np.testing.assert_array_equal(val(dst), (t * np.float32(s1)).astype(np.float32))


def test_tensor_scalar_column_operand_must_be_fp32_p1(rng):
    a = rng.standard_normal((8, 16)).astype(np.float32)
    col = rng.standard_normal((8, 1)).astype(np.float32)
    dst = empty(a.shape)
    nisa.tensor_scalar(dst=dst, data=tile(a), op0=nl.multiply, operand0=tile(col))
    np.testing.assert_array_equal(val(dst), a * col)
    with pytest.raises(NkiValidationError, match="operand0: dtype bfloat16 must be float32"):
        nisa.tensor_scalar(dst=dst, data=tile(a), op0=nl.multiply, operand0=tile(col, nl.bfloat16))
    with pytest.raises(NkiValidationError, match=r"operand0: shape \(8, 2\) must be \(8, 1\)"):
        nisa.tensor_scalar(dst=dst, data=tile(a), op0=nl.multiply, operand0=tile(np.ones((8, 2), np.float32)))


def test_tensor_scalar_scalar_engine_combinations(target):
    target("trn2")
    a = tile(np.ones((4, 4), np.float32))
    nisa.tensor_scalar(dst=empty((4, 4)), data=a, op0=nl.multiply, operand0=2.0, op1=nl.add, operand1=1.0,
                       engine=nisa.engine.scalar)
    with pytest.raises(NkiValidationError, match="ScalarE supports only"):
        nisa.tensor_scalar(dst=empty((4, 4)), data=a, op0=nl.subtract, operand0=2.0, engine=nisa.engine.scalar)


@settings(max_examples=20, deadline=None)
@given(a=arrays(), b=arrays(), col=hnp.arrays(np.float32, (8, 1), elements=finite),
       rev0=st.booleans(), rev1=st.booleans())
def test_scalar_tensor_tensor_matches_formula(a, b, col, rev0, rev1):
    dst = empty(a.shape)
    nisa.scalar_tensor_tensor(dst=dst, data=tile(a), op0=nl.subtract, operand0=tile(col), op1=nl.subtract,
                              operand1=tile(b), reverse0=rev0, reverse1=rev1)
    t = (col - a) if rev0 else (a - col)
    want = (b - t) if rev1 else (t - b)
    np.testing.assert_array_equal(val(dst), want.astype(np.float32))


def test_scalar_tensor_tensor_flash_attention_ds(rng):
    dp = rng.standard_normal((128, 512)).astype(np.float32)
    d = rng.standard_normal((128, 1)).astype(np.float32)
    p = rng.random((128, 512)).astype(np.float32)
    ds = empty((128, 512))
    nisa.scalar_tensor_tensor(dst=ds, data=tile(dp, buffer=nl.psum), op0=nl.subtract, operand0=tile(d),
                              op1=nl.multiply, operand1=tile(p))
    np.testing.assert_array_equal(val(ds), ((dp - d) * p).astype(np.float32))


# ------------------------------------------------------------------ reductions
def test_tensor_reduce_axes_and_negate(rng):
    a = rng.standard_normal((8, 4, 16)).astype(np.float32)
    dst = empty((8, 4))
    nisa.tensor_reduce(dst=dst, op=nl.maximum, data=tile(a), axis=2, negate=True)
    np.testing.assert_array_equal(val(dst), -a.max(axis=2))
    dst1 = empty((8, 1))
    nisa.tensor_reduce(dst=dst1, op=nl.add, data=tile(a), axis=(1, 2))
    np.testing.assert_allclose(val(dst1)[:, 0], a.sum(axis=(1, 2)), rtol=1e-5)
    with pytest.raises(NkiValidationError, match="axis.*trailing free dims"):
        nisa.tensor_reduce(dst=empty((8, 16)), op=nl.add, data=tile(a), axis=1)
    with pytest.raises(NkiValidationError, match="cannot reduce the partition dim"):
        nisa.tensor_reduce(dst=empty((1, 64)), op=nl.add, data=tile(a), axis=(0, 1, 2))


def test_tensor_partition_reduce(rng):
    a = rng.standard_normal((16, 8)).astype(np.float32)
    dst = empty((1, 8))
    nisa.tensor_partition_reduce(dst=dst, op=nl.add, data=tile(a))
    np.testing.assert_allclose(val(dst)[0], a.sum(0), rtol=1e-5)
    with pytest.raises(NkiValidationError, match="tensor_partition_reduce: data.*this operand must be in sbuf"):
        nisa.tensor_partition_reduce(dst=dst, op=nl.add, data=tile(a, buffer=nl.psum))


def test_reciprocal(rng):
    a = rng.random((4, 8)).astype(np.float32) + 0.5
    dst = empty((4, 8))
    nisa.reciprocal(dst=dst, data=tile(a))
    np.testing.assert_array_equal(val(dst), (np.float32(1) / a))


# ------------------------------------------------------------------ ScalarE
@pytest.mark.parametrize("op,fn", [(nl.exp, np.exp), (nl.tanh, np.tanh), (nl.copy, lambda x: x),
                                   (nl.sigmoid, lambda x: 1 / (1 + np.exp(-x))), (nl.relu, lambda x: np.maximum(x, 0)),
                                   (nl.log, np.log), (nl.square, np.square), (nl.sqrt, np.sqrt)])
def test_activation_functions(op, fn, rng):
    x = (rng.random((8, 32)) * 2 + 0.1).astype(np.float32)
    dst = empty(x.shape)
    nisa.activation(dst=dst, op=op, data=tile(x))
    np.testing.assert_allclose(val(dst), fn(x.astype(np.float64)), rtol=2e-6, atol=1e-7)


def test_activation_scale_bias_and_reduce(rng):
    x = rng.standard_normal((16, 64)).astype(np.float32)
    bias = rng.standard_normal((16, 1)).astype(np.float32)
    dst, res = empty(x.shape), empty((16, 1))
    nisa.activation(dst=dst, op=nl.exp, data=tile(x), bias=tile(bias), scale=0.5, reduce_op=nl.add,
                    reduce_res=res, reduce_cmd=nisa.reduce_cmd.reset_reduce)
    want = np.exp(x.astype(np.float64) * 0.5 + bias)
    np.testing.assert_allclose(val(dst), want, rtol=1e-6)
    np.testing.assert_allclose(val(res)[:, 0], want.sum(1), rtol=1e-5)
    # reduce continues the running sum; reduce_res with idle reads the accumulator as it is
    nisa.activation(dst=dst, op=nl.exp, data=tile(x), bias=tile(bias), scale=0.5, reduce_op=nl.add,
                    reduce_cmd=nisa.reduce_cmd.reduce)
    nisa.activation(dst=dst, op=nl.copy, data=tile(x), reduce_res=res)
    np.testing.assert_allclose(val(res)[:, 0], 2 * want.sum(1), rtol=1e-5)


def test_activation_reduce_and_accumulator_poison(rng):
    x = rng.standard_normal((4, 8)).astype(np.float32)
    dst, res = empty(x.shape), empty((4, 1))
    nisa.activation_reduce(dst=dst, op=nl.exp, data=tile(x), reduce_op=nl.add, reduce_res=res)
    np.testing.assert_allclose(val(res)[:, 0], np.exp(x.astype(np.float64)).sum(1), rtol=1e-5)


def test_activation_scalar_bias_needs_trn2(target):
    x = tile(np.ones((4, 4), np.float32))
    target("trn1")
    with pytest.raises(NkiValidationError, match="scalar bias.*requires NeuronCore v3"):
        nisa.activation(dst=empty((4, 4)), op=nl.exp, data=x, bias=1.0)
    target("trn2")
    dst = empty((4, 4))
    nisa.activation(dst=dst, op=nl.exp, data=x, bias=1.0)
    np.testing.assert_allclose(val(dst), np.exp(2.0), rtol=1e-6)


def test_tensor_scalar_reduce(rng):
    x = rng.standard_normal((8, 16)).astype(np.float32)
    dst, res = empty(x.shape), empty((8, 1))
    nisa.tensor_scalar_reduce(dst=dst, data=tile(x), op0=nl.multiply, operand0=2.0, reduce_op=nl.maximum,
                              reduce_res=res, reduce_res_negate=True)
    np.testing.assert_array_equal(val(dst), 2 * x)
    np.testing.assert_array_equal(val(res)[:, 0], -(2 * x).max(1))


# ------------------------------------------------------------------ selection
def test_affine_select_causal_pattern(rng):
    q0, k0 = 128, 0
    s = rng.standard_normal((128, 256)).astype(np.float32)
    dst = empty(s.shape)
    nisa.affine_select(dst=dst, pattern=[[-1, 256]], channel_multiplier=1, on_true_tile=tile(s),
                       on_false_value=FMIN, cmp_op=nl.greater_equal, offset=q0 - k0)
    qi = q0 + np.arange(128)[:, None]
    kj = k0 + np.arange(256)[None, :]
    np.testing.assert_array_equal(val(dst), np.where(kj <= qi, s, FMIN))


def test_affine_select_rejects_psum():
    t = tile(np.ones((4, 4), np.float32), buffer=nl.psum)
    with pytest.raises(NkiValidationError, match="affine_select: on_true_tile.*must be in sbuf"):
        nisa.affine_select(dst=empty((4, 4)), pattern=[[1, 4]], channel_multiplier=0, on_true_tile=t,
                           on_false_value=0.0)


def test_range_select_keeps_range_and_row_max(rng, target):
    target("trn2")
    s = rng.standard_normal((8, 32)).astype(np.float32)
    lo = np.array([[0], [3], [5], [0], [31], [10], [0], [7]], np.float32)
    hi = np.array([[32], [9], [6], [0], [32], [20], [1], [7]], np.float32)
    dst, mx = empty(s.shape), empty((8, 1))
    nisa.range_select(dst=dst, on_true_tile=tile(s, buffer=nl.psum), comp_op0=nl.greater_equal, comp_op1=nl.less,
                      bound0=tile(lo), bound1=tile(hi), reduce_res=mx, range_start=0)
    j = np.arange(32)[None, :]
    keep = (j >= lo) & (j < hi)
    want = np.where(keep, s, FMIN)
    np.testing.assert_array_equal(val(dst), want)
    np.testing.assert_array_equal(val(mx)[:, 0], want.max(1))


def test_range_select_limits(target):
    s = tile(np.ones((4, 8), np.float32))
    b = tile(np.zeros((4, 1), np.float32))
    target("trn1")
    with pytest.raises(NkiValidationError, match="range_select.*requires NeuronCore v3"):
        nisa.range_select(dst=empty((4, 8)), on_true_tile=s, comp_op0=nl.greater_equal, comp_op1=nl.less,
                          bound0=b, bound1=b)
    target("trn2")
    with pytest.raises(NkiValidationError, match="on_false_value.*must be -3.4028235e"):
        nisa.range_select(dst=empty((4, 8)), on_true_tile=s, comp_op0=nl.greater_equal, comp_op1=nl.less,
                          bound0=b, bound1=b, on_false_value=0.0)


def test_tensor_copy_predicated_and_select_reduce(rng):
    x = rng.standard_normal((4, 8)).astype(np.float32)
    y = rng.standard_normal((4, 8)).astype(np.float32)
    pred = (rng.random((4, 8)) > 0.5).astype(np.uint8)
    dst = tile(y)
    nisa.tensor_copy_predicated(dst=dst, src=tile(x), predicate=tile(pred))
    np.testing.assert_array_equal(val(dst), np.where(pred != 0, x, y))
    d2, mx = empty((4, 8)), empty((4, 1))
    nisa.select_reduce(dst=d2, predicate=tile(pred), on_true=tile(x), on_false=-5.0, reduce_res=mx,
                       reduce_cmd=nisa.reduce_cmd.reset_reduce)
    want = np.where(pred != 0, x, -5.0)
    np.testing.assert_array_equal(val(d2), want)
    np.testing.assert_array_equal(val(mx)[:, 0], want.max(1))


@pytest.mark.parametrize("which", ["bound0", "bound1"])
def test_range_select_bounds_must_be_tiles(target, which):
    # ISA: bound0/bound1 are tiles with one fp32 element per partition; there is no immediate form
    target("trn2")
    s = tile(np.ones((4, 8), np.float32))
    kw = dict(bound0=tile(np.zeros((4, 1), np.float32)), bound1=tile(np.full((4, 1), 8.0, np.float32)))
    kw[which] = 0.0
    with pytest.raises(NkiValidationError, match=rf"range_select: {which}: must be a \(4, 1\) float32 tile"):
        nisa.range_select(dst=empty((4, 8)), on_true_tile=s, comp_op0=nl.greater_equal, comp_op1=nl.less, **kw)


@pytest.mark.parametrize("dtype", ["uint8", "uint16", "uint32"])
def test_tensor_copy_predicated_accepts_unsigned_predicates(dtype):
    pred = np.array([[1, 0, 2, 0]], dtype)
    dst = tile(np.zeros((1, 4), np.float32))
    nisa.tensor_copy_predicated(dst=dst, src=tile(np.ones((1, 4), np.float32)), predicate=tile(pred))
    np.testing.assert_array_equal(val(dst), [[1, 0, 1, 0]])


@pytest.mark.parametrize("dtype", ["bool_", "int8", "int32", "float32"])
def test_tensor_copy_predicated_refuses_other_predicate_dtypes(dtype):
    # ISA: predicate must be uint8, uint16 or uint32
    pred = tile(np.ones((1, 4), np.float32), dtype=getattr(nl, dtype))
    with pytest.raises(NkiValidationError, match=f"tensor_copy_predicated: predicate: dtype {dtype} is not accepted"):
        nisa.tensor_copy_predicated(dst=empty((1, 4)), src=1.0, predicate=pred)


def test_select_reduce_refuses_on_true_and_predicate_both_in_psum():
    x = tile(np.ones((2, 4), np.float32), buffer=nl.psum)
    pred_ps = tile(np.ones((2, 4), np.uint8), buffer=nl.psum)
    with pytest.raises(NkiValidationError, match="select_reduce: predicate: on_true and predicate are both in PSUM"):
        nisa.select_reduce(dst=empty((2, 4)), predicate=pred_ps, on_true=x, on_false=0.0)
    # one of them in PSUM is fine
    d = empty((2, 4))
    nisa.select_reduce(dst=d, predicate=tile(np.ones((2, 4), np.uint8)), on_true=x, on_false=0.0)
    np.testing.assert_array_equal(val(d), 1.0)
    with pytest.raises(NkiValidationError, match="select_reduce: on_true: dtype int32 is not accepted"):
        nisa.select_reduce(dst=empty((2, 4)), predicate=tile(np.ones((2, 4), np.uint8)),
                           on_true=tile(np.ones((2, 4), np.int32)), on_false=0.0)


# ------------------------------------------------------------------ iota / memset / copies
def test_iota_pattern_and_channel_multiplier():
    dst = empty((4, 6), nl.int32)
    nisa.iota(dst=dst, pattern=[[10, 2], [1, 3]], offset=5, channel_multiplier=100)
    want = 5 + 100 * np.arange(4)[:, None] + (10 * np.arange(2)[:, None] + np.arange(3)[None, :]).reshape(1, 6)
    np.testing.assert_array_equal(val(dst), want)
    with pytest.raises(NkiValidationError, match="iota: pattern: covers 5 elements per partition, dst has 6"):
        nisa.iota(dst=dst, pattern=[[1, 5]])


def test_memset_types():
    d = empty((4, 4), nl.int32)
    nisa.memset(dst=d, value=7)
    assert (val(d) == 7).all()
    with pytest.raises(NkiValidationError, match="memset: value: 1.5 is a float; dst dtype int32 needs an int"):
        nisa.memset(dst=d, value=1.5)
    f = empty((4, 4), nl.bfloat16)
    nisa.memset(dst=f, value=0.1)
    assert (val(f) == float(np.float32(0.1).astype(BF16))).all()


def test_tensor_copy_bit_exact_and_cast(rng):
    x = rng.standard_normal((8, 8)).astype(np.float32)
    d = empty((8, 8), nl.bfloat16)
    nisa.tensor_copy(dst=d, src=tile(x))
    np.testing.assert_array_equal(val(d), x.astype(BF16).astype(np.float64))
    ints = tile(np.array([[2 ** 30 + 1]], np.int32))
    di = empty((1, 1), nl.int32)
    nisa.tensor_copy(dst=di, src=ints)
    assert val(di)[0, 0] == 2 ** 30 + 1  # equal dtypes copy bits, no fp32 round trip
    with pytest.raises(NkiValidationError, match="tensor_copy: src.*this operand must be in sbuf"):
        nisa.tensor_copy(dst=empty((8, 8)), src=tile(x, buffer=nl.psum), engine=nisa.engine.gpsimd)


def test_float_to_int_rounds_half_even_and_saturates():
    x = tile(np.array([[0.5, 1.5, 2.5, -0.5, 300.0, -300.0]], np.float32))
    d = empty((1, 6), nl.int8)
    nisa.tensor_copy(dst=d, src=x)
    np.testing.assert_array_equal(val(d), [[0, 2, 2, 0, 127, -128]])


# ------------------------------------------------------------------ TensorE
def test_nc_matmul_is_stationary_transpose_times_moving(rng):
    s = rng.standard_normal((128, 96)).astype(BF16)
    m = rng.standard_normal((128, 512)).astype(BF16)
    dst = empty((96, 512), buffer=nl.psum)
    nisa.nc_matmul(dst=dst, stationary=tile(s), moving=tile(m))
    want = s.astype(np.float64).T @ m.astype(np.float64)
    np.testing.assert_allclose(val(dst), want, rtol=1e-5, atol=1e-4)


def test_nc_matmul_accumulate_none_overwrites_then_accumulates(rng):
    a = [rng.standard_normal((64, 32)).astype(np.float32) for _ in range(3)]
    b = [rng.standard_normal((64, 128)).astype(np.float32) for _ in range(3)]
    dst = tile(np.full((32, 128), 1e6, np.float32), buffer=nl.psum)  # stale data from a non-matmul write
    dst = empty((32, 128), buffer=nl.psum)
    for x, y in zip(a, b):
        nisa.nc_matmul(dst=dst, stationary=tile(x), moving=tile(y))
    want = sum(x.astype(np.float64).T @ y for x, y in zip(a, b))
    np.testing.assert_allclose(val(dst), want, rtol=1e-5, atol=1e-4)
    # reusing the tile for a second, independent accumulation adds onto the first result (documented)
    nisa.nc_matmul(dst=dst, stationary=tile(a[0]), moving=tile(b[0]))
    np.testing.assert_allclose(val(dst), want + a[0].astype(np.float64).T @ b[0], rtol=1e-5, atol=1e-4)
    # accumulate=False starts over
    nisa.nc_matmul(dst=dst, stationary=tile(a[0]), moving=tile(b[0]), accumulate=False)
    np.testing.assert_allclose(val(dst), a[0].astype(np.float64).T @ b[0], rtol=1e-5, atol=1e-4)


def test_nc_matmul_accumulate_true_needs_a_started_group(rng):
    s, m = tile(np.ones((4, 4), np.float32)), tile(np.ones((4, 8), np.float32))
    with pytest.raises(NkiValidationError, match="accumulate: True onto PSUM .* never written"):
        nisa.nc_matmul(dst=empty((4, 8), buffer=nl.psum), stationary=s, moving=m, accumulate=True)


@pytest.mark.parametrize("tgt", ["trn1", "trn2"])
def test_nc_matmul_onto_memset_psum_is_undefined_before_trn3(tgt, target):
    target(tgt)
    s, m = tile(np.ones((4, 4), np.float32)), tile(np.ones((4, 8), np.float32))
    dst = empty((4, 8), buffer=nl.psum)
    nisa.memset(dst=dst, value=0.0)
    with pytest.raises(NkiValidationError, match="last written by a non-matmul instruction"):
        nisa.nc_matmul(dst=dst, stationary=s, moving=m, accumulate=True)


def test_nc_matmul_limits(target):
    ok_s, ok_m = tile(np.ones((128, 128), np.float32)), tile(np.ones((128, 512), np.float32))
    with pytest.raises(NkiValidationError, match="stationary: free size 129 exceeds maximum 128"):
        nisa.nc_matmul(dst=empty((128, 512), buffer=nl.psum), stationary=tile(np.ones((128, 129), np.float32)),
                       moving=ok_m)
    with pytest.raises(NkiValidationError, match="moving: free size 513 exceeds maximum 512"):
        nisa.nc_matmul(dst=empty((128, 513), buffer=nl.psum), stationary=ok_s,
                       moving=tile(np.ones((128, 513), np.float32)))
    with pytest.raises(NkiValidationError, match="partition dimension 129 exceeds maximum 128"):
        nisa.nc_matmul(dst=empty((128, 512), buffer=nl.psum), stationary=tile(np.ones((129, 128), np.float32)),
                       moving=ok_m)
    with pytest.raises(NkiValidationError, match="nc_matmul: dst.*must be in psum"):
        nisa.nc_matmul(dst=empty((128, 512)), stationary=ok_s, moving=ok_m)
    with pytest.raises(NkiValidationError, match="nc_matmul: moving.*must be in sbuf"):
        nisa.nc_matmul(dst=empty((128, 512), buffer=nl.psum), stationary=ok_s,
                       moving=tile(np.ones((128, 512), np.float32), buffer=nl.psum))
    with pytest.raises(NkiValidationError, match="cannot be mixed"):
        nisa.nc_matmul(dst=empty((128, 512), buffer=nl.psum), stationary=ok_s,
                       moving=tile(np.ones((128, 512), np.float32), nl.bfloat16))
    with pytest.raises(NkiValidationError, match="dtype int32 is not accepted"):
        nisa.nc_matmul(dst=empty((128, 512), buffer=nl.psum), stationary=tile(np.ones((128, 128), np.int32)),
                       moving=ok_m)
    with pytest.raises(NkiValidationError, match="dst: dtype bfloat16 is not accepted"):
        nisa.nc_matmul(dst=empty((128, 512), nl.bfloat16, buffer=nl.psum), stationary=ok_s, moving=ok_m)
    target("trn3")
    nisa.nc_matmul(dst=empty((128, 1024), buffer=nl.psum), stationary=ok_s,
                   moving=tile(np.ones((128, 1024), np.float32)))


def test_nc_matmul_output_must_fit_one_bank():
    big = empty((128, 1024), buffer=nl.psum)  # two banks
    s, m = tile(np.ones((128, 128), np.float32)), tile(np.ones((128, 512), np.float32))
    nisa.nc_matmul(dst=big[:, 512:1024], stationary=s, moving=m)  # bank 1 exactly
    with pytest.raises(NkiValidationError, match="crossing a 2 KiB bank boundary"):
        nisa.nc_matmul(dst=big[:, 256:768], stationary=s, moving=m)


def test_nc_transpose_tensor_and_vector_engine(rng):
    x = rng.standard_normal((128, 64)).astype(BF16)
    dst = empty((64, 128), nl.bfloat16, buffer=nl.psum)
    nisa.nc_transpose(dst=dst, data=tile(x))
    np.testing.assert_array_equal(val(dst), x.astype(np.float64).T)
    with pytest.raises(NkiValidationError, match="exceeds the 32x32 limit"):
        nisa.nc_transpose(dst=empty((64, 128), nl.bfloat16), data=tile(x))
    small = rng.standard_normal((32, 16)).astype(np.float32)
    d2 = empty((16, 32))
    nisa.nc_transpose(dst=d2, data=tile(small))
    np.testing.assert_array_equal(val(d2), small.T)
    with pytest.raises(NkiValidationError, match="dst: dtype float32 must equal data dtype bfloat16"):
        nisa.nc_transpose(dst=empty((64, 128), buffer=nl.psum), data=tile(x))


def test_is_transpose_matmul_needs_identity(rng, target):
    target("trn2")
    x = rng.standard_normal((128, 64)).astype(BF16)
    eye = tile(np.eye(128, dtype=np.float32), nl.bfloat16)
    dst = empty((64, 128), nl.bfloat16, buffer=nl.psum)
    nisa.nc_matmul(dst=dst, stationary=tile(x), moving=eye, is_transpose=True)
    np.testing.assert_array_equal(val(dst), x.astype(np.float64).T)
    with pytest.raises(NkiValidationError, match="identity"):
        nisa.nc_matmul(dst=dst, stationary=tile(x), moving=tile(np.ones((128, 128), np.float32), nl.bfloat16),
                       is_transpose=True)


# ------------------------------------------------------------------ generation
@pytest.mark.parametrize("tgt,ver", [("trn1", 2), ("trn2", 3), ("trn3", 4)])
def test_get_nc_version(tgt, ver, target):
    target(tgt)
    v = nisa.get_nc_version()
    assert v == ver and v >= nisa.nc_version.gen2


def test_default_target_is_trn2(monkeypatch):
    monkeypatch.delenv("NEURON_PLATFORM_TARGET_OVERRIDE", raising=False)
    assert nisa.get_nc_version() == nisa.nc_version.gen3
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn9")
    with pytest.raises(NkiValidationError, match="trn9"):
        nisa.get_nc_version()


def test_tile_size_constants(target):
    ts = nl.tile_size
    assert (ts.pmax, ts.psum_bank_fmax, ts.gemm_stationary_fmax, ts.gemm_moving_fmax) == (128, 512, 128, 512)
    target("trn1")
    assert ts.sbuf_fmax_bytes == 180224
    target("trn2")
    assert ts.total_available_sbuf_size == 212984
    assert ts.psum_num_banks == 8
    assert math.isclose(ts.sbuf_fmax, 212984 // 4)


def test_dtype_names_are_strings():
    assert str(nl.bfloat16) == "bfloat16" and nl.float32 == "float32"
    assert nl.bfloat16.np == np.dtype(ml_dtypes.bfloat16)
