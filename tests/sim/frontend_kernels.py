"""Kernels for tests/sim/test_frontend.py: the NKI frontend check (nki_attn.sim.frontend).

Kept out of the test module so that pytest does not rewrite their asserts (the frontend instruments a function
only when its source compiles to the code it runs). Each ``bad_<rule>`` kernel reaches a helper holding one
refused construct, marked ``# <- <rule>`` on its line. For the gathering rules the helper is reached only through
a branch that is never taken at trace time (``a.shape[0] < 0``): the frontend refuses it anyway, as the NKI
compiler reads every function the kernel references. For the tracing rules the helper runs, since the tracer
only sees what executes. ``good_kernel`` uses every construct the frontend accepts.
"""
import dataclasses
import enum
import functools
import math

import numpy as np

import nki_attn.sim as nki
from nki_attn.sim import isa as nisa
from nki_attn.sim import language as nl


def copy_out(a, scale=1.0):
    """a * scale in a new shared-HBM tensor (one load, one Vector op, one store)."""
    out = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
    t = nl.ndarray(a.shape, a.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=a)
    nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=scale)
    nisa.dma_copy(dst=out, src=t)
    return out


# ------------------------------------------------------------------------------------------- gathering rules
def _h_raise(a):
    raise ValueError("never raised")  # <- raise


def _h_try(a):
    try:  # <- try
        return a
    except KeyError:
        return None


def _h_with(a):
    with open(__file__) as f:  # <- with
        return f


def _h_del(a):
    b = a
    del b  # <- del
    return a


def _h_import(a):
    import os  # <- import
    return os


_G = 1


def _h_global(a):
    global _G  # <- global
    _G = 2
    return a


def _h_match(a):
    match a.shape[0]:  # <- match
        case 1:
            return 1
    return 0


def _h_inner_def(a):
    def inner(x):  # <- inner-def
        return x
    return inner(a)


def _h_inner_class(a):
    class Inner(nl.NKIObject):  # <- inner-class
        pass
    return Inner


def _h_lambda(a):
    f = lambda x: x  # <- lambda  # noqa: E731
    return f(a)


def _h_comprehension(a):
    return [d for d in a.shape]  # <- comprehension


def _h_generator(a):
    return tuple(d for d in a.shape)  # <- generator


def _h_set(a):
    return {a.shape[0], 1}  # <- set


def _h_walrus(a):
    if (n := a.shape[0]) > 1:  # <- walrus
        return n
    return 0


def _h_yield(a):
    yield a  # <- yield


def _h_format_spec(a):
    return f"{a.shape[0]:4d}"  # <- format-spec


def _h_starred(a):
    return max(*a.shape)  # <- starred


def _h_kwargs_expansion(a):
    opts = dict(scale=1.0)
    return copy_out(a, **opts)  # <- kwargs-expansion


def _h_varargs(*dims):  # <- varargs
    return dims


def _h_matmul_op(a):
    return a @ a  # <- matmul-op


def _h_chained_in(a):
    return 1 in a.shape in (a.shape,)  # <- chained-in


def _h_dict_literal_key(a):
    return {a.shape[0]: a}  # <- dict-literal-key


def _h_for_target(a):
    total = 0
    for i, d in ((0, a.shape[0]),):  # <- for-target
        total = total + i + d
    return total


def _h_loop_else(a):
    for d in a.shape:
        if d == 0:
            break
    else:
        return 1  # <- loop-else
    return 0


class _Holder(nl.NKIObject):
    def __init__(self):
        self.x = 0
        self.y = 0


def _h_assign_target(a):
    h = _Holder()
    h.x, h.y = a.shape[0], a.shape[1]  # <- assign-target
    return h


@functools.lru_cache(maxsize=None)  # <- decorator
def _h_decorator(n):
    return n


def _h_int_range(a):
    return a.shape[0] + 4294967296  # <- int-range


