"""Compiled replay steps: an instruction of a recorded program (nki_attn.sim.replay) as a closure over its operands'
numpy views, made once per program.

A replayed instruction has the operand views, scalar arguments and engine of its trace, and those passed every
static check there. What is left at each replay is the arithmetic, the write with its bookkeeping (dirty flag, PSUM
history, the engine accumulators) and the checks that depend on data. ``compile_step`` turns the common forms of the
instructions of ``nki_attn.sim.isa`` into closures that do exactly that, with the same numpy operations in the same
order as the instruction (so the results are bit-identical), and with everything that depends only on the
signature (operand views, their flag views, dtypes, engine, scalar operands, index vectors) computed once. A step
whose data-dependent check fails (a PSUM accumulation the rules forbid, a non-identity ``is_transpose`` operand)
runs the instruction itself, which raises its own message.

Forms left to the instruction itself (``compile_step`` returns None): strict mode (every read is checked against
the written mask), integer and bit-vector arithmetic, tfloat32 and bool destinations, double-row matmuls, and
instructions without a compiled form. ``NKI_ATTN_SIM_REPLAY_FAST=0`` turns compiled steps off (every replayed step
then calls its instruction).
"""
import os

import numpy as np

from . import context
from . import dtypes as _dt
from . import isa as _isa
from . import ops as _ops
from .tensor import NkiTensor

_F32 = np.float32
_E = _isa.engine
_RC = _isa.reduce_cmd


def enabled():
    """Env ``NKI_ATTN_SIM_REPLAY_FAST`` (default on; ``0`` / ``off`` replays every step through its instruction)."""
    return os.environ.get("NKI_ATTN_SIM_REPLAY_FAST", "1").strip().lower() not in ("0", "off", "false", "no")


def compile_step(fn, args, kwargs, generic, prog):
    """The compiled step of instruction ``fn`` (the recorded, unwrapped ``nki.isa`` function) called with
    ``args``/``kwargs`` (the program's operand views), or None when it has no compiled form. ``generic`` is the
    step that calls the instruction itself (for the failure paths); ``prog`` gives the engine accumulators."""
    build = _BUILDERS.get(getattr(fn, "__name__", None))
    if build is None or getattr(getattr(_isa, fn.__name__), "__wrapped__", None) is not fn:
        return None
    bound = _isa._signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    for v in a.values():
        if isinstance(v, NkiTensor) and (v.storage.written is not None or v.storage.writer is not None):
            return None  # strict mode / LNC2 bookkeeping: the instruction does it
    return build(a, generic, prog)


# ----------------------------------------------------------------------------------------------------- pieces
def _float_dst(t):
    dt = t.dtype
    return dt.kind == "float" and not (dt is _dt.tfloat32 or dt == _dt.tfloat32)


def _marker(dst, matmul=False):
    """The bookkeeping of ``isa._wrote`` / ``isa._mark_matmul`` for a write of all of ``dst``."""
    st = dst.storage
    if st.mm_written is None:
        if matmul:
            return None

        def mark():
            st.dirty = True
        return mark
    mm, other = dst.over(st.mm_written), dst.over(st.other_written)
    if matmul:
        def mark():
            st.dirty = True
            mm[...] = True
            other[...] = False
    else:
        def mark():
            st.dirty = True
            other[...] = True
    return mark


def _writer(dst):
    """``isa._write(dst, vals)`` for float32 ``vals`` and a float (not tfloat32) or integer ``dst``; None
    otherwise."""
    arr = dst.np()
    store, shape = arr.dtype, arr.shape
    mark = _marker(dst)
    if dst.dtype.kind == "int":
        # isa._cast_for on float values: round half to even, NaN to 0, saturate
        lo, hi = _dt.int_range(dst.dtype)

        def write(vals):
            r = np.rint(vals.astype(np.float64))
            r[np.isnan(r)] = 0.0
            arr[...] = np.clip(r, lo, hi).astype(store).reshape(shape)
            mark()
        return write
    if not _float_dst(dst):
        return None

    if store == _F32:
        def write(vals):  # float32 values into float32 storage: astype(copy=False) would return vals itself
            arr[...] = vals.reshape(shape)
            mark()
    else:
        def write(vals):
            arr[...] = vals.astype(store, copy=False).reshape(shape)
            mark()
    return write


