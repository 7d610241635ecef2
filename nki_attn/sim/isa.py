"""``nki.isa`` for the simulator: one function per hardware instruction, ``dst`` first.

Each instruction validates its operands the way the NKI compiler and the public simulator do (buffers, partition
counts, shapes, dtypes, generation gates) and raises ``NkiValidationError`` naming the instruction, the operand,
the value and the limit; then computes in float32 as the engines do and rounds the result to ``dst.dtype`` with
round-to-nearest-even on the write. See docs/simulator.md for what is and is not modelled.
"""
import enum
import functools

import numpy as np

from . import checks as _checks
from . import context
from . import dtypes as _dt
from . import ops as _ops
from .errors import fail
from . import tensor as _tensor_module
from .tensor import NkiTensor

_F32 = np.float32
FP32_MIN = -3.4028235e38
PMAX = 128


# ----------------------------------------------------------------------------------------------------- enums
class engine(enum.Enum):  # noqa: N801 - public lower-case name
    unknown = 0
    tensor = 1
    scalar = 2
    gpsimd = 3
    dma = 4
    vector = 5
    sync = 6


# Deprecated module-level aliases still used by older kernels.
tensor_engine = engine.tensor
scalar_engine = engine.scalar
gpsimd_engine = engine.gpsimd
vector_engine = engine.vector
unknown_engine = engine.unknown


class reduce_cmd(enum.Enum):  # noqa: N801
    idle = 0
    reset = 1
    reduce = 2
    reset_reduce = 3
    load_reduce = 4


class dge_mode(enum.Enum):  # noqa: N801
    unknown = 0
    swdge = 1
    hwdge = 2
    none = 3


class oob_mode(enum.Enum):  # noqa: N801
    error = 0
    skip = 1


class matmul_perf_mode(enum.Enum):  # noqa: N801
    none = 0
    double_row = 1


class dma_engine(enum.Enum):  # noqa: N801
    dma = 0
    gpsimd_dma = 1


class nc_version(enum.IntEnum):  # noqa: N801 - ordered, kernels compare with >=
    gen2 = 2
    gen3 = 3
    gen4 = 4


# Aliases for use inside functions whose parameters shadow the enum names (engine=, reduce_cmd=, dge_mode=).
_E = engine
_RC = reduce_cmd
_DGE = dge_mode


def get_nc_version():
    """NeuronCore version of the simulated target: ``gen2`` trn1/inf2, ``gen3`` trn2, ``gen4`` trn3."""
    return nc_version(context.version())


def get_nc_sub_version():
    return 0


# ----------------------------------------------------------------------------------------------------- helpers
def _state():
    return context.current()


def _need_version(instr, v, what=None):
    cur = context.version()
    if cur < v:
        fail(instr, what, f"requires NeuronCore v{v} ({context.target_name(v)}) or later; the target is "
                          f"{context.target_name(cur)} (NEURON_PLATFORM_TARGET_OVERRIDE)")


def _engine(instr, eng, allowed, default):
    if not isinstance(eng, engine):
        fail(instr, "engine", f"{eng!r} is not an nisa.engine member (raw ints are rejected since NKI 0.3.0)")
    if eng is engine.unknown:
        return default
    if eng not in allowed:
        fail(instr, "engine", f"{eng.name} is not allowed; use one of {[e.name for e in allowed]}")
    return eng


def _tensor(instr, name, t):
    if not isinstance(t, NkiTensor):
        fail(instr, name, f"must be an NkiTensor, got {type(t).__name__}")
    return t


_START_RULE = ((32, (0, 32, 64, 96)), (64, (0, 64)), (128, (0,)))
# Operand names that an instruction writes rather than reads (strict mode checks reads of all others).
_WRITE_OPERANDS = frozenset(("dst", "reduce_res"))


def _onchip(instr, name, t, allow=("sbuf", "psum")):
    """Operand of a compute engine: on-chip, in an allowed buffer, <= 128 partitions, legal start partition.
    These depend on the view alone, so a view that passed them for ``allow`` is not checked again (a replayed
    instruction reuses its operands' views); the strict-mode read check runs every time."""
    if type(t) is NkiTensor and t._ok is allow:
        if t.storage.written is not None and name not in _WRITE_OPERANDS:
            _checks.check_read(instr, name, t)
        return t
    _tensor(instr, name, t)
    kind = t.buffer.kind
    if kind == "hbm":
        fail(instr, name, f"{t.name} is in {t.buffer.name}; compute instructions cannot read or write HBM "
                          f"(move it with dma_copy)")
    if kind not in allow:
        fail(instr, name, f"{t.name} is in {t.buffer.name}; this operand must be in {' or '.join(allow)}")
    p = t.shape[0]
    if p > PMAX:
        fail(instr, name, f"partition dimension {p} exceeds maximum {PMAX}")
    p0 = t.partition_start
    for limit, starts in _START_RULE:
        if p <= limit:
            if p0 not in starts:
                fail(instr, name, f"an access of {p} partitions must start at partition {starts}, starts at {p0}")
            break
    t._ok = allow
    if t.storage.written is not None and name not in _WRITE_OPERANDS:
        _checks.check_read(instr, name, t)
    return t


def _pf(t):
    return t.shape[0], t.free_elems


def _match(instr, name, t, p, f):
    tp, tf = _pf(t)
    if tp != p or tf != f:
        fail(instr, name, f"shape {t.shape} ({tp} partitions x {tf} elements) does not match dst "
                          f"({p} partitions x {f} elements)")


def _read(t):
    """float32 (P, F) copy of an on-chip operand (engines compute in fp32)."""
    a = t.np()
    return a.astype(_F32).reshape(t.shape[0], -1)


def _read_int(t):
    a = t.np()
    return np.array(a).reshape(t.shape[0], -1)


def _round_tf32(x):
    bits = x.astype(_F32).view(np.uint32)
    # round-to-nearest-even to 10 explicit mantissa bits
    lsb = (bits >> 13) & 1
    bits = (bits + 0xFFF + lsb) & np.uint32(0xFFFFE000)
    return bits.view(_F32)


def _cast_for(dst, vals):
    """Convert float32/int results to the storage type of ``dst`` the way the write port does."""
    dt = dst.dtype
    store = dst.np().dtype
    if dt.kind == "float":
        if vals.dtype.kind in "iu":
            vals = vals.astype(_F32)
        if dt is _dt.tfloat32 or dt == _dt.tfloat32:
            return _round_tf32(vals)
        return vals.astype(store, copy=False)
    if vals.dtype.kind == "f":
        lo, hi = _dt.int_range(dt)
        with np.errstate(invalid="ignore"):
            r = np.rint(vals.astype(np.float64))
        r[np.isnan(r)] = 0.0  # NaN -> 0; infinities saturate in the clip
        return np.clip(r, lo, hi).astype(store)
    return vals.astype(store, copy=False)


def _flags(storage_flags, t):
    return t.over(storage_flags)


def _wrote(instr, dst, keep=None, matmul=False):
    """Bookkeeping after an instruction wrote ``dst`` (``keep``: mask of the elements it actually changed):
    dirty flag, PSUM history, and the checking modes' masks. The common case (SBUF, no checking) costs two
    attribute tests."""
    st = dst.storage
    if st.mm_written is None and st.written is None and st.writer is None:
        st.dirty = True
    else:
        _checks.note_write(instr, "dst", dst, keep, matmul)


def _read_checked(instr, name, t):
    """Strict-mode read check for operands that do not pass through ``_onchip`` (DMA sources)."""
    if t.storage.written is not None:
        _checks.check_read(instr, name, t)


def _write(dst, vals):
    """Store ``vals`` ((P, F) or any shape with dst.size elements) into dst, rounding to its dtype."""
    arr = dst.np()
    arr[...] = _cast_for(dst, np.asarray(vals)).reshape(arr.shape)
    _wrote(None, dst)


def _dge_info(mode):
    return {} if mode is _DGE.unknown else {"dge": mode.name}


def _trace(instr, eng, dst, srcs, **info):
    if getattr(_ops.REPLAY, "on", False):
        return  # a replay never runs under a tracer (nki_attn.sim.replay.signature)
    tracer = _state().launch.tracer
    if tracer is not None:
        tracer.record(instr, eng, dst, [s for s in srcs if isinstance(s, NkiTensor)], info)


