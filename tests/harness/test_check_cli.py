"""``nki-attn check`` as a Unix tool: usage errors exit 2 before any work and without a traceback, progress is
one line per finished row off a terminal, both dtype spellings work, --help shows the defaults, and rows of any
length run."""
import io
import json
import subprocess
import sys

import pytest

from nki_attn import cli
from nki_attn.harness import cli as check_cli


def usage_error(argv, capsys):
    """Run ``nki-attn argv`` in process; assert argparse's exit status 2; return stderr."""
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if any row would run: usage errors must come before the work."""
    def boom(*a, **k):
        raise AssertionError("rows ran before the usage error was reported")
    monkeypatch.setattr(check_cli, "run_rows", boom)


@pytest.mark.parametrize("shape", ["1024", "1024x", "x64", "300x64x2x1", "abcx64", "300x0", "8x64", "-300x64"])
def test_malformed_shapes_are_usage_errors(shape, capsys, no_work):
    err = usage_error(["check", "--shapes", shape], capsys)
    assert "--shapes" in err and "Traceback" not in err


@pytest.mark.parametrize("argv,flag", [
    (["--out", "/nonexistent-dir-of-nki-attn/x.json"], "--out"),
    (["--out", "."], "--out"),
    (["--drift", "3", "--drift-dir", "/proc/nki-attn-not-creatable"], "--drift-dir"),
    (["--dtypes", "int8"], "--dtypes"),
    (["--features", "rope"], "--features"),
    (["-j", "0"], "--jobs"),
    (["--determinism", "-1"], "--determinism"),
    (["--lnc", "2", "--target", "trn1"], "--lnc"),
    (["--case", "{not json"], "--case"),
    (["--case", '{"name": "x", "bogus": 1}'], "--case"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else v)
def test_usage_errors_exit_2_before_any_work(argv, flag, capsys, no_work):
    err = usage_error(["check"] + argv, capsys)
    assert flag.lstrip("-").split("-")[0] in err and "Traceback" not in err


def test_usage_error_in_a_real_process_has_no_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "nki_attn.cli", "check", "--shapes", "1024",
                           "--out", str(tmp_path / "r.json")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "--shapes" in proc.stderr
    assert not (tmp_path / "r.json").exists()


def test_out_path_is_not_created_by_the_probe(tmp_path, capsys, no_work):
    out = tmp_path / "report.json"
    assert check_cli.writable_file_problem(str(out)) is None and not out.exists()
    assert "does not exist" in check_cli.writable_file_problem(str(tmp_path / "missing" / "r.json"))


def test_both_dtype_spellings(capsys):
    parser = cli.build_parser()
    short = parser.parse_args(["check", "--dtypes", "bf16", "fp16", "fp32"])
    long = parser.parse_args(["check", "--dtypes", "bfloat16", "float16", "float32"])
    assert short.dtypes == long.dtypes == ["bfloat16", "float16", "float32"]
    prof = [parser.parse_args(["profile", "--dtype", d]).dtype for d in ("bf16", "bfloat16", "FP16", "float32")]
    assert prof == ["bf16", "bf16", "fp16", "fp32"]


@pytest.mark.parametrize("sub,defaults", [
    ("check", ["(default: quick)", "(default: harness_report.json)", "(default: 1)"]),
    ("profile", ["(default: fwd)", "(default: 512)", "(default: bf16)", "(default: trn2)"]),
])
def test_help_shows_defaults(sub, defaults, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main([sub, "--help"])
    assert exc.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # undo argparse's line wrapping
    for d in defaults:
        assert d in out, d
    if sub == "check":
        assert "quick (every feature at small sizes; with -j 2 on 2 cores, 16 s" in out  # measured, not "minutes"


class _Stream(io.StringIO):
    def __init__(self, tty):
        super().__init__()
        self._tty = tty

    def isatty(self):
        return self._tty


def test_progress_is_one_line_per_row_off_a_terminal():
    s = _Stream(tty=False)
    p = check_cli.Progress(3, stream=s)
    for i in range(3):
        p.finished(f"row{i} PASS")
    lines = s.getvalue().splitlines()
    assert len(lines) == 3 and "\r" not in s.getvalue()
    assert lines[0].startswith("[rows 1/3 ") and lines[2].endswith("row2 PASS")


def test_progress_redraws_in_place_on_a_terminal():
    s = _Stream(tty=True)
    p = check_cli.Progress(2, stream=s)
    p.finished("a")
    p.finished("b")
    assert s.getvalue().count("\r") == 2 and s.getvalue().count("\n") == 1


def test_any_length_rows_with_progress_and_determinism(tmp_path, capsys):
    out = tmp_path / "r.json"
    code = cli.main(["check", "--shapes", "300x32", "--features", "causal", "sinks", "--dtypes", "fp32",
                     "--determinism", "2", "--out", str(out)])
    cap = capsys.readouterr()
    rep = json.loads(out.read_text())
    assert code == 0, cap.out
    assert [r["case"]["name"] for r in rep["rows"]] == ["causal-s300-d32-float32", "sinks-s300-d32-float32"]
    assert all("api" in r["case"]["features"] for r in rep["rows"])
    err = cap.err.splitlines()
    # pytest's capture is not a terminal: one line per finished row, then one per determinism run / LNC2 check
    assert sum(line.startswith("[rows ") for line in err) == 2 and "\r" not in cap.err
    assert sum(line.startswith("[determinism ") for line in err) == 2 * (2 + 1)
    assert rep["determinism"] and all(d["pass"] for d in rep["determinism"])
    assert rep["machine"]["cpu_model"] and rep["load_average"]["start"] is not None
