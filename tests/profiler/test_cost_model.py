"""One instruction of each kind, run eagerly under the trace: its modeled cost must equal the formula of
docs/performance.md evaluated by hand here from the parameter table (never by calling the model's helpers)."""
import pytest

from nki_attn.profiler import TRN1, TRN2, TRN3, instruction_cost
from nki_attn.sim import isa as nisa
from nki_attn.sim import language as nl
from nki_attn.sim import trace


def tile(shape, dtype, buffer=None, value=0.5):
    t = nl.ndarray(shape, dtype, buffer=buffer or nl.sbuf)
    t.np()[...] = value
    return t


def only_record(fn):
    """Run ``fn`` with the trace on; return its single record."""
    with trace.recording() as rec:
        fn()
    assert len(rec.records) == 1, rec.records
    return rec.records[0]


@pytest.fixture
def trn(monkeypatch):
    def set_target(gen):
        monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", gen.name)
        return gen
    return set_target


# ----------------------------------------------------------------------------------------------------- TensorE
def test_matmul_full_tile_costs_n_cycles(trn):
    g = trn(TRN2)
    st, mv = tile((128, 128), nl.bfloat16), tile((128, 512), nl.bfloat16)
    ps = nl.ndarray((128, 512), nl.float32, buffer=nl.psum)
    r = only_record(lambda: nisa.nc_matmul(dst=ps, stationary=st, moving=mv))
    c = instruction_cost(r, g)
    assert (r.engine, c.engine) == ("TensorE", "TensorE")
    assert c.cycles == 512
    assert c.ns == pytest.approx(512 / 2.4)
    assert r.flops == 2 * 128 * 512 * 128


def test_narrow_matmul_pays_the_minimum_latency(trn):
    g = trn(TRN2)
    st, mv = tile((128, 128), nl.bfloat16), tile((128, 32), nl.bfloat16)
    ps = nl.ndarray((128, 32), nl.float32, buffer=nl.psum)
    r = only_record(lambda: nisa.nc_matmul(dst=ps, stationary=st, moving=mv))
    assert instruction_cost(r, g).ns == pytest.approx(64 / 2.4)  # MM_INIT_LATENCY = 64 cycles, not 32


def test_small_k_does_not_make_a_matmul_cheaper(trn):
    g = trn(TRN2)
    st, mv = tile((32, 128), nl.bfloat16), tile((32, 512), nl.bfloat16)
    ps = nl.ndarray((128, 512), nl.float32, buffer=nl.psum)
    r = only_record(lambda: nisa.nc_matmul(dst=ps, stationary=st, moving=mv))
    assert instruction_cost(r, g).ns == pytest.approx(512 / 2.4)
    assert r.flops == 2 * 128 * 512 * 32  # but it does 4x less useful work


@pytest.mark.parametrize("gen, ghz", [(TRN1, 2.8), (TRN2, 2.4)])
def test_fp32_matmul_is_four_times_slower(trn, gen, ghz):
    g = trn(gen)
    st, mv = tile((128, 128), nl.float32), tile((128, 256), nl.float32)
    ps = nl.ndarray((128, 256), nl.float32, buffer=nl.psum)
    r = only_record(lambda: nisa.nc_matmul(dst=ps, stationary=st, moving=mv))
    assert instruction_cost(r, g).ns == pytest.approx(4 * 256 / ghz)


def test_tensor_engine_transpose_costs_like_its_matmul_and_has_no_useful_flops(trn):
    g = trn(TRN2)
    data = tile((128, 64), nl.bfloat16)
    ps = nl.ndarray((64, 128), nl.bfloat16, buffer=nl.psum)
    r = only_record(lambda: nisa.nc_transpose(dst=ps, data=data))
    assert r.engine == "TensorE" and r.is_transpose
    # identity moving is [128 x 128]: N = 128 columns of the result
    assert instruction_cost(r, g).ns == pytest.approx(128 / 2.4)
    assert r.flops == 0


