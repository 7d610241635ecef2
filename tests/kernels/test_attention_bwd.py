"""Tests of the flash-attention backward kernel (nki_attn/kernels/attention_bwd.py) on the simulator.

Every numerical case compares the kernel against a float64 reference (the golden run on float64 copies of the
dtype-rounded inputs) with the criterion of docs/tolerances.md (tests/kernels/_compare.py), plus a fixed absolute
band per dtype. Inputs: q, k, v, dy ~ N(0, 1) rounded to the dtype; o and lse from the float64 forward (o rounded
to the dtype, lse to float32), in the kernel layout.
"""
import inspect
import os
import sys
import types

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import _compare  # noqa: E402
from _compare import to_np  # noqa: E402

from golden.attention_bwd_torch import attention_bwd_torch_ref  # noqa: E402
from golden.attention_fwd_torch import compute_o_lse, packing_bounds  # noqa: E402
from nki_attn import kernel_api  # noqa: E402
from nki_attn.kernels import attention_bwd as kb  # noqa: E402
from nki_attn.sim import trace  # noqa: E402
from nki_attn.sim.errors import NkiValidationError  # noqa: E402

TORCH_DT = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
NAMES = ("dq", "dk", "dv", "dsinks")


class Case:
    """Inputs of one backward call, the references and the kernel arguments."""

    def __init__(self, bs=1, h=1, hk=1, d=64, sq=256, sk=None, dtype="float32", causal=False, window=None,
                 sinks=0, cu=None, scale=None, mixed=False, seed=0):
        sk = sq if sk is None else sk
        self.dtype, self.mixed = dtype, mixed
        tdt = TORCH_DT[dtype]
        gen = torch.Generator().manual_seed(seed)

        def rnd(*shape):  # N(0, 1) rounded to the dtype, held in float64
            return torch.randn(*shape, generator=gen, dtype=torch.float64).to(tdt).to(torch.float64)

        q, k, v, dy = rnd(bs, h, d, sq), rnd(bs, hk, d, sk), rnd(bs, hk, d, sk), rnd(bs, h, d, sq)
        sk_t = None
        if sinks:
            sk_t = rnd(bs, h) if sinks == 1 else rnd(bs, h, sinks)
        bmin = bmax = None
        if cu is not None:
            bmin, bmax = packing_bounds(cu, seqlen_q=sq)
        self.opts = dict(use_causal_mask=causal, softmax_scale=scale, sliding_window=window, bound_min=bmin,
                         bound_max=bmax)
        o, lse, _ = compute_o_lse(q, k, v, sinks=sk_t, **self.opts)           # float64 forward
        self.ref = attention_bwd_torch_ref(q, k, v, o, dy, lse, sinks_ref=sk_t, **self.opts)
        low = [x.to(tdt) for x in (q, k, v, o, dy)]
        lse32 = lse.to(torch.float32)
        sk_low = None if sk_t is None else sk_t.to(tdt)
        self.golden = attention_bwd_torch_ref(*low, lse32, sinks_ref=sk_low, mixed_precision=mixed, **self.opts)
        self.fs32 = _compare.bwd_from_stats(*low, lse32, sinks=sk_low, bound_min=bmin, bound_max=bmax,
                                                causal=causal, scale=scale, window=window,
                                                compute_dtype=torch.float32)
        self.lse = lse
        self.args = [to_np(x) for x in low] + [to_np(lse32)]
        self.kwargs = dict(use_causal_mask=causal, softmax_scale=scale, sliding_window=window,
                           mixed_precision=mixed)
        if sk_low is not None:
            self.kwargs["sinks_ref"] = to_np(sk_low)
        if bmin is not None:
            self.kwargs["bound_min"] = to_np(bmin)
            self.kwargs["bound_max"] = to_np(bmax)

    def run(self, lnc=None, **extra):
        kern = kb.attention_bwd if lnc is None else kb.attention_bwd[lnc]
        return kern(*self.args, **self.kwargs, **extra)

    def check(self, out):
        n_out = 4 if "sinks_ref" in self.kwargs else 3
        assert len(out) == n_out
        stats = {}
        for name, got in zip(NAMES, out):
            key = f"out_{name}_ref"
            stats[name] = _compare.check_close(name, got, self.ref[key], self.golden[key], self.dtype,
                                               inputs_err=self.fs32[name])
            _compare.absolute_band(name, got, self.ref[key], self.dtype)
        return stats


def run_case(k_section_len=None, **kw):
    c = Case(**kw)
    out = c.run(k_section_len=k_section_len)
    c.check(out)
    return c, out


@pytest.fixture
def target(monkeypatch):
    def set_target(name):
        monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", name)
    return set_target


