"""Cost model: modeled engine time of recorded instructions on one Trainium generation.

Every number comes from the ``Generation`` table (params.py). The rules, per engine (docs/performance.md explains
them with their sources):

- **TensorE** (``nc_matmul``, TensorE ``nc_transpose``): ``max(N, mm_min_cycles, ceil(M / load_stationary_speedup))``
  cycles, ``N`` = moving free size (dst columns), ``M`` = stationary free size (dst rows); times
  ``fp32_matmul_factor`` for fp32 operands (``fp32_transpose_factor`` for fp32 transposes). K does not change the
  time: a matmul with K < 128 wastes rows. A transpose costs like the matmul it is (identity moving).
- **VectorE / GpSimdE**: ``engine_overhead_cycles + N * inputs * op_factor / speedup`` cycles, ``N`` = elements per
  partition of the largest operand, ``inputs`` = full-size tensor inputs (per-partition ``(P, 1)`` operands are
  free), ``op_factor`` = ``vector_reciprocal_factor`` for ``reciprocal`` (else 1), ``speedup`` = the VectorE perf
  modes (``vector_fast_copy`` / ``vector_half_copy`` / ``vector_fast_tt``). Partitions used do not matter.
- **ScalarE**: ``engine_overhead_cycles + N / speedup`` cycles (one input; scale, bias, reduce are free),
  ``speedup`` = ``scalar_fast_copy`` for 16-bit ``tensor_copy``/``tensor_scalar``.
- **DMA**: a transfer is split over the queues that serve its SBUF partitions (partition ``p`` -> queue
  ``p // dma_partitions_per_queue``; HBM -> HBM transfers over all queues evenly); each piece costs
  ``dma_fixed_ns + bytes / dma_queue_bytes_per_ns`` on its queue (bandwidth scaled by the transpose efficiency for
  ``dma_transpose``). The DMA engine's busy time is its busiest queue's.

A profile sums instruction times per engine and core; the modeled kernel time is reported two ways: the busiest
engine (perfect overlap, a lower bound) and the sum over engines (no overlap, an upper bound for this model).
"""
import math
from collections import defaultdict
from dataclasses import dataclass

from ..sim.trace import DMA_INSTRUCTIONS, ENGINES

_HALF = frozenset({"bfloat16", "float16"})


@dataclass
class InstrCost:
    """Modeled cost of one record: ``engine`` it occupies, ``ns`` of that engine's time (for a DMA, its longest
    queue piece), ``cycles`` on that engine's clock (None for DMAs), and ``queues``: ``(queue, ns)`` pieces of a
    DMA (empty otherwise)."""

    engine: str
    ns: float
    cycles: float = None
    queues: tuple = ()


# ----------------------------------------------------------------------------------------------------- TensorE
def tensor_cycles(rec, gen):
    """TensorE cycles of a matmul or TensorE transpose record (see the module docstring)."""
    n = rec.dst.free_elems
    m = rec.dst.partitions
    cycles = max(n, gen.mm_min_cycles, math.ceil(m / gen.load_stationary_speedup))
    # fp32 cannot be mixed with narrower matmul operands, so the first source (stationary / data) decides.
    if rec.srcs and rec.srcs[0].dtype == "float32":
        cycles *= gen.fp32_transpose_factor if rec.is_transpose else gen.fp32_matmul_factor
    return cycles


# ----------------------------------------------------------------------------------------------------- Vector / Scalar / GpSimd
def _elems_and_inputs(rec):
    n = rec.dst.free_elems if rec.dst is not None else 1
    for s in rec.srcs:
        n = max(n, s.free_elems)
    # Per-partition operands ((P, 1) scale/bias/operand0) ride along for free; only full-size tiles stream.
    inputs = sum(1 for s in rec.srcs if s.free_elems == n)
    return n, max(inputs, 1)


