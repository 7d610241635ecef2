"""Write docs/validation.md and the measured table of docs/tolerances.md from harness reports (the note the
validation method asks for: what was validated, on what, and what was not).

    nki-attn check --preset full -j 2 --out docs/harness_report_full.json
    nki-attn check --preset models -j 2 --out docs/harness_report_models.json
    python scripts/make_validation_note.py docs/harness_report_full.json docs/harness_report_models.json \
        --candidate docs/harness_report_nki_library.json --candidate docs/harness_report_nki_library_cte.json

Reports given with ``--candidate`` are runs of ``nki-attn check --candidate-bwd/--candidate-fwd`` on someone
else's kernels (docs/harness.md, "Validate your own kernel"): each gets a row-by-row verdict table of its own,
and they take no part in the summary of our kernels.
"""
import argparse
import json
import math
import re
import subprocess
from collections import defaultdict

SKIPPED = [
    ("dropout", "no kernel implements dropout yet (the torch API raises NotImplementedError for dropout_p > 0)"),
    ("two-sided / non-causal sliding windows", "the kernels support left windows with causal masking only"),
    ("causal with seqlen_q != seqlen_k in the kernels", "the kernels refuse it; the torch API expresses it "
     "through the packing bounds, which tests/api covers"),
    ("lengths that are not multiples of 128 in the kernels themselves", "the kernels refuse them; such rows "
     "(1000 and 300 tokens) run through the PyTorch API's padding path and are judged on the unpadded problem"),
    ("seqlen beyond 16384, and real models at their full length", "simulator time and the float64 golden's "
     "memory (about 9 GB at 16K for one head): the models preset caps seqlen at 4096 (each row says so); the "
     "full preset has one 16K causal row"),
    ("head_dim above 256, or not splittable into equal tiles of at most 128", "refused by input validation"),
    ("float8 inputs", "not supported by the kernels"),
    ("real Trainium hardware", "none available here: every row ran on the built-in simulator"),
]


def _ratios(o):
    """(rule-1 ratio, rule-2 ratio or None where rule 2 does not apply) of one output of a report row."""
    r1 = o["max_abs"] / o["bound"] if o["bound"] else 0.0
    if not o.get("proj_applies", False):
        return r1, None
    r2 = abs(o["proj"]) / o["proj_bound"] if math.isfinite(o["proj"]) else math.inf
    return r1, r2


def tolerance_table(reports, paths):
    """Per-dtype use of the harness's tolerance rules over all rows (for docs/tolerances.md)."""
    agg = defaultdict(lambda: {"n": 0, "worst": (0.0, ""), "n2": 0, "worst2": (0.0, ""), "band_over": 0,
                               "band": (0.0, "")})
    nrows = 0
    for rep in reports:
        for r in rep["rows"]:
            nrows += 1
            a = agg[r["case"]["dtype"]]
            for name, o in r.get("outputs", {}).items():
                where = f"{r['case']['name']} {name}"
                r1, r2 = _ratios(o)
                a["n"] += 1
                a["worst"] = max(a["worst"], (r1, where))
                if r2 is not None:
                    a["n2"] += 1
                    a["worst2"] = max(a["worst2"], (r2, where))
                band = o["max_abs"] / o["band_bound"]
                a["band_over"] += band > 1
                a["band"] = max(a["band"], (band, where))
    lines = [f"Measured on the committed reports ({', '.join(paths)}; {nrows} rows), by "
             f"`python scripts/make_validation_note.py {' '.join(paths)} ...`:", "",
             "| dtype | outputs judged | worst err / rule-1 bound (where) | outputs where rule 2 applies | worst "
             "systematic / rule-2 bound (where) | outputs over the seed's band (not judged) | largest err / band |",
             "|---|---|---|---|---|---|---|"]
    for dt in ("float32", "bfloat16", "float16"):
        a = agg[dt]
        lines.append(f"| {dt} | {a['n']} | {a['worst'][0]:.3f} ({a['worst'][1]}) | {a['n2']} | "
                     f"{a['worst2'][0]:.3f} ({a['worst2'][1]}) | {a['band_over']} | {a['band'][0]:.2f} |")
    return "\n".join(lines)


def update_tolerances(table, path="docs/tolerances.md"):
    begin, end = "<!-- harness-tolerances:begin -->", "<!-- harness-tolerances:end -->"
    text = open(path).read()
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    with open(path, "w") as f:
        f.write(head + begin + "\n" + table + "\n" + end + tail)


