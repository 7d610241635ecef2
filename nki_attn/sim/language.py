"""``nki.language`` for the simulator: buffers, dtypes, allocation, SPMD queries, loop iterators, operators and
the experimental ``nl``-level helpers (``nl.load``, ``nl.add``, ...), which allocate new tiles and lower to
``nki.isa`` instructions exactly as documented.
"""
import contextlib
import dataclasses
import math

import numpy as np

from . import context
from . import isa as _isa
from . import ops as _ops
from . import replay as _replay
from .dtypes import (bfloat16, bool_, float8_e4m3, float8_e4m3fn, float8_e5m2, float8_e8m0fnu, float16,  # noqa: F401
                     float32, int8, int16, int32, tfloat32, uint8, uint16, uint32)
from .errors import NkiValidationError
from .ops import *  # noqa: F401,F403 - nl.add, nl.exp, ... are public names of this module
from .ops import Op as _Op
from .tensor import DynSlice, NkiTensor, hbm, private_hbm, psum, sbuf, shared_hbm  # noqa: F401
from .tensor import VirtualRegister  # noqa: F401 - nl.VirtualRegister
from .tensor import allocate as _allocate

fp32 = float32  # legacy short names (nl.fp32.min is legacy; use -3.4028235e38)
bf16 = bfloat16
fp16 = float16


# ----------------------------------------------------------------------------------------------------- tile sizes
class _TileSize:
    """``nl.tile_size``: hardware tile limits (see docs/simulator.md for sources)."""

    pmax = 128
    psum_bank_fmax = 512
    psum_fmax = 512  # deprecated alias
    psum_bank_fmax_bytes = 2048
    gemm_stationary_fmax = 128
    gemm_moving_fmax = 512
    bn_stats_fmax = 512
    psum_min_align = 4
    sbuf_min_align = 1

    @property
    def psum_num_banks(self):
        return context.PSUM_BANKS

    @property
    def sbuf_fmax_bytes(self):
        return context.SBUF_BYTES_PER_PARTITION[context.version()]

    @property
    def total_available_sbuf_size(self):  # deprecated alias of sbuf_fmax_bytes
        return self.sbuf_fmax_bytes

    @property
    def sbuf_fmax(self):
        return self.sbuf_fmax_bytes // 4


tile_size = _TileSize()


# ----------------------------------------------------------------------------------------------------- allocation
def ndarray(shape, dtype, buffer=sbuf, name="", address=None):
    """Fresh, uninitialised tensor (floats read as NaN, ints as 4 until written). On-chip: dim 0 is the partition
    dim. ``address=(partition_offset, free_offset_bytes)`` is accepted and ignored functionally."""
    if address is not None:
        if buffer is psum and int(address[1]) % context.PSUM_BANK_BYTES:
            raise NkiValidationError(f"ndarray {name}: PSUM address free offset {address[1]} must be bank aligned "
                                     f"(a multiple of {context.PSUM_BANK_BYTES} bytes)")
    return _allocate(shape, dtype, buffer, name, address=address)


def _filled(shape, dtype, buffer, name, value):
    t = ndarray(shape, dtype, buffer=buffer, name=name)
    if buffer.kind == "hbm":
        _replay.no_replay("nl.zeros/ones/full in HBM reads or writes memory outside an instruction")
        t.np()[...] = value
        _isa._wrote("nl.full", t)
    else:
        v = int(value) if t.dtype.kind != "float" else float(value)
        _isa.memset(dst=t, value=v)
    return t


def zeros(shape, dtype, buffer=sbuf, name=""):
    """Tensor of zeros (a memset)."""
    return _filled(shape, dtype, buffer, name, 0)


def ones(shape, dtype, buffer=sbuf, name=""):
    """Tensor of ones (a memset)."""
    return _filled(shape, dtype, buffer, name, 1)


def full(shape, fill_value, dtype, buffer=sbuf, name=""):
    """Tensor filled with ``fill_value`` (a memset)."""
    return _filled(shape, dtype, buffer, name, fill_value)


