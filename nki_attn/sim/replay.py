"""Trace once, replay: a kernel's instruction stream recorded at its first launch and replayed on new data.

The NKI compiler traces a kernel once per signature and caches the result (language guide, "Kernel Caching"). The
simulator does the same: the first launch of a kernel with a given signature (kernel function, LNC degree, target,
precision and checking modes, argument shapes and dtypes, every scalar argument's value) runs the Python kernel
body and records, in order, every storage it allocates and every ``nki.isa`` instruction it executes with its
operands. A later launch with the same signature does not run the kernel body: it copies the new argument data
into the recorded storages and executes the recorded instructions again. The instructions are the same functions
as in a traced launch, so every check that depends on data (uninitialised reads in strict mode, PSUM accumulation
history, NaN sentinels of fresh storage) runs in the replay too; each recorded allocation that an instruction could
read before writing refills its storage with the sentinel at its place in the stream, as a fresh allocation would
(the others are never read unwritten, so their refill is skipped). Instructions run as compiled steps
(nki_attn.sim.fast) where they have a compiled form. What depends only on the signature (the
frontend's gathering, the tracing rules, capacity) was checked by the traced launch; the frontend's launch checks
(argument values, module globals) still run at every call.

Not recorded, so always traced: LNC2 launches (two cores interleave), launches inside ``trace.recording()`` (the
cost model wants every instruction), launches with the frontend check off (``NKI_ATTN_SIM_FRONTEND=0``: without
its launch stage nothing tells a changed module global, e.g. a patched kernel constant), and launches whose trace read tensor data into Python (a data-dependent
``scalar_offset``), wrote memory outside an instruction (the ``nl``-level helpers that fill tiles directly,
``nl.rand``), got a value back from an instruction, or whose program would hold more than ``NKI_ATTN_SIM_REPLAY_MB``
(default 256) MiB (a program keeps its storages between calls; storages whose live ranges in the stream do not
overlap share memory, so that is about the kernel's peak live memory). ``NKI_ATTN_SIM_REPLAY=0`` turns replay off.
"""
import collections
import enum
import functools
import os
import sys
import threading
import types

import numpy as np

from . import context
from . import fast as _fast
from . import isa as _isa
from . import ops as _ops
from .tensor import INT_SENTINEL, NkiTensor, Storage

_MAX_PROGRAMS = 64


def enabled():
    """Env ``NKI_ATTN_SIM_REPLAY`` (default on; ``0`` / ``off`` turns replay off)."""
    return os.environ.get("NKI_ATTN_SIM_REPLAY", "1").strip().lower() not in ("0", "off", "false", "no")


def _env_mib(name, default):
    try:
        return int(float(os.environ.get(name, str(default))) * (1 << 20))
    except ValueError:
        return default << 20


def budget_bytes():
    """Env ``NKI_ATTN_SIM_REPLAY_MB`` in bytes: the most memory one program may keep (default 256 MiB)."""
    return _env_mib("NKI_ATTN_SIM_REPLAY_MB", 256)


def total_budget_bytes():
    """Env ``NKI_ATTN_SIM_REPLAY_TOTAL_MB`` in bytes: the most memory all kept programs together may hold (default
    1024 MiB). Without it a long run of many signatures (a harness preset: every row its own shapes) kept up to
    ``_MAX_PROGRAMS`` programs of up to ``budget_bytes()`` each alive, 16 GiB at the defaults."""
    return _env_mib("NKI_ATTN_SIM_REPLAY_TOTAL_MB", 1024)


# ----------------------------------------------------------------------------------------------------- keys
class Uncacheable(Exception):
    """An argument whose value cannot be part of a signature."""


