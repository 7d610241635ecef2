"""Modeled TensorE utilisation of attention_fwd / attention_bwd for model shapes, plus the causal / non-causal time
ratio and sliding-window scaling. Device times are MODELED by nki_attn.profiler (cost model over the simulator's
instruction trace), not measured on hardware.

Heads and sequence lengths are scaled down so the whole run fits a few minutes of simulation: utilisation is
per-tile behaviour, so 1-8 heads with the model's GQA group, head dim, mask and sinks show it. Every row says the
shape it actually ran.

    python scripts/bench_modeled_util.py [--target trn2] [--only NAME] [--json out.json] [--plot out.png]
"""
import argparse
import dataclasses
import json
import os
import time
from types import SimpleNamespace

from nki_attn.profiler import generation, profile
from nki_attn.profiler.cli import run_kernel, useful_flops

# name: (model config it stands for, batch, heads, kv_heads, seqlen, head_dim, causal, window, sinks). Sequence
# lengths, head dims, masks and GQA groups are those of the NKI Library backward test matrix (anchors §3); only the
# head counts are cut to one kv head (or two for MHA).
SHAPES = {
    "llama3-8b": ("32q/8kv d128 causal S=8192 (group 4 kept)", 1, 4, 1, 8192, 128, True, None, 0),
    "qwen3-1.7b": ("16q/8kv d128 causal S=4096 (group 2)", 1, 2, 1, 4096, 128, True, None, 0),
    "gemma2-9b": ("16q/8kv d256 causal window 4096 S=8192 (group 2)", 1, 2, 1, 8192, 256, True, 4096, 0),
    "gpt-oss-20b": ("64q/8kv d64 causal window 128, 1 sink, S=4096 (group 8)", 1, 8, 1, 4096, 64, True, 128, 1),
    "modernbert": ("16q/16kv d64 non-causal S=1024", 1, 2, 2, 1024, 64, False, None, 0),
    "mqa-d96": ("8q/1kv d96 causal S=8192 (MQA)", 1, 8, 1, 8192, 96, True, None, 0),
}
# Mask experiments on one Llama-like head (d128): causal vs full, and window 512 at two lengths.
MASKS = {
    "full-2048": (1, 1, 1, 2048, 128, False, None, 0),
    "causal-2048": (1, 1, 1, 2048, 128, True, None, 0),
    "win512-4096": (1, 1, 1, 4096, 128, True, 512, 0),
    "win512-8192": (1, 1, 1, 8192, 128, True, 512, 0),
}


def run_one(kernel, b, h, hkv, s, d, causal, window, sinks, target):
    """Profile one kernel call; returns a dict of modeled figures and the simulator wall time."""
    args = SimpleNamespace(kernel=kernel, batch=b, heads=h, kv_heads=hkv, seqlen=s, head_dim=d, dtype="bf16",
                           causal=causal, window=window, sinks=sinks, target=target, lnc=1, seed=0)
    gen = generation(target)
    prev = os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE")
    os.environ["NEURON_PLATFORM_TARGET_OVERRIDE"] = target
    try:
        t0 = time.perf_counter()
        records, _ = run_kernel(args)
        wall = time.perf_counter() - t0
    finally:
        if prev is None:
            os.environ.pop("NEURON_PLATFORM_TARGET_OVERRIDE", None)
        else:
            os.environ["NEURON_PLATFORM_TARGET_OVERRIDE"] = prev
    flops = useful_flops(args)
    p = profile(records, gen, flops)
    # Sensitivity: the same trace without the per-piece DMA floor (only bytes / bandwidth on the queues), the
    # optimistic end for kernels that issue many small DMAs (docs/performance.md, "Choices").
    p0 = profile(records, dataclasses.replace(gen, dma_min_piece_ns=0.0), flops)
    return {
        "kernel": kernel, "shape": dict(batch=b, heads=h, kv_heads=hkv, seqlen=s, head_dim=d, causal=causal,
                                        window=window, sinks=sinks),
        "time_overlap_us": p.time_overlap_ns / 1e3, "time_serial_us": p.time_serial_ns / 1e3,
        "bottleneck": p.bottleneck,
        "util_overlap": p.tensor_utilisation(True), "util_serial": p.tensor_utilisation(False),
        "useful_util_overlap": p.useful_tensor_utilisation(True), "floor_ratio": p.floor_ratio(True),
        "util_overlap_no_dma_floor": p0.useful_tensor_utilisation(True), "bottleneck_no_dma_floor": p0.bottleneck,
        "sbuf_port_us": p.engine_busy("VectorE/GpSimdE SBUF port") / 1e3,
        "tensor_efficiency": p.tensor_efficiency(), "tflops_overlap": p.tflops(True),
        "busy_us": {e: p.engine_busy(e) / 1e3 for e in ("TensorE", "VectorE", "ScalarE", "GpSimdE", "DMA")},
        "hbm_mib": p.hbm_bytes / 2**20, "instructions": len(records), "sim_wall_s": wall,
    }


def kernel_versions():
    """Short sha256 of the kernel sources the figures came from (the kernels change; the figures go stale)."""
    import hashlib
    import pathlib

    import nki_attn.kernels as kpkg
    root = pathlib.Path(kpkg.__file__).parent
    return {f: hashlib.sha256((root / f).read_bytes()).hexdigest()[:12]
            for f in ("attention_fwd.py", "attention_bwd.py")}


def shape_str(r):
    s = r["shape"]
    bits = f"{s['heads']}/{s['kv_heads']} S={s['seqlen']} d={s['head_dim']}"
    if not s["causal"]:
        bits += " full"
    if s["window"]:
        bits += f" W={s['window']}"
    if s["sinks"]:
        bits += f" sinks={s['sinks']}"
    return bits