def zeros_like(x, dtype=None, buffer=None, name=""):
    return zeros(x.shape, dtype or x.dtype, buffer=buffer or x.buffer, name=name)


def empty_like(x, dtype=None, buffer=None, name=""):
    return ndarray(x.shape, dtype or x.dtype, buffer=buffer or x.buffer, name=name)


def rand(shape, dtype=float32, buffer=sbuf, name="", **_):
    """Uniform [0, 1) random tile (the hardware stream is not reproducible bit for bit)."""
    t = ndarray(shape, dtype, buffer=buffer, name=name)
    _replay.no_replay("nl.rand reads or writes memory outside an instruction")
    t.np()[...] = np.random.default_rng().random(t.shape).astype(t.np().dtype)
    _isa._wrote("nl.rand", t)
    return t


def shared_constant(constant, dtype=None, name=""):
    """Shared-HBM tensor initialised from a numpy array (or a .npy path)."""
    arr = np.load(constant) if isinstance(constant, str) else np.asarray(constant)
    t = ndarray(arr.shape, dtype or arr.dtype, buffer=shared_hbm, name=name)
    _replay.no_replay("nl.shared_constant reads or writes memory outside an instruction")
    t.np()[...] = arr.astype(t.np().dtype)
    # A constant is part of the compiled kernel, not written by a core at run time: it counts as written (strict
    # mode) but has no writer core, so both LNC2 cores may declare it.
    st = t.storage
    st.dirty = True
    if st.written is not None:
        st.written[...] = True
    return t


def shared_identity_matrix(n, dtype=uint8, dst=None, name=""):
    """``n x n`` identity in SBUF (as the public doc states)."""
    t = dst if dst is not None else ndarray((n, n), dtype, buffer=sbuf, name=name)
    _replay.no_replay("nl.shared_identity_matrix reads or writes memory outside an instruction")
    t.np()[...] = np.eye(n).astype(t.np().dtype)
    _isa._wrote("nl.shared_identity_matrix", t)
    return t


def ds(start, size):
    """Dynamic slice ``start:start+size``."""
    return DynSlice(start, size)


def is_hbm(buffer):
    return buffer.kind == "hbm"


def is_sbuf(buffer):
    return buffer.kind == "sbuf"


def is_psum(buffer):
    return buffer.kind == "psum"


def is_on_chip(buffer):
    return buffer.on_chip


# ----------------------------------------------------------------------------------------------------- SPMD
def program_id(axis=0):
    """Index of this core in the launch grid (0 or 1 under ``kernel[2]``; 0 without brackets)."""
    if axis != 0:
        raise NkiValidationError(f"program_id(axis={axis}): only axis 0 exists with kernel[lnc] launches")
    return context.current().program_id


def num_programs(axes=0):
    """Number of cores in the launch (1 without brackets)."""
    if axes not in (0, None):
        raise NkiValidationError(f"num_programs(axes={axes}): only axis 0 exists with kernel[lnc] launches")
    return context.current().launch.lnc


def program_ndim():
    """0 when launched without brackets, 1 for ``kernel[lnc]``."""
    return 1 if context.current().launch.grid else 0


# ----------------------------------------------------------------------------------------------------- loops
def affine_range(start, stop=None, step=1):
    """Deprecated alias of ``range``."""
    return range(start, stop, step) if stop is not None else range(start)


def sequential_range(start, stop=None, step=1):
    """Deprecated alias of ``range``."""
    return range(start, stop, step) if stop is not None else range(start)


def static_range(start, stop=None, step=1):
    """Deprecated alias of ``range``."""
    return range(start, stop, step) if stop is not None else range(start)


def fori_loop(lower, upper, body_fun, step=1):
    """Runtime loop: ``body_fun(i)`` for i in [lower, upper) with a read-only register ``i``."""
    lo = lower.value if isinstance(lower, VirtualRegister) else int(lower)
    hi = upper.value if isinstance(upper, VirtualRegister) else int(upper)
    for i in range(lo, hi, int(step)):
        body_fun(VirtualRegister(i))


