"""The trace of a tiny known kernel, and the profile built from it, checked record by record."""
import ml_dtypes
import numpy as np
import pytest

from nki_attn.profiler import TRN2, profile
from nki_attn.sim import isa as nisa
from nki_attn.sim import jit
from nki_attn.sim import language as nl
from nki_attn.sim import trace


@jit
def mm_exp(x):
    """x [128, 512] bf16 in HBM -> exp(x[:, :128].T @ x) [128, 512] fp32 (one DMA in, one matmul, one
    activation, one DMA out)."""
    out = nl.ndarray((128, 512), nl.float32, buffer=nl.shared_hbm)
    t = nl.ndarray((128, 512), nl.bfloat16, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    acc = nl.ndarray((128, 512), nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=acc, stationary=t[:, 0:128], moving=t)
    res = nl.ndarray((128, 512), nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=res, op=nl.exp, data=acc, scale=0.01)
    nisa.dma_copy(dst=out, src=res)
    return out


@jit
def mm_exp_halves(x):
    """x [128, 1024] bf16: core ``program_id`` does mm_exp's work on its 512-column half."""
    out = nl.ndarray((128, 1024), nl.float32, buffer=nl.shared_hbm)
    c0 = nl.program_id(0) * 512
    t = nl.ndarray((128, 512), nl.bfloat16, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x[:, c0:c0 + 512])
    acc = nl.ndarray((128, 512), nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=acc, stationary=t[:, 0:128], moving=t)
    res = nl.ndarray((128, 512), nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=res, op=nl.exp, data=acc, scale=0.01)
    nisa.dma_copy(dst=out[:, c0:c0 + 512], src=res)
    return out


@pytest.fixture
def x():
    return np.random.default_rng(0).standard_normal((128, 512)).astype(ml_dtypes.bfloat16)


def test_tiny_kernel_records(monkeypatch, x):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    with trace.recording() as rec:
        mm_exp(x)
    r = rec.records
    assert [(e.instr, e.engine) for e in r] == [
        ("dma_copy", "DMA"), ("nc_matmul", "TensorE"), ("activation", "ScalarE"), ("dma_copy", "DMA")]
    load, mm, act, store = r
    assert (load.srcs[0].buffer, load.dst.buffer, load.dst.shape, load.dst.dtype) == \
        ("hbm", "sbuf", (128, 512), "bfloat16")
    assert load.bytes_moved == load.hbm_bytes == 128 * 512 * 2
    assert mm.info == {"m": 128, "n": 512, "k": 128}
    assert [s.shape for s in mm.srcs] == [(128, 128), (128, 512)]
    assert mm.dst.buffer == "psum" and mm.flops == 2 * 128 * 512 * 128
    assert act.srcs[0].buffer == "psum" and act.flops == 0 and act.hbm_bytes == 0
    assert store.dst.buffer == "hbm" and store.hbm_bytes == 128 * 512 * 4
    assert rec.counts_by_engine() == {"DMA": 2, "TensorE": 1, "ScalarE": 1}
    assert rec.matmul_flops() == 2 * 128 * 512 * 128
    assert rec.hbm_bytes() == 128 * 512 * 6


def test_tiny_kernel_modeled_time(x):
    with trace.recording() as rec:
        mm_exp(x)
    p = profile(rec.records, TRN2, useful_flops=2 * 128 * 512 * 64)
    tensor = 512 / 2.4
    scalar = 512 / 1.2  # max(MIN_II = 64, N = 512); it reads PSUM written by TensorE: no same-engine dependency
    # every queue carries 8 partitions of each transfer: 8 KiB in, 16 KiB out, each plus the 150 ns per piece
    dma = 8192 / 23 + 150 + 16384 / 23 + 150
    assert p.engine_busy("TensorE") == pytest.approx(tensor)
    assert p.engine_busy("ScalarE") == pytest.approx(scalar)
    assert p.engine_busy("DMA") == pytest.approx(dma)
    assert p.engine_busy("VectorE") == 0 and p.engine_busy("GpSimdE") == 0
    assert p.time_overlap_ns == pytest.approx(dma) and p.bottleneck == "DMA"
    assert p.time_serial_ns == pytest.approx(tensor + scalar + dma)
    assert p.dma_transfers == 2 and p.dma_latency_ns == pytest.approx(2 * 1300)  # reported, not in either time
    peak = 2 * 128 * 128 * 2.4  # FLOP per ns
    executed = 2 * 128 * 512 * 128
    assert p.tensor_utilisation(True) == pytest.approx(executed / (dma * peak))
    # useful FLOPs (here: a caller counting half the contraction as useful) are reported beside executed ones
    assert p.useful_tensor_utilisation(True) == pytest.approx(executed / 2 / (dma * peak))
    assert p.tensor_floor_ns == pytest.approx(executed / 2 / peak)
    assert p.floor_ratio() == pytest.approx(dma / (executed / 2 / peak))
    assert p.tensor_efficiency() == pytest.approx(1.0)  # a full 128x128x512 bf16 matmul uses every PE
    assert p.hbm_bytes == 128 * 512 * 6
    d = p.to_dict()
    assert d["modeled"] is True and d["engines"]["DMA"]["instructions"] == 2
    assert sum(e["busy_ns"] for e in d["engines"].values()) == pytest.approx(d["time_serial_ns"])
    assert d["useful_tensor_utilisation_overlap"] == pytest.approx(p.useful_tensor_utilisation(True))
    assert d["floor_ratio_overlap"] == pytest.approx(p.floor_ratio(True))


def test_lnc2_cores_are_modeled_separately(monkeypatch, x):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    with trace.recording() as rec:
        mm_exp_halves[2](np.concatenate([x, x], axis=1))
    assert rec.cores() == [0, 1] and rec.count(core=0) == rec.count(core=1) == 4
    p = profile(rec.records, TRN2)
    single = profile([r for r in rec.records if r.core == 0], TRN2)
    # each core has its own engines and queues: the launch takes as long as one core, with twice the work
    assert p.time_overlap_ns == pytest.approx(single.time_overlap_ns)
    assert p.counts["TensorE"] == 2 and p.matmul_flops == 2 * single.matmul_flops
    assert p.tensor_utilisation() == pytest.approx(single.tensor_utilisation())


def test_trace_is_off_by_default_and_innermost_recorder_wins(x):
    from nki_attn.sim import context
    lau = context.Launch(1, grid=False)
    assert lau.tracer is None  # no recorder: the per-instruction check is one attribute read
    mm_exp(x)  # runs untraced
    with trace.recording() as outer:
        with trace.recording() as inner:
            mm_exp(x)
        assert len(inner.records) == 4 and len(outer.records) == 0
        mm_exp(x)
    assert len(outer.records) == 4
    assert trace.active_recorder() is None


def test_operand_span_bounds_the_bytes_a_view_touches():
    big = nl.ndarray((128, 1024), nl.float32, buffer=nl.sbuf)
    big.np()[...] = 0.0
    small = nl.ndarray((128, 512), nl.float32, buffer=nl.sbuf)
    with trace.recording() as rec:
        nisa.tensor_copy(dst=big[32:64, 512:768], src=big[0:32, 0:512:2])
        nisa.tensor_copy(dst=small, src=big[:, 0:512])
    first, second = rec.records
    # partitions 32..63, bytes 2048..3071 of each partition row
    assert first.dst.span == (32, 64, 512 * 4, 768 * 4)
    # a strided view still bounds from its first to its last element
    assert first.srcs[0].span == (0, 32, 0, 510 * 4 + 4)
    assert first.dst.uid == first.srcs[0].uid == second.srcs[0].uid != second.dst.uid
    hbm = nl.ndarray((4, 256), nl.bfloat16, buffer=nl.hbm)
    hbm.np()[...] = 0
    sb = nl.ndarray((2, 256), nl.bfloat16, buffer=nl.sbuf)
    with trace.recording() as rec:
        nisa.dma_copy(dst=sb, src=hbm[2:4, :])
    assert rec.records[0].srcs[0].span == (0, 1, 2 * 256 * 2, 4 * 256 * 2)  # HBM: one flat byte range