def _h_minmax_args(a):
    return min(a.shape[0], a.shape[1], 8)  # <- minmax-args


class _NotNki:  # <- class-base
    def __init__(self, n):
        self.n = n


def _h_class_base(a):
    return _NotNki(a.shape[0])


class _BodyStmt(nl.NKIObject):
    x = 1
    if x > 0:  # <- class-body
        y = 2


def _h_class_body(a):
    return _BodyStmt()


class _Meta(type):
    pass


class _WithKeywords(nl.NKIObject, metaclass=_Meta):  # <- class-keywords
    pass


def _h_class_keywords(a):
    return _WithKeywords()


_NP_DTYPES = (np.float32, np.float16)  # a value the compiler converts (a bare class would just not be gathered)


def _h_numpy_dtype(a):
    return _NP_DTYPES[0]  # <- numpy-dtype


def _h_isinstance_tuple(a):
    return isinstance(a.shape[0], (int, float))  # <- isinstance-tuple


async def _h_async(a):  # <- async
    return a


# One module-level kernel per gathering rule.
@nki.jit
def bad_raise(a):
    if a.shape[0] < 0:
        _h_raise(a)
    return copy_out(a)


@nki.jit
def bad_try(a):
    if a.shape[0] < 0:
        _h_try(a)
    return copy_out(a)


@nki.jit
def bad_with(a):
    if a.shape[0] < 0:
        _h_with(a)
    return copy_out(a)


@nki.jit
def bad_del(a):
    if a.shape[0] < 0:
        _h_del(a)
    return copy_out(a)


@nki.jit
def bad_import(a):
    if a.shape[0] < 0:
        _h_import(a)
    return copy_out(a)


@nki.jit
def bad_global(a):
    if a.shape[0] < 0:
        _h_global(a)
    return copy_out(a)


@nki.jit
def bad_match(a):
    if a.shape[0] < 0:
        _h_match(a)
    return copy_out(a)


@nki.jit
def bad_async(a):
    if a.shape[0] < 0:
        _h_async(a)
    return copy_out(a)


@nki.jit
def bad_inner_def(a):
    if a.shape[0] < 0:
        _h_inner_def(a)
    return copy_out(a)


@nki.jit
def bad_inner_class(a):
    if a.shape[0] < 0:
        _h_inner_class(a)
    return copy_out(a)


@nki.jit
def bad_lambda(a):
    if a.shape[0] < 0:
        _h_lambda(a)
    return copy_out(a)


@nki.jit
def bad_comprehension(a):
    if a.shape[0] < 0:
        _h_comprehension(a)
    return copy_out(a)


@nki.jit
def bad_generator(a):
    if a.shape[0] < 0:
        _h_generator(a)
    return copy_out(a)


@nki.jit
def bad_set(a):
    if a.shape[0] < 0:
        _h_set(a)
    return copy_out(a)


@nki.jit
def bad_walrus(a):
    if a.shape[0] < 0:
        _h_walrus(a)
    return copy_out(a)


@nki.jit
def bad_yield(a):
    if a.shape[0] < 0:
        _h_yield(a)
    return copy_out(a)


@nki.jit
def bad_format_spec(a):
    if a.shape[0] < 0:
        _h_format_spec(a)
    return copy_out(a)


@nki.jit
def bad_starred(a):
    if a.shape[0] < 0:
        _h_starred(a)
    return copy_out(a)


@nki.jit
def bad_kwargs_expansion(a):
    if a.shape[0] < 0:
        _h_kwargs_expansion(a)
    return copy_out(a)


@nki.jit
def bad_varargs(a):
    if a.shape[0] < 0:
        _h_varargs(a)
    return copy_out(a)


@nki.jit
def bad_matmul_op(a):
    if a.shape[0] < 0:
        _h_matmul_op(a)
    return copy_out(a)


@nki.jit
def bad_chained_in(a):
    if a.shape[0] < 0:
        _h_chained_in(a)
    return copy_out(a)