@pytest.mark.parametrize("gen, factor, ghz", [(TRN1, 4, 2.8), (TRN2, 2, 2.4)])
def test_fp32_transpose_factor_by_generation(trn, gen, factor, ghz):
    g = trn(gen)
    data = tile((128, 128), nl.float32)
    ps = nl.ndarray((128, 128), nl.float32, buffer=nl.psum)
    r = only_record(lambda: nisa.nc_transpose(dst=ps, data=data))
    assert instruction_cost(r, g).ns == pytest.approx(factor * 128 / ghz)


# ----------------------------------------------------------------------------------------------------- ScalarE
def test_activation_costs_overhead_plus_n(trn):
    g = trn(TRN2)
    src = tile((128, 512), nl.float32, nl.psum)
    bias = tile((128, 1), nl.float32)
    dst = nl.ndarray((128, 512), nl.bfloat16, buffer=nl.sbuf)
    r = only_record(lambda: nisa.activation(dst=dst, op=nl.exp, data=src, bias=bias, scale=0.5))
    assert r.engine == "ScalarE"
    assert instruction_cost(r, g).ns == pytest.approx((100 + 512) / 1.2)  # bias and scale are free


@pytest.mark.parametrize("gen, speedup", [(TRN2, 1), (TRN3, 2)])
def test_scalar_engine_bf16_copy_is_faster_on_trn3(trn, gen, speedup):
    g = trn(gen)
    src, dst = tile((128, 512), nl.bfloat16), nl.ndarray((128, 512), nl.bfloat16, buffer=nl.sbuf)
    r = only_record(lambda: nisa.tensor_copy(dst=dst, src=src, engine=nisa.engine.scalar))
    assert instruction_cost(r, g).ns == pytest.approx((100 + 512 / speedup) / 1.2)


# ----------------------------------------------------------------------------------------------------- VectorE
def test_tensor_tensor_fp32_streams_two_inputs(trn):
    g = trn(TRN2)
    a, b = tile((128, 256), nl.float32), tile((128, 256), nl.float32)
    dst = nl.ndarray((128, 256), nl.float32, buffer=nl.sbuf)
    r = only_record(lambda: nisa.tensor_tensor(dst=dst, data1=a, data2=b, op=nl.add))
    assert r.engine == "VectorE"
    assert instruction_cost(r, g).ns == pytest.approx((100 + 2 * 256) / 0.96)


def test_tensor_tensor_bf16_sbuf_perf_mode(trn):
    g = trn(TRN2)
    a, b = tile((128, 256), nl.bfloat16), tile((128, 256), nl.bfloat16)
    dst = nl.ndarray((128, 256), nl.bfloat16, buffer=nl.sbuf)
    r = only_record(lambda: nisa.tensor_tensor(dst=dst, data1=a, data2=b, op=nl.multiply))
    assert instruction_cost(r, g).ns == pytest.approx((100 + 2 * 256 / 2) / 0.96)
    assert instruction_cost(r, TRN1).ns == pytest.approx((100 + 2 * 256) / 1.12)  # no perf mode on v2


@pytest.mark.parametrize("src_buf, src_dt, speedup", [
    (nl.sbuf, nl.bfloat16, 4),   # all SBUF, all bf16: 4x
    (nl.psum, nl.bfloat16, 2),   # one side PSUM: 2x
    (nl.psum, nl.float32, 1),    # fp32 operand: no perf mode
])
def test_tensor_copy_perf_modes(trn, src_buf, src_dt, speedup):
    g = trn(TRN2)
    src = tile((128, 512), src_dt, src_buf)
    dst = nl.ndarray((128, 512), nl.bfloat16, buffer=nl.sbuf)
    r = only_record(lambda: nisa.tensor_copy(dst=dst, src=src))
    assert instruction_cost(r, g).ns == pytest.approx((100 + 512 / speedup) / 0.96)


