"""The NKI compiler's frontend rules, checked before (and while) a kernel runs on the simulator.

The simulator runs kernel code as Python, so on its own it accepts kernels the NKI compiler refuses. The real
frontend is public (KLR: ``interop/klr/gather.c`` collects the code, ``KLR/NKI/Simplify.lean`` and
``KLR/NKI/Annotations.lean`` turn it into NKI, ``KLR/Trace/*.lean`` evaluates it); this module mirrors it in
three stages, each raising ``NkiFrontendError`` (an ``NkiValidationError``) that names the file and line, the
construct, and what to write instead:

1. **Gathering** (once per kernel function, cached): starting at the kernel, every function, class (with all its
   methods), default argument and module global the code references is collected, transitively, the way
   ``gather.c`` does it: a name is looked up in the function's module globals and builtins, attribute chains
   are followed, ``@nki.jit`` wrappers are unwrapped, decorators and base classes are not followed, and code in
   branches that never run is gathered too. The NKI API itself (this simulator's ``nki``/``nl``/``nisa``, a real
   ``nki``), numpy, ``enum`` and ``typing`` are left out. Every gathered definition is checked for the statements
   and expressions the frontend refuses (``RULES``), and every gathered global value for the values it cannot
   convert (integers outside 32 bits, dicts with non-string keys, objects of classes not deriving from
   ``NKIObject``).
2. **Launch** (every call): the argument values get the same value checks (functions passed as arguments are
   gathered like referenced ones), and every gathered module global is compared with its value at the kernel's
   first launch: NKI caches compiled kernels by their arguments, so a kernel that reads a global whose value
   changed would run stale code (language guide, "Kernel Caching").
3. **Tracing** (while the kernel runs): for the duration of a launch each gathered function runs an instrumented
   copy of its own code (same file, same line numbers) that checks what only the running values decide:
   out-of-range list/tuple slices, ``isinstance`` with a tuple of types, non-string dict keys in subscripts.

``mode()`` reads the switch: env ``NKI_ATTN_SIM_FRONTEND`` (``1``/``on``/``full``, the default: all three stages;
``gather``: stages 1 and 2 only; ``0``/``off``: none) or ``checking(frontend=...)``. docs/simulator.md, "Frontend
checks", lists every rule with its source and what is not checked.
"""
import __future__
import ast
import builtins
import inspect
import linecache
import math
import operator
import os
import sys
import textwrap
import threading
import types
import weakref

from .context import frontend_mode
from .errors import NkiValidationError

INT32_MIN, INT32_MAX = -(1 << 31), (1 << 31) - 1


class NkiFrontendError(NkiValidationError):
    """Kernel code the NKI compiler's frontend refuses. ``problems`` lists each finding as a ``Problem``."""

    def __init__(self, message, problems=()):
        super().__init__(message)
        self.problems = list(problems)


# ----------------------------------------------------------------------------------------------------- rules
# rule id -> (construct, stage, source, what the frontend says / what to do instead). The gathering rules quote
# the frontend's own message where it has one; docs/simulator.md renders this table.
GUIDE = "NKI language guide"
RULES = {
    "raise": ("'raise' statement", "gather", "KLR gather.c",
              "NKI does not support 'raise' statements. Use 'if/else' control flow within kernels, or 'assert' for "
              "fatal errors."),
    "try": ("'try' statement", "gather", "KLR gather.c",
            "NKI does not support 'try' statements. Use 'if/else' control flow within kernels."),
    "with": ("'with' statement", "gather", "KLR Simplify.lean, Annotations.lean",
             "NKI supports 'with' only as 'with nl.no_reorder():' (one call, no arguments, no 'as'); remove it."),
    "del": ("'del' statement", "gather", "KLR gather.c",
            "NKI does not support 'del' statements at this time. Rebind the name or leave the value unused."),
    "import": ("'import' inside a function", "gather", "KLR gather.c",
               "NKI does not support 'import' statements within a function. Move 'import' outside this function."),
    "global": ("'global' statement", "gather", "KLR gather.c",
               "NKI does not support 'global' statements. Kernels cannot assign to global variables. Pass a dict "
               "between functions to share state."),
    "nonlocal": ("'nonlocal' statement", "gather", "KLR gather.c",
                 "NKI does not support 'nonlocal' statements. Kernels cannot assign to variables in nonlocal "
                 "scope. Pass a dict between functions to share state."),
    "match": ("'match' statement", "gather", "KLR gather.c",
              "NKI does not support 'match' statements at this time. Use 'if/elif' or dict lookups instead."),
    "async": ("'async' code", "gather", "KLR gather.c",
              "NKI does not support 'async'. Use only synchronous functions within kernels."),
    "inner-def": ("function defined inside a function", "gather", "KLR gather.c",
                  "NKI does not support inner function definitions. Move function definition outside this "
                  "function."),
    "inner-class": ("class defined inside a function", "gather", "KLR gather.c",
                    "NKI does not support 'class' definitions within a function. Move class definition outside "
                    "this function."),
    "lambda": ("lambda", "gather, launch", "KLR gather.c",
               "unsupported expression: NKI has no lambda. Define a module-level function and pass it by name."),
    "comprehension": ("comprehension", "gather", "KLR gather.c",
                      "unsupported expression: NKI has no list/dict/set comprehensions. Build the container with a "
                      "for loop (list.append, d[key] = value)."),
    "generator": ("generator expression", "gather", "KLR gather.c",
                  "unsupported expression: NKI has no generators. Use a for loop, or tuple(...) / list(...) of an "
                  "existing sequence."),
    "set": ("set literal", "gather", "KLR gather.c",
            "unsupported expression: NKI has no sets. Use a list or tuple and the 'in' operator."),
    "walrus": ("assignment expression (:=)", "gather", "KLR gather.c",
               "unsupported expression: NKI has no ':='. Assign in a separate statement."),
    "yield": ("yield / await", "gather", "KLR gather.c",
              "unsupported expression: kernel functions cannot be generators or coroutines. Return a list."),
    "format-spec": ("f-string format specifier", "gather", "KLR gather.c",
                    "NKI does not support format specifiers in f-strings. Write f'{x}' (optionally !r / !s) "
                    "without ':spec'."),
    "starred": ("star expansion (*x)", "gather", "KLR Simplify.lean",
                "tuple expansion is not supported in NKI. Pass or unpack the elements explicitly."),
    "kwargs-expansion": ("keyword expansion (**x)", "gather", "KLR Simplify.lean",
                         "keyword expansion is not supported in NKI. Pass the keyword arguments explicitly."),
    "varargs": ("*args parameter", "gather", "KLR Simplify.lean",
                "varargs are not supported in NKI. Give every parameter a name."),
    "matmul-op": ("'@' operator", "gather", "KLR Simplify.lean",
                  "the matmul operator is not supported in NKI. Use nisa.nc_matmul."),
    "chained-in": ("'in' in a chained comparison", "gather", "KLR Simplify.lean",
                   "the 'in' operator is not supported in NKI inside a chained comparison. Split the comparison."),
    "dict-literal-key": ("dict literal key that is not a string constant", "gather", f"{GUIDE}, NKI Values; "
                         "KLR Simplify.lean",
                         "NKI dictionaries have string keys, and a dict literal's keys must be string constants "
                         "('expecting string'). Write {'name': value} or d['name'] = value."),
    "for-target": ("for-loop target that is not a single name", "gather", "KLR Simplify.lean",
                   "NKI loops bind one name ('expecting simple variable'). Loop over the items and unpack them in "
                   "the body: 'for item in items: a, b = item'."),
    "loop-else": ("else clause of a for/while loop", "gather", "KLR Simplify.lean",
                  "for-orelse / while-orelse is not supported in NKI. Use a flag variable."),
    "assign-target": ("assignment target NKI cannot bind", "gather", "KLR Simplify.lean",
                      "NKI unpacks tuples only into plain names, and a statement may mutate only one target "
                      "('expecting simple variable'). Assign attributes and items in separate statements."),
    "decorator": ("decorator", "gather", "KLR Simplify.lean",
                  "unsupported decorator: NKI accepts only @nki.jit, @staticmethod and @dataclass on the code it "
                  "compiles. Call the helper explicitly instead."),
    "int-range": ("integer outside 32 bits", "gather, launch", f"{GUIDE}, NKI Values; KLR gather.c",
                  "NKI integers are 32-bit ('integer value is too large/small'). Keep compile-time integers in "
                  "[-2**31, 2**31 - 1]; use a float for larger magnitudes."),
    "class-base": ("class not deriving from NKIObject", "gather, launch", f"{GUIDE}, Class Support; KLR gather.c",
                   "NKI classes must inherit from either Enum or NKIObject (and nothing else)."),
    "class-body": ("class body statement", "gather", "KLR gather.c",
                   "NKI class bodies hold only a docstring, field assignments (one name each) and methods."),
    "class-keywords": ("class keywords / type parameters", "gather", "KLR gather.c",
                       "class keywords are not supported in NKI."),
    "minmax-args": ("min/max call NKI cannot evaluate", "gather", "KLR Trace/Python.lean",
                    "NKI's min and max take two numbers or one list/tuple (no third argument, no key=/default=). "
                    "Nest the calls: min(min(a, b), c)."),
    "numpy-dtype": ("numpy dtype value", "gather, launch", "KLR gather.c",
                    "numpy dtypes are not supported as arguments. Use the nki.language dtype (nl.float32, ...)."),
    "dict-key": ("dict with a non-string key", "gather, launch, traced",
                 f"{GUIDE}, NKI Values; KLR Trace/Term.lean, NKI.lean",
                 "NKI dictionaries have string keys only. Use str keys (e.g. f'{i}') or a list indexed by int."),
    "isinstance-tuple": ("isinstance with a tuple of types", "gather, traced", "KLR Trace/Python.lean",
                         "NKI's isinstance matches a single type (a tuple silently gives False). Write "
                         "isinstance(x, A) or isinstance(x, B)."),
    "slice-range": ("out-of-range list/tuple slice", "traced", "KLR Trace/Term.lean",
                    "NKI's tracer refuses list/tuple slices that run past either end ('slice index out of "
                    "bounds'); Python would clamp them. Clamp the bounds, e.g. x[i:min(i + n, len(x))]."),
    "is-operator": ("'is' other than against None", "gather", "KLR Simplify.lean",
                    "the 'is' operator is not supported in NKI, use == (the compiler only warns, then compares with "
                    "==, which is not Python's identity test). 'x is None' and 'x is not None' are fine."),
    "builtin": ("Python builtin the NKI tracer does not provide", "traced", "KLR Trace/Python.lean, Term.lean",
                "NKI's tracer provides only isinstance, type, slice, print, min, max, abs, str, bool, int, float, "
                "divmod, tuple, list, dict and len, and range as a for-loop header ('... not found'). Write the "
                "loop out, e.g. 'for i in range(len(xs)): x = xs[i]' for enumerate or zip."),
    "builtin-args": ("builtin call the NKI tracer cannot evaluate", "traced", "KLR Trace/Python.lean",
                     "NKI's builtins take fewer forms than Python's: dict() or dict(pairs), len of a list, tuple or "
                     "dict, list/tuple of a list or tuple, min/max/abs of ints and floats, divmod of ints."),
    "math": ("math name the NKI tracer does not provide", "traced", "KLR Trace/Python.lean",
             "NKI's math provides ceil, floor, gcd, log2, log10, pow, sqrt and the constants pi, e, inf and nan. "
             "Compute the others from these (e.g. math.log(x) as math.log2(x) / math.log2(math.e))."),
    "method": ("method or attribute NKI values do not have", "traced", "KLR Trace/Term.lean (Term.attr), Python.lean",
               "NKI lists have append, clear, copy, extend, index, pop (without an index), remove and reverse; dicts have "
               "clear, copy, get, items, keys, pop, setdefault and values; str, tuple, int, float and bool values "
               "have no methods or attributes. Use a builtin or a loop instead."),
    "operator": ("operator NKI's tracer does not evaluate", "traced", "KLR Trace/Term.lean (binop), Python.lean (in)",
                 "NKI evaluates +, -, *, /, //, ** on ints and floats (no % or bitwise operators on floats, no "
                 "arithmetic between two bools or a bool and a float), + on two strs, lists or tuples, list/tuple "
                 "* int, and 'in' on a list, tuple or str; never on tensors (use nki.isa)."),
    "subscript": ("subscript NKI's tracer does not evaluate", "traced", "KLR Trace/Term.lean (access), NKI.lean "
                  "(mutate)",
                  "NKI cannot subscript a str ('string subscript not implemented') and assigns list items only by "
                  "a non-negative index ('index out of range'): no slice or negative-index assignment."),
    "global-changed": ("module global changed between calls", "launch", f"{GUIDE}, Kernel Caching",
                       "NKI kernels must be pure functions of their arguments: compiled kernels are cached by "
                       "argument, so a changed global would run stale code. Pass the value as a kernel argument."),
}


