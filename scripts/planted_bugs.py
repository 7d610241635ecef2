"""Planted bugs against the harness's tolerance rule, at every dtype: how far over its bound each one lands.

    python scripts/planted_bugs.py            # print the table
    python scripts/planted_bugs.py --write    # also write it into docs/tolerances.md (between its markers)

Bugs (as tests/harness/test_harness.py plants them): dQ scaled by 1.01, dK by 0.99, dV by 1.01; the sliding
window one key wider in forward and backward; dK = 0; and one unit in the last place of dQ on every other run
(jitter, for the determinism check). For each dtype and seqlen (256: the tests' rows; 2048: the full preset's)
the table gives the bugged output's ratio to rule 1's bound (error size) and to rule 2's (systematic error,
the projection of the error on the reference), > 1 meaning over; the seed's band, reported but not judged; the
verdict; and the correct kernels' two ratios on the same output, for comparison.
"""
import argparse
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nki_attn.harness import cases, report, runner, tolerance  # noqa: E402
from nki_attn.harness.determinism import check_determinism  # noqa: E402


class Planted:
    """The real kernels with a hook on the forward/backward keyword arguments and the backward's outputs."""

    def __init__(self, kw=None, post=None):
        self.inner = runner.KernelCandidate()
        self.kw = kw or (lambda k: k)
        self.post = post or (lambda r: r)

    def fwd(self, *a, **k):
        return self.inner.fwd(*a, **self.kw(dict(k)))

    def bwd(self, *a, **k):
        return self.post(list(self.inner.bwd(*a, **self.kw(dict(k)))))


def _scale(i, factor):
    def post(r):
        r[i] = r[i] * factor
        return r
    return post


def _zero_dk(r):
    r[1] = torch.zeros_like(r[1])
    return r


def _widen(k):
    k["sliding_window"] = k["sliding_window"] + 1
    return k


BUGS = (("dQ x 1.01", "causal", "dq", Planted(post=_scale(0, 1.01))),
        ("dK x 0.99", "causal", "dk", Planted(post=_scale(1, 0.99))),
        ("dV x 1.01", "causal", "dv", Planted(post=_scale(2, 1.01))),
        ("window off by one", "window", "o", Planted(kw=_widen)),
        ("dK = 0", "causal", "dk", Planted(post=_zero_dk)))


def _jitter_candidate():
    calls = {"n": 0}

    def post(r):
        calls["n"] += 1
        if calls["n"] % 2:
            r[0] = torch.nextafter(r[0], torch.full_like(r[0], float("inf")))
        return r
    return Planted(post=post)


def _ratios(o):
    r1, r2 = tolerance.ratios(o)
    return f"{r1:.2f}", (f"{r2:.2f}" if o["proj_applies"] else "n/a")


def _bold(text, over):
    return f"**{text}**" if over else text


def measure(seqlens=(256, 2048)):
    lines = ["| bug | dtype | seqlen | output | rule 1: err / bound | rule 2: systematic / bound | band: err / band "
             "(not judged) | verdict | correct kernels' ratios (rule 1, rule 2) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for s in seqlens:
        heads, d = (2, 64) if s <= 256 else (1, 128)
        for dt in cases.DTYPES:
            good = {}
            for label, feature, out, cand in BUGS:
                case = cases.feature_case(feature, s, d, dt, heads=heads)
                if feature not in good:
                    good[feature] = runner.run_case(case, runner.KernelCandidate())
                bad = runner.run_case(case, cand)
                o, g = bad["outputs"][out], good[feature]["outputs"][out]
                r1, r2 = _ratios(o)
                g1, g2 = _ratios(g)
                lines.append(f"| {label} | {dt} | {s} | {out} | {_bold(r1, not o['max_abs'] <= o['bound'])} | "
                             f"{_bold(r2, not o['proj_ok'])} | {o['max_abs'] / o['band_bound']:.2f} | "
                             f"{'caught' if not bad['pass'] else 'MISSED'} | {g1}, {g2} |")
                print(lines[-1], file=sys.stderr, flush=True)
            det = check_determinism(cases.feature_case("causal", s, d, dt, heads=heads), runs=3,
                                    candidate=_jitter_candidate(), compare_lnc=False)
            lines.append(f"| 1-ulp jitter of dQ | {dt} | {s} | dq | determinism: {det['identical_runs']}/3 runs "
                         f"identical | - | - | {'caught' if not det['pass'] else 'MISSED'} | - |")
            print(lines[-1], file=sys.stderr, flush=True)
    return lines


def write(table, path):
    report.replace_marked_section(path, "planted-bugs", table)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help="write the table into docs/tolerances.md")
    args = ap.parse_args(argv)
    load0, t0 = report.load_average(), time.perf_counter()
    lines = measure()
    m = report.machine_info()
    lines += ["", f"Measured by `python scripts/planted_bugs.py --write` on {m['cpu_model']} ({m['cpus']} CPUs, "
              f"Python {platform.python_version()}), {time.perf_counter() - t0:.0f} s at load average "
              f"{load0}-{report.load_average()}."]
    table = "\n".join(lines)
    print(table)
    if args.write:
        write(table, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                                  "tolerances.md"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
