"""The NKI frontend check (nki_attn.sim.frontend): every refused construct is refused on its own, before anything
runs, even hidden in a helper reached only through a branch never taken at trace time; everything the language
guide allows is accepted; the opt-out works; instrumented code is put back after every launch.

The kernels live in frontend_kernels.py (each refused construct marked ``# <- <rule>`` on its line).
"""
import linecache
import re

import frontend_kernels as fk
import numpy as np
import pytest

import nki_attn.sim as sim
from nki_attn.sim import NkiValidationError, frontend, trace
from nki_attn.sim.frontend import NkiFrontendError


@pytest.fixture(autouse=True)
def _default_modes(monkeypatch):
    # The frontend is on by default; the environment of the test run must not turn it off.
    monkeypatch.delenv("NKI_ATTN_SIM_FRONTEND", raising=False)
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")


def _a():
    return np.arange(8 * 16, dtype=np.float32).reshape(8, 16)


def _marker_lines(rule):
    """Lines of frontend_kernels.py marked with ``# <- rule``."""
    lines = linecache.getlines(fk.__file__)
    pat = re.compile(r"#\s*<-\s*" + re.escape(rule) + r"(\s|$)")
    return {i + 1 for i, text in enumerate(lines) if pat.search(text)}


def _refused(kernel, *args, **kwargs):
    """Run ``kernel`` expecting NkiFrontendError before any instruction; returns the error."""
    with trace.recording() as rec, pytest.raises(NkiFrontendError) as info:
        kernel(*args, **kwargs)
    assert rec.count() == 0, "the frontend error must come before any instruction"
    return info.value


GATHER_RULES = ["raise", "try", "with", "del", "import", "global", "match", "async", "inner-def", "inner-class",
                "lambda", "comprehension", "generator", "set", "walrus", "yield", "format-spec", "starred",
                "kwargs-expansion", "varargs", "matmul-op", "chained-in", "dict-literal-key", "for-target",
                "loop-else", "assign-target", "decorator", "int-range", "minmax-args", "class-base", "class-body",
                "class-keywords", "numpy-dtype", "isinstance-tuple", "is-operator"]


@pytest.mark.parametrize("rule", GATHER_RULES)
def test_each_gathering_rule_is_refused_in_a_branch_never_taken(rule):
    kernel = getattr(fk, "bad_" + rule.replace("-", "_"))
    err = _refused(kernel, _a())
    assert {p.rule for p in err.problems} == {rule}, err
    p = err.problems[0]
    assert all(q.file == fk.__file__ and q.line in _marker_lines(rule) for q in err.problems), \
        ([q.line for q in err.problems], _marker_lines(rule))
    # the message names file and line, the construct and what to do instead
    construct, _, _, advice = frontend.RULES[rule]
    line = f"frontend_kernels.py:{p.line}: {construct}"
    assert line in str(err) and advice in str(err)
    assert "reached via bad_" in str(err) and "NKI_ATTN_SIM_FRONTEND=0" in str(err)
    # the branch is never taken: with the check off the kernel runs
    with sim.checking(frontend=False):
        np.testing.assert_array_equal(kernel(_a()), _a())


def test_every_rule_has_a_test():
    traced = {"slice-range", "dict-key", "isinstance-tuple", "builtin", "builtin-args", "math", "method",
              "operator", "subscript"}
    assert traced == {rule for _, rule, _ in TRACED_CASES} | {"slice-range", "isinstance-tuple"}
    launched = {"global-changed", "nonlocal"}
    assert set(frontend.RULES) <= set(GATHER_RULES) | traced | launched


@pytest.mark.parametrize("kernel,rule", [(fk.bad_global_int_range, "int-range"),
                                         (fk.bad_global_dict_key, "dict-key")])
def test_global_values_are_converted_like_the_compiler_does(kernel, rule):
    err = _refused(kernel, _a())
    assert [p.rule for p in err.problems] == [rule]
    assert err.problems[0].line in _marker_lines(rule)


def test_default_arguments_are_gathered():
    # gather.c evaluates a function's defaults in the enclosing scope and follows what they reference
    err = _refused(fk.bad_default_argument, _a())
    p, = err.problems
    assert p.rule == "raise" and p.scope == "_h_raise" and "_h_default -> _h_raise" in p.via


