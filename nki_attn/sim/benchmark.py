"""``nki.benchmark`` on the simulator: the NKI benchmarking decorator, with MODELED latencies.

The NKI releases whose tutorials published kernel latencies (e.g. the trn1 matrix multiplication tutorial) measure
them with ``nki.benchmark(warmup=..., iters=..., save_neff_name=..., save_trace_name=...)(kernel)``: calling the
wrapped kernel runs it on a NeuronDevice in a loop, and ``wrapped.benchmark_result.nc_latency
.get_latency_percentile(p)`` returns the ``p``-th percentile latency in microseconds (p in 0, 1, 10, 25, 50, 90, 99,
100). The same code runs here: the kernel executes once on the simulator with the instruction trace on (the
simulator is deterministic, so every iteration would model the same latency), and the latency is the cost
model's scheduled time (``nki_attn.profiler``, the model named in ``result.model``). Every percentile is that one
modeled figure, and ``result.modeled`` is True: nothing is measured.

On a Trainium host with a real NKI that still provides ``nki.benchmark``, ``run_benchmark`` calls that instead and
returns measured latencies (``modeled`` False). ``save_trace_name`` here writes the modeled schedule as a Chrome
trace (JSON; Perfetto opens it), standing in for neuron-profile's NTFF.
"""
import json

from . import context
from . import trace as _trace
from .runtime import Kernel

PERCENTILES = (0, 1, 10, 25, 50, 90, 99, 100)


def _is_plain_function(f):
    import inspect
    return inspect.isfunction(f) and getattr(f, "__module__", "").split(".")[0] != "nki_attn"


class LatencyResult:
    """``nc_latency``: latencies of the benchmarked iterations, in microseconds. ``modeled``: True when they come
    from the cost model (this simulator), False when measured on a NeuronDevice; ``model``: which cost model."""

    def __init__(self, latencies_us, modeled, model=None):
        self.latencies_us = list(latencies_us)
        self.modeled = modeled
        self.model = model

    def get_latency_percentile(self, percentile):
        """The ``percentile``-th latency in microseconds; ``percentile`` one of ``PERCENTILES``."""
        if percentile not in PERCENTILES:
            raise ValueError(f"percentile {percentile!r} is not available; use one of {list(PERCENTILES)}")
        xs = sorted(self.latencies_us)
        i = min(len(xs) - 1, int(round(percentile / 100 * (len(xs) - 1))))
        return xs[i]

    def __repr__(self):
        kind = f"MODELED by {self.model}" if self.modeled else "measured"
        return f"LatencyResult(p50={self.get_latency_percentile(50):.3f} us, {kind})"


class BenchmarkResult:
    """``benchmark_result`` of a wrapped kernel: ``nc_latency`` (``LatencyResult``), ``modeled``, ``model``, and
    here ``profile`` (the ``nki_attn.profiler.Profile`` the latency came from) and ``records`` (the trace)."""

    def __init__(self, nc_latency, profile=None, records=None):
        self.nc_latency = nc_latency
        self.modeled = nc_latency.modeled
        self.model = nc_latency.model
        self.profile = profile
        self.records = records


class Benchmarked:
    """A kernel wrapped by ``benchmark``; calling it runs the kernel and sets ``benchmark_result``."""

    def __init__(self, kernel, warmup=10, iters=100, save_neff_name=None, save_trace_name=None,
                 additional_compile_opt=None, useful_flops=None, n_cores=None, host=False):
        if not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"warmup={warmup!r} must be a non-negative int")
        if not isinstance(iters, int) or iters < 1:
            raise ValueError(f"iters={iters!r} must be a positive int")
        # A bare function is an ``nki.jit`` kernel still to be wrapped; anything else callable (a Kernel, or a
        # host function that launches one) is called as is.
        # ``host=True``: a host function that launches kernels itself (called as is); otherwise a bare function is
        # an ``nki.jit`` kernel still to be wrapped.
        self.host = host
        self.kernel = kernel if host or isinstance(kernel, Kernel) or not _is_plain_function(kernel) \
            else Kernel(kernel)
        self.warmup, self.iters = warmup, iters
        self.save_neff_name, self.save_trace_name = save_neff_name, save_trace_name
        self.additional_compile_opt = additional_compile_opt
        self.useful_flops, self.n_cores = useful_flops, n_cores
        self.benchmark_result = None

    def __call__(self, *args, **kwargs):
        from ..profiler import generation, profile  # the cost model; imported here so sim stays self-contained
        from ..profiler.params import MODEL
        with _trace.recording() as rec:
            out = self.kernel(*args, **kwargs)
        gen = generation(context.target_name(context.target_version()))
        prof = profile(rec.records, gen, self.useful_flops, n_cores=self.n_cores or getattr(self.kernel, "lnc", None))
        us = prof.time_ns / 1e3
        self.benchmark_result = BenchmarkResult(LatencyResult([us] * self.iters, True, MODEL), prof, rec.records)
        if self.save_trace_name:
            from ..profiler.schedule import chrome_trace
            with open(self.save_trace_name, "w") as f:
                json.dump(chrome_trace(prof.schedule, getattr(self.kernel, "__name__", "")), f)
        return out

    def __getitem__(self, lnc):
        return Benchmarked(self.kernel[lnc], self.warmup, self.iters, self.save_neff_name, self.save_trace_name,
                           self.additional_compile_opt, self.useful_flops, lnc, self.host)


def benchmark(kernel=None, **kwargs):
    """``nki.benchmark``: ``benchmark(kernel, warmup=10, iters=100, save_neff_name=None, save_trace_name=None,
    additional_compile_opt=None)`` or ``@benchmark(warmup=..., iters=...)``. The wrapped kernel takes numpy arrays
    (kernel layouts, as the kernel declares them) and returns the kernel's outputs; afterwards its
    ``benchmark_result.nc_latency.get_latency_percentile(p)`` is the MODELED latency in microseconds."""
    if kernel is None:
        return lambda k: Benchmarked(k, **kwargs)
    return Benchmarked(kernel, **kwargs)


def run_benchmark(kernel, args, kwargs=None, warmup=10, iters=100, useful_flops=None, save_trace_name=None,
                  host=True):
    """Benchmark ``kernel(*args, **kwargs)`` with the NKI in use: a real ``nki.benchmark`` when one is importable
    (Trainium host with an NKI that provides it: measured latencies), else this simulator's (modeled). ``host``:
    ``kernel`` is a host function that launches kernels (our kernel_api functions, a library's wrapper). Returns
    ``(outputs, benchmark_result)``."""
    from . import real_nki_available
    if real_nki_available():
        import nki as real  # pragma: no cover - only on a Trainium host
        if hasattr(real, "benchmark"):
            wrapped = real.benchmark(warmup=warmup, iters=iters)(getattr(kernel, "fn", kernel))
            out = wrapped(*args, **(kwargs or {}))
            res = wrapped.benchmark_result
            res.modeled = False
            return out, res
    wrapped = Benchmarked(kernel, warmup=warmup, iters=iters, useful_flops=useful_flops,
                          save_trace_name=save_trace_name, host=host)
    out = wrapped(*args, **(kwargs or {}))
    return out, wrapped.benchmark_result
