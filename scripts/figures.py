"""Figures of the docs, one subcommand per document section; ``--write`` puts a table into its doc.

    python scripts/figures.py fwd [--write]                  forward kernel: tile skipping, window, on-chip budget
    python scripts/figures.py bwd [--write]                  backward kernel: tile skipping, window, D, budget
    python scripts/figures.py bwd-tolerances [--write]       the backward's accuracy sweep (docs/validation.md)
    python scripts/figures.py ring steps|threshold|balance|tolerances   ring attention (docs/distributed.md)
    python scripts/figures.py validation-note REPORT... [--candidate REPORT]   docs/validation.md from reports
    python scripts/figures.py accuracy [--seqlens N...] [--write]   bf16 errors vs power-of-two scale and torch
    python scripts/figures.py accuracy-steps [--write]          where the backward's bf16 error comes from
    python scripts/figures.py readme measure|write|check     README.md's generated times and preset rows
    python scripts/figures.py masks [--seqlen 2048] [--out F.png]   the prebuilt masks as pictures of their blocks
    python scripts/figures.py variants [--kernels fwd bwd] [--write]   modeled cost of each attention variant

Instruction counts come from the simulator's trace (nki_attn.sim.trace.recording(): one record per executed
instruction). Device times are MODELED by nki_attn.profiler (cost model over the simulator's instruction trace),
not measured; wall-clock times are this machine's CPU running the simulator, not device times.
"""
import argparse
import datetime
import inspect
import json
import math
import os
import pathlib
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
REPORTS = os.path.join(ROOT, "reports")


def _inputs(batch, heads, kv_heads, seqlen, d_head, dtype="bfloat16", seed=0, **variant):
    """Kernel-layout inputs (torch) from the harness's builder, ``nki_attn.harness.runner.make_inputs``."""
    from nki_attn.harness.cases import Case
    from nki_attn.harness.runner import make_inputs
    fields = dict(name="figures", batch=batch, heads=heads, kv_heads=kv_heads, seqlen_q=seqlen, seqlen_k=seqlen,
                  d_head=d_head, dtype=dtype)
    return make_inputs(Case(**{**fields, **variant}), seed=seed)


def _write(doc, name, text):
    from nki_attn.harness.report import replace_marked_section
    replace_marked_section(os.path.join(DOCS, doc), name, text)
    print(f"wrote the {name} section of docs/{doc}", file=sys.stderr)


# ----------------------------------------------------------------------------------------------------- fwd
def _fwd_traced(q, k, v, **kw):
    from nki_attn.kernels.attention_fwd import attention_fwd
    from nki_attn.sim.trace import recording
    t0 = time.time()
    with recording() as rec:
        attention_fwd(q, k, v, **kw)
    return rec, time.time() - t0


def _fwd_site_hook(sites):
    """An ``on_alloc`` hook recording the kernel source line of every on-chip allocation and its bytes per
    partition (max over the calls of that line) into ``sites``."""
    from nki_attn.kernels import attention_fwd as fwd_mod

    def on_alloc(storage):
        if not storage.buffer.on_chip:
            return
        per_part = storage.free_size * storage.dtype.itemsize
        for fr in inspect.stack()[1:]:
            if fr.filename == fwd_mod.__file__:
                src = (fr.code_context or [""])[0].strip()
                m = re.match(r"([\w\.\[\]]+)\s*=\s*nl\.ndarray\((.*)", src)
                key = (storage.buffer.kind, fr.function, m.group(1) if m else src[:40])
                sites[key] = max(sites.get(key, 0), per_part)
                break
    return on_alloc


def _fwd_budget(d, target, s=2048, group=8):
    """Peak SBUF bytes per partition and PSUM banks (simulator accounting), allocation sites, sections, in the
    heaviest configuration: float32, GQA 8:1, packing (no key tile skipped), causal + 2 sinks."""
    from nki_attn.kernels.attention_fwd import attention_fwd
    from nki_attn.sim import checks
    from nki_attn.sim.trace import recording
    os.environ["NEURON_PLATFORM_TARGET_OVERRIDE"] = target
    x = _inputs(1, group, 1, s, d, dtype="float32", num_sinks=2, causal=True, cu_seqlens=(0, 300, 700, s))
    sites = {}
    with recording() as rec:
        rec.on_alloc = _fwd_site_hook(sites)
        attention_fwd(x["q"], x["k"], x["v"], sinks_ref=x["sinks"], bound_min=x["bound_min"],
                      bound_max=x["bound_max"], use_causal_mask=True)
    st = checks.last_launch_stats()
    # query tiles per section: Q is loaded once per (head, d tile, section)
    q_loads = sum(1 for r in rec.records if r.instr == "dma_copy" and r.srcs[0].name == "arg0")
    return st.peak_sbuf_bytes, st.peak_psum_banks, sites, q_loads // (group * ((d + 127) // 128))


def fwd_figures():
    """Markdown of the forward kernel's figures and whether they meet their targets (causal / non-causal
    nc_matmul <= 0.55; window 512 instructions at 8192 / 4096 <= 2.1)."""
    from nki_attn.sim.context import PSUM_BANKS, SBUF_BYTES_PER_PARTITION
    s, d = 4096, 128
    x = _inputs(1, 1, 1, s, d)
    full, _ = _fwd_traced(x["q"], x["k"], x["v"])
    causal, _ = _fwd_traced(x["q"], x["k"], x["v"], use_causal_mask=True)
    ratio = causal.count("nc_matmul") / full.count("nc_matmul")
    lines = [
        f"**Tile skipping** (seqlen {s}, d_head {d}, one head; counts of executed instructions):", "",
        "| | non-causal | causal | causal / non-causal |", "|---|---:|---:|---:|",
        f"| `nc_matmul` | {full.count('nc_matmul')} | {causal.count('nc_matmul')} | **{ratio:.3f}** (target <= 0.55) |",
        f"| `nc_transpose` | {full.count('nc_transpose')} | {causal.count('nc_transpose')} | "
        f"{causal.count('nc_transpose') / full.count('nc_transpose'):.3f} |",
        f"| all instructions | {full.count()} | {causal.count()} | {causal.count() / full.count():.3f} |", ""]
    counts = {}
    for n in (4096, 8192):
        x = _inputs(1, 1, 1, n, d)
        rec, _ = _fwd_traced(x["q"], x["k"], x["v"], use_causal_mask=True, sliding_window=512)
        counts[n] = (rec.count(), rec.count("nc_matmul"))
    (a, am), (b, bm) = counts[4096], counts[8192]
    lines += ["**Sliding window W = 512** (causal, d_head 128, one head):", "",
              "| seqlen | all instructions | `nc_matmul` |", "|---:|---:|---:|",
              f"| 4096 | {a} | {am} |", f"| 8192 | {b} | {bm} |",
              f"| ratio | **{b / a:.3f}** (target <= 2.1) | {bm / am:.3f} |", ""]
    rows, all_sites = [], {}
    prev = os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE")
    try:
        for dh in (64, 128, 256):
            for target in ("trn1", "trn2"):
                sb, ps, sites, sec = _fwd_budget(dh, target)
                cap = SBUF_BYTES_PER_PARTITION[{"trn1": 2, "trn2": 3}[target]]
                rows.append(f"| {dh} | {target} | {sb} | {cap} | {100.0 * sb / cap:.1f}% | {ps} / {PSUM_BANKS} | "
                            f"{sec} ({-(-16 // sec)} query tiles) |")
                if target == "trn1":
                    all_sites[dh] = sites
    finally:
        if prev is None:
            os.environ.pop("NEURON_PLATFORM_TARGET_OVERRIDE", None)
        else:
            os.environ["NEURON_PLATFORM_TARGET_OVERRIDE"] = prev
    lines += ["**On-chip budget** (peak per core, simulator accounting of the kernel's allocations; float32 inputs, "
              "GQA 8:1 so a block holds 8 members, seqlen 2048, causal + packing (no key tile skipped, full key blocks) "
              "+ 2 sinks; trn1 adds the packing fallback's index/predicate tiles):", "",
              "| d_head | target | peak SBUF B/partition | usable | share | peak PSUM banks | slabs of the 16 query "
              "tiles |", "|---:|---|---:|---:|---:|---:|---:|"] + rows + [""]
    lines += ["Allocation sites (bytes per partition of one allocation, float32, trn1):", "",
              "| buffer | function | tensor | d=64 | d=128 | d=256 |", "|---|---|---|---:|---:|---:|"]
    for key in sorted(set().union(*[set(v) for v in all_sites.values()])):
        kind, fn, name = key
        vals = " | ".join(str(all_sites[dh].get(key, "-")) for dh in (64, 128, 256))
        lines.append(f"| {kind} | `{fn}` | `{name}` | {vals} |")
    return "\n".join(lines), ratio <= 0.55 and b / a <= 2.1


def cmd_fwd(a):
    """Figures of the forward kernel (docs/kernel-fwd.md): tile skipping, window linearity, on-chip budget."""
    t0 = time.time()
    text, ok = fwd_figures()
    print(text)
    print(f"\n(measured in {time.time() - t0:.0f} s)", file=sys.stderr)
    if a.write:
        _write("kernel-fwd.md", "fwd-figures", text)
    if not ok:
        print("TARGET MISSED: a figure is outside its limit", file=sys.stderr)
    return 0 if ok else 1


def _bwd_count(seqlen, d=64, h=1, causal=False, window=None, section=None, dtype=None):
    """Instruction counts of one traced call: by instruction name, plus ``instructions`` (all), ``mm_columns``
    (matmul columns streamed: TensorE work), ``exp`` (exp activations: the only ones with a tensor bias) and
    ``d_matmuls`` (one-column matmuls: the D sums)."""
    import numpy as np

    from nki_attn.kernels import attention_bwd as kb
    from nki_attn.sim import trace
    z = np.zeros((1, h, d, seqlen), dtype or np.float32)
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


def bwd_figures():
    """Markdown of the backward kernel's figures (instruction counts do not depend on the values, so the inputs
    are zeros and lse = 0) and whether they meet their limits."""
    import ml_dtypes
    import numpy as np

    from nki_attn.kernels import attention_bwd as kb
    from nki_attn.sim import checks
    from nki_attn.sim.context import SBUF_BYTES_PER_PARTITION
    count = _bwd_count
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
              "statistics for 8 query heads per kv head at seqlen_q 16384; working set of the software pipeline: 3 "
              "blocks, 2 groups, the visit buffers in flight between its stages):", "",
              "| d_head | dtype | section keys | section | per-row stats | working set | total | trn1 180224 | "
              "trn2 212984 | PSUM banks |", "|---|---|---|---|---|---|---|---|---|---|"]
    for d in (64, 128, 256):
        tiles = -(-d // 128)
        for name, isz in (("bfloat16", 2), ("float32", 4)):
            sec = kb.default_section_len(d, tiles, isz, 1 << 20)
            u = kb.sbuf_usage(d, tiles, isz, sec, 8, 16384, mixed_precision=(isz == 2))
            work = u["total"] - u["section"] - u["persistent"]
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
              "estimate with the pipeline's working set | measured PSUM peak |", "|---|---|---|---|---|---|---|"]
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


