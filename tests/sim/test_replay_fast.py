"""The replay's compiled steps (nki_attn.sim.fast) and its refill analysis (nki_attn.sim.replay): a compiled
program gives bit-for-bit what tracing gives and what replaying through the instructions themselves gives, keeps
the data-dependent checks, and refills exactly the allocations whose fresh contents a replay can read; the
frontend's launch check of module globals (identity first, then content) still refuses a changed global."""
import sys

import ml_dtypes
import numpy as np
import pytest

import nki_attn.sim as sim
from nki_attn.kernels.attention_bwd import attention_bwd
from nki_attn.kernels.attention_fwd import attention_fwd
from nki_attn.sim import isa as nisa
from nki_attn.sim import language as nl
from nki_attn.sim import replay

BF16 = ml_dtypes.bfloat16
P = 32


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    for name in ("NKI_ATTN_SIM_REPLAY", "NKI_ATTN_SIM_REPLAY_FAST", "NKI_ATTN_SIM_STRICT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    replay.clear()
    yield
    replay.clear()


def _same_bits(a, b):
    for x, y in zip(a, b, strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        assert np.array_equal(x.view(np.uint8), y.view(np.uint8))


def _programs():
    return list(replay._PROGRAMS.values())


@sim.jit
def every_form(a, b, col, lo, hi, pred, ident):
    """a, b [32, 32] float32, col / lo / hi [32, 1] float32, pred [32, 32] uint8, ident the [32, 32] identity:
    each compiled instruction form once (dtype casts, PSUM operands, tensor and immediate scalars, reversed
    operands, accumulators, in-place writes, matmul accumulation), every result side by side in one output."""
    out = nl.ndarray((32, 32 * 18), nl.float32, buffer=nl.shared_hbm)
    res = nl.ndarray((32, 32 * 18), nl.float32, buffer=nl.sbuf)
    x = nl.ndarray((32, 32), nl.float32, buffer=nl.sbuf)
    y = nl.ndarray((32, 32), nl.float32, buffer=nl.sbuf)
    c = nl.ndarray((32, 1), nl.float32, buffer=nl.sbuf)
    c_lo = nl.ndarray((32, 1), nl.float32, buffer=nl.sbuf)
    c_hi = nl.ndarray((32, 1), nl.float32, buffer=nl.sbuf)
    pr = nl.ndarray((32, 32), nl.uint8, buffer=nl.sbuf)
    eye = nl.ndarray((32, 32), nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=x, src=a)
    nisa.dma_copy(dst=y, src=b)
    nisa.dma_copy(dst=c, src=col)
    nisa.dma_copy(dst=c_lo, src=lo)
    nisa.dma_copy(dst=c_hi, src=hi)
    nisa.dma_copy(dst=pr, src=pred)
    nisa.dma_copy(dst=eye, src=ident)
    cols = nl.ndarray((32, 8), nl.float32, buffer=nl.sbuf)
    # copies: same dtype, float32 -> bfloat16 -> float32
    nisa.tensor_copy(dst=res[:, 0:32], src=x)
    xb = nl.ndarray((32, 32), nl.bfloat16, buffer=nl.sbuf)
    nisa.tensor_copy(dst=xb, src=x)
    nisa.tensor_copy(dst=res[:, 32:64], src=xb)
    # element-wise with a PSUM operand, immediate and tensor scalars, reversed operands, a unary op0
    acc = nl.ndarray((32, 32), nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=acc, stationary=x, moving=y)
    nisa.nc_matmul(dst=acc, stationary=y, moving=x)          # accumulate=None: adds onto the first
    nisa.nc_matmul(dst=acc, stationary=x, moving=x, accumulate=True)
    nisa.tensor_tensor(dst=res[:, 64:96], data1=acc, data2=y, op=nl.subtract)
    nisa.tensor_scalar(dst=res[:, 96:128], data=x, op0=nl.multiply, operand0=1.5, op1=nl.subtract, operand1=c,
                       reverse1=True)
    nisa.tensor_scalar(dst=res[:, 128:160], data=y, op0=nl.exp, operand0=0.0)
    nisa.scalar_tensor_tensor(dst=res[:, 160:192], data=x, op0=nl.multiply, operand0=c, op1=nl.subtract,
                              operand1=y, reverse1=True)
    nisa.tensor_reduce(dst=cols[:, 0:1], op=nl.maximum, data=y, axis=1, negate=True)
    nisa.reciprocal(dst=res[:, 192:224], data=y)
    # activations: tensor bias and immediate scale with a reduction, tensor scale with an immediate bias, in place
    nisa.activation(dst=res[:, 224:256], op=nl.exp, data=x, bias=c, scale=0.5,
                    reduce_cmd=nisa.reduce_cmd.reset_reduce, reduce_res=cols[:, 1:2])
    nisa.activation(dst=res[:, 256:288], op=nl.tanh, data=y, bias=0.25, scale=c)
    z = nl.ndarray((32, 32), nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=z, src=y)
    nisa.activation(dst=z, op=nl.copy, data=z, reduce_cmd=nisa.reduce_cmd.reduce, reduce_res=cols[:, 2:3])
    nisa.activation_reduce(dst=res[:, 288:320], op=nl.exp, data=y, reduce_op=nl.add, reduce_res=cols[:, 3:4])
    nisa.nc_transpose(dst=z, data=z)                          # in place (VectorE)
    nisa.tensor_copy(dst=z[:, 1:32], src=z[:, 0:31])           # overlapping source and destination
    # transposes on VectorE and TensorE, a transpose by matmul, a bfloat16 matmul overwriting (accumulate=False)
    nisa.nc_transpose(dst=res[:, 320:352], data=x)
    tp = nl.ndarray((32, 32), nl.float32, buffer=nl.psum)
    nisa.nc_transpose(dst=tp, data=y)
    nisa.tensor_copy(dst=res[:, 352:384], src=tp)
    tm = nl.ndarray((32, 32), nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=tm, stationary=y, moving=eye, is_transpose=True)
    nisa.tensor_tensor(dst=res[:, 384:416], data1=tm, data2=z, op=nl.add)
    ab = nl.ndarray((32, 32), nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=ab, stationary=xb, moving=xb)
    nisa.nc_matmul(dst=ab, stationary=xb, moving=xb, accumulate=False)
    nisa.tensor_copy(dst=res[:, 416:448], src=ab)
    # selections feeding VectorE's accumulator
    nisa.select_reduce(dst=res[:, 448:480], predicate=pr, on_true=x, on_false=c, reverse_pred=True,
                       reduce_cmd=nisa.reduce_cmd.reset_reduce, reduce_res=cols[:, 4:5])
    nisa.range_select(dst=res[:, 480:512], on_true_tile=y, comp_op0=nl.greater_equal, comp_op1=nl.less,
                      bound0=c_lo, bound1=c_hi, reduce_res=cols[:, 5:6], range_start=0)
    nisa.affine_select(dst=res[:, 512:544], pattern=[[-1, 32]], channel_multiplier=1, on_true_tile=x,
                       on_false_value=-2.0, cmp_op=nl.greater_equal)
    # integer destinations: rounding half to even, saturation, NaN to 0
    i8 = nl.ndarray((32, 32), nl.int8, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=i8, data=x, op0=nl.multiply, operand0=60.0)
    nisa.tensor_copy(dst=res[:, 544:576], src=i8)
    m8 = nl.ndarray((32, 1), nl.uint8, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=m8, data=c, op0=nl.greater, operand0=0.0)
    nisa.memset(dst=cols[:, 6:8], value=0.0)
    nisa.tensor_copy(dst=cols[:, 7:8], src=m8)
    nisa.tensor_tensor(dst=res[:, 0:8], data1=res[:, 0:8], data2=cols, op=nl.add)
    nisa.dma_copy(dst=out, src=res)
    return out


def _every_form_inputs(seed):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((P, P)).astype(np.float32)
    a[3, 5] = np.nan                                           # NaN flows through every form
    b = rng.uniform(0.5, 2.0, (P, P)).astype(np.float32)
    col = rng.standard_normal((P, 1)).astype(np.float32)
    lo = rng.integers(0, 16, (P, 1)).astype(np.float32)
    hi = lo + rng.integers(1, 16, (P, 1)).astype(np.float32)
    pred = rng.integers(0, 2, (P, P)).astype(np.uint8)
    return a, b, col, lo, hi, pred, np.eye(P, dtype=np.float32)


def test_every_compiled_form_is_bit_identical_to_the_instruction(monkeypatch):
    every_form(*_every_form_inputs(0))                         # traced, recorded
    (prog,) = _programs()
    fixed = sum(1 for s in prog.steps if getattr(s, "func", None) is not None and "fixed" in s.func.__name__)
    assert fixed == 1 and prog.n_fast == prog.n_instr - 1       # every instruction but the memset is compiled
    inputs = [_every_form_inputs(seed) for seed in (1, 2)]
    fast = [every_form(*x) for x in inputs]
    assert prog.replays == 2
    monkeypatch.setenv("NKI_ATTN_SIM_REPLAY_FAST", "0")        # replayed through the instructions themselves
    replay.clear()
    every_form(*_every_form_inputs(0))
    slow = [every_form(*x) for x in inputs]
    assert _programs()[0].n_fast == 0 and _programs()[0].replays == 2
    monkeypatch.setenv("NKI_ATTN_SIM_REPLAY", "0")             # traced
    traced = [every_form(*x) for x in inputs]
    for f, s, t in zip(fast, slow, traced):
        _same_bits([f], [t])
        _same_bits([s], [t])
    assert np.isnan(fast[0]).any() and not np.isnan(fast[0]).all()


VARIANTS = [
    {"use_causal_mask": True},
    {"use_causal_mask": True, "sliding_window": 100, "softcap": 30.0, "softmax_scale": 0.2},
    {"use_causal_mask": True, "dropout_p": 0.25, "dropout_seed": np.array([7], dtype=np.int32)},
    {"alibi_slopes": np.array([[0.5, 0.25]], dtype=np.float32)},
]


BIAS = {"use_causal_mask": True,
        "attn_bias": np.random.default_rng(6).standard_normal((1, 2, 128, 128)).astype(np.float32)}


@pytest.mark.parametrize("kw", VARIANTS + [BIAS], ids=["causal", "window-softcap-scale", "dropout", "alibi", "bias"])
def test_the_attention_kernels_compiled_give_the_instructions_bits(kw, monkeypatch):
    rng = np.random.default_rng(5)
    x = {n: rng.standard_normal((1, 2 if n in "qo" else 1, 32, 128)).astype(np.float32).astype(BF16)
         for n in ("q", "k", "v", "o")}
    bwd_kw = dict(kw, bias_grad=True) if "attn_bias" in kw else kw

    def run():
        o, lse = attention_fwd(x["q"], x["k"], x["v"], **kw)
        return (o, lse) + tuple(attention_bwd(x["q"], x["k"], x["v"], o, x["o"], lse, **bwd_kw))

    run()
    fast = run()
    assert all(p.replays == 1 and p.n_fast > 0 for p in _programs())  # dropout's integer hash is not compiled
    monkeypatch.setenv("NKI_ATTN_SIM_REPLAY_FAST", "0")
    replay.clear()
    run()
    _same_bits(fast, run())


@sim.jit
def accumulate_onto_memset(a):
    """accumulate=None onto PSUM partly last written by a memset: accumulated on trn3, refused on trn2."""
    out = nl.ndarray((8, 8), nl.float32, buffer=nl.shared_hbm)
    s = nl.ndarray((8, 8), nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=s, src=a)
    acc = nl.ndarray((8, 8), nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=acc, stationary=s, moving=s)
    nisa.memset(dst=acc[:, 0:4], value=0.0)
    nisa.nc_matmul(dst=acc, stationary=s, moving=s)
    r = nl.ndarray((8, 8), nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=r, src=acc)
    nisa.dma_copy(dst=out, src=r)
    return out


def test_a_compiled_matmul_keeps_the_psum_rules(monkeypatch):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")   # v4 accumulates onto the memset
    a = np.arange(64, dtype=np.float32).reshape(8, 8)
    accumulate_onto_memset(a)
    got = accumulate_onto_memset(a + 1)
    assert _programs()[0].replays == 1 and _programs()[0].n_fast >= 3
    monkeypatch.setenv("NKI_ATTN_SIM_REPLAY", "0")
    _same_bits([got], [accumulate_onto_memset(a + 1)])
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    with pytest.raises(sim.NkiValidationError, match="last written by a non-matmul instruction"):
        accumulate_onto_memset(a)


@sim.jit
def partly_then_fully_written(a):
    """t: half written then read (its fresh NaN shows); u: fully written before any read; v: read through a view
    of another element size (not analysed: refilled)."""
    out = nl.ndarray((8, 24), nl.float32, buffer=nl.shared_hbm, name="out")
    r = nl.ndarray((8, 24), nl.float32, buffer=nl.sbuf, name="r")
    t = nl.ndarray((8, 8), nl.float32, buffer=nl.sbuf, name="t")
    nisa.dma_copy(dst=t[:, 0:4], src=a[:, 0:4])
    nisa.tensor_copy(dst=r[:, 0:8], src=t)
    u = nl.ndarray((8, 8), nl.float32, buffer=nl.sbuf, name="u")
    nisa.dma_copy(dst=u, src=a)
    nisa.tensor_copy(dst=r[:, 8:16], src=u)
    v = nl.ndarray((8, 16), nl.bfloat16, buffer=nl.sbuf, name="v")
    nisa.dma_copy(dst=v, src=a.view(nl.bfloat16))
    nisa.tensor_copy(dst=r[:, 16:24], src=v.view(nl.float32))
    nisa.dma_copy(dst=out, src=r)
    return out


def test_only_allocations_a_replay_reads_unwritten_are_refilled():
    a = np.arange(64, dtype=np.float32).reshape(8, 8)
    first = partly_then_fully_written(a)
    (prog,) = _programs()
    names = {prog.storages[k].name for k in prog.quiet}
    assert names == {"u", "r"}     # r is written in three parts before it is read; t, v and the result are refilled
    for _ in range(2):
        got = partly_then_fully_written(a + 1)
        np.testing.assert_array_equal(got[:, 0:4], a[:, 0:4] + 1)
        assert np.isnan(got[:, 4:8]).all()                     # the sentinel, refilled at every replay
        np.testing.assert_array_equal(got[:, 8:24], np.hstack([a, a]) + 1)   # the bf16 pairs are a's bits
    _same_bits([first[:, 4:8]], [got[:, 4:8]])
    assert prog.replays == 2


def test_strict_mode_replays_through_the_instructions():
    x = _every_form_inputs(1)
    plain = every_form(*x)
    with sim.checking(strict=True):
        every_form(*_every_form_inputs(0))
        _same_bits([every_form(*x)], [plain])
        with pytest.raises(sim.NkiValidationError, match="was never written"):
            partly_then_fully_written(x[0][:8, :8])
    strict = [p for p in _programs() if p.strict]
    assert len(strict) == 1 and strict[0].replays == 1 and strict[0].n_fast == 0 and not strict[0].quiet


SCALE = 2.0
TABLE = {"scale": 2.0}


@sim.jit
def reads_globals(a):
    """a * SCALE * TABLE["scale"]: a global whose value fixes its content and one whose content can change."""
    out = nl.ndarray((8, 8), nl.float32, buffer=nl.shared_hbm)
    t = nl.ndarray((8, 8), nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=a)
    nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=SCALE, op1=nl.multiply, operand1=TABLE["scale"])
    nisa.dma_copy(dst=out, src=t)
    return out


def test_the_launch_check_of_globals_tests_identity_then_content(monkeypatch):
    """Globals bound to values that fix their content are checked by identity, the others by content, at every
    launch (replayed or not)."""
    from nki_attn.sim import frontend
    a = np.ones((8, 8), dtype=np.float32)
    np.testing.assert_array_equal(reads_globals(a), 4 * a)
    np.testing.assert_array_equal(reads_globals(a), 4 * a)
    g = frontend.gather(reads_globals)
    assert [name for _, name, _ in g.identity if name == "SCALE"] and [r.label for r, _ in g.others] == ["TABLE"]
    monkeypatch.setitem(TABLE, "scale", 3.0)                   # same dict, new content
    with pytest.raises(sim.NkiValidationError, match="TABLE was"):
        reads_globals(a)
    monkeypatch.setitem(TABLE, "scale", 2.0)
    monkeypatch.setattr(sys.modules[__name__], "SCALE", 5.0)   # a new object
    with pytest.raises(sim.NkiValidationError, match="SCALE was 2.0 at the first call"):
        reads_globals(a)
    monkeypatch.setattr(sys.modules[__name__], "SCALE", 2.0)
    np.testing.assert_array_equal(reads_globals(a), 4 * a)
    assert _programs()[0].replays == 2
