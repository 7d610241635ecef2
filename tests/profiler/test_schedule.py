"""The dependency-aware schedule and the cost rules it adds, each pinned by a few eagerly run instructions whose
scheduled time is worked out by hand here from the parameter table (trn2: VectorE 0.96 GHz, ScalarE 1.2 GHz,
DMA queue 23 B/ns plus 150 ns per piece, no piece floor, semaphore-to-start latency 1300 ns, DGE 600 ns per
instruction on 2 blocks, tensor access overhead 60 cycles, cross-engine semaphore wait 200 ns, dma_transpose
SBUF -> SBUF at 50 % of a copy's throughput)."""
import json
from dataclasses import replace

import pytest

from nki_attn.profiler import TRN2, profile
from nki_attn.profiler.schedule import DMA_LATENCY, SEM_WAIT, chrome_trace
from nki_attn.sim import isa as nisa
from nki_attn.sim import language as nl
from nki_attn.sim import trace

VEC_COPY = 256 / 0.96       # fp32 tensor_copy [128, 512]: 512 elements at 2 per lane per cycle (A3), VectorE
SCALAR_ACT = 512 / 1.2      # fp32 activation [128, 512]: 512 elements at 1 per cycle, ScalarE
VEC_LAT, SCALAR_LAT = 60 / 0.96, 60 / 1.2   # access overhead: latency after the instruction, per engine clock


def tile(shape, dtype=nl.float32, buffer=None, value=0.5):
    t = nl.ndarray(shape, dtype, buffer=buffer or nl.sbuf)
    t.np()[...] = value
    return t


def records(fn):
    with trace.recording() as rec:
        fn()
    return rec.records


@pytest.fixture(autouse=True)
def trn2(monkeypatch):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")


def test_copy_and_transpose_of_the_same_tile():
    src = tile((128, 1, 4, 128), nl.bfloat16)
    dst_c, dst_t = nl.ndarray((128, 1, 4, 128), nl.bfloat16), nl.ndarray((128, 1, 4, 128), nl.bfloat16)
    copy = profile(records(lambda: nisa.dma_copy(dst=dst_c, src=src)), TRN2)
    # 128 KiB over 16 queues = 8 KiB each: 8192 / 23 ns of data plus the 150 ns per piece.
    piece = 8192 / 23 + 150
    assert copy.engine_busy("DMA") == pytest.approx(piece)
    assert copy.time_ns == pytest.approx(1300 + piece)  # the latency delays the transfer, then the queue works
    tr = profile(records(lambda: nisa.dma_transpose(dst=dst_t, src=src, axes=(3, 1, 2, 0))), TRN2)
    # Hardware DGE: 128 source partitions are not in {1, 2, 4, 8, 16}, so 8 instructions of 16 partitions; each
    # moves 1 KiB per queue, priced as that copy's occupancy at 50 % throughput, 8 per queue.
    sub = (1024 / 23 + 150) / 0.5
    assert tr.engine_busy("DMA") == pytest.approx(8 * sub)
    assert tr.engine_busy("DGE") == pytest.approx(8 * 600 / 2)
    # DGE instruction j ends at 600 * (j // 2 + 1) ns, always before its queue pieces could start (after the
    # 1300 ns latency and j earlier pieces of 389 ns): the queue never waits for the DGE.
    assert tr.time_ns == pytest.approx(1300 + 8 * sub)
    # Without the split: one DGE instruction and one piece of 8 KiB per queue at half the copy's throughput.
    one = profile(records(lambda: nisa.dma_transpose(dst=dst_t, src=src, axes=(3, 1, 2, 0))),
                  replace(TRN2, dge_transpose_split=False))
    assert one.engine_busy("DMA") == pytest.approx(2 * piece) and one.time_ns == pytest.approx(1300 + 2 * piece)
    assert one.engine_busy("DGE") == pytest.approx(600 / 2)
    # The earlier model: bandwidth halved, then the copy's 850 ns floor, no fixed cost, no DGE: a copy's price.
    from nki_attn.profiler.params import revert
    old = revert(TRN2, ["dma_transpose_whole_piece", "hwdge_transpose", "calibrated_dma"])
    was = profile(records(lambda: nisa.dma_transpose(dst=dst_t, src=src, axes=(3, 1, 2, 0))), old)
    assert was.engine_busy("DMA") == pytest.approx(850) and was.engine_busy("DGE") == 0


