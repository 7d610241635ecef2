"""Instruction trace of simulated launches.

Off by default and free when off: every instruction checks one attribute (``launch.tracer``) and returns. Turn
it on around any code that launches kernels::

    with nki_attn.sim.trace.recording() as rec:
        attention_bwd(q, k, v, o, dy, lse)
    rec.count("nc_matmul"), rec.counts_by_instruction()

Each record holds the instruction name, engine, program id, and the operands' shapes, dtypes and buffers, plus
instruction-specific facts (matmul M/N/K). The cost model (issue 9) reads these records.
"""
import contextlib
import threading
from collections import Counter

from . import context


class Operand:
    """Shape, dtype and buffer kind of one instruction operand."""

    __slots__ = ("shape", "dtype", "buffer", "name")

    def __init__(self, t):
        self.shape = t.shape
        self.dtype = str(t.dtype)
        self.buffer = t.buffer.kind
        self.name = t.name

    @property
    def partitions(self):
        return self.shape[0] if self.buffer != "hbm" else None

    @property
    def elems(self):
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def bytes(self):
        from .dtypes import as_dtype
        return self.elems * as_dtype(self.dtype).itemsize

    def __repr__(self):
        return f"{self.name}{list(self.shape)}:{self.dtype}@{self.buffer}"


class Record:
    """One executed instruction."""

    __slots__ = ("instr", "engine", "core", "dst", "srcs", "info")

    def __init__(self, instr, engine, core, dst, srcs, info):
        self.instr = instr
        self.engine = engine
        self.core = core
        self.dst = dst
        self.srcs = srcs
        self.info = info

    def __repr__(self):
        return f"{self.instr}[{self.engine}] core{self.core} {self.dst} <- {self.srcs} {self.info or ''}"


class Recorder:
    """Collects the records of every launch made while it is active (all cores, in execution order)."""

    def __init__(self):
        self.records = []
        self.launches = 0
        self._lock = threading.Lock()

    def record(self, instr, engine, dst, srcs, info):
        rec = Record(instr, engine.name if hasattr(engine, "name") else str(engine),
                     context.current().program_id, Operand(dst) if dst is not None else None,
                     [Operand(s) for s in srcs], dict(info) if info else None)
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
        return Counter(r.engine for r in self.records)


_active = []


def active_recorder():
    """The innermost active Recorder, or None (consulted by every new launch)."""
    return _active[-1] if _active else None


@contextlib.contextmanager
def recording():
    """Record every instruction of every launch started inside the ``with`` block."""
    rec = Recorder()
    _active.append(rec)
    try:
        yield rec
    finally:
        _active.remove(rec)