def _sig(v, depth=0):
    if depth > 12:
        raise Uncacheable("nested too deeply")
    t = type(v)
    if t is np.ndarray:
        return ("nd", v.shape, v.dtype.str)
    if v is None or t is bool or t is int or t is str:
        return (t, v)
    if t is float:
        return (t, v.hex())
    if t is tuple or t is list:
        return (t,) + tuple(_sig(e, depth + 1) for e in v)
    if t is dict:
        return (t,) + tuple((k, _sig(e, depth + 1)) for k, e in v.items())
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(v, torch.Tensor):
        return ("pt", tuple(v.shape), str(v.dtype), v.device.type)
    if isinstance(v, np.generic):
        return ("np", v.dtype.str, v.item())
    if isinstance(v, (enum.Enum, types.FunctionType, types.BuiltinFunctionType, type, types.ModuleType)):
        return ("id", v)  # compared by identity
    fields = getattr(v, "__dict__", None)
    if isinstance(fields, dict) and not isinstance(v, NkiTensor):
        return ("obj", t, _sig(fields, depth + 1))  # NKIObject configs: by class and content
    try:
        hash(v)
    except TypeError:
        raise Uncacheable(f"argument of type {t.__name__}") from None
    return ("val", t, v)


def signature(fn, lnc, args, kwargs):
    """The cache key of a launch, or None when it is not replayable (LNC2, an active instruction recorder, replay
    off, the frontend check off, an argument without a signature)."""
    if lnc not in (None, 1) or not enabled() or context.active_recorder() is not None:
        return None
    modes = context.mode_overrides()
    strict = modes["strict"] if modes["strict"] is not None else context._env_flag("NKI_ATTN_SIM_STRICT", False)
    capacity = modes["capacity"] if modes["capacity"] is not None else context._env_flag("NKI_ATTN_SIM_CAPACITY",
                                                                                         True)
    frontend = context.frontend_mode()
    if frontend == "off":
        # the launch stage (module globals unchanged since the first call) is what makes a kernel a function of
        # its signature; without it (host-side experiments patching kernel constants) every launch is traced
        return None
    config = (context.target_version(), context._env_flag("NKI_PRECISE_FP", True), bool(strict), bool(capacity),
              frontend)
    try:
        return (fn, lnc, config, _sig(tuple(args)), tuple((k, _sig(v)) for k, v in kwargs.items()))
    except Uncacheable:
        return None


# ----------------------------------------------------------------------------------------------------- recording
class _View:
    """A recorded operand: a view (shape, strides, offset, dtype) of the storage in ``slot``."""

    __slots__ = ("slot", "shape", "strides", "offset", "dtype")

    def __init__(self, slot, t):
        self.slot, self.shape, self.strides, self.offset, self.dtype = slot, t.shape, t.strides, t.offset, t.dtype


class _Slot:
    """What a replay needs to make the storage again."""

    __slots__ = ("shape", "dtype", "buffer", "name", "store_dtype", "arg")

    def __init__(self, st, arg):
        self.shape, self.dtype, self.buffer, self.name = st.shape, st.dtype, st.buffer, st.name
        self.store_dtype, self.arg = st.data.dtype, arg


_ALLOC, _INSTR = 0, 1


class Recording:
    """The instruction stream of one traced launch (held by the core's ``CoreState.recorder``). It keeps
    descriptions, not the storages, so that the trace's tensors die when the kernel drops them (capacity)."""

    def __init__(self):
        self.slots = []
        self.by_uid = {}
        self.ops = []
        self.last_use = {}  # slot -> index in ops of the last instruction that uses it
        self.depth = 0
        self.invalid = None

    def invalidate(self, why):
        if self.invalid is None:
            self.invalid = why

    def add_storage(self, st, arg=None):
        self.by_uid[st.uid] = len(self.slots)
        if arg is None:
            self.ops.append((_ALLOC, len(self.slots)))
        self.slots.append(_Slot(st, arg))

    def describe(self, v):
        t = type(v)
        if t is NkiTensor:
            slot = self.by_uid.get(v.storage.uid)
            if slot is None:
                self.invalidate(f"an operand ({v.name}) on storage the trace did not allocate")
                return None
            self.last_use[slot] = len(self.ops)
            return _View(slot, v)
        if t is tuple or t is list:
            return t(self.describe(e) for e in v)
        if t is dict:
            return {k: self.describe(e) for k, e in v.items()}
        return v

    def instruction(self, fn, args, kwargs, out):
        if out is not None:
            self.invalidate(f"{fn.__name__} returned a value to Python")
        if self.invalid is None:
            self.ops.append((_INSTR, fn, self.describe(args), self.describe(kwargs)))