@nki.jit
def bad_dict_literal_key(a):
    if a.shape[0] < 0:
        _h_dict_literal_key(a)
    return copy_out(a)


@nki.jit
def bad_for_target(a):
    if a.shape[0] < 0:
        _h_for_target(a)
    return copy_out(a)


@nki.jit
def bad_loop_else(a):
    if a.shape[0] < 0:
        _h_loop_else(a)
    return copy_out(a)


@nki.jit
def bad_assign_target(a):
    if a.shape[0] < 0:
        _h_assign_target(a)
    return copy_out(a)


@nki.jit
def bad_decorator(a):
    if a.shape[0] < 0:
        _h_decorator(a)
    return copy_out(a)


@nki.jit
def bad_int_range(a):
    if a.shape[0] < 0:
        _h_int_range(a)
    return copy_out(a)


@nki.jit
def bad_minmax_args(a):
    if a.shape[0] < 0:
        _h_minmax_args(a)
    return copy_out(a)


@nki.jit
def bad_class_base(a):
    if a.shape[0] < 0:
        _h_class_base(a)
    return copy_out(a)


@nki.jit
def bad_class_body(a):
    if a.shape[0] < 0:
        _h_class_body(a)
    return copy_out(a)


@nki.jit
def bad_class_keywords(a):
    if a.shape[0] < 0:
        _h_class_keywords(a)
    return copy_out(a)


@nki.jit
def bad_numpy_dtype(a):
    if a.shape[0] < 0:
        _h_numpy_dtype(a)
    return copy_out(a)


@nki.jit
def bad_isinstance_tuple(a):
    if a.shape[0] < 0:
        _h_isinstance_tuple(a)
    return copy_out(a)


# Values the frontend converts: a module global reached only from an untaken branch.
BIG_GLOBAL = 1 << 40
INT_KEYED = {0: "zero"}


def _h_big_global(a):
    return BIG_GLOBAL  # <- int-range


def _h_int_keyed_global(a):
    return INT_KEYED["0"]  # <- dict-key


@nki.jit
def bad_global_int_range(a):
    if a.shape[0] < 0:
        _h_big_global(a)
    return copy_out(a)


@nki.jit
def bad_global_dict_key(a):
    if a.shape[0] < 0:
        _h_int_keyed_global(a)
    return copy_out(a)


# A default argument is an expression of the enclosing scope: gather.c follows its references.
def _h_default(a, fallback=_h_raise):  # <- raise (through the default)
    return a


@nki.jit
def bad_default_argument(a):
    if a.shape[0] < 0:
        _h_default(a)
    return copy_out(a)


def _h_is_operator(a):
    return a.shape is a.shape  # <- is-operator


@nki.jit
def bad_is_operator(a):
    if a.shape[0] < 0:
        _h_is_operator(a)
    return copy_out(a)


class _Members(nl.NKIObject):
    """Members behind property, cached_property and staticmethod are gathered like plain methods."""

    n: int = 1

    @property  # <- decorator
    def size(self):
        raise ValueError("never raised")  # <- raise

    @functools.cached_property  # <- decorator
    def sizes(self):
        return [d for d in range(self.n)]  # <- comprehension

    @staticmethod
    def helper(x):
        return (x := 1)  # <- walrus


@nki.jit
def bad_members(a):
    if a.shape[0] < 0:
        _Members(n=2)
    return copy_out(a)


# ------------------------------------------------------------------------------------------- tracing rules
def _t_slice(a):
    pairs = [0, 1, 2]
    return pairs[1:1 + 4]  # <- slice-range


def _t_isinstance(a):
    kinds = (int, float)
    return isinstance(a.shape[0], kinds)  # <- isinstance-tuple


def _t_dict_key(a):
    d = dict()
    d[a.shape[0]] = a  # <- dict-key
    return d