class Problem:
    """One finding: ``rule`` (a ``RULES`` key), where (``file``, ``line``, ``scope``: the function or class) and
    ``detail`` (the offending code or value)."""

    __slots__ = ("rule", "file", "line", "scope", "detail", "via")

    def __init__(self, rule, file, line, scope, detail="", via=""):
        self.rule, self.file, self.line, self.scope, self.detail, self.via = rule, file, line, scope, detail, via

    def key(self):
        return (self.file, self.line, self.rule, self.detail)

    def format(self):
        construct, _, _, advice = RULES[self.rule]
        if self.file:
            where = f"{_short_path(self.file)}:{self.line}" if self.line else _short_path(self.file)
            scope = f" in {self.scope}" if self.scope else ""
        else:  # a value given at the call, not a place in the source
            where, scope = f"call of {self.scope}", ""
        what = f"{construct} `{self.detail}`" if self.detail else construct
        via = f" (reached via {self.via})" if self.via else ""
        return f"{where}: {what}{scope}{via}: {advice}"

    def __repr__(self):
        return f"Problem({self.format()!r})"


def _short_path(path):
    if not path:
        return "<unknown>"
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return path if rel.startswith("..") else rel


def _snippet(node, limit=60):
    try:
        s = ast.unparse(node)
    except Exception:  # noqa: BLE001 - a snippet is cosmetic
        return ""
    s = " ".join(s.split())
    return s if len(s) <= limit else s[:limit - 3] + "..."


# ----------------------------------------------------------------------------------------------------- modes
def mode():
    """``"full"``, ``"gather"`` or ``"off"``: the innermost ``checking(frontend=...)``, else env
    ``NKI_ATTN_SIM_FRONTEND`` (default full)."""
    return frontend_mode()


# ----------------------------------------------------------------------------------------------------- what is API
# The NKI API (the simulator itself, a real nki, the legacy neuronxcc) is built into the compiler, not gathered.
# numpy and enum are skipped by gather.c itself; typing objects only ever appear in annotations.
_SKIPPED = ("nki_attn.sim", "nki", "neuronxcc", "numpy", "enum", "typing", "builtins")


def _module_of(obj):
    if isinstance(obj, types.ModuleType):
        return obj.__name__
    if isinstance(obj, (types.FunctionType, type, types.BuiltinFunctionType, types.MethodType)):
        m = getattr(obj, "__module__", None)
    else:
        m = getattr(type(obj), "__module__", None)
        if m == "builtins":
            return ""  # values (ints, lists, ...) are judged by their content, not skipped
    return m if isinstance(m, str) else ""


def _skipped(obj):
    name = _module_of(obj)
    return any(name == p or name.startswith(p + ".") for p in _SKIPPED)


def _unwrap_kernel(obj):
    """``@nki.jit`` objects carry the kernel function as ``__wrapped__`` (gather.c follows it)."""
    if isinstance(obj, types.FunctionType):
        return obj
    try:
        inner = getattr(obj, "__wrapped__", None)
    except Exception:  # noqa: BLE001 - arbitrary objects
        return obj
    return inner if isinstance(inner, types.FunctionType) else obj


_TENSOR_TYPES = ("tensor", "ndarray", "Tensor", "FakeTensor", "ShapedArray", "NkiTensor")


def _is_tensor(v):
    return type(v).__name__ in _TENSOR_TYPES and hasattr(v, "shape") and hasattr(v, "dtype")


def _is_numpy_dtype(v):
    np = sys.modules.get("numpy")
    if np is None:
        return False
    if isinstance(v, type):
        return issubclass(v, np.generic)
    return isinstance(v, np.dtype)


# ----------------------------------------------------------------------------------------------------- sources
_FUTURE_MASK = 0  # the compile flags of `from __future__` imports, copied from the code being recompiled
for _name in __future__.all_feature_names:
    _FUTURE_MASK |= getattr(__future__, _name).compiler_flag
del _name


def _source(obj):
    """``(file, AST of the definition with its original line numbers, _Source)`` of a function or class, or None
    when it has no parseable source (builtins, C classes, lambdas): gather.c treats that as nothing to gather, not
    as an error."""
    try:
        file = inspect.getsourcefile(obj) or inspect.getfile(obj)
        lines, first = inspect.getsourcelines(obj)
    except (OSError, TypeError):
        return None
    text = textwrap.dedent("".join(lines))
    node = _parse_def(text, first)
    return None if node is None else (file, node, _Source(text, first))


class _Source:
    """The dedented source text of a definition and its first line: re-parsed for every compile (cheaper than
    copying an AST)."""

    __slots__ = ("text", "first")

    def __init__(self, text, first):
        self.text, self.first = text, first