def _status(r):
    return r.get("status") or ("pass" if r["pass"] else ("error" if "error" in r else "fail"))


def _reason(text, limit=150):
    """A refusal's message without the compiler's boilerplate tags, shortened."""
    text = re.sub(r"\[[A-Z0-9_]+\]\s*", "", text)
    text = text.split(" - Please check")[0]
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _cell(o):
    if o is None:
        return "-"
    r1, r2 = _ratios(o)
    mark = "" if o["ok"] else " **FAIL**"
    return f"{r1:.2f} / {'n/a' if r2 is None else f'{r2:.2f}'}{mark}"


def candidate_section(rep, path):
    """The row-by-row verdict of one candidate report: per output rule-1 / rule-2 ratios, or why a row was not
    judged."""
    s = rep["summary"]
    m = rep["machine"]
    load = rep.get("load_average") or {}
    spec = rep.get("candidate_spec") or {}
    outs = ("o", "lse", "dq", "dk", "dv", "dsinks")
    lines = [f"### {rep.get('candidate')}", "",
             f"`{path}`: preset `{rep.get('preset')}`, backend `{rep['backend']}`, target `{rep['target']}`, "
             f"LNC {rep['lnc']}, created {rep['created']} on {m.get('cpu_model', '?')} ({m['cpus']} CPUs), "
             f"{rep.get('wall_seconds')} s with -j {rep.get('jobs', '?')} at load average {load.get('start', '?')}-"
             f"{load.get('end', '?')}. Backward: `{spec.get('bwd') or 'ours'}`; forward: "
             f"`{spec.get('fwd') or 'ours'}`" + (f" ({spec.get('fwd_contract')} contract)" if spec.get("fwd") else "")
             + ".", "",
             f"**{s['passed']} rows pass, {s['failed']} fail, {s.get('unsupported', 0)} unsupported** (of "
             f"{s['rows']}); overall {'PASS' if s['pass'] else 'FAIL'}. Each cell is err / rule-1 bound and "
             f"systematic error / rule-2 bound (n/a: too few vectors for rule 2); margin = 1 - the row's worst "
             f"ratio.", "",
             "| row | status | " + " | ".join(outs) + " | margin / why not judged |",
             "|---|---|" + "---|" * len(outs) + "---|"]
    for r in rep["rows"]:
        st = _status(r)
        if st in ("unsupported", "error"):
            cells = " | ".join("-" for _ in outs)
            lines.append(f"| {r['case']['name']} | {st} | {cells} | {_reason(r.get('error', ''))} |")
            continue
        cells = " | ".join(_cell(r["outputs"].get(o)) for o in outs)
        lines.append(f"| {r['case']['name']} | {st} | {cells} | {1 - r['worst_ratio']:.2f} |")
    return lines


