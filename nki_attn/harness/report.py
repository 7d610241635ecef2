"""The harness report: JSON (schema in docs/harness.md) and a readable terminal table."""
import datetime
import json
import os
import platform

SCHEMA_VERSION = 1


def build(rows, meta, determinism=None, drift=None):
    """Assemble the report dict from row results and the optional determinism / drift verdicts."""
    failed = [r for r in rows if not r["pass"]]
    ratios = [r["worst_ratio"] for r in rows if "worst_ratio" in r]
    ok = not failed and (determinism is None or all(d["pass"] for d in determinism)) and \
        (drift is None or drift["pass"])
    return {
        "schema_version": SCHEMA_VERSION,
        "tool": "nki-attn check",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"python": platform.python_version(), "platform": platform.platform(),
                    "cpus": os.cpu_count()},
        **meta,
        "rows": rows,
        "determinism": determinism,
        "drift": drift,
        "summary": {"rows": len(rows), "passed": len(rows) - len(failed), "failed": len(failed),
                    "failed_rows": [r["case"]["name"] for r in failed],
                    "worst_ratio": max(ratios) if ratios else None, "pass": ok},
    }


def write(report, path):
    with open(path, "w") as f:
        json.dump(report, f, indent=1, allow_nan=True)


_COLS = ("o", "lse", "dq", "dk", "dv", "dsinks")


def table(report):
    """Terminal table: one line per row with each output's max abs error / allowed bound, then the verdicts."""
    lines = []
    head = f"{'row':44s} " + " ".join(f"{c + ' err/bound':>17s}" for c in _COLS) + "  result"
    lines.append(head)
    lines.append("-" * len(head))
    for r in report["rows"]:
        name = r["case"]["name"][:44]
        if "error" in r:
            lines.append(f"{name:44s} ERROR {r['error'][:120]}")
            continue
        cells = []
        for c in _COLS:
            o = r["outputs"].get(c)
            cells.append(f"{o['max_abs']:8.1e}/{o['bound']:7.1e}{'' if o['ok'] else '!'}" if o else f"{'-':>17s}")
        lines.append(f"{name:44s} " + " ".join(f"{x:>17s}" for x in cells) + f"  {'PASS' if r['pass'] else 'FAIL'}")
    s = report["summary"]
    lines.append(f"\n{s['passed']}/{s['rows']} rows pass; worst error/bound ratio "
                 f"{s['worst_ratio']:.3f}" if s["worst_ratio"] is not None else "")
    for d in report.get("determinism") or []:
        lines.append(f"determinism {d['case']}: {d['identical_runs']}/{d['runs']} identical runs, LNC2 equal: "
                     f"{d['lnc2_equal']} -> {'PASS' if d['pass'] else 'FAIL'}")
    dr = report.get("drift")
    if dr:
        lines.append(f"drift {dr['steps']} steps: tail gap {dr['tail_mean_rel_gap']:.2e} (<= {dr['bound']['tail']}), "
                     f"max gap {dr['max_rel_gap']:.2e} (<= {dr['bound']['max']}) -> {'PASS' if dr['pass'] else 'FAIL'}")
    lines.append(f"OVERALL: {'PASS' if s['pass'] else 'FAIL'}")
    return "\n".join(lines)