def _poison_vector_acc():
    # VectorE's accumulator may be clobbered by any Vector instruction that is not part of a reduce chain.
    _state().vector_acc.fill(np.nan)


def _col_or_scalar(instr, name, x, p, require_f32=True, allow_tensor=True):
    """A per-partition operand: a Python number (fp32 immediate) or a (P, 1) on-chip tensor."""
    if isinstance(x, NkiTensor):
        if not allow_tensor:
            fail(instr, name, "must be a compile-time scalar")
        _onchip(instr, name, x)
        if x.shape[0] != p or x.free_elems != 1:
            fail(instr, name, f"shape {x.shape} must be ({p}, 1): one value per partition")
        if require_f32 and x.dtype != _dt.float32:
            fail(instr, name, f"dtype {x.dtype} must be float32 for arithmetic operands")
        return _read(x).reshape(p, 1)
    if isinstance(x, (bool, np.bool_)):
        return _F32(float(x))
    if isinstance(x, (int, float, np.integer, np.floating)):
        return _F32(x)
    fail(instr, name, f"must be a number or a ({p}, 1) tensor, got {type(x).__name__}")


def _check_op(instr, name, op, need=("binary",), allow_bitvec=True):
    if not isinstance(op, _ops.Op):
        fail(instr, name, f"{op!r} is not an nl operator (numpy functions are rejected; use nl.add etc.)")
    for n in need:
        if getattr(op, n) is None:
            fail(instr, name, f"nl.{op.name} is not a {n} operator")
    if op.bitvec and not allow_bitvec:
        fail(instr, name, f"nl.{op.name} is a bit-vector op; not accepted here")
    if op.min_version > 2:
        _need_version(instr, op.min_version, name)
    return op


def _binary(op, a, b):
    return op.binary(a, b)


def _float_only(instr, name, t):
    if t.dtype.kind != "float":
        fail(instr, name, f"dtype {t.dtype} is not accepted; this operand must be a float type")


def fixed_result(fn, args, kwargs):
    """For replay (nki_attn.sim.replay): ``(dst, poisons VectorE's accumulator)`` when the instruction ``fn``
    called with ``args``/``kwargs`` writes values that depend on its static arguments alone (``iota``, ``memset``:
    no tensor is read), else None."""
    fn = getattr(fn, "__wrapped__", fn)  # the recording holds the unwrapped instruction functions
    is_iota = fn is getattr(iota, "__wrapped__", iota)
    if not is_iota and fn is not getattr(memset, "__wrapped__", memset):
        return None
    bound = _signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    if is_iota:
        return a["dst"], False
    return a["dst"], _engine("memset", a["engine"], (_E.vector, _E.gpsimd), _E.vector) is _E.vector


def blas_size(fn, args, kwargs):
    """For replay (nki_attn.sim.replay): the M*N*K of the BLAS product the instruction ``fn`` called with
    ``args``/``kwargs`` computes (``nc_matmul``), else 0."""
    fn = getattr(fn, "__wrapped__", fn)
    if fn is not getattr(nc_matmul, "__wrapped__", nc_matmul):
        return 0
    a = _signature(fn).bind(*args, **kwargs).arguments
    k, m = _pf(a["stationary"])
    return k * m * a["moving"].free_elems


@functools.lru_cache(maxsize=None)
def _signature(fn):
    import inspect
    return inspect.signature(fn)


def write_fixed(dst, vals, poison):
    """Replay of an instruction found by ``fixed_result``: its recorded values and the bookkeeping of the write
    (dirty flag, PSUM history, strict-mode written mask), as the instruction does them."""
    np.copyto(dst.np(), vals)
    _wrote(None, dst)
    if poison:
        _poison_vector_acc()


# ----------------------------------------------------------------------------------------------------- data movement
def dma_copy(dst, src, priority=None, oob_mode=oob_mode.error, dge_mode=dge_mode.unknown,
             engine=engine.unknown, name=None):
    """``dst = src`` through a DMA queue. HBM or SBUF on both sides (never PSUM); equal element counts, paired in
    row-major order; a dtype change goes through float32; equal dtypes copy bits."""
    instr = "dma_copy"
    if not _ops.replaying():  # static checks (a replayed step passed them in its trace)
        _tensor(instr, "dst", dst)
        _tensor(instr, "src", src)
        for nm, t in (("dst", dst), ("src", src)):
            if t.buffer.kind == "psum":
                fail(instr, nm, f"{t.name} is in PSUM; DMA cannot access PSUM (copy it to SBUF with tensor_copy "
                                f"first)")
            if t.on_chip and t.shape[0] > PMAX:
                fail(instr, nm, f"partition dimension {t.shape[0]} exceeds maximum {PMAX}")
        if dst.size != src.size:
            fail(instr, "src", f"has {src.size} elements ({src.shape}), dst has {dst.size} ({dst.shape})")
        if priority is not None:
            _need_version(instr, 4, "priority")
        if dge_mode is _DGE.hwdge:
            _need_version(instr, 3, "dge_mode=hwdge")
            if dst.dtype != src.dtype:
                fail(instr, "dge_mode", f"hwdge needs equal dtypes, got {src.dtype} -> {dst.dtype}")
    _read_checked(instr, "src", src)
    s = src.np()
    if dst.dtype == src.dtype and s.dtype == dst.np().dtype:
        vals = s
        dst.np()[...] = vals.reshape(dst.shape)
    else:
        if src.dtype.kind == "float" or dst.dtype.kind == "float":
            vals = s.astype(_F32)
        else:
            vals = s
        arr = dst.np()
        arr[...] = _cast_for(dst, np.asarray(vals)).reshape(arr.shape)
    _wrote(instr, dst)
    # The DGE mode (when the kernel forces one) lets the cost model charge descriptor generation.
    _trace(instr, engine if engine is not _E.unknown else _E.dma, dst, [src], **_dge_info(dge_mode))


def tensor_copy(dst, src, engine=engine.unknown, name=None):
    """On-chip to on-chip copy on Vector, Scalar (v3+) or GpSimd (not PSUM). Bit-exact for equal dtypes,
    otherwise through float32."""
    instr = "tensor_copy"
    eng = _engine(instr, engine, (_E.vector, _E.scalar,
                                  _E.gpsimd), _E.vector)
    allow = ("sbuf",) if eng is _E.gpsimd else ("sbuf", "psum")
    _onchip(instr, "dst", dst, allow)
    _onchip(instr, "src", src, allow)
    if eng is _E.scalar:
        _need_version(instr, 3, "engine=scalar")
    p, f = _pf(dst)
    _match(instr, "src", src, p, f)
    if src.dtype == dst.dtype and src.np().dtype == dst.np().dtype:
        vals = np.array(src.np()).reshape(p, f)
        arr = dst.np()
        arr[...] = vals.reshape(arr.shape)
        _wrote(instr, dst)
    else:
        _write(dst, _read(src) if (src.dtype.kind == "float" or dst.dtype.kind == "float") else _read_int(src))
    if eng is _E.vector:
        _poison_vector_acc()
    _trace(instr, eng, dst, [src])


def memset(dst, value, engine=engine.unknown, name=None):
    """Fill ``dst`` with a compile-time constant (Vector or GpSimd; GpSimd cannot reach PSUM). Integer dtypes need
    an ``int`` value."""
    instr = "memset"
    eng = _engine(instr, engine, (_E.vector, _E.gpsimd),
                  _E.vector)
    allow = ("sbuf",) if eng is _E.gpsimd else ("sbuf", "psum")
    _onchip(instr, "dst", dst, allow)
    if isinstance(value, NkiTensor) or not isinstance(value, (int, float, np.integer, np.floating, bool)):
        fail(instr, "value", f"must be a compile-time Python number, got {type(value).__name__}")
    if dst.dtype.kind != "float" and not isinstance(value, (int, np.integer)):
        fail(instr, "value", f"{value!r} is a {type(value).__name__}; dst dtype {dst.dtype} needs an int")
    p, f = _pf(dst)
    if dst.dtype.kind == "float":
        vals = np.full((p, f), value, dtype=_F32)
    else:
        vals = np.full((p, f), value, dtype=np.int64)
        lo, hi = _dt.int_range(dst.dtype)
        if not lo <= value <= hi:
            fail(instr, "value", f"{value} does not fit {dst.dtype} [{lo}, {hi}]")
    _write(dst, vals)
    if eng is _E.vector:
        _poison_vector_acc()
    _trace(instr, eng, dst, [])


