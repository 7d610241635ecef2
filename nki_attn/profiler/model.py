"""Cost model: modeled engine time of recorded instructions on one Trainium generation.

Every number comes from the ``Generation`` table (params.py). The rules, per engine (docs/performance.md explains
them with their sources):

- **TensorE** (``nc_matmul``, TensorE ``nc_transpose``): ``max(N, mm_min_cycles, ceil(M / load_stationary_speedup))``
  cycles, ``N`` = moving free size (dst columns), ``M`` = stationary free size (dst rows); times
  ``fp32_matmul_factor`` for fp32 operands (``fp32_transpose_factor`` for fp32 transposes). K does not change the
  time: a matmul with K < 128 wastes rows. A transpose costs like the matmul it is (identity moving).
- **VectorE / ScalarE / GpSimdE**: ``max(min_ii_cycles, work)`` cycles, plus ``static_overhead_cycles`` when the
  instruction reads what the same engine's previous instruction wrote (``static_overhead_applies="dependent"``).
  ``work``, with ``N`` = elements per partition of the largest operand and ``inputs`` = full-size tensor inputs
  (per-partition ``(P, 1)`` operands are free):

  - VectorE: ``N * inputs / speedup``; ``speedup`` = the bf16/fp16 perf mode (``vector_fast_copy`` /
    ``vector_half_copy`` / ``vector_fast_tt``) or, when larger, the width outside it
    (``vector_width_other / 128`` lanes). ``reciprocal``: ``N * vector_reciprocal_factor``.
  - ScalarE: ``N / speedup`` (one input; scale, bias, reduce are free), ``speedup`` = ``scalar_fast_copy`` for
    16-bit ``tensor_copy``/``tensor_scalar``.
  - GpSimdE: ``N * inputs`` (no published rule).

  Partitions used do not matter.
- **DMA**: a transfer is split over the queues that serve its SBUF partitions (partition ``p`` -> queue
  ``p // dma_partitions_per_queue``; HBM -> HBM transfers over all queues evenly); each piece occupies its queue
  ``max(dma_min_piece_ns, bytes / dma_queue_bytes_per_ns) + dma_fixed_ns``; a ``dma_transpose`` piece costs that
  divided by the transpose efficiency, and a direct transpose is split into hardware-DGE instructions
  (``transpose_instructions``). The DMA engine's busy time is its busiest queue's. The ~1300 ns
  semaphore-to-start latency (``dma_latency_ns``) is not occupancy: the schedule (schedule.py) delays each
  transfer by it.
- **Shared resources** (engines that cannot work at once): the SBUF port VectorE shares with GpSimdE
  (``vector_gpsimd_port``: every VectorE instruction on v2, the perf-mode ones on v3+, plus all GpSimdE
  instructions), the PSUM port of v2 (VectorE and ScalarE instructions touching PSUM,
  ``vector_scalar_psum_shared``), and the hardware DGE (``dge_instr_ns`` per ``dge_mode=hwdge`` DMA, spread over
  ``dge_instances``). Each is busy for the sum of the time of the instructions that need it.

A profile sums instruction times per engine and core and schedules the trace (schedule.py): ``time_ns``, the
headline, is the dependency-aware schedule's; ``time_overlap_ns`` (the busiest engine or shared resource, a lower
bound) and ``time_serial_ns`` (the sum over engines; latencies and waits are not in it) are kept.
"""
import math
from collections import defaultdict
from dataclasses import dataclass

from ..sim.trace import DMA_INSTRUCTIONS, ENGINES
from .params import MODEL

_HALF = frozenset({"bfloat16", "float16"})
# A2: VectorE and ScalarE have 128 parallel lanes, one per partition.
LANES = 128

SBUF_PORT = "VectorE/GpSimdE SBUF port"
PSUM_PORT = "VectorE/ScalarE PSUM port"
DGE = "DGE"
RESOURCES = (SBUF_PORT, PSUM_PORT, DGE)


