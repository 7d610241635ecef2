"""The ``op=`` values of the NKI API (``nl.add``, ``nl.exp``, ...) and their fp32 numpy meaning.

In NKI the same name is both an instruction operand (``nisa.tensor_tensor(op=nl.add)``) and an ``nl``-level
function (``nl.add(x, y)``). An ``Op`` is therefore callable: ``language`` installs the ``nl``-level behaviour.
Arithmetic is done in float32 on float32 inputs (the engines' internal precision); bit-vector ops act on the
raw integer bits. Comparisons and logical ops produce 1.0 / 0.0.
"""
import math
import threading

import numpy as np

_F32 = np.float32


class Op:
    """One NKI operator. ``binary(a, b)``/``unary(x)`` take and return float32 (or int for bitvec) arrays."""

    def __init__(self, name, binary=None, unary=None, bitvec=False, reducible=False, identity=None,
                 activation=False, version=2):
        self.name = name
        self.binary = binary
        self.unary = unary
        self.bitvec = bitvec
        self.reducible = reducible
        self.identity = identity
        self.activation = activation
        self.min_version = version
        self.nl_call = None  # set by language: the nl.<name>(...) helper

    def __call__(self, *args, **kwargs):
        if self.nl_call is None:
            raise TypeError(f"nl.{self.name} cannot be called directly")
        return self.nl_call(*args, **kwargs)

    def __repr__(self):
        return f"nl.{self.name}"

    def reduce(self, x, axis):
        """Fold along ``axis`` (float32 or int arrays)."""
        if self.name in ("add", "sum"):
            return np.add.reduce(x, axis=axis, dtype=x.dtype)
        if self.name in ("multiply", "prod"):
            return np.multiply.reduce(x, axis=axis, dtype=x.dtype)
        if self.name in ("maximum", "max"):
            return np.maximum.reduce(x, axis=axis)
        if self.name in ("minimum", "min"):
            return np.minimum.reduce(x, axis=axis)
        if self.name == "subtract":
            first = np.take(x, 0, axis=axis)
            rest = np.add.reduce(np.delete(x, 0, axis=axis), axis=axis, dtype=x.dtype) if x.shape[axis] > 1 else 0
            return first - rest
        if self.name in ("bitwise_and", "logical_and"):
            return np.logical_and.reduce(x != 0, axis=axis).astype(x.dtype) if self.name.startswith("logical") \
                else np.bitwise_and.reduce(x, axis=axis)
        if self.name in ("bitwise_or", "logical_or"):
            return np.logical_or.reduce(x != 0, axis=axis).astype(x.dtype) if self.name.startswith("logical") \
                else np.bitwise_or.reduce(x, axis=axis)
        if self.name in ("bitwise_xor", "logical_xor"):
            return np.logical_xor.reduce(x != 0, axis=axis).astype(x.dtype) if self.name.startswith("logical") \
                else np.bitwise_xor.reduce(x, axis=axis)
        if self.name == "average":
            return np.add.reduce(x, axis=axis, dtype=x.dtype) / _F32(x.shape[axis])
        raise ValueError(f"nl.{self.name} is not a reduction operator")


def _cmp(fn):
    wrapped = lambda a, b: fn(a, b).astype(_F32)  # noqa: E731
    # the boolean comparison itself, for compiled replay steps (nki_attn.sim.fast) that test the result != 0
    wrapped.compare = fn
    return wrapped


def _sigmoid(x):
    with np.errstate(over="ignore"):
        return (1.0 / (1.0 + np.exp(-x))).astype(_F32)


def _erf(x):
    # Abramowitz & Stegun 7.1.26 refined with one Newton-free polynomial; |error| < 1.5e-7, below fp32 noise
    # of the activation tables. Written out to keep scipy out of the runtime dependencies.
    x = np.asarray(x, dtype=np.float64)
    s = np.sign(x)
    a = np.abs(x)
    t = 1.0 / (1.0 + 0.3275911 * a)
    y = 1.0 - (((((1.061405429 * t - 1.453152027) * t) + 1.421413741) * t - 0.284496736) * t + 0.254829592) * t \
        * np.exp(-a * a)
    return (s * y).astype(_F32)


def _softplus(x):
    return np.logaddexp(np.float32(0), x).astype(_F32)


def _gelu(x):
    return (0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))).astype(_F32)


def _gelu_tanh(x):
    return (0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))).astype(_F32)


def _silu_dx(x):
    s = _sigmoid(x)
    return (s * (1 + x * (1 - s))).astype(_F32)


def _gelu_dx(x):
    return (0.5 * (1.0 + _erf(x / math.sqrt(2.0))) + x * np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)).astype(_F32)


# ``REPLAY.on`` is set (per thread) while a replay (nki_attn.sim.replay) runs its whole instruction stream under
# np.errstate(all="ignore"): the operators then skip entering that state once per call, and instructions skip the
# checks that depend only on their static arguments (operand views, dtypes, scalars), which the trace ran.
REPLAY = threading.local()


def replaying():
    """True while the calling thread runs a replay."""
    return getattr(REPLAY, "on", False)


def _safe(fn):
    def wrapped(*a):
        if getattr(REPLAY, "on", False):
            return np.asarray(fn(*a)).astype(_F32, copy=False)
        with np.errstate(all="ignore"):
            return np.asarray(fn(*a)).astype(_F32, copy=False)
    # a numpy ufunc, called by compiled replay steps (nki_attn.sim.fast) on float32 arrays, where it returns the
    # float32 array the wrapper would (the replay runs under errstate(all="ignore") already)
    wrapped.ufunc = fn if isinstance(fn, np.ufunc) else None
    return wrapped