def _pattern_values(instr, pattern, f, p, offset, channel_multiplier):
    try:
        pairs = [(int(s), int(n)) for s, n in pattern]
    except (TypeError, ValueError):
        fail(instr, "pattern", f"{pattern!r} must be a list of [step, num] pairs")
    if not 1 <= len(pairs) <= 4:
        fail(instr, "pattern", f"has {len(pairs)} [step, num] pairs; 1 to 4 allowed")
    total = 1
    for _, n in pairs:
        total *= n
    if total != f:
        fail(instr, "pattern", f"covers {total} elements per partition, dst has {f}")
    vals = np.zeros(1, dtype=np.int64)
    for step, n in pairs:
        vals = (vals[:, None] + step * np.arange(n, dtype=np.int64)[None, :]).reshape(-1)
    chan = np.arange(p, dtype=np.int64)[:, None] * int(channel_multiplier)
    return int(offset) + chan + vals[None, :]


def iota(dst, pattern, offset=0, channel_multiplier=0, name=None):
    """GpSimd: ``dst[c, i...] = offset + c*channel_multiplier + sum(step_d * i_d)`` computed in int32, then cast."""
    instr = "iota"
    _onchip(instr, "dst", dst, ("sbuf",))
    p, f = _pf(dst)
    vals = _pattern_values(instr, pattern, f, p, offset, channel_multiplier)
    vals = vals.astype(np.int32)
    _write(dst, vals.astype(_F32) if dst.dtype.kind == "float" else vals)
    _trace(instr, engine.gpsimd, dst, [])


def dma_transpose(dst, src, axes=None, priority=None, dge_mode=dge_mode.unknown, oob_mode=oob_mode.error,
                  name=None):
    """DMA transpose (v3+): ``dst`` (SBUF) = ``src`` (HBM/SBUF) permuted by ``axes`` (default: reversed dims);
    same 2-byte dtype on both sides."""
    instr = "dma_transpose"
    _need_version(instr, 3)
    _tensor(instr, "dst", dst)
    _tensor(instr, "src", src)
    if dst.buffer.kind != "sbuf":
        fail(instr, "dst", f"{dst.name} must be in SBUF, is in {dst.buffer.name}")
    if src.buffer.kind == "psum":
        fail(instr, "src", f"{src.name} is in PSUM; DMA cannot access PSUM")
    if dst.dtype != src.dtype:
        fail(instr, "dst", f"dtype {dst.dtype} differs from src dtype {src.dtype}")
    if src.dtype.itemsize != 2:
        fail(instr, "src", f"dtype {src.dtype} is not a 2-byte type")
    nd = src.ndim
    if axes is None:
        axes = {2: (1, 0), 3: (2, 1, 0), 4: (3, 1, 2, 0)}.get(nd)
    axes = tuple(axes) if axes is not None else None
    legal = {2: (1, 0), 3: (2, 1, 0), 4: (3, 1, 2, 0)}
    if nd not in legal or axes != legal[nd]:
        fail(instr, "axes", f"{axes} for a rank-{nd} src is not supported; allowed: {legal}")
    want = tuple(src.shape[a] for a in axes)
    if dst.shape != want:
        fail(instr, "dst", f"shape {dst.shape} must equal the permuted src shape {want}")
    if dst.shape[0] > PMAX:
        fail(instr, "dst", f"partition dimension {dst.shape[0]} exceeds maximum {PMAX}")
    _read_checked(instr, "src", src)
    dst.np()[...] = np.transpose(src.np(), axes)
    _wrote(instr, dst)
    _trace(instr, engine.dma, dst, [src], **_dge_info(dge_mode))


# ----------------------------------------------------------------------------------------------------- TensorE
_MM_DTYPES = {"float8_e4m3", "float8_e5m2", "bfloat16", "float16", "tfloat32", "float32"}


def _matmul_operand_checks(instr, ver, dst, stationary, moving, k, m, k2, n, double, is_transpose):
    """nc_matmul's checks of its operand views, dtypes and perf mode (static: a replay skips them)."""
    _onchip(instr, "stationary", stationary, ("sbuf",))
    _onchip(instr, "moving", moving, ("sbuf",))
    _onchip(instr, "dst", dst, ("psum",))
    if double:
        _need_version(instr, 3, "perf_mode=double_row")
        if stationary.ndim != 3 or stationary.shape[1] != 2 or moving.ndim != 3 or moving.shape[1] != 2:
            fail(instr, "perf_mode", "double_row needs stationary [P, 2, M] and moving [P, 2, N]")
        if not (str(stationary.dtype).startswith("float8") and str(moving.dtype).startswith("float8")):
            fail(instr, "perf_mode", "double_row is for fp8 operands only")
    if k != k2:
        fail(instr, "moving", f"contraction (partition) size {k2} differs from stationary's {k}")
    if k > PMAX:
        fail(instr, "stationary", f"contraction size {k} exceeds maximum {PMAX}")
    if m > 128:
        fail(instr, "stationary", f"free size {m} exceeds maximum 128 (gemm_stationary_fmax)")
    nmax = 512 if ver < 4 else (8192 if dst.dtype == _dt.bfloat16 else 4096)
    if n > nmax:
        fail(instr, "moving", f"free size {n} exceeds maximum {nmax} (gemm_moving_fmax on "
                              f"{context.target_name(ver)})")
    for nm, t in (("stationary", stationary), ("moving", moving)):
        allowed = set(_MM_DTYPES) | ({"float8_e4m3fn"} if ver >= 4 else set())
        if str(t.dtype) not in allowed:
            fail(instr, nm, f"dtype {t.dtype} is not accepted; allowed {sorted(allowed)}")
    wide = {"float32", "tfloat32"}
    if (str(stationary.dtype) in wide) != (str(moving.dtype) in wide):
        fail(instr, "moving", f"dtype {moving.dtype} cannot be mixed with stationary {stationary.dtype} "
                              f"(fp32/tf32 only pair with fp32/tf32)")
    if {str(stationary.dtype), str(moving.dtype)} == {"float8_e4m3", "float8_e4m3fn"}:
        fail(instr, "moving", "float8_e4m3fn cannot be mixed with the legacy float8_e4m3")
    if is_transpose:
        _need_version(instr, 3, "is_transpose")
        if k != n:
            fail(instr, "moving", "is_transpose=True needs an identity matrix as moving")


def _matmul_output_checks(instr, ver, dst, stationary, m, n, k, is_transpose, accumulate, tile_position,
                          tile_size):
    """nc_matmul's checks of its output view and the remaining scalar arguments."""
    if is_transpose:
        if dst.dtype != stationary.dtype and dst.dtype != _dt.float32:
            fail(instr, "dst", f"dtype {dst.dtype} must be {stationary.dtype} or float32 for a transpose")
    else:
        allowed_dst = ("float32",) if ver < 4 else ("float32", "bfloat16")
        if str(dst.dtype) not in allowed_dst:
            fail(instr, "dst", f"dtype {dst.dtype} is not accepted; PSUM matmul output must be {allowed_dst} "
                               f"on {context.target_name(ver)}")
    dp, df = _pf(dst)
    if dp != m or df != n:
        fail(instr, "dst", f"shape {dst.shape} ({dp} x {df}) must be (M={m}, N={n})")
    if ver < 4:
        _check_one_bank(instr, dst)
    if tile_position or tile_size:
        _check_tiling(instr, tile_position, tile_size, k, m)
    if accumulate not in (None, True, False):
        fail(instr, "accumulate", f"{accumulate!r} must be None, True or False")