def _reader(t):
    """``isa._read(t)``: a float32 (P, F) copy of the view."""
    v, p = t.np(), t.shape[0]
    return lambda: v.astype(_F32).reshape(p, -1)


def _operand(t):
    """``isa._read(t)`` for an element-wise operand: where the view is already C-contiguous float32, the view
    itself in (P, F) shape instead of a copy (same values, same memory layout, so the same numpy loops; every
    operator returns a new array, and numpy's assignment handles a destination that overlaps it)."""
    v, p = t.np(), t.shape[0]
    if v.dtype == _F32 and v.flags.c_contiguous:
        flat = v.reshape(p, -1)
        return lambda: flat
    return lambda: v.astype(_F32).reshape(p, -1)


def _ufunc(op_fn):
    """An operator's function (``Op.binary`` / ``Op.unary``) or, when it wraps a numpy ufunc, the ufunc itself: on
    float32 arrays and float32 scalars it returns the float32 array the wrapper returns."""
    return getattr(op_fn, "ufunc", None) or op_fn


def _column(x, p):
    """``isa._col_or_scalar`` after its checks: a reader of a (P, 1) tensor, or the float32 immediate."""
    if isinstance(x, NkiTensor):
        r = _operand(x)
        return lambda: r().reshape(p, 1)
    value = _F32(float(x)) if isinstance(x, (bool, np.bool_)) else _F32(x)
    return lambda: value


def _poisoner(prog, eng):
    """VectorE's accumulator clobbered (``isa._poison_vector_acc``) when ``eng`` is VectorE, else nothing."""
    if eng is not _E.vector:
        return lambda: None
    acc = prog.vector_acc
    return lambda: acc.fill(np.nan)


def _column_writer(res, p, negate=False):
    """``isa._write_col``: the accumulator's first ``p`` lanes into ``res`` (P, 1)."""
    write = _writer(res)
    if write is None:
        return None
    if negate:
        return lambda vals: write(-np.array(vals, dtype=_F32).reshape(p, 1))
    return lambda vals: write(np.array(vals, dtype=_F32).reshape(p, 1))


# ----------------------------------------------------------------------------------------------------- instructions
def _dma_copy(a, generic, prog):
    dst, src = a["dst"], a["src"]
    d, s = dst.np(), src.np()
    if dst.dtype != src.dtype or s.dtype != d.dtype:
        return None
    mark, shape = _marker(dst), dst.shape

    def step():
        d[...] = s.reshape(shape)
        mark()
    return step


def _tensor_copy(a, generic, prog):
    dst, src = a["dst"], a["src"]
    eng = _isa._engine("tensor_copy", a["engine"], (_E.vector, _E.scalar, _E.gpsimd), _E.vector)
    poison = _poisoner(prog, eng)
    p, f = _isa._pf(dst)
    if src.dtype == dst.dtype and src.np().dtype == dst.np().dtype:
        s, d, mark = src.np(), dst.np(), _marker(dst)
        shape = d.shape

        def step():
            # the instruction copies src first; numpy's assignment copies by itself where dst overlaps src
            d[...] = s.reshape(p, f).reshape(shape)
            mark()
            poison()
        return step
    if not (src.dtype.kind == "float" or dst.dtype.kind == "float"):
        return None
    write, read = _writer(dst), _operand(src)
    if write is None:
        return None

    def step():
        write(read())
        poison()
    return step