def _parse_def(text, first):
    try:
        tree = ast.parse("\n" * (max(first, 1) - 1) + text)  # blank lines in front: the parser numbers the lines
    except SyntaxError:
        return None
    if len(tree.body) != 1 or not isinstance(tree.body[0], (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return None
    return tree.body[0]


class FunctionInfo:
    """A gathered function, for instrumenting: the object, where its AST comes from (``index``: its position in
    the class body for a method), its scope name, file and local names."""

    __slots__ = ("fn", "source", "index", "scope", "file", "locals")

    def __init__(self, fn, source, index, scope, file, local_names):
        self.fn, self.source, self.index, self.scope, self.file, self.locals = (fn, source, index, scope, file,
                                                                               local_names)

    def node(self):
        """A fresh FunctionDef of the function, with its original line numbers."""
        node = _parse_def(self.source.text, self.source.first)
        return node if self.index is None else node.body[self.index]


def _bound_names(fdef):
    """Names a function binds (its locals, by Python's scoping rule), without descending into nested scopes."""
    names = set()
    a = fdef.args
    for arg in a.posonlyargs + a.args + a.kwonlyargs + [x for x in (a.vararg, a.kwarg) if x is not None]:
        names.add(arg.arg)
    stack = list(fdef.body)
    while stack:
        n = stack.pop()
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(n.name)
            continue
        if isinstance(n, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            continue
        if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del)):
            names.add(n.id)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            for al in n.names:
                names.add((al.asname or al.name).split(".")[0])
        elif isinstance(n, ast.ExceptHandler) and n.name:
            names.add(n.name)
        elif isinstance(n, (ast.Global, ast.Nonlocal)):
            continue
        stack.extend(ast.iter_child_nodes(n))
    return names


# ----------------------------------------------------------------------------------------------------- definitions
class GlobalRef:
    """A module global (or an attribute chain rooted at one) that gathered code reads."""

    __slots__ = ("label", "root", "path", "file", "line")

    def __init__(self, label, root, path, file, line):
        self.label, self.root, self.path, self.file, self.line = label, root, path, file, line

    def key(self):
        return (id(self.root), self.path)

    def current(self):
        """The value now (``_MISSING`` when the name or an attribute no longer exists)."""
        v = self.root.get(self.path[0], _MISSING)
        for attr in self.path[1:]:
            if v is _MISSING:
                break
            try:
                v = getattr(v, attr)
            except Exception:  # noqa: BLE001 - any failure means the chain is gone
                v = _MISSING
        return v


_MISSING = object()


class Definition:
    """What gathering learnt from one function or class: its own problems, the functions and classes it
    references (to gather next), the globals it reads, and its functions with their AST (for instrumenting)."""

    def __init__(self, obj, name, file):
        self.obj = obj
        self.name = name
        self.file = file
        self.problems = []
        self.refs = []
        self.globals = []
        self.functions = []  # FunctionInfo of the function or of each method


_DEFS = weakref.WeakKeyDictionary()
_LOCK = threading.RLock()


def definition(obj):
    """The cached ``Definition`` of a function or class (None when it has no source)."""
    with _LOCK:
        try:
            d = _DEFS.get(obj)
        except TypeError:
            d = None
        if d is not None:
            return d
        src = _source(obj)
        if src is None:
            return None
        file, node, source = src
        d = Definition(obj, getattr(obj, "__qualname__", getattr(obj, "__name__", "?")), file)
        if isinstance(obj, type):
            _ClassScan(d, obj, node, source).run()
        elif isinstance(node, ast.AsyncFunctionDef):
            d.problems.append(Problem("async", file, node.lineno, d.name, f"async def {node.name}"))
        elif isinstance(node, ast.FunctionDef):
            _FunctionScan(d, obj, node, d.name, source, None).run()
        try:
            _DEFS[obj] = d
        except TypeError:
            pass
        return d


_REFUSED_STMT = {ast.Raise: "raise", ast.Try: "try", ast.Delete: "del", ast.Import: "import",
                 ast.ImportFrom: "import", ast.Global: "global", ast.Nonlocal: "nonlocal", ast.Match: "match",
                 ast.AsyncFunctionDef: "async", ast.AsyncFor: "async", ast.AsyncWith: "async",
                 ast.FunctionDef: "inner-def", ast.ClassDef: "inner-class"}
if hasattr(ast, "TryStar"):
    _REFUSED_STMT[ast.TryStar] = "try"
_REFUSED_EXPR = {ast.Lambda: "lambda", ast.ListComp: "comprehension", ast.SetComp: "comprehension",
                 ast.DictComp: "comprehension", ast.GeneratorExp: "generator", ast.Set: "set",
                 ast.NamedExpr: "walrus", ast.Await: "yield", ast.Yield: "yield", ast.YieldFrom: "yield"}
_DECORATORS = ("staticmethod", "dataclass", "jit")


def _allowed_decorator(dec, globals_, builtins_):
    """Simplify.lean accepts @nki.jit, @staticmethod and @dataclass (with or without a call), by name; a
    decorator imported under another name counts by the object it resolves to."""
    target = dec.func if isinstance(dec, ast.Call) else dec
    name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", None)
    if name in _DECORATORS:
        return True
    chain = []
    while isinstance(target, ast.Attribute):
        chain.append(target.attr)
        target = target.value
    if not isinstance(target, ast.Name):
        return False
    obj = globals_.get(target.id, builtins_.get(target.id))
    for attr in reversed(chain):
        obj = getattr(obj, attr, None)
    return getattr(obj, "__name__", None) in _DECORATORS and (_skipped(obj) or obj is staticmethod
                                                              or _module_of(obj) == "dataclasses")


class _Scan:
    """Shared by function and class scans: problems, references and value checks for one Definition."""

    def __init__(self, d, scope):
        self.d = d
        self.scope = scope
        self.file = d.file

    def problem(self, rule, node_or_line, detail=""):
        line = node_or_line if isinstance(node_or_line, int) else getattr(node_or_line, "lineno", 0)
        self.d.problems.append(Problem(rule, self.file, line, self.scope, detail))

    def ref(self, obj):
        """A function or class to gather (gather.c add_work)."""
        obj = _unwrap_kernel(obj)
        if _skipped(obj):
            return
        self.d.refs.append(obj)


def check_value(v, label, on_ref, depth=0, seen=None):
    """Problems ``(rule, detail)`` of a value converted by the frontend; calls ``on_ref(obj)`` for the functions
    and classes it carries (gathered like referenced code)."""
    out = []
    if seen is None:
        seen = set()
    _check_value(v, label, on_ref, depth, seen, out)
    return out


def _check_value(v, label, on_ref, depth, seen, out):
    if depth > 12 or v is None or isinstance(v, (bool, float, str, complex)) or v is Ellipsis:
        return
    if isinstance(v, int):
        if v > INT32_MAX or v < INT32_MIN:
            out.append(("int-range", f"{label} = {v}"))
        return
    if isinstance(v, types.ModuleType) or _is_tensor(v):
        return
    if id(v) in seen:
        return
    seen.add(id(v))
    if isinstance(v, (tuple, list)):
        for i, e in enumerate(v):
            _check_value(e, f"{label}[{i}]", on_ref, depth + 1, seen, out)
        return
    if isinstance(v, dict):
        for k, e in v.items():
            if not isinstance(k, str):
                out.append(("dict-key", f"{label} has key {k!r}"))
            _check_value(e, f"{label}[{k!r}]", on_ref, depth + 1, seen, out)
        return
    if _is_numpy_dtype(v):
        out.append(("numpy-dtype", f"{label} = {v!r}"))
        return
    if isinstance(v, types.FunctionType):
        if v.__name__ == "<lambda>":
            out.append(("lambda", f"{label} = <lambda> ({_short_path(v.__code__.co_filename)}:"
                                  f"{v.__code__.co_firstlineno})"))
        elif not _skipped(v):
            on_ref(v)
        return
    if isinstance(v, type) or _skipped(v):
        return
    enum = sys.modules.get("enum")
    if enum is not None and isinstance(v, enum.Enum):
        on_ref(type(v))
        _check_value(v.value, f"{label}.value", on_ref, depth + 1, seen, out)
        return
    fields = getattr(v, "__dict__", None)
    if isinstance(fields, dict):
        on_ref(type(v))
        for k, e in fields.items():
            _check_value(e, f"{label}.{k}", on_ref, depth + 1, seen, out)


class _FunctionScan(_Scan):
    """gather.c ``function_`` plus the Simplify/Annotations rules, over one function's AST."""

    def __init__(self, d, fn, node, scope, source, index):
        super().__init__(d, scope)
        self.fn = fn
        self.node = node
        self.source, self.body_index = source, index
        self.globals = getattr(fn, "__globals__", {})
        b = getattr(fn, "__builtins__", builtins.__dict__)
        self.builtins = b if isinstance(b, dict) else vars(b)
        self.locals = _bound_names(node)

    def run(self):
        node = self.node
        if isinstance(self.fn, types.FunctionType):
            self.d.functions.append(FunctionInfo(self.fn, self.source, self.body_index, self.scope, self.file, self.locals))
        for dec in node.decorator_list:
            self.decorator(dec)
        a = node.args
        if a.vararg is not None:
            self.problem("varargs", node, f"*{a.vararg.arg}")
        for e in a.defaults + [e for e in a.kw_defaults if e is not None]:
            self.expr(e)  # gather.c evaluates defaults in the enclosing scope, references followed
        for s in node.body:
            self.stmt(s)

    def decorator(self, dec):
        if not _allowed_decorator(dec, self.globals, self.builtins):
            self.problem("decorator", dec, f"@{_snippet(dec)}")

    # -- statements
    def stmt(self, s):
        rule = _REFUSED_STMT.get(type(s))
        if rule is not None:
            detail = {ast.FunctionDef: "def ", ast.ClassDef: "class "}.get(type(s), "")
            self.problem(rule, s, detail + s.name if detail else _snippet(s, 40).split("\n")[0])
            return
        if isinstance(s, ast.With):
            self.with_(s)
        elif isinstance(s, (ast.For, ast.While)):
            if s.orelse:
                self.problem("loop-else", s.orelse[0], f"{'for' if isinstance(s, ast.For) else 'while'} ... else")
            if isinstance(s, ast.For):
                if not isinstance(s.target, ast.Name):
                    self.problem("for-target", s, f"for {_snippet(s.target)} in ...")
                self.expr(s.iter)
                self.expr(s.target)
            else:
                self.expr(s.test)
            for b in s.body:
                self.stmt(b)
            return
        elif isinstance(s, ast.Assign):
            self.assign(s)
        for child in ast.iter_child_nodes(s):
            if isinstance(child, ast.stmt):
                self.stmt(child)
            elif isinstance(child, ast.expr):
                self.expr(child)

    def with_(self, s):
        ok = len(s.items) == 1
        if ok:
            item = s.items[0]
            call = item.context_expr
            ok = (item.optional_vars is None and isinstance(call, ast.Call) and not call.args
                  and not call.keywords and isinstance(call.func, (ast.Name, ast.Attribute))
                  and (call.func.attr if isinstance(call.func, ast.Attribute) else call.func.id) == "no_reorder")
        if not ok:
            self.problem("with", s, "with " + ", ".join(_snippet(i) for i in s.items))

    def assign(self, s):
        def simple_pattern(t):
            if isinstance(t, ast.Name):
                return True
            return isinstance(t, (ast.Tuple, ast.List)) and all(simple_pattern(e) for e in t.elts)

        mutating = [t for t in s.targets if not isinstance(t, (ast.Name, ast.Tuple, ast.List))]
        for t in s.targets:
            if isinstance(t, (ast.Tuple, ast.List)) and not simple_pattern(t) and not _has_starred(t):
                self.problem("assign-target", t, f"{_snippet(t)} = ...")
        if len(mutating) > 1:
            self.problem("assign-target", s, _snippet(s))

    # -- expressions
    def expr(self, e):
        rule = _REFUSED_EXPR.get(type(e))
        if rule is not None:
            self.problem(rule, e, _snippet(e))
            return
        t = type(e)
        if t is ast.Name:
            if isinstance(e.ctx, ast.Load) and e.id not in self.locals:
                self.reference(e)
            return
        if t is ast.Attribute:
            if isinstance(e.ctx, ast.Load) and self.reference(e):
                return
            self.expr(e.value)
            return
        if t is ast.Constant:
            v = e.value
            if isinstance(v, int) and not isinstance(v, bool) and (v > INT32_MAX or v < INT32_MIN):
                self.problem("int-range", e, repr(v))
            return
        if t is ast.JoinedStr:
            for part in e.values:
                if isinstance(part, ast.FormattedValue):
                    if part.format_spec is not None:
                        self.problem("format-spec", part, "{" + _snippet(part.value) + ":"
                                     + _snippet(part.format_spec)[2:-1] + "}")
                        continue
                    self.expr(part.value)
            return
        if t is ast.Dict:
            for k in e.keys:
                if k is None:
                    self.problem("kwargs-expansion", e, "{**...}")
                elif not (isinstance(k, ast.Constant) and isinstance(k.value, str)):
                    self.problem("dict-literal-key", k, _snippet(k))
        elif t is ast.Compare:
            if len(e.ops) > 1 and any(isinstance(o, (ast.In, ast.NotIn)) for o in e.ops):
                self.problem("chained-in", e, _snippet(e))
            if any(isinstance(o, (ast.Is, ast.IsNot)) for o in e.ops) and not (
                    len(e.ops) == 1 and isinstance(e.comparators[0], ast.Constant)
                    and e.comparators[0].value is None):
                self.problem("is-operator", e, _snippet(e))
        elif t is ast.BinOp:
            if isinstance(e.op, ast.MatMult):
                self.problem("matmul-op", e, _snippet(e))
        elif t is ast.Starred:
            self.problem("starred", e, _snippet(e))
            return
        elif t is ast.Call:
            for kw in e.keywords:
                if kw.arg is None:
                    self.problem("kwargs-expansion", kw.value, "**" + _snippet(kw.value))
            if isinstance(e.func, ast.Name) and e.func.id in ("min", "max") and self.is_builtin(e.func.id) \
                    and (len(e.args) not in (1, 2) or e.keywords):
                self.problem("minmax-args", e, _snippet(e))
            if (isinstance(e.func, ast.Name) and e.func.id == "isinstance" and len(e.args) == 2
                    and self.is_builtin("isinstance")):
                types_ = e.args[1]
                if isinstance(types_, ast.Tuple):
                    self.problem("isinstance-tuple", e, _snippet(e))
                elif isinstance(types_, ast.Name) and types_.id not in self.locals \
                        and isinstance(self.globals.get(types_.id), tuple):
                    self.problem("isinstance-tuple", e, f"{_snippet(e)} with {types_.id} = "
                                                        f"{_snippet_value(self.globals[types_.id])}")
        elif t is ast.Subscript:
            self.expr(e.value)
            self.index(e.slice)
            return
        for child in ast.iter_child_nodes(e):
            if isinstance(child, ast.expr):
                self.expr(child)
            elif isinstance(child, ast.keyword):
                self.expr(child.value)

    def index(self, s):
        if isinstance(s, ast.Slice):
            for part in (s.lower, s.upper, s.step):
                if part is not None:
                    self.expr(part)
        elif isinstance(s, ast.Tuple):
            for part in s.elts:
                self.index(part)
        else:
            self.expr(s)

    def is_builtin(self, name):
        return name not in self.locals and name not in self.globals and name in self.builtins

    def reference(self, e):
        """gather.c ``reference``: resolve a name or a dotted chain rooted at a global; gather the functions and
        classes it reaches, record the other values as globals. Returns False when ``e`` is not such a chain."""
        chain = []
        base = e
        while isinstance(base, ast.Attribute):
            chain.append(base.attr)
            base = base.value
        if not isinstance(base, ast.Name):
            return False
        if base.id in self.locals:
            return True
        chain.reverse()
        if base.id in self.globals:
            root, obj = self.globals, self.globals[base.id]
        elif base.id in self.builtins:
            root, obj = None, self.builtins[base.id]
        else:
            return True  # unresolved: the tracer reports an unknown name, Python a NameError, if it ever runs
        path = [base.id]
        while True:
            obj = _unwrap_kernel(obj)
            if _skipped(obj):
                return True
            label = ".".join(path)
            if isinstance(obj, (types.FunctionType, type)):
                self.ref(obj)
                if root is not None:
                    self.d.globals.append(GlobalRef(label, root, tuple(path), self.file, e.lineno))
            elif not isinstance(obj, types.ModuleType) and root is not None:
                self.d.globals.append(GlobalRef(label, root, tuple(path), self.file, e.lineno))
                for rule, detail in check_value(obj, label, self.ref):
                    self.problem(rule, e, detail)
            if not chain:
                return True
            attr = chain.pop(0)
            try:
                if not hasattr(obj, attr):
                    return True
                obj = getattr(obj, attr)
            except Exception:  # noqa: BLE001 - properties of arbitrary objects
                return True
            path.append(attr)


def _has_starred(t):
    return any(isinstance(n, ast.Starred) for n in ast.walk(t))


def _snippet_value(v, limit=40):
    s = repr(v)
    return s if len(s) <= limit else s[:limit - 3] + "..."


class _ClassScan(_Scan):
    """gather.c ``class``: bases, keywords, decorators, body statements, field values and every method."""

    def __init__(self, d, cls, node, source):
        super().__init__(d, d.name)
        self.cls = cls
        self.node = node
        self.source = source

    def run(self):
        node, cls = self.node, self.cls
        if node.keywords or getattr(node, "type_params", None):
            self.problem("class-keywords", node, f"class {node.name}({_snippet_args(node)})")
        bases = [b.__name__ for b in cls.__bases__]
        if not node.bases or any(b not in ("NKIObject", "Enum") for b in bases):
            self.problem("class-base", node, f"class {node.name}({', '.join(bases) if node.bases else ''})")
        module = sys.modules.get(cls.__module__)
        for dec in node.decorator_list:
            if not _allowed_decorator(dec, vars(module) if module is not None else {}, builtins.__dict__):
                self.problem("decorator", dec, f"@{_snippet(dec)}")
        for index, s in enumerate(node.body):
            if isinstance(s, ast.Pass):
                continue
            if isinstance(s, ast.Expr):
                if not isinstance(s.value, ast.Constant):
                    self.problem("class-body", s, _snippet(s))
                continue
            if isinstance(s, (ast.Assign, ast.AnnAssign)):
                targets = s.targets if isinstance(s, ast.Assign) else [s.target]
                if len(targets) != 1 or not isinstance(targets[0], ast.Name):
                    self.problem("class-body", s, _snippet(s))
                    continue
                name = targets[0].id
                try:
                    v = getattr(cls, name)
                except Exception:  # noqa: BLE001 - e.g. dataclass fields with a default_factory
                    continue
                for rule, detail in check_value(v, f"{node.name}.{name}", self.ref):
                    self.problem(rule, s, detail)
                continue
            if isinstance(s, ast.FunctionDef):
                fn = _member_function(cls.__dict__.get(s.name), s)
                if fn is None:  # e.g. a property whose setter replaced this getter: its module's scope
                    fn = _Unbound(sys.modules.get(cls.__module__))
                _FunctionScan(self.d, fn, s, f"{self.d.name}.{s.name}", self.source, index).run()
                continue
            self.problem("class-body", s, _snippet(s, 40).split("\n")[0])


def _member_function(raw, fdef):
    """The function a class member's ``def`` made, behind staticmethod / classmethod / property (getter, setter or
    deleter) / functools.cached_property or a functools.wraps wrapper: the one whose code starts at this def (its
    first decorator line). None when no plain function of this def is reachable."""
    first = min([fdef.lineno] + [d.lineno for d in fdef.decorator_list])
    seen, work = set(), [raw]
    while work:
        obj = work.pop()
        if obj is None or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, types.FunctionType):
            if obj.__code__.co_firstlineno in (first, fdef.lineno):
                return obj
            work.append(getattr(obj, "__wrapped__", None))
            continue
        for attr in ("__func__", "fget", "fset", "fdel", "func", "__wrapped__"):
            try:
                work.append(getattr(obj, attr, None))
            except Exception:  # noqa: BLE001 - descriptors of arbitrary classes
                pass
    return None