def nc_matmul(dst, stationary, moving, is_stationary_onezero=False, is_moving_onezero=False, is_transpose=False,
              accumulate=None, tile_position=(), tile_size=(), perf_mode=matmul_perf_mode.none, name=None):
    """TensorE matmul ``dst[m, n] (+)= sum_k stationary[k, m] * moving[k, n]`` (``dst = stationary.T @ moving``).

    stationary ``[K, M]`` and moving ``[K, N]`` in SBUF (extra free dims flatten), dst ``[M, N]`` in PSUM.
    Limits: K <= 128, M <= 128, N <= 512 on v2/v3 (the output fits one 2 KiB PSUM bank). ``accumulate=None``:
    elements no matmul has written since allocation are overwritten, the others accumulated; ``True`` always adds
    (undefined on elements no matmul started: raised); ``False`` overwrites.
    """
    instr = "nc_matmul"
    ver = context.version()
    k, m = _pf(stationary)
    k2, n = _pf(moving)
    double = perf_mode is matmul_perf_mode.double_row
    if double:
        m //= 2
        n //= 2
    replayed = _ops.replaying()
    if replayed:
        # a replayed step: its operands' views and static arguments passed the static checks in the trace; the
        # strict-mode reads and the data-dependent checks still run
        for nm, t in (("stationary", stationary), ("moving", moving)):
            if t.storage.written is not None:
                _checks.check_read(instr, nm, t)
    else:
        _matmul_operand_checks(instr, ver, dst, stationary, moving, k, m, k2, n, double, is_transpose)
    if is_transpose and not np.array_equal(_read(moving), np.eye(k, dtype=_F32)):
        fail(instr, "moving", "is_transpose=True needs an identity matrix as moving")  # data-dependent
    if not replayed:
        _matmul_output_checks(instr, ver, dst, stationary, m, n, k, is_transpose, accumulate, tile_position,
                              tile_size)
    if is_transpose:
        # bit-exact data movement: no arithmetic touches the values
        vals = np.array(stationary.np()).reshape(k, m).T
        arr = dst.np()
        arr[...] = vals.astype(arr.dtype).reshape(arr.shape) if arr.dtype != vals.dtype else vals.reshape(arr.shape)
        _mark_matmul(dst)
        _trace(instr, engine.tensor, dst, [stationary, moving], m=m, n=n, k=k, transpose=True)
        return
    if double:
        s = stationary.np().astype(_F32).reshape(k, 2, m).transpose(1, 0, 2).reshape(2 * k, m)
        mv = moving.np().astype(_F32).reshape(k, 2, n).transpose(1, 0, 2).reshape(2 * k, n)
    else:
        s = _read(stationary)
        mv = _read(moving)
    prod = s.T @ mv
    _accumulate(instr, dst, prod, accumulate, ver)
    _trace(instr, engine.tensor, dst, [stationary, moving], m=m, n=n, k=k * (2 if double else 1))


def _check_one_bank(instr, dst):
    st = dst.storage
    item = st.dtype.itemsize
    fs = st.free_size
    lo = hi = dst.offset % fs
    for s, stv in zip(dst.shape[1:], dst.strides[1:]):
        if stv > 0:
            hi += (s - 1) * stv
        else:
            lo += (s - 1) * stv
    lo_b, hi_b = lo * item, (hi + 1) * item - 1
    if lo_b // context.PSUM_BANK_BYTES != hi_b // context.PSUM_BANK_BYTES:
        fail(instr, "dst", f"{dst.name} spans PSUM bytes {lo_b}..{hi_b} of each partition, crossing a 2 KiB bank "
                           f"boundary; the matmul output must fit one bank (512 fp32) on "
                           f"{context.target_name(context.version())}")


def _check_tiling(instr, tile_position, tile_size, k, m):
    if len(tile_position) != 2 or len(tile_size) != 2:
        fail(instr, "tile_position", "tile_position and tile_size must both be given as (rows, cols)")
    rows, cols = tile_size
    r0, c0 = tile_position
    legal = (128, 64) if context.version() < 3 else (128, 64, 32)
    if rows not in legal or cols not in legal:
        fail(instr, "tile_size", f"{tile_size} must use sizes from {legal}")
    if r0 % rows or c0 % cols or r0 + rows > 128 or c0 + cols > 128:
        fail(instr, "tile_position", f"{tile_position} must be a multiple of tile_size {tile_size} inside 128x128")
    if k > rows or m > cols:
        fail(instr, "tile_size", f"K={k} x M={m} does not fit the tile {tile_size}")


def _mark_matmul(dst):
    _wrote("nc_matmul", dst, matmul=True)


def _psum_where(dst, p, f):
    """``t5[0:4, 0:8] (element [p, ...] of t5)``: the dst region and one element, in tensor coordinates."""
    pos = (int(p),) + tuple(int(i) for i in np.unravel_index(int(f), dst.shape[1:] or (1,)))[:dst.ndim - 1]
    flat = dst.offset + sum(i * s for i, s in zip(pos, dst.strides))
    return f"{_checks.region(dst)} (element {list(_checks.element_index(dst, flat))} of {dst.name})"


def _accumulate(instr, dst, prod, accumulate, ver):
    st = dst.storage
    mm = _flags(st.mm_written, dst).reshape(prod.shape)
    other = _flags(st.other_written, dst).reshape(prod.shape)
    if accumulate is False:
        add_mask = None
    elif accumulate is True:
        if not mm.all():
            never = ~mm & ~other
            what = "was never written" if never.any() else "was last written by a non-matmul instruction"
            if never.any() or ver < 4:
                p, f = np.argwhere(never if never.any() else ~mm)[0]  # an element the message describes
                fail(instr, "accumulate", f"True onto PSUM {_psum_where(dst, p, f)} that {what}; no overwriting "
                                          f"matmul started this accumulation (undefined on hardware)")
        add_mask = np.ones_like(mm)
    else:
        add_mask = mm
        if ver < 4 and (mm & other).any():
            p, f = np.argwhere(mm & other)[0]
            fail(instr, "accumulate", f"accumulating onto PSUM {_psum_where(dst, p, f)}, last written by a "
                                      f"non-matmul instruction (undefined on {context.target_name(ver)})")
    arr = dst.np()
    if add_mask is None or not add_mask.any():
        res = prod
    else:
        cur = arr.astype(_F32).reshape(prod.shape)
        res = np.where(add_mask, cur + prod, prod) if not add_mask.all() else cur + prod
    arr[...] = _cast_for(dst, res).reshape(arr.shape)
    _mark_matmul(dst)


def nc_transpose(dst, data, engine=engine.unknown, name=None):
    """Swap partition and (flattened) free axes. TensorE (dst in PSUM): data in SBUF, up to 128x128. VectorE
    (dst in SBUF, or engine=vector): up to 32x32, SBUF/PSUM. ``dst.dtype`` must equal ``data.dtype``."""
    instr = "nc_transpose"
    eng_cls = _E
    _tensor(instr, "dst", dst)
    if engine is eng_cls.unknown:
        eng = eng_cls.tensor if dst.buffer.kind == "psum" else eng_cls.vector
    else:
        eng = _engine(instr, engine, (eng_cls.tensor, eng_cls.vector), eng_cls.tensor)
    if eng is eng_cls.tensor:
        _onchip(instr, "dst", dst, ("psum",))
        _onchip(instr, "data", data, ("sbuf",))
        limit = 128
    else:
        _onchip(instr, "dst", dst)
        _onchip(instr, "data", data)
        limit = 32
    p, f = _pf(data)
    if p > limit or f > limit:
        fail(instr, "data", f"shape {data.shape} ({p} x {f}) exceeds the {limit}x{limit} limit of "
                            f"{eng.name} transposes")
    dp, df = _pf(dst)
    if dp != f or df != p:
        fail(instr, "dst", f"shape {dst.shape} must be ({f}, {p}), the transpose of data {data.shape}")
    if dst.dtype != data.dtype:
        fail(instr, "dst", f"dtype {dst.dtype} must equal data dtype {data.dtype}")
    vals = np.array(data.np()).reshape(p, f).T
    arr = dst.np()
    arr[...] = vals.astype(arr.dtype, copy=False).reshape(arr.shape)
    if eng is eng_cls.tensor:
        _mark_matmul(dst)
    else:
        _wrote(instr, dst)
        _poison_vector_acc()
    _trace(instr, eng, dst, [data], m=p, n=f, k=p, transpose=True)


