"""Figures of the backward kernel from the simulator's instruction trace (docs/kernel-bwd.md, "Figures").

    python scripts/bwd_figures.py            # print the tables (a few minutes on one core)
    python scripts/bwd_figures.py --write    # also replace the generated block in docs/kernel-bwd.md
    python scripts/bwd_figures.py --tolerances [--write]   # the accuracy sweep of docs/tolerances.md

1. causal vs non-causal matmul columns (TensorE work) at seqlen 4096 (bs 1, 1 head, d_head 64): trace-time tile
   skipping and chunk trimming must bring the ratio to <= 0.55;
2. total instruction count, causal with sliding window 512, seqlen 4096 -> 8192: the work per query tile is
   bounded by the window, so the count must grow linearly (ratio <= 2.1);
3. the D = rowsum(O * dO) reduction (the kernel's only one-column matmuls, one per (query head, query tile) and
   head-dim tile) runs once per (query head, query tile), whatever the number of K/V sections;
4. the SBUF bytes per partition and PSUM banks for d_head 64, 128, 256 against trn1 / trn2 capacity;
5. the same, measured by the simulator's capacity bookkeeping at one full section.

Instruction counts do not depend on the values, so the inputs are zeros (lse = 0): no reference is needed.
"""
import argparse
import os
import re
import sys
import time

import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from nki_attn.kernels import attention_bwd as kb  # noqa: E402
from nki_attn.sim import checks, trace  # noqa: E402
from nki_attn.sim.context import SBUF_BYTES_PER_PARTITION  # noqa: E402

DOC = os.path.join(os.path.dirname(__file__), "..", "docs", "kernel-bwd.md")
BEGIN, END = "<!-- bwd-figures:begin -->", "<!-- bwd-figures:end -->"
TOL_DOC = os.path.join(os.path.dirname(__file__), "..", "docs", "tolerances.md")
TOL_BEGIN, TOL_END = "<!-- bwd-tolerances:begin -->", "<!-- bwd-tolerances:end -->"

# The accuracy sweep: 13 shapes x 3 seeds per (dtype, mixed_precision).
SWEEP = [dict(), dict(causal=True), dict(scale=0.3), dict(scale=1.0, causal=True),
         dict(scale=1.0, d=128, causal=True), dict(causal=True, window=100),
         dict(cu=[0, 100, 250, 384], sq=384, causal=True), dict(h=4, hk=1), dict(d=256),
         dict(d=128, sq=512, causal=True), dict(sinks=2, h=2), dict(sq=256, sk=512),
         dict(sq=512, causal=True, section=128)]