def cmd_bwd(a):
    """Figures of the backward kernel (docs/kernel-bwd.md): causal tile skipping, window linearity, the D sums,
    SBUF / PSUM budget and the simulator-measured peaks."""
    text, ok = bwd_figures()
    print(text)
    if a.write:
        _write("kernel-bwd.md", "bwd-figures", text)
    if not ok:
        print("a figure is outside its limit", file=sys.stderr)
    return 0 if ok else 1


# ----------------------------------------------------------------------------------------------------- bwd accuracy
# The backward's accuracy sweep: shapes (1 batch, h query heads on hk kv heads, d_head d, sq queries, sk keys;
# defaults h = hk = 1, d 64, sq = sk = 256) x seeds, per (dtype, mixed_precision); "section" is k_section_len.
BWD_SWEEP = [dict(), dict(causal=True), dict(scale=0.3), dict(scale=1.0, causal=True),
             dict(scale=1.0, d=128, causal=True), dict(causal=True, window=100),
             dict(cu=(0, 100, 250, 384), sq=384, causal=True), dict(h=4, hk=1), dict(d=256),
             dict(d=128, sq=512, causal=True), dict(sinks=2, h=2), dict(sq=256, sk=512),
             dict(sq=512, causal=True, section=128)]
UNIT_ROUNDOFF = {"float32": 2.0 ** -24, "bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}
# the fixed absolute bands of the kernel tests, max|err| <= atol + rtol * max|ref| (docs/validation.md)
ABS_BANDS = {"float32": (1e-4, 1e-5), "bfloat16": (0.0, 2e-2), "float16": (0.0, 2.5e-3)}


def _bwd_sweep_row(kw, dtype, mixed, seed):
    """{output: (K needed, err / (u max|ref|), err / band)} of one sweep shape: our backward handed the float64
    reference's O (rounded to the dtype) and LSE (float32), against the reference, the golden in the dtype (same
    inputs, same mixed_precision) and the formula-from-the-inputs baseline
    (``nki_attn.harness.runner.inputs_baseline``)."""
    from golden import attention_bwd_torch_ref
    from nki_attn.harness.cases import Case
    from nki_attn.harness.runner import inputs_baseline, make_inputs, reference
    from nki_attn.kernel_api import attention_bwd
    kw = dict(kw)
    sec = kw.pop("section", None)
    sq = kw.get("sq", 256)
    case = Case(name="bwd-sweep", batch=1, heads=kw.get("h", 1), kv_heads=kw.get("hk", 1), seqlen_q=sq,
                seqlen_k=kw.get("sk", sq), d_head=kw.get("d", 64), dtype=dtype, causal=kw.get("causal", False),
                window=kw.get("window", 0), num_sinks=kw.get("sinks", 0), cu_seqlens=tuple(kw.get("cu", ())),
                scale=kw.get("scale", 0.0))
    x = make_inputs(case, seed=seed)
    ref = reference(x, case, torch.float64)
    fs32 = inputs_baseline(x, ref, case)
    o, lse = ref["o"].to(x["q"].dtype), ref["lse"].float()
    args = (x["q"], x["k"], x["v"], o, x["dy"], lse, x["sinks"], x["bound_min"], x["bound_max"])
    kw = dict(use_causal_mask=case.causal, softmax_scale=case.scale or None, sliding_window=case.window or None,
              mixed_precision=mixed)
    # the golden in the dtype, handed the same O and LSE, with the same mixed_precision: the kernel tests' baseline
    g = attention_bwd_torch_ref(*args, **kw)
    base = {n: g[f"out_{n}_ref"] for n in ("dq", "dk", "dv", "dsinks") if f"out_{n}_ref" in g}
    out = attention_bwd(*args, **kw, k_section_len=sec)
    u, (atol, rtol) = UNIT_ROUNDOFF[dtype], ABS_BANDS[dtype]
    res = {}
    for name, got in zip(("dq", "dk", "dv", "dsinks"), out):
        r = ref[name].double()

        def err(t):
            return float((torch.as_tensor(t).double() - r).abs().max())
        e, mx = err(got), float(r.abs().max())
        res[name] = ((e - u * mx) / (err(base[name]) + err(fs32[name])), e / (u * mx), e / (atol + rtol * mx))
    return res


def cmd_bwd_tolerances(a):
    """The backward's accuracy sweep: per (dtype, mixed_precision) and output, the worst K the kernel tests' rule
    needs (err <= K (err_golden + err_inputs) + u max|ref|, K = 2), err in units of u max|ref|, and the fraction
    of the absolute band used, over BWD_SWEEP x seeds."""
    lines = ["| dtype | mixed | output | worst K needed | worst err / (u max abs ref) | worst err / band | "
             "case of worst K |", "|---|---|---|---|---|---|---|"]
    for dtype in a.dtypes:
        for mixed in ((False,) if dtype == "float32" else (False, True)):
            worst = {}
            for kw in BWD_SWEEP:
                for seed in range(a.seeds):
                    for name, (need, rel, band) in _bwd_sweep_row(kw, dtype, mixed, seed).items():
                        w = worst.setdefault(name, [-1e9, 0.0, 0.0, None])
                        if need > w[0]:
                            w[0], w[3] = need, f"{kw or 'plain'} seed {seed}"
                        w[1], w[2] = max(w[1], rel), max(w[2], band)
            for name, (need, rel, band, where) in worst.items():
                lines.append(f"| {dtype} | {mixed} | {name} | {need:.2f} | {rel:.1f} | {band:.2f} | {where} |")
            print("\n".join(lines[-len(worst):]), file=sys.stderr, flush=True)
    text = "\n".join(lines)
    print(text)
    if a.write:
        _write("validation.md", "bwd-tolerances", text)
    return 0


# ----------------------------------------------------------------------------------------------------- ring
# Public interconnect figures (aws-neuron-sdk documentation, cited by document name):
# - "Amazon EC2 Trn2 Architecture": trn2.48xlarge, 16 Trainium2 chips in a 4x4 2D torus, intra-instance
#   NeuronLink-v3 1,024 GB/s per chip; Trn2 UltraServer, inter-instance NeuronLink-v3 256 GB/s per chip;
#   EFAv3 3,200 Gbps per instance.
# - "Neuron Runtime: Collectives" (System Connectivity): each chip has a 200 Gbps EFA interface; each chip links
#   to 4 neighbours in the 2D torus (2 more on the Z dimension in an UltraServer); a minimal packet between
#   servers takes 15 us (ib_write_lat).
# - "Intra-node Collective Communications with AWS Neuron": per-hop latency of Ring about 1-2 us.
# Per link = per-chip figure / links; the documents do not say whether a figure counts both directions, so the
# ring (one direction per link) is given half of it (conservative; the other reading halves the thresholds).
SCENARIOS = [
    # name, ranks, GB/s available to one rank's hop, latency us, what it is
    ("trn2 8 ranks, NeuronLink", 8, 1024 / 4 / 2, 2.0,
     "8 chips of one trn2.48xlarge, one rank per chip; hop = one intra-instance NeuronLink-v3 link"),
    ("trn2 32 ranks, EFA", 32, 200 / 8, 15.0,
     "32 chips of two trn2.48xlarge, one rank per chip; the 2 hops between instances use the chip's 200 Gbps "
     "EFA share and set the step time"),
    ("trn2 32 ranks, UltraServer", 32, 256 / 2 / 2, 2.0,
     "32 chips of a Trn2 UltraServer, one rank per chip; the hops between instances use an inter-instance "
     "NeuronLink-v3 Z link (256 GB/s per chip over 2 links)"),
]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


# ----------------------------------------------------------------------------------------------------- modeled
def _modeled_hook(target):
    """A ``record_steps`` kernel hook: run the kernel under the instruction trace, return modeled times."""
    from nki_attn.profiler import generation, profile
    from nki_attn.sim import trace

    gen = generation(target)

    def hook(run):
        os.environ["NEURON_PLATFORM_TARGET_OVERRIDE"] = target
        with trace.recording() as rec:
            result = run()
        prof = profile(rec.records, gen)
        # the headline is the scheduled time (cost model v2); the perfect-overlap bound and the serial sum are kept
        return result, {"time_us": prof.time_ns / 1e3, "overlap_us": prof.time_overlap_ns / 1e3,
                        "serial_us": prof.time_serial_ns / 1e3}
    return hook


# ----------------------------------------------------------------------------------------------------- variants
# The attention-variant cost tables of docs/performance.md: (label, extra `nki-attn profile` arguments, causal).
# Every row adds its arguments to VARIANT_BASE; causal rows are compared with the causal default, non-causal
# rows with the non-causal default (and that default with the causal one).
VARIANT_BASE = ["--heads", "4", "--kv-heads", "1", "--seqlen", "2048", "--head-dim", "128", "--mixed-precision",
                "true"]
VARIANT_ROWS = {
    "fwd": [
        ("default (causal)", [], True),
        ("softcap 50", ["--features", "softcap=50"], True),
        ("ALiBi, causal", ["--features", "alibi"], True),
        ("softcap 50 + ALiBi", ["--features", "softcap=50", "alibi"], True),
        ("window_size (1023, 0) = sliding_window 1024", ["--features", "window_size=1023,0"], True),
        ("sliding_window 1024 (legacy)", ["--window", "1024"], True),
        ("window_size (255, 0) = sliding_window 256", ["--features", "window_size=255,0"], True),
        ("causal, seqlen_k = seqlen_q / 2 (bottom-right)", ["--features", "seqlen_k=1024"], True),
        ("causal, seqlen_q 1024 < seqlen_k 2048", ["--features", "seqlen_q=1024"], True),
        ("d_qk 192 / d_v 128", ["--features", "d_qk=192"], True),
        ("d 199 (128 + 71)", ["--features", "d_qk=199", "d_v=199"], True),
        ("d 256 (reference for d 199)", ["--head-dim", "256"], True),
        ("dropout 0.1", ["--features", "dropout=0.1"], True),
        ("attn_bias [1, 4, 2048, 2048] bf16", ["--features", "bias"], True),
        ("default (non-causal)", [], False),
        ("ALiBi (non-causal)", ["--features", "alibi"], False),
        ("window_size (256, 256) (non-causal)", ["--features", "window_size=256,256"], False),
        ("window_size (64, 64) (non-causal)", ["--features", "window_size=64,64"], False),
    ],
    "bwd": [
        ("default (causal)", [], True),
        ("softcap 50", ["--features", "softcap=50"], True),
        ("ALiBi, causal", ["--features", "alibi"], True),
        ("window_size (1023, 0), causal", ["--features", "window_size=1023,0"], True),
        ("window_size (255, 0) = sliding_window 256", ["--features", "window_size=255,0"], True),
        ("causal, seqlen_q 1024 < seqlen_k 2048", ["--features", "seqlen_q=1024"], True),
        ("dropout 0.1", ["--features", "dropout=0.1"], True),
        ("d_qk 192 / d_v 128 (MLA)", ["--features", "d_qk=192"], True),
        ("d 199 (128 + 71)", ["--features", "d_qk=199", "d_v=199"], True),
        ("Gemma-2-like: softcap 50 + sliding window 1024", ["--features", "softcap=50", "--window", "1024"], True),
        ("attn_bias [1, 4, 2048, 2048] bf16, no gradient", ["--features", "bias", "--set", "bias_grad=False"], True),
        ("attn_bias [1, 4, 2048, 2048] bf16 with its gradient", ["--features", "bias"], True),
        ("default (non-causal)", [], False),
        ("ALiBi (non-causal)", ["--features", "alibi"], False),
        ("window_size (256, 256) (non-causal)", ["--features", "window_size=256,256"], False),
        ("window_size (64, 64) (non-causal)", ["--features", "window_size=64,64"], False),
    ],
}


def variant_argv(kernel, extra, causal):
    """The ``nki-attn profile`` arguments of one variant row."""
    return ["profile", "--kernel", kernel] + VARIANT_BASE + (["--causal"] if causal else []) + list(extra)


def _variant_profile(argv):
    """Parse ``argv`` as ``nki-attn profile`` does and model the run: the ``Profile`` (cost model v2)."""
    from nki_attn.cli import build_parser
    from nki_attn.profiler import generation, profile
    from nki_attn.profiler.cli import run_kernel, useful_flops, validate
    args = build_parser().parse_args(argv)
    if args.kv_heads is None:
        args.kv_heads = args.heads
    if args.window:
        args.causal = True
    validate(args, args._parser)
    prev = os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE")
    os.environ["NEURON_PLATFORM_TARGET_OVERRIDE"] = args.target
    try:
        t0 = time.perf_counter()
        records, _ = run_kernel(args)
        wall = time.perf_counter() - t0
    finally:
        if prev is None:
            os.environ.pop("NEURON_PLATFORM_TARGET_OVERRIDE", None)
        else:
            os.environ["NEURON_PLATFORM_TARGET_OVERRIDE"] = prev
    return profile(records, generation(args.target), useful_flops(args), n_cores=args.lnc), len(records), wall


def variant_rows(kernel, only=None):
    """Model every row of ``VARIANT_ROWS[kernel]`` (``only``: labels to keep, the defaults always run); one dict per
    row with the scheduled time (the headline), the perfect-overlap bound and the ratios to its default."""
    from nki_attn.sim.trace import ENGINES
    rows = []
    for label, extra, causal in VARIANT_ROWS[kernel]:
        is_default = not extra
        if only and label not in only and not is_default:
            continue
        argv = variant_argv(kernel, extra, causal)
        p, n, wall = _variant_profile(argv)
        path = p.critical_path_by_kind()
        lead = max(path, key=path.get) if path else "-"
        rows.append({"label": label, "kernel": kernel, "causal": causal, "default": is_default,
                     "command": "nki-attn " + " ".join(shlex.quote(x) for x in argv),
                     "time_us": p.time_ns / 1e3, "overlap_us": p.time_overlap_ns / 1e3,
                     "useful_flops": p.useful_flops, "busiest": p.bottleneck, "critical_lead": lead,
                     "critical_lead_share": path[lead] / p.time_ns if path and p.time_ns else 0.0,
                     "busy_us": {e: p.engine_busy(e) / 1e3 for e in ENGINES}, "instructions": n, "sim_wall_s": wall})
        print(f"{kernel} {label}: {rows[-1]['time_us']:.1f} us scheduled, {rows[-1]['overlap_us']:.1f} us perfect "
              f"overlap ({wall:.1f} s sim)", file=sys.stderr, flush=True)
    base = {r["causal"]: r for r in rows if r["default"]}
    for r in rows:
        # the non-causal default is set against the causal one; every other row against its own default
        b = base[True] if r["default"] else base[r["causal"]]
        r["rel"] = r["time_us"] / b["time_us"]
        r["rel_overlap"] = r["overlap_us"] / b["overlap_us"]
        r["rel_per_flop"] = (r["time_us"] / r["useful_flops"]) / (b["time_us"] / b["useful_flops"])
    return rows


def variant_table(rows):
    """Markdown table of ``variant_rows``."""
    from nki_attn.sim.trace import ENGINES
    out = ["| variant | scheduled us | rel | rel/flop | perfect overlap us (rel) | critical path lead (share) | "
           "busiest engine | " + " | ".join(ENGINES) + " | instructions | `nki-attn profile` arguments |",
           "|---|---:|---:|---:|---:|---|---|" + "---:|" * len(ENGINES) + "---:|---|"]
    for r in rows:
        rel = f"{r['rel']:.2f}" + (" vs causal" if r["default"] and not r["causal"] else "")
        flop = "-" if r["default"] else f"{r['rel_per_flop']:.2f}"
        args = r["command"].split(" --mixed-precision true", 1)[1].strip() or "(the default)"
        out.append(f"| {r['label']} | **{r['time_us']:.1f}** | **{rel}** | {flop} | {r['overlap_us']:.1f} "
                   f"({r['rel_overlap']:.2f}) | {r['critical_lead']} ({r['critical_lead_share']:.0%}) | "
                   f"{r['busiest']} | " + " | ".join(f"{r['busy_us'][e]:.1f}" for e in ENGINES)
                   + f" | {r['instructions']} | `{args}` |")
    return "\n".join(out)


def cmd_variants(a):
    """Modeled cost of each attention variant against the default path (docs/performance.md), cost model v2.

    One `nki-attn profile` run per row (the row's arguments after the shared ones: batch 1, 4 query heads / 1 kv
    head, S 2048, d 128, bf16, mixed precision, trn2); the headline is the scheduled time, the perfect-overlap
    bound is kept beside it. --write puts each kernel's table between the variant-costs-fwd / variant-costs-bwd
    markers of docs/performance.md."""
    from nki_attn.profiler.params import MODEL
    from bench import kernel_versions  # scripts/ is on the path when a script of it runs
    versions = kernel_versions()
    out = {"model": MODEL, "modeled": True, "kernel_sha256_12": versions, "kernels": {}}
    for kernel in a.kernels:
        rows = variant_rows(kernel, a.only)
        out["kernels"][kernel] = rows
        name = {"fwd": "attention_fwd.py", "bwd": "attention_bwd.py"}[kernel]
        text = (f"**{'Forward' if kernel == 'fwd' else 'Backward'}** (`--kernel {kernel}`; MODELED by cost model v2, "
                f"scheduled, trn2; `{name}` `{versions.get(name, '?')}`; `python scripts/figures.py variants "
                f"--kernels {kernel} --write`):\n\n" + variant_table(rows))
        print(text + "\n")
        if a.write and not a.only:
            _write("performance.md", f"variant-costs-{kernel}", text)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {a.json}", file=sys.stderr)
    return 0


# ----------------------------------------------------------------------------------------------------- steps
def _steps_rank(rank, world_size, a):
    from nki_attn.distributed import record_steps, ring_flash_attn_func, zigzag_ring_flash_attn_func
    g = torch.Generator().manual_seed(0)
    S, dt = a["seqlen_local"] * world_size, DTYPES[a["dtype"]]
    full = [torch.randn(a["batch"], S, h, a["head_dim"], generator=g).to(dt)
            for h in (a["heads"], a["kv_heads"], a["kv_heads"], a["heads"])]
    if a["layout"] == "zigzag":
        from nki_attn.distributed import zigzag_shard as shard
        fn = zigzag_ring_flash_attn_func
    else:
        from nki_attn.distributed import ring_shard as shard
        fn = ring_flash_attn_func
    q, k, v, do = (shard(t, rank, world_size).requires_grad_(i < 3) for i, t in enumerate(full))
    from nki_attn import kernel_api
    x = torch.zeros(1, 1, a["head_dim"], 128, dtype=dt)
    kernel_api.attention_fwd(x, x, x)  # pay the one-time import / trace set-up outside the recorded steps
    with record_steps(_modeled_hook(a["target"])) as log:
        out = fn(q, k, v, causal=a["causal"], window_size=(a["window"] - 1 if a["window"] else -1, -1))
        out.backward(do)
    return log


def cmd_steps(a):
    """Per-step bytes sent and modeled kernel time of one forward + backward on gloo processes (loopback).

    Every kernel call runs under the simulator's instruction trace; per step: bytes this rank posted, the modeled
    trn2 time of its kernel calls (slowest / fastest rank), the simulator's wall time, the time blocked on
    transfers."""
    from nki_attn.distributed import run_local
    args = {k: v for k, v in vars(a).items() if k not in ("run", "command", "ring_command")}
    logs = run_local(_steps_rank, a.world_size, args, timeout=a.timeout)
    rows = []
    keys = sorted({(e["phase"] != "fwd", e["step"]) for log in logs for e in log})
    for bwd, step in keys:
        phase = "bwd" if bwd else "fwd"
        per = [next(e for e in log if e["phase"] == phase and e["step"] == step) for log in logs]
        modeled = [sum(b["info"]["time_us"] for b in e["blocks"]) for e in per]
        rows.append({"phase": phase, "step": step, "sent_bytes": max(e["sent_bytes"] for e in per),
                     "kernel_calls": [len(e["blocks"]) for e in per],
                     "modeled_us_max": max(modeled), "modeled_us_min": min(modeled),
                     "sim_wall_s": max(sum(b["seconds"] for b in e["blocks"]) for e in per),
                     "wait_s": max(e["wait_seconds"] for e in per)})
    title = (f"{a.layout} ring, {a.world_size} ranks x {a.seqlen_local} tokens, batch {a.batch}, heads {a.heads}/"
             f"{a.kv_heads}, d {a.head_dim} {a.dtype}, causal={a.causal}, window={a.window}; modeled on "
             f"{a.target} (cost model v2, scheduled), NOT measured")
    from bench import kernel_versions
    title += "; kernels " + ", ".join(f"{k} {v}" for k, v in kernel_versions().items())
    print(title)
    print(f"{'phase':<6}{'step':>5}{'MiB sent/rank':>15}{'calls/rank':>16}{'modeled us max':>16}"
          f"{'modeled us min':>16}{'sim wall s':>12}{'wait s':>9}")
    for r in rows:
        print(f"{r['phase']:<6}{r['step']:>5}{r['sent_bytes'] / 2**20:>15.3f}{str(r['kernel_calls']):>16}"
              f"{r['modeled_us_max']:>16.1f}{r['modeled_us_min']:>16.1f}{r['sim_wall_s']:>12.2f}{r['wait_s']:>9.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"title": title, "args": args, "steps": rows}, f, indent=1)
        print(f"wrote {a.json}")


# ----------------------------------------------------------------------------------------------------- threshold
def _block_times(sq, sk, heads, kv_heads, d, dtype, target):
    """Modeled (fwd, bwd) us of one unmasked block pair: sq queries x sk keys, ``heads`` / ``kv_heads``."""
    from nki_attn import kernel_api
    hook = _modeled_hook(target)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads, d, sq, generator=g).to(dtype)
    k = torch.randn(1, kv_heads, d, sk, generator=g).to(dtype)
    v = torch.randn(1, kv_heads, d, sk, generator=g).to(dtype)
    (o, lse), fwd = hook(lambda: kernel_api.attention_fwd(q, k, v))
    _, bwd = hook(lambda: kernel_api.attention_bwd(q, k, v, o, torch.randn_like(o), lse))
    return fwd["time_us"], bwd["time_us"]


def _fit(xs, ys):
    """Least-squares a*s^2 + b*s + c."""
    A = torch.tensor([[x * x, x, 1.0] for x in xs], dtype=torch.float64)
    y = torch.tensor(ys, dtype=torch.float64)
    return [float(c) for c in torch.linalg.lstsq(A, y[:, None]).solution[:, 0]]


def _threshold(seqlens, comp, bytes_per_token, gbps, lat_us):
    """Shard length above which a step's kernel time ``comp[i]`` (at ``seqlens[i]``) covers its transfer
    ``lat + bytes_per_token * s / bandwidth``: the last crossing, linearly interpolated between measured points;
    beyond the largest point, extrapolated with a quadratic fit of the three largest. Returns (s, how)."""
    margin = [c - (lat_us + bytes_per_token * s / (gbps * 1e3)) for s, c in zip(seqlens, comp)]  # GB/s = 1e3 B/us
    if margin[-1] < 0:
        a, b, c = _fit(seqlens[-3:], comp[-3:])
        beta = bytes_per_token / (gbps * 1e3)
        disc = (b - beta) ** 2 - 4 * a * (c - lat_us)
        if a <= 0 or disc < 0:
            return math.inf, "never (fit)"
        return (-(b - beta) + math.sqrt(disc)) / (2 * a), "extrapolated"
    last_bad = max((i for i, m in enumerate(margin) if m < 0), default=None)
    if last_bad is None:
        return seqlens[0], "at or below"
    s0, s1, m0, m1 = seqlens[last_bad], seqlens[last_bad + 1], margin[last_bad], margin[last_bad + 1]
    return s0 + (s1 - s0) * (-m0) / (m1 - m0), "interpolated"


def cmd_threshold(a):
    """Modeled shard length above which each ring step's transfer hides behind its kernel.

    Models one block pair's kernel time for several shard lengths, fits a quadratic and solves compute(s) >=
    transfer(s) with the public NeuronLink / EFA figures of SCENARIOS."""
    d, dt = a.head_dim, DTYPES[a.dtype]
    item = torch.empty(0, dtype=dt).element_size()
    args = {k: v for k, v in vars(a).items() if k not in ("run", "command", "ring_command")}
    from bench import kernel_versions
    versions = kernel_versions()
    out = {"args": args, "scenarios": SCENARIOS, "configs": [], "kernel_sha256_12": versions}
    print(f"Kernel times MODELED on {a.target} (nki_attn.profiler, cost model v2: scheduled time), one NeuronCore per "
          f"rank; d {d} {a.dtype}; per step the ring computes a full s x s block, zigzag an s/2 x s or s x s/2 "
          f"block; kernels " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    for kv in a.kv_heads:
        group = a.heads // kv
        pts = []
        for s in a.seqlens:
            # the kernel runs the kv heads one after another: model one GQA group, times kv
            ff, fb = _block_times(s, s, group, 1, d, dt, a.target)
            # zigzag: ranks holding later chunks run s/2 queries x s keys, the others s queries x s/2 keys; the
            # slower of the two sets the step
            h = max(128, s // 2)  # the kernels pad a shorter half to 128, as the ring does
            hf, hb = (max(x, y) for x, y in zip(_block_times(h, s, group, 1, d, dt, a.target),
                                                 _block_times(s, h, group, 1, d, dt, a.target)))
            pts.append({"s": s, "full_fwd": ff * kv, "full_bwd": fb * kv, "half_fwd": hf * kv, "half_bwd": hb * kv})
            print(f"  heads {a.heads}/{kv} s {s:>5}: full block fwd {ff * kv:8.1f} bwd {fb * kv:8.1f} us, half block "
                  f"fwd {hf * kv:8.1f} bwd {hb * kv:8.1f} us (modeled)", flush=True)
        ss = [p["s"] for p in pts]
        kv_bytes = 2 * kv * d * item  # K and V of one token
        dkv_bytes = 2 * kv * d * 4  # float32 dK/dV partial sums of one token, sent with them in the backward
        cfg = {"heads": a.heads, "kv_heads": kv, "points": pts, "thresholds": []}
        print(f"heads {a.heads}/{kv}: shard length above which each step's transfer hides behind its kernel")
        print(f"  {'scenario':<28}{'GB/s':>6}{'lat us':>7}{'fwd ring':>16}{'fwd zigzag':>16}{'bwd ring':>16}"
              f"{'bwd zigzag':>16}")
        for name, ranks, gbps, lat, what in SCENARIOS:
            t = {"scenario": name, "ranks": ranks, "gbps": gbps, "latency_us": lat}
            cells = []
            for key, col, per_token in (("fwd_ring", "full_fwd", kv_bytes), ("fwd_zigzag", "half_fwd", kv_bytes),
                                        ("bwd_ring", "full_bwd", kv_bytes + dkv_bytes),
                                        ("bwd_zigzag", "half_bwd", kv_bytes + dkv_bytes)):
                val, how = _threshold(ss, [p[col] for p in pts], per_token, gbps, lat)
                t[key] = {"s": val, "how": how}
                mark = {"interpolated": "", "extrapolated": " (x)", "at or below": " (<=)"}.get(how, " (-)")
                cells.append(f"{val:.0f}{mark}" if math.isfinite(val) else "never")
            cfg["thresholds"].append(t)
            print(f"  {name:<28}{gbps:>6.0f}{lat:>7.0f}" + "".join(f"{c:>16}" for c in cells))
        out["configs"].append(cfg)
    print("(<=): already hidden at the smallest length modeled; (x): beyond the largest, from a quadratic fit")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {a.json}")


# ----------------------------------------------------------------------------------------------------- balance
def cmd_balance(a):
    """Per-rank work (128 x 128 score tiles) of the ring and zigzag layouts, causal."""
    from nki_attn.distributed import format_work_balance, work_balance_report
    w = (a.window - 1, 0) if a.window else (-1, -1)
    rep = work_balance_report(a.seqlen, a.world_size, causal=True, window_size=w)
    print(f"causal, {a.seqlen} tokens, {a.world_size} ranks, window {a.window}: per-rank work (tiles = 128 x 128 "
          f"score tiles the kernels compute under the block plans)")
    print(format_work_balance(rep))




# ----------------------------------------------------------------------------------------------------- ring accuracy
def _rc(name, layout="ring", causal=True, window=(-1, -1), dtype="bf16", b=1, seqlen=512, h=4, hk=2, d=64,
        sinks=0, lengths=None, scale=None):
    return dict(name=name, layout=layout, causal=causal, window=window, dtype=dtype, b=b, seqlen=seqlen, h=h,
                hk=hk, d=d, sinks=sinks, lengths=lengths, scale=scale)


# The configurations of the distributed tests' default run, by world size.
RING_CASES = {
    2: [_rc("ring-causal-gqa"), _rc("ring-full-mha-b2", causal=False, b=2, h=2, hk=2),
        _rc("ring-window-sinks-fp32", window=(100, 0), dtype="fp32", sinks=2),
        _rc("ring-uneven-causal", lengths=[200, 312]),
        _rc("ring-bidir-window-fp32", causal=False, window=(60, 70), dtype="fp32", scale=0.2),
        _rc("zigzag-causal-mqa", layout="zigzag", hk=1), _rc("zigzag-window-sinks", layout="zigzag", window=(150, 0),
                                                             sinks=1)],
    4: [_rc("ring-causal-gqa"), _rc("ring-window-sinks-fp32", window=(100, 0), dtype="fp32", sinks=2),
        _rc("ring-uneven-causal", lengths=[128, 100, 156, 128]),
        _rc("ring-bidir-window", causal=False, window=(60, 70)),
        _rc("zigzag-causal-gqa", layout="zigzag"),
        _rc("zigzag-window-sinks-fp32", layout="zigzag", window=(100, 0), dtype="fp32", sinks=1)],
}
_UNIT = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11, "fp32": 2.0 ** -24}


def _ring_inputs(c):
    """Full-sequence q, k, v, do in FlashAttention's layout [b, S, h, d] and sinks [h] / [h, n], the same in every
    process (the harness's builder, seed 1000 + the configuration's seed)."""
    dtype = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[c["dtype"]]
    x = _inputs(c["b"], c["h"], c["hk"], c["seqlen"], c["d"], dtype=dtype, seed=1000 + c["seed"],
                num_sinks=c["sinks"])
    fa = [x[n].permute(0, 3, 1, 2).contiguous() for n in ("q", "k", "v", "dy")]
    return (*fa, None if x["sinks"] is None else x["sinks"][0].contiguous())


def _ring_split(c, x, rank, world_size, dim=1):
    from nki_attn.distributed import ring_shard, zigzag_shard
    if c["layout"] == "zigzag":
        return zigzag_shard(x, rank, world_size, dim)
    if c["lengths"]:
        return torch.split(x, c["lengths"], dim)[rank].contiguous()
    return ring_shard(x, rank, world_size, dim)


def _ring_worker(rank, world_size, cases):
    """Every configuration on this rank: local out, lse and gradients; dsinks summed over the ranks."""
    from nki_attn.distributed import ring_flash_attn_func, zigzag_ring_flash_attn_func
    out = []
    for c in cases:
        q, k, v, do, s = _ring_inputs(c)
        fn = zigzag_ring_flash_attn_func if c["layout"] == "zigzag" else ring_flash_attn_func
        ql, kl, vl = (_ring_split(c, t, rank, world_size).requires_grad_() for t in (q, k, v))
        sl = s.clone().requires_grad_() if s is not None else None
        o, lse = fn(ql, kl, vl, softmax_scale=c["scale"], causal=c["causal"], window_size=c["window"], sinks=sl,
                    return_lse=True)
        o.backward(_ring_split(c, do, rank, world_size))
        ds = None
        if sl is not None:
            ds = sl.grad.clone()
            torch.distributed.all_reduce(ds)  # each rank holds its queries' share
        out.append({"out": o.detach(), "lse": lse.detach(), "dq": ql.grad, "dk": kl.grad, "dv": vl.grad,
                    "dsinks": ds})
    return out


def _ring_references(c):
    """(truth, single): the float64 golden on the rounded full sequence, and flash_attn_func in one process."""
    import nki_attn
    from golden import attention_bwd_torch_ref, attention_fwd_torch_ref
    q, k, v, do, s = _ring_inputs(c)
    b, S, h, _ = q.shape
    kl = [t.double().permute(0, 2, 3, 1).contiguous() for t in (q, k, v, do)]
    sk = None if s is None else s.double().unsqueeze(0).expand(b, *s.shape).contiguous()
    kw = dict(sinks_ref=sk, use_causal_mask=c["causal"], softmax_scale=c["scale"],
              window_size=None if tuple(c["window"]) == (-1, -1) else tuple(c["window"]))
    o, lse = attention_fwd_torch_ref(*kl[:3], **kw)
    g = attention_bwd_torch_ref(*kl[:3], o, kl[3], lse, **kw)
    lse = lse.permute(0, 1, 3, 2).reshape(b, h, S)

    def fa(t):
        return t.permute(0, 3, 1, 2).contiguous()
    truth = {"out": fa(o), "lse": torch.where(torch.isneginf(lse), math.inf, lse), "dq": fa(g["out_dq_ref"]),
             "dk": fa(g["out_dk_ref"]), "dv": fa(g["out_dv_ref"]),
             "dsinks": None if s is None else g["out_dsinks_ref"].sum(0).reshape(s.shape)}
    qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ss = None if s is None else s.clone().requires_grad_()
    o1, lse1 = nki_attn.flash_attn_func(qs, ks, vs, softmax_scale=c["scale"], causal=c["causal"],
                                        window_size=c["window"], sinks=ss, return_lse=True)
    o1.backward(do)
    single = {"out": o1.detach(), "lse": lse1.detach(), "dq": qs.grad, "dk": ks.grad, "dv": vs.grad,
              "dsinks": None if ss is None else ss.grad}
    return truth, single, do, s


def _ring_partials(c, world_size):
    """Most kernel calls (partial results) meeting in one query row and in one key, from the ring's schedule."""
    from nki_attn.distributed.layout import partial_counts, ring_layout, zigzag_layout
    if c["layout"] == "zigzag":
        shards = zigzag_layout(c["seqlen"], world_size)
    else:
        shards = ring_layout(c["lengths"] or [len(t) for t in torch.tensor_split(torch.arange(c["seqlen"]),
                                                                               world_size)])
    return partial_counts(shards, c["window"][0], 0 if c["causal"] else c["window"][1])


def _ring_judge(c, world_size, got, truth, single, do, sinks):
    """The distributed accuracy rule (docs/distributed.md): err_ring <= 2 (err_single + err_inputs) + n/2 u
    max|truth| per output; rows with the fraction of the bound used."""
    n_row, n_key = _ring_partials(c, world_size)
    rows = []
    for name in ("out", "lse", "dq", "dk", "dv", "dsinks"):
        t = truth[name]
        if t is None:
            continue
        e_ring = float((got[name].double() - t).abs().max())
        e_single = float((single[name].double() - t).abs().max())
        e_inputs = 0.0
        if name == "dsinks":  # the formula in float64 from the ring's own rounded out and the true lse
            D = (got["out"].double() * do.double()).sum(-1).transpose(1, 2)
            s = sinks.double() if sinks.dim() == 2 else sinks.double()[:, None]
            p = torch.exp(s[None, :, None, :] - truth["lse"].double()[..., None])
            f = -(p * D[..., None]).sum((0, 2))
            e_inputs = float(((f if sinks.dim() == 2 else f[:, 0]) - t).abs().max())
        u = _UNIT["fp32"] if name in ("lse", "dsinks") else _UNIT[c["dtype"]]
        n = n_key if name in ("dk", "dv") else n_row
        bound = 2 * (e_single + e_inputs) + n / 2 * u * float(t.abs().max())
        rows.append({"case": c["name"], "output": name, "err_ring": e_ring, "err_single": e_single,
                     "used": e_ring / bound if bound else math.inf})
    return rows


def cmd_tolerances(a):
    """The distributed tests' configurations over more seeds: the worst fraction of the rule's bound used."""
    from nki_attn.distributed import ring_unshard, run_local, zigzag_unshard
    worst = {}
    for world_size in a.world_sizes:
        cases = [dict(c, seed=s, name=f"{c['name']}/seed{s}") for s in range(a.seeds) for c in RING_CASES[world_size]]
        results = run_local(_ring_worker, world_size, cases, timeout=a.timeout)
        for i, c in enumerate(cases):
            truth, single, do, s = _ring_references(c)
            per = [r[i] for r in results]
            unshard = zigzag_unshard if c["layout"] == "zigzag" else ring_unshard
            got = {n: (per[0][n] if n == "dsinks" else unshard([p[n] for p in per], 2 if n == "lse" else 1))
                   for n in per[0]}
            for row in _ring_judge(c, world_size, got, truth, single, do, s):
                key = (c["dtype"], row["output"])
                if key not in worst or row["used"] > worst[key]["used"]:
                    worst[key] = dict(row, world_size=world_size)
        print(f"{world_size} ranks: {len(cases)} runs checked", flush=True)
    print(f"{'dtype':<10}{'output':<8}{'worst used':>11}  {'ring/single':>11}  case")
    for (dt, out), r in sorted(worst.items()):
        ratio = r["err_ring"] / r["err_single"] if r["err_single"] else math.inf
        print(f"{dt:<10}{out:<8}{r['used']:>11.2f}  {ratio:>11.2f}  {r['case']} ({r['world_size']} ranks)")
    outputs = ("out", "lse", "dq", "dk", "dv", "dsinks")
    runs = sum(a.seeds * len(RING_CASES[w]) for w in a.world_sizes)
    import textwrap
    lines = [textwrap.fill(f"Measured by `python scripts/figures.py ring tolerances --seeds {a.seeds}` (the "
                           f"default-run configurations of the distributed tests on "
                           f"{' and '.join(map(str, a.world_sizes))} ranks with seeds 0-{a.seeds - 1}, inputs from "
                           f"the harness's builder: {runs} runs, every output): the largest fraction of the bound "
                           f"used, and in brackets the ring's error over the single-process error in that case.",
                           115, break_on_hyphens=False), "",
             "| dtype | " + " | ".join(outputs) + " |", "|---|" + "---|" * len(outputs)]
    for dt, name in (("bf16", "bfloat16"), ("fp32", "float32")):
        cells = []
        for out in outputs:
            r = worst.get((dt, out))
            ratio = r and (r["err_ring"] / r["err_single"] if r["err_single"] else math.inf)
            cells.append(f"{r['used']:.2f} ({ratio:.2f}x)" if r else "-")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    top = max(worst.values(), key=lambda r: r["used"])
    lines += ["", f"No output used more than {100 * top['used']:.0f} % of its bound ({top['case']} {top['output']}, "
                  f"{top['world_size']} ranks)."]
    text = "\n".join(lines)
    print("\n" + text)
    if a.write:
        _write("distributed.md", "tolerances", text)
    return 0


# ----------------------------------------------------------------------------------------------------- validation note
SKIPPED = [
    ("dropout through the PyTorch API", "the harness regenerates the kernels' keep mask from the seed it hands "
     "them; dropout rows therefore run the kernels directly (lengths that are multiples of 128)"),
    ("lengths that are not multiples of 128 in the kernels themselves", "the kernels refuse them; such rows "
     "(1000 and 300 tokens) run through the PyTorch API's padding path and are judged on the unpadded problem"),
    ("seqlen beyond 16384, and real models at their full length", "simulator time, and the memory of the SDPA "
     "comparison, which takes whole rows (2.3 GB at 16K for one head, growing with the square of the length; the "
     "float64 golden runs in blocks of query rows): the models preset caps seqlen at 4096 (each row says so); "
     "the full preset has one 16K causal row"),
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
    """Per-dtype use of the harness's tolerance rules over all rows (for docs/validation.md)."""
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
             f"`python scripts/figures.py validation-note {' '.join(paths)} ...`:", "",
             "| dtype | outputs judged | worst err / rule-1 bound (where) | outputs where rule 2 applies | worst "
             "systematic / rule-2 bound (where) | outputs over the seed's band (not judged) | largest err / band |",
             "|---|---|---|---|---|---|---|"]
    for dt in ("float32", "bfloat16", "float16"):
        a = agg[dt]
        lines.append(f"| {dt} | {a['n']} | {a['worst'][0]:.3f} ({a['worst'][1]}) | {a['n2']} | "
                     f"{a['worst2'][0]:.3f} ({a['worst2'][1]}) | {a['band_over']} | {a['band'][0]:.2f} |")
    return "\n".join(lines)


def update_tolerances(table, path):
    from nki_attn.harness.report import replace_marked_section
    replace_marked_section(path, "harness-tolerances", table)


KEEP_MARK = "<!-- sections below are not generated: figures.py validation-note keeps them -->"


def _kept_sections(out):
    """The hand-maintained tail of the note (from KEEP_MARK on, e.g. the FlashAttention-reference check written by
    python scripts/compare.py flash-attention), kept across regenerations; "" when there is none."""
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
        "row by its dtype, so they fail, and the backward they feed fails with them. This is a verdict on precision, not a "
        "crash; its bfloat16 rows pass.",
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


def cmd_validation_note(args, out=None):
    """Write docs/validation.md and its measured tolerance table from harness reports (reports/*.json): what was
    validated, on what, and what was not; --candidate reports (other people's kernels) get verdict tables."""
    out = out or os.path.join(DOCS, "validation.md")
    paths = args.reports
    reports = [json.load(open(p)) for p in paths]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    command = " ".join(["python scripts/figures.py validation-note"] + paths +
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
            lines.append(f"- **an older report** (schema {rep.get('schema_version', 1)}): made by an earlier "
                         "version of "
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
    update_tolerances(tolerance_table(reports, paths), out)
    print(f"wrote {out} and its harness tolerance table")
    return 0


# ----------------------------------------------------------------------------------------------------- readme
# The README's figures (how long each command takes, how many rows each preset has), generated from committed
# measurements so that they are never typed by hand. ``readme measure`` runs one README command once, from the
# repository root, and records in TIMINGS its wall time, the 1-minute load average at its start and end, the CPU
# and the date (the machine is shared, so every time comes with its load); ``measure install`` installs into the
# interpreter given by ``--python`` (a virtual environment: it must not replace the package installed in the
# environment you work in). ``readme write`` fills the sections between ``<!-- readme-times:begin/end -->`` and
# ``<!-- readme-presets:begin/end -->`` from TIMINGS and the committed harness reports (the rows per preset and the
# full and models runs' own times and loads); ``readme check`` exits 1 when README.md differs from ``write``.
README_ROOT = pathlib.Path(ROOT)
README = README_ROOT / "README.md"
# Where the committed reports live: the harness reports and the README's timings. The one place to change if
# they move.
REPORTS_DIR = README_ROOT / "reports"
TIMINGS = REPORTS_DIR / "readme_timings.json"
PRESET_REPORTS = {"full": "harness_report_full.json", "models": "harness_report_models.json"}

README_SEP = "&&"


def readme_command(marker):
    """The shell command in the first ```bash block after ``<!-- {marker} -->`` in README.md."""
    text = README.read_text()
    found = re.search(rf"<!-- {re.escape(marker)} -->\s*```bash\n(.*?)```", text, flags=re.S)
    if not found:
        raise SystemExit(f"README.md has no ```bash block after <!-- {marker} -->")
    return found.group(1).strip()


def _readme_parts(marker):
    """README's `install && run` command split into its two halves."""
    install, run = readme_command(marker).split(README_SEP, 1)
    return install.strip(), run.strip()


def _readme_run(argv, env=None, cwd=README_ROOT):
    from nki_attn.harness.report import cpu_model, load_average
    load0, t0 = load_average(), time.perf_counter()
    proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, env=env)
    seconds = round(time.perf_counter() - t0, 1)
    entry = {"command": " ".join(shlex.quote(a) for a in argv), "seconds": seconds,
             "load_average": {"start": load0, "end": load_average()}, "cpu_model": cpu_model(),
             "cpus": os.cpu_count(), "date": datetime.date.today().isoformat(), "exit_code": proc.returncode}
    return entry, proc


def readme_measure(what, python=None):
    """Run one README command and return its timing entry (raises SystemExit when the command fails)."""
    if what == "quick":
        _, run = _readme_parts("quick-command")
        argv = [sys.executable, "-m", "nki_attn.cli"] + shlex.split(run)[1:]  # `nki-attn` from this checkout
        env = dict(os.environ, PYTHONPATH=str(README_ROOT))
    elif what == "suite":
        _, run = _readme_parts("test-command")
        argv = [sys.executable] + shlex.split(run)[1:]
        env = dict(os.environ, PYTHONPATH=str(README_ROOT))
    else:
        if not python:
            raise SystemExit("readme measure install needs --python: the interpreter of a virtual environment to "
                             "install into (not the one you work in)")
        install, _ = _readme_parts("quick-command")
        argv = [python, "-m"] + shlex.split(install)
        env = None
    with tempfile.TemporaryDirectory() as tmp:  # the check writes harness_report.json where it runs
        entry, proc = _readme_run(argv, env, cwd=tmp if what == "quick" else README_ROOT)
    entry["command"] = install if what == "install" else run  # as the README prints it
    if proc.returncode != 0:
        raise SystemExit(f"{entry['command']} exited {proc.returncode}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    if what == "suite":
        counts = re.findall(r"(\d+) (passed|failed|skipped|xfailed|deselected)", proc.stdout.splitlines()[-1])
        entry["tests"] = {k: int(n) for n, k in counts}
    return entry


def load_timings():
    return json.loads(TIMINGS.read_text()) if TIMINGS.exists() else {}


def _readme_duration(seconds):
    s = round(seconds)
    return f"{s} s" if s < 120 else f"{s // 60} min {s % 60:02d} s"


def _readme_load(entry):
    la = entry.get("load_average") or {}
    if la.get("start") is None:
        return "load average not recorded"
    a, b = la["start"], la["end"]
    return f"load average {a:.0f}" if round(a) == round(b) else f"load average {a:.0f} to {b:.0f}"


def _readme_where(entry):
    cpu = " ".join(w for w in str(entry.get("cpu_model") or "").split() if not w.startswith("(")) or "CPU unknown"
    cores = f"{entry['cpus']} cores" if entry.get("cpus") else "cores unknown"
    return f"{cpu}, {cores}, {_readme_load(entry)}, {entry.get('date', 'date unknown')}"


def times_sentence(timings):
    """The first screen's sentence: how long the install, the quick check and the test suite took."""
    parts = []
    if "install" in timings:
        t = timings["install"]
        parts.append(f"the install {_readme_duration(t['seconds'])} with every dependency already present "
                     f"({_readme_where(t)})")
    if "quick" in timings:
        t = timings["quick"]
        parts.append(f"the quick check {_readme_duration(t['seconds'])} ({_readme_where(t)})")
    if "suite" in timings:
        t = timings["suite"]
        n = sum(v for k, v in t.get("tests", {}).items() if k in ("passed", "failed", "skipped", "xfailed"))
        parts.append(f"the test suite {_readme_duration(t['seconds'])} ({n:,} tests; {_readme_where(t)})")
    return ("Real time of each, on machines shared with other jobs (1-minute load average at the start and end): "
            + "; ".join(parts) + ". Generated from `" + TIMINGS.relative_to(README_ROOT).as_posix()
            + "` by `python scripts/figures.py readme write`; `readme measure` re-times a command.")


def preset_reports():
    return {name: json.loads((REPORTS_DIR / f).read_text()) for name, f in PRESET_REPORTS.items()}


def presets_paragraph(timings, reports):
    """The check section's paragraph: rows and time of each preset, from the timings and the committed reports."""
    items = []
    if "quick" in timings:
        t = timings["quick"]
        items.append(f"quick {_readme_duration(t['seconds'])} with `-j 2` ({_readme_where(t)})")
    for name, rep in reports.items():
        s = rep["summary"]
        where = _readme_where({**rep["machine"], "load_average": rep["load_average"], "date": rep["created"][:10]})
        items.append(f"{name} ({s['rows']} rows, {s['passed']} pass) {_readme_duration(rep['wall_seconds'])} with "
                     f"`-j {rep['jobs']}` ({where}; the committed report "
                     f"`{(REPORTS_DIR / PRESET_REPORTS[name]).relative_to(README_ROOT).as_posix()}`)")
    return ("Real times on machines shared with other jobs (1-minute load average at the start and end of each "
            "run; each report records its own): " + "; ".join(items) + ".")


README_SECTIONS = {"readme-times": lambda t, r: times_sentence(t), "readme-presets": presets_paragraph}


def render(text, timings, reports):
    """README text with every generated section rewritten."""
    for name, make in README_SECTIONS.items():
        begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        text = head + begin + "\n" + make(timings, reports) + "\n" + end + tail
    return text


def readme_write():
    from nki_attn.harness.report import replace_marked_section
    timings, reports = load_timings(), preset_reports()
    for name, make in README_SECTIONS.items():
        replace_marked_section(str(README), name, make(timings, reports))


def cmd_readme(a):
    """The README's generated figures: time a README command, write README.md's sections, or check them.

    python scripts/figures.py readme measure quick        time `nki-attn check --preset quick -j 2`
    python scripts/figures.py readme measure suite        time the README's test run (pytest -q -n 2)
    python scripts/figures.py readme measure install --python VENV/bin/python   time the README's install
    python scripts/figures.py readme write                rewrite README.md's generated sections
    python scripts/figures.py readme check                exit 1 when README.md differs from `write`
"""
    if a.readme_command == "measure":
        entry = readme_measure(a.what, a.python)
        timings = load_timings()
        timings[a.what] = entry
        TIMINGS.write_text(json.dumps(timings, indent=1) + "\n")
        print(json.dumps(entry, indent=1))
        if not a.no_write:
            readme_write()
        return 0
    if a.readme_command == "write":
        readme_write()
        return 0
    want = render(README.read_text(), load_timings(), preset_reports())
    if want != README.read_text():
        print("README.md's generated sections are out of date: run python scripts/figures.py readme write",
              file=sys.stderr)
        return 1
    return 0


# ----------------------------------------------------------------------------------------------------- main

# ------------------------------------------------------------------------------------------------------ accuracy
ACCURACY_DOC_MARK = "<!-- figures.py accuracy -->"


def _acc_inputs(b, h, s, d, seed, q_factor=1.0):
    """Kernel-layout bfloat16 inputs ``q, k, v, dy`` ``[b, h, d, s]`` (one kv head per query head); ``q`` is the
    standard normal draw times ``q_factor`` before its rounding to bfloat16 (the same draw for every factor)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, dy = (torch.randn(b, h, d, s, generator=g, dtype=torch.float64) for _ in range(4))
    return (q * q_factor).bfloat16(), k.bfloat16(), v.bfloat16(), dy.bfloat16()


def _acc_torch(q, k, v, dy, scale, causal, dtype, reduce_in_dtype=False):
    """o, dq, dk, dv of torch's SDPA math path (``aten._scaled_dot_product_attention_math``) in ``dtype``, from
    kernel-layout ``[b, h, d, s]`` tensors, returned in that layout. ``reduce_in_dtype``: torch's
    ``allow_fp16_bf16_reduction_math_sdp(True)``, the whole computation in the 16-bit dtype; False (torch's
    default): the math path upcasts q, k, v to float32, computes in float32 (forward and autograd backward) and
    rounds its output, and each gradient, to the dtype once (the ``.to`` casts at its ends)."""
    was = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(reduce_in_dtype)
    try:
        leaves = [x.transpose(-1, -2).to(dtype).detach().requires_grad_(True) for x in (q, k, v)]
        o = torch.ops.aten._scaled_dot_product_attention_math(*leaves, None, 0.0, causal, scale=scale)[0]
        o.backward(dy.transpose(-1, -2).to(dtype))
    finally:
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(was)
    return [t.transpose(-1, -2).detach() for t in (o, *(x.grad for x in leaves))]


def _rel_fro(t, r):
    """Relative Frobenius error of ``t`` against the float64 ``r``."""
    t = torch.as_tensor(t).double()
    return float((t - r).norm() / r.norm())


def _acc_errors(q, k, v, dy, scale, causal, kernel_default=True):
    """Relative Frobenius errors {output: (ours, torch SDPA math in bfloat16 with float32 reductions, the same
    with bfloat16 reductions, ours with the backward kernel's default mixed_precision=False or None)} against
    float64 computed from the same bfloat16 inputs. Ours = ``kernel_api.attention_fwd`` then ``attention_bwd`` on
    its own o and LSE, both with ``mixed_precision=True``: the arguments the PyTorch API passes
    (``ops.kernel_keywords``), so what FlashAttention-2 is compared with through SDPA."""
    from nki_attn.kernel_api import attention_bwd, attention_fwd
    ref = _acc_torch(q, k, v, dy, scale, causal, torch.float64)
    low = _acc_torch(q, k, v, dy, scale, causal, torch.bfloat16)
    low16 = _acc_torch(q, k, v, dy, scale, causal, torch.bfloat16, reduce_in_dtype=True)
    o, lse = attention_fwd(q, k, v, use_causal_mask=causal, softmax_scale=scale, mixed_precision=True)
    ours = (o, *attention_bwd(q, k, v, o, dy, lse, use_causal_mask=causal, softmax_scale=scale,
                              mixed_precision=True)[:3])
    plain = (None,) * 4
    if kernel_default:
        plain = (o, *attention_bwd(q, k, v, o, dy, lse, use_causal_mask=causal, softmax_scale=scale)[:3])
    return {n: (_rel_fro(got, r), _rel_fro(t, r), _rel_fro(t16, r), None if pl is None else _rel_fro(pl, r))
            for n, got, t, t16, pl, r in zip(("o", "dq", "dk", "dv"), ours, low, low16, plain, ref)}


def args_accuracy(p):
    """Arguments of the ``accuracy`` subcommand."""
    p.add_argument("--head-dims", type=int, nargs="+", default=[32, 64, 96, 128, 192, 256])
    p.add_argument("--seqlens", type=int, nargs="+", default=[1024, 2048])
    p.add_argument("--heads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the rows to this file")
    p.add_argument("--from-json", nargs="+", default=[], metavar="FILE",
                   help="do not measure: tabulate the rows of earlier --json files (concatenated)")
    p.add_argument("--write", action="store_true", help="write the table into docs/validation.md")


def run_accuracy(a):
    """bfloat16 accuracy of forward + backward with the default scale 1/sqrt(d_head) against a power-of-two scale
    and torch's bfloat16 SDPA math path.

    Per (head dim, causal, tokens): every output's relative Frobenius error against float64 computed from the
    same bfloat16-rounded inputs, at the default scale s = 1/sqrt(d) (ours and torch's), and ours at the nearest
    power-of-two scale p with q drawn s/p times larger (the same draw, so the logits have the same distribution
    and only the scale's value differs). Ratios: ``vs p2`` = ours(s) / ours(p) (target <= 1.05); ``vs torch`` =
    ours(s) / torch(s) for torch's bfloat16 SDPA math path in its two modes: ``f32`` its default (float32
    reductions, outputs rounded to bfloat16) and ``bf16`` (``allow_fp16_bf16_reduction_math_sdp(True)``, the
    computation in bfloat16). Ours is both kernels with ``mixed_precision=True``, the arguments of the PyTorch
    API (the path FlashAttention-2 is compared with through SDPA); ``kernel default`` is the backward kernel run
    with its own default ``mixed_precision=False`` on the same forward (dS from the bfloat16 P, docs/validation.md
    "Where the backward's error comes from"). Runs the kernels on the simulator (numerics only; no time is
    reported). Exit status 1 when a ratio to the power-of-two scale exceeds 1.05 or one to torch f32 exceeds 1.55.
    """
    rows = []
    for path in a.from_json:
        with open(path) as f:
            rows += json.load(f)
    for d in [] if a.from_json else a.head_dims:
        s = d ** -0.5
        p2 = 2.0 ** round(math.log2(s))
        for n in a.seqlens:
            for causal in (False, True):
                t0 = time.time()
                e_s = _acc_errors(*_acc_inputs(1, a.heads, n, d, a.seed), s, causal)
                e_p = e_s if p2 == s else _acc_errors(*_acc_inputs(1, a.heads, n, d, a.seed, s / p2), p2, causal,
                                                      kernel_default=False)
                row = dict(d=d, seqlen=n, causal=causal, scale=s, p2=p2, bwd_mixed_precision=True,
                           ours={k: v[0] for k, v in e_s.items()}, torch={k: v[1] for k, v in e_s.items()},
                           torch_bf16={k: v[2] for k, v in e_s.items()}, ours_p2={k: v[0] for k, v in e_p.items()},
                           kernel_default={k: v[3] for k, v in e_s.items()})
                row["vs_p2"] = {k: row["ours"][k] / row["ours_p2"][k] for k in row["ours"]}
                row["vs_torch"] = {k: row["ours"][k] / row["torch"][k] for k in row["ours"]}
                row["vs_torch_bf16"] = {k: row["ours"][k] / row["torch_bf16"][k] for k in row["ours"]}
                row["default_vs_torch"] = {k: row["kernel_default"][k] / row["torch"][k] for k in row["ours"]}
                rows.append(row)
                print(f"d={d} n={n} causal={causal} ({time.time() - t0:.0f} s wall): "
                      + "  ".join(f"{k} {row['ours'][k]:.3e} p2x{row['vs_p2'][k]:.3f} f32x{row['vs_torch'][k]:.3f} "
                                  f"bf16x{row['vs_torch_bf16'][k]:.3f} defaultx{row['default_vs_torch'][k]:.3f}"
                                  for k in row["ours"]), flush=True)
    outs = ("o", "dq", "dk", "dv")

    def worst(r, key):
        w = max(r[key], key=r[key].get)
        return f"{r[key][w]:.3f} ({w})"
    head = ("| head_dim | tokens | causal | ours o / dq / dk / dv | worst vs p2 | worst vs torch f32 | "
            "worst vs torch bf16 | kernel default dq / dk / dv vs torch f32 | torch f32 o / dq / dk / dv | "
            "torch bf16 o / dq / dk / dv |\n"
            "|---|---|---|---|---|---|---|---|---|---|\n")
    body = ""
    for r in rows:
        dflt = r.get("default_vs_torch")
        body += (f"| {r['d']} | {r['seqlen']} | {'yes' if r['causal'] else 'no'} | "
                 + " / ".join(f"{r['ours'][k]:.2e}" for k in outs)
                 + f" | {worst(r, 'vs_p2')} | {worst(r, 'vs_torch')} | {worst(r, 'vs_torch_bf16')} | "
                 + (" / ".join(f"{dflt[k]:.3f}" for k in outs[1:]) if dflt else "-") + " | "
                 + " / ".join(f"{r['torch'][k]:.2e}" for k in outs) + " | "
                 + " / ".join(f"{r['torch_bf16'][k]:.2e}" for k in outs) + " |\n")
    worst_p = max(max(r["vs_p2"].values()) for r in rows)
    per_out = {k: max(r["vs_torch"][k] for r in rows) for k in outs}
    per_out16 = {k: max(r["vs_torch_bf16"][k] for r in rows) for k in outs}
    dflt_rows = [r for r in rows if r.get("default_vs_torch")]
    per_dflt = {k: max(r["default_vs_torch"][k] for r in dflt_rows) for k in outs[1:]} if dflt_rows else {}
    table = head + body + (
        f"\nWorst ratio to the power-of-two scale: {worst_p:.3f} (target 1.05). Worst ratio per output to torch "
        "f32 (default math path): " + ", ".join(f"{k} {v:.3f}" for k, v in per_out.items())
        + " (target 1.55); to torch bf16 (reductions in bfloat16): "
        + ", ".join(f"{k} {v:.3f}" for k, v in per_out16.items())
        + (". The backward kernel's default mixed_precision=False, to torch f32: "
           + ", ".join(f"{k} {v:.3f}" for k, v in per_dflt.items()) if per_dflt else "") + ".\n")
    print(table)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    if a.write:
        path = os.path.join(DOCS, "validation.md")
        text = open(path).read()
        i = text.index(ACCURACY_DOC_MARK) + len(ACCURACY_DOC_MARK)
        j = text.index(ACCURACY_DOC_MARK, i)
        with open(path, "w") as f:
            f.write(text[:i] + "\n" + table + text[j:])
    return 0 if worst_p <= 1.05 and max(per_out.values()) <= 1.55 else 1


# ------------------------------------------------------------------------------------------------ accuracy steps
# Which rounding of a flash backward costs what: a float64 model of forward + backward that rounds to bfloat16
# exactly where a flash implementation must or may (every other value exact: float32's 2^-24 is nothing next to
# bfloat16's 2^-9), switched on one at a time, against the kernels run in both mixed_precision modes.
ROUNDINGS = {
    "out": "o, dq, dk, dv rounded to bf16 once (any bf16-output implementation; torch f32 itself)",
    "p_mm": "P rounded to bf16 as a matmul operand: exp(s - m) for PV (forward), exp(s - LSE) for dV",
    "d_o16": "D = rowsum(dO o O) from the bf16 O the forward wrote",
    "d_ours": "D as d_o16, but exact (sum_j P dP) on rows whose keys fit one 128-key chunk (attention_bwd)",
    "ds": "dS rounded to bf16 as the dK, dQ matmul operand",
    "p_ds": "dS computed from the bf16 P instead of the float32 P",
    "dq_part": "dQ partial sums rounded to bf16 between K/V sections",
    "d_o32": "D = rowsum(dO o O) from the float32 O before its rounding",
}
STEPS_ROWS = (  # (roundings, what the row is): cumulative in a flash backward's order, then each one alone
    (("out",), "the comparator's own roundings"),
    (("out", "p_mm"), "adds P's"),
    (("out", "p_mm", "d_o16"), "adds D's"),
    (("out", "p_mm", "d_o16", "ds"), "adds dS's: FlashAttention-2's roundings"),
    (("out", "p_mm", "d_ours", "ds"), "ours, mixed_precision=True: D exact on the rows of one 128-key chunk"),
    (("out", "p_mm", "d_ours", "ds", "p_ds"), "adds dS from the bf16 P: ours, mixed_precision=False"),
    (("out", "p_mm", "d_ours", "ds", "p_ds", "dq_part"), "adds bf16 dQ partial sums: the same, several sections"),
    (("out", "ds"), "dS's alone"),
    (("out", "d_o16"), "D's alone"),
    (("out", "p_ds"), "dS from the bf16 P alone"),
    (("out", "p_mm", "ds"), "FlashAttention-2's with D exact (sum_j P dP)"),
    (("out", "p_mm", "d_o32", "ds"), "FlashAttention-2's with D from the float32 O"),
)


def _acc_model(q, k, v, dy, scale, causal, rounds, sections=1):
    """o, dq, dk, dv (kernel layout ``[b, h, d, s]``, float64) of a flash forward + backward computed exactly
    from the bfloat16 inputs ``q, k, v, dy`` ``[b, h, d, s]`` except for the bfloat16 roundings named in
    ``rounds`` (keys of ``ROUNDINGS``). P is not tiled: the forward's PV operand is exp(s - m) with m the row's
    max (a flash forward whose row fits one key block; with several, the running max changes which values are
    rounded, not how much), normalised after the matmul; the backward's is exp(s - LSE). ``sections``: K/V
    sections of the dQ accumulation (``dq_part`` rounds the partial sum at each boundary)."""
    def bf(x):
        return x.to(torch.bfloat16).double()

    def r(name, x):
        return bf(x) if name in rounds else x
    q, k, v, dy = (x.transpose(-1, -2).double() for x in (q, k, v, dy))
    # the last key each 128-row query tile sees (causal: bottom-right aligned, seqlen_q == seqlen_k)
    rows = torch.arange(q.shape[-2])
    last_key = rows // 128 * 128 + 127 if causal else torch.full_like(rows, k.shape[-2] - 1)
    s = scale * (q @ k.transpose(-1, -2))
    if causal:
        n, m = s.shape[-2:]
        s = s.masked_fill(torch.ones(n, m, dtype=torch.bool).triu(m - n + 1), float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    e = torch.exp(s - m)
    el = e.sum(dim=-1, keepdim=True)
    o32 = (r("p_mm", e) @ v) / el
    o = r("out", o32)
    p = e / el
    dp = dy @ v.transpose(-1, -2)
    if "d_o16" in rounds:
        dsum = (dy * o).sum(-1, keepdim=True)
    elif "d_ours" in rounds:
        one_chunk = (last_key < 128)[:, None]
        dsum = torch.where(one_chunk, (p * dp).sum(-1, keepdim=True), (dy * o).sum(-1, keepdim=True))
    elif "d_o32" in rounds:
        dsum = (dy * o32).sum(-1, keepdim=True)
    else:
        dsum = (p * dp).sum(-1, keepdim=True)
    ds = r("ds", r("p_ds", p) * (dp - dsum))
    dv = r("p_mm", p).transpose(-1, -2) @ dy
    dk = scale * (ds.transpose(-1, -2) @ q)
    w = k.shape[-2] // sections
    # a 128-row query tile's partial sum leaves the chip only before a section it still sees a key in
    dq = torch.zeros_like(q)
    for i in range(sections):
        dq = dq + ds[..., i * w:(i + 1) * w] @ k[..., i * w:(i + 1) * w, :]
        if i < sections - 1:
            dq = torch.where((last_key >= (i + 1) * w)[:, None], r("dq_part", dq), dq)
    return [r("out", t).transpose(-1, -2) for t in (o, scale * dq, dk, dv)]


def args_accuracy_steps(p):
    """Arguments of the ``accuracy-steps`` subcommand."""
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=1024)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--k-section-len", type=int, default=256,
                   help="the section length of the several-sections kernel run and model row (default 256)")
    p.add_argument("--write", action="store_true", help="write the table into docs/validation.md")


def run_accuracy_steps(a):
    """Where a flash backward's bfloat16 error comes from: the float64 rounding model (``_acc_model``) with its
    bfloat16 roundings added one at a time, and the kernels themselves, as ratios of each output's relative
    Frobenius error to torch's SDPA math path in its default mode (torch f32), on the inputs of ``figures.py
    accuracy`` at scale 1/sqrt(d), causal and not. The kernels run on the simulator (numerics only, no time)."""
    from nki_attn.kernel_api import attention_bwd, attention_fwd
    outs = ("o", "dq", "dk", "dv")
    d, n = a.head_dim, a.seqlen
    scale = d ** -0.5
    sections = n // a.k_section_len
    table = {}
    for causal in (False, True):
        t0 = time.time()
        q, k, v, dy = _acc_inputs(1, a.heads, n, d, a.seed)
        ref = _acc_torch(q, k, v, dy, scale, causal, torch.float64)
        floor = [_rel_fro(t, r) for t, r in zip(_acc_torch(q, k, v, dy, scale, causal, torch.bfloat16), ref)]
        res = {}
        for rounds, what in STEPS_ROWS:
            got = _acc_model(q, k, v, dy, scale, causal, set(rounds), sections=sections)
            res[("model", " + ".join(rounds), what)] = [_rel_fro(g, r) / f for g, r, f in zip(got, ref, floor)]
        o, lse = attention_fwd(q, k, v, use_causal_mask=causal, softmax_scale=scale, mixed_precision=True)
        for label, kw in (("mixed_precision=True", dict(mixed_precision=True)),
                          ("mixed_precision=False", dict(mixed_precision=False)),
                          (f"mixed_precision=False, k_section_len={a.k_section_len}",
                           dict(mixed_precision=False, k_section_len=a.k_section_len))):
            got = (o, *attention_bwd(q, k, v, o, dy, lse, use_causal_mask=causal, softmax_scale=scale, **kw)[:3])
            res[("kernel", label, "")] = [_rel_fro(g, r) / f for g, r, f in zip(got, ref, floor)]
        res[("torch f32", "", "the unit: its relative error")] = floor
        table[causal] = res
        print(f"causal={causal}: {time.time() - t0:.0f} s wall", file=sys.stderr)
    lines = [f"d_head {d}, {a.heads} heads x {n} tokens, scale 1/sqrt({d}), bf16; each output's relative "
             "Frobenius error against float64 / the comparator's (torch f32, last row). Model roundings: "
             + "; ".join(f"`{k}` {v}" for k, v in ROUNDINGS.items())
             + f" (several K/V sections: {sections} of {a.k_section_len} keys).", "",
             "| | roundings or run | what | non-causal o / dq / dk / dv | causal o / dq / dk / dv |",
             "|---|---|---|---|---|"]
    for key in table[False]:
        fmt = "{:.2e}" if key[0] == "torch f32" else "{:.3f}"
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | "
                     + " / ".join(fmt.format(x) for x in table[False][key]) + " | "
                     + " / ".join(fmt.format(x) for x in table[True][key]) + " |")
    text = "\n".join(lines)
    print(text)
    if a.write:
        _write("validation.md", "accuracy-steps", text)
    return 0


# ----------------------------------------------------------------------------------------------------- masks
def _mask_gallery(s):
    """(title, mask_mod) of the prebuilt masks at ``s`` tokens, as docs/masks.md draws them."""
    from nki_attn import masks
    ids = torch.tensor([0] * (s * 3 // 8) + [1] * (s * 5 // 16) + [2] * (s - s * 3 // 8 - s * 5 // 16))
    return [
        ("causal", masks.causal_mask),
        (f"sliding_window({s // 5})", masks.sliding_window(s // 5)),
        ("document (3 docs) & causal", masks.and_masks(masks.causal_mask, masks.document(ids))),
        (f"prefix_lm({s // 3})", masks.prefix_lm(s // 3)),
        (f"chunked_local({s // 5})", masks.chunked_local(s // 5)),
        (f"dilated(4, window={s // 16})", masks.dilated(4, window=s // 16)),
    ]


def cmd_masks(a):
    """the prebuilt masks drawn as their blocks (docs/masks.md): text pictures, and a PNG with --out"""
    from nki_attn.block_mask import FULL, PARTIAL, create_block_mask
    gallery = [(t, create_block_mask(m, None, None, a.seqlen, a.seqlen)) for t, m in _mask_gallery(a.seqlen)]
    for title, bm in gallery:
        print(f"{title}:\n{bm.to_string()}\n")
    if a.out:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.colors import ListedColormap
        cmap = ListedColormap(["#ffffff", "#f4a259", "#2a4d69"])  # skip, partial, full
        fig, axes = plt.subplots(2, 3, figsize=(10.5, 8.4))
        for ax, (title, bm) in zip(axes.flat, gallery):
            c = bm.classes[0, 0].numpy()
            ax.imshow(c, cmap=cmap, vmin=0, vmax=2, interpolation="nearest")
            n = bm.counts()
            ax.set_title(f"{title}\nfull {n['full']}, partial {n['partial']}, skip {n['skip']}", fontsize=9)
            ax.set_xticks([])
            ax.set_yticks([])
            ax.set_xlabel("key blocks (128)", fontsize=8)
            ax.set_ylabel("query blocks (128)", fontsize=8)
        handles = [plt.Rectangle((0, 0), 1, 1, facecolor=cmap(i), edgecolor="#999999") for i in (FULL, PARTIAL, 0)]
        fig.legend(handles, ["FULL: no mask instruction", "PARTIAL: bitmap from HBM", "SKIP: no instruction"],
                   loc="lower center", ncol=3, fontsize=9)
        fig.suptitle(f"Block classes of the prebuilt masks, {a.seqlen} tokens, 128 x 128 blocks "
                     f"(python scripts/figures.py masks --out ...)", fontsize=10)
        fig.tight_layout(rect=(0, 0.05, 1, 0.96))
        fig.savefig(a.out, dpi=110)
        print(f"wrote {a.out}")
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n")[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(parent, name, run):
        p = parent.add_parser(name, help=run.__doc__.split("\n")[0], description=run.__doc__)
        p.set_defaults(run=run)
        return p

    for name, run, doc in (("fwd", cmd_fwd, "kernel-fwd.md"), ("bwd", cmd_bwd, "kernel-bwd.md")):
        add(sub, name, run).add_argument("--write", action="store_true", help=f"write the table into docs/{doc}")
    p = add(sub, "masks", cmd_masks)
    p.add_argument("--seqlen", type=int, default=2048)
    p.add_argument("--out", metavar="F.png", help="write the picture of the blocks to F.png (matplotlib)")
    p = add(sub, "bwd-tolerances", cmd_bwd_tolerances)
    p.add_argument("--write", action="store_true", help="write the table into docs/validation.md")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "float16"],
                   choices=["float32", "bfloat16", "float16"])
    p.add_argument("--seeds", type=int, default=3)

    p = add(sub, "variants", cmd_variants)
    p.add_argument("--kernels", nargs="+", choices=("fwd", "bwd"), default=["fwd", "bwd"])
    p.add_argument("--only", action="append", metavar="LABEL",
                   help="run only this row (repeatable; the defaults always run); --write is then ignored")
    p.add_argument("--json", metavar="F", help="write every row as JSON")
    p.add_argument("--write", action="store_true", help="write the tables into docs/performance.md")

    ring = sub.add_parser("ring", help="ring attention (docs/distributed.md): steps, threshold, balance, tolerances")
    rsub = ring.add_subparsers(dest="ring_command", required=True, metavar="RING_COMMAND")
    s = add(rsub, "steps", cmd_steps)
    s.add_argument("--world-size", type=int, default=4)
    s.add_argument("--seqlen-local", type=int, default=512)
    s.add_argument("--batch", type=int, default=1)
    s.add_argument("--heads", type=int, default=8)
    s.add_argument("--kv-heads", type=int, default=2)
    s.add_argument("--head-dim", type=int, default=128)
    s.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    s.add_argument("--layout", choices=("ring", "zigzag"), default="ring")
    s.add_argument("--causal", action="store_true")
    s.add_argument("--window", type=int, default=None, help="sliding window W (keys i-W+1..i; implies --causal)")
    s.add_argument("--target", default="trn2")
    s.add_argument("--timeout", type=float, default=1800)
    s.add_argument("--json")
    t = add(rsub, "threshold", cmd_threshold)
    t.add_argument("--heads", type=int, default=8)
    t.add_argument("--kv-heads", type=int, nargs="+", default=[8, 1])
    t.add_argument("--head-dim", type=int, default=128)
    t.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    t.add_argument("--seqlens", type=int, nargs="+", default=[128, 256, 512, 1024, 2048, 4096])
    t.add_argument("--target", default="trn2")
    t.add_argument("--json")
    b = add(rsub, "balance", cmd_balance)
    b.add_argument("--seqlen", type=int, default=65536)
    b.add_argument("--world-size", type=int, default=8)
    b.add_argument("--window", type=int, default=None)
    o = add(rsub, "tolerances", cmd_tolerances)
    o.add_argument("--seeds", type=int, default=3)
    o.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4], choices=sorted(RING_CASES))
    o.add_argument("--timeout", type=float, default=3600)
    o.add_argument("--write", action="store_true", help="write the table into docs/distributed.md")

    v = add(sub, "validation-note", cmd_validation_note)
    v.add_argument("reports", nargs="+", help="harness reports of our kernels (reports/harness_report_full.json, "
                                              "reports/harness_report_models.json)")
    v.add_argument("--candidate", action="append", default=[], metavar="REPORT",
                   help="a report of nki-attn check --candidate-bwd/--candidate-fwd (repeatable)")
    args_accuracy(add(sub, "accuracy", run_accuracy))
    args_accuracy_steps(add(sub, "accuracy-steps", run_accuracy_steps))
    r = sub.add_parser("readme", help=cmd_readme.__doc__.split("\n")[0], description=cmd_readme.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    r.set_defaults(run=cmd_readme)
    rsub = r.add_subparsers(dest="readme_command", required=True, metavar="README_COMMAND")
    m = rsub.add_parser("measure", help="time one README command and record it")
    m.add_argument("what", choices=["install", "quick", "suite"])
    m.add_argument("--python", help="(install) the interpreter of a virtual environment to install into")
    m.add_argument("--no-write", action="store_true", help="record the timing but leave README.md as it is")
    rsub.add_parser("write", help="rewrite README.md's generated sections")
    rsub.add_parser("check", help="exit 1 when README.md's generated sections are out of date")
    a = ap.parse_args(argv)
    if getattr(a, "window", None) and hasattr(a, "causal"):
        a.causal = True
    return a.run(a) or 0


if __name__ == "__main__":
    sys.exit(main())