# ----------------------------------------------------------------------------------------------------- VectorE / GpSimd
def tensor_tensor(dst, data1, data2, op, engine=engine.unknown, name=None):
    """Element-wise ``dst = op(data1, data2)`` (Vector, or GpSimd for nl.power / all-int32 data). Operands pair by
    (partitions, elements per partition); at most one input in PSUM; no broadcasting."""
    instr = "tensor_tensor"
    eng_cls = _E
    _check_op(instr, "op", op)
    ints = all(t.dtype in (_dt.int32, _dt.uint32) for t in (dst, data1, data2) if isinstance(t, NkiTensor))
    default = eng_cls.gpsimd if (op is _ops.power or ints) else eng_cls.vector
    if ints and any(isinstance(t, NkiTensor) and t.buffer.kind == "psum" for t in (dst, data1, data2)):
        default = eng_cls.vector
    eng = _engine(instr, engine, (eng_cls.vector, eng_cls.gpsimd), default)
    allow = ("sbuf",) if eng is eng_cls.gpsimd else ("sbuf", "psum")
    _onchip(instr, "dst", dst, allow)
    _onchip(instr, "data1", data1, allow)
    _onchip(instr, "data2", data2, allow)
    if data1.buffer.kind == "psum" and data2.buffer.kind == "psum":
        fail(instr, "data2", "both inputs are in PSUM; at most one input may be in PSUM")
    p, f = _pf(dst)
    _match(instr, "data1", data1, p, f)
    _match(instr, "data2", data2, p, f)
    if op.bitvec:
        for nm, t in (("data1", data1), ("data2", data2), ("dst", dst)):
            if t.dtype.kind == "float":
                fail(instr, nm, f"bit-vector op nl.{op.name} needs integer dtypes, got {t.dtype}")
        res = op.binary(_read_int(data1), _read_int(data2))
    elif ints and eng is eng_cls.gpsimd:
        res = _gpsimd_int(op, _read_int(data1).astype(np.int64), _read_int(data2).astype(np.int64))
    else:
        res = op.binary(_read(data1), _read(data2))
    _write(dst, res)
    if eng is eng_cls.vector:
        _poison_vector_acc()
    _trace(instr, eng, dst, [data1, data2])


_INT_EXACT = {
    "add": np.add, "subtract": np.subtract,
    "maximum": np.maximum, "minimum": np.minimum,
}


def _gpsimd_int(op, a, b):
    """GpSimdE int32/uint32 ``tensor_tensor``: "native integer arithmetic ... exact results for all 32-bit integer
    values" (ISA, tensor_tensor). Results that do not fit 32 bits are not specified (AMBIGUOUS, docs/simulator.md);
    the simulator wraps them modulo 2**32 (two's complement), as an integer ALU does. ``a``, ``b``: int64 arrays
    holding the operands' values. Returns int64 (comparisons: 1/0)."""
    if op.name == "multiply":
        # low 64 bits of the product (uint64 multiplication wraps mod 2**64); the low 32 are exact
        prod = a.astype(np.uint64) * b.astype(np.uint64)
        return (prod & np.uint64(0xFFFFFFFF)).astype(np.int64)
    fn = _INT_EXACT.get(op.name)
    if fn is not None:
        return fn(a, b) & 0xFFFFFFFF
    if op.name in ("equal", "not_equal", "greater", "greater_equal", "less", "less_equal"):
        return np.asarray(op.binary(a, b)).astype(np.int64)
    # other operators (power, logical ops, divide): through float64, as before
    return np.asarray(op.binary(a.astype(np.float64), b.astype(np.float64)))


def _scalar_op(op, x, operand, reverse):
    if op.binary is None:
        return op.unary(x)
    return op.binary(operand, x) if reverse else op.binary(x, operand)


def tensor_scalar(dst, data, op0, operand0, reverse0=False, op1=None, operand1=None, reverse1=False,
                  engine=engine.unknown, name=None):
    """``dst = op1(op0(data, operand0), operand1)`` with per-partition operands (numbers or (P, 1) float32
    tensors); ``reverse*`` swaps an op's operands. ScalarE (v3+) accepts only (multiply, add), (multiply, None),
    (add, None)."""
    instr = "tensor_scalar"
    eng_cls = _E
    _check_op(instr, "op0", op0, need=())
    if op1 is not None:
        _check_op(instr, "op1", op1, need=())
    if (op1 is None) != (operand1 is None) and not (op1 is not None and op1.binary is None):
        fail(instr, "op1", "op1 and operand1 must both be given or both be None")
    eng = _engine(instr, engine, (eng_cls.vector, eng_cls.scalar, eng_cls.gpsimd), eng_cls.vector)
    if eng is eng_cls.scalar:
        _need_version(instr, 3, "engine=scalar")
        combo = (op0.name, op1.name if op1 is not None else None)
        if combo not in (("multiply", "add"), ("multiply", None), ("add", None)):
            fail(instr, "engine", f"ScalarE supports only (multiply, add), (multiply, None), (add, None); got {combo}")
    if eng is eng_cls.gpsimd and op0 is not _ops.rsqrt:
        fail(instr, "engine", "GpSimd runs tensor_scalar only for nl.rsqrt")
    allow = ("sbuf",) if eng is eng_cls.gpsimd else ("sbuf", "psum")
    _onchip(instr, "dst", dst, allow)
    _onchip(instr, "data", data, allow)
    p, f = _pf(dst)
    _match(instr, "data", data, p, f)
    bitvec = op0.bitvec or (op1 is not None and op1.bitvec)
    if bitvec:
        if op1 is not None and op0.bitvec != op1.bitvec:
            fail(instr, "op1", "op0 and op1 must both be bit-vector or both arithmetic")
        if data.dtype.kind == "float":
            fail(instr, "data", f"bit-vector ops need integer data, got {data.dtype}")
        x = _read_int(data)
        o0 = operand0.np().reshape(p, 1) if isinstance(operand0, NkiTensor) else np.asarray(int(operand0))
        res = _scalar_op(op0, x, o0.astype(x.dtype), reverse0)
        if op1 is not None:
            o1 = operand1.np().reshape(p, 1) if isinstance(operand1, NkiTensor) else np.asarray(int(operand1))
            res = _scalar_op(op1, res, o1.astype(x.dtype), reverse1)
    else:
        x = _read(data)
        o0 = _col_or_scalar(instr, "operand0", operand0, p) if op0.binary is not None else None
        res = _scalar_op(op0, x, o0, reverse0)
        if op1 is not None:
            o1 = _col_or_scalar(instr, "operand1", operand1, p) if op1.binary is not None else None
            res = _scalar_op(op1, res, o1, reverse1)
    _write(dst, res)
    if eng is eng_cls.vector:
        _poison_vector_acc()
    _trace(instr, eng, dst, [data] + [o for o in (operand0, operand1) if isinstance(o, NkiTensor)])


def scalar_tensor_tensor(dst, data, op0, operand0, op1, operand1, reverse0=False, reverse1=False, name=None):
    """Vector: ``dst = op1(op0(data, operand0), operand1)``; operand0 a number or (P, 1) float32 tensor, operand1 a
    full tile. ``reverse0``/``reverse1`` swap the operands of op0/op1. data and operand1 not both in PSUM."""
    instr = "scalar_tensor_tensor"
    _check_op(instr, "op0", op0, allow_bitvec=False)
    _check_op(instr, "op1", op1, allow_bitvec=False)
    _onchip(instr, "dst", dst)
    _onchip(instr, "data", data)
    _onchip(instr, "operand1", operand1)
    if data.buffer.kind == "psum" and operand1.buffer.kind == "psum":
        fail(instr, "operand1", "data and operand1 are both in PSUM; at most one may be")
    p, f = _pf(dst)
    _match(instr, "data", data, p, f)
    _match(instr, "operand1", operand1, p, f)
    o0 = _col_or_scalar(instr, "operand0", operand0, p)
    t = _scalar_op(op0, _read(data), o0, reverse0)
    b = _read(operand1)
    res = op1.binary(b, t) if reverse1 else op1.binary(t, b)
    _write(dst, res)
    _poison_vector_acc()
    _trace(instr, engine.vector, dst, [data, operand1] + ([operand0] if isinstance(operand0, NkiTensor) else []))