class _Unbound:
    """Stands in for a member function that cannot be reached: scanned with its module's globals, never
    instrumented."""

    def __init__(self, module):
        self.__globals__ = vars(module) if module is not None else {}


def _snippet_args(node):
    return ", ".join([_snippet(b) for b in node.bases] + [f"{k.arg}={_snippet(k.value)}" for k in node.keywords])


# ----------------------------------------------------------------------------------------------------- gathering
class Gathered:
    """The transitive closure of a kernel: its definitions (kernel first), problems, globals, functions."""

    def __init__(self):
        self.definitions = []
        self.problems = []
        self.globals = []
        self.functions = []
        self.snapshot = None  # per global: (value at the first launch, immutable?, frozen picture)
        self.identity = ()    # (module dict, name, value) of the globals an identity test checks
        self.others = ()      # (global, snapshot entry) of the rest
        self.swaps = None     # (function, instrumented code) pairs, built at the first full launch
        self._defs = set()
        self._pkeys = set()
        self._gkeys = set()

    def add(self, roots, via_root=None):
        """Breadth-first over the references of ``roots`` (gather.c worklist). Returns the new definitions."""
        new = []
        parent = {}
        work = []
        for r in roots:
            r = _unwrap_kernel(r)
            if _skipped(r):
                continue
            work.append(r)
            parent[id(r)] = None
        while work:
            obj = work.pop(0)
            if id(obj) in self._defs:
                continue
            self._defs.add(id(obj))
            d = definition(obj)
            if d is None:
                continue
            self.definitions.append(d)
            new.append(d)
            via = self._path(obj, parent, via_root)
            for p in d.problems:
                if p.key() in self._pkeys:
                    continue
                self._pkeys.add(p.key())
                self.problems.append(Problem(p.rule, p.file, p.line, p.scope, p.detail, via))
            for g in d.globals:
                if g.key() not in self._gkeys:
                    self._gkeys.add(g.key())
                    self.globals.append(g)
            self.functions.extend(d.functions)
            for r in d.refs:
                if id(r) not in self._defs and id(r) not in parent:
                    parent[id(r)] = obj
                    work.append(r)
        return new

    @staticmethod
    def _path(obj, parent, via_root):
        names = []
        cur = obj
        while cur is not None and len(names) < 12:
            names.append(getattr(cur, "__name__", "?"))
            cur = parent.get(id(cur))
        if via_root:
            names.append(via_root)
        names.reverse()
        return " -> ".join(names) if len(names) > 1 else ""


