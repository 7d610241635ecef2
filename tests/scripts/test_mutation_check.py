"""scripts/mutation_check.py's own logic: target lookup, broken targets, scratch copies, outcome classification
and the exit status. The mutation suite itself is not run here (it takes tens of minutes: run it by hand)."""
import importlib.util
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load():
    spec = importlib.util.spec_from_file_location("mutation_check", os.path.join(ROOT, "scripts",
                                                                                 "mutation_check.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


mc = _load()


def _mut(old="X = 1", new="X = 2", path="pkg/mod.py", tests=("test_x.py",)):
    return mc.Mutation("m", path, old, new, "a planted bug", tests)


def test_apply_replaces_the_unique_snippet():
    assert mc.apply_mutation("A = 0\nX = 1\n", _mut()) == "A = 0\nX = 2\n"


@pytest.mark.parametrize("text,why", [("A = 0\n", "not found"), ("X = 1\nX = 1\n", "found 2 times")])
def test_missing_or_repeated_snippet_is_a_broken_target(text, why):
    with pytest.raises(mc.BrokenTarget, match=why):
        mc.apply_mutation(text, _mut())


def test_check_targets_names_every_broken_mutation(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text("X = 1\nY = 1\nY = 1\n")
    muts = [mc.Mutation("ok", "pkg/mod.py", "X = 1", "X = 2", "d", ["t"]),
            mc.Mutation("gone", "pkg/mod.py", "Z = 1", "Z = 2", "d", ["t"]),
            mc.Mutation("twice", "pkg/mod.py", "Y = 1", "Y = 2", "d", ["t"]),
            mc.Mutation("nofile", "pkg/other.py", "X = 1", "X = 2", "d", ["t"])]
    got = mc.check_targets(str(tmp_path), muts)
    assert got["ok"] is None
    assert "not found" in got["gone"]
    assert "found 2 times" in got["twice"]
    assert "does not exist" in got["nofile"]


def test_the_mutation_list_is_well_formed():
    assert len(mc.MUTATIONS) >= 22
    muts = mc.MUTATIONS + mc.PENDING
    names = [m.name for m in muts]
    assert len(set(names)) == len(names)
    # the five bugs an audit found the suite missed are all planted
    for k in range(1, 6):
        assert any(n.startswith(f"i19_{k}_") for n in names), k
    for m in muts:
        assert m.old != m.new and m.old and m.description and m.tests, m.name
        assert os.path.isfile(os.path.join(ROOT, m.path)), m.name
        for t in m.tests:
            assert os.path.isfile(os.path.join(ROOT, t.split("::")[0])), (m.name, t)


def test_select_by_name_and_glob():
    picked = mc.select(mc.MUTATIONS, "i19_*,f_lse_sign")
    names = [m.name for m in picked]
    assert len(names) == 6 and names[-1] == "f_lse_sign"
    assert all(n.startswith("i19_") for n in names[:5])
    with pytest.raises(SystemExit, match="matches no mutation"):
        mc.select(mc.MUTATIONS, "no_such_mutation")


def test_classify_pytest_outcomes():
    assert mc.classify(0, "3 passed") == ("survived", None)
    out = "F\nFAILED tests/a.py::test_x[change12-must be None or an int] - AssertionError: boom\n1 failed"
    assert mc.classify(1, out) == ("killed", "tests/a.py::test_x[change12-must be None or an int]")
    status, killer = mc.classify(2, "ERROR tests/a.py - ImportError\nInterrupted: 1 error during collection")
    assert status == "killed" and killer.startswith("collection error: tests/a.py")
    assert mc.classify(4, "ERROR: file or directory not found: tests/zz.py")[0] == "error"


def _results(*statuses):
    return [{"status": s} for s in statuses]


def test_kill_rate_and_exit_status():
    s = mc.summarize(_results("killed", "killed", "timeout", "survived"))
    assert (s["caught"], s["ran"]) == (3, 4) and s["kill_rate"] == pytest.approx(0.75)
    assert mc.exit_status(s, 1.0) == 1
    assert mc.exit_status(s, 0.75) == 0
    assert mc.exit_status(s, 0.75, baseline_ok=False) == 1
    # a broken target fails the run even when everything that ran was caught
    s = mc.summarize(_results("killed", "broken-target"))
    assert s["kill_rate"] == 1.0 and mc.exit_status(s, 1.0) == 1
    assert mc.exit_status(mc.summarize(_results("killed", "error")), 0.0) == 1


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_mutation_runs_in_a_scratch_copy_and_never_touches_the_tree(tmp_path):
    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    (repo / "pkg" / "__init__.py").write_text("")
    (repo / "pkg" / "mod.py").write_text("X = 0\n")
    (repo / "test_x.py").write_text("from pkg.mod import X\n\n\ndef test_x():\n    assert X == 1\n")
    (repo / ".gitignore").write_text("ignored.txt\n")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git + ["init", "-q"], check=True)
    subprocess.run(git + ["add", "."], check=True)
    subprocess.run(git + ["commit", "-q", "-m", "c"], check=True)
    # an uncommitted edit and an untracked file are copied; ignored files and .git are not
    (repo / "pkg" / "mod.py").write_text("X = 1\n")
    (repo / "extra.py").write_text("")
    (repo / "ignored.txt").write_text("")
    scratch = tmp_path / "scratch"
    mc.make_scratch(str(repo), str(scratch))
    assert (scratch / "pkg" / "mod.py").read_text() == "X = 1\n"
    assert (scratch / "extra.py").exists()
    assert not (scratch / "ignored.txt").exists() and not (scratch / ".git").exists()

    killed = mc.run_mutation(str(scratch), _mut(tests=["test_x.py"]), timeout=120)
    assert killed["status"] == "killed" and killed["killer"] == "test_x.py::test_x", killed["output"]
    equivalent = mc.run_mutation(str(scratch), _mut(old="X = 1\n", new="X = 1  # same\n", tests=["test_x.py"]),
                                 timeout=120)
    assert equivalent["status"] == "survived", equivalent["output"]
    broken = mc.run_mutation(str(scratch), _mut(old="X = 5"), timeout=120)
    assert broken["status"] == "broken-target"
    # the scratch file is restored after each run; the working tree was never written
    assert (scratch / "pkg" / "mod.py").read_text() == "X = 1\n"
    assert (repo / "pkg" / "mod.py").read_text() == "X = 1\n"
