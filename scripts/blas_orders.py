"""The harness's float32 rows under the BLAS kernels other CPUs would run: does the tolerance rule hold there?

    python scripts/blas_orders.py --write                  # run the four choices below, write the table
    python scripts/blas_orders.py --reuse DIR --write      # tabulate reports already in DIR (<name>.json)

Each choice runs ``nki-attn check --preset full --dtypes float32 -j 2`` in a subprocess with environment
variables that select the CPU kernels of numpy's OpenBLAS (the simulator's matmuls, hence the kernels') and of
torch's MKL (the golden's): the summation orders behind every error. The table goes into docs/tolerances.md
between its ``blas-orders`` markers.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHOICES = (
    ("default", {}),
    ("zen_avx2", {"OPENBLAS_CORETYPE": "Zen", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}),
    ("sandy_avx", {"OPENBLAS_CORETYPE": "Sandybridge", "MKL_ENABLE_INSTRUCTIONS": "AVX"}),
    ("prescott_sse", {"OPENBLAS_CORETYPE": "Prescott", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"}),
)


def run(out_dir):
    for name, env in CHOICES:
        out = os.path.join(out_dir, f"{name}.json")
        cmd = [sys.executable, "-m", "nki_attn.cli", "check", "--preset", "full", "--dtypes", "float32", "-j", "2",
               "--out", out]
        print(f"{' '.join(f'{k}={v}' for k, v in env.items())} {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
        subprocess.run(cmd, env={**os.environ, **env, "PYTHONPATH": ROOT}, cwd=ROOT, stdout=subprocess.DEVNULL,
                       check=False)


def table(out_dir):
    lines = ["| environment | numpy BLAS kernels | rows passing | worst err / bound (output) | worst dsinks "
             "err / bound | wall s (load) |", "|---|---|---|---|---|---|"]
    for name, env in CHOICES:
        rep = json.load(open(os.path.join(out_dir, f"{name}.json")))
        outs = [(o["max_abs"] / o["bound"], f"{r['case']['name']} {k}") for r in rep["rows"]
                for k, o in r.get("outputs", {}).items()]
        worst = max(outs)
        ds = max(x for x in outs if x[1].endswith("dsinks"))
        arch = ", ".join(f"{b['internal_api']} {b['architecture']}" for b in rep["machine"]["blas"]["numpy"])
        load = rep.get("load_average") or {}
        s = rep["summary"]
        lines.append(f"| {' '.join(f'`{k}={v}`' for k, v in env.items()) or 'none (this CPU)'} | {arch} | "
                     f"{s['passed']}/{s['rows']} | {worst[0]:.3f} ({worst[1]}) | {ds[0]:.3f} ({ds[1]}) | "
                     f"{rep['wall_seconds']} ({load.get('start')}-{load.get('end')}) |")
    m = json.load(open(os.path.join(out_dir, f"{CHOICES[0][0]}.json")))["machine"]
    lines += ["", f"Measured by `python scripts/blas_orders.py --write` on {m['cpu_model']} ({m['cpus']} CPUs; "
              f"torch MKL {m['blas']['torch'].get('mkl', '?').split(' for ')[0]}). The load is the 1-minute load "
              f"average at the start and end of each run (the machine is shared)."]
    return "\n".join(lines)


def write(text, path=os.path.join(ROOT, "docs", "tolerances.md")):
    from nki_attn.harness.report import replace_marked_section
    replace_marked_section(path, "blas-orders", text)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reuse", metavar="DIR", help="tabulate the reports in DIR instead of running")
    ap.add_argument("--write", action="store_true", help="write the table into docs/tolerances.md")
    args = ap.parse_args(argv)
    out_dir = args.reuse or tempfile.mkdtemp(prefix="blas-orders-")
    if not args.reuse:
        run(out_dir)
    text = table(out_dir)
    print(text)
    if args.write:
        write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