def test_strided_bf16_copy_gets_the_half_speedup(trn):
    g = trn(TRN2)
    big = tile((128, 1024), nl.bfloat16)
    src = big[:, 0:1024:2]
    assert src.strides[-1] == 2
    dst = nl.ndarray((128, 512), nl.bfloat16, buffer=nl.sbuf)
    r = only_record(lambda: nisa.tensor_copy(dst=dst, src=src))
    assert instruction_cost(r, g).ns == pytest.approx((100 + 512 / 2) / 0.96)


def test_tensor_scalar_column_operand_is_free(trn):
    g = trn(TRN2)
    data, col = tile((128, 512), nl.float32), tile((128, 1), nl.float32)
    dst = nl.ndarray((128, 512), nl.float32, buffer=nl.sbuf)
    r = only_record(lambda: nisa.tensor_scalar(dst=dst, data=data, op0=nl.multiply, operand0=col,
                                               op1=nl.add, operand1=1.0))
    assert instruction_cost(r, g).ns == pytest.approx((100 + 512) / 0.96)


def test_reduce_costs_its_input_length(trn):
    g = trn(TRN2)
    data = tile((128, 512), nl.float32, nl.psum)
    dst = nl.ndarray((128, 1), nl.float32, buffer=nl.sbuf)
    r = only_record(lambda: nisa.tensor_reduce(dst=dst, op=nl.maximum, data=data, axis=1))
    assert instruction_cost(r, g).ns == pytest.approx((100 + 512) / 0.96)


def test_reciprocal_is_eight_cycles_per_element_on_vector(trn):
    g = trn(TRN2)
    data = tile((128, 16), nl.float32)
    dst = nl.ndarray((128, 16), nl.float32, buffer=nl.sbuf)
    r = only_record(lambda: nisa.reciprocal(dst=dst, data=data))
    assert instruction_cost(r, g).ns == pytest.approx((100 + 8 * 16) / 0.96)


def test_partitions_used_do_not_change_vector_time(trn):
    g = trn(TRN2)
    a, b = tile((32, 256), nl.float32), tile((32, 256), nl.float32)
    dst = nl.ndarray((32, 256), nl.float32, buffer=nl.sbuf)
    r = only_record(lambda: nisa.tensor_tensor(dst=dst, data1=a, data2=b, op=nl.add))
    assert instruction_cost(r, g).ns == pytest.approx((100 + 2 * 256) / 0.96)


# ----------------------------------------------------------------------------------------------------- GpSimdE
def test_iota_on_gpsimd(trn):
    g = trn(TRN2)
    dst = nl.ndarray((128, 64), nl.int32, buffer=nl.sbuf)
    r = only_record(lambda: nisa.iota(dst=dst, pattern=[[1, 64]], channel_multiplier=64))
    assert r.engine == "GpSimdE"
    assert instruction_cost(r, g).ns == pytest.approx((100 + 64) / 1.2)


def test_affine_select_on_gpsimd(trn):
    g = trn(TRN1)
    src = tile((128, 512), nl.float32)
    dst = nl.ndarray((128, 512), nl.float32, buffer=nl.sbuf)
    r = only_record(lambda: nisa.affine_select(dst=dst, pattern=[[-1, 512]], channel_multiplier=1,
                                               on_true_tile=src, on_false_value=-1e30, cmp_op=nl.greater_equal))
    assert instruction_cost(r, g).ns == pytest.approx((100 + 512) / 1.4)


# ----------------------------------------------------------------------------------------------------- DMA
def test_full_partition_load_spreads_over_all_16_queues(trn):
    g = trn(TRN2)
    src = tile((128, 512), nl.bfloat16, nl.hbm)
    dst = nl.ndarray((128, 512), nl.bfloat16, buffer=nl.sbuf)
    r = only_record(lambda: nisa.dma_copy(dst=dst, src=src))
    c = instruction_cost(r, g)
    assert r.engine == "DMA" and r.hbm_bytes == 128 * 512 * 2
    per_queue = 8 * 512 * 2  # 8 partitions x 1 KiB
    assert sorted(q for q, _ in c.queues) == list(range(16))
    assert all(ns == pytest.approx(1300 + per_queue / 23) for _, ns in c.queues)
    assert c.ns == pytest.approx(1300 + per_queue / 23)


