"""Modeled time of our attention kernels against the NKI Library's, side by side, in one run.

The NKI Library is not part of this repository: point the script at a local checkout of the public
aws-neuron/nki-library repository (its package lives under src/nkilib_src)::

    python scripts/bench_vs_nki_library.py --nkilib /path/to/nki-library \\
        [--max-bwd-ratio 0.70] [--max-fwd-ratio 0.80] [--max-bwd-floor-ratio 2.5] [--json out.json]

For each of its four shapes it runs, on the simulator with the instruction trace on and identical inputs (bf16,
mixed precision, target trn2 unless ``--target`` says otherwise):

- backward: our ``attention_bwd`` and the library's ``attention_bwd`` (same signature and layouts; ``o`` and
  ``lse`` from the torch golden forward, outside the trace);
- forward: our ``attention_fwd`` and the library's ``attention_cte`` with ``cache_softmax=True`` (its training
  mode: it also writes the softmax statistics ``-max`` and ``1/sum``, from which ``lse = -(-max) - log(1/sum)``),
  called with the layouts ours uses (``tp_q=False, tp_k=False, tp_out=True``; V is ``[seqlen, d]`` in its API).
  With a sliding window the library requires ``scale=1``, so q is pre-scaled on the host for it.

The library's kernels run unmodified through ``nki_attn.sim.install_as_nki()``. Both kernels' outputs are compared
with each other (a gross mismatch means they did not solve the same problem and fails the run). Every device time
is MODELED by nki_attn.profiler (docs/performance.md), never measured.

It prints the ratio table (our modeled time / the library's, perfect-overlap bound), the busy time per engine and
shared resource, the engine balance per (128-query x 512-key) tile pair, how far each kernel is from the
useful-FLOP bound (TensorE peak on the FlashAttention FLOP count), and with ``--model-steps`` the same ratios
under each earlier version of the cost model. It exits 1 when a ratio is past a limit given on the command line
(``--max-bwd-floor-ratio`` applies to shape (a)), 2 on bad arguments.
"""
import argparse
import hashlib
import json
import math
import os
import pathlib
import subprocess
import sys
import time
from dataclasses import dataclass

import ml_dtypes
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import nki_attn.sim as sim  # noqa: E402
from nki_attn.profiler import generation, profile  # noqa: E402
from nki_attn.profiler.flops import useful_attention_flops  # noqa: E402
from nki_attn.profiler.model import RESOURCES  # noqa: E402
from nki_attn.profiler.params import CORRECTIONS, revert  # noqa: E402
from nki_attn.profiler.params import MODEL  # noqa: E402
from nki_attn.sim.benchmark import run_benchmark  # noqa: E402

BF16 = ml_dtypes.bfloat16
ENGINES = ("TensorE", "VectorE", "ScalarE", "GpSimdE", "DMA")
Q_TILE, K_TILE = 128, 512


@dataclass(frozen=True)
class Shape:
    """One benchmark case: ``B`` batch, ``H`` query heads, ``HKV`` kv heads, ``S`` sequence length (queries and
    keys), ``D`` head dim, ``causal``, ``window`` (None: none), ``sinks`` per head (0 or 1)."""

    label: str
    B: int
    H: int
    HKV: int
    S: int
    D: int
    causal: bool
    window: int = None
    sinks: int = 0


SHAPES = {
    "a": Shape("B1, 4 heads / 1 kv head, S 2048, d128, causal", 1, 4, 1, 2048, 128, True),
    "b": Shape("1x1x1 heads, S 4096, d128, non-causal", 1, 1, 1, 4096, 128, False),
    "c": Shape("GPT-OSS-like 8/1 heads, S 2048, d64, causal, window 128, 1 sink/head", 1, 8, 1, 2048, 64, True,
               128, 1),
    "d": Shape("4/4 heads, S 2048, d128, causal", 1, 4, 4, 2048, 128, True),
}


