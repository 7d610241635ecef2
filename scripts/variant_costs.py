"""What each attention variant of issue #14 costs: the modeled time of the forward and backward kernels with the
variant against the default path, at one shape, side by side in one run.

    python scripts/variant_costs.py [--target trn2] [--variants softcap alibi ...] [--json out.json]

Shape: batch 1, 4 query heads / 1 kv head, S 2048, d 128, bf16, mixed precision, causal; the two-sided window
(64, 64) is bidirectional and is compared with the non-causal default. Each kernel runs once on the simulator
under the instruction trace (the backward's o and lse come from the torch golden forward with the same variant,
outside the trace) and ``nki_attn.profiler`` models its time on the target. Every time printed is MODELED
(perfect-overlap bound of the cost model, docs/performance.md), never measured.

Variants that change the amount of work (causal with seqlen_q != seqlen_k, d_qk != d_v, head_dim 199, the
local window) are also given per useful FLOP (2 * (d_qk + d_v) per visible query-key pair forward, 2.5x that
backward): ``rel/flop`` is the variant's modeled time per useful FLOP over the default's, the cost of the
variant's machinery with the change in work taken out.
"""
import argparse
import json
import os
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
B, H, HKV, S, D = 1, 4, 1, 2048, 128
ENGINES = ("TensorE", "VectorE", "ScalarE", "GpSimdE", "DMA")

# name -> (baseline name, overrides of the default problem)
VARIANTS = {
    "default (causal)": (None, {}),
    "softcap 50": ("default (causal)", {"softcap": 50.0}),
    "alibi": ("default (causal)", {"alibi": True}),
    "window_size (255, 0)": ("default (causal)", {"window_size": (255, 0)}),
    "sliding_window 256": ("default (causal)", {"sliding_window": 256}),
    "causal sq 1024 < sk 2048": ("default (causal)", {"sq": 1024}),
    "d_qk 192 / d_v 128": ("default (causal)", {"d_qk": 192}),
    "head_dim 199": ("default (causal)", {"d_qk": 199, "d_v": 199}),
    "dropout 0.1": ("default (causal)", {"dropout_p": 0.1}),
    "default (non-causal)": (None, {"causal": False}),
    "window_size (64, 64)": ("default (non-causal)", {"causal": False, "window_size": (64, 64)}),
}


def problem(overrides):
    p = dict(sq=S, sk=S, d_qk=D, d_v=D, causal=True, softcap=0.0, alibi=False, window_size=None,
             sliding_window=None, dropout_p=0.0)
    p.update(overrides)
    return p


def visible_pairs(p):
    """Query-key pairs the mask leaves visible (the golden's own mask)."""
    from golden.attention_fwd_torch import visibility_mask
    return int(visibility_mask(p["sq"], p["sk"], p["causal"], p["sliding_window"], None, None,
                               p["window_size"]).sum())


def inputs(p, seed=0):
    """Random bf16 inputs in the kernels' layout (torch), and the variant keywords of both kernels."""
    import torch
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(torch.bfloat16)

    x = {"q": rand(B, H, p["d_qk"], p["sq"]), "k": rand(B, HKV, p["d_qk"], p["sk"]),
         "v": rand(B, HKV, p["d_v"], p["sk"]), "dy": rand(B, H, p["d_v"], p["sq"])}
    kw = {"use_causal_mask": p["causal"], "mixed_precision": True}
    if p["sliding_window"]:
        kw["sliding_window"] = p["sliding_window"]
    if p["softcap"]:
        kw["softcap"] = p["softcap"]
    if p["alibi"]:  # the geometric ALiBi slopes of H heads: 2^-2, 2^-4, ...
        kw["alibi_slopes"] = torch.tensor([[2.0 ** (-8.0 * (h + 1) / H) for h in range(H)]] * B)
    if p["window_size"]:
        kw["window_size"] = p["window_size"]
    if p["dropout_p"]:
        kw["dropout_p"] = p["dropout_p"]
        kw["dropout_seed"] = torch.tensor([1234, 0], dtype=torch.int32)  # (seed, offset), docs/semantics.md
    return x, kw