@dataclass
class InstrCost:
    """Modeled cost of one record: ``engine`` it occupies, ``ns`` of that engine's time (for a DMA, its longest
    queue piece), ``cycles`` on that engine's clock (None for DMAs), ``queues``: ``(queue, ns)`` pieces of a DMA
    (empty otherwise), ``shared``: ``(resource, ns)`` it also holds (see ``RESOURCES``), ``dependent``: it paid the
    static overhead for reading its engine's previous output, ``unmodelled_issue``: a software-DGE DMA whose
    descriptor generation on GpSimdE has no published cost. For the schedule: ``latency_ns`` after the
    instruction ends before its result is visible (access overhead; not occupancy), ``dge``: hardware-DGE
    instructions it issues (each ``dge_instr_ns`` on one DGE block, before its queue pieces start)."""

    engine: str
    ns: float
    cycles: float = None
    queues: tuple = ()
    shared: tuple = ()
    dependent: bool = False
    unmodelled_issue: bool = False
    latency_ns: float = 0.0
    dge: int = 0
    # ``queues`` holds the pieces of each of the ``dge`` instructions in turn (equal counts), for the schedule.


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


def perf_mode(rec, gen, n):
    """Speedup of a VectorE record from the bf16/fp16 perf mode exactly as A3 states it (1: no perf mode)."""
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


def vector_speedup(rec, gen, n):
    """Elements per partition per cycle of each input stream of a VectorE record: the perf mode, or the width the
    data path has outside it (A3/A4: 256 elements per cycle for other data types, i.e. 2 per lane), whichever is
    larger."""
    return max(perf_mode(rec, gen, n), gen.vector_width_other / LANES)


def depends_on(rec, prev):
    """True when ``rec`` reads bytes that ``prev`` wrote (same allocation, overlapping byte ranges)."""
    if prev is None or prev.dst is None:
        return False
    d = prev.dst.span
    return any(s.uid == prev.dst.uid and s.span[0] < d[1] and d[0] < s.span[1] and s.span[2] < d[3]
               and d[2] < s.span[3] for s in rec.srcs)


def elementwise_cycles(rec, gen, dependent=False):
    """Cycles of a VectorE, ScalarE or GpSimdE record (see the module docstring); ``dependent``: it reads what
    the same engine's previous instruction wrote."""
    n, inputs = _elems_and_inputs(rec)
    if rec.engine == "ScalarE":
        ops = _full_operands(rec, n)
        fast = rec.instr in ("tensor_copy", "tensor_scalar") and all(o.dtype in _HALF for o in ops)
        work = n / (gen.scalar_fast_copy if fast else 1)
    elif rec.engine == "VectorE":
        if rec.instr == "reciprocal":
            work = n * gen.vector_reciprocal_factor  # SH: max(MIN_II, 8N), stated without a width speedup
        else:
            work = n * inputs / vector_speedup(rec, gen, n)
    elif gen.gpsimd_vector_factor:  # sensitivity: GpSimdE as a multiple of VectorE, on VectorE's clock
        work = n * inputs / vector_speedup(rec, gen, n) * gen.gpsimd_vector_factor * gen.gpsimd_ghz / gen.vector_ghz
    else:  # GpSimdE: no published rule; one element per partition per cycle like v2's VectorE
        work = n * inputs
    cycles = max(gen.min_ii_cycles, work)
    if gen.static_overhead_applies == "all" or (gen.static_overhead_applies == "dependent" and dependent):
        cycles += gen.static_overhead_cycles
    return cycles


_CLOCK = {"VectorE": "vector_ghz", "ScalarE": "scalar_ghz", "GpSimdE": "gpsimd_ghz"}


def _shared_ports(rec, gen, ns, n):
    """``(resource, ns)`` pairs a compute record holds besides its engine."""
    out = []
    buffers = {o.buffer for o in ([rec.dst] if rec.dst is not None else []) + rec.srcs}
    if rec.engine == "GpSimdE" and gen.vector_gpsimd_port != "none" and "sbuf" in buffers:
        out.append((SBUF_PORT, ns))
    elif rec.engine == "VectorE":
        if (gen.vector_gpsimd_port == "all" and "sbuf" in buffers) or \
                (gen.vector_gpsimd_port == "perf_mode" and rec.instr != "reciprocal" and perf_mode(rec, gen, n) > 1):
            out.append((SBUF_PORT, ns))
    if gen.vector_scalar_psum_shared and rec.engine in ("VectorE", "ScalarE") and "psum" in buffers:
        out.append((PSUM_PORT, ns))
    return tuple(out)


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