def test_two_dependent_instructions_on_two_engines():
    a, b, c = tile((128, 512)), nl.ndarray((128, 512), nl.float32), nl.ndarray((128, 512), nl.float32)

    def kernel():
        nisa.tensor_copy(dst=b, src=a, engine=nisa.engine.vector)
        nisa.activation(dst=c, op=nl.exp, data=b)
    recs = records(kernel)
    for sem in (0.0, 250.0):
        p = profile(recs, replace(TRN2, sem_wait_ns=sem))
        # ScalarE waits for VectorE's result: its end, its access overhead, then the semaphore.
        assert p.time_ns == pytest.approx(VEC_COPY + VEC_LAT + sem + SCALAR_ACT + SCALAR_LAT)
        assert p.time_overlap_ns == pytest.approx(SCALAR_ACT) and p.time_ns >= p.time_overlap_ns
        path = p.critical_path_by_kind()
        assert path["VectorE tensor_copy"] == pytest.approx(VEC_COPY)
        assert path["ScalarE activation"] == pytest.approx(SCALAR_ACT)
        assert sum(path.values()) == pytest.approx(p.time_ns)
        assert (SEM_WAIT in path) == bool(sem)


def test_two_independent_instructions_overlap():
    a, b = tile((128, 512)), tile((128, 512))
    b2, c = nl.ndarray((128, 512), nl.float32), nl.ndarray((128, 512), nl.float32)

    def kernel():
        nisa.tensor_copy(dst=b2, src=a, engine=nisa.engine.vector)
        nisa.activation(dst=c, op=nl.exp, data=b)
    p = profile(records(kernel), replace(TRN2, sem_wait_ns=250.0))
    assert p.time_ns == pytest.approx(max(VEC_COPY + VEC_LAT, SCALAR_ACT + SCALAR_LAT))
    assert p.time_serial_ns == pytest.approx(VEC_COPY + SCALAR_ACT)


def test_write_after_read_waits_for_the_reader():
    a, b = tile((128, 512)), tile((128, 512))
    c = nl.ndarray((128, 512), nl.float32)

    def kernel():
        nisa.activation(dst=c, op=nl.exp, data=a)              # ScalarE reads a
        nisa.tensor_copy(dst=a, src=b, engine=nisa.engine.vector)  # VectorE overwrites a: must wait
    p = profile(records(kernel), TRN2)
    # A write-after-read waits for the reader's end (no result of it is needed: no access latency), and the
    # semaphore between the two engines (200 ns).
    assert p.time_ns == pytest.approx(SCALAR_ACT + 200 + VEC_COPY + VEC_LAT)


def test_psum_accumulation_group_is_read_after_its_last_matmul():
    st, mv = tile((128, 128), nl.bfloat16), tile((128, 512), nl.bfloat16)
    ps = nl.ndarray((128, 512), nl.float32, buffer=nl.psum)
    out = nl.ndarray((128, 512), nl.float32)

    def kernel():
        nisa.nc_matmul(dst=ps, stationary=st, moving=mv)
        nisa.nc_matmul(dst=ps, stationary=st, moving=mv, accumulate=True)
        nisa.tensor_copy(dst=out, src=ps, engine=nisa.engine.vector)
    p = profile(records(kernel), TRN2)
    mm = 512 / 2.4  # N = 512 columns per matmul (A3)
    # fp32 PSUM -> SBUF copy: 512 elements at 2 per cycle; PSUM on one side gives no perf mode for fp32
    # the second matmul follows the first on TensorE (same engine: in order, no semaphore); VectorE waits for its
    # result: TensorE's access overhead, then the 200 ns semaphore
    assert p.time_ns == pytest.approx(2 * mm + 60 / 2.4 + 200 + VEC_COPY + VEC_LAT)