def _nc_matmul(a, generic, prog):
    dst, stationary, moving = a["dst"], a["stationary"], a["moving"]
    if a["perf_mode"] is not _isa.matmul_perf_mode.none or not _float_dst(dst):
        return None
    mark = _marker(dst, matmul=True)
    if mark is None:
        return None
    k, m = _isa._pf(stationary)
    k2, n = _isa._pf(moving)
    arr = dst.np()
    store, shape = arr.dtype, arr.shape
    sv = stationary.np()
    read_s, read_m = _reader(stationary), _reader(moving)
    if a["is_transpose"]:
        eye = np.eye(k, dtype=_F32)

        def step():
            if not np.array_equal(read_m(), eye):
                return generic()  # raises: the moving operand must be an identity matrix
            vals = np.array(sv).reshape(k, m).T
            arr[...] = vals.astype(store).reshape(shape) if store != vals.dtype else vals.reshape(shape)
            mark()
        return step
    st = dst.storage
    mmv, otv = dst.over(st.mm_written), dst.over(st.other_written)
    accumulate = a["accumulate"]
    v3 = context.target_version() < 4

    def step():
        prod = read_s().T @ read_m()
        if accumulate is False:
            res = prod
        else:
            mm = mmv.reshape(prod.shape)
            if accumulate is True:
                if not mm.all():
                    return generic()  # raises, or (v4) accumulates onto a non-matmul write as the rules allow
                res = arr.astype(_F32).reshape(prod.shape) + prod
            elif not mm.any():  # nothing to accumulate onto (nor any element the v3 rule below could refuse)
                res = prod
            else:
                if v3 and (mm & otv.reshape(prod.shape)).any():
                    return generic()  # raises: accumulating onto a non-matmul write
                if mm.all():
                    res = arr.astype(_F32).reshape(prod.shape) + prod
                else:
                    res = np.where(mm, arr.astype(_F32).reshape(prod.shape) + prod, prod)
        arr[...] = res.astype(store, copy=False).reshape(shape)
        mark()
    return step


def _nc_transpose(a, generic, prog):
    dst, data, engine = a["dst"], a["data"], a["engine"]
    if engine is _E.unknown:
        eng = _E.tensor if dst.buffer.kind == "psum" else _E.vector
    else:
        eng = _isa._engine("nc_transpose", engine, (_E.tensor, _E.vector), _E.tensor)
    mark = _marker(dst, matmul=eng is _E.tensor)
    if mark is None:
        return None
    poison = _poisoner(prog, eng)
    p, f = _isa._pf(data)
    d, arr = data.np(), dst.np()
    store, shape = arr.dtype, arr.shape

    def step():
        # the instruction copies data first; numpy's assignment copies by itself where dst overlaps data
        vals = d.reshape(p, f).T
        arr[...] = vals.astype(store, copy=False).reshape(shape)
        mark()
        poison()
    return step


def _tensor_tensor(a, generic, prog):
    dst, data1, data2, op, engine = a["dst"], a["data1"], a["data2"], a["op"], a["engine"]
    ints = all(t.dtype in (_dt.int32, _dt.uint32) for t in (dst, data1, data2))
    if op.bitvec or ints:
        return None
    default = _E.gpsimd if op is _ops.power else _E.vector
    eng = _isa._engine("tensor_tensor", engine, (_E.vector, _E.gpsimd), default)
    write, r1, r2, poison = _writer(dst), _operand(data1), _operand(data2), _poisoner(prog, eng)
    if write is None:
        return None
    binary = _ufunc(op.binary)

    def step():
        write(binary(r1(), r2()))
        poison()
    return step


def _tensor_scalar(a, generic, prog):
    dst, data, op0, op1 = a["dst"], a["data"], a["op0"], a["op1"]
    if op0.bitvec or (op1 is not None and op1.bitvec):
        return None
    eng = _isa._engine("tensor_scalar", a["engine"], (_E.vector, _E.scalar, _E.gpsimd), _E.vector)
    write, read, poison = _writer(dst), _operand(data), _poisoner(prog, eng)
    if write is None:
        return None
    p = dst.shape[0]
    o0 = _column(a["operand0"], p) if op0.binary is not None else (lambda: None)
    f0 = _scalar_fn(op0, a["reverse0"])
    if op1 is None:
        def step():
            write(f0(read(), o0()))
            poison()
        return step
    o1 = _column(a["operand1"], p) if op1.binary is not None else (lambda: None)
    f1 = _scalar_fn(op1, a["reverse1"])

    def step():
        write(f1(f0(read(), o0()), o1()))
        poison()
    return step


