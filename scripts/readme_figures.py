"""The README's figures (how long each command takes, how many rows each preset has), generated from committed
measurements so that they are never typed by hand.

    python scripts/readme_figures.py measure quick             # time `nki-attn check --preset quick -j 2`
    python scripts/readme_figures.py measure suite             # time the README's test run (pytest -q -n 2)
    python scripts/readme_figures.py measure install --python VENV/bin/python   # time the README's install
    python scripts/readme_figures.py write                     # rewrite README.md's generated sections
    python scripts/readme_figures.py check                     # exit 1 when README.md differs from `write`

``measure`` runs the command once, from the repository root, and records in ``TIMINGS`` its wall time, the 1-minute
load average at its start and end, the CPU and the date (the machine is shared, so every time comes with its load).
``measure install`` installs into the interpreter given by ``--python`` (a virtual environment: it must not replace
the package installed in the environment you work in). ``write`` fills the sections between
``<!-- readme-times:begin/end -->`` and ``<!-- readme-presets:begin/end -->`` from ``TIMINGS`` and the committed
harness reports (the rows per preset and the full and models runs' own times and loads).
"""
import argparse
import datetime
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repository's package, also when run from a checkout that is not installed

from nki_attn.harness.report import cpu_model, load_average, replace_marked_section  # noqa: E402

README = ROOT / "README.md"
# Where the committed reports live: the harness reports and this script's timings. The one place to change if
# they move.
REPORTS_DIR = ROOT / "reports"
TIMINGS = REPORTS_DIR / "readme_timings.json"
PRESET_REPORTS = {"full": "harness_report_full.json", "models": "harness_report_models.json"}

SEP = "&&"


def readme_command(marker):
    """The shell command in the first ```bash block after ``<!-- {marker} -->`` in README.md."""
    text = README.read_text()
    found = re.search(rf"<!-- {re.escape(marker)} -->\s*```bash\n(.*?)```", text, flags=re.S)
    if not found:
        raise SystemExit(f"README.md has no ```bash block after <!-- {marker} -->")
    return found.group(1).strip()


def _parts(marker):
    """README's `install && run` command split into its two halves."""
    install, run = readme_command(marker).split(SEP, 1)
    return install.strip(), run.strip()


def _measure(argv, env=None, cwd=ROOT):
    load0, t0 = load_average(), time.perf_counter()
    proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, env=env)
    seconds = round(time.perf_counter() - t0, 1)
    entry = {"command": " ".join(shlex.quote(a) for a in argv), "seconds": seconds,
             "load_average": {"start": load0, "end": load_average()}, "cpu_model": cpu_model(),
             "cpus": os.cpu_count(), "date": datetime.date.today().isoformat(), "exit_code": proc.returncode}
    return entry, proc