def measure(name, target):
    """Modeled figures of the forward and backward with one variant (this process)."""
    os.environ["NEURON_PLATFORM_TARGET_OVERRIDE"] = target
    sys.path.insert(0, str(ROOT))
    import golden
    from nki_attn.kernel_api import attention_bwd, attention_fwd
    from nki_attn.profiler import generation, profile
    from nki_attn.sim import trace

    p = problem(VARIANTS[name][1])
    x, kw = inputs(p)
    gen = generation(target)
    pairs = visible_pairs(p)
    fwd_flops = 2 * B * H * pairs * (p["d_qk"] + p["d_v"])
    out = {"pairs": pairs, "problem": {k: v for k, v in p.items()}}
    try:
        o, lse = golden.attention_fwd_torch_ref(x["q"], x["k"], x["v"], **kw)
    except (ValueError, NotImplementedError) as exc:  # e.g. dropout before golden.dropout exists
        o = lse = None
        golden_error = f"golden forward: {type(exc).__name__}: {exc}"
    for kernel, call, flops in (
            ("fwd", lambda: attention_fwd(x["q"], x["k"], x["v"], **kw), fwd_flops),
            ("bwd", lambda: attention_bwd(x["q"], x["k"], x["v"], o, x["dy"], lse.float(), **kw),
             fwd_flops * 5 // 2)):
        t0 = time.perf_counter()
        if kernel == "bwd" and o is None:
            out[kernel] = {"error": golden_error}
            continue
        try:
            with trace.recording() as rec:
                call()
        except (ValueError, NotImplementedError, TypeError) as exc:  # a variant this kernel does not support yet
            out[kernel] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        prof = profile(rec.records, gen, flops)
        out[kernel] = {"time_us": prof.time_overlap_ns / 1e3, "bottleneck": prof.bottleneck,
                       "busy_us": {e: prof.engine_busy(e) / 1e3 for e in ENGINES},
                       "useful_flops": flops, "sim_seconds": round(time.perf_counter() - t0, 1)}
    return out


SHORT = {"VectorE/GpSimdE SBUF port": "SBUF port", "VectorE/ScalarE PSUM port": "PSUM port"}


def table(results):
    """The comparison table; bottlenecks named by engine (SBUF port: the one VectorE shares with GpSimdE)."""
    lines = [f"{'variant':<26}{'vs':<22}" + "".join(
        f"{k + ' us':>10}{'rel':>7}{'rel/flop':>9}{'bottleneck':>12}" for k in ("fwd", "bwd"))]
    lines.append("-" * len(lines[0]))
    for name, r in results.items():
        base_name = VARIANTS[name][0]
        base = results.get(base_name)
        cells = ""
        for k in ("fwd", "bwd"):
            f = r.get(k, r)
            if "error" in f:
                cells += f"{'unsupported':>38}"
                continue
            bn = SHORT.get(f["bottleneck"], f["bottleneck"])
            if base and "error" not in base.get(k, base):
                rel = f["time_us"] / base[k]["time_us"]
                per_flop = (f["time_us"] / f["useful_flops"]) / (base[k]["time_us"] / base[k]["useful_flops"])
                cells += f"{f['time_us']:>10.1f}{rel:>7.3f}{per_flop:>9.3f}{bn:>12}"
            else:
                cells += f"{f['time_us']:>10.1f}{'':>7}{'':>9}{bn:>12}"
        lines.append(f"{name:<26}{(base_name or '-'):<22}{cells}")
    for name, r in results.items():
        for k in ("fwd", "bwd"):
            f = r.get(k, r)
            if "error" in f:
                lines.append(f"  {name} {k}: {f['error']}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="trn2", choices=("trn1", "trn2", "trn3"))
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                    help="variants to run (their baselines are added)")
    ap.add_argument("--json", metavar="F")
    args = ap.parse_args(argv)
    names = []
    for v in args.variants:
        base = VARIANTS[v][0]
        for n in ([base] if base else []) + [v]:
            if n not in names:
                names.append(n)
    names.sort(key=list(VARIANTS).index)
    results = {}
    t0 = time.perf_counter()
    for i, name in enumerate(names, 1):
        results[name] = measure(name, args.target)
        print(f"[{i}/{len(names)}] {name} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    print(f"Modeled cost of the attention variants: B={B} H={H} HKV={HKV} S={S} D={D} bf16, target {args.target}. "
          f"Device times are MODELED by nki_attn.profiler (perfect-overlap bound), not measured.")
    print("rel: time / the baseline's ('vs'); rel/flop: time per useful FLOP / the baseline's")
    print(table(results))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"target": args.target, "modeled": True,
                                                       "results": results}, indent=1))
    return 1 if any("error" in r.get(k, {}) for r in results.values() for k in ("fwd", "bwd")) else 0


if __name__ == "__main__":
    sys.exit(main())