def recorder():
    """The recording of the calling core's launch, or None."""
    return context.current().recorder


def no_replay(why):
    """Called where kernel code reads tensor data into Python or writes memory outside an instruction: the launch
    being recorded cannot be replayed."""
    rec = context.current().recorder
    if rec is not None:
        rec.invalidate(why)


# ----------------------------------------------------------------------------------------------------- programs
class _Pool:
    """Memory of a program: storages whose live ranges in the stream do not overlap share their arrays, so a
    program holds about the kernel's peak live memory, not the sum of its allocations."""

    def __init__(self):
        self.free = {}  # (dtype, size) -> [(index after which it is free, array)]
        self.bytes = 0

    def take(self, dtype, size, start, end):
        """An array for a storage live from ``start`` to ``end`` (indices in the stream)."""
        key = (np.dtype(dtype).str, size)
        entries = self.free.setdefault(key, [])
        for i, (free_after, arr) in enumerate(entries):
            if free_after < start:
                entries[i] = (end, arr)
                return arr
        arr = np.empty(size, dtype=dtype)
        self.bytes += arr.nbytes
        entries.append((end, arr))
        return arr


# Instructions that write only part of ``dst`` and keep the rest, which they read.
_PARTIAL_WRITERS = frozenset(("tensor_copy_predicated", "nc_stream_shuffle"))


def _views(v, out):
    t = type(v)
    if t is _View:
        out.append(v)
    elif t is tuple or t is list:
        for e in v:
            _views(e, out)
    elif t is dict:
        for e in v.values():
            _views(e, out)
    return out


def _unobserved(rec, keep):
    """The allocation slots whose fresh contents no replay can observe: every element an instruction reads was
    written by an earlier instruction since the allocation (a write counts only when it covers its whole ``dst``
    view with the storage's own element size). Slots in ``keep`` (results, read after the stream) are left out.
    Such a slot needs no refill with the sentinel: what a replay reads from it is what the replay wrote."""
    sizes = {k: int(np.prod(s.shape)) for k, s in enumerate(rec.slots) if s.arg is None and k not in keep}
    itemsize = {k: s.dtype.itemsize for k, s in enumerate(rec.slots)}
    covered = {}
    observed = set()

    def mask(v):
        c = covered.get(v.slot)
        if c is None or v.dtype.itemsize != itemsize[v.slot]:
            return None
        return np.ndarray(v.shape, bool, buffer=c, offset=v.offset, strides=v.strides)

    done = {}  # op index -> slots last used there, whose masks are dropped then (live memory, not the sum)
    for k, i in rec.last_use.items():
        done.setdefault(i, []).append(k)
    for i, op in enumerate(rec.ops):
        for k in done.get(i - 1, ()):
            covered.pop(k, None)
        if op[0] == _ALLOC:
            if op[1] in sizes:
                covered[op[1]] = np.zeros(sizes[op[1]], dtype=bool)
            continue
        fn = op[1]
        bound = _isa._signature(fn).bind(*op[2], **op[3]).arguments
        partial = fn.__name__ in _PARTIAL_WRITERS
        written = []
        for name, v in bound.items():
            views = _views(v, [])
            if name in _isa._WRITE_OPERANDS:
                written += views
                if not partial:
                    continue
            for w in views:
                m = mask(w)
                if m is None or not m.all():
                    observed.add(w.slot)
        if not partial:
            for w in written:
                m = mask(w)
                if m is not None:
                    m[...] = True
                else:
                    observed.add(w.slot)
    return set(sizes) - observed