def _full_operands(rec, n):
    ops = [rec.dst] if rec.dst is not None else []
    return ops + [s for s in rec.srcs if s.free_elems == n]


def vector_speedup(rec, gen, n):
    """VectorE perf-mode speedup of one record (1 when no perf mode applies)."""
    ops = _full_operands(rec, n)
    half = all(o.dtype in _HALF for o in ops)
    if rec.instr in ("tensor_copy", "tensor_scalar") and half:
        in_psum = sum(o.buffer == "psum" for o in ops)
        contiguous = all(o.unit_stride for o in ops)
        if in_psum == 0:
            return gen.vector_fast_copy if contiguous else gen.vector_half_copy
        # A3 lists PSUM-on-one-side at 2x only for contiguous operands; strided and PSUM gets no perf mode.
        return gen.vector_half_copy if (in_psum == 1 and contiguous) else 1
    if rec.instr == "tensor_tensor" and half and all(s.buffer == "sbuf" for s in rec.srcs):
        return gen.vector_fast_tt
    return 1


def elementwise_cycles(rec, gen):
    """Cycles of a VectorE, ScalarE or GpSimdE record (see the module docstring)."""
    n, inputs = _elems_and_inputs(rec)
    if rec.engine == "ScalarE":
        ops = _full_operands(rec, n)
        fast = rec.instr in ("tensor_copy", "tensor_scalar") and all(o.dtype in _HALF for o in ops)
        work = n / (gen.scalar_fast_copy if fast else 1)
    elif rec.engine == "VectorE":
        factor = gen.vector_reciprocal_factor if rec.instr == "reciprocal" else 1
        work = n * inputs * factor / vector_speedup(rec, gen, n)
    else:  # GpSimdE: no published rule; one element per partition per cycle like un-accelerated VectorE
        work = n * inputs
    return gen.engine_overhead_cycles + work


_CLOCK = {"VectorE": "vector_ghz", "ScalarE": "scalar_ghz", "GpSimdE": "gpsimd_ghz"}