def _scalar_fn(op, reverse):
    """``isa._scalar_op(op, x, operand, reverse)`` as a function of (x, operand)."""
    if op.binary is None:
        unary = _ufunc(op.unary)
        return lambda x, _: unary(x)
    binary = _ufunc(op.binary)
    if reverse:
        return lambda x, o: binary(o, x)
    return binary


def _scalar_tensor_tensor(a, generic, prog):
    dst, data, op0, op1, operand1 = a["dst"], a["data"], a["op0"], a["op1"], a["operand1"]
    write, read, read1, poison = _writer(dst), _operand(data), _operand(operand1), _poisoner(prog, _E.vector)
    if write is None:
        return None
    o0 = _column(a["operand0"], dst.shape[0])
    f0, rev1, binary = _scalar_fn(op0, a["reverse0"]), a["reverse1"], _ufunc(op1.binary)

    def step():
        t = f0(read(), o0())
        b = read1()
        write(binary(b, t) if rev1 else binary(t, b))
        poison()
    return step


def _tensor_reduce(a, generic, prog):
    dst, op, data = a["dst"], a["op"], a["data"]
    if op.bitvec:
        return None
    write, poison = _writer(dst), _poisoner(prog, _E.vector)
    if write is None:
        return None
    axes = _isa._norm_axes("tensor_reduce", a["axis"], data.ndim)
    p = data.shape[0]
    kept = 1
    for d in range(1, data.ndim):
        if d not in axes:
            kept *= data.shape[d]
    v, negate, reduce = data.np(), a["negate"], op.reduce

    def step():
        r = reduce(v.astype(_F32), axis=axes)
        if negate:
            r = -r
        write(r.reshape(p, kept))
        poison()
    return step


def _reciprocal(a, generic, prog):
    dst, data = a["dst"], a["data"]
    write, read, poison = _writer(dst), _operand(data), _poisoner(prog, _E.vector)
    if write is None:
        return None
    one = _F32(1.0)

    def step():
        write((one / read()).astype(_F32))
        poison()
    return step


def _activation(a, generic, prog):
    dst, op, data, bias, scale = a["dst"], a["op"], a["data"], a["bias"], a["scale"]
    reduce_op, reduce_res, cmd = a["reduce_op"], a["reduce_res"], a["reduce_cmd"]
    # in place, the result of nl.copy may be the view of data that the write then changes: copy the input then
    write, read = _writer(dst), (_reader(data) if data.storage is dst.storage else _operand(data))
    if write is None:
        return None
    p = dst.shape[0]
    reduces = reduce_op is not None or cmd is not _RC.idle or reduce_res is not None
    write_res = _column_writer(reduce_res, p) if reduce_res is not None else None
    if reduce_res is not None and write_res is None:
        return None
    scale_t = isinstance(scale, NkiTensor)
    s = _column(scale, p)
    s_one = not scale_t and s() == 1.0
    b = None if bias is None else (lambda r=_operand(bias): r().reshape(p, 1)) if isinstance(bias, NkiTensor) \
        else _column(bias, p)
    unary, acc, add, apply_acc = _ufunc(op.unary), prog.scalar_acc, _ops.add, _isa._apply_acc

    def step():
        x = read()
        if not s_one:
            x = x * s()
        if b is not None:
            x = x + b()
        y = unary(x.astype(_F32, copy=False))
        write(y)
        if reduces:
            apply_acc(acc, p, cmd, np.add.reduce(y, axis=1, dtype=_F32), add)
            if write_res is not None:
                write_res(acc[:p])
    return step


def _activation_reduce(a, generic, prog):
    b = dict(a, reduce_cmd=_RC.reset_reduce)
    return _activation(b, generic, prog)