class Program:
    """A recording made executable: its own storages (kept between calls) and views."""

    def __init__(self, rec, arg_views, result, stats, strict):
        forever = len(rec.ops) + 1
        start = {op[1]: i for i, op in enumerate(rec.ops) if op[0] == _ALLOC}
        pinned = set()  # arguments and results live through the whole launch

        def pin(v):
            if type(v) is _View:
                pinned.add(v.slot)
            elif type(v) in (tuple, list):
                for e in v:
                    pin(e)
            elif type(v) is dict:
                for e in v.values():
                    pin(e)
        pin(arg_views)
        pin(result)
        pool = _Pool()
        self.storages = []
        for k, s in enumerate(rec.slots):
            first = start.get(k, -1)
            last = forever if k in pinned or s.arg is not None else rec.last_use.get(k, first)
            n = int(np.prod(s.shape))
            data = pool.take(s.store_dtype, n, first, last)
            st = Storage(s.shape, s.dtype, s.buffer, name=s.name, data=data, precise=s.store_dtype == s.dtype.np)
            if st.mm_written is not None:
                st.mm_written = pool.take(bool, n, first, last)
                st.other_written = pool.take(np.uint8, n, first, last).view(bool)
            if strict:
                st.written = pool.take(np.int8, n, first, last).view(bool)
            self.storages.append(st)
        self.bytes = pool.bytes
        # Allocations whose fresh contents no replay can observe (every element read was written first) are not
        # refilled with the sentinel; their PSUM history and written masks are still cleared.
        self.quiet = _unobserved(rec, pinned) if not strict else set()
        self.fills = [np.nan if st.data.dtype.kind == "f" or s.dtype.kind == "float" else INT_SENTINEL
                      for s, st in zip(rec.slots, self.storages)]
        # The engine accumulators of the replay's core: NaN at the start of every replay, as at a launch.
        self.scalar_acc = np.full(128, np.nan, dtype=np.float32)
        self.vector_acc = np.full(128, np.nan, dtype=np.float32)
        # Each step is a ready call: the operand views (and their numpy views, flag views and passed static
        # checks, cached on the views) are made once here, so a replay runs only the instructions' numeric work
        # and their data-dependent checks.
        self.steps = []
        self.n_instr = 0
        self.n_fast = 0
        self.blas_size = 0  # the largest M*N*K of the program's matmuls
        use_fast = _fast.enabled() and not strict
        for op in rec.ops:
            if op[0] == _ALLOC:
                # what a fresh allocation holds: the sentinel, no PSUM history, nothing written (strict mode)
                st = self.storages[op[1]]
                flags = tuple(f for f in (st.mm_written, st.other_written, st.written) if f is not None)
                if op[1] not in self.quiet:
                    self.steps.append(functools.partial(_reset, st, self.fills[op[1]], flags))
                elif flags:
                    self.steps.append(functools.partial(_clear, st, flags))
            else:
                args, kwargs = self.make(op[2]), self.make(op[3])
                step = functools.partial(op[1], *args, **kwargs)
                self.blas_size = max(self.blas_size, _isa.blas_size(op[1], args, kwargs))
                fixed = _isa.fixed_result(op[1], args, kwargs)
                if fixed is not None:
                    # values that depend on static arguments alone (iota, memset): computed by the first replay,
                    # copied by the later ones
                    step = functools.partial(self._first_fixed, len(self.steps), step, *fixed)
                elif use_fast:
                    fast = _fast.compile_step(op[1], args, kwargs, step, self)
                    if fast is not None:
                        step = fast
                        self.n_fast += 1
                self.steps.append(step)
                self.n_instr += 1
        self.args = [self.make(v) for v in arg_views]  # the argument tensors, in launch order
        self.result = self.make(result)
        self.stats = stats
        self.strict = strict
        self.lock = threading.Lock()
        self.replays = 0

    def make(self, v):
        t = type(v)
        if t is _View:
            return NkiTensor(self.storages[v.slot], v.shape, v.strides, v.offset, v.dtype)
        if t is tuple or t is list:
            return t(self.make(e) for e in v)
        if t is dict:
            return {k: self.make(e) for k, e in v.items()}
        return v

    def _first_fixed(self, i, step, dst, poison):
        step()
        self.steps[i] = functools.partial(_isa.write_fixed, dst, np.array(dst.np()), poison)

    def run(self, arrays):
        """Replay on ``arrays`` (numpy, one per argument tensor, launch order); returns the result tensors."""
        for t, arr in zip(self.args, arrays):
            st = t.storage
            np.copyto(st.data, np.asarray(arr).reshape(-1), casting="unsafe")
            st.dirty = False
            if st.written is not None:
                st.written[:] = True
        # the core's engine accumulators start poisoned, as at a launch; the compiled steps hold these arrays
        self.scalar_acc.fill(np.nan)
        self.vector_acc.fill(np.nan)
        core = context.current()
        core.scalar_acc, core.vector_acc = self.scalar_acc, self.vector_acc
        # floating-point warnings are off for the whole stream, as each operator turns them off for itself
        with np.errstate(all="ignore"):
            _ops.REPLAY.on = True
            try:
                for step in self.steps:
                    step()
            finally:
                _ops.REPLAY.on = False
        self.replays += 1
        return self.result


