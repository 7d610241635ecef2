"""Instruction trace of simulated launches.

Off by default and free when off: every instruction checks one attribute (``launch.tracer``) and returns. Turn
it on around any code that launches kernels::

    with nki_attn.sim.trace.recording() as rec:
        attention_bwd(q, k, v, o, dy, lse)
    rec.count("nc_matmul"), rec.counts_by_engine(), rec.matmul_flops(), rec.hbm_bytes()

Each ``Record`` holds the instruction name, the engine that executes it (one of ``ENGINES``: ``TensorE``,
``VectorE``, ``ScalarE``, ``GpSimdE``, ``DMA``), the program id (core), the operands' shapes, dtypes, buffers and
partition placement, and instruction-specific facts (matmul ``m``/``n``/``k``, ``transpose``). From those it
derives the bytes each instruction reads, writes and moves through HBM, and its useful FLOPs. Timing is not
recorded here: the cost model (``nki_attn.profiler``) turns records into modeled engine time per generation.
"""
import contextlib
import os
import sys
import threading
from collections import Counter

from . import context

# Display names of the engines, keyed by the simulator's ``nisa.engine`` member names. A DMA instruction always
# runs on the DMA engines (the ``engine=`` argument of dma_copy only names the engine that triggers it), so DMA
# instructions are mapped by instruction name, not through this table.
ENGINE_NAMES = {"tensor": "TensorE", "vector": "VectorE", "scalar": "ScalarE", "gpsimd": "GpSimdE",
                "dma": "DMA"}
ENGINES = ("TensorE", "VectorE", "ScalarE", "GpSimdE", "DMA")
DMA_INSTRUCTIONS = frozenset({"dma_copy", "dma_transpose", "dma_compute"})


def _span(t):
    """``(p_lo, p_hi, lo, hi)`` bounding the bytes view ``t`` can touch (see ``Operand``)."""
    size = t.dtype.itemsize
    start = t.offset * size
    row = t.storage.free_size * t.storage.dtype.itemsize if t.on_chip else None
    dims = list(zip(t.shape, t.strides))
    if row and dims and dims[0][1] * size == row:
        p_lo = start // row
        p_hi, lo, dims = p_lo + dims[0][0], start % row, dims[1:]
    else:  # HBM, or an on-chip view whose first dim is not the partition dim: one flat range
        p_lo, p_hi, lo = 0, 1, start
    hi = lo
    for n, st in dims:
        if n > 0:
            lo, hi = lo + min(0, (n - 1) * st * size), hi + max(0, (n - 1) * st * size)
    return p_lo, p_hi, lo, hi + size


class Operand:
    """Shape, dtype, buffer and placement of one instruction operand, captured when the instruction ran.

    ``shape`` is the operand's view shape (dim 0 = partitions on chip); ``pstart`` the first partition it touches
    (on chip; 0 in HBM); ``unit_stride`` whether its innermost dimension is contiguous (VectorE perf modes need
    it); ``itemsize`` the element size in bytes; ``uid`` the allocation it views and ``span`` =
    ``(p_lo, p_hi, lo, hi)``: the partitions ``[p_lo, p_hi)`` and, within each, the byte range ``[lo, hi)`` it can
    touch (in HBM one flat byte range, partitions ``[0, 1)``). The cost model finds read-after-write dependencies
    with them.
    """

    __slots__ = ("shape", "dtype", "buffer", "name", "itemsize", "pstart", "unit_stride", "uid", "span")

    def __init__(self, t):
        self.shape = t.shape
        self.dtype = str(t.dtype)
        self.buffer = t.buffer.kind
        self.name = t.name
        self.itemsize = t.dtype.itemsize
        self.pstart = t.partition_start if self.buffer != "hbm" else 0
        # A size-1 innermost dim has no stride to speak of: treat it as contiguous.
        self.unit_stride = len(t.shape) < 2 or t.shape[-1] == 1 or t.strides[-1] == 1
        self.uid = t.storage.uid
        self.span = _span(t)

    @property
    def partitions(self):
        """Partition count of an on-chip operand (``shape[0]``); None in HBM, which has no partitions."""
        return self.shape[0] if self.buffer != "hbm" else None

    @property
    def free_elems(self):
        """Elements per partition of an on-chip operand (product of the free dims; 1 for a 1-D view)."""
        n = 1
        for s in self.shape[1:]:
            n *= s
        return n

    @property
    def elems(self):
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def bytes(self):
        return int(self.elems * self.itemsize)

    def __repr__(self):
        return f"{self.name}{list(self.shape)}:{self.dtype}@{self.buffer}"