def _select_reduce(a, generic, prog):
    dst, pred, on_true, on_false = a["dst"], a["predicate"], a["on_true"], a["on_false"]
    reduce_res, cmd, reverse = a["reduce_res"], a["reduce_cmd"], a["reverse_pred"]
    write, read = _writer(dst), _operand(on_true)
    if write is None:
        return None
    p = dst.shape[0]
    write_res = _column_writer(reduce_res, p) if reduce_res is not None else None
    if reduce_res is not None and write_res is None:
        return None
    pv, pp = pred.np(), pred.shape[0]
    off = _column(on_false, p)
    acc, maximum, apply_acc = prog.vector_acc, _ops.maximum, _isa._apply_acc
    row_max = np.maximum.reduce  # what np.max calls, without its Python wrapper
    idle = cmd is _RC.idle

    def step():
        keep = np.array(pv).reshape(pp, -1) != 0
        if reverse:
            keep = ~keep
        y = np.where(keep, read(), off()).astype(_F32, copy=False)
        write(y)
        if idle:
            acc.fill(np.nan)
        else:
            apply_acc(acc, p, cmd, row_max(y, axis=1), maximum)
        if write_res is not None:
            write_res(acc[:p])
    return step


def _range_select(a, generic, prog):
    dst, on_true, op0, op1 = a["dst"], a["on_true_tile"], a["comp_op0"], a["comp_op1"]
    reduce_res, cmd = a["reduce_res"], a["reduce_cmd"]
    write, read = _writer(dst), _operand(on_true)
    if write is None:
        return None
    p, f = _isa._pf(dst)
    write_res = _column_writer(reduce_res, p) if reduce_res is not None else None
    if reduce_res is not None and write_res is None:
        return None
    b0, b1 = _column(a["bound0"], p), _column(a["bound1"], p)
    idx = (int(a["range_start"]) + np.arange(f, dtype=_F32)).reshape(1, f)
    low = _F32(_isa.FP32_MIN)
    acc, maximum, apply_acc = prog.vector_acc, _ops.maximum, _isa._apply_acc
    row_max = np.maximum.reduce  # what np.max calls, without its Python wrapper
    # (cmp(...) as float32) != 0 is the boolean comparison itself
    c0, c1 = getattr(op0.binary, "compare", None), getattr(op1.binary, "compare", None)
    if c0 is None or c1 is None:
        return None

    def step():
        keep = c0(idx, b0()) & c1(idx, b1())
        y = np.where(keep, read(), low).astype(_F32, copy=False)
        write(y)
        apply_acc(acc, p, cmd, row_max(y, axis=1), maximum)
        if write_res is not None:
            write_res(acc[:p])
    return step


def _affine_select(a, generic, prog):
    dst, on_true, cmp_op = a["dst"], a["on_true_tile"], a["cmp_op"]
    write, read = _writer(dst), _operand(on_true)
    if write is None:
        return None
    p, f = _isa._pf(dst)
    # the instruction's mask, from its static arguments alone (isa.affine_select)
    values = _isa._pattern_values("affine_select", a["pattern"], f, p, a["offset"], a["channel_multiplier"])
    keep = cmp_op.binary(values.astype(np.float64), np.zeros(1)) != 0
    off = _F32(a["on_false_value"])

    def step():
        write(np.where(keep, read(), off))
    return step


_BUILDERS = {
    "dma_copy": _dma_copy,
    "tensor_copy": _tensor_copy,
    "nc_matmul": _nc_matmul,
    "nc_transpose": _nc_transpose,
    "tensor_tensor": _tensor_tensor,
    "tensor_scalar": _tensor_scalar,
    "scalar_tensor_tensor": _scalar_tensor_tensor,
    "tensor_reduce": _tensor_reduce,
    "reciprocal": _reciprocal,
    "activation": _activation,
    "activation_reduce": _activation_reduce,
    "select_reduce": _select_reduce,
    "range_select": _range_select,
    "affine_select": _affine_select,
}
