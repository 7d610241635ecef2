"""``nki-attn profile``: run one kernel once on the simulator under the instruction trace, print the modeled
per-engine time on a Trainium generation, optionally write JSON and a PNG bar chart.

Device times printed here are MODELED from the public architecture numbers (nki_attn/profiler/params.py), not
measured on hardware.

Usage errors (a bad number, an unwritable --json / --plot path, --lnc 2 on trn1) are reported by argparse before
the kernel runs, with exit status 2 and no traceback.
"""
import argparse
import json
import os
import sys
import time

from ..harness.cli import HelpFormatter, non_negative_int, positive_int, writable_file_problem
from ..harness.mods import HARNESS_MODS
from ..sim.trace import ENGINES
from ..spec import GRAD_MODS, SCORE_MODS
from .model import RESOURCES
from .params import MODEL

KERNELS = ("fwd", "bwd", "demo")
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
_SHORT = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16", "fp32": "fp32", "float32": "fp32"}


def dtype_arg(text):
    """argparse type: either spelling of a dtype (bf16 / bfloat16, fp16 / float16, fp32 / float32) -> the short
    name the profile prints."""
    try:
        return _SHORT[str(text).lower()]
    except KeyError:
        raise argparse.ArgumentTypeError(f"dtype {text!r} is not supported; choose from {sorted(_SHORT)}") from None