def test_few_partitions_use_one_queue(trn):
    # The DMA overview's example: A[4, 4096] bf16 HBM -> SBUF occupies a single engine with 32 KiB.
    g = trn(TRN2)
    src = tile((4, 4096), nl.bfloat16, nl.hbm)
    dst = nl.ndarray((4, 4096), nl.bfloat16, buffer=nl.sbuf)
    c = instruction_cost(only_record(lambda: nisa.dma_copy(dst=dst, src=src)), g)
    assert [q for q, _ in c.queues] == [0]
    assert c.ns == pytest.approx(1300 + 32768 / 23)


def test_partition_offset_selects_the_queues(trn):
    g = trn(TRN2)
    src = tile((16, 256), nl.float32, nl.hbm)
    big = nl.ndarray((128, 256), nl.float32, buffer=nl.sbuf)
    c = instruction_cost(only_record(lambda: nisa.dma_copy(dst=big[64:80, :], src=src)), g)
    assert [q for q, _ in c.queues] == [8, 9]  # partitions 64..79 -> queues 64//8 and 72//8
    assert c.ns == pytest.approx(1300 + 8 * 256 * 4 / 23)


def test_store_to_hbm_counts_hbm_bytes_of_the_hbm_side(trn):
    g = trn(TRN3)
    src = tile((128, 128), nl.float32)
    dst = nl.ndarray((128, 128), nl.bfloat16, buffer=nl.hbm)  # casting store: 64 KiB read, 32 KiB written
    r = only_record(lambda: nisa.dma_copy(dst=dst, src=src))
    assert r.hbm_bytes == 128 * 128 * 2
    assert r.bytes_moved == 128 * 128 * 4
    assert instruction_cost(r, g).ns == pytest.approx(1300 + 8 * 128 * 4 / 33)


def test_hbm_to_hbm_copy_spreads_evenly(trn):
    g = trn(TRN1)
    src = tile((64, 1024), nl.float32, nl.hbm)
    dst = nl.ndarray((64, 1024), nl.float32, buffer=nl.hbm)
    r = only_record(lambda: nisa.dma_copy(dst=dst, src=src))
    c = instruction_cost(r, g)
    assert len(c.queues) == 16
    assert c.ns == pytest.approx(1300 + 64 * 1024 * 4 / 16 / 17)
    assert r.hbm_bytes == 2 * 64 * 1024 * 4  # read and written in HBM


def test_dma_transpose_runs_at_90_percent_from_hbm(trn):
    g = trn(TRN2)
    src = tile((128, 64), nl.bfloat16, nl.hbm)
    dst = nl.ndarray((64, 128), nl.bfloat16, buffer=nl.sbuf)
    r = only_record(lambda: nisa.dma_transpose(dst=dst, src=src))
    c = instruction_cost(r, g)
    assert len(c.queues) == 8  # 64 destination partitions
    assert c.ns == pytest.approx(1300 + 8 * 128 * 2 / (23 * 0.9))


def test_dma_trigger_engine_stays_on_the_dma_queues(trn):
    g = trn(TRN2)
    src = tile((128, 64), nl.bfloat16, nl.hbm)
    dst = nl.ndarray((128, 64), nl.bfloat16, buffer=nl.sbuf)
    r = only_record(lambda: nisa.dma_copy(dst=dst, src=src, engine=nisa.engine.scalar,
                                          dge_mode=nisa.dge_mode.hwdge))
    assert r.engine == "DMA" and r.info == {"trigger": "scalar"}
    assert instruction_cost(r, g).engine == "DMA"


def test_strided_copy_out_of_psum_gets_no_perf_mode(trn):
    g = trn(TRN2)
    big = tile((128, 1024), nl.bfloat16, nl.psum)
    dst = nl.ndarray((128, 512), nl.bfloat16, buffer=nl.sbuf)
    r = only_record(lambda: nisa.tensor_copy(dst=dst, src=big[:, 0:1024:2]))
    assert instruction_cost(r, g).ns == pytest.approx((100 + 512) / 0.96)