def _abs_max(a, b):
    return np.where(np.abs(a) > np.abs(b), a, b).astype(_F32)


def _abs_min(a, b):
    return np.where(np.abs(a) < np.abs(b), a, b).astype(_F32)


_NEG_INF = _F32(-np.inf)
_POS_INF = _F32(np.inf)

# ---- binary arithmetic
add = Op("add", binary=_safe(np.add), reducible=True, identity=0.0)
subtract = Op("subtract", binary=_safe(np.subtract), reducible=True, identity=0.0)
multiply = Op("multiply", binary=_safe(np.multiply), reducible=True, identity=1.0)
divide = Op("divide", binary=_safe(np.divide))
maximum = Op("maximum", binary=_safe(np.maximum), reducible=True, identity=_NEG_INF)
minimum = Op("minimum", binary=_safe(np.minimum), reducible=True, identity=_POS_INF)
power = Op("power", binary=_safe(np.power))
fmod = Op("fmod", binary=_safe(np.fmod))
mod = Op("mod", binary=_safe(np.mod))
equal = Op("equal", binary=_cmp(np.equal))
not_equal = Op("not_equal", binary=_cmp(np.not_equal))
greater = Op("greater", binary=_cmp(np.greater))
greater_equal = Op("greater_equal", binary=_cmp(np.greater_equal))
less = Op("less", binary=_cmp(np.less))
less_equal = Op("less_equal", binary=_cmp(np.less_equal))
logical_and = Op("logical_and", binary=_cmp(lambda a, b: np.logical_and(a != 0, b != 0)), reducible=True)
logical_or = Op("logical_or", binary=_cmp(lambda a, b: np.logical_or(a != 0, b != 0)), reducible=True)
logical_xor = Op("logical_xor", binary=_cmp(lambda a, b: np.logical_xor(a != 0, b != 0)), reducible=True)
logical_not = Op("logical_not", unary=_cmp(lambda a, _=None: a == 0))
abs_max = Op("abs_max", binary=_abs_max, version=4)
abs_min = Op("abs_min", binary=_abs_min, version=4)

# ---- bit-vector (integer dtypes, raw bits; right_shift is logical)
bitwise_and = Op("bitwise_and", binary=np.bitwise_and, bitvec=True, reducible=True)
bitwise_or = Op("bitwise_or", binary=np.bitwise_or, bitvec=True, reducible=True)
bitwise_xor = Op("bitwise_xor", binary=np.bitwise_xor, bitvec=True, reducible=True)
left_shift = Op("left_shift", binary=np.left_shift, bitvec=True)
right_shift = Op("right_shift", binary=lambda a, b: (a.view(np.uint32 if a.itemsize == 4 else np.uint16 if
                                                            a.itemsize == 2 else np.uint8) >> b).view(a.dtype),
                 bitvec=True)
invert = Op("invert", unary=np.invert, bitvec=True)

# ---- unary arithmetic that are also activation functions
abs = Op("abs", unary=_safe(np.abs), activation=True)  # noqa: A001 - the public name
square = Op("square", unary=_safe(np.square), activation=True)
relu = Op("relu", unary=_safe(lambda x: np.maximum(x, 0)), activation=True)
rsqrt = Op("rsqrt", unary=_safe(lambda x: 1.0 / np.sqrt(x)), activation=True)
reciprocal = Op("reciprocal", unary=_safe(lambda x: 1.0 / x), activation=True)
sqrt = Op("sqrt", unary=_safe(np.sqrt), activation=True)

# ---- activation functions (ScalarE)
copy = Op("copy", unary=lambda x: x.astype(_F32, copy=False), activation=True)
exp = Op("exp", unary=_safe(np.exp), activation=True)
log = Op("log", unary=_safe(np.log), activation=True)
tanh = Op("tanh", unary=_safe(np.tanh), activation=True)
sigmoid = Op("sigmoid", unary=_sigmoid, activation=True)
gelu = Op("gelu", unary=_safe(_gelu), activation=True)
gelu_dx = Op("gelu_dx", unary=_safe(_gelu_dx), activation=True)
gelu_apprx_tanh = Op("gelu_apprx_tanh", unary=_safe(_gelu_tanh), activation=True)
gelu_apprx_sigmoid = Op("gelu_apprx_sigmoid", unary=_safe(lambda x: x * _sigmoid(1.702 * x)), activation=True)
gelu_apprx_sigmoid_dx = Op("gelu_apprx_sigmoid_dx", unary=_safe(
    lambda x: _sigmoid(1.702 * x) * (1 + 1.702 * x * (1 - _sigmoid(1.702 * x)))), activation=True)
silu = Op("silu", unary=_safe(lambda x: x * _sigmoid(x)), activation=True)
silu_dx = Op("silu_dx", unary=_safe(_silu_dx), activation=True)
softplus = Op("softplus", unary=_safe(_softplus), activation=True)
mish = Op("mish", unary=_safe(lambda x: x * np.tanh(_softplus(x))), activation=True)
erf = Op("erf", unary=_safe(_erf), activation=True)
erf_dx = Op("erf_dx", unary=_safe(lambda x: 2.0 / math.sqrt(math.pi) * np.exp(-x * x)), activation=True)
sin = Op("sin", unary=_safe(np.sin), activation=True)
arctan = Op("arctan", unary=_safe(np.arctan), activation=True)
sign = Op("sign", unary=_safe(np.sign), activation=True)

# ---- special
bypass = Op("bypass", unary=lambda x: x)
average = Op("average", reducible=True, identity=0.0)

ACTIVATIONS = {o.name: o for o in globals().values() if isinstance(o, Op) and o.activation}
ALL = {o.name: o for o in globals().values() if isinstance(o, Op)}
__all__ = sorted(ALL)