class Record:
    """One executed instruction.

    ``instr`` name, ``engine`` (one of ``ENGINES``), ``core`` (program id), ``dst`` (Operand or None), ``srcs``
    (list of tensor Operands; numbers are not recorded), ``info`` (dict of instruction facts or None). DMA records
    carry the trigger engine the kernel asked for (``sync``, ``scalar``, ...) as ``info["trigger"]`` when it
    was not the default. ``line``: ``"file.py:N"``, the first caller outside the simulator (the kernel source
    line that issued it), for timelines.
    """

    __slots__ = ("instr", "engine", "core", "dst", "srcs", "info", "line")

    def __init__(self, instr, engine, core, dst, srcs, info, line=None):
        self.instr = instr
        self.engine = engine
        self.core = core
        self.dst = dst
        self.srcs = srcs
        self.info = info
        self.line = line

    @property
    def is_transpose(self):
        """True for transposes executed on TensorE/VectorE (nc_transpose, nc_matmul(is_transpose=True))."""
        return bool(self.info and self.info.get("transpose"))

    @property
    def bytes_read(self):
        """Bytes of all tensor inputs (per-partition scalars included)."""
        return sum(s.bytes for s in self.srcs)

    @property
    def bytes_written(self):
        return self.dst.bytes if self.dst is not None else 0

    @property
    def bytes_moved(self):
        """For a DMA the transfer size (the larger side: a casting DMA reads one width and writes another);
        for a compute instruction the bytes it reads plus the bytes it writes."""
        if self.instr in DMA_INSTRUCTIONS:
            return max([self.bytes_written] + [s.bytes for s in self.srcs])
        return self.bytes_read + self.bytes_written

    @property
    def hbm_bytes(self):
        """Bytes this instruction moves to or from HBM: the HBM-side operands of a DMA (both sides for an
        HBM -> HBM copy), 0 for anything else (compute engines never touch HBM)."""
        if self.instr not in DMA_INSTRUCTIONS:
            return 0
        ops = ([self.dst] if self.dst is not None else []) + list(self.srcs)
        return sum(o.bytes for o in ops if o.buffer == "hbm")

    @property
    def flops(self):
        """Useful floating-point operations: ``2*M*N*K`` for a TensorE matmul (multiply + add per MAC), 0 for
        transposes (pure data movement, even on TensorE) and for every other instruction. Only matmul FLOPs are
        counted because they are what the attention FLOP conventions count and what TensorE peak refers to."""
        if self.engine != "TensorE" or self.is_transpose or not self.info:
            return 0
        return 2 * self.info["m"] * self.info["n"] * self.info["k"]

    def __repr__(self):
        return f"{self.instr}[{self.engine}] core{self.core} {self.dst} <- {self.srcs} {self.info or ''}"


class Recorder:
    """Collects the records of every launch made while it is active (all cores, in execution order)."""

    def __init__(self):
        self.records = []
        self.launches = 0
        self._lock = threading.Lock()

    def record(self, instr, engine, dst, srcs, info):
        """Called by ``nisa._trace`` for each executed instruction (``engine``: a ``nisa.engine`` member)."""
        raw = engine.name if hasattr(engine, "name") else str(engine)
        info = dict(info) if info else None
        if instr in DMA_INSTRUCTIONS:
            if raw not in ("dma", "unknown"):
                info = dict(info or {}, trigger=raw)
            name = "DMA"
        else:
            name = ENGINE_NAMES.get(raw, raw)
        rec = Record(instr, name, context.current().program_id, Operand(dst) if dst is not None else None,
                     [Operand(s) for s in srcs], info, _caller_line())
        with self._lock:
            self.records.append(rec)

    def on_alloc(self, storage):
        pass

    def count(self, instr=None, core=None):
        """Number of records, optionally of one instruction name and/or one core."""
        return sum(1 for r in self.records
                   if (instr is None or r.instr == instr) and (core is None or r.core == core))

    def counts_by_instruction(self):
        return Counter(r.instr for r in self.records)

    def counts_by_engine(self):
        """Counter of records per engine display name (``TensorE``, ``VectorE``, ``ScalarE``, ``GpSimdE``,
        ``DMA``)."""
        return Counter(r.engine for r in self.records)

    def cores(self):
        """Sorted program ids that executed at least one instruction."""
        return sorted({r.core for r in self.records})

    def matmul_flops(self):
        """Sum of ``Record.flops`` (useful TensorE matmul FLOPs) over all records."""
        return sum(r.flops for r in self.records)

    def hbm_bytes(self):
        """Bytes moved to or from HBM by all DMAs."""
        return sum(r.hbm_bytes for r in self.records)


_SIM_DIR = os.path.dirname(os.path.abspath(__file__))


def _caller_line():
    """``"file.py:N"`` of the innermost frame outside the simulator package (the issuing kernel line)."""
    f = sys._getframe(2)
    while f is not None and os.path.dirname(f.f_code.co_filename) == _SIM_DIR:
        f = f.f_back
    return f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno}" if f is not None else None


active_recorder = context.active_recorder  # the innermost active Recorder, or None (read by every new launch)


@contextlib.contextmanager
def recording():
    """Record every instruction of every launch started inside the ``with`` block."""
    rec = Recorder()
    context._recorders.append(rec)
    try:
        yield rec
    finally:
        context._recorders.remove(rec)