def dma_piece_ns(nbytes, gen, bw):
    """Queue occupancy of one piece of ``nbytes`` at ``bw`` bytes/ns (see the module docstring)."""
    return max(gen.dma_min_piece_ns, nbytes / bw) + gen.dma_fixed_ns


HWDGE_TRANSPOSE_PARTITIONS = (1, 2, 4, 8, 16)


def transpose_instructions(rec, gen):
    """Hardware-DGE instructions one ``dma_transpose`` record lowers to: 1, or with ``gen.dge_transpose_split``
    ``ceil(P / 16)`` when the source partition count ``P`` is not one the hardware DGE takes (ISA
    ``dma_transpose``: 2-D needs ``P == 16``, 3-D/4-D ``P`` in {1, 2, 4, 8, 16})."""
    if not gen.dge_transpose_split or not rec.srcs:
        return 1
    p = rec.srcs[0].shape[0]
    ok = p == 16 if len(rec.srcs[0].shape) == 2 else p in HWDGE_TRANSPOSE_PARTITIONS
    return 1 if ok else math.ceil(p / 16)


def dma_cost(rec, gen):
    """InstrCost of a DMA record: per-queue pieces, and the DGE instructions it issues.

    ``dma_transpose`` runs at ``dma_transpose_*_eff`` of a copy's throughput for the whole piece: each piece costs
    the same-size copy's occupancy (floor included) divided by the efficiency (A3: "up to 50% of DMA throughput"
    SBUF -> SBUF, 90% from HBM), so it never costs what a copy costs. Direct transposes only take the hardware-DGE
    path (ISA ``dma_transpose``), split as ``transpose_instructions`` says; each instruction pays its own pieces."""
    bw = gen.dma_queue_bytes_per_ns
    dge = (rec.info or {}).get("dge")
    if rec.instr == "dma_transpose":
        from_hbm = any(s.buffer == "hbm" for s in rec.srcs)
        eff = gen.dma_transpose_hbm_eff if from_hbm else gen.dma_transpose_sbuf_eff
        n_instr = transpose_instructions(rec, gen)
        if gen.dma_transpose_whole_piece:
            queues = tuple((q, dma_piece_ns(b / n_instr, gen, bw) / eff) for _ in range(n_instr)
                           for q, b in dma_pieces(rec, gen))
        else:  # the earlier rule: only the bandwidth scaled, so small transposes cost what the copy costs
            queues = tuple((q, dma_piece_ns(b / n_instr, gen, bw * eff)) for _ in range(n_instr)
                           for q, b in dma_pieces(rec, gen))
        # Direct transposes only take the hardware-DGE path (ISA); the earlier model (no split) did not charge it
        # unless the kernel forced dge_mode=hwdge.
        n_dge = n_instr if (gen.dge_charge_transposes or dge == "hwdge") else 0
        dge = "hwdge" if n_dge else dge
    else:
        queues = tuple((q, dma_piece_ns(b, gen, bw)) for q, b in dma_pieces(rec, gen))
        n_dge = 1 if dge == "hwdge" else 0
    n_dge = n_dge if gen.dge_instr_ns else 0
    # Static descriptors (dge_mode none, and what the compiler picks for the trace-time addresses of both
    # kernels' copies) cost nothing on the device (DGE reference). A hardware-DGE instruction holds a DGE block;
    # its trigger engine (ScalarE or SyncE) only issues it and can keep computing (A3).
    shared = ((DGE, gen.dge_instr_ns * n_dge),) if n_dge else ()
    per_queue = defaultdict(float)
    for q, ns in queues:
        per_queue[q] += ns
    return InstrCost("DMA", max(per_queue.values()), None, queues, shared,
                     unmodelled_issue=dge == "swdge", dge=n_dge)


