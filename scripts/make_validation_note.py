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
    ("dropout through the PyTorch API", "the harness regenerates the kernels' keep mask from the seed it hands "
     "them; dropout rows therefore run the kernels directly (lengths that are multiples of 128)"),
    ("lengths that are not multiples of 128 in the kernels themselves", "the kernels refuse them; such rows "
     "(1000 and 300 tokens) run through the PyTorch API's padding path and are judged on the unpadded problem"),
    ("seqlen beyond 16384, and real models at their full length", "simulator time and the float64 golden's "
     "memory (about 9 GB at 16K for one head): the models preset caps seqlen at 4096 (each row says so); the "
     "full preset has one 16K causal row"),
    ("head_dim above 256", "refused by input validation"),
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
    from nki_attn.harness.report import replace_marked_section
    replace_marked_section(path, "harness-tolerances", table)


KEEP_MARK = "<!-- sections below are not generated: make_validation_note.py keeps them -->"


def _kept_sections(out):
    """The hand-maintained tail of the note (from KEEP_MARK on, e.g. the FlashAttention-reference check written by
    scripts/fa_reference_check.py's run), kept across regenerations; "" when there is none."""
    try:
        text = open(out).read()
    except OSError:
        return ""
    at = text.find(KEEP_MARK)
    return "\n" + text[at:] if at >= 0 else ""


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


