"""Buffers, storage and tensor views of the simulator.

An ``NkiTensor`` is a strided view (shape, element strides, element offset) onto a ``Storage``, a flat numpy
array. On-chip storage (SBUF, PSUM) is laid out partition-major, ``flat = p * free_size + f``, so a view's
partition stride must equal the storage free size: partitions are always contiguous and never strided. HBM
storage is linear with no partition axis. Views never copy; instructions read and write through them with
numpy strided views (made once per view) after a bounds check done once when the view is made.
"""
import itertools
import math

import numpy as np

from . import context
from . import dtypes as _dt
from .errors import NkiValidationError


class Buffer:
    """A memory space. ``kind`` is ``sbuf``, ``psum`` or ``hbm``."""

    def __init__(self, name, kind):
        self.name = name
        self.kind = kind

    @property
    def on_chip(self):
        return self.kind in ("sbuf", "psum")

    def __repr__(self):
        return f"nl.{self.name}"


sbuf = Buffer("sbuf", "sbuf")
psum = Buffer("psum", "psum")
private_hbm = Buffer("private_hbm", "hbm")
hbm = private_hbm  # nl.hbm is the private HBM of one SPMD instance
shared_hbm = Buffer("shared_hbm", "hbm")

# Fill of fresh storage, as in the public simulator: NaN for floats, 4 for integers.
INT_SENTINEL = 4

_ids = itertools.count()


class Storage:
    """Flat backing memory of one allocation (or one kernel argument)."""

    __slots__ = ("data", "dtype", "buffer", "name", "shape", "partitions", "free_size", "mm_written",
                 "other_written", "uid", "dirty", "written", "writer", "acct", "__weakref__")

    def __init__(self, shape, dtype, buffer, name="", data=None, precise=True):
        self.dtype = dtype
        self.buffer = buffer
        self.name = name or f"t{next(_ids)}"
        self.uid = next(_ids)
        self.shape = tuple(int(s) for s in shape)
        n = math.prod(self.shape)
        if buffer.on_chip:
            self.partitions = self.shape[0]
            self.free_size = n // self.shape[0] if self.shape[0] else 0
        else:
            self.partitions = None
            self.free_size = None
        store_np = dtype.np if (precise or dtype.kind != "float") else np.dtype(np.float32)
        if data is None:
            if dtype.kind == "float":
                data = np.full(n, np.nan, dtype=store_np)
            else:
                data = np.full(n, INT_SENTINEL, dtype=store_np)
        else:
            data = np.ascontiguousarray(data).reshape(-1).astype(store_np, copy=False)
        self.data = data
        self.mm_written = None
        self.other_written = None
        if buffer.kind == "psum":
            # Per-element PSUM history, needed for nc_matmul's accumulate=None rule (see isa.nc_matmul).
            self.mm_written = np.zeros(n, dtype=bool)
            self.other_written = np.zeros(n, dtype=bool)
        self.dirty = False
        # Checking-mode bookkeeping (nki_attn.sim.checks), None unless the launch asks for it: the strict-mode
        # written mask, the LNC2 writer core per element of shared HBM, and the core's memory account.
        self.written = None
        self.writer = None
        self.acct = None

    def __del__(self):
        # The end of the Python object stands in for the end of the tensor's live range (capacity accounting).
        acct = self.acct
        if acct is not None:
            acct.release(self)


def _normalize_shape(shape):
    if isinstance(shape, (int, np.integer)):
        shape = (shape,)
    try:
        shape = tuple(int(s) for s in shape)
    except TypeError as exc:
        raise NkiValidationError(f"shape {shape!r} must be a tuple of ints") from exc
    for s in shape:
        if s <= 0:
            raise NkiValidationError(f"shape {shape} has a dimension {s} <= 0")
    return shape


class DynSlice:
    """``nl.ds(start, size)``: the slice ``start:start+size``."""

    __slots__ = ("start", "size")

    def __init__(self, start, size):
        self.start = int(start)
        self.size = int(size)

    def as_slice(self):
        return slice(self.start, self.start + self.size, 1)


