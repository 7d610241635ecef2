"""README.md's code blocks run as written, and its generated figures match the committed reports.

Every ```python block runs in a fresh interpreter. Every `nki-attn ...` line of a ```bash block is parsed by the
real command-line parser (an unknown option or value fails), and the cheap ones run; the heavy ones (the full and
models presets, tens of minutes each) are only parsed, and the quick check and the profile command run under the
`slow` marker. The test command (CI's, run by `.ci/run`) is not re-run here: the test checks that `.ci/run` would
extract exactly it. The install half of each command is checked for the torch pin, the CPU wheel index and the
torch floor of pyproject.toml rather than run: running it would re-install the package under test.
"""
import importlib.util
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

from nki_attn.cli import build_parser

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
CPU_INDEX = "--extra-index-url https://download.pytorch.org/whl/cpu"


def _blocks(lang):
    return re.findall(rf"```{lang}\n(.*?)```", README.read_text(), flags=re.S)


def _after(marker):
    found = re.search(rf"<!-- {marker} -->\s*```bash\n(.*?)```", README.read_text(), flags=re.S)
    assert found, f"README has no bash block after <!-- {marker} -->"
    return found.group(1).strip()


def _figures():
    spec = importlib.util.spec_from_file_location("figures", ROOT / "scripts" / "figures.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _nki_attn_lines():
    """Each `nki-attn ...` invocation in the README's bash blocks, as argv after `nki-attn`."""
    found = []
    for block in _blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            for part in line.split("#", 1)[0].split("&&"):
                words = shlex.split(part)
                while words and "=" in words[0]:  # VAR=value prefixes
                    words = words[1:]
                if words and words[0] == "nki-attn":
                    found.append(words[1:])
    return found


@pytest.mark.parametrize("index", range(len(_blocks("python"))))
def test_readme_python_example_runs(index):
    code = _blocks("python")[index]
    if "transformers" in code:
        pytest.importorskip("transformers")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr


def test_the_first_screen_has_both_examples_and_they_are_short():
    code = _blocks("python")
    torch_ex = next(c for c in code if "nki_attn.flash_attn_func" in c)
    hf_ex = next(c for c in code if "attn_implementation=\"nki_attn\"" in c)
    text = README.read_text()
    assert text.index(torch_ex) < text.index(hf_ex) < text.index("\n## ")  # before the first section heading
    for ex in (torch_ex, hf_ex):
        assert len([line for line in ex.splitlines() if line.strip()]) <= 12


def test_every_nki_attn_command_parses():
    lines = _nki_attn_lines()
    assert ["check", "--preset", "quick", "-j", "2"] in lines and any(a[0] == "profile" for a in lines)
    parser = build_parser()
    for argv in lines:
        parser.parse_args(argv)  # SystemExit(2) on an unknown option or a bad value


def test_the_simulator_one_liner_runs():
    line = next(b.strip() for b in _blocks("bash") if "install_as_nki" in b)
    argv = shlex.split(line)
    assert argv[0] == "python"
    r = subprocess.run([sys.executable] + argv[1:], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr


def test_install_lines_pin_a_cpu_torch_within_the_declared_floor():
    pyproject = (ROOT / "pyproject.toml").read_text()
    floor = re.search(r'"torch>=(\d+)\.(\d+)"', pyproject)
    assert floor and (int(floor.group(1)), int(floor.group(2))) >= (2, 4)  # torch.library.custom_op
    for marker in ("quick-command", "test-command"):
        install = _after(marker).split("&&")[0]
        pin = re.search(r"torch==(\d+)\.(\d+)\.\d+", install)
        assert pin and (int(pin.group(1)), int(pin.group(2))) >= (int(floor.group(1)), int(floor.group(2)))
        assert CPU_INDEX in install and install.startswith("pip install ")


def test_ci_extracts_exactly_the_test_command():
    """.ci/run's awk program, run on the README, gives the block after the test-command marker."""
    script = (ROOT / ".ci" / "run").read_text()
    program = re.search(r"awk '(.*?)' README.md", script).group(1)
    r = subprocess.run(["awk", program, str(README)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == _after("test-command")
    assert r.stdout.strip().endswith("python -m pytest -q -n 2")


def test_generated_figures_are_up_to_date():
    """The README's times and preset rows are what `scripts/figures.py readme` writes from the committed reports."""
    fig = _figures()
    timings, reports = fig.load_timings(), fig.preset_reports()
    assert {"install", "quick", "suite"} <= set(timings), "each README command's time is recorded"
    text = README.read_text()
    assert fig.render(text, timings, reports) == text, "run: python scripts/figures.py readme write"
    for name, rep in reports.items():
        assert f"{name} ({rep['summary']['rows']} rows" in text
    assert fig.main(["readme", "check"]) == 0


def test_generated_sections_follow_the_reports(tmp_path):
    """Changing a committed report changes the README's figure: the text is derived, not typed."""
    fig = _figures()
    timings, reports = fig.load_timings(), fig.preset_reports()
    reports["full"] = dict(reports["full"], summary=dict(reports["full"]["summary"], rows=123, passed=123))
    timings["quick"] = dict(timings["quick"], seconds=61.0)
    out = fig.render(README.read_text(), timings, reports)
    assert "full (123 rows, 123 pass)" in out and "the quick check 61 s" in out


@pytest.mark.slow
def test_the_quick_command_runs(tmp_path):
    argv = shlex.split(_after("quick-command").split("&&")[1])
    assert argv[0] == "nki-attn"
    r = subprocess.run([sys.executable, "-m", "nki_attn.cli"] + argv[1:], capture_output=True, text=True,
                       timeout=1800, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert (tmp_path / "harness_report.json").exists()


@pytest.mark.slow
def test_the_profile_command_runs(tmp_path):
    argv = next(a for a in _nki_attn_lines() if a[0] == "profile")
    r = subprocess.run([sys.executable, "-m", "nki_attn.cli"] + argv, capture_output=True, text=True,
                       timeout=1800, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "bwd.json").exists() and (tmp_path / "bwd.png").exists()