def _t_dict_read(a):
    d = {"x": 1}
    return d[0]  # <- dict-key


@nki.jit
def traced_slice(a, run):
    if run:
        _t_slice(a)
    return copy_out(a)


@nki.jit
def traced_isinstance(a, run):
    if run:
        _t_isinstance(a)
    return copy_out(a)


@nki.jit
def traced_dict_key(a, run):
    if run:
        _t_dict_key(a)
    return copy_out(a)


@nki.jit
def traced_dict_read(a, run):
    if run:
        _t_dict_read(a)
    return copy_out(a)


# Each _tr_* helper runs one construct KLR's tracer refuses when it evaluates it (marked with its rule); traced_case
# runs the helper it is given only when asked, so the same code in a branch never taken is accepted.
def _tr_enumerate(a):
    return enumerate(a.shape)  # <- builtin


def _tr_zip(a):
    return zip(a.shape, a.shape)  # <- builtin


def _tr_sum(a):
    return sum(a.shape)  # <- builtin


def _tr_sorted(a):
    return sorted(a.shape)  # <- builtin


def _tr_any(a):
    return any(a.shape)  # <- builtin


def _tr_round(a):
    return round(a.shape[0] / 3)  # <- builtin


def _tr_getattr(a):
    return getattr(a, "shape")  # <- builtin


def _tr_range_value(a):
    return list(range(a.shape[0]))  # <- builtin


def _tr_dict_kwargs(a):
    return dict(rows=a.shape[0])  # <- builtin-args


def _tr_len_str(a):
    return len("rows")  # <- builtin-args


def _tr_list_of_dict(a):
    return list({"rows": 1})  # <- builtin-args


def _tr_min_none(a):
    return min(a.shape[0], None)  # <- builtin-args


def _tr_divmod_float(a):
    return divmod(a.shape[0] / 2, 2)  # <- builtin-args


def _tr_math_exp(a):
    return math.exp(1.0)  # <- math


def _tr_math_log(a):
    return math.log(a.shape[0])  # <- math


def _tr_math_prod(a):
    return math.prod(a.shape)  # <- math


def _tr_list_insert(a):
    lst = [1, 2]
    lst.insert(0, 3)  # <- method
    return lst


def _tr_list_sort(a):
    lst = [2, 1]
    lst.sort()  # <- method
    return lst


def _tr_list_count(a):
    lst = [2, 1]
    return lst.count(2)  # <- method


def _tr_list_pop_index(a):
    lst = [2, 1]
    return lst.pop(0)  # <- method


def _tr_list_remove_twice(a):
    lst = [1, 2, 1]
    lst.remove(1)  # <- method
    return lst


def _tr_dict_update(a):
    d = {"a": 1}
    d.update({"b": 2})  # <- method
    return d


def _tr_str_method(a):
    return "a,b".split(",")  # <- method


def _tr_tuple_method(a):
    return a.shape.index(16)  # <- method


def _tr_int_method(a):
    n = a.shape[0]
    return n.bit_length()  # <- method


def _tr_float_method(a):
    x = a.shape[0] / 2
    return x.is_integer()  # <- method


def _tr_float_mod(a):
    return (a.shape[0] / 3) % 2  # <- operator


def _tr_float_aug_mod(a):
    x = a.shape[0] / 3
    x %= 2  # <- operator
    return x


def _tr_bool_add(a):
    return (a.shape[0] > 1) + (a.shape[1] > 1)  # <- operator


def _tr_str_repeat(a):
    return "ab" * a.shape[0]  # <- operator


def _tr_str_format(a):
    return "%d rows" % a.shape[0]  # <- operator


def _tr_negative_power(a):
    return a.shape[0] ** -1  # <- operator


def _tr_in_dict(a):
    return "a" in {"a": 1}  # <- operator


def _tr_tensor_add(a):
    return a + a  # <- operator


def _tr_str_subscript(a):
    return "rows"[0]  # <- subscript


