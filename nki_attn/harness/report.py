"""The harness report: JSON (schema in docs/harness.md) and a readable terminal table."""
import datetime
import json
import os
import platform
import re

SCHEMA_VERSION = 3
# Environment variables that change which BLAS kernels run (and so the summation order behind every error).
_BLAS_ENV = ("OPENBLAS_CORETYPE", "OPENBLAS_NUM_THREADS", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR", "MKL_NUM_THREADS",
             "OMP_NUM_THREADS", "ATEN_CPU_CAPABILITY")


def load_average():
    """1-minute load average (None where the OS does not report one): the machine is shared, so every time in a
    report comes with the load it was measured under."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def replace_marked_section(path, name, text):
    """Rewrite the part of the text file ``path`` between ``<!-- {name}:begin -->`` and ``<!-- {name}:end -->``
    with ``text`` (the markers stay): how scripts put their generated tables into the docs."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    doc = open(path).read()
    head, rest = doc.split(begin, 1)
    _, tail = rest.split(end, 1)
    with open(path, "w") as f:
        f.write(head + begin + "\n" + text + "\n" + end + tail)


def clip(text, width):
    """``text`` shortened to at most ``width`` characters at a word boundary, with "..." when cut (a single word
    longer than ``width`` is kept whole rather than cut mid-word)."""
    text = " ".join(str(text).split())
    if len(text) <= width:
        return text
    cut = text.rfind(" ", 0, max(width - 3, 1) + 1)
    if cut <= 0:
        cut = text.find(" ")
        return text if cut < 0 else text[:cut] + "..."
    return text[:cut].rstrip(" ,;:") + "..."


