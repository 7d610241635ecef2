"""``nki-attn check``: run harness rows (in parallel processes with -j), determinism and drift checks.

Usage errors (malformed --shapes, an unknown dtype, an output path that cannot be written) are reported by
argparse before any work, with exit status 2 and no traceback. Progress goes to stderr: a bar redrawn in place
on a terminal, one line per finished row (or determinism run, or drift stage) otherwise, so CI logs stay
readable. The table and the verdict go to stdout; the exit status is 0 only when everything asked passed.
"""
import argparse
import concurrent.futures
import multiprocessing
import os
import sys
import time

from . import candidate as _candidate
from . import cases as _cases
from . import fuzz as _fuzz
from . import report as _report


# ----------------------------------------------------------------------------------------------------- argument types
def positive_int(text):
    """argparse type: an int >= 1."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{v} must be >= 1")
    return v


def non_negative_int(text):
    """argparse type: an int >= 0."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"{v} must be >= 0")
    return v


def dtype_arg(text):
    """argparse type: either spelling of a dtype (bf16 / bfloat16, fp16 / float16, fp32 / float32) -> the long
    name."""
    try:
        return _cases.canonical_dtype(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def shape_arg(text):
    """argparse type: one --shapes entry -> (seqlen, d_head, heads)."""
    try:
        return _cases.parse_shape(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def writable_file_problem(path):
    """Why ``path`` cannot be written as a file (a sentence), or None when it can. Probes by opening it: an
    existing file is opened for appending (its content is untouched), a new one is created and removed."""
    if os.path.isdir(path):
        return f"{path} is a directory"
    parent = os.path.dirname(path) or "."
    if not os.path.isdir(parent):
        return f"directory {parent} of {path} does not exist"
    existed = os.path.exists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as exc:
        return f"{path} cannot be written ({exc.strerror or exc})"
    if not existed:
        os.remove(path)
    return None


def writable_dir_problem(path):
    """Why ``path`` cannot be used as an output directory, or None when it can (it is created if missing)."""
    if os.path.exists(path) and not os.path.isdir(path):
        return f"{path} exists and is not a directory"
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        return f"{path} cannot be created ({exc.strerror or exc})"
    return writable_file_problem(os.path.join(path, ".nki-attn-write-probe"))


def case_arg(text):
    """argparse type: one row as JSON (a report row's ``case``, or what a failing property test prints)."""
    try:
        return _cases.case_from_json(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows every default, except None (the option is simply off) which the help text explains."""

    def _get_help_string(self, action):
        if action.default is None or action.default is argparse.SUPPRESS or isinstance(action.default, bool):
            return action.help
        return super()._get_help_string(action)


# ----------------------------------------------------------------------------------------------------- parser
PRESET_HELP = ("row set: quick (every feature at small sizes; with -j 2 on 2 cores, 16 s idle to 50 s under load), "
               "full (realistic sizes up to 16K tokens; 10 min under load), models (real models' head shapes; "
               "29 min under load); README.md has the measured times, docs/harness.md the rows")


def add_parser(sub):
    """Register ``check`` on an argparse subparsers object."""
    p = sub.add_parser("check", help="check forward + backward kernels against the float64 golden",
                       description="Run harness rows: forward + backward kernels against a float64 golden with "
                                   "derived tolerances (docs/harness.md, docs/validation.md). Exit status 0 only "
                                   "when every row (and determinism/drift when asked) passes; 2 for usage errors.",
                       formatter_class=HelpFormatter)
    p.add_argument("--preset", default="quick", choices=sorted(_cases.PRESETS), help=PRESET_HELP)
    p.add_argument("--shapes", nargs="+", type=shape_arg, metavar="SxD[xH]",
                   help="build rows from shapes instead of a preset: seqlen (any length >= "
                        f"{_cases.MIN_SEQLEN}) x d_head [x heads, default 2], e.g. 1024x128 300x64x4")
    p.add_argument("--case", nargs="+", type=case_arg, metavar="JSON",
                   help="run exactly these rows, each the JSON of a report row's \"case\" (how a failing "
                        "property-test example is reproduced)")
    p.add_argument("--fuzz", type=positive_int, metavar="N",
                   help="instead of a preset, N random combinations of every feature (docs/harness.md, "
                        "\"Fuzzing\"); failing cases are printed as --case lines and shrunk")
    p.add_argument("--seed", type=non_negative_int, default=0, help="the --fuzz run's seed (case i of a seed is "
                                                                    "the same whatever N is)")
    p.add_argument("--shrink", type=non_negative_int, default=3, metavar="K",
                   help="with --fuzz, shrink the first K failing cases (0: none)")
    p.add_argument("--shrink-budget", type=positive_int, default=40, metavar="RUNS",
                   help="with --fuzz, at most RUNS reruns to shrink one failing case")
    p.add_argument("--dtypes", nargs="+", type=dtype_arg, metavar="DTYPE",
                   help="only these dtypes (float32|fp32, bfloat16|bf16, float16|fp16); with --shapes the default "
                        "is bfloat16")
    p.add_argument("--features", nargs="+", choices=_cases.FEATURES, metavar="FEATURE",
                   help="only these features (with --shapes the default is plain causal); one of: "
                        + ", ".join(_cases.FEATURES))
    p.add_argument("--candidate-bwd", metavar="MODULE:FUNCTION",
                   help="judge this backward kernel instead of ours: an importable module or a path to a .py file, "
                        "and the function, with the signature (q, k, v, o, dy, lse, sinks=None, bound_min=None, "
                        "bound_max=None, use_causal_mask=False, mixed_precision=..., softmax_scale=None, "
                        "sliding_window=None) -> (dq, dk, dv[, dsinks]); rows it refuses are reported as "
                        "unsupported (docs/harness.md, \"Validate your own kernel\")")
    p.add_argument("--candidate-fwd", metavar="MODULE:FUNCTION",
                   help="judge this forward kernel instead of ours (its o and lse also feed the backward): "
                        "(q, k, v, sinks, bound_min, bound_max, use_causal_mask=, mixed_precision=, "
                        "softmax_scale=, sliding_window=) -> (o, lse), or see --fwd-contract")
    p.add_argument("--fwd-contract", choices=_candidate.FWD_CONTRACTS, default="lse",
                   help="how --candidate-fwd is called: lse (our (o, lse) contract) or cte (the NKI Library's "
                        "attention_cte with cache_softmax=True, its -max and 1/sum turned into lse)")
    p.add_argument("-j", "--jobs", type=positive_int, default=1, help="rows in parallel processes")
    p.add_argument("--lnc", type=int, default=1, choices=(1, 2),
                   help="launch the kernels on 1 or 2 cores (a candidate kernel as kernel[2])")
    p.add_argument("--determinism", type=non_negative_int, nargs="?", const=10, default=0, metavar="N",
                   help="also require N bit-identical runs (N defaults to 10 when the flag has no value) and "
                        "LNC1 == LNC2; 0 skips the check")
    p.add_argument("--drift", type=non_negative_int, nargs="?", const=1000, default=0, metavar="STEPS",
                   help="also run the training-drift check for STEPS steps (1000 when the flag has no value); "
                        "0 skips it")
    p.add_argument("--out", default="harness_report.json", help="JSON report path")
    p.add_argument("--drift-dir", default=".", help="where drift.json and drift.png go")
    p.add_argument("--target", choices=("trn1", "trn2", "trn3"),
                   help="simulated generation (default: NEURON_PLATFORM_TARGET_OVERRIDE, else trn2)")
    p.set_defaults(func=main, _parser=p)
    return p


def validate(args, parser):
    """Usage checks that need more than one argument or the file system; parser.error (exit 2) on failure.
    Returns the selected rows."""
    problem = writable_file_problem(args.out)
    if problem:
        parser.error(f"--out: {problem}")
    if args.drift:
        problem = writable_dir_problem(args.drift_dir)
        if problem:
            parser.error(f"--drift-dir: {problem}")
    if args.lnc == 2 and (args.target or os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE")) == "trn1":
        parser.error("--lnc 2 needs trn2 or trn3 (trn1 has no LNC2)")
    if args.case and args.shapes:
        parser.error("--case and --shapes are alternatives: give one")
    if args.fuzz and (args.case or args.shapes or args.features):
        parser.error("--fuzz draws its own rows over every feature: give it without --case, --shapes or "
                     "--features (--dtypes narrows its dtypes)")
    args.candidate = _candidate_spec(args, parser)
    try:
        if args.fuzz:
            dtypes = [_cases.canonical_dtype(d) for d in args.dtypes] if args.dtypes else _fuzz.DTYPES
            rows = _fuzz.draw_many(args.fuzz, args.seed, dtypes)
        else:
            rows = list(args.case) if args.case else \
                _cases.select(None if args.shapes else args.preset, args.shapes, args.dtypes, args.features)
    except ValueError as exc:
        parser.error(str(exc))
    if not rows:
        parser.error("the options select no rows (check --dtypes / --features against the preset)")
    return rows


def _candidate_spec(args, parser):
    """The ``CandidateSpec`` the options name, its functions imported now so that a wrong MODULE:FUNCTION is a
    usage error before any work."""
    spec = _candidate.CandidateSpec(bwd=args.candidate_bwd, fwd=args.candidate_fwd, fwd_contract=args.fwd_contract)
    if args.fwd_contract != "lse" and not args.candidate_fwd:
        parser.error(f"--fwd-contract {args.fwd_contract} applies to --candidate-fwd, which is not given")
    for flag, value in (("--candidate-bwd", spec.bwd), ("--candidate-fwd", spec.fwd)):
        if value is None:
            continue
        try:
            fn = _candidate.load_function(value)
        except ValueError as exc:
            parser.error(f"{flag}: {exc}")
        if args.lnc == 2 and not _candidate.accepts_lnc(fn):
            parser.error(f"{flag}: --lnc 2 launches kernels as kernel[2], which {value} does not accept")
    return spec


# ----------------------------------------------------------------------------------------------------- progress
class Progress:
    """Progress on ``stream``: a bar redrawn with \\r on a terminal; otherwise one line per finished item."""

    def __init__(self, total, stream=None, label="rows"):
        self.total, self.done, self.label = total, 0, label
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.t0 = time.perf_counter()

    def finished(self, text):
        """One item finished: ``text`` says which and how it went (with the time left, estimated from the pace
        so far, on runs of more than 20 items)."""
        self.done += 1
        elapsed = time.perf_counter() - self.t0
        if self.total > 20 and self.done < self.total:
            text = f"{text} (~{elapsed / self.done * (self.total - self.done) / 60:.0f} min left)"
        if self.tty:
            width = 24
            filled = int(width * self.done / self.total) if self.total else width
            self.stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
                              f"{elapsed:6.1f}s {_report.clip(text, 60):60s}")
            if self.done == self.total:
                self.stream.write("\n")
        else:
            self.stream.write(f"[{self.label} {self.done}/{self.total} {elapsed:.1f}s] {text}\n")
        self.stream.flush()

    def note(self, text):
        """A message that is not an item (e.g. a stage starting): its own line in both modes."""
        self.stream.write(("\n" if self.tty and 0 < self.done < self.total else "") + text + "\n")
        self.stream.flush()


def _run_row(args):
    case, lnc, spec = args
    from .runner import run_case
    return run_case(case, _candidate.make(spec, lnc))


def _row_text(row):
    status = row.get("status", "pass" if row["pass"] else ("error" if "error" in row else "fail"))
    secs = f" {row['seconds']:.1f}s" if row.get("seconds") is not None else ""
    ratio = f" worst err/bound {row['worst_ratio']:.3f}" if "worst_ratio" in row else ""
    why = f" ({_report.clip(row['error'], 100)})" if status in ("error", "unsupported") and row.get("error") else ""
    return f"{row['case']['name']} {status.upper()}{ratio}{secs}{why}"


def run_rows(rows_in, jobs, lnc, progress, spec=None):
    """Run the rows of candidate ``spec`` (None: ours) in ``jobs`` processes when > 1; report rows in the order
    given."""
    rows = [None] * len(rows_in)
    work = [(c, lnc, spec) for c in rows_in]
    if jobs > 1:
        ctx = multiprocessing.get_context("fork")
        with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=ctx) as ex:
            futs = {ex.submit(_run_row, w): i for i, w in enumerate(work)}
            for fut in concurrent.futures.as_completed(futs):
                i = futs[fut]
                try:
                    rows[i] = fut.result()
                except Exception as exc:  # noqa: BLE001 - e.g. a worker killed for lack of memory
                    rows[i] = {"case": work[i][0].as_dict(), "status": "error", "pass": False, "seconds": None,
                               "error": f"worker process failed: {type(exc).__name__}: {exc}"}
                progress.finished(_row_text(rows[i]))
    else:
        for i, w in enumerate(work):
            rows[i] = _run_row(w)
            progress.finished(_row_text(rows[i]))
    return rows


def _determinism(args, rows_in, rows, spec):
    """The determinism check on the selection's first causal and first sinks row the candidate ran (a row it
    refused cannot be repeated)."""
    from .determinism import check_determinism
    target = os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    ran = [c for c, r in zip(rows_in, rows) if r.get("status") != "unsupported"]
    picks = [c for c in ran if c.causal][:1] + [c for c in ran if c.num_sinks][:1]
    picks = picks or ran[:1]
    if not picks:
        return []
    lnc_cmp = target != "trn1"
    prog = Progress(len(picks) * (args.determinism + lnc_cmp), label="determinism")
    cand = _candidate.make(spec, args.lnc)
    return [check_determinism(c, runs=args.determinism, candidate=cand, compare_lnc=lnc_cmp, progress=prog.finished)
            for c in picks]


def _drift(args, spec):
    """The drift check with our kernels through the PyTorch API, or a candidate's backward (and forward: the
    candidate's when given, else ours) through ``drift.CandidateAttention``."""
    from .drift import candidate_attention, check_drift, progress_steps
    prog = Progress(2 * len(progress_steps(args.drift)), label="drift")
    if spec.builtin:
        return check_drift(args.drift, args.drift_dir, progress=prog.finished)
    try:
        return check_drift(args.drift, args.drift_dir, attn=candidate_attention(_candidate.make(spec, args.lnc)),
                           progress=prog.finished, label=spec.describe())
    except _candidate.Unsupported as exc:
        return {"steps": args.drift, "status": "unsupported", "error": str(exc), "pass": None}
    except Exception as exc:  # noqa: BLE001 - a crash of the candidate fails the check, with its message
        return {"steps": args.drift, "status": "error", "error": f"{type(exc).__name__}: {exc}", "pass": False}


def _fuzz_failures(args, rows_in, rows, spec, seconds):
    """The report's ``fuzz`` section: the run's counts and coverage, and for each failing case its replay line;
    the first ``args.shrink`` of them shrunk (``fuzz.shrink``: reruns in this process, each judged like a row)
    to the smallest case that fails with the same status."""
    from .runner import run_case
    cand = _candidate.make(spec, args.lnc)
    failures = []
    bad = [(c, r) for c, r in zip(rows_in, rows) if r["status"] in ("fail", "error")]
    prog = Progress(min(len(bad), args.shrink), label="shrink")
    for k, (case, row) in enumerate(bad):
        entry = {"case": case.as_dict(), "status": row["status"], "replay": _fuzz.replay_line(case, spec, args.lnc),
                 "error": row.get("error"),
                 "failed_outputs": sorted(n for n, c in row.get("outputs", {}).items() if not c["ok"])}
        if k < args.shrink:
            small, calls = _fuzz.shrink(case, lambda c: run_case(c, cand)["status"] == row["status"],
                                        budget=args.shrink_budget)
            entry.update(shrunk=small.as_dict(), shrunk_replay=_fuzz.replay_line(small, spec, args.lnc),
                         shrink_runs=calls)
            prog.finished(f"{case.name} -> {', '.join(small.features)} s{small.seqlen_q}/{small.seqlen_k} "
                          f"d{small.d_head} ({calls} reruns)")
        failures.append(entry)
    return _fuzz.summary(rows, rows_in, args.seed, failures, round(seconds, 1))


def _fuzz_text(fz):
    """The fuzz run's lines after the table: counts, then each failure's replay line (and its shrunk one)."""
    c = fz["counts"]
    lines = [f"fuzz seed {fz['seed']}: {fz['n']} cases, {c['pass']} pass, {c['fail']} fail, {c['error']} error, "
             f"{c['unsupported']} unsupported ({fz['wall_seconds']} s)"]
    for reason, n in list(fz["unsupported_reasons"].items())[:8]:
        lines.append(f"  unsupported x{n}: {reason}")
    for f in fz["failures"]:
        lines.append(f"FAILED ({f['status']}{': ' + ', '.join(f['failed_outputs']) if f['failed_outputs'] else ''})"
                     f" replay: {f['replay']}")
        if "shrunk_replay" in f:
            lines.append(f"  shrunk ({f['shrink_runs']} reruns): {f['shrunk_replay']}")
    return "\n".join(lines)


def main(args):
    """Entry point of ``nki-attn check``; returns the exit status (usage errors exit 2 through argparse)."""
    parser = getattr(args, "_parser", None) or argparse.ArgumentParser(prog="nki-attn check")
    for name, default in (("candidate_bwd", None), ("candidate_fwd", None), ("fwd_contract", "lse"), ("fuzz", None),
                          ("seed", 0), ("shrink", 3), ("shrink_budget", 40)):
        if not hasattr(args, name):  # a Namespace built by hand (tests, scripts) without the candidate options
            setattr(args, name, default)
    rows_in = validate(args, parser)
    spec = args.candidate
    if args.target:
        os.environ["NEURON_PLATFORM_TARGET_OVERRIDE"] = args.target
    from ..backend import BACKEND
    load_start = _report.load_average()
    t0 = time.perf_counter()
    rows = run_rows(rows_in, args.jobs, args.lnc, Progress(len(rows_in), label="fuzz" if args.fuzz else "rows"),
                    spec)
    fuzz = _fuzz_failures(args, rows_in, rows, spec, time.perf_counter() - t0) if args.fuzz else None
    determinism = _determinism(args, rows_in, rows, spec) if args.determinism else None
    drift = _drift(args, spec) if args.drift else None
    meta = {"backend": BACKEND, "target": os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2"),
            "preset": None if (args.shapes or args.case or args.fuzz) else args.preset, "lnc": args.lnc,
            "jobs": args.jobs,
            "candidate": spec.describe(), "candidate_spec": None if spec.builtin else spec.as_dict(),
            "notes": sorted({c.note for c in rows_in if c.note}),
            "wall_seconds": round(time.perf_counter() - t0, 1),
            "load_average": {"start": load_start, "end": _report.load_average()}}
    rep = _report.build(rows, meta, determinism, drift)
    if fuzz is not None:
        rep["fuzz"] = fuzz
    _report.write(rep, args.out)
    print(_report.table(rep, only_failing=bool(args.fuzz)))
    if fuzz is not None:
        print(_fuzz_text(fuzz))
    print(f"report: {args.out}")
    return 0 if rep["summary"]["pass"] else 1