def _tr_negative_store(a):
    lst = [1, 2]
    lst[-1] = a.shape[0]  # <- subscript
    return lst


def _tr_slice_store(a):
    lst = [1, 2]
    lst[0:1] = [a.shape[0]]  # <- subscript
    return lst


def _tr_dict_get_int(a):
    d = {"a": 1}
    return d.get(a.shape[0])  # <- dict-key


@nki.jit
def traced_case(a, helper, run):
    """Runs ``helper(a)`` only when ``run`` is true (the tracer sees only what runs)."""
    if run:
        helper(a)
    return copy_out(a)


def _ok_everything(a):
    """Every form of the builtins, methods, operators and subscripts the tracer accepts; returns a number."""
    rows, cols = a.shape
    (p, q), r = (rows, cols), 3                            # nested unpacking (KLR NKI/Patterns.lean)
    lst = list((1, 2, 3))                                  # list / tuple of a tuple / list
    tup = tuple(lst) + (4,)                                # tuple + tuple
    lst = lst + [5] * 2                                    # list + list, list * int: [1, 2, 3, 5, 5]
    cp = lst.copy()
    cp.clear()
    lst.extend(tup)
    i = lst.index(5)
    lst.remove(4)                                          # present once
    lst.reverse()
    last = lst.pop()                                       # 1
    d = dict([("a", 1), ("b", 2)])                         # dict from pairs
    d2 = dict()
    d2["c"] = d.get("a") + d.setdefault("z", 3) + d.pop("b")  # 1 + 3 + 2
    d3 = d2.copy()
    n = len(d) + len(lst) + len(tup) + len(d3.keys())
    keys = list(d.keys())
    for k in keys:
        n = n + (1 if k in ("a", "z") else 0)               # 'in' on a tuple
    for kv in d.items():
        n = n + kv[1]
    assert "ow" in "rows" and 2 in [1, 2] and 7 not in tup
    n = n + abs(-2) + divmod(7, 2)[0] + max([1, 4]) + min(p, q) // 8 + q % 5
    x = float(r) / 2 + 2 ** 3 + 2.0 ** -1 + 7 // 2 + 7.5 // 2 - (1 << 2) + (6 >> 1) + (6 & 3) + (6 | 1) + (6 ^ 2)
    x = x + (True + 1) + int(2.9) + math.ceil(1.2) + math.floor(1.8) + math.gcd(4, 6) + math.log2(8.0)
    x = x + math.log10(100.0) + math.pow(2.0, 2.0) + math.sqrt(4.0) + int(math.pi > 3) + int(math.e > 2)
    x = x + int(math.inf > 0) + int(math.nan != math.nan) - 0.5
    s = str(n) + "!"
    assert isinstance(s, str) and type(n) == int and s == str(n) + "!"
    lst[0] = 9                                             # non-negative index assignment
    sl = slice(0, 2)
    part = lst[sl]
    print("checked", part)
    return n + x + int(bool(lst)) + last + i


@nki.jit
def traced_ok(a, run):
    """Runs _ok_everything (traced) and scales by its result."""
    v = 1.0
    if run:
        v = _ok_everything(a)
    return copy_out(a, v)


@nki.jit
def traced_slice_lnc(a):
    """Core 1 slices past the end (the error is raised in its thread and re-raised by the launch)."""
    pairs = [0, 1, 2]
    n = 3 if nl.program_id(0) == 0 else 4
    pairs = pairs[0:n]  # <- slice-range
    return copy_out(a, float(len(pairs)))


# ------------------------------------------------------------------------------------------- launch rules
MODE = "a"


@nki.jit
def reads_global(a):
    """Reads the module global MODE (the tests change it between calls)."""
    if MODE == "a":
        return copy_out(a, 2.0)
    return copy_out(a, 3.0)


@nki.jit
def takes_value(a, value):
    """Any value as an argument (the frontend converts it like the compiler does)."""
    if a.shape[0] < 0:
        return value
    return copy_out(a)