def tensor_tensor_scan(dst, data0, data1, initial, op0, op1, reverse0=False, reverse1=False, name=None):
    """Vector: running scan along the (flattened) free dim of each partition,
    ``r[i] = op1(op0(data0[i], r[i-1]), data1[i])`` with ``r[-1] = initial`` (a number or a (P, 1) tile).
    ``reverse0`` makes data0 the right operand of op0, ``reverse1`` makes data1 the left operand of op1. Math in
    float32 (the carried state too); each result is rounded to dst's dtype on write. Not both data in PSUM."""
    instr = "tensor_tensor_scan"
    _check_op(instr, "op0", op0, allow_bitvec=False)
    _check_op(instr, "op1", op1, allow_bitvec=False)
    _onchip(instr, "dst", dst)
    _onchip(instr, "data0", data0)
    _onchip(instr, "data1", data1)
    if data0.buffer.kind == "psum" and data1.buffer.kind == "psum":
        fail(instr, "data1", "data0 and data1 are both in PSUM; at most one may be")
    p, f = _pf(dst)
    _match(instr, "data0", data0, p, f)
    _match(instr, "data1", data1, p, f)
    a, b = _read(data0), _read(data1)
    init = _col_or_scalar(instr, "initial", initial, p, require_f32=False)
    state = np.broadcast_to(init, (p, 1)).reshape(p).astype(_F32)
    out = np.empty((p, f), dtype=_F32)
    # The recurrence is sequential along the free dim; one numpy call per column keeps it exact in fp32.
    for i in range(f):
        t = op0.binary(state, a[:, i]) if reverse0 else op0.binary(a[:, i], state)
        state = op1.binary(b[:, i], t) if reverse1 else op1.binary(t, b[:, i])
        out[:, i] = state
    _write(dst, out)
    _poison_vector_acc()
    _trace(instr, engine.vector, dst, [data0, data1] + ([initial] if isinstance(initial, NkiTensor) else []))