def dynamic_range(start, stop=None, step=1):
    """Deprecated runtime loop; simulated as a Python range."""
    return affine_range(start, stop, step)


@contextlib.contextmanager
def no_reorder():
    """Pins instruction order on hardware; the simulator is sequential anyway."""
    yield


def _declared_fields(body):
    """Field names a class body declares, in declaration order: annotated names and plain data attributes (not
    methods or descriptors). Read when the class is created, before ``@dataclass`` rewrites the body."""
    ann = [n for n in body.get("__annotations__", {}) if not n.startswith("__")]
    names = []
    for n, v in body.items():
        if n.startswith("__") or callable(v) or isinstance(v, (property, staticmethod, classmethod)):
            continue
        if n in ann:
            # annotated names without a value are declared between the valued ones, in annotation order
            for a in ann[:ann.index(n)]:
                if a not in names:
                    names.append(a)
        names.append(n)
    names += [a for a in ann if a not in names]
    return names


def _nki_fields(cls):
    """Field names of an NKIObject class, base classes first."""
    names = []
    for klass in reversed(cls.__mro__):
        for n in vars(klass).get("_nki_declared_fields", ()):
            if n not in names:
                names.append(n)
    return names


def _nki_default(cls, name):
    f = getattr(cls, "__dataclass_fields__", {}).get(name)
    if f is not None and f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    if f is not None and f.default is not dataclasses.MISSING:
        return f.default
    val = getattr(cls, name, None)
    return None if isinstance(val, dataclasses.Field) else val


def _synth_init(self, *args, **kwargs):
    # The initializer the NKI compiler creates when a class does not define one (language guide, "Class
    # Support"): every field is a keyword with its class-level default (None when it has none), then
    # __post_init__ runs. Plain class attributes are fields too, which NKI library kernels rely on.
    cls = type(self)
    fields = _nki_fields(cls)
    if len(args) > len(fields):
        raise TypeError(f"{cls.__name__}() takes {len(fields)} positional arguments but {len(args)} were given")
    values = dict(zip(fields, args))
    for k, v in kwargs.items():
        if k not in fields:
            raise TypeError(f"{cls.__name__}() got an unexpected keyword argument {k!r}")
        if k in values:
            raise TypeError(f"{cls.__name__}() got multiple values for argument {k!r}")
        values[k] = v
    for n in fields:
        # object.__setattr__ so that @dataclass(frozen=True) subclasses can be constructed.
        object.__setattr__(self, n, values[n] if n in values else _nki_default(cls, n))
    post = getattr(self, "__post_init__", None)
    if post is not None:
        post()


_synth_init._nki_synthesised = True


class NKIObject:
    """Base class of the dataclass-like objects the NKI compiler accepts in kernels.

    As the language guide describes, a subclass that does not define ``__init__`` gets the compiler's
    initializer: ``__init__(self, field=default, ...)`` over its fields, then ``__post_init__``; ``@dataclass``
    is optional and does not change that (its generated ``__init__`` is not used)."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls._nki_declared_fields = tuple(_declared_fields(vars(cls)))
        if "__init__" in vars(cls):
            return
        inherited = cls.__init__
        if inherited is not object.__init__ and not getattr(inherited, "_nki_synthesised", False):
            return  # a base class defines its own initializer: keep Python inheritance
        # Put the initializer in the class body before @dataclass runs: dataclass never replaces an __init__
        # the class already defines.
        cls.__init__ = _synth_init


def device_print(prefix, x):
    """Print a tensor's values immediately (the simulator runs eagerly)."""
    _replay.no_replay("nl.device_print reads or writes memory outside an instruction")
    print(prefix, np.asarray(x.np()) if isinstance(x, NkiTensor) else x)


# ----------------------------------------------------------------------------------------------------- nl-level helpers
def _new_sbuf(shape, dtype):
    return ndarray(shape, dtype, buffer=sbuf)