# --------------------------------------------------------------------------------------------- features
@pytest.mark.parametrize("kw", [
    dict(),                                           # plain, non-causal
    dict(causal=True),
    dict(causal=True, window=100),                    # window inside a tile and across tiles
    dict(causal=True, window=1, sq=128),              # only the diagonal
    dict(causal=True, window=300, sq=512),            # window tiles skipped at trace time
    dict(h=8, hk=2, sq=128, causal=True),             # GQA 4:1
    dict(bs=2, h=3, hk=1, sq=128),                    # MQA
    dict(scale=0.3),                                  # non-default scale
    dict(scale=1.0, causal=True),                     # large logits
    dict(sq=256, sk=512),                             # seqlen_q != seqlen_k
    dict(sq=384, sk=128),
], ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "plain")
def test_features_fp32(kw):
    run_case(**kw)


@pytest.mark.parametrize("d", [64, 96, 128, 256])
def test_head_dims(d):
    run_case(d=d, causal=True, h=2, hk=1, sq=256)


@pytest.mark.parametrize("kw", [
    dict(cu=[0, 100, 250, 384], sq=384),                          # 3 unequal sequences, non-causal
    dict(cu=[0, 100, 250, 384], sq=384, causal=True),             # with causal
    dict(cu=[0, 37, 300, 384], sq=384, causal=True, window=50),   # with causal + window
], ids=["packing", "packing-causal", "packing-causal-window"])
def test_packing(kw):
    run_case(**kw)


def test_rows_without_keys_get_zero_gradients():
    # 3 sequences in 250 rows, rows 250..383 are padding: bound [0, 0) -> no visible key, lse = +inf
    c, out = run_case(cu=[0, 90, 200, 250], sq=384, causal=True, h=2, hk=1)
    lse_rows = c.lse.transpose(-1, -2).reshape(1, 2, -1)
    assert torch.isinf(lse_rows[..., 250:]).all() and torch.isfinite(lse_rows[..., :250]).all()
    dq = np.asarray(out[0]).astype(np.float64)
    assert np.all(dq[..., 250:] == 0.0)
    assert np.all(np.isfinite(dq))
    # keys 250.. are seen by no query: zero dK, dV there
    for t in out[1:3]:
        assert np.all(np.asarray(t).astype(np.float64)[..., 250:] == 0.0)


@pytest.mark.parametrize("sinks,kw", [(1, dict()), (2, dict(h=4, hk=2, causal=True)),
                                      (1, dict(cu=[0, 100, 250, 384], sq=384, causal=True))],
                         ids=["1-sink", "2-sinks-gqa-causal", "1-sink-packing"])
def test_sinks(sinks, kw):
    c, out = run_case(sinks=sinks, **kw)
    assert out[3].dtype == np.float32 and out[3].shape == c.kwargs["sinks_ref"].shape


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("mixed", [False, True])
def test_low_precision(dtype, mixed):
    c, out = run_case(dtype=dtype, mixed=mixed, causal=True, h=2, hk=1, d=128, sinks=1)
    assert all(str(np.asarray(t).dtype) == dtype for t in out[:3])


@pytest.mark.parametrize("kw", [
    dict(sq=512, causal=True, window=200),                              # fp32, 4 sections of 128
    dict(sq=512, sk=768, dtype="bfloat16", mixed=True, h=2, hk=1),      # fp32 dQ scratch in HBM
    dict(sq=512, dtype="bfloat16", mixed=False, causal=True, sinks=2),  # dQ round trip in bf16
    dict(sq=384, d=256, causal=True),
], ids=["fp32-causal-window", "bf16-mixed", "bf16-sinks", "d256"])
def test_several_sections(kw):
    run_case(k_section_len=128, **kw)


def test_section_count_does_not_change_results():
    c = Case(sq=512, causal=True, h=2, hk=1)
    one = c.run()
    two = c.run(k_section_len=256)
    c.check(two)
    # only the grouping of the dQ partial sums changes (fp32 rounding)
    for a, b in zip(one, two):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


def test_section_length_argument():
    c = Case(sq=384, causal=True, sinks=1)
    with trace.recording() as rec:
        out = c.run(k_section_len=256)
    c.check(out)
    # sections [0, 256) and [256, 384): query tile 2 needs both, so 3 + 1 exps of P, and one for the sink (all
    # the query rows of the head at once)
    assert _exp_count(rec) == 4 + 1
    # the argument is the last keyword of the jit kernel
    assert list(inspect.signature(kb.attention_bwd.fn).parameters)[-1] == "k_section_len"
    msg = "k_section_len=200 must be a positive multiple of 128"
    with pytest.raises(ValueError, match=msg):
        kernel_api.attention_bwd(*c.args, **c.kwargs, k_section_len=200)
    with pytest.raises(AssertionError, match=msg):
        c.run(k_section_len=200)