class HostOnly:
    """A plain Python class (not an NKIObject): its instances are not NKI values."""

    def __init__(self):
        self.n = 1


def make_counter():
    """A closure: only a function nested in another can say 'nonlocal', so this rule is met through a function
    passed as an argument (gathered like a referenced one)."""
    n = 0

    def bump(a):
        nonlocal n  # <- nonlocal
        n = n + 1
        return a
    return bump


@nki.jit
def calls_argument(a, fn):
    """Calls the function it is given (NKI inlines functions passed as arguments)."""
    if a.shape[0] < 0:
        fn(a)
    return copy_out(a)


# ------------------------------------------------------------------------------------------- accepted constructs
class Mode(enum.Enum):
    DOUBLE = 2
    TRIPLE = 3


@dataclasses.dataclass
class Plan(nl.NKIObject):
    """A dataclass-style NKI class: fields with defaults, the compiler's initializer."""
    factor: float = 1.0
    label: str = "plan"


class Counter(nl.NKIObject):
    """An NKI class with its own __init__ and methods."""

    def __init__(self, start):
        self.value = start
        self.steps = []

    def add(self, n):
        self.value = self.value + n
        self.steps.append(n)
        return self.value

    @staticmethod
    def twice(n):
        return 2 * n


def _scale_by(x, factor):
    return x * factor


def _apply(fn, x, factor=2):
    """Calls a function passed as an argument (inlined by NKI at trace time)."""
    return fn(x, factor)


@nki.jit
def good_kernel(a, mode=Mode.DOUBLE, combine=_scale_by):
    """Every construct the frontend accepts; returns a * 42 (each construct contributes to the factor)."""
    rows, cols = a.shape                                   # tuple unpacking
    assert rows > 0, f"rows={rows!r} must be positive"    # assert with an f-string (and !r)
    n = 0
    while n < 3:                                           # while
        n += 1
    d = {"two": 2, "three": 3}                             # dict literal, string keys
    d["one"] = 1                                           # string-key store
    e = dict([("seven", 7)])                               # dict from (key, value) pairs
    e.setdefault("eight", 8)
    total = d.get("two") + d["three"] + e.pop("seven")     # 2 + 3 + 7 = 12
    keys = d.keys()
    vals = d.values()
    for k in keys:                                         # loop over a list
        total = total + (1 if k == "one" else 0)           # conditional expression: 13
    assert len(vals) == 3
    lst = [1, 2]
    lst.append(3)                                          # list methods
    lst.extend((4, 5))
    lst.remove(5)
    lst.reverse()                                          # [4, 3, 2, 1]
    last = lst.pop()                                       # 1
    first = lst[0]                                         # 4
    part = lst[1:3]                                        # in-range slice: [3, 2]
    total = total + last + first + len(part) + lst[-1] - 1  # 13 + 1 + 4 + 2 + 2 - 1 = 21
    plan = Plan(factor=2.0)                                # @dataclass NKIObject
    c = Counter(0)                                         # NKIObject with __init__
    c.add(1)
    c.add(Counter.twice(1))                                # static method: 1 + 2 = 3
    if mode == Mode.DOUBLE and c.value == 3 and plan.label == "plan":   # enum compare, chained logic
        total = _apply(combine, total, int(plan.factor))   # function passed as an argument: 42
    for i in range(0, 4, 2):                               # range with a step, continue / break
        if i == 0:
            continue
        break
    label = "x" + str(total)                               # string concatenation and str()
    assert label == "x42" and total is not None, label
    assert isinstance(total, int) and 1 in (1, 2)          # single-type isinstance, 'in' on a tuple
    scale = min(float(total), 100.0) * max(1, 1) + math.sqrt(0.0)
    with nl.no_reorder():                                  # the one 'with' NKI accepts
        out = copy_out(a, scale)
    return out