_GATHERED = weakref.WeakKeyDictionary()


def gather(fn):
    """The cached ``Gathered`` closure of kernel function ``fn`` (the function a ``@nki.jit`` object wraps)."""
    fn = _unwrap_kernel(fn)
    with _LOCK:
        g = _GATHERED.get(fn)
        if g is None:
            g = Gathered()
            g.add([fn])
            _GATHERED[fn] = g
        return g


def _name(fn):
    return getattr(fn, "__qualname__", getattr(fn, "__name__", repr(fn)))


_HEADERS = {"uses": "uses {n} construct{s} the NKI compiler refuses",
            "is called with": "is called with {n} value{s} the NKI compiler cannot convert",
            "reads": "reads {n} module global{s} whose value changed since its first call"}


def _raise(fn, problems, what="uses"):
    lines = [p.format() for p in problems[:25]]
    if len(problems) > 25:
        lines.append(f"... and {len(problems) - 25} more")
    head = _HEADERS[what].format(n=len(problems), s="s" if len(problems) != 1 else "")
    raise NkiFrontendError(f"kernel {_name(fn)} {head} (NKI frontend check; NKI_ATTN_SIM_FRONTEND=0 runs it "
                           f"anyway):\n  " + "\n  ".join(lines), problems)


def check_kernel(fn):
    """Gathering-time check of kernel function ``fn`` without running it: raises ``NkiFrontendError`` listing
    every refused construct, returns the ``Gathered`` closure otherwise."""
    g = gather(fn)
    if g.problems:
        _raise(_unwrap_kernel(fn), g.problems)
    return g


# ----------------------------------------------------------------------------------------------------- launch
def _freeze(v, depth=0, seen=None):
    """A comparable picture of a global's value (what the frontend would convert): containers by content,
    objects by class and fields, everything else by identity."""
    if v is None or isinstance(v, (bool, int, str)) or v is Ellipsis:
        return v
    if isinstance(v, float):
        return ("float", v.hex())
    if depth > 8:
        return _Ident(v)
    if seen is None:
        seen = set()
    if id(v) in seen:
        return _Ident(v)
    seen = seen | {id(v)}
    if isinstance(v, (tuple, list)):
        return (type(v).__name__,) + tuple(_freeze(e, depth + 1, seen) for e in v)
    if isinstance(v, dict):
        return ("dict",) + tuple((_freeze(k, depth + 1, seen), _freeze(e, depth + 1, seen)) for k, e in v.items())
    if isinstance(v, (types.ModuleType, types.FunctionType, type)) or _is_tensor(v) or _skipped(v):
        return _Ident(v)
    enum = sys.modules.get("enum")
    if enum is not None and isinstance(v, enum.Enum):
        return _Ident(v)
    fields = getattr(v, "__dict__", None)
    if isinstance(fields, dict):
        return ("object", _Ident(type(v)), _freeze(fields, depth + 1, seen))
    return _Ident(v)


class _Ident:
    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def __eq__(self, other):
        return isinstance(other, _Ident) and other.obj is self.obj

    def __hash__(self):
        return id(self.obj)


def _describe(v, limit=60):
    if v is _MISSING:
        return "<deleted>"
    return _snippet_value(v, limit)


def _immutable(v, depth=0):
    """Values whose identity fixes their content (the launch check can skip comparing them again)."""
    if v is None or isinstance(v, (bool, int, float, str, bytes, types.ModuleType, types.FunctionType, type,
                                   types.BuiltinFunctionType)):
        return True
    enum = sys.modules.get("enum")
    if enum is not None and isinstance(v, enum.Enum):
        return True
    return type(v) is tuple and depth < 4 and all(_immutable(e, depth + 1) for e in v)


def _check_globals(fn, g):
    """Launch stage: every gathered global must still have the value it had at the kernel's first launch."""
    if g.snapshot is None:
        g.snapshot = []
        for ref in g.globals:
            v = ref.current()
            g.snapshot.append((v, _immutable(v), _freeze(v)))
        # the common case, checked first at every launch: a plain module global (no attribute chain) whose value
        # fixes its content, unchanged if it is still the same object
        simple = [fixed and len(ref.path) == 1 for ref, (_, fixed, _) in zip(g.globals, g.snapshot)]
        g.identity = tuple((ref.root, ref.path[0], old) for ref, (old, _, _), easy in
                           zip(g.globals, g.snapshot, simple) if easy)
        g.others = tuple((ref, snap) for ref, snap, easy in zip(g.globals, g.snapshot, simple) if not easy)
        return
    missing = _MISSING
    if all(root.get(name, missing) is old for root, name, old in g.identity):
        pairs = g.others
    else:
        pairs = zip(g.globals, g.snapshot)
    problems = []
    for ref, (old, fixed, frozen) in pairs:
        v = ref.current()
        if v is old and fixed:
            continue
        if _freeze(v) != frozen:
            problems.append(Problem("global-changed", ref.file, ref.line, "",
                                    f"{ref.label} was {_describe(old)} at the first call, now {_describe(v)}"))
    if problems:
        _raise(fn, problems, "reads")


def _plain(v):
    """The argument values that need no walk: tensors, None, bools, floats, strings, 32-bit ints."""
    t = type(v)
    if v is None or t is bool or t is float or t is str:
        return True
    if t is int:
        return INT32_MIN <= v <= INT32_MAX
    return _is_tensor(v)