class NkiTensor:
    """A view onto a ``Storage``: ``shape``, element ``strides`` and element ``offset`` into the flat storage."""

    __slots__ = ("storage", "shape", "strides", "offset", "dtype", "_flat", "_np", "_ok", "_fe", "_ov")

    def __init__(self, storage, shape, strides, offset, dtype=None):
        self.storage = storage
        self.shape = tuple(int(s) for s in shape)
        self.strides = tuple(int(s) for s in strides)
        self.offset = int(offset)
        self.dtype = dtype if dtype is not None else storage.dtype
        self._np = None
        self._fe = None
        self._ov = ()  # (flag array, view) pairs made by over(): a view's offset and strides never change
        self._ok = None  # the `allow` of the engine-operand checks this view passed (nki_attn.sim.isa._onchip)
        if self.dtype is storage.dtype or self.dtype == storage.dtype:
            self._flat = storage.data
        else:
            if storage.data.dtype != storage.dtype.np:
                raise NkiValidationError(
                    f"view(dtype): cannot reinterpret {storage.name} while NKI_PRECISE_FP=0 widens it to float32")
            self._flat = storage.data.view(self.dtype.np)
        self._check_bounds()

    # ----------------------------------------------------------------- basic properties
    @property
    def buffer(self):
        return self.storage.buffer

    @property
    def name(self):
        return self.storage.name

    @property
    def ndim(self):
        return len(self.shape)

    @property
    def size(self):
        return math.prod(self.shape)

    @property
    def itemsize(self):
        return self.dtype.itemsize

    @property
    def on_chip(self):
        return self.storage.buffer.on_chip

    @property
    def partition_start(self):
        """First partition the view touches (on-chip only)."""
        fs = self._flat_free_size()
        return self.offset // fs if fs else 0

    @property
    def free_elems(self):
        """Elements per partition (on-chip), i.e. the product of the free dims."""
        n = self._fe
        if n is None:
            n = self._fe = math.prod(self.shape[1:]) if len(self.shape) > 1 else 1
        return n

    def over(self, arr):
        """The elements of this view in ``arr``, a flat array with one entry per storage element (the per-element
        flags of nki_attn.sim.checks and isa), as a writable strided view."""
        for a, v in self._ov:
            if a is arr:
                return v
        itemsize = arr.itemsize
        v = np.ndarray(self.shape, arr.dtype, buffer=arr, offset=self.offset * itemsize,
                       strides=tuple(s * itemsize for s in self.strides))
        if len(self._ov) < 4:  # a view meets at most a few flag arrays (PSUM history, strict, LNC2 writer)
            self._ov += ((arr, v),)
        return v

    def _flat_free_size(self):
        fs = self.storage.free_size
        if fs is None:
            return None
        ratio = self.storage.dtype.itemsize / self.dtype.itemsize
        return int(fs * ratio)

    def __repr__(self):
        return (f"NkiTensor(name={self.name!r}, shape={self.shape}, dtype={self.dtype}, "
                f"buffer={self.buffer.name}, offset={self.offset}, strides={self.strides})")

    def __len__(self):
        return self.shape[0]

    def __iter__(self):
        raise TypeError("NkiTensor is not iterable; index it explicitly")

    def __bool__(self):
        raise TypeError("the truth value of an NkiTensor is not known at trace time")

    # ----------------------------------------------------------------- bounds and numpy access
    def _extent(self):
        lo = hi = self.offset
        for s, st in zip(self.shape, self.strides):
            if st > 0:
                hi += (s - 1) * st
            else:
                lo += (s - 1) * st
        return lo, hi

    def _check_bounds(self):
        lo, hi = self._extent()
        n = self._flat.size
        if lo < 0 or hi >= n:
            raise NkiValidationError(
                f"view of {self.name} with offset {self.offset}, shape {self.shape} and strides {self.strides} "
                f"reaches element {lo if lo < 0 else hi}, outside its storage of {n} elements")
        fs = self._flat_free_size()
        if fs and self.ndim >= 1 and self.shape[0] > 1 and self.strides[0] != fs:
            raise NkiValidationError(
                f"on-chip view of {self.name} has partition stride {self.strides[0]}; partitions must be "
                f"contiguous (stride {fs}, the storage free size)")
        if fs and self.shape and self.ndim >= 1:
            # every free-dim access must stay inside its partition
            p0 = self.offset // fs
            flo = self.offset - p0 * fs
            fhi = flo
            for s, st in zip(self.shape[1:], self.strides[1:]):
                if st > 0:
                    fhi += (s - 1) * st
                else:
                    flo += (s - 1) * st
            if flo < 0 or fhi >= fs:
                raise NkiValidationError(
                    f"view of {self.name} crosses a partition boundary (free offsets {flo}..{fhi} of {fs})")

    def np(self):
        """Writable numpy view of the elements (no copy). Made once per view: a view's storage array, offset and
        strides never change (replayed instructions reuse their operands' views)."""
        arr = self._np
        if arr is None:
            flat = self._flat
            itemsize = flat.itemsize
            arr = self._np = np.ndarray(self.shape, flat.dtype, buffer=flat, offset=self.offset * itemsize,
                                        strides=tuple(s * itemsize for s in self.strides))
        return arr

    def flat_indices(self):
        """Flat storage element indices covered by the view, in view order (for access tracking)."""
        idx = np.full(self.shape, self.offset, dtype=np.int64)
        for d, (s, st) in enumerate(zip(self.shape, self.strides)):
            shp = [1] * self.ndim
            shp[d] = s
            idx = idx + (np.arange(s, dtype=np.int64) * st).reshape(shp)
        return idx

    def _from_np(self, arr, dtype=None):
        """Wrap a numpy view of this tensor's flat data back into an NkiTensor."""
        flat = self._flat
        itemsize = flat.itemsize
        byte_off = arr.__array_interface__["data"][0] - flat.__array_interface__["data"][0]
        strides = tuple(s // itemsize for s in arr.strides)
        return NkiTensor(self.storage, arr.shape, strides, byte_off // itemsize, dtype or self.dtype)

    # ----------------------------------------------------------------- indexing
    def __getitem__(self, key):
        if not isinstance(key, tuple):
            key = (key,)
        n_ell = sum(1 for k in key if k is Ellipsis)
        if n_ell > 1:
            raise NkiValidationError(f"index {key} of {self.name} has more than one Ellipsis")
        if n_ell:
            i = next(j for j, k in enumerate(key) if k is Ellipsis)
            fill = self.ndim - (len(key) - 1)
            key = key[:i] + (slice(None),) * fill + key[i + 1:]
        if len(key) > self.ndim:
            raise NkiValidationError(f"index {key} has {len(key)} entries for {self.name} of rank {self.ndim}")
        key = key + (slice(None),) * (self.ndim - len(key))
        shape, strides, offset, dropped = [], [], self.offset, []
        for d, k in enumerate(key):
            size, st = self.shape[d], self.strides[d]
            if isinstance(k, DynSlice):
                k = k.as_slice()
            if isinstance(k, slice):
                start, stop, step = k.start, k.stop, k.step
                step = 1 if step is None else int(step)
                if step < 1:
                    raise NkiValidationError(f"slice step {step} on dim {d} of {self.name} must be >= 1")
                start = 0 if start is None else int(start)
                stop = size if stop is None else int(stop)
                if start < 0:
                    start += size
                if stop < 0:
                    stop += size
                if not (0 <= start < stop <= size):
                    raise NkiValidationError(
                        f"index out of bounds: slice {start}:{stop} on dim {d} of {self.name} with shape "
                        f"{self.shape} (the simulator does not clamp)")
                if d == 0 and self.on_chip and step != 1:
                    raise NkiValidationError(f"partition slice of {self.name} must have step 1, got {step}")
                n = (stop - start + step - 1) // step
                offset += start * st
                shape.append(n)
                strides.append(st * step)
            elif isinstance(k, (int, np.integer)):
                i = int(k)
                if i < 0:
                    i += size
                if not 0 <= i < size:
                    raise NkiValidationError(
                        f"index out of bounds: {int(k)} on dim {d} of {self.name} with shape {self.shape}")
                offset += i * st
                if d == 0 and self.on_chip:
                    shape.append(1)
                    strides.append(st)
                else:
                    dropped.append(len(shape))
                    shape.append(1)
                    strides.append(st)
            else:
                raise NkiValidationError(
                    f"index {k!r} on dim {d} of {self.name} is not an int, slice or nl.ds (dynamic tensor "
                    f"indexing is expressed with .ap(scalar_offset=...) in current NKI)")
        # Integer-indexed free dims are dropped, but an on-chip view never drops below 2-D (the last kept).
        keep = [i for i in range(len(shape)) if i not in dropped]
        min_rank = 2 if self.on_chip else 1
        while len(keep) < min_rank:
            extra = max(i for i in range(len(shape)) if i not in keep)
            keep.append(extra)
            keep.sort()
        return NkiTensor(self.storage, [shape[i] for i in keep], [strides[i] for i in keep], offset, self.dtype)

    def __setitem__(self, key, value):
        # Undocumented in the API reference but used by the migration guide (buf[...] = nl.load(x)): a copy, by
        # the instruction nki_attn.sim.isa installs (isa imports this module, not the other way round).
        dst = self[key]
        if not isinstance(value, NkiTensor):
            raise NkiValidationError(f"assignment to {self.name}[...] needs an NkiTensor value, got {type(value)}")
        _COPY[0](dst, value)

    def slice(self, dim, start, end, step=1):
        """``t.slice(dim, start, end, step)``: requires ``0 <= start < end <= shape[dim]`` and ``step >= 1``."""
        if not (0 <= start < end <= self.shape[dim]) or step < 1:
            raise NkiValidationError(
                f"slice(dim={dim}, start={start}, end={end}, step={step}) out of range for {self.name} "
                f"with shape {self.shape}")
        key = [slice(None)] * self.ndim
        key[dim] = slice(start, end, step)
        return self[tuple(key)]

    # ----------------------------------------------------------------- access patterns
    def ap(self, pattern, offset=None, scalar_offset=None, vector_offset=None, indirect_dim=0, dtype=None):
        """Explicit access pattern over the underlying storage (the receiver's view is ignored).

        ``pattern`` is a list of ``[stride, count]`` pairs, outermost first; the result has shape ``counts``.
        ``offset`` is an absolute element offset into storage (``None`` keeps the receiver's offset).
        ``scalar_offset`` (int, register or 1x1 tensor) adds ``idx * prod(base_shape[indirect_dim+1:])``.
        """
        dt = _dt.as_dtype(dtype) if dtype is not None else self.dtype
        try:
            pairs = [(int(st), int(n)) for st, n in pattern]
        except (TypeError, ValueError) as exc:
            raise NkiValidationError(f"ap pattern {pattern!r} must be a list of [stride, count] pairs") from exc
        if not pairs:
            raise NkiValidationError("ap pattern is empty")
        for st, n in pairs:
            if n < 1 or n > 65535:
                raise NkiValidationError(f"ap count {n} must be in 1..65535 (uint16 ISA field)")
            if not -32768 <= st <= 32767 and not (self.on_chip and (st, n) == pairs[0]):
                raise NkiValidationError(f"ap stride {st} does not fit the int16 ISA field")
        base_off = self.offset if offset is None else int(offset)
        if dt != self.dtype and offset is None:
            base_off = base_off * self.dtype.itemsize // dt.itemsize
        if vector_offset is not None:
            raise NkiValidationError("ap(vector_offset=...) gathers are not supported by this simulator")
        if scalar_offset is not None:
            idx = _scalar_value(scalar_offset)
            mult = math.prod(self.storage.shape[indirect_dim + 1:])
            base_off += idx * mult
        view = NkiTensor(self.storage, [n for _, n in pairs], [st for st, _ in pairs], base_off, dt)
        return view

    def get_pattern(self):
        return [[st, n] for st, n in zip(self.strides, self.shape)]

    def is_contiguous(self):
        dims = list(zip(self.shape, self.strides))
        if self.on_chip:
            dims = dims[1:]
        expected = 1
        for s, st in reversed(dims):
            if s != 1 and st != expected:
                return False
            expected *= s
        return True

    def is_indirect(self):
        return False

    # ----------------------------------------------------------------- view methods
    def _np_view(self, fn, what):
        arr = self.np()
        try:
            out = fn(arr)
        except ValueError as exc:
            raise NkiValidationError(f"{what} of {self.name} with shape {self.shape}: {exc}") from exc
        if not np.shares_memory(out, arr) and out.size:
            raise NkiValidationError(f"{what} of {self.name} would need a copy; the layout does not allow it")
        return self._from_np(out)

    def reshape(self, shape):
        shape = _normalize_shape(shape) if -1 not in tuple(shape) else tuple(int(s) for s in shape)
        if -1 in shape:
            known = math.prod(s for s in shape if s != -1)
            shape = tuple(self.size // known if s == -1 else s for s in shape)
        if math.prod(shape) != self.size:
            raise NkiValidationError(f"reshape of {self.name} from {self.shape} to {shape} changes the element count")
        if self.on_chip and shape[0] != self.shape[0]:
            raise NkiValidationError(
                f"reshape of on-chip {self.name} must keep the partition dim {self.shape[0]}, got {shape}")
        return self._np_view(lambda a: a.reshape(shape, copy=False), "reshape")

    def reshape_dim(self, dim, shape):
        shape = list(shape)
        if shape.count(-1) > 1:
            raise NkiValidationError("reshape_dim allows at most one -1")
        if -1 in shape:
            known = math.prod(s for s in shape if s != -1)
            shape[shape.index(-1)] = self.shape[dim] // known
        if self.on_chip and dim == 0:
            raise NkiValidationError("reshape_dim cannot split the partition dim of an on-chip tensor")
        return self.reshape(self.shape[:dim] + tuple(shape) + self.shape[dim + 1:])

    def flatten_dims(self, start, end):
        if self.on_chip and start == 0:
            raise NkiValidationError("flatten_dims cannot merge the partition dim of an on-chip tensor")
        merged = math.prod(self.shape[start:end + 1])
        return self.reshape(self.shape[:start] + (merged,) + self.shape[end + 1:])

    def permute(self, dims):
        dims = tuple(int(d) for d in dims)
        if sorted(dims) != list(range(self.ndim)):
            raise NkiValidationError(f"permute dims {dims} is not a permutation of {self.ndim} dims")
        if self.on_chip and dims[0] != 0:
            raise NkiValidationError(f"permute of on-chip {self.name} must keep dim 0 first, got {dims}")
        return NkiTensor(self.storage, [self.shape[d] for d in dims], [self.strides[d] for d in dims],
                         self.offset, self.dtype)

    def broadcast(self, dim, size):
        if self.shape[dim] != 1:
            raise NkiValidationError(f"broadcast of dim {dim} of {self.name} needs size 1, has {self.shape[dim]}")
        if self.on_chip and dim == 0:
            raise NkiValidationError("broadcast of the partition dim is not possible with a view")
        shape, strides = list(self.shape), list(self.strides)
        shape[dim], strides[dim] = int(size), 0
        return NkiTensor(self.storage, shape, strides, self.offset, self.dtype)

    def expand_dim(self, dim):
        if self.on_chip and dim == 0:
            raise NkiValidationError("expand_dim cannot insert before the partition dim of an on-chip tensor")
        shape, strides = list(self.shape), list(self.strides)
        shape.insert(dim, 1)
        strides.insert(dim, 0)
        return NkiTensor(self.storage, shape, strides, self.offset, self.dtype)

    def squeeze_dim(self, dim):
        if self.shape[dim] != 1:
            raise NkiValidationError(f"squeeze_dim({dim}) of {self.name}: size is {self.shape[dim]}, not 1")
        if self.on_chip and dim == 0:
            raise NkiValidationError("squeeze_dim cannot remove the partition dim of an on-chip tensor")
        shape, strides = list(self.shape), list(self.strides)
        del shape[dim], strides[dim]
        return NkiTensor(self.storage, shape, strides, self.offset, self.dtype)

    def select(self, dim, index):
        """``t.select(dim, i)``: the view at index ``i`` of ``dim``, with the dim dropped (on-chip views keep a
        size-1 dim rather than fall below 2-D). Runtime indices are not supported."""
        if not isinstance(index, (int, np.integer)):
            raise NkiValidationError("select with a runtime index is not supported by this simulator")
        if self.on_chip and dim == 0:
            raise NkiValidationError("select cannot pick along the partition dim of an on-chip tensor")
        key = [slice(None)] * self.ndim
        key[dim] = int(index)
        return self[tuple(key)]

    def view(self, dtype):
        """Bit cast: the last dim is scaled by the element-size ratio and must be contiguous."""
        dt = _dt.as_dtype(dtype)
        if dt.itemsize == self.dtype.itemsize:
            return NkiTensor(self.storage, self.shape, self.strides, self.offset, dt)
        if self.strides[-1] != 1:
            raise NkiValidationError(f"view({dt}) of {self.name} needs a contiguous last dim")
        num, den = self.dtype.itemsize, dt.itemsize
        last = self.shape[-1] * num
        if last % den:
            raise NkiValidationError(f"view({dt}): last dim {self.shape[-1]} x {num} B is not a multiple of {den} B")
        if (self.offset * num) % den or any((s * num) % den for s in self.strides[:-1]):
            raise NkiValidationError(f"view({dt}) of {self.name}: offset/strides not aligned to {den} bytes")
        shape = self.shape[:-1] + (last // den,)
        strides = tuple(s * num // den for s in self.strides[:-1]) + (1,)
        return NkiTensor(self.storage, shape, strides, self.offset * num // den, dt)

    reinterpret_cast = view


class VirtualRegister:
    """A 32-bit engine register (runtime loops); the simulator holds its value."""

    def __init__(self, value=0):
        self.value = int(value)

    def __int__(self):
        raise TypeError("a VirtualRegister cannot drive Python control flow (int()) at trace time")

    def __index__(self):
        raise TypeError("a VirtualRegister cannot drive Python control flow (range()) at trace time")

    def __bool__(self):
        raise TypeError("a VirtualRegister cannot drive Python control flow (if/while) at trace time")



_COPY = [None]  # the copy NkiTensor item assignment makes (nki_attn.sim.isa.install_item_copy sets it)


def _scalar_value(x):
    if isinstance(x, VirtualRegister):
        return int(x.value)
    if isinstance(x, NkiTensor):
        rec = context.current().recorder
        if rec is not None:
            rec.invalidate(f"the value of {x.name} decides a view at trace time")
        if x.size != 1:
            raise NkiValidationError(f"scalar_offset tensor {x.name} must have one element, has {x.size}")
        return int(x.np().reshape(-1)[0])
    return int(x)


def _track(st, launch, state, address=None, written=False):
    """Attach the launch's checking bookkeeping to a new storage (see nki_attn.sim.checks)."""
    if launch.strict:
        st.written = np.full(st.data.size, written, dtype=bool)
    if launch.lnc > 1 and st.buffer is shared_hbm:
        st.writer = np.full(st.data.size, -1, dtype=np.int8)
    if st.buffer.on_chip and state.mem is not None:
        state.mem.allocate(st, address)


def allocate(shape, dtype, buffer, name="", address=None):
    """Fresh storage and a full view of it (the NaN/4 sentinel fill). ``address=(partition, free byte offset)``
    places an on-chip tensor explicitly (used by the capacity accounting)."""
    state = context.current()
    launch = state.launch
    shape = _normalize_shape(shape)
    dt = _dt.as_dtype(dtype)
    if not isinstance(buffer, Buffer):
        raise NkiValidationError(f"buffer {buffer!r} must be one of nl.sbuf, nl.psum, nl.hbm, nl.private_hbm, "
                                 f"nl.shared_hbm (string buffer names are rejected since NKI 0.3.0)")
    if buffer.on_chip and len(shape) < 2:
        raise NkiValidationError(f"on-chip tensor {name or ''} must be at least 2-D (partition, free), got {shape}")
    if buffer is shared_hbm and launch.grid and launch.lnc > 1:
        # Every core's k-th shared_hbm allocation is the same tensor, as the compiler allocates it once.
        with launch.lock:
            k = state.shared_counter
            state.shared_counter += 1
            if k < len(launch.shared_allocs):
                st = launch.shared_allocs[k]
                if st.shape != shape or st.dtype != dt:
                    raise NkiValidationError(
                        f"shared_hbm allocation #{k} differs between cores ({st.shape} {st.dtype} vs {shape} {dt}); "
                        f"LNC2 kernels must have identical control flow on both cores")
                return NkiTensor(st, shape, _contig_strides(shape), 0)
            st = Storage(shape, dt, buffer, name=name, precise=launch.precise_fp)
            _track(st, launch, state)
            launch.shared_allocs.append(st)
    else:
        st = Storage(shape, dt, buffer, name=name, precise=launch.precise_fp)
        _track(st, launch, state, address)
    if launch.tracer is not None:
        launch.tracer.on_alloc(st)
    if state.recorder is not None:
        state.recorder.add_storage(st)
    return NkiTensor(st, shape, _contig_strides(shape), 0)


def _contig_strides(shape):
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= s
    return tuple(reversed(strides))


def from_array(arr, buffer, name=""):
    """HBM tensor holding a copy of a numpy array (kernel arguments)."""
    dt = _dt.as_dtype(arr.dtype)
    state = context.current()
    st = Storage(arr.shape, dt, buffer, name=name, data=arr, precise=state.launch.precise_fp)
    _track(st, state.launch, state, written=True)  # kernel arguments count as written
    return NkiTensor(st, arr.shape, _contig_strides(arr.shape), 0)


def to_array(t):
    """Numpy copy of a tensor's elements in its declared dtype."""
    arr = np.array(t.np(), copy=True)
    if arr.dtype != t.dtype.np:
        arr = arr.astype(t.dtype.np)
    return arr