def load(src, dtype=None, **_):
    """HBM -> new SBUF tile of the same shape (dim 0 becomes the partition dim)."""
    if not isinstance(src, NkiTensor) or src.buffer.kind != "hbm":
        raise NkiValidationError("nl.load: src must be an HBM tensor")
    shape = src.shape if src.ndim >= 2 else (src.shape[0], 1)
    t = _new_sbuf(shape, dtype or src.dtype)
    _isa.dma_copy(dst=t, src=src)
    return t


def store(dst, value, **_):
    """SBUF tile -> HBM (PSUM is not accepted: copy it to SBUF first)."""
    if not isinstance(dst, NkiTensor) or dst.buffer.kind != "hbm":
        raise NkiValidationError("nl.store: dst must be an HBM tensor")
    _isa.dma_copy(dst=dst, src=value)


def load_transpose2d(src, dtype=None, **_):
    """HBM [a, b] -> SBUF [b, a]."""
    _isa._read_checked("nl.load_transpose2d", "src", src)
    t = _new_sbuf((src.shape[1], src.shape[0]), dtype or src.dtype)
    _replay.no_replay("nl.load_transpose2d reads or writes memory outside an instruction")
    t.np()[...] = np.asarray(src.np()).T.astype(t.np().dtype)
    _isa._wrote("nl.load_transpose2d", t)
    return t


def _copy_helper(x, dtype=None, **_):
    """``nl.copy(x)``: on-chip -> new SBUF tile (Vector tensor_copy). ``nl.copy`` is also the identity
    activation function."""
    t = _new_sbuf(x.shape, dtype or x.dtype)
    _isa.tensor_copy(dst=t, src=x)
    return t


def matmul(x, y, transpose_x=False, **_):
    """``x.T @ y`` into a new PSUM tile (only transpose_x=True is supported, as documented)."""
    if not transpose_x:
        raise NkiValidationError("nl.matmul: only transpose_x=True is supported (x.T @ y)")
    out = ndarray((x.shape[1] if x.ndim > 1 else 1, y.free_elems), float32, buffer=psum)
    _isa.nc_matmul(dst=out, stationary=x, moving=y)
    return out


def transpose(x, **_):
    """TensorE transpose into a new PSUM tile."""
    out = ndarray((x.free_elems, x.shape[0]), x.dtype, buffer=psum)
    _isa.nc_transpose(dst=out, data=x)
    return out


def broadcast_to(x, shape, dtype=None, **_):
    """``nl.broadcast_to(x, shape)``: a new SBUF tile of ``shape`` holding ``x`` (SBUF or PSUM) broadcast by numpy
    rules; same rank, each dim equal or broadcast from 1 (the partition dim included). Returns ``x`` itself when the
    shape already matches and no ``dtype`` is given. The documentation does not say which instruction the
    broadcast lowers to; the trace records it as one VectorE pass named ``broadcast_to``."""
    shape = tuple(int(s) for s in shape)
    if not isinstance(x, NkiTensor) or not x.on_chip:
        raise NkiValidationError("nl.broadcast_to: x must be an SBUF or PSUM tile")
    if len(shape) != x.ndim:
        raise NkiValidationError(f"nl.broadcast_to: target shape {shape} must have the rank of x {x.shape}")
    for d, (have, want) in enumerate(zip(x.shape, shape)):
        if have != want and have != 1:
            raise NkiValidationError(f"nl.broadcast_to: dim {d} of x has size {have}; it can only become {want} "
                                     f"from size 1")
    if shape[0] > _isa.PMAX:
        raise NkiValidationError(f"nl.broadcast_to: partition dimension {shape[0]} exceeds maximum {_isa.PMAX}")
    if shape == x.shape and dtype is None:
        return x
    _isa._read_checked("nl.broadcast_to", "x", x)
    out = _new_sbuf(shape, dtype or x.dtype)
    _replay.no_replay("nl.broadcast_to reads or writes memory outside an instruction")
    vals = np.broadcast_to(np.asarray(x.np(), dtype=np.float32), shape)
    out.np()[...] = _isa._cast_for(out, vals)
    _isa._wrote("broadcast_to", out)
    _isa._trace("broadcast_to", _isa.engine.vector, out, [x])
    return out