def _check_arguments(fn, g, args, kwargs):
    """Launch stage: argument values get the frontend's value checks; the functions and the objects' classes
    they carry are gathered (not cached with the kernel: other calls may pass other values). Returns the
    functions to instrument."""
    problems = []
    refs = []
    items = [(f"argument {i}", a) for i, a in enumerate(args)] + [(f"argument {k}", v) for k, v in kwargs.items()]
    for label, v in items:
        if _plain(v):
            continue
        found = []
        for rule, detail in check_value(v, label, found.append):
            problems.append(Problem(rule, "", 0, _name(fn), detail))
        refs.extend((label, r) for r in found)
    functions = []
    if refs:
        extra = Gathered()
        extra._defs = set(g._defs)
        with _LOCK:
            for label, r in refs:
                extra.add([r], via_root=label)
        problems.extend(extra.problems)
        functions = extra.functions
    if problems:
        _raise(fn, problems, "is called with")
    return functions


def prepare(fn, args, kwargs):
    """Everything the frontend does before a launch of kernel function ``fn``: gathering (cached), the argument
    and global checks; returns a context manager that runs the launch with the instrumented code (a no-op when
    the tracing checks are off). Raises ``NkiFrontendError`` before any instruction runs."""
    m = mode()
    if m == "off":
        return _NOOP
    fn = _unwrap_kernel(fn)
    g = gather(fn)
    if g.problems:
        _raise(fn, g.problems)
    extra = _check_arguments(fn, g, args, kwargs)
    _check_globals(fn, g)
    if m == "gather":
        return _NOOP
    if g.swaps is None:
        g.swaps = _swaps(g.functions)
    return _Instrumented(g.swaps + _swaps(extra) if extra else g.swaps)


class _Noop:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_NOOP = _Noop()


# ----------------------------------------------------------------------------------------------------- tracing
class _Site:
    __slots__ = ("file", "line", "scope", "detail")

    def __init__(self, file, line, scope, detail):
        self.file, self.line, self.scope, self.detail = file, line, scope, detail


_SITES = []
FE_NAME = "__nki_attn_frontend__"
_TMP = "__nki_attn_frontend_c"


def _site(file, node, scope):
    _SITES.append(_Site(file, node.lineno, scope, _snippet(node)))
    return len(_SITES) - 1


def _traced_error(rule, site, detail):
    s = _SITES[site]
    p = Problem(rule, s.file, s.line, s.scope, detail)
    raise NkiFrontendError(f"NKI frontend check while tracing: {p.format()}", [p])


def _seq_slice(x, k, site):
    """KLR Trace/Term.lean ``listAccess``: negative bounds count from the end once; anything still outside
    [0, len] is an error (Python would clamp)."""
    n = len(x)
    start, stop, step = k.start, k.stop, k.step
    step = 1 if step is None else step
    start = 0 if start is None else start
    stop = n if stop is None else stop
    if isinstance(step, int) and step <= 0:
        _traced_error("slice-range", site, f"{_SITES[site].detail}: step {step} (must be positive)")
    if not (isinstance(start, int) and isinstance(stop, int)):
        return
    s = start + n if start < 0 else start
    e = stop + n if stop < 0 else stop
    if s < 0 or s > n or e < 0 or e > n:
        kind = type(x).__name__
        _traced_error("slice-range", site, f"{_SITES[site].detail}: [{start}:{stop}] on a {kind} of length {n}")


# What KLR's tracer provides (KLR/Trace/Python.lean, Term.lean ``Term.attr``, NKI.lean); docs/simulator.md has the
# table with the file of each entry.
BUILTINS = ("isinstance", "type", "slice", "print", "min", "max", "abs", "str", "bool", "int", "float", "divmod",
            "tuple", "list", "dict", "len")
LIST_METHODS = ("append", "clear", "copy", "extend", "index", "pop", "remove", "reverse")
DICT_METHODS = ("clear", "copy", "get", "items", "keys", "pop", "setdefault", "values")
MATH_NAMES = ("ceil", "floor", "gcd", "log2", "log10", "pow", "sqrt", "pi", "e", "inf", "nan")
_NO_ATTRIBUTES = (str, tuple, int, float, bool)
_DICT_VIEWS = (type({}.keys()), type({}.values()), type({}.items()))
_SEQUENCES = (list, tuple) + _DICT_VIEWS  # what KLR's fetchIter walks (dict views are lists there)


def _kind(v):
    if _is_tensor(v):
        return "tensor"
    return type(v).__name__


def _num(v):
    return type(v) is int or type(v) is float


class _Checks:
    """The functions instrumented code calls (bound in each instrumented module as ``__nki_attn_frontend__``)."""

    S = slice

    @staticmethod
    def sub(x, k, site):
        t = type(x)
        if t is list or t is tuple:
            if type(k) is slice:
                _seq_slice(x, k, site)
        elif t is dict or isinstance(x, dict):
            if type(k) is not str:
                _traced_error("dict-key", site, f"{_SITES[site].detail}: key {k!r}")
        elif t is str:
            _traced_error("subscript", site, f"{_SITES[site].detail}: a str value")
        return x[k]

    @staticmethod
    def key(x, k, site):
        """The key of an item assignment ``x[k] = v`` (KLR Trace/NKI.lean ``mutate``)."""
        t = type(x)
        if t is dict or isinstance(x, dict):
            if type(k) is not str:
                _traced_error("dict-key", site, f"{_SITES[site].detail}: key {k!r}")
        elif t is list:
            if type(k) is slice:
                _traced_error("subscript", site, f"{_SITES[site].detail}: slice assignment into a list")
            if type(k) is int and k < 0:
                _traced_error("subscript", site, f"{_SITES[site].detail}: negative index {k} assigned")
        return k

    @staticmethod
    def bi(name, site):
        """A builtin name being evaluated: the tracer's own, checked, or a refusal."""
        f = _BUILTIN_CHECKS.get(name)
        if f is None:
            _traced_error("builtin", site, f"{name}")
        return f if f is not True else getattr(builtins, name)

    @staticmethod
    def math_(name, site):
        _traced_error("math", site, f"math.{name}")

    @staticmethod
    def attr(x, name, site):
        t = type(x)
        if t is list:
            if name not in LIST_METHODS:
                _traced_error("method", site, f"{_SITES[site].detail}: list has no '{name}' in NKI")
            if name == "pop":
                return _ListPop(x, site)
            if name == "remove":
                return _ListRemove(x, site)
        elif t is dict:
            if name not in DICT_METHODS:
                _traced_error("method", site, f"{_SITES[site].detail}: dict has no '{name}' in NKI")
            if name in ("get", "pop", "setdefault"):
                return _DictKeyed(getattr(x, name), site)
        elif t in _NO_ATTRIBUTES:
            _traced_error("method", site, f"{_SITES[site].detail}: a {t.__name__} value has no attributes in NKI")
        return getattr(x, name)

    @staticmethod
    def binop(l, r, op, site):
        if type(l) is int and type(r) is int:  # the common case: index arithmetic
            if op == _POW and r < 0:
                _bad_operator(l, r, op, site, "an int raised to a negative int power (NKI computes l ** 0)")
            return _OPS[op][1](l, r)
        _check_binop(l, r, op, site)
        return _OPS[op][1](l, r)

    @staticmethod
    def contains(x, seq, negate, site):
        """``x in seq`` (KLR Trace/Python.lean ``builtin.op.in``: tuples, lists, and a str in a str)."""
        t = type(seq)
        if not (t is list or t is tuple or t in _DICT_VIEWS or (t is str and type(x) is str)):
            what = "a dict" if isinstance(seq, dict) else f"a {_kind(seq)}"
            _traced_error("operator", site, f"{_SITES[site].detail}: 'in' on {what}")
        return (x not in seq) if negate else (x in seq)


def _bad_operator(l, r, op, site, why=None):
    sym = _OPS[op][0]
    why = why or f"'{sym}' on {_kind(l)} and {_kind(r)}"
    _traced_error("operator", site, f"{_SITES[site].detail}: {why}")


_NUMERIC_FLOAT_OPS = ("+", "-", "*", "/", "**", "//")


def _check_binop(l, r, op, site):
    """KLR Trace/Term.lean ``binop``: which operands each operator takes."""
    sym = _OPS[op][0]
    tl, tr = type(l), type(r)
    if _is_tensor(l) or _is_tensor(r):
        _bad_operator(l, r, op, site, f"'{sym}' on a tensor (binary operators on tensors are not supported; "
                                      f"use nki.isa)")
    num_l, num_r = tl in (int, float, bool), tr in (int, float, bool)
    if num_l and num_r:
        if tl is bool and tr is bool or (tl is bool and tr is float) or (tl is float and tr is bool):
            _bad_operator(l, r, op, site)
        if (tl is float or tr is float) and sym not in _NUMERIC_FLOAT_OPS:
            _bad_operator(l, r, op, site)
        if sym == "**" and tr is int and r < 0 and tl is not float:
            _bad_operator(l, r, op, site, "an int raised to a negative int power (NKI computes l ** 0)")
        return
    if tl is str or tr is str:
        if not (sym == "+" and tl is str and tr is str):
            _bad_operator(l, r, op, site)
        return
    if tl in (list, tuple) or tr in (list, tuple):
        if sym == "+" and tl is tr:
            return
        if sym == "*" and ((tl in (list, tuple) and tr in (int, bool)) or (tr in (list, tuple) and tl in (int, bool))):
            return
        _bad_operator(l, r, op, site)
    if tl is dict or tr is dict or l is None or r is None:
        _bad_operator(l, r, op, site)
    # other objects: operator overloading through their methods (KLR NKI.lean binopOverload?)