def test_dma_latency_is_hidden_by_queued_transfers():
    srcs = [tile((128, 2048)) for _ in range(3)]
    dsts = [nl.ndarray((128, 2048), nl.float32) for _ in range(3)]

    def kernel():
        for s, d in zip(srcs, dsts):
            nisa.dma_copy(dst=d, src=s)
    p = profile(records(kernel), TRN2)
    piece = 8 * 2048 * 4 / 23 + 150  # 64 KiB per queue at 23 B/ns, plus the fixed cost
    assert p.time_ns == pytest.approx(1300 + 3 * piece)  # one latency, not three
    assert p.critical_path_by_kind()[DMA_LATENCY] == pytest.approx(1300)


def test_chrome_trace_has_one_track_per_engine_and_queue(tmp_path):
    from nki_attn.cli import main
    out = tmp_path / "t.json"
    assert main(["profile", "--kernel", "demo", "--seqlen", "512", "--trace", str(out)]) == 0
    d = json.loads(out.read_text())
    names = {e["tid"]: e["args"]["name"] for e in d["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    assert len(set(names.values())) == len(names)  # one track per engine / queue
    assert {"TensorE", "ScalarE", "DMA q0"} <= set(names.values())
    xs = [e for e in d["traceEvents"] if e["ph"] == "X"]
    assert xs and all(e["tid"] in names and e["dur"] >= 0 and e["args"]["line"] for e in xs)
    assert any(e["name"] == "nc_matmul" and names[e["tid"]] == "TensorE" for e in xs)
    assert all(names[e["tid"]].startswith("DMA q") for e in xs if e["cat"] == "DMA" and e["name"] == "dma_copy")
    end = max(e["ts"] + e["dur"] for e in xs)
    assert end <= d["otherData"]["time_ns"] / 1e3 + 1e-9


def test_scheduled_time_never_below_perfect_overlap_on_a_kernel():
    import numpy as np

    from nki_attn.kernels.demo import matmul_exp
    rng = np.random.default_rng(0)
    lhsT, rhs = rng.standard_normal((64, 128)).astype(np.float32), rng.standard_normal((64, 1024)).astype(np.float32)
    with trace.recording() as rec:
        matmul_exp(lhsT, rhs, 0.5)
    for gen in (TRN2, replace(TRN2, sem_wait_ns=1300.0, access_overhead_cycles=0, dma_min_piece_ns=0.0)):
        p = profile(rec.records, gen)
        assert p.time_ns >= p.time_overlap_ns > 0


def test_the_critical_path_sums_to_the_scheduled_time_when_dma_pieces_start_apart():
    """A DMA's pieces run on several queues, each when its queue is free. X holds queues 8-15 (partitions
    64-127) with a long transfer; A (all 16 queues) starts on queues 0-7 at once and on 8-15 after X; B (all 16)
    follows A's short queue-0 piece, long before A's last piece ends. The critical path runs X -> A -> B with B
    starting inside A: the breakdown by kind must still add up to the scheduled time, not count the overlap
    twice."""
    big = tile((128, 8192), nl.bfloat16, nl.hbm)
    x_dst = nl.ndarray((128, 8192), nl.bfloat16, buffer=nl.sbuf)
    src = tile((128, 512), nl.bfloat16, nl.hbm)
    a_dst, b_dst = (nl.ndarray((128, 512), nl.bfloat16, buffer=nl.sbuf) for _ in range(2))

    def kernel():
        nisa.dma_copy(dst=x_dst[64:128, :], src=big[64:128, :])
        nisa.dma_copy(dst=a_dst, src=src)
        nisa.dma_copy(dst=b_dst, src=src)
    p = profile(records(kernel), TRN2)
    path = p.critical_path_by_kind()
    assert all(v >= 0 for v in path.values())
    assert sum(path.values()) == pytest.approx(p.time_ns)
    # the three transfers' queue time on the path is at most their busiest queue's total
    assert path["DMA dma_copy"] <= p.engine_busy("DMA") + 1e-6