def table(rows):
    head = ("| case | kernel | ran (H/HKV, S, d) | modeled us (overlap / serial) | bottleneck | useful util | "
            "x useful-FLOP bound | executed util overlap / serial | useful util, no DMA floor | TensorE eff. | "
            "TFLOPS (overlap) | TensorE / VectorE / ScalarE / GpSimdE / DMA busy us | V/G SBUF port us | sim s |")
    out = [head, "|" + "---|" * 14]
    for name, r in rows:
        b = r["busy_us"]
        busy = " / ".join(f"{b[e]:.0f}" for e in ("TensorE", "VectorE", "ScalarE", "GpSimdE", "DMA"))
        out.append(f"| {name} | {r['kernel']} | {shape_str(r)} | {r['time_overlap_us']:.0f} / "
                   f"{r['time_serial_us']:.0f} | {r['bottleneck']} | {r['useful_util_overlap']:.1%} | "
                   f"{r['floor_ratio']:.2f} | {r['util_overlap']:.1%} / {r['util_serial']:.1%} | "
                   f"{r['util_overlap_no_dma_floor']:.1%} ({r['bottleneck_no_dma_floor']}) | "
                   f"{r['tensor_efficiency']:.0%} | {r['tflops_overlap']:.1f} | {busy} | {r['sbuf_port_us']:.0f} | "
                   f"{r['sim_wall_s']:.1f} |")
    return "\n".join(out)


def plot(rows, path, target):
    """Grouped bars: modeled TensorE utilisation of useful FLOPs (perfect overlap; the no-overlap value as a dark
    inner bar)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed, {path} not written (pip install 'nki-attn[plot]')")
        return
    names = list(dict.fromkeys(n for n, _ in rows))
    by = {(n, r["kernel"]): r for n, r in rows}
    fig, ax = plt.subplots(figsize=(8, 3.6))
    width = 0.38
    for i, kernel in enumerate(("fwd", "bwd")):
        xs = [j + (i - 0.5) * width for j in range(len(names))]
        over = [100 * by[(n, kernel)]["useful_util_overlap"] for n in names]
        ser = [100 * by[(n, kernel)]["useful_util_overlap"] * by[(n, kernel)]["time_overlap_us"]
               / by[(n, kernel)]["time_serial_us"] for n in names]
        ax.bar(xs, over, width, color=("#4c72b0", "#dd8452")[i], label=f"{kernel} (perfect overlap)")
        ax.bar(xs, ser, width * 0.5, color="black", alpha=0.35, label="no overlap" if i else None)
        for x, v in zip(xs, over):
            ax.text(x, v, f"{v:.0f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, fontsize=8)
    ax.set_ylabel("TensorE utilisation, useful FLOPs (%)")
    ax.set_title(f"Modeled TensorE utilisation on {target} (modeled, not measured; scaled-down head counts)",
                 fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="trn2", choices=("trn1", "trn2", "trn3"))
    ap.add_argument("--only", action="append", help="run only these case names (repeatable)")
    ap.add_argument("--json", metavar="F", help="write all rows as JSON")
    ap.add_argument("--plot", metavar="F", help="bar chart of TensorE utilisation per model shape (matplotlib)")
    args = ap.parse_args()

    rows = []
    for name, (model, *shape) in SHAPES.items():
        if args.only and name not in args.only:
            continue
        for kernel in ("fwd", "bwd"):
            r = run_one(kernel, *shape, args.target)
            r["model"] = model
            rows.append((name, r))
            print(f"{name} {kernel}: useful util {r['useful_util_overlap']:.1%} ({r['sim_wall_s']:.1f} s sim)",
                  flush=True)
    mask_rows = {}
    for name, shape in MASKS.items():
        if args.only and name not in args.only:
            continue
        for kernel in ("fwd", "bwd"):
            r = run_one(kernel, *shape, args.target)
            mask_rows[(name, kernel)] = r
            rows.append((name, r))
            print(f"{name} {kernel}: {r['time_overlap_us']:.0f} us ({r['sim_wall_s']:.1f} s sim)", flush=True)

    versions = kernel_versions()
    print(f"\nTarget {args.target}; device times MODELED, not measured. Kernel sources (sha256[:12]): "
          + ", ".join(f"{k} {v}" for k, v in versions.items()) + "\n")
    print(table(rows))
    ratios = []
    for kernel in ("fwd", "bwd"):
        def t(name, key="time_overlap_us"):
            return mask_rows[(name, kernel)][key] if (name, kernel) in mask_rows else None
        if t("causal-2048") and t("full-2048"):
            ratios.append(f"{kernel}: causal / non-causal modeled time at S=2048 = "
                          f"{t('causal-2048') / t('full-2048'):.3f} (overlap), "
                          f"{t('causal-2048', 'time_serial_us') / t('full-2048', 'time_serial_us'):.3f} (serial); "
                          f"ideal 0.500 (visible pairs {(2048 * 2049 // 2) / 2048 ** 2:.3f})")
        if t("win512-4096") and t("win512-8192"):
            ratios.append(f"{kernel}: window 512, S=8192 / S=4096 modeled time = "
                          f"{t('win512-8192') / t('win512-4096'):.3f} (overlap), "
                          f"{t('win512-8192', 'time_serial_us') / t('win512-4096', 'time_serial_us'):.3f} "
                          f"(serial); ideal ~2 (linear in S)")
    if ratios:
        print("\n" + "\n".join(ratios))
    if args.plot:
        plot([(n, r) for n, r in rows if n in SHAPES], args.plot, args.target)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"target": args.target, "modeled": True, "kernel_sha256_12": versions, "rows": [dict(r, case=n) for n, r in rows],
                       "ratios": ratios}, f, indent=1)


if __name__ == "__main__":
    main()
