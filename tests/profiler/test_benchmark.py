"""``nki.benchmark`` on the simulator: the NKI decorator's arguments and result object, with the latency taken
from cost model v2's schedule of the same run (modeled, and saying so)."""
import json

import numpy as np
import pytest

import nki_attn.sim as nki
from nki_attn.profiler import TRN2, profile
from nki_attn.sim import isa as nisa
from nki_attn.sim import language as nl
from nki_attn.sim import trace
from nki_attn.sim.benchmark import PERCENTILES, run_benchmark


def add_kernel(a_tensor, b_tensor):
    c_tensor = nl.ndarray(a_tensor.shape, dtype=a_tensor.dtype, buffer=nl.shared_hbm)
    a = nl.ndarray(a_tensor.shape, dtype=a_tensor.dtype, buffer=nl.sbuf)
    b = nl.ndarray(b_tensor.shape, dtype=b_tensor.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=a, src=a_tensor)
    nisa.dma_copy(dst=b, src=b_tensor)
    c = nl.ndarray(a_tensor.shape, dtype=a_tensor.dtype, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=c, data1=a, data2=b, op=nl.add)
    nisa.dma_copy(dst=c_tensor, src=c)
    return c_tensor


@pytest.fixture(autouse=True)
def trn2(monkeypatch):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")


def test_decorator_result_is_the_scheduled_time_and_says_modeled(tmp_path):
    a = np.zeros((128, 1024), np.float32)
    b = np.random.default_rng(0).random((128, 1024)).astype(np.float32)
    out_trace = tmp_path / "t.json"
    bench = nki.benchmark(warmup=10, iters=100, save_trace_name=str(out_trace))(add_kernel)
    c = bench(a, b)
    np.testing.assert_array_equal(np.asarray(c), a + b)
    lat = bench.benchmark_result.nc_latency
    with trace.recording() as rec:
        nki.jit(add_kernel)(a, b)
    expected_us = profile(rec.records, TRN2).time_ns / 1e3
    assert [lat.get_latency_percentile(p) for p in PERCENTILES] == pytest.approx([expected_us] * len(PERCENTILES))
    assert lat.modeled and bench.benchmark_result.modeled and "cost model v2" in bench.benchmark_result.model
    assert len(lat.latencies_us) == 100
    with pytest.raises(ValueError, match="percentile"):
        lat.get_latency_percentile(95)
    assert json.loads(out_trace.read_text())["traceEvents"]


def test_run_benchmark_calls_host_functions_as_they_are():
    a = np.ones((128, 512), np.float32)
    kernel = nki.jit(add_kernel)
    out, res = run_benchmark(lambda x, y: kernel(x, y), (a, a))
    np.testing.assert_array_equal(np.asarray(out), 2 * a)
    assert res.modeled and res.records and res.profile.time_ns > 0


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="iters"):
        nki.benchmark(add_kernel, iters=0)