def measure(what, python=None):
    """Run one README command and return its timing entry (raises SystemExit when the command fails)."""
    if what == "quick":
        _, run = _parts("quick-command")
        argv = [sys.executable, "-m", "nki_attn.cli"] + shlex.split(run)[1:]  # `nki-attn` from this checkout
        env = dict(os.environ, PYTHONPATH=str(ROOT))
    elif what == "suite":
        _, run = _parts("test-command")
        argv = [sys.executable] + shlex.split(run)[1:]
        env = dict(os.environ, PYTHONPATH=str(ROOT))
    else:
        if not python:
            raise SystemExit("measure install needs --python: the interpreter of a virtual environment to install "
                             "into (not the one you work in)")
        install, _ = _parts("quick-command")
        argv = [python, "-m"] + shlex.split(install)
        env = None
    with tempfile.TemporaryDirectory() as tmp:  # the check writes harness_report.json where it runs
        entry, proc = _measure(argv, env, cwd=tmp if what == "quick" else ROOT)
    entry["command"] = install if what == "install" else run  # as the README prints it
    if proc.returncode != 0:
        raise SystemExit(f"{entry['command']} exited {proc.returncode}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    if what == "suite":
        counts = re.findall(r"(\d+) (passed|failed|skipped|xfailed|deselected)", proc.stdout.splitlines()[-1])
        entry["tests"] = {k: int(n) for n, k in counts}
    return entry


def load_timings():
    return json.loads(TIMINGS.read_text()) if TIMINGS.exists() else {}


def _duration(seconds):
    s = round(seconds)
    return f"{s} s" if s < 120 else f"{s // 60} min {s % 60:02d} s"


def _load(entry):
    la = entry.get("load_average") or {}
    if la.get("start") is None:
        return "load average not recorded"
    a, b = la["start"], la["end"]
    return f"load average {a:.0f}" if round(a) == round(b) else f"load average {a:.0f} to {b:.0f}"


def _where(entry):
    cpu = " ".join(w for w in str(entry.get("cpu_model") or "").split() if not w.startswith("(")) or "CPU unknown"
    cores = f"{entry['cpus']} cores" if entry.get("cpus") else "cores unknown"
    return f"{cpu}, {cores}, {_load(entry)}, {entry.get('date', 'date unknown')}"


def times_sentence(timings):
    """The first screen's sentence: how long the install, the quick check and the test suite took."""
    parts = []
    if "install" in timings:
        t = timings["install"]
        parts.append(f"the install {_duration(t['seconds'])} with every dependency already present ({_where(t)})")
    if "quick" in timings:
        t = timings["quick"]
        parts.append(f"the quick check {_duration(t['seconds'])} ({_where(t)})")
    if "suite" in timings:
        t = timings["suite"]
        n = sum(v for k, v in t.get("tests", {}).items() if k in ("passed", "failed", "skipped", "xfailed"))
        parts.append(f"the test suite {_duration(t['seconds'])} ({n:,} tests; {_where(t)})")
    return ("Real time of each, on machines shared with other jobs (1-minute load average at the start and end): "
            + "; ".join(parts) + ". Generated from `" + TIMINGS.relative_to(ROOT).as_posix()
            + "` by `python scripts/readme_figures.py write`; `measure` re-times a command.")


def preset_reports():
    return {name: json.loads((REPORTS_DIR / f).read_text()) for name, f in PRESET_REPORTS.items()}


def presets_paragraph(timings, reports):
    """The check section's paragraph: rows and time of each preset, from the timings and the committed reports."""
    items = []
    if "quick" in timings:
        t = timings["quick"]
        items.append(f"quick {_duration(t['seconds'])} with `-j 2` ({_where(t)})")
    for name, rep in reports.items():
        s = rep["summary"]
        where = _where({**rep["machine"], "load_average": rep["load_average"], "date": rep["created"][:10]})
        items.append(f"{name} ({s['rows']} rows, {s['passed']} pass) {_duration(rep['wall_seconds'])} with "
                     f"`-j {rep['jobs']}` ({where}; the committed report "
                     f"`{(REPORTS_DIR / PRESET_REPORTS[name]).relative_to(ROOT).as_posix()}`)")
    return ("Real times on machines shared with other jobs (1-minute load average at the start and end of each "
            "run; each report records its own): " + "; ".join(items) + ".")


SECTIONS = {"readme-times": lambda t, r: times_sentence(t), "readme-presets": presets_paragraph}


def render(text, timings, reports):
    """README text with every generated section rewritten."""
    for name, make in SECTIONS.items():
        begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        text = head + begin + "\n" + make(timings, reports) + "\n" + end + tail
    return text


def write():
    timings, reports = load_timings(), preset_reports()
    for name, make in SECTIONS.items():
        replace_marked_section(str(README), name, make(timings, reports))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure", help="time one README command and record it")
    m.add_argument("what", choices=["install", "quick", "suite"])
    m.add_argument("--python", help="(install) the interpreter of a virtual environment to install into")
    m.add_argument("--no-write", action="store_true", help="record the timing but leave README.md as it is")
    sub.add_parser("write", help="rewrite README.md's generated sections")
    sub.add_parser("check", help="exit 1 when README.md's generated sections are out of date")
    args = ap.parse_args(argv)
    if args.cmd == "measure":
        entry = measure(args.what, args.python)
        timings = load_timings()
        timings[args.what] = entry
        TIMINGS.write_text(json.dumps(timings, indent=1) + "\n")
        print(json.dumps(entry, indent=1))
        if not args.no_write:
            write()
        return 0
    if args.cmd == "write":
        write()
        return 0
    want = render(README.read_text(), load_timings(), preset_reports())
    if want != README.read_text():
        print("README.md's generated sections are out of date: run python scripts/readme_figures.py write",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