# ----------------------------------------------------------------------------------------------------- DMA
def dma_pieces(rec, gen):
    """``[(queue, bytes)]`` of one DMA record: how the transfer is spread over the core's queues."""
    total = rec.bytes_moved
    onchip = [o for o in ([rec.dst] if rec.dst is not None else []) + rec.srcs if o.buffer != "hbm"]
    if not onchip:
        # HBM -> HBM has no partitions to follow; spread it over every queue.
        q = gen.dma_queues
        return [(i, total / q) for i in range(q)]
    side = onchip[0]  # dst first: SBUF -> SBUF follows the destination partitions
    p0, parts = side.pstart, side.partitions
    per_partition = total / parts
    ppq = gen.dma_partitions_per_queue
    pieces = []
    for g in range(p0 // ppq, (p0 + parts - 1) // ppq + 1):
        lo, hi = max(p0, g * ppq), min(p0 + parts, (g + 1) * ppq)
        pieces.append((g % gen.dma_queues, (hi - lo) * per_partition))
    return pieces


def dma_cost(rec, gen):
    """InstrCost of a DMA record: per-queue pieces of ``dma_fixed_ns + bytes / bandwidth``."""
    bw = gen.dma_queue_bytes_per_ns
    if rec.instr == "dma_transpose":
        from_hbm = any(s.buffer == "hbm" for s in rec.srcs)
        bw *= gen.dma_transpose_hbm_eff if from_hbm else gen.dma_transpose_sbuf_eff
    queues = tuple((q, gen.dma_fixed_ns + b / bw) for q, b in dma_pieces(rec, gen))
    return InstrCost("DMA", max(ns for _, ns in queues), None, queues)


# ----------------------------------------------------------------------------------------------------- dispatch
def instruction_cost(rec, gen):
    """Modeled ``InstrCost`` of one trace ``Record`` on generation ``gen``. Records on an engine the model does
    not know cost 0 (``Profile.unmodelled`` counts them)."""
    if rec.instr in DMA_INSTRUCTIONS or rec.engine == "DMA":
        return dma_cost(rec, gen)
    if rec.engine == "TensorE":
        c = tensor_cycles(rec, gen)
        return InstrCost("TensorE", c / gen.tensor_ghz, c)
    if rec.engine in _CLOCK:
        c = elementwise_cycles(rec, gen)
        return InstrCost(rec.engine, c / getattr(gen, _CLOCK[rec.engine]), c)
    return InstrCost(rec.engine, 0.0, 0.0)


# ----------------------------------------------------------------------------------------------------- profile
class Profile:
    """Modeled time of a list of trace records on one generation.

    Attributes: ``gen``; ``cores`` (program ids that ran instructions); ``n_cores`` (cores the launch occupied:
    ``n_cores`` argument, at least ``len(cores)``; utilisations divide by it); ``busy[core][engine]`` ns (DMA: busiest queue);
    ``queue_busy[core]`` list of per-queue ns; ``counts[engine]`` instructions over all cores;
    ``by_instr[(engine, instr)] = [count, ns]`` (ns summed over cores; DMA: sum of each transfer's longest piece);
    ``matmul_flops`` (useful TensorE FLOPs); ``transposes`` (TensorE transposes); ``hbm_bytes``; ``useful_flops``
    (the caller's convention, e.g. attention FLOPs; defaults to ``matmul_flops``); ``unmodelled`` records.
    """

    def __init__(self, records, gen, useful_flops=None, n_cores=None):
        self.gen = gen
        self.busy = defaultdict(lambda: dict.fromkeys(ENGINES, 0.0))
        self.queue_busy = defaultdict(lambda: [0.0] * gen.dma_queues)
        self.counts = dict.fromkeys(ENGINES, 0)
        self.by_instr = defaultdict(lambda: [0, 0.0])
        self.matmul_flops = 0
        self.transposes = 0
        self.hbm_bytes = 0
        self.unmodelled = 0
        for rec in records:
            cost = instruction_cost(rec, gen)
            core = rec.core
            if cost.engine == "DMA":
                qb = self.queue_busy[core]
                for q, ns in cost.queues:
                    qb[q] += ns
            elif cost.engine in ENGINES:
                self.busy[core][cost.engine] += cost.ns
            else:
                self.unmodelled += 1
                continue
            self.counts[cost.engine] += 1
            entry = self.by_instr[(cost.engine, rec.instr)]
            entry[0] += 1
            entry[1] += cost.ns
            self.matmul_flops += rec.flops
            self.transposes += rec.engine == "TensorE" and rec.is_transpose
            self.hbm_bytes += rec.hbm_bytes
        for core, qb in self.queue_busy.items():
            self.busy[core]["DMA"] = max(qb)
        self.cores = sorted(self.busy)
        self.n_cores = max(n_cores or 1, len(self.cores))
        self.useful_flops = self.matmul_flops if useful_flops is None else useful_flops

    # ------------------------------------------------------------------ times
    def engine_busy(self, engine):
        """Busy ns of ``engine`` on the busiest core (the critical one)."""
        return max((self.busy[c][engine] for c in self.cores), default=0.0)

    @property
    def time_overlap_ns(self):
        """Modeled time with perfect overlap: the busiest engine of the slowest core."""
        return max((max(self.busy[c].values()) for c in self.cores), default=0.0)

    @property
    def time_serial_ns(self):
        """Modeled time with no overlap: the sum of all engines' busy time, slowest core."""
        return max((sum(self.busy[c].values()) for c in self.cores), default=0.0)

    @property
    def bottleneck(self):
        """Engine that sets ``time_overlap_ns``."""
        if not self.cores:
            return None
        core = max(self.cores, key=lambda c: max(self.busy[c].values()))
        return max(self.busy[core], key=self.busy[core].get)

    # ------------------------------------------------------------------ rates
    def _per_ns(self, amount, t):
        return amount / t if t > 0 else 0.0

    def tflops(self, overlap=True):
        """Useful TFLOPS (``useful_flops`` over modeled time; FLOP/ns / 1000 = TFLOP/s)."""
        t = self.time_overlap_ns if overlap else self.time_serial_ns
        return self._per_ns(self.useful_flops, t) / 1000.0

    def tensor_utilisation(self, overlap=True):
        """Useful matmul FLOPs over (modeled time x TensorE peak x cores): fraction of peak in [0, 1]."""
        t = self.time_overlap_ns if overlap else self.time_serial_ns
        return self._per_ns(self.matmul_flops, t * self.gen.peak_flops_per_ns * self.n_cores)

    def tensor_efficiency(self):
        """Useful matmul FLOPs over TensorE busy time x peak: how well the time TensorE does spend is used
        (transposes, narrow N, K < 128, fp32 all lower it). ``tensor_utilisation = this x TensorE active share``."""
        busy = sum(self.busy[c]["TensorE"] for c in self.cores)
        return self._per_ns(self.matmul_flops, busy * self.gen.peak_flops_per_ns)

    def hbm_utilisation(self, overlap=True):
        """HBM bytes over (modeled time x per-core HBM bandwidth x cores)."""
        t = self.time_overlap_ns if overlap else self.time_serial_ns
        return self._per_ns(self.hbm_bytes, t * self.gen.hbm_bytes_per_ns * self.n_cores)

    # ------------------------------------------------------------------ export
    def engine_rows(self):
        """``[(engine, instructions, busy_ns, share_of_serial, active_share_of_overlap)]`` in ENGINES order."""
        serial, overlap = self.time_serial_ns, self.time_overlap_ns
        rows = []
        for e in ENGINES:
            b = self.engine_busy(e)
            rows.append((e, self.counts[e], b, b / serial if serial else 0.0, b / overlap if overlap else 0.0))
        return rows

    def to_dict(self):
        """JSON-ready summary (times in ns, FLOPs, bytes; utilisations as fractions)."""
        return {
            "target": self.gen.name,
            "modeled": True,
            "cores": self.n_cores,
            "active_cores": self.cores,
            "engines": {e: {"instructions": n, "busy_ns": b, "share_of_serial": s, "active_share": a}
                        for e, n, b, s, a in self.engine_rows()},
            "busy_ns_by_core": {str(c): dict(self.busy[c]) for c in self.cores},
            "dma_queue_busy_ns_by_core": {str(c): list(self.queue_busy[c]) for c in self.cores},
            "by_instruction": [{"engine": e, "instr": i, "count": n, "ns": ns}
                               for (e, i), (n, ns) in sorted(self.by_instr.items())],
            "time_overlap_ns": self.time_overlap_ns,
            "time_serial_ns": self.time_serial_ns,
            "bottleneck": self.bottleneck,
            "matmul_flops": self.matmul_flops,
            "useful_flops": self.useful_flops,
            "tensor_transposes": self.transposes,
            "tflops_overlap": self.tflops(True),
            "tflops_serial": self.tflops(False),
            "tensor_utilisation_overlap": self.tensor_utilisation(True),
            "tensor_utilisation_serial": self.tensor_utilisation(False),
            "tensor_efficiency": self.tensor_efficiency(),
            "hbm_bytes": self.hbm_bytes,
            "hbm_utilisation_overlap": self.hbm_utilisation(True),
            "peak_tflops_per_core": self.gen.peak_tflops,
            "unmodelled_instructions": self.unmodelled,
        }


def profile(records, gen, useful_flops=None, n_cores=None):
    """``Profile`` of ``records`` (from ``nki_attn.sim.trace.recording()``) on generation ``gen``; ``n_cores``: the
    launch's LNC degree when some core may have run nothing."""
    return Profile(records, gen, useful_flops, n_cores)