class _ListPop:
    """``list.pop`` in NKI takes no index (KLR Python.lean ``builtin.list.pop``)."""

    __slots__ = ("lst", "site")

    def __init__(self, lst, site):
        self.lst, self.site = lst, site

    def __call__(self, *args, **kwargs):
        if args or kwargs:
            _traced_error("method", self.site, f"{_SITES[self.site].detail}: list.pop with an index (NKI's pop "
                                               f"takes none and removes the last element)")
        return self.lst.pop()


class _ListRemove:
    """``list.remove`` in NKI removes every equal element (KLR Python.lean), Python only the first."""

    __slots__ = ("lst", "site")

    def __init__(self, lst, site):
        self.lst, self.site = lst, site

    def __call__(self, value):
        if self.lst.count(value) > 1:
            _traced_error("method", self.site, f"{_SITES[self.site].detail}: list.remove of a value present "
                                               f"{self.lst.count(value)} times (NKI removes every copy, Python "
                                               f"the first)")
        return self.lst.remove(value)


class _DictKeyed:
    """``dict.get`` / ``pop`` / ``setdefault``: the key is a string (KLR Python.lean ``(key : String)``)."""

    __slots__ = ("method", "site")

    def __init__(self, method, site):
        self.method, self.site = method, site

    def __call__(self, key, *rest):
        if type(key) is not str:
            _traced_error("dict-key", self.site, f"{_SITES[self.site].detail}: key {key!r}")
        return self.method(key, *rest)


def _args_error(site, why):
    _traced_error("builtin-args", site, f"{_SITES[site].detail}: {why}")


def _checked_builtin(name):
    """A builtin with the argument rules of its KLR implementation; ``site`` is passed by the instrumented call."""

    def dict_(*args, site=-1, **kwargs):
        if kwargs:
            _args_error(site, "dict(name=value) (NKI's dict takes no keyword arguments; write {'name': value})")
        if len(args) > 1:
            _args_error(site, "dict with more than one argument")
        if args:
            pairs = args[0]
            if type(pairs) not in _SEQUENCES or isinstance(pairs, dict):
                _args_error(site, f"dict of a {_kind(pairs)} (NKI's dict takes a list or tuple of (key, value) "
                                  f"pairs)")
            for p in pairs:
                if type(p) not in (list, tuple) or len(p) != 2:
                    _args_error(site, f"dict of {p!r}, not a (key, value) pair")
                if type(p[0]) is not str:
                    _traced_error("dict-key", site, f"{_SITES[site].detail}: key {p[0]!r}")
        return dict(*args)

    def len_(x, site=-1):
        if type(x) not in _SEQUENCES and type(x) is not dict:
            _args_error(site, f"len of a {_kind(x)} (NKI's len takes a list, tuple or dict)")
        return len(x)

    def seq_(*args, site=-1):
        if len(args) != 1:
            _args_error(site, f"{name}() needs exactly one argument in NKI")
        x = args[0]
        if type(x) not in _SEQUENCES and x is not None:
            _args_error(site, f"{name} of a {_kind(x)} (NKI's {name} takes a list or tuple)")
        return (list if name == "list" else tuple)(() if x is None else x)

    def minmax_(*args, site=-1):
        vals = args[0] if len(args) == 1 and type(args[0]) in _SEQUENCES else args
        if not vals:
            _args_error(site, f"{name} of an empty sequence")
        for v in vals:
            if not _num(v):
                _args_error(site, f"{name} over a {_kind(v)} (NKI's {name} compares ints and floats)")
        return (min if name == "min" else max)(*args)

    def abs_(x, site=-1):
        if type(x) not in (int, float, bool):
            _args_error(site, f"abs of a {_kind(x)}")
        return abs(x)

    def divmod_(x, y, site=-1):
        if type(x) is not int or type(y) is not int:
            _args_error(site, f"divmod of {_kind(x)} and {_kind(y)} (NKI's divmod takes ints)")
        return divmod(x, y)

    def isinstance_(obj, types_, site=-1):
        if type(types_) is tuple:
            _traced_error("isinstance-tuple", site, f"{_SITES[site].detail}: types {types_!r}")
        return isinstance(obj, types_)

    return {"dict": dict_, "len": len_, "list": seq_, "tuple": seq_, "min": minmax_, "max": minmax_,
            "abs": abs_, "divmod": divmod_, "isinstance": isinstance_}.get(name, True)


_BUILTIN_CHECKS = {n: _checked_builtin(n) for n in BUILTINS}
_OPS = {}
for _sym, _node, _fn in (("+", ast.Add, operator.add), ("-", ast.Sub, operator.sub), ("*", ast.Mult, operator.mul),
                         ("/", ast.Div, operator.truediv), ("//", ast.FloorDiv, operator.floordiv),
                         ("%", ast.Mod, operator.mod), ("**", ast.Pow, operator.pow),
                         ("<<", ast.LShift, operator.lshift), (">>", ast.RShift, operator.rshift),
                         ("|", ast.BitOr, operator.or_), ("^", ast.BitXor, operator.xor),
                         ("&", ast.BitAnd, operator.and_)):
    _OPS[len(_OPS)] = (_sym, _fn, _node)
_OP_CODE = {node: code for code, (_, _, node) in _OPS.items()}
_POW = _OP_CODE[ast.Pow]
del _sym, _node, _fn
_CHECKS = _Checks()
_BUILTIN_NAMES = frozenset(dir(builtins))
_math = math


def _located(new, old):
    """``new`` (and the nodes created with it) at ``old``'s place in the source: tracebacks keep the kernel's
    line numbers."""
    ast.copy_location(new, old)
    return ast.fix_missing_locations(new)


def _fe(attr):
    return ast.Attribute(value=ast.Name(id=FE_NAME, ctx=ast.Load()), attr=attr, ctx=ast.Load())


class _Instrumenter(ast.NodeTransformer):
    """Rewrites one function's AST so that what only running values decide goes through ``_Checks``: subscripts
    (``sub``/``key``), builtin names (``bi``), attributes and methods (``attr``), binary operators (``binop``,
    augmented assignments as the rebinding ``x = x op e`` that Simplify.lean makes of them), ``in``
    (``contains``) and ``math`` names. Nested scopes are left alone (the gathering stage refuses them)."""

    def __init__(self, file, scope, local_names, globals_):
        self.file, self.scope, self.globals = file, scope, globals_
        self.locals_only = local_names
        self.shadowed = local_names | set(globals_)  # names that are not builtins here
        self.changed = False

    def visit_Lambda(self, node):
        return node

    visit_ListComp = visit_SetComp = visit_DictComp = visit_GeneratorExp = visit_Lambda

    def site(self, node):
        self.changed = True
        return ast.Constant(value=_site(self.file, node, self.scope))

    def _as_value(self, s):
        if isinstance(s, ast.Slice):
            none = ast.Constant(value=None)
            return ast.Call(func=_fe("S"), args=[s.lower or none, s.upper or none, s.step or none], keywords=[])
        if isinstance(s, ast.Tuple) and any(isinstance(e, ast.Slice) for e in s.elts):
            return ast.Tuple(elts=[self._as_value(e) for e in s.elts], ctx=ast.Load())
        return s

    def visit_Subscript(self, node):
        site = self.site(node)
        node.value = self.visit(node.value)
        node.slice = self.visit(node.slice)
        if isinstance(node.ctx, ast.Load):
            return _located(ast.Call(func=_fe("sub"), args=[node.value, self._as_value(node.slice), site],
                                     keywords=[]), node)
        if isinstance(node.ctx, ast.Store):
            node.value = _located(ast.NamedExpr(target=ast.Name(id=_TMP, ctx=ast.Store()), value=node.value), node)
            node.slice = _located(ast.Call(func=_fe("key"), args=[ast.Name(id=_TMP, ctx=ast.Load()),
                                                                  self._as_value(node.slice), site],
                                           keywords=[]), node)
        return node

    def _builtin(self, name):
        return name not in self.shadowed and name in _BUILTIN_NAMES

    def visit_Name(self, node):
        if isinstance(node.ctx, ast.Load) and self._builtin(node.id) and node.id not in BUILTINS:
            return _located(ast.Call(func=_fe("bi"), args=[ast.Constant(value=node.id), self.site(node)],
                                     keywords=[]), node)
        if isinstance(node.ctx, ast.Load) and node.id not in self.shadowed:
            return node
        if isinstance(node.ctx, ast.Load) and node.id in self.globals and node.id not in self.locals_only:
            obj = self.globals[node.id]
            if getattr(obj, "__module__", None) == "math" and callable(obj) \
                    and getattr(obj, "__name__", "") not in MATH_NAMES:
                return _located(ast.Call(func=_fe("math_"), args=[ast.Constant(value=obj.__name__),
                                                                  self.site(node)], keywords=[]), node)
        return node

    def _root_is_static(self, node):
        """An attribute chain rooted at a module or class global (nl.x, nisa.y, Mode.A): nothing to check."""
        base = node
        while isinstance(base, ast.Attribute):
            base = base.value
        if not isinstance(base, ast.Name) or base.id in self.locals_only:
            return False
        obj = self.globals.get(base.id, _MISSING)
        return isinstance(obj, (types.ModuleType, type))

    def visit_Attribute(self, node):
        if not isinstance(node.ctx, ast.Load):
            node.value = self.visit(node.value)
            return node
        if isinstance(node.value, ast.Name) and node.value.id not in self.locals_only \
                and self.globals.get(node.value.id) is _math and node.attr not in MATH_NAMES:
            return _located(ast.Call(func=_fe("math_"), args=[ast.Constant(value=node.attr), self.site(node)],
                                     keywords=[]), node)
        if self._root_is_static(node):
            return node
        site = self.site(node)
        value = self.visit(node.value)
        return _located(ast.Call(func=_fe("attr"), args=[value, ast.Constant(value=node.attr), site],
                                 keywords=[]), node)

    def _binop(self, left, op, right, node, site):
        return _located(ast.Call(func=_fe("binop"), args=[left, right, ast.Constant(value=_OP_CODE[type(op)]),
                                                          site], keywords=[]), node)

    def visit_BinOp(self, node):
        if type(node.op) not in _OP_CODE:
            return self.generic_visit(node)
        site = self.site(node)
        return self._binop(self.visit(node.left), node.op, self.visit(node.right), node, site)

    def visit_AugAssign(self, node):
        t = node.target
        if type(node.op) not in _OP_CODE or not isinstance(t, ast.Name):
            return self.generic_visit(node)
        site = self.site(node)
        value = self.visit(node.value)
        load = ast.Name(id=t.id, ctx=ast.Load())
        new = ast.Assign(targets=[ast.Name(id=t.id, ctx=ast.Store())],
                         value=self._binop(self.visit(load), node.op, value, node, site))
        return _located(new, node)

    def visit_Compare(self, node):
        if not (len(node.ops) == 1 and isinstance(node.ops[0], (ast.In, ast.NotIn))):
            return self.generic_visit(node)
        site = self.site(node)
        self.generic_visit(node)
        return _located(ast.Call(func=_fe("contains"), args=[
            node.left, node.comparators[0], ast.Constant(value=isinstance(node.ops[0], ast.NotIn)), site],
            keywords=[]), node)

    def visit_AnnAssign(self, node):
        # a local annotation is never evaluated
        node.target = self.visit(node.target)
        if node.value is not None:
            node.value = self.visit(node.value)
        return node

    def visit_For(self, node):
        it = node.iter
        if isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "range" \
                and self._builtin("range"):
            it.args = [self.visit(a) for a in it.args]  # range: only as a for-loop header
        else:
            node.iter = self.visit(it)
        node.target = self.visit(node.target)
        node.body = [self.visit(s) for s in node.body]
        node.orelse = [self.visit(s) for s in node.orelse]
        return node

    def visit_Call(self, node):
        func = node.func
        if isinstance(func, ast.Name) and self._builtin(func.id) and func.id in BUILTINS \
                and _BUILTIN_CHECKS[func.id] is not True:
            site = self.site(node)
            node.args = [self.visit(a) for a in node.args]
            node.keywords = [self.visit(k) for k in node.keywords]
            node.func = _located(ast.Call(func=_fe("bi"), args=[ast.Constant(value=func.id), site],
                                          keywords=[]), func)
            node.keywords.append(ast.keyword(arg="site", value=ast.Constant(value=site.value)))
            return _located(node, node)
        return self.generic_visit(node)