# ----------------------------------------------------------------------------------------------------- setup
def load_library(path):
    """Import the NKI Library's attention kernels from a checkout at ``path``; returns (bwd, cte, commit)."""
    pkg = pathlib.Path(path) / "src" / "nkilib_src"
    if not (pkg / "nkilib" / "core" / "attention" / "attention_bwd.py").is_file():
        raise SystemExit(f"--nkilib {path}: no src/nkilib_src/nkilib/core/attention/attention_bwd.py under it; "
                         f"give the root of an aws-neuron/nki-library checkout")
    if not sim.install_as_nki():
        raise SystemExit("a real 'nki' package is importable; this script compares kernels on the simulator")
    sys.path.insert(0, str(pkg))
    from nkilib.core.attention.attention_bwd import attention_bwd
    from nkilib.core.attention.attention_cte import attention_cte
    try:
        commit = subprocess.run(["git", "-C", str(path), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown (not a git checkout)"
    return attention_bwd, attention_cte, commit


def kernel_versions():
    """sha256[:12] of our kernel sources (the figures go stale when they change)."""
    root = ROOT / "nki_attn" / "kernels"
    return {f: hashlib.sha256((root / f).read_bytes()).hexdigest()[:12]
            for f in ("attention_fwd.py", "attention_bwd.py")}


def make_inputs(sh, seed):
    """bf16 q, dy ``[B, H, D, S]``, k, v ``[B, HKV, D, S]``; float32 sinks ``[B, H]`` when the shape has them."""
    rng = np.random.default_rng(seed)

    def rand(*shape):
        return rng.standard_normal(shape).astype(np.float32).astype(BF16)

    x = {"q": rand(sh.B, sh.H, sh.D, sh.S), "k": rand(sh.B, sh.HKV, sh.D, sh.S), "v": rand(sh.B, sh.HKV, sh.D, sh.S),
         "dy": rand(sh.B, sh.H, sh.D, sh.S), "sinks": None}
    if sh.sinks:
        x["sinks"] = rng.standard_normal((sh.B, sh.H)).astype(np.float32)
    return x


def golden_o_lse(sh, x):
    """o (bf16) and lse (float32) from the torch golden forward, mixed precision (the backward's inputs)."""
    from golden.attention_fwd_torch import attention_fwd_torch_ref
    from nki_attn.sim.runtime import _numpy_to_torch, _torch_to_numpy
    t = {k: (_numpy_to_torch(v) if v is not None else None) for k, v in x.items()}
    o, lse = attention_fwd_torch_ref(t["q"], t["k"], t["v"], sinks_ref=t["sinks"], use_causal_mask=sh.causal,
                                     mixed_precision=True, sliding_window=sh.window)
    return _torch_to_numpy(o), _torch_to_numpy(lse.float())


def visible_tile_pairs(sh):
    """(128-query x 512-key) tiles that hold at least one visible (query, key) pair, over all batches and heads."""
    i = np.arange(sh.S)[:, None]
    j = np.arange(sh.S)[None, :]
    vis = np.ones((sh.S, sh.S), bool)
    if sh.causal:
        vis &= j <= i
    if sh.window:
        vis &= j >= i - sh.window + 1
    per_head = vis.reshape(sh.S // Q_TILE, Q_TILE, sh.S // K_TILE, K_TILE).any(axis=(1, 3)).sum()
    return int(per_head) * sh.B * sh.H


# ----------------------------------------------------------------------------------------------------- runs
class Progress:
    def __init__(self, total):
        self.total, self.done, self.t0 = total, 0, time.perf_counter()

    def run(self, what, fn):
        """Run ``fn`` under the trace; returns (result, records)."""
        self.done += 1
        print(f"[{self.done}/{self.total}] {what} ...", end="", flush=True)
        t = time.perf_counter()
        # through nki.benchmark (the simulator's: modeled latency from the trace; a real NKI's on Trainium)
        out, res = run_benchmark(fn, (), warmup=0, iters=1)
        if res.records is None:
            raise SystemExit("a real NeuronDevice measured this run: the per-engine comparison needs the simulator")
        print(f" {time.perf_counter() - t:.1f} s, {len(res.records)} instructions, modeled "
              f"{res.nc_latency.get_latency_percentile(50):.1f} us (elapsed {time.perf_counter() - self.t0:.0f} s)",
              flush=True)
        return out, res.records


def _f32(a):
    return np.asarray(a).astype(np.float32)


def _mismatch(ours, theirs):
    """max |ours - theirs| / max |theirs|."""
    a, b = _f32(ours), _f32(theirs)
    return float(np.abs(a - b).max() / max(float(np.abs(b).max()), 1e-30))


def run_shape(name, sh, lib_bwd, lib_cte, kernels, prog, seed):
    """Run the chosen kernels (``bwd``, ``fwd``) of one shape, ours and the library's; returns
    ``{kernel: {"ours": records, "lib": records, "mismatch": {...}}}``."""
    from nki_attn.kernels.attention_bwd import attention_bwd
    from nki_attn.kernels.attention_fwd import attention_fwd

    x = make_inputs(sh, seed)
    out = {}
    if "fwd" in kernels:
        (o, lse), ours = prog.run(f"({name}) forward, ours: attention_fwd",
                                  lambda: attention_fwd(x["q"], x["k"], x["v"], sinks_ref=x["sinks"],
                                                        use_causal_mask=sh.causal, mixed_precision=True,
                                                        sliding_window=sh.window))
        scale = 1.0 / math.sqrt(sh.D)
        q = x["q"].reshape(sh.B * sh.H, sh.D, sh.S)
        if sh.window:  # the library asks for scale=1 with a sliding window: pre-scale q outside the trace
            q, scale = (q.astype(np.float32) * scale).astype(BF16), 1.0
        k = x["k"].reshape(sh.B * sh.HKV, sh.D, sh.S)
        v = np.ascontiguousarray(x["v"].reshape(sh.B * sh.HKV, sh.D, sh.S).transpose(0, 2, 1))
        kw = dict(scale=scale, causal_mask=sh.causal, sliding_window=sh.window, tp_q=False, tp_k=False,
                  tp_out=True, cache_softmax=True)
        if sh.sinks:
            kw["sink"] = x["sinks"].reshape(sh.B * sh.H, 1)
        (lo, neg_max, recip), lib = prog.run(f"({name}) forward, NKI Library: attention_cte",
                                             lambda: lib_cte(q, k, v, **kw))
        lib_lse = -_f32(neg_max) - np.log(_f32(recip))
        out["fwd"] = {"ours": ours, "lib": lib, "mismatch": {
            "o": _mismatch(o, _f32(lo).reshape(sh.B, sh.H, sh.D, sh.S)),
            "lse": _mismatch(lse, lib_lse.reshape(sh.B, sh.H, Q_TILE, -1))}}
    if "bwd" in kernels:
        o, lse = golden_o_lse(sh, x)
        kw = dict(sinks_ref=x["sinks"], use_causal_mask=sh.causal, mixed_precision=True, sliding_window=sh.window)
        grads, ours = prog.run(f"({name}) backward, ours: attention_bwd",
                               lambda: attention_bwd(x["q"], x["k"], x["v"], o, x["dy"], lse, **kw))
        lib_grads, lib = prog.run(f"({name}) backward, NKI Library: attention_bwd",
                                  lambda: lib_bwd(x["q"], x["k"], x["v"], o, x["dy"], lse, **kw))
        out["bwd"] = {"ours": ours, "lib": lib, "mismatch": {
            n: _mismatch(a, b) for n, a, b in zip(("dq", "dk", "dv", "dsinks"), grads, lib_grads)}}
    return out


# ----------------------------------------------------------------------------------------------------- figures
def figures(sh, kernel, records, gen):
    """Modeled figures of one trace (times in us)."""
    flops = useful_attention_flops(sh.B, sh.H, sh.S, sh.S, sh.D, causal=sh.causal, window=sh.window,
                                   backward=kernel == "bwd")
    p = profile(records, gen, flops)
    pairs = visible_tile_pairs(sh)
    busy = {e: p.engine_busy(e) / 1e3 for e in ENGINES + RESOURCES}
    by_instr = {}
    for (e, instr), (n, ns) in p.by_instr.items():
        if e in ("VectorE", "ScalarE", "GpSimdE"):
            by_instr[f"{e} {instr}"] = {"count_per_pair": n / pairs, "us_per_pair": ns / 1e3 / pairs}
    return {
        "time_us": p.time_ns / 1e3, "overlap_us": p.time_overlap_ns / 1e3, "serial_us": p.time_serial_ns / 1e3,
        "bottleneck": p.bottleneck,
        "critical_path_us": {k: v / 1e3 for k, v in p.critical_path_by_kind().items()},
        "busy_us": busy, "per_pair_us": {e: b / pairs for e, b in busy.items()}, "tile_pairs": pairs,
        "floor_us": p.tensor_floor_ns / 1e3, "floor_ratio": p.floor_ratio("scheduled"),
        "useful_util": p.useful_tensor_utilisation(), "executed_util": p.tensor_utilisation(),
        "instructions": len(records), "dma_transfers": p.dma_transfers, "dependent": p.dependent,
        "by_instr": by_instr,
    }


def sensitivity_variants(gen):
    """``[(label, Generation)]``: each parameter the docs leave uncertain at its plausible extremes, one at a time
    (docs/performance.md, "Sensitivity")."""
    from dataclasses import replace
    return [
        ("dma_transpose efficiency 0.25", replace(gen, dma_transpose_sbuf_eff=0.25, dma_transpose_hbm_eff=0.45)),
        ("dma_transpose efficiency 0.5", replace(gen, dma_transpose_sbuf_eff=0.5, dma_transpose_hbm_eff=0.9)),
        ("GpSimd 1x VectorE", replace(gen, gpsimd_vector_factor=1.0)),
        ("GpSimd 4x VectorE", replace(gen, gpsimd_vector_factor=4.0)),
        ("fp32 VectorE 1 elem/lane/cycle", replace(gen, vector_width_other=128)),
        ("fp32 VectorE 2 elem/lane/cycle", replace(gen, vector_width_other=256)),
        ("DMA floor 0 ns", replace(gen, dma_min_piece_ns=0.0)),
        ("DMA floor 850 ns", replace(gen, dma_min_piece_ns=850.0)),
        ("access overhead 0", replace(gen, access_overhead_cycles=0)),
        ("access overhead 60", replace(gen, access_overhead_cycles=60)),
        ("hardware-DGE split off", replace(gen, dge_transpose_split=False)),
        ("hardware-DGE split on", replace(gen, dge_transpose_split=True)),
        ("semaphore wait 0", replace(gen, sem_wait_ns=0.0)),
        ("semaphore wait 1300 ns", replace(gen, sem_wait_ns=1300.0)),
    ]


def sensitivity(sh, kernel, rec_ours, rec_lib, gen):
    """Our time / the library's under every sensitivity variant, and under the combination of the individually
    worst settings for us; returns a dict with ``plain``, ``rows``, ``worst``, ``best``, ``combined``."""
    from dataclasses import replace

    def ratio(g):
        return profile(rec_ours, g).time_ns / profile(rec_lib, g).time_ns
    plain = ratio(gen)
    rows = [(label, ratio(g)) for label, g in sensitivity_variants(gen)]
    # the worst setting of each parameter (pairs of rows), combined
    changes = {}
    variants = sensitivity_variants(gen)
    for i in range(0, len(variants), 2):
        (la, ga), (lb, gb) = variants[i], variants[i + 1]
        pick = ga if dict(rows)[la] >= dict(rows)[lb] else gb
        changes.update({f: getattr(pick, f) for f in pick.__dataclass_fields__
                        if getattr(pick, f) != getattr(gen, f)})
    combined = ratio(replace(gen, **changes))
    worst = max(rows, key=lambda r: r[1])
    best = min(rows, key=lambda r: r[1])
    return {"plain": plain, "rows": rows, "worst": worst, "best": best, "combined": combined,
            "combined_changes": {k: v for k, v in changes.items()}}


def print_sensitivity(results):
    print(f"\nSensitivity (MODELED by {MODEL}): our time / the NKI Library's with each docs-uncertain parameter at "
          f"its extremes, one at a time, and all at the setting worst for us at once\n")
    print("| shape | kernel | plain | lowest (parameter) | highest (parameter) | all worst-for-us at once |")
    print("|---|---|---|---|---|---|")
    for name, per in results.items():
        for kernel in ("bwd", "fwd"):
            if kernel in per and "sens" in per[kernel]:
                s = per[kernel]["sens"]
                print(f"| ({name}) | {kernel} | {s['plain']:.2f} | {s['best'][1]:.2f} ({s['best'][0]}) | "
                      f"{s['worst'][1]:.2f} ({s['worst'][0]}) | **{s['combined']:.2f}** |")


def model_steps(sh, kernel, rec_ours, rec_lib, gen):
    """Our time / the library's under the earlier model and after each correction in turn (cumulative)."""
    names = list(CORRECTIONS)
    rows = []
    for k in range(len(names) + 1):
        g = revert(gen, names[k:])
        a = figures(sh, kernel, rec_ours, g)
        b = figures(sh, kernel, rec_lib, g)
        rows.append({"after": names[k - 1] if k else "earlier model", "ours_us": a["time_us"],
                     "lib_us": b["time_us"], "ratio": a["time_us"] / b["time_us"],
                     "ours_bottleneck": a["bottleneck"], "lib_bottleneck": b["bottleneck"]})
    return rows


# ----------------------------------------------------------------------------------------------------- output
def _us(v):
    return f"{v:.1f}"


def print_report(results, target, steps):
    print(f"\nAll device times are MODELED on {target} by {MODEL} (docs/performance.md), not measured.")
    print("ratio = our modeled time / the NKI Library's (scheduled time: the dependency-aware schedule)\n")
    print("| shape | kernel | ours us | NKI Library us | ratio | ours / floor | library / floor | floor us | "
          "bottleneck (ours / library) | max output mismatch |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, per in results.items():
        for kernel in ("bwd", "fwd"):
            if kernel not in per:
                continue
            r = per[kernel]
            a, b = r["ours_fig"], r["lib_fig"]
            mm = max(r["mismatch"].values())
            print(f"| ({name}) | {kernel} | {_us(a['time_us'])} | {_us(b['time_us'])} | "
                  f"**{a['time_us'] / b['time_us']:.2f}** | {a['floor_ratio']:.2f} | {b['floor_ratio']:.2f} | "
                  f"{_us(a['floor_us'])} | {a['bottleneck']} / {b['bottleneck']} | {mm:.1e} |")
    # shared resources no kernel used (e.g. the v2-only PSUM port on trn2) are left out
    used = {c for per in results.values() for r in per.values() for f in (r["ours_fig"], r["lib_fig"])
            for c in RESOURCES if f["busy_us"][c] > 0}
    cols = ENGINES + tuple(c for c in RESOURCES if c in used)
    short = {"VectorE/GpSimdE SBUF port": "V/G SBUF port", "VectorE/ScalarE PSUM port": "V/S PSUM port"}
    print("\nBusy time per engine and shared resource (us), and per (128-query x 512-key) tile pair (us/pair):\n")
    print("| shape | kernel | who | tile pairs | " + " | ".join(short.get(c, c) for c in cols) +
          " | useful util | executed util |")
    print("|---|---|---|---|" + "---|" * len(cols) + "---|---|")
    for name, per in results.items():
        for kernel in ("bwd", "fwd"):
            if kernel not in per:
                continue
            for who, key in (("ours", "ours_fig"), ("NKI Library", "lib_fig")):
                f = per[kernel][key]
                cells = " | ".join(f"{f['busy_us'][c]:.0f} ({f['per_pair_us'][c]:.2f})" for c in cols)
                print(f"| ({name}) | {kernel} | {who} | {f['tile_pairs']} | {cells} | {f['useful_util']:.1%} | "
                      f"{f['executed_util']:.1%} |")
    if steps:
        print("\nRatio under each version of the cost model (cumulative corrections, docs/performance.md):\n")
        print("| shape | kernel | model | ours us | NKI Library us | ratio | bottleneck (ours / library) |")
        print("|---|---|---|---|---|---|---|")
        for name, per in results.items():
            for kernel in ("bwd", "fwd"):
                for row in per.get(kernel, {}).get("steps", []):
                    print(f"| ({name}) | {kernel} | {row['after']} | {_us(row['ours_us'])} | {_us(row['lib_us'])} | "
                          f"{row['ratio']:.2f} | {row['ours_bottleneck']} / {row['lib_bottleneck']} |")


def print_breakdown(name, per, kernel):
    """Per tile pair: VectorE / ScalarE / GpSimdE time by instruction, ours beside the library's."""
    if kernel not in per:
        return
    a, b = per[kernel]["ours_fig"]["by_instr"], per[kernel]["lib_fig"]["by_instr"]
    keys = sorted(set(a) | set(b), key=lambda k: -max(a.get(k, {}).get("us_per_pair", 0),
                                                      b.get(k, {}).get("us_per_pair", 0)))
    print(f"\n({name}) {kernel}: element-wise engines per (128 x 512) tile pair, by instruction "
          f"(count / us per pair):\n")
    print("| engine instruction | ours | NKI Library |")
    print("|---|---|---|")
    for k in keys:
        cell = [f"{d[k]['count_per_pair']:.2f} / {d[k]['us_per_pair']:.3f}" if k in d else "-" for d in (a, b)]
        print(f"| {k} | {cell[0]} | {cell[1]} |")


# ----------------------------------------------------------------------------------------------------- main
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nkilib", required=True, help="root of a local aws-neuron/nki-library checkout")
    ap.add_argument("--target", default="trn2", choices=("trn1", "trn2", "trn3"))
    ap.add_argument("--shapes", default="a,b,c,d", help="comma-separated subset of a,b,c,d (default all)")
    ap.add_argument("--kernels", default="bwd,fwd", help="comma-separated subset of bwd,fwd (default both)")
    ap.add_argument("--max-bwd-ratio", type=float, help="fail if any backward ratio exceeds this")
    ap.add_argument("--max-fwd-ratio", type=float, help="fail if any forward ratio exceeds this")
    ap.add_argument("--max-bwd-floor-ratio", type=float,
                    help="fail if our backward at shape (a) exceeds this multiple of the useful-FLOP bound")
    ap.add_argument("--max-mismatch", type=float, default=0.05,
                    help="fail if ours and the library's outputs differ by more than this fraction of the "
                         "library's largest |value| (default 0.05: bf16 rounding stays near 1e-2)")
    ap.add_argument("--model-steps", action="store_true",
                    help="also print the ratios under each earlier version of the cost model")
    ap.add_argument("--breakdown", default="a", help="shapes whose per-instruction breakdown to print ('' none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="F", help="write all figures as JSON to F")
    ap.add_argument("--sensitivity", action="store_true",
                    help="re-cost the same traces with each docs-uncertain parameter at its extremes and print the "
                         "plain and worst-case ratios per shape")
    args = ap.parse_args(argv)
    args.shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    args.kernels = [k.strip() for k in args.kernels.split(",") if k.strip()]
    bad = [s for s in args.shapes if s not in SHAPES] + [k for k in args.kernels if k not in ("bwd", "fwd")]
    if bad or not args.shapes or not args.kernels:
        ap.error(f"--shapes takes a subset of {','.join(SHAPES)} and --kernels of bwd,fwd; got {bad or 'nothing'}")
    for name in ("max_bwd_ratio", "max_fwd_ratio", "max_bwd_floor_ratio", "max_mismatch"):
        v = getattr(args, name)
        if v is not None and not v > 0:
            ap.error(f"--{name.replace('_', '-')} must be > 0, got {v}")
    return args


def check_limits(results, args):
    """Messages for every figure past its limit."""
    fails = []
    for name, per in results.items():
        for kernel, limit in (("bwd", args.max_bwd_ratio), ("fwd", args.max_fwd_ratio)):
            if kernel in per and limit is not None:
                r = per[kernel]["ours_fig"]["time_us"] / per[kernel]["lib_fig"]["time_us"]
                if r > limit:
                    fails.append(f"({name}) {kernel}: ratio {r:.2f} > --max-{kernel}-ratio {limit}")
        if name == "a" and "bwd" in per and args.max_bwd_floor_ratio is not None:
            fr = per["bwd"]["ours_fig"]["floor_ratio"]
            if fr > args.max_bwd_floor_ratio:
                fails.append(f"(a) bwd: {fr:.2f}x the useful-FLOP bound > --max-bwd-floor-ratio "
                             f"{args.max_bwd_floor_ratio}")
        for kernel in per:
            for out, m in per[kernel]["mismatch"].items():
                if not m <= args.max_mismatch:
                    fails.append(f"({name}) {kernel}: output {out} differs from the library's by {m:.2e} of its "
                                 f"largest value (> --max-mismatch {args.max_mismatch}): not the same problem?")
    return fails


def main(argv=None):
    args = parse_args(argv)
    lib_bwd, lib_cte, commit = load_library(args.nkilib)
    gen = generation(args.target)
    os.environ["NEURON_PLATFORM_TARGET_OVERRIDE"] = args.target
    versions = kernel_versions()
    print(f"NKI Library at {commit}; our kernels (sha256[:12]): "
          + ", ".join(f"{k} {v}" for k, v in versions.items()))
    runs = len(args.shapes) * 2 * len(args.kernels)
    prog = Progress(runs)
    results = {}
    for name in args.shapes:
        sh = SHAPES[name]
        per = run_shape(name, sh, lib_bwd, lib_cte, args.kernels, prog, args.seed)
        for kernel, r in per.items():
            r["ours_fig"] = figures(sh, kernel, r["ours"], gen)
            r["lib_fig"] = figures(sh, kernel, r["lib"], gen)
            if args.model_steps:
                r["steps"] = model_steps(sh, kernel, r["ours"], r["lib"], gen)
            if args.sensitivity:
                r["sens"] = sensitivity(sh, kernel, r["ours"], r["lib"], gen)
        results[name] = per
    print_report(results, args.target, args.model_steps)
    if args.sensitivity:
        print_sensitivity(results)
    for name in [s.strip() for s in args.breakdown.split(",") if s.strip() in results]:
        for kernel in ("bwd", "fwd"):
            print_breakdown(name, results[name], kernel)
    fails = check_limits(results, args)
    if args.json:
        dump = {"target": args.target, "modeled": True, "model": MODEL, "nki_library_commit": commit, "kernel_sha256_12": versions,
                "shapes": {n: SHAPES[n].__dict__ for n in results},
                "results": {n: {k: {kk: vv for kk, vv in r.items() if kk not in ("ours", "lib")}
                                for k, r in per.items()} for n, per in results.items()},
                "limit_failures": fails}
        pathlib.Path(args.json).write_text(json.dumps(dump, indent=1))
        print(f"\nwrote {args.json}")
    if fails:
        print("\nPAST THE LIMITS:\n  " + "\n  ".join(fails))
        return 1
    print("\nall figures within the given limits" if any(
        getattr(args, n) is not None for n in ("max_bwd_ratio", "max_fwd_ratio", "max_bwd_floor_ratio"))
        else "\n(no ratio limits given)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