U = {"float32": 2.0 ** -24, "bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}

# What the tables of the NKI Library's kernels mean, read from their source and from the rows (the numbers are in
# the tables): keyed by the function a candidate report names, shown under that report's table.
CANDIDATE_NOTES = {
    "attention_bwd:attention_bwd": [
        "The NKI Library's `attention_bwd` refuses every row whose key count is 384: its key tile is "
        "min(512, seqlen_k) and its key section (8192 keys for d_head <= 128) must be a multiple of that tile, so "
        "the unequal row (256 queries, 384 keys) and the 300-token rows (padded to 384 by the harness) are "
        "refused by its own input validation, not by a crash.",
    ],
    "attention_cte:attention_cte": [
        "The NKI Library's `attention_cte` computes its matmuls in bfloat16 whatever the input dtype (its "
        "docstring: float32 for the softmax, bfloat16 for the other operations). Its float32 and float16 rows "
        "therefore carry bfloat16-size errors (of the order of one bfloat16 unit roundoff of max|ref|, last "
        "column: hundreds of times the float32 bounds, a few times the float16 ones): the harness judges each "
        "row by its dtype, so they fail, and the backward they feed fails with them. This is a verdict on precision, not a crash; its bfloat16 rows pass.",
        "`empty_row` (packing that leaves query rows with no visible key): for such rows `attention_cte` returns "
        "o = the mean of v over the masked keys and -max = 3.4e38 (its mask fills scores with the most negative "
        "float32, and a softmax over equal scores is uniform), where the golden, like this project's kernels, "
        "gives o = 0 and lse = +inf. The backward fed that o and lse fails too.",
        "It refuses d_head above 128 (its own validation) and more than one sink per head (the adapter, which "
        "passes one sink column). Packing and windows run with q scaled on the host, as its range_select and "
        "sliding-window paths require scale = 1.",
    ],
}


def _notes(rep):
    """The notes of the functions a candidate report judged: the forward's when one is given (it feeds the
    backward, so it explains the rows), else the backward's; plus what the rows say."""
    spec = rep.get("candidate_spec") or {}
    name = spec.get("fwd") or spec.get("bwd") or ""
    out = [text for key, texts in CANDIDATE_NOTES.items() if name.endswith(key) for text in texts]
    s = rep["summary"]
    if s["failed"] == 0 and s["judged"]:
        dtypes = sorted({r["case"]["dtype"] for r in rep["rows"] if _status(r) == "pass"})
        feats = sorted({f for r in rep["rows"] if _status(r) == "pass" for f in r["case"]["features"]})
        out.append(f"Every row it accepts passes both rules ({', '.join(dtypes)}; {', '.join(feats)}), the "
                   f"tightest at {s['worst_ratio']:.2f} of a bound.")
    return out


def _why_failed(r):
    """A failing row's worst output: its error relative to max|ref|, in units of the row dtype's roundoff and of
    bfloat16's, beside the same-dtype baseline's (what separates arithmetic in another precision from a bug);
    or its count of values whose infinity is wrong (+inf expected where no key is visible, or NaN/inf made)."""
    dt = r["case"]["dtype"]
    bad = {n: o for n, o in r["outputs"].items() if o.get("nonfinite")}
    if bad:
        return "; ".join(f"{n}: {o['nonfinite']} values not +inf where the reference is, or not finite"
                         for n, o in bad.items())
    name, o = max(r["outputs"].items(), key=lambda kv: max(_ratios(kv[1])[0], _ratios(kv[1])[1] or 0))
    r1, r2 = _ratios(o)
    rule = "rule 1" if r1 >= (r2 or 0) else "rule 2"
    units = f"{o['max_rel'] / U[dt]:.3g} u({dt})" + ("" if dt == "bfloat16" else
                                                      f" = {o['max_rel'] / U['bfloat16']:.2f} u(bfloat16)")
    return (f"{max(r1, r2 or 0):.3g} x the bound ({rule}) on {name}: err {o['max_rel']:.1e} of max\\|ref\\| = "
            f"{units}; {dt} baseline {o['base_rel']:.1e}")


def _command(rep, path):
    """The command that makes a candidate report (the module must be importable: for the NKI Library, with
    PYTHONPATH=$NKI_LIBRARY/src/nkilib_src)."""
    spec = rep.get("candidate_spec") or {}
    cmd = f"nki-attn check --preset {rep.get('preset')} -j {rep.get('jobs', 1)}"
    if rep.get("lnc", 1) != 1:
        cmd += f" --lnc {rep['lnc']}"
    if spec.get("bwd"):
        cmd += f" --candidate-bwd {spec['bwd']}"
    if spec.get("fwd"):
        cmd += f" --candidate-fwd {spec['fwd']}"
        if spec.get("fwd_contract", "lse") != "lse":
            cmd += f" --fwd-contract {spec['fwd_contract']}"
    prefix = "PYTHONPATH=$NKI_LIBRARY/src/nkilib_src " if "nkilib" in (str(spec.get("bwd")) + str(spec.get("fwd"))) \
        else ""
    return f"{prefix}{cmd} --out {path}"


def candidate_section(rep, path):
    """The row-by-row verdict of one candidate report: per output rule-1 / rule-2 ratios, the row's margin, or
    why a row failed or was not judged."""
    s = rep["summary"]
    m = rep["machine"]
    load = rep.get("load_average") or {}
    spec = rep.get("candidate_spec") or {}
    outs = ("o", "lse", "dq", "dk", "dv", "dsinks")
    lines = [f"### {rep.get('candidate')}", "",
             "```bash", _command(rep, path), "```", "",
             f"Preset `{rep.get('preset')}`, backend `{rep['backend']}`, target `{rep['target']}`, "
             f"LNC {rep['lnc']}, created {rep['created']} on {m.get('cpu_model', '?')} ({m['cpus']} CPUs), "
             f"{rep.get('wall_seconds')} s with -j {rep.get('jobs', '?')} at load average {load.get('start', '?')}-"
             f"{load.get('end', '?')}. Backward: `{spec.get('bwd') or 'ours'}`; forward: "
             f"`{spec.get('fwd') or 'ours'}`" + (f" ({spec.get('fwd_contract')} contract)" if spec.get("fwd") else "")
             + ".", "",
             f"**{s['passed']} rows pass, {s['failed']} fail, {s.get('unsupported', 0)} unsupported** (of "
             f"{s['rows']}); overall {'PASS' if s['pass'] else 'FAIL'}. Each cell is err / rule-1 bound and "
             f"systematic error / rule-2 bound (n/a: too few vectors for rule 2); a passing row's margin is 1 - its "
             f"worst ratio.", "",
             "| row | status | " + " | ".join(outs) + " | margin, or why not |",
             "|---|---|" + "---|" * len(outs) + "---|"]
    for r in rep["rows"]:
        st = _status(r)
        if st in ("unsupported", "error"):
            cells = " | ".join("-" for _ in outs)
            lines.append(f"| {r['case']['name']} | {st} | {cells} | {_reason(r.get('error', ''))} |")
            continue
        cells = " | ".join(_cell(r["outputs"].get(o)) for o in outs)
        why = f"{1 - r['worst_ratio']:.2f}" if st == "pass" else _why_failed(r)
        lines.append(f"| {r['case']['name']} | {st} | {cells} | {why} |")
    notes = _notes(rep)
    return lines + ([""] + [f"- {t}" for t in notes] if notes else [])


def detection_limits(reports):
    """Per dtype, over the outputs o, dq, dk, dv of our kernels' rows: the smallest scaling of a whole output
    each rule is sure to catch, from each output's bound and the correct kernels' own error.

    A gradient scaled by 1 + eps errs by eps * |ref| plus the kernel's own error e, so its max error exceeds
    rule 1's bound for sure when eps > (bound + max|e|) / max|ref|; its projection is eps + c (c, the correct
    kernels' own projection), past rule 2's bound for sure when eps > proj_bound + |c|."""
    agg = defaultdict(lambda: {"r1": [], "r2": []})
    for rep in reports:
        for r in rep["rows"]:
            for name, o in r.get("outputs", {}).items():
                if name not in ("o", "dq", "dk", "dv") or not o.get("max_rel"):
                    continue
                where = f"{r['case']['name']} {name}"
                scale = o["max_abs"] / o["max_rel"]
                a = agg[r["case"]["dtype"]]
                a["r1"].append(((o["bound"] + o["max_abs"]) / scale, where))
                if o.get("proj_applies"):
                    a["r2"].append((o["proj_bound"] + abs(o["proj"]), where))
    lines = ["| dtype | outputs | rule 1 catches a scaling of (median; largest, where) | rule 2 catches a scaling "
             "of (median; largest, where) |", "|---|---|---|---|"]
    for dt in ("float32", "bfloat16", "float16"):
        a = agg[dt]
        if not a["r1"]:
            continue
        cells = []
        for key in ("r1", "r2"):
            v = sorted(a[key])
            cells.append(f"{100 * v[len(v) // 2][0]:.3g} %; {100 * v[-1][0]:.3g} % ({v[-1][1]})" if v else "-")
        lines.append(f"| {dt} | {len(a['r1'])} | {cells[0]} | {cells[1]} |")
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
        if rep.get("schema_version", 1) < 3:
            lines.append(f"- **an older report** (schema {rep.get('schema_version', 1)}): made by an earlier version of "
                         "the kernels and the harness, before the systematic-error rule (rule 2) and the current "
                         "band policy; its rows were judged by rule 1 and the band where required. Regenerate it "
                         "with the command in docs/harness.md to bring it up to date.")
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
    lines += ["## What these rows can and cannot detect", "",
              "Derived from each output's bounds (docs/harness.md, \"What the harness can and cannot detect\"): "
              "the smallest uniform scaling of a whole output (a dQ x 1.01 bug is 1 %) that each rule is sure to "
              "reject on these rows, given the kernels' own error there. Below rule 1's figure an error can hide "
              "in the size of the legitimate error; rule 2 sees scalings far smaller, but only scalings (and "
              "other errors correlated with the reference) of outputs with at least 25 effective vectors.", ""]
    lines += detection_limits(reports) + [""]
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
    kept = _kept_sections(out)
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n" + kept)
    update_tolerances(tolerance_table(reports, paths))
    print(f"wrote {out} and the harness table of docs/tolerances.md")


if __name__ == "__main__":
    main()