def _find_code(code, name, firstline):
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            if c.co_name == name and c.co_firstlineno == firstline:
                return c
            found = _find_code(c, name, firstline)
            if found is not None:
                return found
    return None


_IMPORTED = {}


def _module_imports(file):
    """Names the module in ``file`` binds with top-level imports. The compiler looks them up in the module's
    symbol table (it calls ``imported.f()`` without LOAD_METHOD), so the recompiled code must see them too."""
    if file in _IMPORTED:
        return _IMPORTED[file]
    names = set()
    try:
        tree = ast.parse("".join(linecache.getlines(file)))
    except (SyntaxError, ValueError):
        tree = None
    if tree is not None:
        stack = list(tree.body)
        while stack:
            n = stack.pop()
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                continue
            if isinstance(n, (ast.Import, ast.ImportFrom)):
                for al in n.names:
                    if al.name != "*":
                        names.add((al.asname or al.name).split(".")[0])
                continue
            stack.extend(ast.iter_child_nodes(n))
    _IMPORTED[file] = names
    return names


def _compile_like(fn, fdef, file):
    """Compile ``fdef`` (a FunctionDef with the original line numbers) so that the result can replace
    ``fn.__code__``: with the module's top-level imports in scope, nested in a function that provides the same
    free variables, inside a class of the same name for methods (private-name mangling)."""
    code = fn.__code__
    line = fdef.lineno

    def at_def_line(node):
        for m in ast.walk(node):
            if isinstance(m, (ast.stmt, ast.expr, ast.alias, ast.arguments)):
                m.lineno = m.end_lineno = line
                m.col_offset = m.end_col_offset = 0
        return node

    freevars = [v for v in code.co_freevars if v != "__class__"]
    parts = fn.__qualname__.split(".")
    inner = fdef
    if len(parts) >= 2 and parts[-2] != "<locals>":
        inner = ast.ClassDef(name=parts[-2], bases=[], keywords=[], body=[fdef], decorator_list=[],
                             lineno=line, col_offset=0, end_lineno=line, end_col_offset=0)
    top = [at_def_line(ast.Import(names=[ast.alias(name=n, asname=None)])) for n in sorted(_module_imports(file))]
    if freevars:
        # Free variables need an enclosing function scope that binds them.
        body = [at_def_line(ast.Assign(targets=[ast.Name(id=v, ctx=ast.Store())], value=ast.Constant(value=None)))
                for v in freevars]
        body.append(inner)
        outer = ast.FunctionDef(name="__nki_attn_outer", args=at_def_line(ast.arguments(
            posonlyargs=[], args=[], vararg=None, kwonlyargs=[], kw_defaults=[], kwarg=None, defaults=[])),
            body=body, decorator_list=[], returns=None, lineno=line, col_offset=0, end_lineno=line,
            end_col_offset=0)
        top.append(outer)
    else:
        top.append(inner)
    module = ast.Module(body=top, type_ignores=[])
    compiled = compile(module, file, "exec", flags=code.co_flags & _FUTURE_MASK, dont_inherit=True)
    return _find_code(compiled, code.co_name, code.co_firstlineno)


_INSTRUMENTED = weakref.WeakKeyDictionary()  # function -> instrumented code, or None (nothing to check / cannot)
UNCHECKED = weakref.WeakSet()  # gathered functions whose source does not compile to the code they run


def instrumented_code(info):
    """The instrumented code of a gathered function (``FunctionInfo``; cached), or None when there is nothing to
    check in it or when its source no longer compiles to the code it runs (edited file, pytest-rewritten asserts,
    optimised build): such a function keeps its own code."""
    fn = info.fn
    with _LOCK:
        if fn in _INSTRUMENTED:
            return _INSTRUMENTED[fn]
        result = None
        try:
            plain = _compile_like(fn, info.node(), info.file)
            orig = fn.__code__
            same = plain is not None and plain.co_code == orig.co_code and plain.co_freevars == orig.co_freevars \
                and plain.co_cellvars == orig.co_cellvars and plain.co_names == orig.co_names
            if not same:
                UNCHECKED.add(fn)
            else:
                ins = _Instrumenter(info.file, info.scope, info.locals, fn.__globals__)
                tree = ins.visit(info.node())
                if ins.changed:
                    new = _compile_like(fn, tree, info.file)
                    if new is not None and new.co_freevars == orig.co_freevars:
                        result = new.replace(co_qualname=orig.co_qualname) if hasattr(new, "co_qualname") \
                            else new
                        fn.__globals__.setdefault(FE_NAME, _CHECKS)
        except (SyntaxError, ValueError, TypeError):
            result = None
        _INSTRUMENTED[fn] = result
        return result


_ACTIVE = {}  # id(function) -> [function, original code, depth]


def _swaps(functions):
    """(function, instrumented code) of the functions that have instrumented code."""
    pairs = []
    for info in functions:
        code = instrumented_code(info)
        if code is not None:
            pairs.append((info.fn, code))
    return pairs


class _Instrumented:
    """Swaps the gathered functions' code for their instrumented copies for the duration of a launch (nested or
    concurrent launches of kernels sharing a helper swap it once)."""

    def __init__(self, pairs):
        self.pairs = pairs

    def __enter__(self):
        with _LOCK:
            done = []
            try:
                for fn, code in self.pairs:
                    slot = _ACTIVE.get(id(fn))
                    if slot is not None:
                        slot[2] += 1
                    else:
                        _ACTIVE[id(fn)] = [fn, fn.__code__, 1]
                        fn.__code__ = code
                    done.append((fn, code))
            except BaseException:
                self._restore(done)
                raise
        return self

    def __exit__(self, *exc):
        with _LOCK:
            self._restore(self.pairs)
        return False

    @staticmethod
    def _restore(pairs):
        for fn, _ in pairs:
            slot = _ACTIVE.get(id(fn))
            if slot is None:
                continue
            slot[2] -= 1
            if slot[2] == 0:
                fn.__code__ = slot[1]
                del _ACTIVE[id(fn)]

