"""``nki-attn check``: run harness rows (in parallel processes with -j), determinism and drift checks."""
import concurrent.futures
import multiprocessing
import os
import sys
import time

from . import cases as _cases
from . import report as _report


def add_parser(sub):
    p = sub.add_parser("check", help="check forward + backward kernels against the float64 golden",
                       description="Exit code 0 only when every row (and determinism/drift when asked) passes.")
    p.add_argument("--preset", default="quick", choices=sorted(_cases.PRESETS),
                   help="row set: quick (minutes), full (realistic sizes), models (real model shapes)")
    p.add_argument("--shapes", nargs="+", metavar="SxD[xH]", help="build rows from shapes instead of a preset")
    p.add_argument("--dtypes", nargs="+", choices=_cases.DTYPES, help="only these dtypes")
    p.add_argument("--features", nargs="+", choices=_cases.FEATURES, help="only these features")
    p.add_argument("-j", "--jobs", type=int, default=1, help="rows in parallel processes")
    p.add_argument("--lnc", type=int, default=1, choices=(1, 2), help="launch the kernels on 1 or 2 cores")
    p.add_argument("--determinism", type=int, nargs="?", const=10, default=0, metavar="N",
                   help="also require N (default 10) bit-identical runs and LNC1 == LNC2")
    p.add_argument("--drift", type=int, nargs="?", const=1000, default=0, metavar="STEPS",
                   help="also run the training-drift check for STEPS (default 1000) steps")
    p.add_argument("--out", default="harness_report.json", help="JSON report path")
    p.add_argument("--drift-dir", default=".", help="where drift.json and drift.png go")
    p.add_argument("--target", choices=("trn1", "trn2", "trn3"), help="simulated generation")
    p.set_defaults(func=main)
    return p


def _run_row(args):
    case, lnc = args
    from .runner import KernelCandidate, run_case
    return run_case(case, KernelCandidate(lnc=lnc))


def _progress(i, n, t0, text):
    width = 24
    done = int(width * i / n) if n else width
    sys.stderr.write(f"\r[{'#' * done}{'.' * (width - done)}] {i}/{n} {time.perf_counter() - t0:6.1f}s {text[:60]:60s}")
    sys.stderr.flush()


def main(args):
    if args.target:
        os.environ["NEURON_PLATFORM_TARGET_OVERRIDE"] = args.target
    from ..backend import BACKEND
    rows_in = _cases.select(None if args.shapes else args.preset, args.shapes, args.dtypes, args.features)
    if not rows_in:
        print("no rows selected", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    rows = [None] * len(rows_in)
    work = [(c, args.lnc) for c in rows_in]
    if args.jobs > 1:
        ctx = multiprocessing.get_context("fork")
        with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=ctx) as ex:
            futs = {ex.submit(_run_row, w): i for i, w in enumerate(work)}
            for n, fut in enumerate(concurrent.futures.as_completed(futs), 1):
                i = futs[fut]
                try:
                    rows[i] = fut.result()
                except Exception as exc:  # noqa: BLE001 - e.g. a worker killed for lack of memory
                    rows[i] = {"case": work[i][0].as_dict(), "pass": False, "seconds": None,
                               "error": f"worker process failed: {type(exc).__name__}: {exc}"}
                _progress(n, len(work), t0, f"{rows[i]['case']['name']} {'ok' if rows[i]['pass'] else 'FAIL'}")
    else:
        for i, w in enumerate(work):
            _progress(i, len(work), t0, w[0].name)
            rows[i] = _run_row(w)
        _progress(len(work), len(work), t0, "rows done")
    sys.stderr.write("\n")
    determinism = None
    if args.determinism:
        from .determinism import check_determinism
        target = os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
        picks = [c for c in rows_in if c.causal][:1] + [c for c in rows_in if c.num_sinks][:1]
        determinism = [check_determinism(c, runs=args.determinism, compare_lnc=target != "trn1")
                       for c in (picks or rows_in[:1])]
    drift = None
    if args.drift:
        from .drift import check_drift
        drift = check_drift(args.drift, args.drift_dir, progress=lambda s: sys.stderr.write(s + "\n"))
    meta = {"backend": BACKEND, "target": os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2"),
            "preset": None if args.shapes else args.preset, "lnc": args.lnc, "candidate": "nki-kernels",
            "notes": sorted({c.note for c in rows_in if c.note}), "wall_seconds": round(time.perf_counter() - t0, 1)}
    rep = _report.build(rows, meta, determinism, drift)
    _report.write(rep, args.out)
    print(_report.table(rep))
    print(f"report: {args.out}")
    return 0 if rep["summary"]["pass"] else 1