# ----------------------------------------------------------------------------------------------------- dispatch
def instruction_cost(rec, gen, prev=None):
    """Modeled ``InstrCost`` of one trace ``Record`` on generation ``gen``; ``prev``: the previous record on the
    same engine and core (for the dependent-instruction overhead). Records on an engine the model does not know
    cost 0 (``Profile.unmodelled`` counts them)."""
    if rec.instr in DMA_INSTRUCTIONS or rec.engine == "DMA":
        return dma_cost(rec, gen)
    if rec.engine == "TensorE":
        c = tensor_cycles(rec, gen)
        return InstrCost("TensorE", c / gen.tensor_ghz, c, latency_ns=gen.access_overhead_cycles / gen.tensor_ghz)
    if rec.engine in _CLOCK:
        dep = depends_on(rec, prev)
        c = elementwise_cycles(rec, gen, dep)
        ns = c / getattr(gen, _CLOCK[rec.engine])
        n, _ = _elems_and_inputs(rec)
        return InstrCost(rec.engine, ns, c, shared=_shared_ports(rec, gen, ns, n),
                         dependent=dep and gen.static_overhead_applies == "dependent",
                         latency_ns=gen.access_overhead_cycles / getattr(gen, _CLOCK[rec.engine]))
    return InstrCost(rec.engine, 0.0, 0.0)