def main(argv=None, out="docs/validation.md"):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("reports", nargs="+", help="harness reports of our kernels (full, models)")
    ap.add_argument("--candidate", action="append", default=[], metavar="REPORT",
                    help="a report of nki-attn check --candidate-bwd/--candidate-fwd (repeatable)")
    args = ap.parse_args(argv)
    paths = args.reports
    reports = [json.load(open(p)) for p in paths]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    command = " ".join(["python scripts/make_validation_note.py"] + paths +
                       [f"--candidate {c}" for c in args.candidate])
    lines = ["# Validation note", "",
             f"Generated by `{command}` from the harness reports committed beside it. Every number below comes "
             "from those reports.", ""]
    worst = (0.0, None, None)
    for rep, path in zip(reports, paths):
        s = rep["summary"]
        m = rep["machine"]
        load = rep.get("load_average") or {}
        blas = m.get("blas") or {}
        numpy_blas = ", ".join(f"{b.get('internal_api')} {b.get('version')} ({b.get('architecture')} kernels)"
                               for b in blas.get("numpy") or [] if isinstance(b, dict)) or "unknown"
        torch_blas = blas.get("torch") if isinstance(blas.get("torch"), dict) else {}
        lines += [f"## `{path}`", "",
                  f"- preset `{rep.get('preset')}`, backend `{rep['backend']}`, target `{rep['target']}`, "
                  f"LNC {rep['lnc']}, created {rep['created']}, candidate `{rep.get('candidate')}`",
                  f"- machine: {m.get('cpu_model', '?')}, {m['cpus']} CPUs, Python {m['python']}; numpy BLAS "
                  f"{numpy_blas} (the simulator's matmuls); torch {torch_blas.get('version', '?')} with "
                  f"{torch_blas.get('blas', '?')} ({torch_blas.get('cpu_capability', '?')}) (the golden)"
                  + (f"; BLAS environment {blas['env']}" if blas.get("env") else ""),
                  f"- wall time {rep.get('wall_seconds')} s with -j {rep.get('jobs', '?')}, 1-minute load average "
                  f"{load.get('start', '?')} at the start and {load.get('end', '?')} at the end (shared machine)",
                  f"- **{s['passed']}/{s['rows']} rows pass**; worst ratio to a bound (either rule) "
                  f"{s['worst_ratio']:.3f}" + ("" if s["pass"] else f"; FAILED: {s['failed_rows']}"), ""]
        for n in rep.get("notes") or []:
            lines.append(f"- note: {n}")
        by_dtype = defaultdict(list)
        for r in rep["rows"]:
            by_dtype[r["case"]["dtype"]].append(r)
        lines += ["", "| dtype | rows | shapes (seqlen_q x seqlen_k, d_head, heads/kv) | features | worst ratio |",
                  "|---|---|---|---|---|"]
        for dt, rows in sorted(by_dtype.items()):
            shapes = sorted({f"{r['case']['seqlen_q']}x{r['case']['seqlen_k']} d{r['case']['d_head']} "
                             f"{r['case']['heads']}/{r['case']['kv_heads']}" for r in rows})
            feats = sorted({f for r in rows for f in r["case"]["features"]})
            ratio = max(r.get("worst_ratio", float("inf")) for r in rows)
            lines.append(f"| {dt} | {len(rows)} | {'; '.join(shapes)} | {', '.join(feats)} | {ratio:.3f} |")
            for r in rows:
                if r.get("worst_ratio", float("inf")) >= worst[0]:
                    worst_out = max(r.get("outputs", {}).items(), key=lambda kv: max(_ratios(kv[1])[0],
                                                                                      _ratios(kv[1])[1] or 0),
                                    default=(None, None))
                    rule = None
                    if worst_out[1] is not None:
                        r1, r2 = _ratios(worst_out[1])
                        rule = "rule 1, error size" if r1 >= (r2 or 0) else "rule 2, systematic error"
                    worst = (r.get("worst_ratio", float("inf")), r["case"]["name"], worst_out[0], rule)
        for d in rep.get("determinism") or []:
            lines.append(f"\n- determinism `{d['case']}`: {d['identical_runs']}/{d['runs']} bit-identical runs, "
                         f"LNC2 equal to LNC1: {d['lnc2_equal']}")
        if rep.get("drift"):
            dr = rep["drift"]
            lines.append(f"\n- drift {dr['steps']} steps: tail gap {dr['tail_mean_rel_gap']:.2e}, max gap "
                         f"{dr['max_rel_gap']:.2e} -> {'pass' if dr['pass'] else 'FAIL'}")
        lines.append("")
    lines += ["## Worst case", "",
              f"The largest ratio to a bound over all rows is **{worst[0]:.3f}** (row `{worst[1]}`, output "
              f"`{worst[2]}`, {worst[3]}): the kernels' error is at most that fraction of what the tolerance "
              f"rules allow.", ""]
    if args.candidate:
        lines += ["## Other people's kernels, judged by the same harness", "",
                  "Runs of `nki-attn check --candidate-bwd / --candidate-fwd` (docs/harness.md, \"Validate your own "
                  "kernel\") on kernels that are not part of this repository, unmodified, on the same simulator "
                  "and under the same rules. A row is `unsupported` when the kernel refused its arguments (an "
                  "assert of its input validation, or a signature without the parameter), `fail` or `error` when "
                  "it ran and was wrong or crashed.", ""]
        for path in args.candidate:
            lines += candidate_section(json.load(open(path)), path) + [""]
    lines += ["## Not validated, and why", ""]
    lines += [f"- {what}: {why}" for what, why in SKIPPED]
    lines += ["", f"Code at commit `{commit}` (the commit before the one adding this note and the reports)."]
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")
    update_tolerances(tolerance_table(reports, paths))
    print(f"wrote {out} and the harness table of docs/tolerances.md")


if __name__ == "__main__":
    main()