def count(seqlen, d=64, h=1, causal=False, window=None, section=None, dtype=np.float32):
    """Instruction counts of one traced call: by instruction name, plus ``instructions`` (all), ``mm_columns``
    (matmul columns streamed: TensorE work), ``exp`` (exp activations: the only ones with a tensor bias) and
    ``d_matmuls`` (one-column matmuls: the D sums)."""
    z = np.zeros((1, h, d, seqlen), dtype)
    lse = np.zeros((1, h, 128, seqlen // 128), np.float32)
    t0 = time.time()
    with trace.recording() as rec:
        kb.attention_bwd(z, z[:, :1], z[:, :1], z, z, lse, use_causal_mask=causal, sliding_window=window,
                         k_section_len=section)
    secs = time.time() - t0
    c = dict(rec.counts_by_instruction())
    c["instructions"] = len(rec.records)
    mm = [r for r in rec.records if r.instr == "nc_matmul" and not r.is_transpose]
    c["mm_columns"] = sum(r.dst.free_elems for r in mm)
    c["d_matmuls"] = sum(1 for r in mm if r.dst.free_elems == 1)
    c["exp"] = sum(1 for r in rec.records if r.instr == "activation" and len(r.srcs) == 2)
    return c, secs


def figures():
    lines = []
    os.environ.setdefault("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")

    nc, t_nc = count(4096)
    ca, t_ca = count(4096, causal=True)
    r1 = ca["mm_columns"] / nc["mm_columns"]
    lines += ["**1. Causal tile skipping** (seqlen 4096, bs 1, 1 head, d_head 64, float32, trn2):", "",
              "| | non-causal | causal | ratio |", "|---|---|---|---|",
              f"| matmul columns (TensorE work) | {nc['mm_columns']} | {ca['mm_columns']} | **{r1:.3f}** "
              f"(limit 0.55) |",
              f"| nc_matmul | {nc['nc_matmul']} | {ca['nc_matmul']} | {ca['nc_matmul'] / nc['nc_matmul']:.3f} |",
              f"| all instructions | {nc['instructions']} | {ca['instructions']} | "
              f"{ca['instructions'] / nc['instructions']:.3f} |",
              f"| exp activations (= (q tile, k tile) pairs) | {nc['exp']} | {ca['exp']} | "
              f"{ca['exp'] / nc['exp']:.3f} |",
              f"| simulator time | {t_nc:.1f} s | {t_ca:.1f} s | |", ""]

    lines += ["**2. Sliding window 512, causal, seqlen 4096 -> 8192** (bs 1, 1 head, d_head 64):", "",
              "| dtype (K/V sections at 8192) | instructions 4096 | instructions 8192 | ratio | nc_matmul ratio | "
              "simulator time 4096 / 8192 |", "|---|---|---|---|---|---|"]
    r2 = 0.0
    for name, dt in (("float32", np.float32), ("bfloat16", ml_dtypes.bfloat16)):
        w4, t4 = count(4096, causal=True, window=512, dtype=dt)
        w8, t8 = count(8192, causal=True, window=512, dtype=dt)
        r = w8["instructions"] / w4["instructions"]
        r2 = max(r2, r)
        n_sec = -(-8192 // kb.default_section_len(64, 1, np.dtype(dt).itemsize, 8192))
        lines.append(f"| {name} ({n_sec}) | {w4['instructions']} | {w8['instructions']} | **{r:.3f}** (limit 2.1) | "
                     f"{w8['nc_matmul'] / w4['nc_matmul']:.3f} | {t4:.1f} s / {t8:.1f} s |")
    lines.append("")

    d_rows = []
    for sec in (8192, 1024, 512):
        c, _ = count(2048, h=2, causal=True, section=sec)
        n_sec = -(-2048 // min(sec, kb.default_section_len(64, 1, 4, 2048)))
        d_rows.append(f"| {n_sec} | {c['d_matmuls']} | {2 * 2048 // 128} | {c['mm_columns']} |")
    lines += ["**3. D = rowsum(O*dO) once per (query head, query tile)** (seqlen 2048, 2 query heads on 1 kv head, "
              "causal, d_head 64; D is summed over the head dim by one-column matmuls against a ones vector, one per "
              "(query head, query tile), the kernel's only one-column matmuls):", "",
              "| K/V sections | D matmuls | query heads x query tiles | matmul columns |", "|---|---|---|---|",
              *d_rows, ""]

    lines += ["**4. SBUF bytes per partition and PSUM banks** (section length chosen by the kernel; per-row "
              "statistics for 8 query heads per kv head at seqlen_q 16384; working set counted twice for "
              "double buffering):", "",
              "| d_head | dtype | section keys | section | per-row stats | working set x2 | total | trn1 180224 | "
              "trn2 212984 | PSUM banks |", "|---|---|---|---|---|---|---|---|---|---|"]
    for d in (64, 128, 256):
        tiles = -(-d // 128)
        for name, isz in (("bfloat16", 2), ("float32", 4)):
            sec = kb.default_section_len(d, tiles, isz, 1 << 20)
            u = kb.sbuf_usage(d, tiles, isz, sec, 8, 16384, mixed_precision=(isz == 2))
            work = 2 * (u["per_block"] + u["per_group"] + u["per_visit"])
            lines.append(f"| {d} | {name}{' (mixed)' if isz == 2 else ''} | {sec} | {u['section']} | "
                         f"{u['persistent']} | {work} | {u['total']} | "
                         f"{'fits' if u['total'] <= SBUF_BYTES_PER_PARTITION[2] else 'NO'} | "
                         f"{'fits' if u['total'] <= SBUF_BYTES_PER_PARTITION[3] else 'NO'} | "
                         f"{kb.psum_banks(tiles)} of 8 |")
    lines.append("")

    lines += ["**5. Simulator-measured peaks** (`nki_attn.sim.checks` capacity bookkeeping: live SBUF bytes per "
              "partition and PSUM banks, Python lifetime as the liveness proxy; 1 head, seqlen = one full "
              "section, causal, target trn1 with its capacity check on):", "",
              "| d_head | dtype | section keys | measured SBUF peak | estimate, one copy of each tile | "
              "estimate with working set x2 | measured PSUM peak |", "|---|---|---|---|---|---|---|"]
    old_target = os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE")
    os.environ["NEURON_PLATFORM_TARGET_OVERRIDE"] = "trn1"
    try:
        for d in (64, 128, 256):
            tiles = -(-d // 128)
            for name, dt, mixed in (("bfloat16", ml_dtypes.bfloat16, True), ("float32", np.float32, False)):
                isz = np.dtype(dt).itemsize
                sec = kb.default_section_len(d, tiles, isz, 1 << 20)
                z = np.zeros((1, 1, d, sec), dt)
                lse = np.zeros((1, 1, 128, sec // 128), np.float32)
                kb.attention_bwd(z, z, z, z, z, lse, use_causal_mask=True, mixed_precision=mixed)
                st = checks.last_launch_stats()
                u = kb.sbuf_usage(d, tiles, isz, sec, 1, sec, mixed)
                one = u["section"] + u["persistent"] + u["per_block"] + u["per_group"] + u["per_visit"]
                lines.append(f"| {d} | {name}{' (mixed)' if mixed else ''} | {sec} | {st.peak_sbuf_bytes} | {one} | "
                             f"{u['total']} | {st.peak_psum_banks} |")
    finally:
        if old_target is None:
            os.environ.pop("NEURON_PLATFORM_TARGET_OVERRIDE")
        else:
            os.environ["NEURON_PLATFORM_TARGET_OVERRIDE"] = old_target
    lines.append("")
    ok = r1 <= 0.55 and r2 <= 2.1 and len({r.split("|")[2] for r in d_rows}) == 1
    return "\n".join(lines), ok


def tolerance_sweep():
    """Worst case over SWEEP of the quantities docs/tolerances.md bounds."""
    from tests.kernels import conftest as _compare
    from tests.kernels.conftest import GRAD_NAMES as NAMES
    from tests.kernels.conftest import Case
    lines = ["| dtype | mixed | output | worst K needed | worst err / (u max abs ref) | worst err / band | "
             "case of worst K |", "|---|---|---|---|---|---|---|"]
    for dtype in ("float32", "bfloat16", "float16"):
        for mixed in ((False,) if dtype == "float32" else (False, True)):
            worst = {}
            for kw in SWEEP:
                kw = dict(kw)
                sec = kw.pop("section", None)
                for seed in range(3):
                    c = Case(dtype=dtype, mixed=mixed, seed=seed, **kw)
                    out = c.bwd(k_section_len=sec)
                    r = c.bwd_refs()
                    u = _compare.UNIT_ROUNDOFF[dtype]
                    atol, rtol = _compare.ABS_BANDS[dtype]
                    for name, got in zip(NAMES, out):
                        key = f"out_{name}_ref"
                        ref = r["ref"][key]
                        e = _compare.max_err(got, ref)
                        eg = _compare.max_err(r["golden"][key], ref)
                        ei = _compare.max_err(r["inputs"][name], ref)
                        mx = float(np.max(np.abs(_compare.as_f64(ref))))
                        need = (e - u * mx) / (eg + ei)
                        w = worst.setdefault(name, [-1e9, 0.0, 0.0, None])
                        if need > w[0]:
                            w[0], w[3] = need, f"{kw or 'plain'} seed {seed}"
                        w[1] = max(w[1], e / (u * mx))
                        w[2] = max(w[2], e / (atol + rtol * mx))
            for name, (need, rel, band, case) in worst.items():
                lines.append(f"| {dtype} | {mixed} | {name} | {need:.2f} | {rel:.1f} | {band:.2f} | {case} |")
            print("\n".join(lines[-len(worst):]), flush=True)
    return "\n".join(lines)


def _write_block(path, begin, end, text):
    doc = open(path).read()
    block = f"{begin}\n{text}\n{end}"
    new, n = re.subn(re.escape(begin) + ".*?" + re.escape(end), lambda _: block, doc, flags=re.S)
    if n != 1:
        sys.exit(f"{path}: marker pair {begin} ... {end} not found")
    open(path, "w").write(new)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--write", action="store_true", help="replace the generated block in the doc")
    ap.add_argument("--tolerances", action="store_true", help="run the accuracy sweep of docs/tolerances.md")
    args = ap.parse_args()
    if args.tolerances:
        text = tolerance_sweep()
        if args.write:
            _write_block(TOL_DOC, TOL_BEGIN, TOL_END, text)
        return
    text, ok = figures()
    print(text)
    if args.write:
        _write_block(DOC, BEGIN, END, text)
    if not ok:
        sys.exit("a figure is outside its limit")


if __name__ == "__main__":
    main()