def test_all_problems_are_reported_at_once():
    err = _refused(fk.takes_value, _a(), {1: 2, "x": 1 << 40})
    assert sorted(p.rule for p in err.problems) == ["dict-key", "int-range"]
    assert "argument 1 has key 1" in str(err) and "argument 1['x'] = 1099511627776" in str(err)


@pytest.mark.parametrize("value,rule,text", [
    (1 << 40, "int-range", "argument 1 = 1099511627776"),
    (-(1 << 31) - 1, "int-range", "= -2147483649"),
    ({1: 2}, "dict-key", "has key 1"),
    ((1, [2, {3: 4}]), "dict-key", "argument 1[1][1] has key 3"),
    (np.float32, "numpy-dtype", "numpy.float32"),
    (np.dtype("float16"), "numpy-dtype", "float16"),
    (fk.HostOnly(), "class-base", "class HostOnly()"),
    (lambda x: x, "lambda", "<lambda>"),
])
def test_argument_values_are_checked_at_launch(value, rule, text):
    err = _refused(fk.takes_value, _a(), value)
    assert [p.rule for p in err.problems] == [rule] and text in str(err), err


def test_accepted_argument_values():
    for value in (None, True, 3, -(1 << 31), (1 << 31) - 1, 2.5, "s", (1, 2.0, "x"), [1, [2]],
                  {"a": 1, "b": {"c": 2}}, fk.Plan(factor=3.0), fk.Mode.TRIPLE, sim.language.float32, fk.copy_out):
        np.testing.assert_array_equal(fk.takes_value(_a(), value), _a())


def test_functions_passed_as_arguments_are_gathered():
    err = _refused(fk.calls_argument, _a(), fk._h_raise)
    assert [p.rule for p in err.problems] == ["raise"] and "argument 1 -> _h_raise" in str(err)
    err = _refused(fk.calls_argument, _a(), fk.make_counter())
    assert [p.rule for p in err.problems] == ["nonlocal"]
    assert err.problems[0].line in _marker_lines("nonlocal")
    # an argument's refusal is not cached with the kernel: a valid function afterwards runs
    np.testing.assert_array_equal(fk.calls_argument(_a(), fk.copy_out), _a())


# ------------------------------------------------------------------------------------------- tracing rules
@pytest.mark.parametrize("kernel,rule,text,python_error", [
    (fk.traced_slice, "slice-range", "pairs[1:1 + 4]: [1:5] on a list of length 3", None),
    (fk.traced_isinstance, "isinstance-tuple", "types (<class 'int'>, <class 'float'>)", None),
    (fk.traced_dict_key, "dict-key", "key 8", None),
    (fk.traced_dict_read, "dict-key", "d[0]: key 0", KeyError),
])
def test_tracing_rules_are_checked_when_the_code_runs(kernel, rule, text, python_error):
    # not executed: accepted (the tracer never sees it)
    np.testing.assert_array_equal(kernel(_a(), False), _a())
    with pytest.raises(NkiFrontendError) as info:
        kernel(_a(), True)
    p, = info.value.problems
    assert p.rule == rule and p.line in _marker_lines(rule) and text in str(info.value), info.value
    assert str(info.value).startswith("NKI frontend check while tracing: ")
    # gather mode: no tracing checks, so Python's own behaviour (a clamped slice, a tuple isinstance) goes through
    with sim.checking(frontend="gather"):
        if python_error is None:
            np.testing.assert_array_equal(kernel(_a(), True), _a())
        else:
            with pytest.raises(python_error):
                kernel(_a(), True)