def cpu_model():
    """The CPU's model name (from /proc/cpuinfo on Linux, else the platform module)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def blas_info():
    """Which BLAS computed what: numpy's (the simulator's matmuls, so the kernels') and torch's (the golden's),
    with the CPU kernels each picked and the environment overrides in force."""
    info = {}
    try:
        import threadpoolctl
        pools = threadpoolctl.threadpool_info()
        info["numpy"] = [{k: p.get(k) for k in ("internal_api", "version", "architecture", "num_threads")}
                         for p in pools if p.get("user_api") == "blas"]
    except Exception as exc:  # noqa: BLE001 - informational only
        info["numpy"] = f"unknown ({type(exc).__name__})"
    try:
        import torch
        cfg = torch.__config__.show()
        found = re.search(r"BLAS_INFO=([\w.-]+)", cfg)
        blas = found.group(1) if found else None
        mkl = next((line.strip(" -") for line in cfg.splitlines() if "Math Kernel Library" in line), None)
        info["torch"] = {"version": torch.__version__, "blas": blas, "mkl": mkl,
                         "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                         "threads": torch.get_num_threads()}
    except Exception as exc:  # noqa: BLE001 - informational only
        info["torch"] = f"unknown ({type(exc).__name__})"
    info["env"] = {k: os.environ[k] for k in _BLAS_ENV if k in os.environ}
    return info


def machine_info():
    """The machine facts a report records: Python, platform, CPU model and count, BLAS libraries."""
    return {"python": platform.python_version(), "platform": platform.platform(), "cpu_model": cpu_model(),
            "cpus": os.cpu_count(), "blas": blas_info()}


def build(rows, meta, determinism=None, drift=None):
    """Assemble the report dict from row results and the optional determinism / drift verdicts.

    A row's ``status`` is pass, fail, error or unsupported (the candidate refused it); unsupported rows, and
    determinism or drift entries the candidate refused (``pass`` None), do not fail the run, but a run in which
    no row could be judged does. ``meta["candidate"]`` names what was judged.
    """
    for r in rows:  # rows from before schema 3 (or hand-made) carry only "pass"
        r.setdefault("status", "pass" if r["pass"] else ("error" if "error" in r else "fail"))
    failed = [r for r in rows if r["status"] in ("fail", "error")]
    unsupported = [r for r in rows if r["status"] == "unsupported"]
    judged = len(rows) - len(unsupported)
    ratios = [r["worst_ratio"] for r in rows if "worst_ratio" in r]
    ok = not failed and judged > 0 and all(d["pass"] is not False for d in determinism or []) and \
        (drift is None or drift["pass"] is not False)
    return {
        "schema_version": SCHEMA_VERSION,
        "tool": "nki-attn check",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        **meta,
        "rows": rows,
        "determinism": determinism,
        "drift": drift,
        "summary": {"candidate": meta.get("candidate"), "rows": len(rows), "judged": judged,
                    "passed": len(rows) - len(failed) - len(unsupported), "failed": len(failed),
                    "failed_rows": [r["case"]["name"] for r in failed], "unsupported": len(unsupported),
                    "unsupported_rows": [r["case"]["name"] for r in unsupported],
                    "worst_ratio": max(ratios) if ratios else None, "pass": ok,
                    "worst_vs_sdpa": worst_vs_sdpa(rows)},
    }


def worst_vs_sdpa(rows):
    """Per output (o, dq, dk, dv): the worst (largest) ratio of our relative Frobenius error to torch's SDPA math
    in the row's dtype over the 16-bit rows that have it, with its row: ``{output: [ratio, row name]}``."""
    worst = {}
    for r in rows:
        for name, o in (r.get("outputs") or {}).items():
            v = o.get("vs_sdpa")
            if v is not None and (name not in worst or v > worst[name][0]):
                worst[name] = [v, r["case"]["name"]]
    return worst


def write(report, path):
    """Write the report as JSON (NaN/inf kept as JSON extensions, as Python's json reads them)."""
    with open(path, "w") as f:
        json.dump(report, f, indent=1, allow_nan=True)


_COLS = ("o", "lse", "dq", "dk", "dv", "dsinks", "dbias")


def table(report, only_failing=False):
    """Terminal table: one line per row with each output's max abs error / allowed bound (rule 1; a trailing
    ``!`` marks an output that fails either rule), then the verdicts. ``only_failing`` lists only the rows that
    did not pass (a fuzz run's thousands of rows)."""
    lines = [f"candidate: {report.get('candidate', '?')}"]
    head = f"{'row':44s} " + " ".join(f"{c + ' err/bound':>17s}" for c in _COLS) + "  result"
    lines.append(head)
    lines.append("-" * len(head))
    for r in report["rows"]:
        name = r["case"]["name"][:44]
        status = r.get("status", "pass" if r["pass"] else "fail")
        if only_failing and status in ("pass", "unsupported"):
            continue
        if status in ("error", "unsupported"):
            lines.append(f"{name:44s} {status.upper()} {clip(r.get('error', ''), 160)}")
            continue
        cells = []
        for c in _COLS:
            o = r["outputs"].get(c)
            cells.append(f"{o['max_abs']:8.1e}/{o['bound']:7.1e}{'' if o['ok'] else '!'}" if o else f"{'-':>17s}")
        lines.append(f"{name:44s} " + " ".join(f"{x:>17s}" for x in cells) + f"  {status.upper()}")
    s = report["summary"]
    tail = f"\n{s['passed']}/{s['rows']} rows pass"
    if s.get("unsupported"):
        tail += f", {s['unsupported']} unsupported by the candidate (not judged)"
    if s.get("failed"):
        tail += f", {s['failed']} fail"
    if s["worst_ratio"] is not None:
        tail += f"; worst error/bound ratio {s['worst_ratio']:.3f} (either rule)"
    lines.append(tail)
    if s.get("worst_vs_sdpa"):
        lines.append("worst relative Frobenius error / torch SDPA math's in the row dtype: " + ", ".join(
            f"{k} {v[0]:.2f} ({v[1]})" for k, v in s["worst_vs_sdpa"].items()))
    if s.get("judged") == 0:
        lines.append("no row could be judged: the candidate refused every row")
    for d in report.get("determinism") or []:
        if d.get("status") == "unsupported":
            lines.append(f"determinism {d['case']}: unsupported by the candidate ({clip(d.get('error', ''), 120)})")
            continue
        lnc = d["lnc2_note"] if d.get("lnc2_note") else f"LNC2 equal: {d['lnc2_equal']}"
        lines.append(f"determinism {d['case']}: {d['identical_runs']}/{d['runs']} identical runs, {lnc} -> "
                     f"{'PASS' if d['pass'] else 'FAIL'}")
    dr = report.get("drift")
    if dr and dr.get("status") in ("unsupported", "error"):
        lines.append(f"drift: {dr['status']} ({clip(dr.get('error', ''), 160)})")
    elif dr:
        lines.append(f"drift {dr['steps']} steps: tail gap {dr['tail_mean_rel_gap']:.2e} (<= {dr['bound']['tail']}), "
                     f"max gap {dr['max_rel_gap']:.2e} (<= {dr['bound']['max']}) -> {'PASS' if dr['pass'] else 'FAIL'}")
    verdict = "PASS" if s["pass"] else "FAIL"
    if s.get("unsupported"):  # say how much was judged, so a refused row never reads as a passed one
        judged = s.get("judged", s["rows"] - s["unsupported"])
        verdict += f" ({judged} row{'' if judged == 1 else 's'}; {s['unsupported']} unsupported)"
    lines.append(f"OVERALL: {verdict} (candidate: {report.get('candidate', '?')})")
    return "\n".join(lines)