def _binary_helper(op):
    def helper(x, y, dtype=None, **_):
        if isinstance(x, NkiTensor) and isinstance(y, NkiTensor):
            if x.shape != y.shape:
                raise NkiValidationError(f"nl.{op.name}: shapes {x.shape} and {y.shape} differ (no broadcasting)")
            out = _new_sbuf(x.shape, dtype or x.dtype)
            _isa.tensor_tensor(dst=out, data1=x, data2=y, op=op)
            return out
        if isinstance(x, NkiTensor):
            out = _new_sbuf(x.shape, dtype or x.dtype)
            _isa.tensor_scalar(dst=out, data=x, op0=op, operand0=y)
            return out
        if isinstance(y, NkiTensor):
            out = _new_sbuf(y.shape, dtype or y.dtype)
            _isa.tensor_scalar(dst=out, data=y, op0=op, operand0=x, reverse0=True)
            return out
        return op.binary(np.float32(x), np.float32(y))
    return helper


def _unary_helper(op):
    def helper(x, dtype=None, **_):
        out = _new_sbuf(x.shape, dtype or x.dtype)
        if op.activation:
            _isa.activation(dst=out, op=op, data=x)
        else:
            _isa._read_checked(f"nl.{op.name}", "x", x)
            _replay.no_replay("an nl-level unary helper reads or writes memory outside an instruction")
            arr = op.unary(np.array(x.np()))
            out.np()[...] = arr.astype(out.np().dtype)
            _isa._wrote(f"nl.{op.name}", out)
        return out
    return helper


for _name, _op in _ops.ALL.items():
    if _op.binary is not None:
        _op.nl_call = _binary_helper(_op)
    elif _op.unary is not None:
        _op.nl_call = _unary_helper(_op)


copy.nl_call = _copy_helper  # noqa: F405


def _reduce_helper(op):
    def helper(x, axis, dtype=None, keepdims=False, **_):
        axes = [axis] if isinstance(axis, int) else list(axis)
        kept = [x.shape[d] for d in range(x.ndim) if d not in axes and d - x.ndim not in axes]
        shape = tuple(kept) + ((1,) if len(kept) < 2 else ())
        out = _new_sbuf(shape, dtype or x.dtype)
        _isa.tensor_reduce(dst=out, op=op, data=x, axis=axis, keepdims=keepdims)
        return out
    return helper


sum = _reduce_helper(_ops.add)  # noqa: A001 - public names shadow builtins in nki.language
prod = _reduce_helper(_ops.multiply)
max = _Op("max", binary=_ops.maximum.binary, reducible=True, identity=_ops.maximum.identity)  # noqa: A001
min = _Op("min", binary=_ops.minimum.binary, reducible=True, identity=_ops.minimum.identity)  # noqa: A001
max.nl_call = _reduce_helper(_ops.maximum)
min.nl_call = _reduce_helper(_ops.minimum)


def mean(x, axis, dtype=None, keepdims=False, **_):
    s = sum(x, axis, dtype=float32)
    n = math.prod(x.shape[d] for d in ([axis] if isinstance(axis, int) else axis))
    out = _new_sbuf(s.shape, dtype or x.dtype)
    _isa.tensor_scalar(dst=out, data=s, op0=_ops.multiply, operand0=1.0 / n)
    return out


def where(condition, x, y, dtype=None, **_):
    for nm, t in (("condition", condition), ("x", x), ("y", y)):
        if isinstance(t, NkiTensor):
            _isa._read_checked("nl.where", nm, t)
    out = _new_sbuf(x.shape, dtype or x.dtype)
    _replay.no_replay("nl.where reads or writes memory outside an instruction")
    vals = np.where(np.asarray(condition.np()) != 0, np.asarray(x.np(), dtype=np.float32),
                    np.asarray(y.np(), dtype=np.float32) if isinstance(y, NkiTensor) else np.float32(y))
    out.np()[...] = vals.astype(out.np().dtype)
    _isa._wrote("nl.where", out)
    return out