def add_parser(sub):
    """Register the ``profile`` subcommand on an ``argparse`` subparsers object."""
    p = sub.add_parser(
        "profile", help="modeled per-engine profile of one kernel run (simulator trace + cost model)",
        description="Run a kernel once on the simulator with the instruction trace on and print its modeled "
                    "time per engine on a Trainium generation. Times are modeled, not measured. Exit status 2 "
                    "for usage errors.",
        formatter_class=HelpFormatter)
    p.add_argument("--kernel", choices=KERNELS, default="fwd",
                   help="attention_fwd, attention_bwd, or demo (matmul_exp: lhsT [D,128], rhs [D,S])")
    p.add_argument("--batch", type=positive_int, default=1, help="batch size")
    p.add_argument("--heads", type=positive_int, default=1, help="query heads")
    p.add_argument("--kv-heads", type=positive_int, default=None, help="kv heads (default: as many as --heads)")
    p.add_argument("--seqlen", type=positive_int, default=512, help="seqlen_q = seqlen_k (a multiple of 128)")
    p.add_argument("--head-dim", type=positive_int, default=128, help="head dimension")
    p.add_argument("--dtype", type=dtype_arg, default="bf16", metavar="DTYPE",
                   help="input dtype: bf16|bfloat16, fp16|float16, fp32|float32")
    p.add_argument("--causal", action="store_true", help="causal mask")
    p.add_argument("--window", type=positive_int, default=None, help="sliding window W (implies --causal; default: no window)")
    p.add_argument("--sinks", type=non_negative_int, default=0, help="sink logits per head (0: none)")
    p.add_argument("--target", choices=("trn1", "trn2", "trn3"), default="trn2", help="Trainium generation")
    p.add_argument("--lnc", type=int, choices=(1, 2), default=1, help="logical NeuronCore degree (2: trn2/trn3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    p.add_argument("--json", metavar="F", help="write the profile as JSON to F")
    p.add_argument("--plot", metavar="F.png", help="write a bar chart of engine busy time to F.png (matplotlib)")
    p.add_argument("--trace", metavar="F.json",
                   help="write the modeled schedule as a Chrome trace (one track per engine and DMA queue; opens "
                        "in Perfetto or chrome://tracing)")
    p.add_argument("--timeline", metavar="F.png",
                   help="write a picture of the modeled schedule to F.png (matplotlib)")
    add_variant_arguments(p)
    p.set_defaults(func=run, _parser=p)
    return p


def validate(args, parser):
    """Usage checks before any work; parser.error (exit 2, no traceback) on failure."""
    for flag in ("json", "plot", "trace", "timeline"):
        path = getattr(args, flag)
        problem = writable_file_problem(path) if path else None
        if problem:
            parser.error(f"--{flag}: {problem}")
    if args.lnc == 2 and args.target == "trn1":
        parser.error("--lnc 2 needs trn2 or trn3 (trn1 has no LNC2)")
    if args.lnc == 2 and args.kernel == "demo":
        parser.error("--lnc 2: the demo kernel does not split its work between LNC2 cores")
    if args.kv_heads is not None and args.heads % args.kv_heads:
        parser.error(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")
    validate_variant(args, parser)


# ----------------------------------------------------------------------------------------------------- inputs
def _inputs(args):
    """Random kernel-layout inputs: numpy arrays for the kernel, torch copies for the golden (same values)."""
    import ml_dtypes
    import numpy as np

    rng = np.random.default_rng(args.seed)
    b, h, hkv, s, d = args.batch, args.heads, args.kv_heads, args.seqlen, args.head_dim
    npdt = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}[DTYPES[args.dtype]]

    def rand(*shape):
        return rng.standard_normal(shape).astype(np.float32).astype(npdt)

    x = {"q": rand(b, h, d, s), "k": rand(b, hkv, d, s), "v": rand(b, hkv, d, s)}
    if args.sinks:
        shape = (b, h) if args.sinks == 1 else (b, h, args.sinks)
        x["sinks"] = rng.standard_normal(shape).astype(np.float32)
    if args.kernel == "bwd":
        x["dy"] = rand(b, h, d, s)
    return x


def _torch(a):
    from ..sim.runtime import _numpy_to_torch
    return _numpy_to_torch(a) if a is not None else None


def _golden_o_lse(args, x):
    """o (kernel dtype) and lse (float32) from the torch golden forward, as numpy, for the backward's inputs."""
    from golden.attention_fwd_torch import attention_fwd_torch_ref

    from ..sim.runtime import _torch_to_numpy
    o, lse = attention_fwd_torch_ref(_torch(x["q"]), _torch(x["k"]), _torch(x["v"]), sinks_ref=_torch(x.get("sinks")),
                                     use_causal_mask=args.causal, sliding_window=args.window)
    return _torch_to_numpy(o), _torch_to_numpy(lse.float())


def _load(kind):
    try:
        if kind == "fwd":
            from ..kernel_api import attention_fwd as k  # bad arguments: ValueError before launching
        elif kind == "bwd":
            from ..kernel_api import attention_bwd as k
        else:
            from ..kernels.demo import matmul_exp as k
    except ImportError as exc:
        raise SystemExit(f"nki-attn profile: the {kind} kernel is not importable ({exc}); "
                         f"try --kernel demo") from exc
    return k


def _launch(kernel, lnc):
    return kernel if lnc == 1 else kernel[lnc]


def run_kernel(args):
    """Build inputs and run the kernel once through ``nki.benchmark`` (``nki_attn.sim.benchmark.run_benchmark``:
    the simulator's, with the instruction trace on, or a real NKI's on a Trainium host); returns (records,
    sim_wall_seconds). ``records`` is None when a real device measured the latency; ``LAST_RESULT[0]`` holds the
    benchmark result either way.

    The backward's ``o`` and ``lse`` come from the torch golden forward, outside the benchmark, so the trace
    holds the backward kernel only.
    """
    import numpy as np

    from ..sim.benchmark import run_benchmark

    if is_variant(args):
        return run_variant_kernel(args)
    kernel = _launch(_load(args.kernel), args.lnc)
    if args.kernel == "demo":
        rng = np.random.default_rng(args.seed)
        lhsT = (rng.standard_normal((args.head_dim, 128)) * 0.1).astype(np.float32)
        rhs = (rng.standard_normal((args.head_dim, args.seqlen)) * 0.1).astype(np.float32)
        call, kw = (lhsT, rhs, 0.5), {}
    else:
        x = _inputs(args)
        kw = dict(sinks_ref=x.get("sinks"), use_causal_mask=args.causal, sliding_window=args.window)
        if args.kernel == "fwd":
            call = (x["q"], x["k"], x["v"])
        else:
            o, lse = _golden_o_lse(args, x)
            call = (x["q"], x["k"], x["v"], o, x["dy"], lse)
    t0 = time.perf_counter()
    _, result = run_benchmark(kernel, call, kw, warmup=0, iters=1)
    wall = time.perf_counter() - t0
    LAST_RESULT[0] = result
    return result.records, wall


LAST_RESULT = [None]


def useful_flops(args):
    """FLOPs the run is credited with: attention FLOPs (visible pairs; bwd 2.5x) or the demo's matmul FLOPs."""
    from .flops import useful_attention_flops
    if is_variant(args):
        return variant_flops(args)
    if args.kernel == "demo":
        return 2 * 128 * args.seqlen * args.head_dim
    return useful_attention_flops(args.batch, args.heads, args.seqlen, args.seqlen, args.head_dim,
                                  causal=args.causal, window=args.window, backward=args.kernel == "bwd")


# ----------------------------------------------------------------------------------------------------- output
def describe(args):
    """One-line description of the profiled call."""
    if args.kernel == "demo":
        return f"demo matmul_exp lhsT[{args.head_dim},128] rhs[{args.head_dim},{args.seqlen}] fp32"
    bits = [f"attention_{args.kernel}", f"B={args.batch}", f"H={args.heads}", f"HKV={args.kv_heads}",
            f"S={args.seqlen}", f"D={args.head_dim}", args.dtype]
    if args.causal:
        bits.append("causal")
    if args.window:
        bits.append(f"window={args.window}")
    if args.sinks:
        bits.append(f"sinks={args.sinks}")
    bits += [f"{k}={v}" if v is not True else k for k, v in (getattr(args, "features", None) or {}).items()]
    if getattr(args, "mixed_precision", None) is not None:
        bits.append(f"mixed_precision={args.mixed_precision}")
    bits += [f"{k}={v!r}" for k, v in (getattr(args, "knobs", None) or {}).items()]
    if (getattr(args, "features", None) or {}).get("mask"):
        # the skipped work: how many 128 x 128 blocks the kernels skip, compute whole, or mask
        n = _block_mask(_variant_case(args)).counts()
        bits.append(f"(blocks: {n['full']} full, {n['partial']} partial, {n['skip']} skipped of "
                    f"{sum(n.values())})")
    return " ".join(bits)


def format_report(prof, title, wall=None):
    """Human-readable table of a ``Profile``."""
    g = prof.gen
    idle = sorted(set(range(prof.n_cores)) - set(prof.cores))
    lines = [f"{title}  target={g.name} cores={prof.n_cores}" + (f" (idle: {idle})" if idle else ""),
             f"Device times are MODELED ({MODEL}), not measured (docs/performance.md).",
             "",
             f"{'engine':<9}{'instrs':>9}{'busy (us)':>12}{'share':>8}{'active':>8}",
             "-" * 46]
    for e, n, b, share, active in prof.engine_rows():
        lines.append(f"{e:<9}{n:>9}{b / 1e3:>12.2f}{share:>8.1%}{active:>8.1%}")
    for r, b, active in prof.resource_rows():
        lines.append(f"  shared: {r} {b / 1e3:.2f} us, active {active:.1%}")
    t = prof.time_ns
    lines += ["-" * 46,
              "share = engine busy / sum of all engines; active = engine busy / busiest engine "
              "(busy on the slowest core)",
              "",
              f"modeled time, scheduled (dependencies, semaphores, DMA latency): {t / 1e3:10.2f} us   <- headline",
              "busy share of the scheduled time: " + ", ".join(
                  f"{e} {prof.scheduled_share(e):.0%}" for e in ENGINES + RESOURCES if prof.engine_busy(e) > 0),
              "critical path by kind: " + ", ".join(
                  f"{k} {v / 1e3:.2f} us" for k, v in sorted(prof.critical_path_by_kind().items(),
                                                           key=lambda kv: -kv[1])[:6]),
              f"modeled time, perfect overlap (busiest engine: {prof.bottleneck}): "
              f"{prof.time_overlap_ns / 1e3:10.2f} us",
              f"modeled time, no overlap (sum of engines):          {prof.time_serial_ns / 1e3:10.2f} us",
              f"useful FLOPs {prof.useful_flops:.4g}; TensorE matmul FLOPs {prof.matmul_flops:.4g}; "
              f"TensorE transposes {prof.transposes}",
              f"useful TFLOPS: {prof.tflops('scheduled'):.1f} (scheduled) / {prof.tflops(True):.1f} (overlap) / "
              f"{prof.tflops(False):.1f} (no overlap); "
              f"peak {g.peak_tflops:.1f} per core",
              f"TensorE utilisation, useful FLOPs: {prof.useful_tensor_utilisation('scheduled'):.1%} (scheduled) / "
              f"{prof.useful_tensor_utilisation(True):.1%} (overlap) / "
              f"{prof.useful_tensor_utilisation(False):.1%} (no overlap); useful-FLOP bound "
              f"{prof.tensor_floor_ns / 1e3:.2f} us (scheduled {prof.floor_ratio('scheduled'):.2f}x, perfect overlap "
              f"{prof.floor_ratio(True):.2f}x)",
              f"TensorE utilisation, executed FLOPs: {prof.tensor_utilisation('scheduled'):.1%} (scheduled) / "
              f"{prof.tensor_utilisation(True):.1%} (overlap) / "
              f"{prof.tensor_utilisation(False):.1%} (no overlap); efficiency while busy "
              f"{prof.tensor_efficiency():.1%}",
              f"HBM traffic: {prof.hbm_bytes / 2**20:.2f} MiB; "
              f"{prof.hbm_utilisation('scheduled'):.1%} of HBM bandwidth (scheduled), "
              f"{prof.hbm_utilisation(True):.1%} (overlap)"]
    if prof.unmodelled:
        lines.append(f"WARNING: {prof.unmodelled} instructions on engines the model does not know (cost 0)")
    if wall is not None:
        lines.append(f"simulator wall time (this CPU): {wall:.2f} s")
    return "\n".join(lines)


def _pyplot(path):
    """matplotlib's pyplot on the file-only Agg backend, or None (with a message on stderr naming ``path``, the
    picture not written) when matplotlib is missing: pictures are an optional extra."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"nki-attn profile: matplotlib is not installed, so {path} was not written; "
              f"install it with: pip install 'nki-attn[plot]'", file=sys.stderr)
        return None
    return plt


def write_plot(prof, path, title):
    """Bar chart of busy time per engine with the scheduled time and the perfect-overlap bound; returns False (with a message on stderr)
    when matplotlib is missing."""
    plt = _pyplot(path)
    if plt is None:
        return False
    rows = prof.engine_rows()
    names = [r[0] for r in rows]
    busy = [r[2] / 1e3 for r in rows]
    fig, ax = plt.subplots(figsize=(7, 3.7))
    bars = ax.barh(names[::-1], busy[::-1], color="#4c72b0")
    for bar, (_, n, b, share, _) in zip(bars, rows[::-1]):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {b / 1e3:.1f} us ({n} instr)",
                va="center", fontsize=8, bbox=dict(facecolor="white", edgecolor="none", pad=0.5, alpha=0.85))
    # the scheduled time is the headline; the perfect-overlap bound (the busiest unit) is drawn beside it
    ax.axvline(prof.time_ns / 1e3, color="black", ls="-", lw=1.2,
               label=f"scheduled {prof.time_ns / 1e3:.1f} us (cost model v2)")
    ax.axvline(prof.time_overlap_ns / 1e3, color="#c44e52", ls="--", lw=1,
               label=f"perfect overlap {prof.time_overlap_ns / 1e3:.1f} us")
    ax.set_xlabel("modeled busy time (us) - modeled, not measured")
    ax.set_title(f"{title}\n{prof.gen.name}: scheduled {prof.time_ns / 1e3:.1f} us, no overlap "
                 f"{prof.time_serial_ns / 1e3:.1f} us, TensorE util {prof.tensor_utilisation('scheduled'):.0%} "
                 f"(scheduled)", fontsize=9)
    ax.set_xlim(0, max(busy + [prof.time_ns / 1e3]) * 1.35)
    # Below the axes: inside them the legend hid the longest bar's label.
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), frameon=False, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_timeline(prof, path, title, max_events=None):
    """Gantt picture of the modeled schedule (one row per engine, DMA queue and DGE block of the slowest core);
    returns False (with a message on stderr) when matplotlib is missing."""
    plt = _pyplot(path)
    if plt is None:
        return False
    from .schedule import chrome_trace
    sched = prof.schedule
    core = max(sched.end_by_core, key=sched.end_by_core.get)
    trace = chrome_trace(sched)
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    rows = [k for k in sorted(names, key=lambda k: k[1]) if k[0] == core]
    colours = {"TensorE": "#4c72b0", "VectorE": "#dd8452", "ScalarE": "#55a868", "GpSimdE": "#c44e52",
               "DMA": "#8172b3"}
    fig, ax = plt.subplots(figsize=(10, 0.28 * len(rows) + 1.3))
    for y, key in enumerate(rows):
        bars = [(e["ts"], e["dur"]) for e in trace["traceEvents"]
                if e["ph"] == "X" and (e["pid"], e["tid"]) == key]
        cats = [e["cat"] for e in trace["traceEvents"] if e["ph"] == "X" and (e["pid"], e["tid"]) == key]
        name = names[key]
        colour = colours.get(cats[0] if cats else name, "#937860")
        if not name.split()[0] in colours and not name.startswith("DMA"):
            colour = "#937860"
        ax.broken_barh(bars, (len(rows) - 1 - y - 0.4, 0.8), facecolors=colour, linewidth=0)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([names[k] for k in rows][::-1], fontsize=7)
    ax.set_xlim(0, sched.time_ns / 1e3)
    ax.set_xlabel("modeled time (us) - MODELED, not measured")
    ax.set_title(f"{title}, {prof.gen.name}: scheduled {sched.time_ns / 1e3:.1f} us "
                 f"(perfect overlap {prof.time_overlap_ns / 1e3:.1f}, no overlap {prof.time_serial_ns / 1e3:.1f})",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def run(args):
    """Entry point of ``nki-attn profile``; returns the exit status."""
    parser = getattr(args, "_parser", None) or argparse.ArgumentParser(prog="nki-attn profile")
    validate(args, parser)
    from .model import profile
    from .params import generation

    if args.kv_heads is None:
        args.kv_heads = args.heads
    if args.window and not args.causal:
        print("nki-attn profile: --window implies --causal (sliding windows are causal, docs/semantics.md)",
              file=sys.stderr)
        args.causal = True
    print(f"nki-attn profile: running {describe(args)} on the simulator ...", file=sys.stderr, flush=True)
    from ..sim.errors import NkiValidationError
    prev = os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE")
    os.environ["NEURON_PLATFORM_TARGET_OVERRIDE"] = args.target
    try:
        records, wall = run_kernel(args)
    except (ValueError, NkiValidationError) as exc:
        # the kernels' argument checks (e.g. seqlen not a multiple of 128): report, no traceback
        print(f"nki-attn profile: {describe(args)}: {exc}", file=sys.stderr)
        return 2
    finally:
        if prev is None:
            os.environ.pop("NEURON_PLATFORM_TARGET_OVERRIDE", None)
        else:
            os.environ["NEURON_PLATFORM_TARGET_OVERRIDE"] = prev
    if records is None:  # a real NeuronDevice measured it (Trainium host): no trace to model
        lat = LAST_RESULT[0].nc_latency
        print(f"{describe(args)}: MEASURED on a NeuronDevice: p50 {lat.get_latency_percentile(50):.2f} us, "
              f"p99 {lat.get_latency_percentile(99):.2f} us")
        return 0
    prof = profile(records, generation(args.target), useful_flops(args), n_cores=args.lnc)
    title = describe(args) + (f" lnc={args.lnc}" if args.lnc != 1 else "")
    print(format_report(prof, title, wall))
    versus = compare_with_default(args, prof) if getattr(args, "vs", None) else None
    if args.json:
        out = prof.to_dict()
        out.update(description=title, sim_wall_seconds=wall,
                   args={k: v for k, v in vars(args).items() if k not in ("func", "_parser")})
        if versus:
            out["vs_default"] = versus
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.json}")
    if args.plot and write_plot(prof, args.plot, title):
        print(f"wrote {args.plot}")
    if args.trace:
        from .schedule import chrome_trace
        with open(args.trace, "w") as f:
            json.dump(chrome_trace(prof.schedule, f"{title} {prof.gen.name}"), f)
        print(f"wrote {args.trace} (Chrome trace of the modeled schedule: open it in Perfetto)")
    if args.timeline and write_timeline(prof, args.timeline, title):
        print(f"wrote {args.timeline}")
    return 0


# ----------------------------------------------------------------------------------------------------- variants
def _pair(text):
    left, _, right = str(text).partition(",")
    return int(left), int(right)


# The variant set of --features: name -> (value when none is given (None: a value is required), parser, meaning).
def _mask_name(text):
    from ..masks import INTERVAL_EXAMPLES
    if text not in INTERVAL_EXAMPLES:
        raise ValueError(text)
    return text


# A score modification's feature (a row of nki_attn.harness.mods.HARNESS_MODS, its ``profile`` entry) has the
# row's name and gives the harness Case field of that name its value; the other features follow.
FEATURES = {
    **{m.name: m.profile for m in HARNESS_MODS},
    "window_size": (None, _pair, "two-sided local window L,R (-1: that side unbounded)"),
    "dropout": (0.1, float, "dropout on the probabilities at rate P = 0.1 unless given (seed from the inputs)"),
    "d_qk": (None, int, "head dim of q and k instead of --head-dim"),
    "d_v": (None, int, "head dim of v, o and dO instead of --head-dim"),
    "seqlen_q": (None, int, "query length instead of --seqlen"),
    "seqlen_k": (None, int, "key length instead of --seqlen"),
    "mask": (None, _mask_name, "a prebuilt block mask (causal, sliding_window, document, prefix_lm, chunked_local; "
                        "nki_attn.masks.interval_example at --seqlen): the kernels skip its SKIP tiles"),
}
# kernel parameters that are inputs or that the options above set: everything else with a default is a knob
_NOT_KNOBS = {"sinks_ref", "bound_min", "bound_max", "dropout_seed", "use_causal_mask", "sliding_window",
              "window_size", "dropout_p", "mixed_precision", "softmax_scale"} | {m.kernel for m in SCORE_MODS}


def add_variant_arguments(p):
    """The options that make ``nki-attn profile`` cost a variant or an ablation against the default path."""
    g = p.add_argument_group("variants and ablations (fwd / bwd kernels)")
    g.add_argument("--features", nargs="+", metavar="F", default=None,
                   help="variant set, each NAME or NAME=VALUE: " + "; ".join(
                       f"{n}{'' if d is True else ('=' + str(d) if d is not None else '=V')}: {h}"
                       for n, (d, _, h) in FEATURES.items()))
    g.add_argument("--set", dest="set_knobs", action="append", metavar="KNOB=VALUE", default=None,
                   help="pass KNOB=VALUE to the kernel as a keyword argument (a design switch of the kernel, "
                        "e.g. k_section_len=512; repeatable; the valid names are listed when one is wrong)")
    g.add_argument("--mixed-precision", choices=("true", "false"), default=None,
                   help="the kernels' mixed_precision argument (default: the kernel's own default)")
    g.add_argument("--vs", choices=("default",), default=None,
                   help="also run the default path (no --features, no --set) and print both modeled times and "
                        "their ratio")


def _parse_value(text):
    import ast
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def kernel_knobs(kind):
    """``{name: default}`` of the keyword arguments ``--set`` may pass to the ``kind`` ("fwd"/"bwd") kernel,
    read from its signature."""
    import inspect
    k = _load(kind)
    for attr in ("kernel", "fn", "__wrapped__"):  # through the host wrapper and the jit object to the function
        k = getattr(k, attr, k)
    return {n: p.default for n, p in inspect.signature(k).parameters.items()
            if p.default is not inspect.Parameter.empty and n not in _NOT_KNOBS}


def validate_variant(args, parser):
    """Parse --features / --set / --mixed-precision into ``args.features``, ``args.knobs``,
    ``args.mixed_precision``; parser.error naming the offending value."""
    raw = getattr(args, "features", None)
    if isinstance(raw, dict):  # already parsed (a script building its own arguments)
        feats = raw
    else:
        feats = {}
        for item in raw or ():
            name, has, value = item.partition("=")
            if name not in FEATURES:
                parser.error(f"--features {item}: unknown feature {name!r}; choose from {sorted(FEATURES)}")
            default, conv, _ = FEATURES[name]
            if not has and default is None:
                parser.error(f"--features {item}: {name} needs a value ({name}=V)")
            try:
                feats[name] = conv(value) if has and conv else default
            except ValueError:
                parser.error(f"--features {item}: bad value {value!r} for {name}")
    args.features = feats
    mp = getattr(args, "mixed_precision", None)
    args.mixed_precision = {"true": True, "false": False}.get(mp, mp)
    knobs = {}
    items = getattr(args, "set_knobs", None) or ()
    if items:
        if args.kernel == "demo":
            parser.error("--set: the demo kernel has no knobs")
        valid = kernel_knobs(args.kernel)
        for item in items:
            name, has, value = item.partition("=")
            if not has or name not in valid:
                parser.error(f"--set {item}: attention_{args.kernel} has no keyword argument {name!r} to set; "
                             f"valid: {', '.join(f'{n} (default {d!r})' for n, d in valid.items()) or 'none'}")
            knobs[name] = _parse_value(value)
    args.knobs = getattr(args, "knobs", None) or knobs
    if is_variant(args) or getattr(args, "vs", None):
        if args.kernel == "demo":
            parser.error("--features / --mixed-precision / --vs apply to the fwd and bwd kernels, not the demo")
        if feats.get("window_size") and args.window:
            parser.error("give --window (causal sliding window) or --features window_size=L,R, not both")


def is_variant(args):
    """True when the run has variant features, knobs or an explicit mixed_precision."""
    return bool(getattr(args, "features", None) or getattr(args, "knobs", None)
                or getattr(args, "mixed_precision", None) is not None)


def _variant_case(args):
    """The harness row (``nki_attn.harness.cases.Case``) describing the profiled problem and its variants."""
    from ..harness.cases import Case
    f = args.features
    return Case(name=f"profile-{args.kernel}", batch=args.batch, heads=args.heads,
                kv_heads=args.kv_heads or args.heads, seqlen_q=f.get("seqlen_q", args.seqlen),
                seqlen_k=f.get("seqlen_k", args.seqlen), d_head=f.get("d_qk", args.head_dim),
                d_v=f.get("d_v", args.head_dim), dtype=DTYPES[args.dtype], causal=bool(args.causal),
                window=args.window or 0, num_sinks=args.sinks, window_size=tuple(f.get("window_size", ())),
                dropout=f.get("dropout", 0.0), mask=f.get("mask", ""),
                **{m.name: f[m.name] for m in HARNESS_MODS if m.name in f})


def _block_mask(case):
    """The ``BlockMask`` of a --features mask=NAME run (built once per case)."""
    from ..block_mask import create_block_mask
    from ..masks import interval_example
    key = (case.mask, case.seqlen_q)
    if key not in _BLOCK_MASKS:
        mm = interval_example(case.mask, case.seqlen_q)[0]
        _BLOCK_MASKS[key] = create_block_mask(mm, None, None, case.seqlen_q, case.seqlen_k)
    return _BLOCK_MASKS[key]


_BLOCK_MASKS = {}


def run_variant_kernel(args):
    """``run_kernel`` for a run with --features / --set: inputs from the harness's ``make_inputs`` (kernel
    layout, torch), the kernel called with the variant keywords and the knobs; (records, sim_wall_seconds)."""
    from golden.attention_fwd_torch import attention_fwd_torch_ref

    from ..harness.runner import make_inputs, variant_kwargs
    from ..sim import trace

    case = _variant_case(args)
    x = make_inputs(case, seed=args.seed)
    kw = dict(sinks_ref=x["sinks"], use_causal_mask=case.causal, sliding_window=case.window or None)
    kw.update(variant_kwargs(case, x))
    if args.mixed_precision is not None:
        kw["mixed_precision"] = args.mixed_precision
    if case.mask:
        blk, store = _block_mask(case).kernel_operands()
        kw.update(block_mask=blk, block_bits=store)
    kernel = _launch(_load(args.kernel), args.lnc)
    if args.kernel == "fwd":
        def call():
            return kernel(x["q"], x["k"], x["v"], **kw, **args.knobs)
    else:  # o and lse from the golden forward with the same variant, outside the recording
        o, lse = attention_fwd_torch_ref(x["q"], x["k"], x["v"], **kw)
        knobs = dict(args.knobs)
        for m in GRAD_MODS:  # a gradient computed on request (the bias's) is costed unless --set turns it off
            if m.grad_flag and m.kernel in kw:
                knobs.setdefault(m.grad_flag, True)

        def call():
            return kernel(x["q"], x["k"], x["v"], o, x["dy"], lse.float(), **kw, **knobs)
    from ..sim.benchmark import run_benchmark
    t0 = time.perf_counter()
    _, result = run_benchmark(call, (), warmup=0, iters=1)
    wall = time.perf_counter() - t0
    LAST_RESULT[0] = result
    return result.records, wall


def variant_flops(args):
    """Useful FLOPs of a variant run: 2 * (d_qk + d_v) per visible (query, key) pair (the golden's mask) per
    query head, 2.5x that for the backward."""
    from golden.attention_fwd_torch import visibility_mask
    c = _variant_case(args)
    if c.mask:
        pairs = int(_block_mask(c).to_dense().sum())
    else:
        pairs = int(visibility_mask(c.seqlen_q, c.seqlen_k, c.causal, c.window or None, None, None,
                                    window_size=c.window_size or None).sum())
    fwd = 2 * c.batch * c.heads * pairs * (c.d_head + c.dv)
    return fwd * 5 // 2 if args.kernel == "bwd" else fwd


def compare_with_default(args, prof):
    """Run the default path (the same call without --features and --set) and print both modeled times, their
    ratio and the ratio per useful FLOP; returns them as a dict."""
    from .model import profile
    from .params import generation
    from ..sim.trace import ENGINES

    base = argparse.Namespace(**{**vars(args), "features": {}, "knobs": {}, "vs": None})
    prev = os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE")
    os.environ["NEURON_PLATFORM_TARGET_OVERRIDE"] = args.target
    try:
        records, _ = run_kernel(base)
    finally:
        if prev is None:
            os.environ.pop("NEURON_PLATFORM_TARGET_OVERRIDE", None)
        else:
            os.environ["NEURON_PLATFORM_TARGET_OVERRIDE"] = prev
    bprof = profile(records, generation(args.target), useful_flops(base), n_cores=args.lnc)
    # the scheduled time is the headline (as in the profile above); the perfect-overlap time rides along because
    # older figures of the docs quote it
    t, tb = prof.time_ns / 1e3, bprof.time_ns / 1e3
    to, tbo = prof.time_overlap_ns / 1e3, bprof.time_overlap_ns / 1e3
    out = {"default": describe(base), "time_us": t, "default_time_us": tb, "ratio": t / tb,
           "ratio_per_useful_flop": (t / prof.useful_flops) / (tb / bprof.useful_flops),
           "overlap_us": to, "default_overlap_us": tbo, "overlap_ratio": to / tbo,
           "bottleneck": prof.bottleneck, "default_bottleneck": bprof.bottleneck,
           "busy_us": {e: prof.engine_busy(e) / 1e3 for e in ENGINES},
           "default_busy_us": {e: bprof.engine_busy(e) / 1e3 for e in ENGINES}}
    print(f"\nvs the default path ({out['default']}), MODELED by {MODEL}:")
    print(f"{'':<24}{'this run':>12}{'default':>12}")
    print(f"{'scheduled time (us)':<24}{t:>12.1f}{tb:>12.1f}")
    print(f"{'perfect overlap (us)':<24}{to:>12.1f}{tbo:>12.1f}")
    for e in ENGINES:
        print(f"{e + ' busy (us)':<24}{out['busy_us'][e]:>12.1f}{out['default_busy_us'][e]:>12.1f}")
    print(f"{'bottleneck':<24}{prof.bottleneck:>12}{bprof.bottleneck:>12}")
    print(f"ratio (scheduled) {out['ratio']:.3f}; per useful FLOP {out['ratio_per_useful_flop']:.3f}; "
          f"perfect overlap {out['overlap_ratio']:.3f}")
    return out