# (helper of frontend_kernels.py, rule, text of the detail): every construct KLR's tracer refuses when it evaluates it
TRACED_CASES = [
    ("_tr_enumerate", "builtin", "enumerate"), ("_tr_zip", "builtin", "zip"), ("_tr_sum", "builtin", "sum"),
    ("_tr_sorted", "builtin", "sorted"), ("_tr_any", "builtin", "any"), ("_tr_round", "builtin", "round"),
    ("_tr_getattr", "builtin", "getattr"), ("_tr_range_value", "builtin", "range"),
    ("_tr_dict_kwargs", "builtin-args", "dict(name=value)"), ("_tr_len_str", "builtin-args", "len of a str"),
    ("_tr_list_of_dict", "builtin-args", "list of a dict"), ("_tr_min_none", "builtin-args", "min over a NoneType"),
    ("_tr_divmod_float", "builtin-args", "divmod of float and int"),
    ("_tr_math_exp", "math", "math.exp"), ("_tr_math_log", "math", "math.log"), ("_tr_math_prod", "math", "math.prod"),
    ("_tr_list_insert", "method", "list has no 'insert'"), ("_tr_list_sort", "method", "list has no 'sort'"),
    ("_tr_list_count", "method", "list has no 'count'"), ("_tr_list_pop_index", "method", "list.pop with an index"),
    ("_tr_list_remove_twice", "method", "present 2 times"), ("_tr_dict_update", "method", "dict has no 'update'"),
    ("_tr_str_method", "method", "a str value has no attributes"),
    ("_tr_tuple_method", "method", "a tuple value has no attributes"),
    ("_tr_int_method", "method", "a int value has no attributes"),
    ("_tr_float_method", "method", "a float value has no attributes"),
    ("_tr_float_mod", "operator", "'%' on float and int"), ("_tr_float_aug_mod", "operator", "x %= 2: '%' on float"),
    ("_tr_bool_add", "operator", "'+' on bool and bool"), ("_tr_str_repeat", "operator", "'*' on str and int"),
    ("_tr_str_format", "operator", "'%' on str and int"), ("_tr_negative_power", "operator", "negative int power"),
    ("_tr_in_dict", "operator", "'in' on a dict"), ("_tr_tensor_add", "operator", "'+' on a tensor"),
    ("_tr_str_subscript", "subscript", "a str value"), ("_tr_negative_store", "subscript", "negative index -1"),
    ("_tr_slice_store", "subscript", "slice assignment into a list"), ("_tr_dict_get_int", "dict-key", "key 8"),
]


@pytest.mark.parametrize("helper,rule,text", TRACED_CASES)
def test_each_tracing_rule_is_refused_on_the_taken_path_only(helper, rule, text):
    fn = getattr(fk, helper)
    # in a branch never taken the tracer never evaluates it: accepted
    np.testing.assert_array_equal(fk.traced_case(_a(), fn, False), _a())
    with trace.recording() as rec, pytest.raises(NkiFrontendError) as info:
        fk.traced_case(_a(), fn, True)
    assert rec.count() == 0, "the construct runs before the kernel's first instruction"
    p, = info.value.problems
    assert p.rule == rule and p.line in _marker_lines(rule), (p, _marker_lines(rule))
    assert p.scope == helper and text in p.detail, info.value
    msg = str(info.value)
    assert msg.startswith("NKI frontend check while tracing: ") and f"frontend_kernels.py:{p.line}: " in msg
    assert frontend.RULES[rule][3] in msg and "__nki_attn_frontend__" not in msg
    # the helper is plain Python again after the launch
    assert fn.__code__.co_filename == fk.__file__ and "__nki_attn_frontend__" not in fn.__code__.co_names


def test_every_accepted_builtin_method_and_operator_runs_traced():
    # _ok_everything uses each builtin form, list/dict method, operator and subscript the tracer evaluates; the
    # instrumented run gives what plain Python gives
    expected = fk._ok_everything(_a())
    with sim.checking(strict=True, frontend="full"):
        out = fk.traced_ok(_a(), True)
    np.testing.assert_array_equal(out, np.float32(expected) * _a())


def test_class_members_behind_property_cached_property_and_staticmethod_are_gathered():
    err = _refused(fk.bad_members, _a())
    rules = sorted(p.rule for p in err.problems)
    assert rules == ["comprehension", "decorator", "decorator", "raise", "walrus"], err
    for p in err.problems:
        assert p.line in _marker_lines(p.rule), p
    assert "@property" in str(err) and "@functools.cached_property" in str(err)


def test_tracing_rules_in_an_lnc2_core():
    with pytest.raises(NkiFrontendError, match=r"pairs\[0:n\]: \[0:4\] on a list of length 3"):
        fk.traced_slice_lnc[2](_a())