def nc_stream_shuffle(dst, src, shuffle_mask, name=None):
    """Vector: cross-partition move inside each 32-partition quadrant: ``dst[32q + i] = src[32q + mask[i]]``
    (partitions counted from each view's start), the same 32-entry mask for every quadrant; ``mask[i] == 255``
    leaves ``dst`` partition i unchanged. Same dtype and elements per partition on both sides; SBUF or PSUM;
    in place allowed. Start partitions follow the rule for ``ceil(max(P_src, P_dst) / 32) * 32`` active
    partitions."""
    instr = "nc_stream_shuffle"
    _onchip(instr, "dst", dst)
    _onchip(instr, "src", src)
    if dst.dtype != src.dtype:
        fail(instr, "dst", f"dtype {dst.dtype} must equal src dtype {src.dtype}")
    pd, f = _pf(dst)
    ps, fs = _pf(src)
    if fs != f:
        fail(instr, "src", f"has {fs} elements per partition, dst has {f}")
    try:
        mask = [int(m) for m in shuffle_mask]
    except (TypeError, ValueError):
        fail(instr, "shuffle_mask", f"{shuffle_mask!r} must be a list of 32 ints")
    if len(mask) != 32 or any(not (0 <= m < 32 or m == 255) for m in mask):
        fail(instr, "shuffle_mask", f"{shuffle_mask!r} must hold 32 entries, each in 0..31 or 255 (keep)")
    active = -(-max(ps, pd) // 32) * 32
    starts = {128: (0,), 96: (0,), 64: (0, 64), 32: (0, 32, 64, 96)}[active]
    for nm, t in (("src", src), ("dst", dst)):
        if t.partition_start not in starts:
            fail(instr, nm, f"with {active} active partitions the start partition must be one of {starts}, "
                            f"is {t.partition_start}")
    sv = np.array(src.np()).reshape(ps, f)
    out = np.array(dst.np()).reshape(pd, f)
    keep = np.zeros((pd, f), dtype=bool)
    for p in range(pd):
        m = mask[p % 32]
        if m == 255:
            continue
        sp = (p // 32) * 32 + m
        if sp >= ps:
            fail(instr, "shuffle_mask", f"entry {p % 32} = {m} makes dst partition {p} read src partition {sp}, "
                                        f"but src has {ps} partitions")
        out[p] = sv[sp]
        keep[p] = True
    arr = dst.np()
    arr[...] = out.reshape(arr.shape)
    _wrote(instr, dst, keep=keep)
    _poison_vector_acc()
    _trace(instr, engine.vector, dst, [src])


def _norm_axes(instr, axis, ndim):
    axes = [axis] if isinstance(axis, (int, np.integer)) else list(axis)
    if not axes:
        fail(instr, "axis", "must name at least one free dim")
    axes = sorted(int(a) + ndim if int(a) < 0 else int(a) for a in axes)
    if axes[0] == 0:
        fail(instr, "axis", "cannot reduce the partition dim 0 (use tensor_partition_reduce)")
    if axes != list(range(axes[0], ndim)):
        fail(instr, "axis", f"{axis} must be the trailing free dims of a rank-{ndim} tensor, e.g. {ndim - 1}")
    return tuple(axes)


def tensor_reduce(dst, op, data, axis, negate=False, keepdims=False, name=None):
    """Reduce ``data`` over trailing free dims ``axis`` with ``op`` (add, multiply, maximum, minimum, ... ) into
    ``dst`` (the kept elements per partition); ``negate`` multiplies the result by -1."""
    instr = "tensor_reduce"
    _check_op(instr, "op", op, need=())
    if not op.reducible:
        fail(instr, "op", f"nl.{op.name} is not a reduction operator")
    _onchip(instr, "dst", dst)
    _onchip(instr, "data", data)
    axes = _norm_axes(instr, axis, data.ndim)
    p = data.shape[0]
    kept = 1
    for d in range(1, data.ndim):
        if d not in axes:
            kept *= data.shape[d]
    _match(instr, "dst", dst, p, kept)
    if op.bitvec:
        x = np.array(data.np())
    else:
        x = data.np().astype(_F32)
    r = op.reduce(x, axis=axes)
    if negate:
        if op.bitvec:
            fail(instr, "negate", "negate applies to arithmetic reductions only")
        r = -r
    _write(dst, r.reshape(p, kept))
    _poison_vector_acc()
    _trace(instr, engine.vector, dst, [data])


def tensor_partition_reduce(dst, op, data, name=None):
    """GpSimd: ``dst[0, f] = op over partitions p of data[p, f]`` (add, average, maximum, bitwise_or/and); SBUF."""
    instr = "tensor_partition_reduce"
    _check_op(instr, "op", op, need=())
    if op.name not in ("add", "average", "maximum", "bitwise_or", "bitwise_and"):
        fail(instr, "op", f"nl.{op.name} is not supported; use add, average, maximum, bitwise_or or bitwise_and")
    _onchip(instr, "dst", dst, ("sbuf",))
    _onchip(instr, "data", data, ("sbuf",))
    p, f = _pf(data)
    _match(instr, "dst", dst, 1, f)
    x = np.array(data.np()).reshape(p, f) if op.bitvec else _read(data)
    r = op.reduce(x, axis=0).reshape(1, f)
    _write(dst, r)
    _trace(instr, engine.gpsimd, dst, [data])


def reciprocal(dst, data, name=None):
    """``dst = 1 / data`` in float32 (VectorE), SBUF or PSUM."""
    instr = "reciprocal"
    _onchip(instr, "dst", dst)
    _onchip(instr, "data", data)
    p, f = _pf(dst)
    _match(instr, "data", data, p, f)
    with np.errstate(divide="ignore"):
        res = (_F32(1.0) / _read(data)).astype(_F32)
    _write(dst, res)
    _poison_vector_acc()
    _trace(instr, engine.vector, dst, [data])


# ----------------------------------------------------------------------------------------------------- ScalarE
def _check_reduce_cmd(instr, cmd):
    if not isinstance(cmd, reduce_cmd):
        fail(instr, "reduce_cmd", f"{cmd!r} is not an nisa.reduce_cmd member")


def _apply_acc(acc, p, cmd, row, op, init=None):
    """Update a per-lane engine accumulator with one instruction's row reduction ``row`` (P,) per ``cmd``."""
    if cmd is reduce_cmd.idle:
        return
    if cmd is reduce_cmd.reset:
        acc[:p] = _F32(op.identity if op is not None and op.identity is not None else 0.0)
        return
    if cmd is reduce_cmd.reset_reduce:
        acc[:p] = row
    elif cmd is reduce_cmd.reduce:
        acc[:p] = op.binary(acc[:p], row)
    elif cmd is reduce_cmd.load_reduce:
        acc[:p] = op.binary(np.broadcast_to(np.asarray(init, dtype=_F32).reshape(-1), (p,)).astype(_F32), row)


def activation(dst, op, data, bias=None, scale=1.0, reduce_op=None, reduce_res=None,
               reduce_cmd=reduce_cmd.idle, name=None):
    """ScalarE: ``dst = op(data * scale + bias)`` in float32. ``bias``: (P, 1) tensor, or a number on v3+;
    ``scale``: number or (P, 1) float32 tensor. With ``reduce_cmd`` the engine's add-accumulator is reset / fed
    with the row sums of the result; ``reduce_res`` (P, 1) receives the accumulator."""
    instr = "activation"
    _check_op(instr, "op", op, need=("unary",))
    if not op.activation:
        fail(instr, "op", f"nl.{op.name} is not an activation function")
    _check_reduce_cmd(instr, reduce_cmd)
    _onchip(instr, "dst", dst)
    _onchip(instr, "data", data)
    p, f = _pf(dst)
    _match(instr, "data", data, p, f)
    x = _read(data)
    if isinstance(scale, NkiTensor):
        x = x * _col_or_scalar(instr, "scale", scale, p)
    else:
        s = _col_or_scalar(instr, "scale", scale, p)
        if s != 1.0:
            x = x * s
    if bias is not None:
        if isinstance(bias, NkiTensor):
            _onchip(instr, "bias", bias)
            if bias.shape[0] != p or bias.free_elems != 1:
                fail(instr, "bias", f"shape {bias.shape} must be ({p}, 1)")
            if bias.dtype == _dt.tfloat32:
                fail(instr, "bias", "dtype tfloat32 is not accepted")
            x = x + _read(bias).reshape(p, 1)
        else:
            _need_version(instr, 3, "scalar bias")
            x = x + _col_or_scalar(instr, "bias", bias, p)
    y = op.unary(x.astype(_F32, copy=False))
    _write(dst, y)
    if reduce_op is not None or reduce_cmd is not _RC.idle or reduce_res is not None:
        if reduce_op is not None and reduce_op is not _ops.add:
            fail(instr, "reduce_op", f"nl.{getattr(reduce_op, 'name', reduce_op)} is not supported; only nl.add")
        acc = _state().scalar_acc
        _apply_acc(acc, p, reduce_cmd, np.add.reduce(y, axis=1, dtype=_F32), _ops.add)
        if reduce_res is not None:
            _write_col(instr, reduce_res, acc[:p], p)
    _trace(instr, engine.scalar, dst, [data] + [b for b in (bias, scale) if isinstance(b, NkiTensor)])


def _write_col(instr, res, vals, p, negate=False):
    _onchip(instr, "reduce_res", res)
    if res.shape[0] != p or res.free_elems != 1:
        fail(instr, "reduce_res", f"shape {res.shape} must be ({p}, 1)")
    v = np.array(vals, dtype=_F32).reshape(p, 1)
    _write(res, -v if negate else v)


def activation_reduce(dst, op, data, reduce_op, reduce_res, bias=None, scale=1.0, name=None):
    """Legacy spelling of ``activation(..., reduce_cmd=reset_reduce, reduce_res=reduce_res)``: the row sums of the
    result land in ``reduce_res`` (P, 1)."""
    activation(dst=dst, op=op, data=data, bias=bias, scale=scale, reduce_op=reduce_op, reduce_res=reduce_res,
               reduce_cmd=reduce_cmd.reset_reduce)


def tensor_scalar_reduce(dst, data, op0, operand0, reduce_op, reduce_res=None, reverse0=False,
                         reduce_cmd=reduce_cmd.reset_reduce, reduce_init=None, reduce_res_negate=False, name=None):
    """Vector: ``dst = op0(data, operand0)`` and the Vector accumulator folds ``dst`` over all free dims with
    ``reduce_op`` (add, multiply, maximum/max, minimum/min); ``reduce_res`` (P, 1) receives it (negated copy with
    ``reduce_res_negate``)."""
    instr = "tensor_scalar_reduce"
    _check_op(instr, "op0", op0, allow_bitvec=False)
    _check_reduce_cmd(instr, reduce_cmd)
    if reverse0:
        fail(instr, "reverse0", "reverse0=True is not supported yet by NKI")
    red = {"max": _ops.maximum, "min": _ops.minimum}.get(getattr(reduce_op, "name", None), reduce_op)
    if red not in (_ops.add, _ops.multiply, _ops.maximum, _ops.minimum):
        fail(instr, "reduce_op", f"{reduce_op!r} must be nl.add, nl.multiply, nl.maximum or nl.minimum")
    _onchip(instr, "dst", dst)
    _onchip(instr, "data", data)
    p, f = _pf(dst)
    _match(instr, "data", data, p, f)
    o0 = _col_or_scalar(instr, "operand0", operand0, p)
    y = op0.binary(_read(data), o0)
    _write(dst, y)
    acc = _state().vector_acc
    row = red.reduce(y, axis=1)
    if reduce_cmd is _RC.reset_reduce:
        acc[:p] = row
    elif reduce_cmd is _RC.load_reduce:
        if reduce_init is None:
            fail(instr, "reduce_init", "load_reduce needs reduce_init")
        init = reduce_init if not isinstance(reduce_init, NkiTensor) else _read(reduce_init).reshape(-1)
        _apply_acc(acc, p, reduce_cmd, row, red, init)
    else:
        _apply_acc(acc, p, reduce_cmd, row, red)
    if reduce_res is not None:
        _write_col(instr, reduce_res, acc[:p], p, negate=reduce_res_negate)
    _trace(instr, engine.vector, dst, [data])


# ----------------------------------------------------------------------------------------------------- selection
_CMP = ("equal", "not_equal", "less", "less_equal", "greater", "greater_equal")


# affine_select's mask depends on its static arguments alone (pattern, offset, channel multiplier, comparison,
# shape): made once per distinct set, as the compiler would bake it into the instruction.
_AFFINE_KEEP = {}


def affine_select(dst, pattern, channel_multiplier, on_true_tile, on_false_value, cmp_op=_ops.equal, offset=0,
                  name=None):
    """GpSimd: ``a = offset + c*channel_multiplier + sum(step_d * i_d)`` for partition c and free index i;
    ``dst = on_true_tile if cmp_op(a, 0) else on_false_value``. dst and on_true_tile in SBUF."""
    instr = "affine_select"
    _check_op(instr, "cmp_op", cmp_op)
    if cmp_op.name not in _CMP:
        fail(instr, "cmp_op", f"nl.{cmp_op.name} is not a comparison")
    _onchip(instr, "dst", dst, ("sbuf",))
    _onchip(instr, "on_true_tile", on_true_tile, ("sbuf",))
    p, f = _pf(dst)
    _match(instr, "on_true_tile", on_true_tile, p, f)
    if isinstance(on_false_value, NkiTensor):
        fail(instr, "on_false_value", "must be a float32 scalar")
    try:
        key = (tuple(tuple(int(x) for x in pair) for pair in pattern), f, p, int(offset), int(channel_multiplier),
               cmp_op.name)
    except (TypeError, ValueError):
        key = None  # a malformed pattern: _pattern_values says what is wrong
    keep = _AFFINE_KEEP.get(key) if key is not None else None
    if keep is None:
        a = _pattern_values(instr, pattern, f, p, offset, channel_multiplier).astype(np.float64)
        keep = cmp_op.binary(a, np.zeros(1)) != 0
        if key is not None:
            keep.flags.writeable = False
            if len(_AFFINE_KEEP) >= 256:
                _AFFINE_KEEP.clear()
            _AFFINE_KEEP[key] = keep
    res = np.where(keep, _read(on_true_tile), _F32(on_false_value))
    _write(dst, res)
    _trace(instr, engine.gpsimd, dst, [on_true_tile])


def range_select(dst, on_true_tile, comp_op0, comp_op1, bound0, bound1, reduce_cmd=reduce_cmd.reset_reduce,
                 reduce_res=None, reduce_op=_ops.maximum, range_start=0, on_false_value=FP32_MIN, name=None):
    """Vector (v3+): with ``idx = range_start + j`` (flat free index, compared in fp32), keep where
    ``comp_op0(idx, bound0[p]) and comp_op1(idx, bound1[p])``: ``dst = keep ? on_true : on_false_value``.
    ``bound0``/``bound1`` are (P, 1) float32 tiles (no immediates); ``on_false_value`` must be -3.4028235e38; the
    accumulator takes the row max (``reduce_res``)."""
    instr = "range_select"
    _need_version(instr, 3)
    for nm, o in (("comp_op0", comp_op0), ("comp_op1", comp_op1)):
        _check_op(instr, nm, o)
        if o.name not in _CMP:
            fail(instr, nm, f"nl.{o.name} is not a comparison")
    if reduce_op is not _ops.maximum:
        fail(instr, "reduce_op", f"{reduce_op!r} is not supported; only nl.maximum")
    if float(on_false_value) != FP32_MIN:
        fail(instr, "on_false_value", f"{on_false_value!r} is not supported; it must be {FP32_MIN}")
    _check_reduce_cmd(instr, reduce_cmd)
    _onchip(instr, "dst", dst)
    _onchip(instr, "on_true_tile", on_true_tile)
    if on_true_tile.dtype.kind != "float":
        fail(instr, "on_true_tile", f"dtype {on_true_tile.dtype} must be a float type")
    p, f = _pf(dst)
    _match(instr, "on_true_tile", on_true_tile, p, f)
    for nm, b in (("bound0", bound0), ("bound1", bound1)):
        if not isinstance(b, NkiTensor):
            # the ISA takes bounds as tiles with one fp32 element per partition (no immediate form)
            fail(instr, nm, f"must be a ({p}, 1) float32 tile, got {type(b).__name__} {b!r}")
    b0 = _col_or_scalar(instr, "bound0", bound0, p)
    b1 = _col_or_scalar(instr, "bound1", bound1, p)
    if int(range_start) + f > (1 << 24):
        fail(instr, "range_start", f"indices up to {int(range_start) + f} exceed 2^24 (fp32-exact compare)")
    idx = (int(range_start) + np.arange(f, dtype=_F32)).reshape(1, f)
    keep = (comp_op0.binary(idx, b0) != 0) & (comp_op1.binary(idx, b1) != 0)
    y = np.where(keep, _read(on_true_tile), _F32(FP32_MIN)).astype(_F32, copy=False)
    _write(dst, y)
    acc = _state().vector_acc
    _apply_acc(acc, p, reduce_cmd, np.max(y, axis=1), _ops.maximum)
    if reduce_res is not None:
        _write_col(instr, reduce_res, acc[:p], p)
    _trace(instr, engine.vector, dst, [on_true_tile] + [b for b in (bound0, bound1) if isinstance(b, NkiTensor)])


_PRED_DTYPES = ("int8", "uint8", "int16", "uint16", "int32", "uint32", "bool_")


def _predicate(instr, pred, p, f, allowed):
    _onchip(instr, "predicate", pred)
    if str(pred.dtype) not in allowed:
        fail(instr, "predicate", f"dtype {pred.dtype} is not accepted; use one of {allowed}")
    _match(instr, "predicate", pred, p, f)
    return _read_int(pred) != 0


def tensor_copy_predicated(dst, src, predicate, reverse_pred=False, name=None):
    """Vector: copy ``src`` (tile of dst's dtype, or a number) into ``dst`` where ``predicate`` (uint8, uint16 or
    uint32) is non-zero (zero with ``reverse_pred``); elsewhere dst keeps its value."""
    instr = "tensor_copy_predicated"
    _onchip(instr, "dst", dst)
    p, f = _pf(dst)
    keep = _predicate(instr, predicate, p, f, ("uint8", "uint16", "uint32"))
    if reverse_pred:
        keep = ~keep
    if isinstance(src, NkiTensor):
        _onchip(instr, "src", src)
        _match(instr, "src", src, p, f)
        if src.dtype != dst.dtype:
            fail(instr, "src", f"dtype {src.dtype} must equal dst dtype {dst.dtype}")
        if src.buffer.kind == "psum" and predicate.buffer.kind == "psum":
            fail(instr, "predicate", "src and predicate are both in PSUM; at most one may be")
        s = np.array(src.np()).reshape(p, f)
    else:
        s = np.full((p, f), src, dtype=dst.np().dtype)
    cur = np.array(dst.np()).reshape(p, f)
    res = np.where(keep, s, cur)
    arr = dst.np()
    arr[...] = res.astype(arr.dtype, copy=False).reshape(arr.shape)
    _wrote(instr, dst, keep=keep)
    _poison_vector_acc()
    _trace(instr, engine.vector, dst, [predicate] + ([src] if isinstance(src, NkiTensor) else []))


def select_reduce(dst, predicate, on_true, on_false, reduce_res=None, reduce_cmd=reduce_cmd.idle,
                  reduce_op=_ops.maximum, reverse_pred=False, name=None):
    """Vector: ``dst = predicate ? on_true : on_false`` (on_false a float32 number or (P, 1) tensor), with an
    optional row max into the Vector accumulator / ``reduce_res``. ``on_true`` and ``predicate`` may not both be in
    PSUM; ``on_true`` may not be tfloat32/int32/uint32."""
    instr = "select_reduce"
    _check_reduce_cmd(instr, reduce_cmd)
    if reduce_op is not _ops.maximum:
        fail(instr, "reduce_op", f"{reduce_op!r} is not supported; only nl.maximum")
    _onchip(instr, "dst", dst)
    _onchip(instr, "on_true", on_true)
    if str(on_true.dtype) in ("tfloat32", "int32", "uint32"):
        fail(instr, "on_true", f"dtype {on_true.dtype} is not accepted (any supported dtype except tfloat32, "
                               f"int32, uint32)")
    p, f = _pf(dst)
    _match(instr, "on_true", on_true, p, f)
    keep = _predicate(instr, predicate, p, f, ("int8", "uint8", "int16", "uint16"))
    if on_true.buffer.kind == "psum" and predicate.buffer.kind == "psum":
        fail(instr, "predicate", "on_true and predicate are both in PSUM; at most one may be")
    if reverse_pred:
        keep = ~keep
    off = _col_or_scalar(instr, "on_false", on_false, p)
    y = np.where(keep, _read(on_true), off).astype(_F32, copy=False)
    _write(dst, y)
    acc = _state().vector_acc
    if reduce_cmd is _RC.idle:
        _poison_vector_acc()
    else:
        _apply_acc(acc, p, reduce_cmd, np.max(y, axis=1), _ops.maximum)
    if reduce_res is not None:
        _write_col(instr, reduce_res, acc[:p], p)
    _trace(instr, engine.vector, dst, [predicate, on_true])


def _item_copy(dst, value):
    """``dst[...] = value`` on a tensor: a Vector copy between on-chip tensors, a DMA otherwise."""
    if dst.on_chip and value.on_chip:
        tensor_copy(dst=dst, src=value)
    else:
        dma_copy(dst=dst, src=value)


_tensor_module._COPY[0] = _item_copy


def _recorded(fn):
    """``fn`` recording itself into the launch's replay stream (nki_attn.sim.replay) when its core records one;
    instructions called by instructions are part of their caller."""

    def instruction(*args, **kwargs):
        rec = context.current().recorder
        if rec is None or rec.depth:
            return fn(*args, **kwargs)
        rec.depth = 1
        try:
            out = fn(*args, **kwargs)
        finally:
            rec.depth = 0
        rec.instruction(fn, args, kwargs, out)
        return out

    functools.update_wrapper(instruction, fn)
    return instruction


INSTRUCTIONS = ("dma_copy", "tensor_copy", "memset", "iota", "dma_transpose", "nc_matmul", "nc_transpose",
                "tensor_tensor", "tensor_scalar", "scalar_tensor_tensor", "tensor_tensor_scan", "nc_stream_shuffle",
                "tensor_reduce", "tensor_partition_reduce", "reciprocal", "activation", "activation_reduce",
                "tensor_scalar_reduce", "affine_select", "range_select", "tensor_copy_predicated", "select_reduce")
for _name in INSTRUCTIONS:
    globals()[_name] = _recorded(globals()[_name])
del _name