def _reset(st, fill, flags):
    st.data.fill(fill)
    st.dirty = False
    for f in flags:
        f.fill(False)


def _clear(st, flags):
    st.dirty = False
    for f in flags:
        f.fill(False)


_PROGRAMS = collections.OrderedDict()
_REFUSED = collections.OrderedDict()  # key -> why its recording cannot be replayed (not recorded again)
_LOCK = threading.Lock()


def lookup(key):
    """The program recorded for signature ``key``, or None."""
    with _LOCK:
        prog = _PROGRAMS.get(key)
        if prog is not None:
            _PROGRAMS.move_to_end(key)
        return prog


def should_record(key):
    """False when a launch of signature ``key`` was recorded before and could not be replayed."""
    with _LOCK:
        return key not in _REFUSED


def store(key, rec, arg_tensors, result, stats, strict):
    """After a traced launch: keep its program (or remember why it cannot be replayed)."""
    arg_views = [rec.describe(t) for t in arg_tensors]
    result_view = rec.describe(result)
    with _LOCK:
        if rec.invalid is not None:
            _REFUSED[key] = rec.invalid
            while len(_REFUSED) > 4 * _MAX_PROGRAMS:
                _REFUSED.popitem(last=False)
            return None
    prog = Program(rec, arg_views, result_view, stats, strict)
    total = total_budget_bytes()
    over = None
    if prog.bytes > budget_bytes():
        over = "NKI_ATTN_SIM_REPLAY_MB"
    elif prog.bytes > total:
        over = "NKI_ATTN_SIM_REPLAY_TOTAL_MB"
    if over is not None:
        with _LOCK:
            _REFUSED[key] = f"its storages need {prog.bytes >> 20} MiB, over {over}"
        return None
    with _LOCK:
        _PROGRAMS[key] = prog
        held = sum(p.bytes for p in _PROGRAMS.values())
        # least recently used out first; the new program, last in the order, fits the total on its own
        while len(_PROGRAMS) > _MAX_PROGRAMS or held > total:
            _, old = _PROGRAMS.popitem(last=False)
            held -= old.bytes
    return prog


def clear():
    """Forget every recorded program."""
    with _LOCK:
        _PROGRAMS.clear()
        _REFUSED.clear()


def info():
    """(signature, replays, storages, instructions) of each cached program, and the refused signatures with
    why; for tests and benchmarks."""
    with _LOCK:
        progs = [(k, p.replays, len(p.storages), p.n_instr)
                 for k, p in _PROGRAMS.items()]
        return progs, dict(_REFUSED)