@pytest.mark.slow
@pytest.mark.parametrize("dtype,mixed", [("bfloat16", True), ("float32", False)])
def test_slow_long_sequence(dtype, mixed):
    run_case(k_section_len=1024, sq=2048, h=4, hk=2, d=128, dtype=dtype, mixed=mixed, causal=True, window=700,
             sinks=1)


# --------------------------------------------------------------------------------------------- SPMD / targets
@pytest.mark.parametrize("tgt", ["trn2", "trn3"])
@pytest.mark.parametrize("kw", [dict(bs=2, h=2, hk=1, causal=True, sinks=1, sq=128),
                                dict(bs=3, h=2, hk=1, sq=128, dtype="bfloat16", mixed=True)],
                         ids=["even-items", "odd-items"])
def test_lnc2_bit_identical(tgt, kw, target):
    target(tgt)
    c = Case(**kw)
    single = c.run()
    c.check(single)
    dual = c.run(lnc=2)
    assert len(single) == len(dual)
    for a, b in zip(single, dual):
        assert np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


@pytest.mark.parametrize("tgt", ["trn1", "trn2", "trn3"])
def test_targets(tgt, target):
    target(tgt)
    run_case(cu=[0, 100, 250, 384], sq=384, causal=True, window=120, h=2, hk=1, sinks=1)
    run_case(causal=True, dtype="bfloat16")


def test_trn1_refuses_lnc2(target):
    target("trn1")
    c = Case(sq=128)
    with pytest.raises(NkiValidationError, match="LNC2"):
        c.run(lnc=2)


# --------------------------------------------------------------------------------------------- design checks
def _counts(c, **extra):
    with trace.recording() as rec:
        c.run(**extra)
    return rec


def _exp_count(rec):
    """exp activations: the only activations with a tensor bias (-LSE, or the sink logit); the dQ and dS^T
    copies on ScalarE have none."""
    return sum(1 for r in rec.records if r.instr == "activation" and len(r.srcs) == 2)


def _mm_columns(rec):
    return sum(r.dst.free_elems for r in rec.records if r.instr == "nc_matmul" and not r.is_transpose)


def _d_matmuls(rec):
    """The ones-vector matmuls that sum O*dO over the head dim: the kernel's only matmuls with one column."""
    return sum(1 for r in rec.records if r.instr == "nc_matmul" and r.dst.free_elems == 1)


def test_rowsum_once_per_query_tile_whatever_the_sections():
    c = Case(sq=512, h=2, hk=1, causal=True, sinks=1)
    full = _counts(c)
    split = _counts(c, k_section_len=128)
    n_rows = 2 * 512 // 128  # query heads x query tiles
    assert _d_matmuls(full) == _d_matmuls(split) == n_rows
    # one exp per visible (query tile, key tile) pair and one per (head, sink) for the sinks
    assert _exp_count(full) == 4 * 2 + 2                 # one 512-key tile per query tile
    assert _exp_count(split) == (1 + 2 + 3 + 4) * 2 + 2  # causal: query tile i sees sections 0..i


def test_causal_tiles_are_skipped():
    base = _counts(Case(sq=512))
    causal = _counts(Case(sq=512, causal=True))
    # 4 query tiles x 1 key tile of 512: non-causal 4 pairs, causal the same 4 pairs trimmed to 1..4 chunks
    assert _exp_count(base) == _exp_count(causal) == 4
    # TensorE work: matmul columns streamed (a diagonal pair computes only its visible 128-key chunks)
    assert _mm_columns(causal) < 0.65 * _mm_columns(base)
    window = _counts(Case(sq=512, causal=True, window=128))
    assert _mm_columns(window) < _mm_columns(causal)