# ----------------------------------------------------------------------------------------------------- profile
class Profile:
    """Modeled time of a list of trace records on one generation.

    Attributes: ``gen``; ``cores`` (program ids that ran instructions); ``n_cores`` (cores the launch occupied:
    ``n_cores`` argument, at least ``len(cores)``; utilisations divide by it); ``busy[core][engine]`` ns (DMA:
    busiest queue); ``shared[core][resource]`` ns of the ``RESOURCES`` (DGE: per block); ``queue_busy[core]``
    list of per-queue ns; ``counts[engine]`` instructions over all cores; ``by_instr[(engine, instr)] = [count,
    ns]`` (ns summed over cores; DMA: sum of each transfer's longest piece); ``matmul_flops`` (executed TensorE
    FLOPs, masked parts included); ``transposes`` (TensorE transposes); ``hbm_bytes``; ``useful_flops`` (the
    caller's convention, e.g. attention FLOPs of the visible pairs; defaults to ``matmul_flops``);
    ``dma_transfers``; ``dependent`` (instructions that paid the dependent-instruction overhead);
    ``unmodelled`` records; ``unmodelled_issue`` (software-DGE DMAs).
    """

    def __init__(self, records, gen, useful_flops=None, n_cores=None):
        self.gen = gen
        self.busy = defaultdict(lambda: dict.fromkeys(ENGINES, 0.0))
        self.shared = defaultdict(lambda: dict.fromkeys(RESOURCES, 0.0))
        self.queue_busy = defaultdict(lambda: [0.0] * gen.dma_queues)
        self.counts = dict.fromkeys(ENGINES, 0)
        self.by_instr = defaultdict(lambda: [0, 0.0])
        self.matmul_flops = 0
        self.transposes = 0
        self.hbm_bytes = 0
        self.unmodelled = 0
        self.unmodelled_issue = 0
        self.dma_transfers = 0
        self.dependent = 0
        last = {}
        self._records = records = list(records)
        self._costs = costs = []
        self._schedule = None
        for rec in records:
            core = rec.core
            cost = instruction_cost(rec, gen, last.get((core, rec.engine)))
            last[(core, rec.engine)] = rec
            costs.append(cost if cost.engine in ENGINES else None)
            if cost.engine == "DMA":
                qb = self.queue_busy[core]
                for q, ns in cost.queues:
                    qb[q] += ns
                self.dma_transfers += 1
            elif cost.engine in ENGINES:
                self.busy[core][cost.engine] += cost.ns
            else:
                self.unmodelled += 1
                continue
            for res, ns in cost.shared:
                self.shared[core][res] += ns
            self.dependent += cost.dependent
            self.unmodelled_issue += cost.unmodelled_issue
            self.counts[cost.engine] += 1
            entry = self.by_instr[(cost.engine, rec.instr)]
            entry[0] += 1
            entry[1] += cost.ns
            self.matmul_flops += rec.flops
            self.transposes += rec.engine == "TensorE" and rec.is_transpose
            self.hbm_bytes += rec.hbm_bytes
        for core, qb in self.queue_busy.items():
            self.busy[core]["DMA"] = max(qb)
        for core in self.busy:
            self.shared[core][DGE] /= max(gen.dge_instances, 1)
        self.cores = sorted(self.busy)
        self.n_cores = max(n_cores or 1, len(self.cores))
        self.useful_flops = self.matmul_flops if useful_flops is None else useful_flops

    # ------------------------------------------------------------------ times
    @property
    def schedule(self):
        """The dependency-aware ``schedule.Schedule`` of the records (built on first use)."""
        if self._schedule is None:
            from .schedule import Schedule
            self._schedule = Schedule(self._records, self._costs, self.gen)
        return self._schedule

    @property
    def time_ns(self):
        """Modeled time, the headline: the dependency-aware schedule's (``schedule.py``). Never below
        ``time_overlap_ns``: the schedule keeps every engine, queue and shared resource busy at most once at a
        time."""
        return self.schedule.time_ns

    def scheduled_share(self, engine):
        """Busy time of ``engine`` (or shared resource) on the busiest core over the scheduled time."""
        t = self.time_ns
        return self.engine_busy(engine) / t if t else 0.0

    def critical_path_by_kind(self):
        """``{kind: ns}``: the scheduled time split along the critical path by instruction kind (``"VectorE
        tensor_tensor"``...) and waits (semaphore, DMA latency, access overhead)."""
        return self.schedule.critical_path_by_kind()

    def engine_busy(self, engine):
        """Busy ns of ``engine`` (or shared resource) on the busiest core (the critical one)."""
        table = self.shared if engine in RESOURCES else self.busy
        return max((table[c][engine] for c in self.cores), default=0.0)

    def _units(self, core):
        return {**self.busy[core], **self.shared[core]}

    @property
    def time_overlap_ns(self):
        """Modeled time with perfect overlap: the busiest engine or shared resource of the slowest core."""
        return max((max(self._units(c).values()) for c in self.cores), default=0.0)

    @property
    def time_serial_ns(self):
        """Modeled time with no overlap: the sum of all engines' busy time (and the DGE's), slowest core."""
        return max((sum(self.busy[c].values()) + self.shared[c][DGE] for c in self.cores), default=0.0)

    @property
    def bottleneck(self):
        """Engine or shared resource that sets ``time_overlap_ns``."""
        if not self.cores:
            return None
        core = max(self.cores, key=lambda c: max(self._units(c).values()))
        units = self._units(core)
        return max(units, key=units.get)

    @property
    def dma_latency_ns(self):
        """Sum of the transfers' semaphore-to-start latency (``dma_latency_ns`` each): what the DMAs would add if
        none of it were hidden behind other work. Not part of either modeled time."""
        return self.dma_transfers * self.gen.dma_latency_ns

    # ------------------------------------------------------------------ rates
    def _per_ns(self, amount, t):
        return amount / t if t > 0 else 0.0

    def _time(self, overlap):
        """``overlap``: True (perfect overlap), False (no overlap) or ``"scheduled"`` (the headline)."""
        if overlap == "scheduled":
            return self.time_ns
        return self.time_overlap_ns if overlap else self.time_serial_ns

    def tflops(self, overlap=True):
        """Useful TFLOPS (``useful_flops`` over modeled time; FLOP/ns / 1000 = TFLOP/s)."""
        return self._per_ns(self.useful_flops, self._time(overlap)) / 1000.0

    def tensor_utilisation(self, overlap=True):
        """Executed matmul FLOPs (masked parts of computed tiles included) over (modeled time x TensorE peak x
        cores): fraction of peak in [0, 1]."""
        return self._per_ns(self.matmul_flops, self._time(overlap) * self.gen.peak_flops_per_ns * self.n_cores)

    def useful_tensor_utilisation(self, overlap=True):
        """Useful FLOPs (``useful_flops``: for attention the FlashAttention convention over visible pairs) over
        (modeled time x TensorE peak x cores): what FlashAttention papers report as utilisation."""
        return self._per_ns(self.useful_flops, self._time(overlap) * self.gen.peak_flops_per_ns * self.n_cores)

    @property
    def tensor_floor_ns(self):
        """The useful-FLOP bound: ``useful_flops`` at TensorE peak on every core, the time no kernel beats."""
        return self._per_ns(self.useful_flops, self.gen.peak_flops_per_ns * self.n_cores)

    def floor_ratio(self, overlap=True):
        """Modeled time over ``tensor_floor_ns`` (1.0 = at the useful-FLOP bound)."""
        return self._per_ns(self._time(overlap), self.tensor_floor_ns)

    def tensor_efficiency(self):
        """Executed matmul FLOPs over TensorE busy time x peak: how well the time TensorE does spend is used
        (transposes, narrow N, K < 128, fp32 all lower it). ``tensor_utilisation = this x TensorE active share``."""
        busy = sum(self.busy[c]["TensorE"] for c in self.cores)
        return self._per_ns(self.matmul_flops, busy * self.gen.peak_flops_per_ns)

    def hbm_utilisation(self, overlap=True):
        """HBM bytes over (modeled time x per-core HBM bandwidth x cores)."""
        return self._per_ns(self.hbm_bytes, self._time(overlap) * self.gen.hbm_bytes_per_ns * self.n_cores)

    # ------------------------------------------------------------------ export
    def engine_rows(self):
        """``[(engine, instructions, busy_ns, share_of_serial, active_share_of_overlap)]`` in ENGINES order."""
        serial, overlap = self.time_serial_ns, self.time_overlap_ns
        rows = []
        for e in ENGINES:
            b = self.engine_busy(e)
            rows.append((e, self.counts[e], b, b / serial if serial else 0.0, b / overlap if overlap else 0.0))
        return rows

    def resource_rows(self):
        """``[(resource, busy_ns, active_share_of_overlap)]`` of the shared resources some instruction used."""
        overlap = self.time_overlap_ns
        return [(r, self.engine_busy(r), self.engine_busy(r) / overlap if overlap else 0.0)
                for r in RESOURCES if self.engine_busy(r) > 0]

    def to_dict(self):
        """JSON-ready summary (times in ns, FLOPs, bytes; utilisations as fractions)."""
        return {
            "target": self.gen.name,
            "modeled": True,
            "cores": self.n_cores,
            "active_cores": self.cores,
            "engines": {e: {"instructions": n, "busy_ns": b, "share_of_serial": s, "active_share": a}
                        for e, n, b, s, a in self.engine_rows()},
            "shared_resources": {r: {"busy_ns": b, "active_share": a} for r, b, a in self.resource_rows()},
            "busy_ns_by_core": {str(c): dict(self.busy[c]) for c in self.cores},
            "dma_queue_busy_ns_by_core": {str(c): list(self.queue_busy[c]) for c in self.cores},
            "by_instruction": [{"engine": e, "instr": i, "count": n, "ns": ns}
                               for (e, i), (n, ns) in sorted(self.by_instr.items())],
            "model": MODEL,
            "time_ns": self.time_ns,
            "scheduled_share": {e: self.scheduled_share(e) for e in ENGINES + RESOURCES
                                if self.engine_busy(e) > 0},
            "critical_path_ns_by_kind": self.critical_path_by_kind(),
            "tflops_scheduled": self.tflops("scheduled"),
            "useful_tensor_utilisation_scheduled": self.useful_tensor_utilisation("scheduled"),
            "floor_ratio_scheduled": self.floor_ratio("scheduled"),
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
            "useful_tensor_utilisation_overlap": self.useful_tensor_utilisation(True),
            "useful_tensor_utilisation_serial": self.useful_tensor_utilisation(False),
            "tensor_floor_ns": self.tensor_floor_ns,
            "floor_ratio_overlap": self.floor_ratio(True),
            "tensor_efficiency": self.tensor_efficiency(),
            "hbm_bytes": self.hbm_bytes,
            "hbm_utilisation_overlap": self.hbm_utilisation(True),
            "dma_transfers": self.dma_transfers,
            "dma_latency_ns_unhidden": self.dma_latency_ns,
            "dependent_instructions": self.dependent,
            "peak_tflops_per_core": self.gen.peak_tflops,
            "unmodelled_instructions": self.unmodelled,
            "unmodelled_dge_instructions": self.unmodelled_issue,
        }


def profile(records, gen, useful_flops=None, n_cores=None):
    """``Profile`` of ``records`` (from ``nki_attn.sim.trace.recording()``) on generation ``gen``; ``n_cores``: the
    launch's LNC degree when some core may have run nothing."""
    return Profile(records, gen, useful_flops, n_cores)