def test_instrumented_code_is_put_back_after_every_launch():
    helper = fk._t_slice
    original = helper.__code__
    with pytest.raises(NkiFrontendError):
        fk.traced_slice(_a(), True)
    assert helper.__code__ is original
    fk.traced_slice(_a(), False)
    assert helper.__code__ is original
    # outside a launch the helper is plain Python: the slice clamps
    assert helper(None) == [1, 2]


def test_kernel_code_runs_instrumented_with_its_own_lines():
    # a traceback through instrumented code points at the kernel's source lines
    with pytest.raises(NkiFrontendError) as info:
        fk.traced_slice(_a(), True)
    frames = [(tb.tb_frame.f_code.co_name, tb.tb_lineno) for tb in _walk(info.value.__traceback__)]
    assert ("_t_slice", min(_marker_lines("slice-range"))) in frames


def _walk(tb):
    while tb is not None:
        yield tb
        tb = tb.tb_next


# ------------------------------------------------------------------------------------------- launch rules
def test_a_global_changed_between_calls_is_refused(monkeypatch):
    a = _a()
    np.testing.assert_array_equal(fk.reads_global(a), 2 * a)
    monkeypatch.setattr(fk, "MODE", "b")
    err = _refused(fk.reads_global, a)
    p, = err.problems
    assert p.rule == "global-changed" and "MODE was 'a' at the first call, now 'b'" in str(err)
    assert "Kernel Caching" not in str(err) and "pure functions of their arguments" in str(err)
    monkeypatch.setattr(fk, "MODE", "a")
    np.testing.assert_array_equal(fk.reads_global(a), 2 * a)


# ------------------------------------------------------------------------------------------- accepted code
def test_good_kernel_with_every_accepted_construct_runs_checked():
    a = _a()
    with sim.checking(strict=True, frontend="full"):
        out = fk.good_kernel(a)
    assert sim.last_launch_stats().frontend == "full"
    np.testing.assert_array_equal(out, 42 * a)
    g = frontend.gather(fk.good_kernel)
    assert not g.problems
    gathered = {d.name for d in g.definitions}
    # the defaults, the enum, both classes and their methods are gathered
    assert {"good_kernel", "_scale_by", "_apply", "Mode", "Plan", "Counter", "copy_out"} <= gathered


def test_gathering_skips_the_nki_api_and_caches_per_kernel():
    g = frontend.gather(fk.good_kernel)
    assert frontend.gather(fk.good_kernel) is g
    modules = {getattr(d.obj, "__module__", "") for d in g.definitions}
    assert modules == {fk.__name__}
    assert not any(r.label.startswith(("nl", "nisa", "nki")) for r in g.globals)


def test_host_code_next_to_a_kernel_is_not_gathered():
    # frontend_kernels.py holds refused constructs in functions no kernel of this test references
    g = frontend.gather(fk.reads_global)
    assert {d.name for d in g.definitions} == {"reads_global", "copy_out"}


def test_check_kernel_without_running_it():
    frontend.check_kernel(fk.good_kernel)
    with pytest.raises(NkiFrontendError, match="'raise' statement"):
        frontend.check_kernel(fk.bad_raise)


# ------------------------------------------------------------------------------------------- switches
def test_environment_switch(monkeypatch):
    monkeypatch.setenv("NKI_ATTN_SIM_FRONTEND", "0")
    np.testing.assert_array_equal(fk.bad_raise(_a()), _a())
    assert sim.last_launch_stats().frontend == "off"
    monkeypatch.setenv("NKI_ATTN_SIM_FRONTEND", "gather")
    _refused(fk.bad_raise, _a())
    np.testing.assert_array_equal(fk.traced_slice(_a(), True), _a())
    monkeypatch.setenv("NKI_ATTN_SIM_FRONTEND", "maybe")
    with pytest.raises(NkiValidationError, match="NKI_ATTN_SIM_FRONTEND='maybe' is not a frontend mode"):
        fk.good_kernel(_a())
    # checking() wins over the environment
    with sim.checking(frontend=True):
        _refused(fk.bad_raise, _a())