# --------------------------------------------------------------------------------------------- validation
def _arrays(bs=1, h=1, hk=1, d=64, sq=128, sk=None, dtype=np.float32):
    sk = sq if sk is None else sk
    z = lambda *s: np.zeros(s, dtype=dtype)  # noqa: E731
    return dict(q_ref=z(bs, h, d, sq), k_ref=z(bs, hk, d, sk), v_ref=z(bs, hk, d, sk), o_ref=z(bs, h, d, sq),
                dy_ref=z(bs, h, d, sq), lse_ref=np.zeros((bs, h, 128, sq // 128), np.float32))


@pytest.mark.parametrize("change,match", [
    (dict(q_ref=np.zeros((1, 64, 128), np.float32)), "q must be 4-D"),
    (dict(v_ref=np.zeros((1, 1, 64, 256), np.float32)), "v shape"),
    (dict(k_ref=np.zeros((2, 1, 64, 128), np.float32), v_ref=np.zeros((2, 1, 64, 128), np.float32)), "batch"),
    (dict(k_ref=np.zeros((1, 1, 32, 128), np.float32), v_ref=np.zeros((1, 1, 32, 128), np.float32)), "d_head"),
    (dict(k_ref=np.zeros((1, 2, 64, 128), np.float32), v_ref=np.zeros((1, 2, 64, 128), np.float32)),
     "divisible by nheads_kv"),
    (dict(k_ref=np.zeros((1, 1, 64, 200), np.float32), v_ref=np.zeros((1, 1, 64, 200), np.float32)),
     "seqlen_k=200 must be a positive multiple of 128"),
    (dict(o_ref=np.zeros((1, 1, 64, 256), np.float32)), "o shape"),
    (dict(dy_ref=np.zeros((1, 1, 64, 128), np.float16)), "dy dtype"),
    (dict(lse_ref=np.zeros((1, 1, 128, 2), np.float32)), "lse shape"),
    (dict(lse_ref=np.zeros((1, 1, 128, 1), np.float16)), "lse dtype"),
    (dict(sliding_window=64), "only supported with use_causal_mask=True"),
    (dict(sliding_window=0, use_causal_mask=True), "must be None or an int >= 1"),
    (dict(bound_min=np.zeros(128, np.float32)), "bound_min was given without bound_max"),
    (dict(bound_min=np.zeros(128, np.int32), bound_max=np.zeros(128, np.int32)), "bound_min dtype"),
    (dict(bound_min=np.zeros(64, np.float32), bound_max=np.zeros(64, np.float32)), "bound_min shape"),
    (dict(sinks_ref=np.zeros((1, 2), np.float32)), "sinks shape"),
    (dict(softmax_scale=-1.0), "softmax_scale=-1.0 must be None or a positive number"),
    (dict(mixed_precision=1), "mixed_precision=1 must be a bool"),
    (dict(lse_ref=None), "lse_ref are required"),
], ids=lambda x: x if isinstance(x, str) else None)
def test_validation_errors(change, match):
    args = _arrays()
    args.update(change)
    with pytest.raises(ValueError, match=match) as host:
        kernel_api.attention_bwd(**args)
    # Kernel code cannot raise: called directly, the kernel fails its assert with the same message, before it
    # emits any instruction.
    with trace.recording() as rec, pytest.raises(AssertionError) as kernel:
        kb.attention_bwd(**args)
    assert str(kernel.value) == str(host.value)
    assert rec.count() == 0


@pytest.mark.parametrize("shape_kw,match", [
    (dict(d=260), "d_head=260 exceeds the supported maximum 256"),
    (dict(sq=200), "seqlen_q=200 must be a positive multiple of 128"),
])
def test_validation_shapes(shape_kw, match):
    with pytest.raises(ValueError, match=match):
        kernel_api.attention_bwd(**_arrays(**shape_kw))
    with pytest.raises(AssertionError, match=match):
        kb.attention_bwd(**_arrays(**shape_kw))


def test_validation_dtype():
    # (float64 has no NKI dtype: the launcher itself rejects it before the kernel runs)
    with pytest.raises(ValueError, match="q dtype int32 is not supported"):
        kernel_api.attention_bwd(**_arrays(dtype=np.int32))


def test_sbuf_budget_refusal(target):
    # 64 query heads on one kv head at 32K tokens: -LSE and D of every row of the group no longer fit SBUF.
    # Shapes only (validation runs before any instruction), so no 32K-token arrays are built.
    target("trn2")

    def t(*shape, dt="float32"):
        return types.SimpleNamespace(shape=shape, dtype=dt)
    q, kv = t(1, 64, 128, 32768), t(1, 1, 128, 32768)
    lse = t(1, 64, 128, 256)
    assert "SBUF bytes per partition" in kb.bwd_problem(q, kv, kv, q, q, lse, use_causal_mask=True)
    # the same shapes with 8 query heads per kv head fit (llama-style GQA at 16K)
    q8, lse8, kv8 = t(1, 8, 128, 16384), t(1, 8, 128, 128), t(1, 1, 128, 16384)
    assert kb.bwd_problem(q8, kv8, kv8, q8, q8, lse8, use_causal_mask=True) is None
    cfg = kb._configure(q8, kv8, None, None, True, False, None, None, None)
    assert cfg.n_sections == -(-16384 // cfg.section_len) >= 2
