"""Benchmarks and measurements: one subcommand per study.

    python scripts/bench.py compile [--calls 20] [--json F]          torch.compile over the attention ops
    python scripts/bench.py frontend-overhead [--repeats 5]          cost of the simulator's NKI frontend check
    python scripts/bench.py sim-overhead [--seqlen 2048]             simulated kernels vs the torch golden, wall
    python scripts/bench.py modeled-util [--only NAME] [--plot F]    modeled TensorE utilisation, model shapes
    python scripts/bench.py dropout-cost [--tiles 8]                 modeled cost of dropout per score tile
    python scripts/bench.py dropout-stats [--seeds 8]                statistics of the dropout keep mask
    python scripts/bench.py blas-orders [--reuse DIR] [--write]      float32 rows under other CPUs' BLAS kernels
    python scripts/bench.py planted-bugs [--write]                   planted bugs against the tolerance rules
    python scripts/bench.py sim-speed [--seqlens 512,2048,8192] [--skip-kernels] [--skip-llama] [--matmul-tiles N]
                                      [--torch-threads N] [--profile-llama F] [--replay-loop N]
                                      the simulator vs torch, wall clock and CPU
    python scripts/bench.py block-mask-cost [--seqlen 16384] [--docs 8] [--density 0.5]   modeled time of block
                                      masks (document, causal document, random block-sparse) against the
                                      unmasked kernels

Every device time printed is MODELED by nki_attn.profiler (the cost model over the simulator's instruction
trace, docs/performance.md), never measured; wall-clock times are this machine's CPU running the simulator.

A study is two functions registered in COMMANDS: ``args_<name>(parser)`` adds its options and
``run_<name>(args)`` runs it and returns the exit status (its docstring's first line is the help). Heavy imports
stay inside the run functions, so that ``--blas-threads`` (sim-overhead) can set OPENBLAS_NUM_THREADS before
numpy loads. A new study is one more such pair and one COMMANDS line.
"""
import argparse
import contextlib
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------------------------------- shared
def kernel_inputs(batch, heads, kv_heads, seqlen, d_head, dtype="bfloat16", seed=0, **variant):
    """q, k, v, dy in the kernels' layout ([b, h, d, s], torch, rounded to ``dtype``) and the rest of the
    harness's inputs, from ``nki_attn.harness.runner.make_inputs`` (``variant``: further ``Case`` fields)."""
    from nki_attn.harness.cases import Case
    from nki_attn.harness.runner import make_inputs
    fields = dict(name="bench", batch=batch, heads=heads, kv_heads=kv_heads, seqlen_q=seqlen, seqlen_k=seqlen,
                  d_head=d_head, dtype=dtype)
    case = Case(**{**fields, **variant})
    return make_inputs(case, seed=seed)


def api_inputs(batch, heads, kv_heads, seqlen, d_head, seed=0, seqlen_k=None):
    """The same inputs in FlashAttention's layout [b, s, h, d] (float32) for the PyTorch API."""
    x = kernel_inputs(batch, heads, kv_heads, seqlen, d_head, dtype="float32", seed=seed,
                      seqlen_k=seqlen_k or seqlen)
    return {n: x[n].permute(0, 3, 1, 2).contiguous() for n in ("q", "k", "v", "dy")}


@contextlib.contextmanager
def target(name):
    """NEURON_PLATFORM_TARGET_OVERRIDE = ``name`` for the duration (the simulator's and profiler's target)."""
    prev = os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE")
    os.environ["NEURON_PLATFORM_TARGET_OVERRIDE"] = name
    try:
        yield
    finally:
        if prev is None:
            os.environ.pop("NEURON_PLATFORM_TARGET_OVERRIDE", None)
        else:
            os.environ["NEURON_PLATFORM_TARGET_OVERRIDE"] = prev


def best_of(fn, repeats):
    """Smallest wall time of ``repeats`` calls of ``fn()``, seconds."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def profile_args(kernel, b, h, hkv, s, d, causal=False, window=None, sinks=0, target="trn2", dtype="bf16"):
    """The argument namespace ``nki_attn.profiler.cli.run_kernel`` / ``useful_flops`` take."""
    return argparse.Namespace(kernel=kernel, batch=b, heads=h, kv_heads=hkv, seqlen=s, head_dim=d, dtype=dtype,
                              causal=causal, window=window, sinks=sinks, target=target, lnc=1, seed=0)


def kernel_versions():
    """Short sha256 of the kernel sources the figures came from (the kernels change; the figures go stale)."""
    import hashlib
    import pathlib

    import nki_attn.kernels as kpkg
    root = pathlib.Path(kpkg.__file__).parent
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest()[:12] for f in sorted(root.glob("attention_*.py"))}


def kernel_package_sha(exclude=()):
    """sha256[:12] over every source of nki_attn/kernels but ``exclude`` (file names): a kernel's figures depend on
    the shared steps, band plans and helpers too, not only on its own file."""
    import hashlib
    import pathlib

    import nki_attn.kernels as kpkg
    h = hashlib.sha256()
    for f in sorted(pathlib.Path(kpkg.__file__).parent.glob("*.py")):
        if f.name not in exclude:
            h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:12]


def _write_json(path, obj):
    if path:
        with open(path, "w") as f:
            json.dump(obj, f, indent=1)
        print(f"wrote {path}")


# ----------------------------------------------------------------------------------------------------- compile
COMPILE_CASES = {
    "causal-gqa-sinks": dict(shape=(2, 256, 4, 2, 64), kw=dict(causal=True, window_size=(100, 0)), sinks=True),
    "noncausal-pad": dict(shape=(1, 200, 2, 2, 64), kw=dict(), sinks=False),
    "bottom-right": dict(shape=(1, 128, 2, 1, 64), kw=dict(causal=True), sinks=False, sk=300),
}


def args_compile(p):
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--json")


def run_compile(a):
    """torch.compile over the attention ops: first call, per-call overhead, graph breaks, recompiles, bit-exactness.

    Each case is a training step ``(attn(q, k, v) * w).sum().backward()`` with ``attn`` eager and with
    ``torch.compile(attn, fullgraph=True)`` (Inductor); the loss is the same eager code. Times are wall-clock on
    this CPU, where the kernels run on the simulator: the per-call ratio is the compile machinery's overhead
    around the opaque kernel ops. Graph breaks come from ``torch._dynamo.explain``; recompiles from
    ``torch._dynamo.config.error_on_recompile`` over the timed calls. Set ``OMP_WAIT_POLICY=PASSIVE`` before
    Python starts so that Inductor's OpenMP workers sleep instead of spinning beside the simulator (recorded in
    the JSON)."""
    import torch

    import nki_attn

    def inputs(case, seed):
        b, s, h, hk, d = case["shape"]
        x = api_inputs(b, h, hk, s, d, seed=seed, seqlen_k=case.get("sk", s))
        g = torch.Generator().manual_seed(seed)
        sinks = torch.randn(h, generator=g).requires_grad_() if case["sinks"] else None
        return (x["q"].requires_grad_(), x["k"].requires_grad_(), x["v"].requires_grad_(), x["dy"], sinks)

    def grads(q, k, v, w, sinks):
        return [t.grad for t in (q, k, v) + ((sinks,) if sinks is not None else ())]

    rows = []
    for name, case in COMPILE_CASES.items():
        torch._dynamo.reset()

        def fwd(q, k, v, sinks, kw=case["kw"]):
            return nki_attn.flash_attn_func(q, k, v, sinks=sinks, **kw)

        def eager_step(q, k, v, w, s):
            (fwd(q, k, v, s) * w).sum().backward()

        compiled_fwd = torch.compile(fwd, fullgraph=True)

        def compiled_step(q, k, v, w, s):
            (compiled_fwd(q, k, v, s) * w).sum().backward()

        x = inputs(case, 0)
        explain = torch._dynamo.explain(fwd)(x[0], x[1], x[2], x[4])
        t0 = time.perf_counter()
        compiled_step(*inputs(case, 0))
        first = time.perf_counter() - t0
        ea, ca = inputs(case, 1), inputs(case, 1)
        out_e, out_c = fwd(ea[0], ea[1], ea[2], ea[4]), compiled_fwd(ca[0], ca[1], ca[2], ca[4])
        (out_e * ea[3]).sum().backward()
        (out_c * ca[3]).sum().backward()
        exact = torch.equal(out_e, out_c) and all(torch.equal(p, q) for p, q in zip(grads(*ea), grads(*ca)))
        torch._dynamo.config.error_on_recompile = True
        te, tc, recompiles = [], [], 0
        try:
            for i in range(a.calls):  # interleaved eager / compiled, fresh inputs; a recompile raises
                te.append(best_of(lambda: eager_step(*inputs(case, 100 + i)), 1))
                tc.append(best_of(lambda: compiled_step(*inputs(case, 100 + i)), 1))
        except torch._dynamo.exc.RecompileError:
            recompiles = 1
        finally:
            torch._dynamo.config.error_on_recompile = False
        me, mc = statistics.median(te), statistics.median(tc) if tc else float("nan")
        r = {"case": name, "shape [b, s, h, hk, d]": list(case["shape"]), "graph_breaks": explain.graph_break_count,
             "graphs": explain.graph_count, "first_call_s": round(first, 2), "eager_ms": round(me * 1e3, 2),
             "compiled_ms": round(mc * 1e3, 2), "ratio": round(mc / me, 3), "recompiles": recompiles,
             "bit_exact": exact}
        rows.append(r)
        print(json.dumps(r), flush=True)
    _write_json(a.json, {"torch": torch.__version__, "calls": a.calls, "cpus": os.cpu_count(),
                         "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"), "rows": rows})
    return 1 if any(r["graph_breaks"] or r["recompiles"] or not r["bit_exact"] for r in rows) else 0


# ----------------------------------------------------------------------------------------------------- frontend
def args_frontend_overhead(p):
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--shapes", default="1x256x64,4x1024x128", help="HEADSxSEQLENxD_HEAD,... (batch 1, 1 kv head)")


def run_frontend_overhead(a):
    """Cost of the simulator's NKI frontend check (nki_attn.sim.frontend) on attention_fwd + attention_bwd.

    First call (gathering and instrumenting every function the kernels reach, once per process); per launch
    (the frontend's work before a launch); one tracing check (timed alone) times the checks one fwd + bwd pair
    makes, an estimate independent of the machine's load; and whole launches with the check off / gather / full
    (CPU time, modes alternated so that a load change hits all three alike; best and median)."""
    # every launch here must run the kernel body: a replayed launch (nki_attn.sim.replay) runs no tracing check
    os.environ["NKI_ATTN_SIM_REPLAY"] = "0"
    from nki_attn.sim import checking, frontend

    t0 = time.process_time()
    from nki_attn.kernels.attention_bwd import attention_bwd
    from nki_attn.kernels.attention_fwd import attention_fwd
    t_import = time.process_time() - t0
    t0 = time.process_time()
    for k in (attention_fwd, attention_bwd):
        for info in frontend.check_kernel(k).functions:
            frontend.instrumented_code(info)
    t_first = time.process_time() - t0
    n_defs = sum(len(frontend.gather(k).definitions) for k in (attention_fwd, attention_bwd))
    n_fns = sum(len(frontend.gather(k).functions) for k in (attention_fwd, attention_bwd))
    print(f"first call (gather {n_defs} definitions, instrument {n_fns} functions, both kernels): "
          f"{1e3 * t_first:.1f} ms CPU (importing the kernels: {1e3 * t_import:.1f} ms)")

    def pair(x):
        o, lse = attention_fwd(x["q"], x["k"], x["v"], use_causal_mask=True)
        return attention_bwd(x["q"], x["k"], x["v"], o, x["dy"], lse, use_causal_mask=True, mixed_precision=True)

    x = kernel_inputs(1, 1, 1, 256, 64)
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        with frontend.prepare(attention_fwd.fn, (x["q"], x["k"], x["v"]), {"use_causal_mask": True}):
            pass
    per = (time.perf_counter() - t0) / n
    print(f"per launch, frontend work before the kernel runs (prepare + code swap): {1e6 * per:.0f} us")

    class Probe:
        def __getitem__(self, k):
            return k

    t, n = Probe(), 200000
    t0 = time.perf_counter()
    for _ in range(n):
        t[(0, 1)]
    bare = (time.perf_counter() - t0) / n
    t0 = time.perf_counter()
    for _ in range(n):
        frontend._CHECKS.sub(t, (0, 1), 0)  # the commonest check: a tensor indexed by a tuple
    per_check = (time.perf_counter() - t0) / n - bare
    print(f"one tracing check (beyond the subscript itself): {1e9 * per_check:.0f} ns")

    def count_checks(run):
        """Calls of the tracing checks (subscripts, item stores, builtins, attributes, operators, 'in') made by
        ``run()`` in full mode, counted by a
        profile hook on their code objects (nothing is patched)."""
        codes = {getattr(frontend._Checks, m).__code__ for m in ("sub", "key", "bi", "attr", "binop", "contains")}
        counts = [0]

        def hook(frame, event, arg):
            if event == "call" and frame.f_code in codes:
                counts[0] += 1
        sys.setprofile(hook)
        try:
            with checking(frontend="full"):
                run()
        finally:
            sys.setprofile(None)
        return counts[0]

    print("\n| shape (heads x seqlen x d_head) | checks per pair | estimate | off | gather | full | full / off |")
    print("|---|---|---|---|---|---|---|")
    for spec in a.shapes.split(","):
        h, s, d = (int(p) for p in spec.lower().split("x"))
        x = kernel_inputs(1, h, 1, s, d)
        calls = count_checks(lambda: pair(x))
        times = {"off": [], "gather": [], "full": []}
        for mode in times:  # warm-up
            with checking(frontend=mode):
                pair(x)
        for _ in range(a.repeats):
            for mode in times:
                with checking(frontend=mode):
                    t0 = time.process_time()
                    pair(x)
                    times[mode].append(time.process_time() - t0)
        best = {m: min(v) for m, v in times.items()}
        med = {m: statistics.median(v) for m, v in times.items()}
        est = calls * per_check + 2 * per
        print(f"| {h}x{s}x{d} | {calls} | {1e3 * est:.2f} ms ({100 * est / best['off']:.2f} %) | "
              + " | ".join(f"{best[m]:.3f} / {med[m]:.3f} s" for m in ("off", "gather", "full"))
              + f" | {best['full'] / best['off']:.3f} / {med['full'] / med['off']:.3f} |")
    print(f"\n(CPU seconds of attention_fwd + attention_bwd, bf16, causal: best / median of {a.repeats} alternated "
          f"runs; estimate = checks x one check + 2 x the per-launch work, as a share of the best run without the "
          f"check)")
    return 0


# ----------------------------------------------------------------------------------------------------- sim overhead
def args_sim_overhead(p):
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--seqlen", type=int, default=2048)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--non-causal", action="store_true")
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each side, alternating; the best counts")
    p.add_argument("--profile", metavar="F", help="also cProfile one simulated run into F")
    p.add_argument("--blas-threads", type=int, default=None,
                   help="OPENBLAS_NUM_THREADS for numpy (the simulator's matmuls), set before numpy is imported")


def run_sim_overhead(a):
    """Simulator overhead: wall time of the simulated attention_fwd + attention_bwd against the torch golden's.

    Same CPU, shape and process (default: batch 1, 4 heads, seqlen 2048, d_head 128, bf16, causal); the golden
    computes the full score matrix with torch BLAS calls, the simulator runs the kernels instruction by
    instruction in numpy. Target: simulated / golden <= 3x. ``--profile F`` also cProfiles one simulated pair
    into F and prints the 25 most expensive functions and the instruction counts."""
    import numpy as np
    import torch

    from golden.attention_bwd_torch import attention_bwd_torch_ref
    from golden.attention_fwd_torch import attention_fwd_torch_ref
    from nki_attn.harness.report import cpu_model
    from nki_attn.kernels.attention_bwd import attention_bwd
    from nki_attn.kernels.attention_fwd import attention_fwd

    hkv = a.kv_heads or a.heads
    causal = not a.non_causal
    x = npx = kernel_inputs(a.batch, a.heads, hkv, a.seqlen, a.head_dim)  # torch: both sides take it

    def simulated():
        o, lse = attention_fwd(npx["q"], npx["k"], npx["v"], use_causal_mask=causal)
        return attention_bwd(npx["q"], npx["k"], npx["v"], o, npx["dy"], lse, use_causal_mask=causal)

    def golden():
        o, lse = attention_fwd_torch_ref(x["q"], x["k"], x["v"], use_causal_mask=causal)
        return attention_bwd_torch_ref(x["q"], x["k"], x["v"], o, x["dy"], lse, use_causal_mask=causal)

    golden()
    simulated()  # warm-up: imports, thread pools, first-call caches
    gold, sim = [], []
    for _ in range(a.repeats):  # alternate so that a change of load hits both sides alike
        gold.append(best_of(golden, 1))
        sim.append(best_of(simulated, 1))
    t_gold, t_sim = min(gold), min(sim)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    import platform
    print(f"machine: {os.cpu_count()} CPUs ({cpu_model()}), torch {torch.__version__} "
          f"({torch.get_num_threads()} threads), numpy {np.__version__} "
          f"(OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}), "
          f"python {platform.python_version()}")
    print(f"shape: B={a.batch} H={a.heads} HKV={hkv} S={a.seqlen} D={a.head_dim} bf16 "
          f"{'causal' if causal else 'non-causal'}; best of {a.repeats} alternating runs; "
          f"1-min load average {load:.1f}")
    print(f"torch golden fwd+bwd:    {t_gold:8.2f} s  (runs: {', '.join(f'{t:.2f}' for t in gold)})")
    print(f"simulated kernels f+b:   {t_sim:8.2f} s  (runs: {', '.join(f'{t:.2f}' for t in sim)})")
    print(f"ratio simulated/golden:  {t_sim / t_gold:8.2f}x  (target <= 3x)")
    if a.profile:
        import cProfile
        import pstats
        from collections import Counter

        from nki_attn.sim import trace
        prof = cProfile.Profile()
        with trace.recording() as rec:
            prof.enable()
            simulated()
            prof.disable()
        prof.dump_stats(a.profile)
        print(f"\ncProfile of one simulated fwd+bwd (traced) -> {a.profile}")
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        print("instructions executed:", dict(Counter(r.instr for r in rec.records).most_common()))
    return 0


# ----------------------------------------------------------------------------------------------------- modeled util
# name: (model config it stands for, batch, heads, kv_heads, seqlen, head_dim, causal, window, sinks). Sequence
# lengths, head dims, masks and GQA groups are those of the NKI Library backward test matrix; the head counts are
# cut to one kv head (two for MHA): utilisation is per-tile behaviour.
UTIL_SHAPES = {
    "llama3-8b": ("32q/8kv d128 causal S=8192 (group 4 kept)", 1, 4, 1, 8192, 128, True, None, 0),
    "qwen3-1.7b": ("16q/8kv d128 causal S=4096 (group 2)", 1, 2, 1, 4096, 128, True, None, 0),
    "gemma2-9b": ("16q/8kv d256 causal window 4096 S=8192 (group 2)", 1, 2, 1, 8192, 256, True, 4096, 0),
    "gpt-oss-20b": ("64q/8kv d64 causal window 128, 1 sink, S=4096 (group 8)", 1, 8, 1, 4096, 64, True, 128, 1),
    "modernbert": ("16q/16kv d64 non-causal S=1024", 1, 2, 2, 1024, 64, False, None, 0),
    "mqa-d96": ("8q/1kv d96 causal S=8192 (MQA)", 1, 8, 1, 8192, 96, True, None, 0),
}
# Mask experiments on one Llama-like head (d128): causal vs full, and window 512 at two lengths.
UTIL_MASKS = {
    "full-2048": (1, 1, 1, 2048, 128, False, None, 0),
    "causal-2048": (1, 1, 1, 2048, 128, True, None, 0),
    "win512-4096": (1, 1, 1, 4096, 128, True, 512, 0),
    "win512-8192": (1, 1, 1, 8192, 128, True, 512, 0),
}


def args_modeled_util(p):
    p.add_argument("--target", default="trn2", choices=("trn1", "trn2", "trn3"))
    p.add_argument("--only", action="append", help="run only these case names (repeatable)")
    p.add_argument("--kernels", nargs="+", choices=("fwd", "bwd"), default=["fwd", "bwd"],
                   help="which kernels to run (default both)")
    p.add_argument("--json", metavar="F", help="write all rows as JSON")
    p.add_argument("--plot", metavar="F", help="bar chart of TensorE utilisation per model shape (matplotlib)")
    p.add_argument("--write", action="store_true",
                   help="put the table and the ratios between the modeled-util markers of docs/performance.md "
                        "(a full run only: every case, both kernels)")
    p.add_argument("--reuse", metavar="F",
                   help="take the rows of the kernels not in --kernels from F (an earlier --json of the same "
                        "target), refused unless F was made from the same kernel source and model")


def _critical_lead(p):
    """The instruction kind holding the largest share of the schedule's critical path, and that share."""
    path = p.critical_path_by_kind()
    if not path or not p.time_ns:
        return "-", 0.0
    kind = max(path, key=path.get)
    return kind, path[kind] / p.time_ns


def _util_row(kernel, shape, tgt):
    from nki_attn.profiler import generation, profile
    from nki_attn.profiler.cli import run_kernel, useful_flops
    from nki_attn.sim.trace import ENGINES
    b, h, hkv, s, d, causal, window, sinks = shape
    args = profile_args(kernel, b, h, hkv, s, d, causal, window, sinks, tgt)
    with target(tgt):
        t0 = time.perf_counter()
        records, _ = run_kernel(args)
        wall = time.perf_counter() - t0
    p = profile(records, generation(tgt), useful_flops(args))
    lead, lead_share = _critical_lead(p)
    # the scheduled time (cost model v2's headline) leads; the perfect-overlap bound and the serial sum ride along
    return {
        "kernel": kernel, "shape": dict(batch=b, heads=h, kv_heads=hkv, seqlen=s, head_dim=d, causal=causal,
                                        window=window, sinks=sinks),
        "time_us": p.time_ns / 1e3, "time_overlap_us": p.time_overlap_ns / 1e3,
        "time_serial_us": p.time_serial_ns / 1e3,
        "busiest": p.bottleneck, "critical_lead": lead, "critical_lead_share": lead_share,
        "useful_util": p.useful_tensor_utilisation("scheduled"), "floor_ratio": p.floor_ratio("scheduled"),
        "util": p.tensor_utilisation("scheduled"),
        "useful_util_overlap": p.useful_tensor_utilisation(True), "floor_ratio_overlap": p.floor_ratio(True),
        "sbuf_port_us": p.engine_busy("VectorE/GpSimdE SBUF port") / 1e3,
        "tensor_efficiency": p.tensor_efficiency(), "tflops": p.tflops("scheduled"),
        "busy_us": {e: p.engine_busy(e) / 1e3 for e in ENGINES},
        "hbm_mib": p.hbm_bytes / 2**20, "instructions": len(records), "sim_wall_s": wall,
    }


def _util_shape(s):
    return f"{s['heads']}/{s['kv_heads']} S={s['seqlen']} d={s['head_dim']}" + ("" if s["causal"] else " full") \
        + (f" W={s['window']}" if s["window"] else "") + (f" sinks={s['sinks']}" if s["sinks"] else "")


def _util_table(rows):
    from nki_attn.sim.trace import ENGINES
    out = ["| case | kernel | ran (H/HKV, S, d) | modeled us: scheduled (perfect overlap / no overlap) | "
           "x useful-FLOP bound, scheduled (overlap) | useful util, scheduled (overlap) | executed util, scheduled | "
           "critical path lead (share) | busiest engine | TensorE eff. | TFLOPS, scheduled | "
           + " / ".join(ENGINES) + " busy us | V/G SBUF port us | sim s |", "|" + "---|" * 14]
    for name, r in rows:
        busy = " / ".join(f"{r['busy_us'][e]:.0f}" for e in ENGINES)
        out.append(f"| {name} | {r['kernel']} | {_util_shape(r['shape'])} | **{r['time_us']:.0f}** "
                   f"({r['time_overlap_us']:.0f} / {r['time_serial_us']:.0f}) | **{r['floor_ratio']:.2f}** "
                   f"({r['floor_ratio_overlap']:.2f}) | {r['useful_util']:.1%} ({r['useful_util_overlap']:.1%}) | "
                   f"{r['util']:.1%} | {r['critical_lead']} ({r['critical_lead_share']:.0%}) | {r['busiest']} | "
                   f"{r['tensor_efficiency']:.0%} | {r['tflops']:.1f} | {busy} | {r['sbuf_port_us']:.0f} | "
                   f"{r['sim_wall_s']:.1f} |")
    return "\n".join(out)


def _util_plot(rows, path, tgt):
    """Grouped bars: modeled TensorE utilisation of useful FLOPs on the scheduled time (cost model v2's headline),
    with the perfect-overlap bound as a light bar behind and no overlap as a dark inner bar."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed, {path} not written (pip install 'nki-attn[plot]')")
        return
    names = list(dict.fromkeys(n for n, _ in rows))
    by = {(n, r["kernel"]): r for n, r in rows}
    kernels = [k for k in ("fwd", "bwd") if any((n, k) in by for n in names)]
    fig, ax = plt.subplots(figsize=(8, 3.8))
    width = 0.38
    for i, kernel in enumerate(kernels):
        xs, sched, over, ser = [], [], [], []
        for j, n in enumerate(names):
            r = by.get((n, kernel))
            if r is None:
                continue
            xs.append(j + (i - 0.5) * width)
            sched.append(100 * r["useful_util"])
            over.append(100 * r["useful_util_overlap"])
            # utilisation scales with 1 / time: the same FLOPs over the serial sum
            ser.append(100 * r["useful_util"] * r["time_us"] / r["time_serial_us"])
        colour = ("#4c72b0", "#dd8452")[i]
        ax.bar(xs, over, width, color=colour, alpha=0.3, label=f"{kernel}, perfect-overlap bound")
        ax.bar(xs, sched, width, color=colour, label=f"{kernel}, scheduled (headline)")
        ax.bar(xs, ser, width * 0.5, color="black", alpha=0.35, label="no overlap" if i == len(kernels) - 1 else None)
        for x, v in zip(xs, sched):
            ax.text(x, v, f"{v:.0f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, fontsize=8)
    ax.set_ylabel("TensorE utilisation, useful FLOPs (%)")
    ax.set_ylim(0, 105)  # room for the legend above the tallest bars
    ax.set_title(f"TensorE utilisation on {tgt}, MODELED by cost model v2 (scheduled), not measured; "
                 "scaled-down head counts", fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def run_modeled_util(a):
    """Modeled TensorE utilisation of both kernels at model shapes; causal and sliding-window time ratios.

    Every time is cost model v2's scheduled time (the headline of ``profile()``), with the perfect-overlap bound
    and the no-overlap sum beside it. Head counts are scaled down so that the run fits minutes of simulation;
    every row says what it ran."""
    from nki_attn.profiler.params import MODEL
    versions = kernel_versions()
    reused = {}
    if a.reuse:
        with open(a.reuse) as f:
            old = json.load(f)
        for kernel in {"fwd", "bwd"} - set(a.kernels):
            src = f"attention_{kernel}.py"
            other = "attention_bwd.py" if kernel == "fwd" else "attention_fwd.py"
            # a row is only as current as the model and the kernel sources it was made with (the other kernel's
            # file aside: it does not run)
            if old.get("model") != MODEL or old.get("target") != a.target or \
                    old.get("kernel_sha256_12", {}).get(src) != versions.get(src) or \
                    old.get("kernel_package_sha256_12", {}).get(kernel) != kernel_package_sha([other]):
                raise SystemExit(f"--reuse {a.reuse}: its {kernel} rows were made from {src} "
                                 f"{old.get('kernel_sha256_12', {}).get(src)} and kernel package "
                                 f"{old.get('kernel_package_sha256_12', {}).get(kernel)} ({old.get('model')}, "
                                 f"{old.get('target')}), not the current {versions.get(src)} / "
                                 f"{kernel_package_sha([other])}; run them again")
            reused.update({(r["case"], kernel): {k: v for k, v in r.items() if k != "case"}
                           for r in old["rows"] if r["kernel"] == kernel})
    kernels = [k for k in ("fwd", "bwd") if k in a.kernels or any(kk == k for _, kk in reused)]
    rows, masks = [], {}

    def row(name, kernel, shape, model=None):
        if (name, kernel) in reused:
            return reused[(name, kernel)]
        r = _util_row(kernel, shape, a.target)
        print(f"{name} {kernel}: {r['time_us']:.0f} us scheduled, useful util {r['useful_util']:.1%} "
              f"({r['sim_wall_s']:.1f} s sim)", flush=True)
        return dict(r, model=model) if model else r
    for name, (model, *shape) in UTIL_SHAPES.items():
        for kernel in kernels:
            if a.only and name not in a.only:
                continue
            rows.append((name, row(name, kernel, shape, model)))
    for name, shape in UTIL_MASKS.items():
        for kernel in kernels:
            if a.only and name not in a.only:
                continue
            r = masks[(name, kernel)] = row(name, kernel, shape)
            rows.append((name, r))
    print(f"\nTarget {a.target}; device times MODELED by {MODEL}, not measured. Kernel sources (sha256[:12]): "
          + ", ".join(f"{k} {v}" for k, v in versions.items()) + "\n")
    print(_util_table(rows))
    ratios = []
    for kernel in kernels:
        def t(name, key="time_us"):
            return masks[(name, kernel)][key] if (name, kernel) in masks else None
        if t("causal-2048") and t("full-2048"):
            ratios.append(f"{kernel}: causal / non-causal modeled time at S=2048 = "
                          f"{t('causal-2048') / t('full-2048'):.3f} (scheduled), "
                          f"{t('causal-2048', 'time_overlap_us') / t('full-2048', 'time_overlap_us'):.3f} "
                          f"(perfect overlap); ideal 0.500 (visible pairs {(2048 * 2049 // 2) / 2048 ** 2:.3f})")
        if t("win512-4096") and t("win512-8192"):
            ratios.append(f"{kernel}: window 512, S=8192 / S=4096 modeled time = "
                          f"{t('win512-8192') / t('win512-4096'):.3f} (scheduled), "
                          f"{t('win512-8192', 'time_overlap_us') / t('win512-4096', 'time_overlap_us'):.3f} "
                          f"(perfect overlap); ideal ~2 (linear in S)")
    if ratios:
        print("\n" + "\n".join(ratios))
    if a.write:
        if a.only or set(kernels) != {"fwd", "bwd"}:
            print("--write: only a full run (no --only, both kernels) rewrites the docs' table; not written")
        else:
            from nki_attn.harness.report import replace_marked_section
            text = (f"Target {a.target}, MODELED by cost model v2 (scheduled), not measured; kernels "
                    + ", ".join(f"`{k}` `{v}`" for k, v in versions.items()) + ".\n\n" + _util_table(rows)
                    + "\n\nCausal and window scaling (same run, one d128 head):\n\n"
                    + "\n".join(f"- {r}" for r in ratios))
            name = "modeled-util" if a.target == "trn2" else f"modeled-util-{a.target}"
            replace_marked_section(os.path.join(ROOT, "docs", "performance.md"), name, text)
            print(f"wrote the {name} section of docs/performance.md")
    if a.plot:
        _util_plot([(n, r) for n, r in rows if n in UTIL_SHAPES], a.plot, a.target)
    _write_json(a.json, {"target": a.target, "modeled": True, "model": MODEL, "kernel_sha256_12": versions,
                         "kernel_package_sha256_12": {"fwd": kernel_package_sha(["attention_bwd.py"]),
                                                      "bwd": kernel_package_sha(["attention_fwd.py"])},
                         "rows": [dict(r, case=n) for n, r in rows], "ratios": ratios})
    return 0


# ----------------------------------------------------------------------------------------------------- dropout
def args_dropout_cost(p):
    p.add_argument("--target", default="trn2", choices=("trn1", "trn2", "trn3"))
    p.add_argument("--tiles", type=int, default=8, help="key tiles per 128 query rows (seqlen_k / 512)")
    p.add_argument("--no-context", action="store_true", help="skip the attention forward profile")


def _dropout_kernels():
    """Kernels that run one stage of the dropout mask each, and the hardware-generator stand-in.

    Counter hash (nki_attn/kernels/dropout.py), stage by stage: ``seed`` load_dropout_seed (once per call),
    ``rows`` dropout_row_keys (once per 128 query rows and 65536-key block), ``tile`` dropout_scale_keys (per
    [128 x 512] tile). Hardware generator (estimate; the simulator has no rand_set_state / rng, so stand-ins with
    the same engine, operand shapes and dtypes, which the cost model prices by the same rules): the per-lane
    XORWOW state (6 uint32 words per lane on GpSimdE) hashed from (seed, b, h, tile) costs what ``rows`` costs;
    ``set`` rand_set_state, one GpSimdE instruction on [128, 6] (a GpSimdE tensor_copy); ``rng`` into a uint32
    [128, 512] tile, one VectorE instruction without tensor input (a VectorE memset); ``decide`` the same two
    tensor_scalar instructions as the hash."""
    from nki_attn.backend import nisa, nki, nl
    from nki_attn.kernels import dropout as kd
    P, COLS = 128, 512

    @nki.jit
    def seed_only(dropout_seed):
        out = nl.ndarray((P, 2), dtype=nl.uint32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=kd.load_dropout_seed(dropout_seed))
        return out

    @nki.jit
    def rows(dropout_seed):
        out = nl.ndarray((P, 4), dtype=nl.uint32, buffer=nl.shared_hbm)
        keys = kd.dropout_row_keys(kd.load_dropout_seed(dropout_seed), 0, 0, 0, P)
        nisa.dma_copy(dst=out, src=keys)
        return out

    @nki.jit
    def tile(dropout_seed):
        out = nl.ndarray((P, COLS), dtype=nl.float32, buffer=nl.shared_hbm)
        keys = kd.dropout_row_keys(kd.load_dropout_seed(dropout_seed), 0, 0, 0, P)
        nisa.dma_copy(dst=out, src=kd.dropout_scale_keys(keys, 0.1, 0, P, COLS))
        return out

    @nki.jit
    def hw_rng_standin(dropout_seed):
        out = nl.ndarray((P, COLS), dtype=nl.float32, buffer=nl.shared_hbm)
        state = nl.ndarray((P, 6), dtype=nl.uint32, buffer=nl.sbuf)
        nisa.memset(dst=state, value=1, engine=nisa.engine.gpsimd)
        lane_state = nl.ndarray((P, 6), dtype=nl.uint32, buffer=nl.sbuf)  # per tile from here
        nisa.tensor_copy(dst=lane_state, src=state, engine=nisa.engine.gpsimd)  # rand_set_state
        bits = nl.ndarray((P, COLS), dtype=nl.uint32, buffer=nl.sbuf)
        nisa.memset(dst=bits, value=7, engine=nisa.engine.vector)  # rng(dst=bits)
        v = nl.ndarray((P, COLS), dtype=nl.uint32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=v, data=bits, op0=nl.right_shift, operand0=16)
        scale = nl.ndarray((P, COLS), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=scale, data=v, op0=nl.less, operand0=58982.0, op1=nl.multiply, operand1=1.0 / 0.9)
        nisa.dma_copy(dst=out, src=scale)
        return out
    return seed_only, rows, tile, hw_rng_standin


def run_dropout_cost(a):
    """Modeled cost of dropout per [128 x 512] score tile: the kernels' counter hash vs a hardware generator.

    The hardware generator is nki.isa's rand_set_state + rng (XORWOW), priced by the same cost model through
    stand-in instructions (see ``_dropout_kernels``)."""
    import numpy as np

    from nki_attn.profiler import generation, profile
    from nki_attn.profiler.cli import run_kernel
    from nki_attn.sim import trace
    engines = ("VectorE", "GpSimdE", "ScalarE", "TensorE", "DMA")
    gen = generation(a.target)
    seed = np.array([1234, 0], dtype=np.int32)

    def records(kernel):
        with trace.recording() as rec:
            kernel(seed)
        return list(rec.records)

    def busy(recs):
        p = profile(recs, gen)
        return {e: p.engine_busy(e) for e in engines}, len(recs)

    def row(name, b, n, note=""):
        cells = "".join(f"{b[e] / 1e3:10.3f}" for e in engines[:2])
        print(f"  {name:<44}{n:6d}{cells}{max(b[e] for e in engines[:4]) / 1e3:11.3f}  {note}")

    t0 = time.perf_counter()
    with target(a.target):
        seed_only, rows_k, tile_k, hw = _dropout_kernels()
        r_seed, r_rows, r_tile, r_hw = (records(k) for k in (seed_only, rows_k, tile_k, hw))
        # each kernel's trace starts with the previous one's (same instructions), minus its final output DMA
        n_seed, n_rows = len(r_seed) - 1, len(r_rows) - 1
        assert [r.instr for r in r_rows[:n_seed]] == [r.instr for r in r_seed[:n_seed]]
        assert [r.instr for r in r_tile[:n_rows]] == [r.instr for r in r_rows[:n_rows]]
        c = {"seed": busy(r_seed[:n_seed]), "rows": busy(r_rows[n_seed:n_rows]), "tile": busy(r_tile[n_rows:-1]),
             "hw_per_tile": busy(r_hw[1:-1])}  # set + rng + 2 decisions (the state memset is set-up)
        context = None
        if not a.no_context:  # attention_fwd bf16 d128 2048 x 2048 non-causal, per [128 x 512] tile
            recs, _ = run_kernel(profile_args("fwd", 1, 1, 1, 2048, 128, target=a.target))
            p = profile(recs, gen)
            n_tiles = (2048 // 128) * (2048 // 512)
            context = ({e: p.engine_busy(e) / n_tiles for e in engines}, p.time_ns / n_tiles)
    print(f"Dropout cost per [128 x 512] score tile, target {a.target} -- MODELED (nki_attn.profiler), "
          f"microseconds of engine busy time")
    print(f"  {'stage':<44}{'instr':>6}{'VectorE':>10}{'GpSimdE':>10}{'busiest':>11}")
    print(" counter hash (simulated tile step):")
    row("seed: load_dropout_seed (once per call)", *c["seed"])
    row("rows: dropout_row_keys (per 128 rows)", *c["rows"])
    row("tile: dropout_scale_keys (per tile)", *c["tile"])
    (tb, tn), (rb, rn), k = c["tile"], c["rows"], a.tiles
    row(f"per tile, row words hoisted ({k} tiles per row block)", {e: tb[e] + rb[e] / k for e in engines},
        tn + rn // k)
    row("per tile, dropout_scale_tile (row words every call)", {e: tb[e] + rb[e] for e in engines}, tn + rn)
    print(" hardware generator (estimate, stand-in instructions):")
    hb, hn = c["hw_per_tile"]
    row("set + rng + decide (per tile)", hb, hn)
    row(f"per tile, states hashed per row block ({k} tiles)", {e: hb[e] + rb[e] / k for e in engines}, hn + rn // k,
        "state hash ~ rows stage")
    row("per tile, state hashed per tile", {e: hb[e] + rb[e] for e in engines}, hn + rn)
    if context:
        b, t_sched = context
        print(f" context: attention_fwd bf16 d128 2048x2048 non-causal, per tile: scheduled time (cost model v2) "
              f"{t_sched / 1e3:.3f} us (VectorE {b['VectorE'] / 1e3:.3f}, GpSimdE {b['GpSimdE'] / 1e3:.3f},"
              f" ScalarE {b['ScalarE'] / 1e3:.3f}, TensorE {b['TensorE'] / 1e3:.3f})")
    print(f" (simulator wall time {time.perf_counter() - t0:.1f} s)")
    return 0


DROPOUT_SEEDS = [(1234, 7), (99, 1), (0, 0), (5, 6), (1, 0), (42, 42), (2**31, 0), (12345678, 9), (-1, 0), (7, 7),
                 (65536, 0), (3, 2**31)]


def args_dropout_stats(p):
    p.add_argument("--seeds", type=int, default=8, help=f"how many of the {len(DROPOUT_SEEDS)} listed seeds")


def run_dropout_stats(a):
    """Statistics of the dropout keep mask (golden.dropout) over several seeds, larger than the unit tests.

    Per seed, the 16-bit hash values of a 2 x 2 x 512 x 1024 problem; |z| (deviation in standard deviations from
    independent uniform draws) of: bits, the fairness of each of the 16 bits; cols, the correlation of keep
    decisions at column lags 1-256; rows, at row lags 1, 2, 3, 8; heads, between heads and between batches; for
    keep probabilities 0.5, 0.9 and 0.1. With ~40 statistics per seed a healthy hash shows a largest |z| of about
    3; a structural defect shows tens or thousands."""
    import math

    from golden import dropout as D

    def corr(x, y):
        x, y = x - x.mean(), y - y.mean()
        return float((x * y).mean() / (x.std(unbiased=False) * y.std(unbiased=False)))

    def study(seed, bs=2, nheads=2, sq=512, sk=1024):
        v = D.hash_values(D.make_seed(*seed), bs, nheads, sq, sk)
        sig = 1.0 / math.sqrt(v.numel())
        bits = max(abs(float(((v >> b) & 1).double().mean()) - 0.5) / (0.5 * sig) for b in range(16))
        cols = rows = heads = 0.0
        for t in (32768, D.keep_threshold(0.1), D.keep_threshold(0.9)):
            m = (v < t).double()
            cols = max([cols] + [abs(corr(m[..., :-d], m[..., d:])) / sig for d in (1, 2, 3, 4, 8, 16, 64, 256)])
            rows = max([rows] + [abs(corr(m[:, :, :-d], m[:, :, d:])) / sig for d in (1, 2, 3, 8)])
            half = sig * math.sqrt(2)  # head-vs-head and batch-vs-batch compare n / 2 pairs
            heads = max(heads, abs(corr(m[:, 0], m[:, 1])) / half, abs(corr(m[0], m[1])) / half)
        return {"bits": bits, "cols": cols, "rows": rows, "heads": heads}

    t0 = time.perf_counter()
    worst = 0.0
    print(f"{'seed':>24} {'bits':>6} {'cols':>6} {'rows':>6} {'heads':>6}   (largest |z|)")
    for seed in DROPOUT_SEEDS[:a.seeds]:
        z = study(seed)
        worst = max([worst] + list(z.values()))
        print(f"{str(seed):>24} {z['bits']:6.1f} {z['cols']:6.1f} {z['rows']:6.1f} {z['heads']:6.1f}", flush=True)
    print(f"largest |z| over all: {worst:.1f}  ({time.perf_counter() - t0:.0f} s)")
    return 0


# ----------------------------------------------------------------------------------------------------- tolerances
VALIDATION_DOC = os.path.join(ROOT, "docs", "validation.md")
BLAS_CHOICES = (
    ("default", {}),
    ("zen_avx2", {"OPENBLAS_CORETYPE": "Zen", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}),
    ("sandy_avx", {"OPENBLAS_CORETYPE": "Sandybridge", "MKL_ENABLE_INSTRUCTIONS": "AVX"}),
    ("prescott_sse", {"OPENBLAS_CORETYPE": "Prescott", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"}),
)


def args_blas_orders(p):
    p.add_argument("--reuse", metavar="DIR", help="tabulate the reports in DIR (<name>.json) instead of running")
    p.add_argument("--write", action="store_true", help="write the table into docs/validation.md")
    p.add_argument("--preset", default="full", help="harness preset to run (the table's is full)")


def run_blas_orders(a):
    """The harness's float32 rows under the BLAS kernels other CPUs would run: does the tolerance rule hold there?

    Each choice runs ``nki-attn check --preset full --dtypes float32 -j 2`` in a subprocess whose environment
    selects the CPU kernels of numpy's OpenBLAS (the simulator's matmuls) and torch's MKL (the golden's): the
    summation orders behind every error. ``--write`` puts the table between the ``blas-orders`` markers of
    docs/validation.md."""
    import subprocess
    import tempfile
    out_dir = a.reuse or tempfile.mkdtemp(prefix="blas-orders-")
    if not a.reuse:
        for name, env in BLAS_CHOICES:
            cmd = [sys.executable, "-m", "nki_attn.cli", "check", "--preset", a.preset, "--dtypes", "float32",
                   "-j", "2", "--out", os.path.join(out_dir, f"{name}.json")]
            print(f"{' '.join(f'{k}={v}' for k, v in env.items())} {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
            subprocess.run(cmd, env={**os.environ, **env, "PYTHONPATH": ROOT}, cwd=ROOT, stdout=subprocess.DEVNULL,
                           check=False)
    lines = ["| environment | numpy BLAS kernels | rows passing | worst err / bound (output) | worst dsinks "
             "err / bound | wall s (load) |", "|---|---|---|---|---|---|"]
    for name, env in BLAS_CHOICES:
        rep = json.load(open(os.path.join(out_dir, f"{name}.json")))
        outs = [(o["max_abs"] / o["bound"], f"{r['case']['name']} {k}") for r in rep["rows"]
                for k, o in r.get("outputs", {}).items()]
        worst = max(outs)
        ds = max((x for x in outs if x[1].endswith("dsinks")), default=(0.0, "-"))
        arch = ", ".join(f"{b['internal_api']} {b['architecture']}" for b in rep["machine"]["blas"]["numpy"])
        load = rep.get("load_average") or {}
        s = rep["summary"]
        lines.append(f"| {' '.join(f'`{k}={v}`' for k, v in env.items()) or 'none (this CPU)'} | {arch} | "
                     f"{s['passed']}/{s['rows']} | {worst[0]:.3f} ({worst[1]}) | {ds[0]:.3f} ({ds[1]}) | "
                     f"{rep['wall_seconds']} ({load.get('start')}-{load.get('end')}) |")
    m = json.load(open(os.path.join(out_dir, f"{BLAS_CHOICES[0][0]}.json")))["machine"]
    lines += ["", f"Measured by `python scripts/bench.py blas-orders --write` on {m['cpu_model']} ({m['cpus']} CPUs; "
              f"torch MKL {m['blas']['torch'].get('mkl', '?').split(' for ')[0]}). The load is the 1-minute load "
              f"average at the start and end of each run (the machine is shared)."]
    text = "\n".join(lines)
    print(text)
    if a.write:
        from nki_attn.harness.report import replace_marked_section
        replace_marked_section(VALIDATION_DOC, "blas-orders", text)
    return 0


def args_planted_bugs(p):
    p.add_argument("--write", action="store_true", help="write the table into docs/validation.md")
    p.add_argument("--seqlens", type=int, nargs="+", default=[256, 2048])


def run_planted_bugs(a):
    """Planted bugs against the harness's tolerance rules, at every dtype: how far over its bound each lands.

    Bugs (as the harness's tests plant them): dQ x 1.01, dK x 0.99, dV x 1.01; the sliding window one key wider
    in forward and backward; dK = 0; one unit in the last place of dQ on every other run (jitter, for the
    determinism check). Per dtype and seqlen (256: the tests' rows; 2048: the full preset's): the bugged
    output's ratio to rule 1's bound and to rule 2's (> 1: over), the seed's band (reported, not judged), the
    verdict, and the correct kernels' two ratios on the same output."""
    import platform

    import torch

    from nki_attn.harness import cases, report, runner, tolerance
    from nki_attn.harness.determinism import check_determinism

    class Planted:
        """The real kernels with a hook on the keyword arguments and on the backward's outputs."""

        def __init__(self, kw=None, post=None):
            self.inner = runner.KernelCandidate()
            self.kw, self.post = kw or (lambda k: k), post or (lambda r: r)

        def fwd(self, *args, **k):
            return self.inner.fwd(*args, **self.kw(dict(k)))

        def bwd(self, *args, **k):
            return self.post(list(self.inner.bwd(*args, **self.kw(dict(k)))))

    def scale(i, factor):
        def post(r):
            r[i] = r[i] * factor
            return r
        return post

    def zero_dk(r):
        r[1] = torch.zeros_like(r[1])
        return r

    def widen(k):
        k["sliding_window"] = k["sliding_window"] + 1
        return k

    def jitter():
        calls = {"n": 0}

        def post(r):
            calls["n"] += 1
            if calls["n"] % 2:
                r[0] = torch.nextafter(r[0], torch.full_like(r[0], float("inf")))
            return r
        return Planted(post=post)

    def ratios(o):
        r1, r2 = tolerance.ratios(o)
        return f"{r1:.2f}", (f"{r2:.2f}" if o["proj_applies"] else "n/a")

    def bold(text, over):
        return f"**{text}**" if over else text

    bugs = (("dQ x 1.01", "causal", "dq", Planted(post=scale(0, 1.01))),
            ("dK x 0.99", "causal", "dk", Planted(post=scale(1, 0.99))),
            ("dV x 1.01", "causal", "dv", Planted(post=scale(2, 1.01))),
            ("window off by one", "window", "o", Planted(kw=widen)),
            ("dK = 0", "causal", "dk", Planted(post=zero_dk)))
    load0, t0 = report.load_average(), time.perf_counter()
    lines = ["| bug | dtype | seqlen | output | rule 1: err / bound | rule 2: systematic / bound | band: err / band "
             "(not judged) | verdict | correct kernels' ratios (rule 1, rule 2) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for s in a.seqlens:
        heads, d = (2, 64) if s <= 256 else (1, 128)
        for dt in cases.DTYPES:
            good = {}
            for label, feature, out, cand in bugs:
                case = cases.feature_case(feature, s, d, dt, heads=heads)
                if feature not in good:
                    good[feature] = runner.run_case(case, runner.KernelCandidate())
                bad = runner.run_case(case, cand)
                o, g = bad["outputs"][out], good[feature]["outputs"][out]
                r1, r2 = ratios(o)
                g1, g2 = ratios(g)
                lines.append(f"| {label} | {dt} | {s} | {out} | {bold(r1, not o['max_abs'] <= o['bound'])} | "
                             f"{bold(r2, not o['proj_ok'])} | {o['max_abs'] / o['band_bound']:.2f} | "
                             f"{'caught' if not bad['pass'] else 'MISSED'} | {g1}, {g2} |")
                print(lines[-1], file=sys.stderr, flush=True)
            det = check_determinism(cases.feature_case("causal", s, d, dt, heads=heads), runs=3,
                                    candidate=jitter(), compare_lnc=False)
            lines.append(f"| 1-ulp jitter of dQ | {dt} | {s} | dq | determinism: {det['identical_runs']}/3 runs "
                         f"identical | - | - | {'caught' if not det['pass'] else 'MISSED'} | - |")
            print(lines[-1], file=sys.stderr, flush=True)
    m = report.machine_info()
    lines += ["", f"Measured by `python scripts/bench.py planted-bugs --write` on {m['cpu_model']} ({m['cpus']} CPUs, "
              f"Python {platform.python_version()}), {time.perf_counter() - t0:.0f} s at load average "
              f"{load0}-{report.load_average()}."]
    text = "\n".join(lines)
    print(text)
    if a.write:
        report.replace_marked_section(VALIDATION_DOC, "planted-bugs", text)
    return 0


# ----------------------------------------------------------------------------------------------------- sim-speed
def _load():
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


def _timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _matmul_act_loop_kernel():
    """The matmul loop's kernel, made on first use (numpy and the simulator load inside ``run_sim_speed``)."""
    from nki_attn.sim import isa as nisa
    from nki_attn.sim import jit
    from nki_attn.sim import language as nl

    @jit
    def matmul_act_loop(stat, mov, n_tiles):
        """stat [128, 128] bf16, mov [128, 512] bf16 in HBM; n_tiles matmul + activation pairs; returns the
        last."""
        out = nl.ndarray((128, 512), nl.bfloat16, buffer=nl.shared_hbm)
        s = nl.ndarray((128, 128), nl.bfloat16, buffer=nl.sbuf)
        m = nl.ndarray((128, 512), nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_copy(dst=s, src=stat)
        nisa.dma_copy(dst=m, src=mov)
        res = nl.ndarray((128, 512), nl.bfloat16, buffer=nl.sbuf)
        for _ in range(n_tiles):
            acc = nl.ndarray((128, 512), nl.float32, buffer=nl.psum)
            nisa.nc_matmul(dst=acc, stationary=s, moving=m)
            nisa.activation(dst=res, op=nl.exp, data=acc, scale=0.01)
        nisa.dma_copy(dst=out, src=res)
        return out
    return matmul_act_loop


def _numpy_loop(stat, mov, n_tiles):
    import ml_dtypes
    import numpy as np
    res = None
    for _ in range(n_tiles):
        acc = stat.astype(np.float32).T @ mov.astype(np.float32)
        res = np.exp(acc * np.float32(0.01)).astype(ml_dtypes.bfloat16)
    return res


def _sim_speed_matmul_loop(tiles, repeats):
    import ml_dtypes
    import numpy as np
    matmul_act_loop = _matmul_act_loop_kernel()
    rng = np.random.default_rng(0)
    stat = rng.standard_normal((128, 128)).astype(ml_dtypes.bfloat16)
    mov = rng.standard_normal((128, 512)).astype(ml_dtypes.bfloat16)
    sim_out = matmul_act_loop(stat, mov, tiles)
    assert np.array_equal(sim_out.astype(np.float32), _numpy_loop(stat, mov, 1).astype(np.float32)), \
        "simulator and numpy disagree"
    t_sim = best_of(lambda: matmul_act_loop(stat, mov, tiles), repeats)
    t_np = best_of(lambda: _numpy_loop(stat, mov, tiles), repeats)
    print(f"\nmatmul-loop: {tiles} x (128x128x512 bf16 nc_matmul + exp activation), best of {repeats}")
    print(f"  simulator {t_sim * 1e3:8.1f} ms ({t_sim / tiles * 1e6:.0f} us per pair)  load {_load():.1f}")
    print(f"  numpy     {t_np * 1e3:8.1f} ms ({t_np / tiles * 1e6:.0f} us per pair)  load {_load():.1f}")
    print(f"  ratio     {t_sim / t_np:8.2f}x")


def _sim_speed_kernels(seqlens, heads, head_dim, repeats):
    import ml_dtypes
    import numpy as np
    import torch
    import torch.nn.functional as F

    from golden.attention_bwd_torch import attention_bwd_torch_ref
    from golden.attention_fwd_torch import attention_fwd_torch_ref
    from nki_attn.kernels.attention_bwd import attention_bwd
    from nki_attn.kernels.attention_fwd import attention_fwd
    from nki_attn.sim import replay

    print(f"\nkernels: attention fwd+bwd, B=1 H={heads} D={head_dim} bf16 causal; best of {repeats}, sides "
          f"alternated; times in seconds (wall clock, CPU)")
    print(f"  {'seqlen':>6} | {'golden':>8} | {'SDPA':>8} | {'sim 1st':>8} | {'sim rep':>8} | {'rep/gold':>8} | "
          f"{'rep/SDPA':>8} | {'1st/rep':>7} | load (golden, SDPA, 1st, rep)")
    rows = []
    process_first = None
    for s in seqlens:
        rng = np.random.default_rng(s)
        shapes = {"q": (1, heads, head_dim, s), "k": (1, heads, head_dim, s), "v": (1, heads, head_dim, s),
                  "dy": (1, heads, head_dim, s)}
        npx = {n: rng.standard_normal(sh).astype(np.float32).astype(ml_dtypes.bfloat16) for n, sh in shapes.items()}
        tx = {n: torch.from_numpy(a.view(np.int16)).view(torch.bfloat16) for n, a in npx.items()}
        # SDPA takes [B, H, S, D]
        sq = {n: t.transpose(-1, -2).contiguous() for n, t in tx.items()}

        def simulated():
            o, lse = attention_fwd(npx["q"], npx["k"], npx["v"], use_causal_mask=True)
            return attention_bwd(npx["q"], npx["k"], npx["v"], o, npx["dy"], lse, use_causal_mask=True)

        def golden():
            o, lse = attention_fwd_torch_ref(tx["q"], tx["k"], tx["v"], use_causal_mask=True)
            return attention_bwd_torch_ref(tx["q"], tx["k"], tx["v"], o, tx["dy"], lse, use_causal_mask=True)

        def sdpa():
            q, k, v = (sq[n].detach().requires_grad_() for n in ("q", "k", "v"))
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            o.backward(sq["dy"])
            return q.grad, k.grad, v.grad

        golden()
        sdpa()
        t_gold, t_sdpa, t_first, t_rep = [], [], [], []
        l_gold = l_sdpa = l_first = l_rep = 0.0
        for _ in range(repeats):
            t_gold.append(_timed(golden))
            l_gold = _load()
            t_sdpa.append(_timed(sdpa))
            l_sdpa = _load()
            replay.clear()                  # the first call of the signature: a trace (recorded)
            t_first.append(_timed(simulated))
            l_first = _load()
            t_rep.append(_timed(simulated))  # a repeated call: a replay
            l_rep = _load()
        if process_first is None:  # the kernels' first call in this process: gathering and instrumenting too
            process_first = (s, t_first[0], t_rep[0])
        replayed = sum(r for _, r, _, _ in replay.info()[0]) > 0
        g, d, f, r = min(t_gold), min(t_sdpa), min(t_first), min(t_rep)
        note = "" if replayed else " (not replayed: " + "; ".join(sorted(set(replay.info()[1].values()))) + ")"
        print(f"  {s:>6} | {g:8.3f} | {d:8.3f} | {f:8.3f} | {r:8.3f} | {r / g:7.2f}x | {r / d:7.2f}x | "
              f"{f / r:6.2f}x | {l_gold:.1f}, {l_sdpa:.1f}, {l_first:.1f}, {l_rep:.1f}{note}", flush=True)
        rows.append((s, g, d, f, r))
    s, f, r = process_first
    print(f"  first call in the process (frontend gathering and instrumenting, then the trace) at seqlen {s}: "
          f"{f:.3f} s, {f / r:.1f}x the second call (target >= 5x: {_verdict(f / r, 5.0, below=False)})")
    for s, g, _, _, r in rows:
        if s == 2048:
            print(f"  seqlen 2048: replayed fwd+bwd {r / g:.2f}x the torch golden (target <= 1.0x: "
                  f"{_verdict(r / g, 1.0)})")
    return rows


LLAMA_TARGET = 3.0  # the issue's bound on the tiny-Llama step, nki_attn / sdpa, wall clock
LLAMA_MARGIN = 2.5  # what this benchmark aims at, so that load noise on another machine does not flip the verdict


def _verdict(value, target, margin=None, below=True):
    """PASS / FAIL of ``value`` against ``target`` (``below``: value <= target, else value >= target), and whether
    it also keeps the ``margin``."""
    ok = value <= target if below else value >= target
    text = "PASS" if ok else "FAIL"
    if ok and margin is not None:
        text += " (within the margin)" if (value <= margin if below else value >= margin) else \
            f" (outside the {margin:g}x margin)"
    return text


def _timed_both(fn):
    """(wall seconds, CPU seconds of this process) of one call."""
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def _sim_speed_llama(repeats, profile=None):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from nki_attn.integrations.transformers import register

    name = register()
    ids = torch.randint(0, 256, (1, 128), generator=torch.Generator().manual_seed(0))

    def build(impl):
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256)
        return LlamaForCausalLM._from_config(cfg, attn_implementation=impl)

    def step(m):
        m(input_ids=ids, labels=ids).loss.backward()
        m.zero_grad(set_to_none=True)

    models = {name: build(name), "sdpa": build("sdpa")}
    first = {}
    for impl, m in models.items():
        first[impl] = (_timed(lambda: step(m)), _load())
    wall = {impl: [] for impl in models}
    cpu = {impl: [] for impl in models}
    loads = {impl: [] for impl in models}
    for _ in range(repeats):
        for impl, m in models.items():
            w, c = _timed_both(lambda: step(m))
            wall[impl].append(w)
            cpu[impl].append(c)
            loads[impl].append(_load())
    n, s = min(wall[name]), min(wall["sdpa"])
    nc, sc = min(cpu[name]), min(cpu["sdpa"])
    lo = min(min(v) for v in loads.values())
    hi = max(max(v) for v in loads.values())
    print(f"\nllama: one training step, 2 layers, hidden 64, 4 heads, 128 tokens, float32; best of {repeats}, "
          f"sides alternated (torch {torch.get_num_threads()} threads); wall clock and this process's CPU time")
    print(f"  sdpa     step {s * 1e3:8.1f} ms wall  {sc * 1e3:6.1f} ms CPU  load {loads['sdpa'][-1]:.1f}   "
          f"(first step {first['sdpa'][0] * 1e3:.1f} ms)")
    print(f"  nki_attn step {n * 1e3:8.1f} ms wall  {nc * 1e3:6.1f} ms CPU  load {loads[name][-1]:.1f}   "
          f"(first step {first[name][0] * 1e3:.1f} ms, load {first[name][1]:.1f}: {first[name][0] / n:.1f}x the "
          f"steady step)")
    print(f"  ratio nki_attn / sdpa: {n / s:.2f}x wall, {nc / sc:.2f}x CPU (load {lo:.1f}-{hi:.1f} during the steps)")
    print(f"  target <= {LLAMA_TARGET:g}x, aim <= {LLAMA_MARGIN:g}x: wall "
          f"{_verdict(n / s, LLAMA_TARGET, LLAMA_MARGIN)}; CPU {_verdict(nc / sc, LLAMA_TARGET, LLAMA_MARGIN)}")
    if profile:
        import cProfile
        import pstats
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(repeats):
            step(models[name])
        prof.disable()
        prof.dump_stats(profile)
        print(f"\ncProfile of {repeats} nki_attn steps -> {profile}")
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)
    return n, s


def _sim_speed_replay_loop(repeats):
    """The programs the llama steps recorded, replayed on their own in a loop: CPU time per replay of each (best of
    ``repeats``) and per instruction kind (each step timed alone, best of 30)."""
    import collections

    import numpy as np

    from nki_attn.sim import context, replay
    from nki_attn.sim import ops as sim_ops
    progs = [(getattr(k[0], "__name__", "?"), p) for k, p in replay._PROGRAMS.items()]
    print(f"\nreplay loop: the {len(progs)} recorded programs replayed outside the model (CPU time, best of "
          f"{repeats})")
    total = 0.0
    for name, p in progs:
        arrays = [np.array(t.np()) for t in p.args]
        best = float("inf")
        for _ in range(repeats):
            c0 = time.process_time()
            p.run(arrays)
            best = min(best, time.process_time() - c0)
        total += best
        print(f"  {name}: {len(p.steps)} steps ({p.n_instr} instructions, "
              f"{p.n_fast} compiled; {len(p.storages)} storages, {len(p.quiet)} never refilled; "
              f"{p.bytes / 2**20:.2f} MiB): {best * 1e3:.3f} ms")
    print(f"  all programs once: {total * 1e3:.3f} ms  load {_load():.1f}")
    per = collections.defaultdict(float)
    count = collections.Counter()
    for _, p in progs:
        core = context.current()
        core.scalar_acc, core.vector_acc = p.scalar_acc, p.vector_acc
        sim_ops.REPLAY.on = True
        try:
            with np.errstate(all="ignore"):
                for step in p.steps:
                    fn = getattr(step, "func", None)
                    kind = getattr(fn, "__name__", None) or step.__qualname__.split(".")[0].strip("_") + \
                        " (compiled)"
                    best = float("inf")
                    for _ in range(30):
                        c0 = time.perf_counter()
                        step()
                        best = min(best, time.perf_counter() - c0)
                    per[kind] += best
                    count[kind] += 1
        finally:
            sim_ops.REPLAY.on = False
    print(f"  per step kind, each step alone (wall, best of 30): {sum(per.values()) * 1e3:.3f} ms in all")
    for kind, t in sorted(per.items(), key=lambda kv: -kv[1]):
        print(f"    {kind:32s} {count[kind]:4d} x {t / count[kind] * 1e6:7.1f} us = {t * 1e6:7.0f} us")


def args_sim_speed(p):
    p.add_argument("--seqlens", default="512,2048,8192", help="comma-separated sequence lengths (kernels)")
    p.add_argument("--heads", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip-kernels", action="store_true")
    p.add_argument("--skip-llama", action="store_true")
    p.add_argument("--matmul-tiles", type=int, default=0, help="also run the matmul loop with this many tiles")
    p.add_argument("--profile-llama", metavar="F", help="cProfile nki_attn llama steps into F")
    p.add_argument("--replay-loop", type=int, default=0, metavar="N",
                   help="after the llama steps, replay their recorded programs alone, best of N (CPU per program, "
                        "time per step kind)")
    p.add_argument("--torch-threads", type=int, default=None,
                   help="torch.set_num_threads (default: torch's own; the simulator runs numpy single-threaded)")


def run_sim_speed(a):
    """The simulator's speed: simulated kernels and a tiny Hugging Face model against torch on the same CPU.

Wall-clock CPU times (nothing here is a device time). Every figure is printed with the 1-minute load average read
right after it, and each ratio is taken from figures of the same run, sides alternated, best of --repeats:

1. kernels: simulated attention_fwd + attention_bwd (bf16, causal, batch 1) against the torch golden forward +
   backward (golden/) and against torch SDPA forward + backward on CPU, at each --seqlens. The simulated figure
   is given twice: the first call of a signature (the kernel body runs: a trace, recorded) and a repeated call (a
   replay of the recording, nki_attn.sim.replay; when the signature is not replayable, a second trace, and the
   row says why), with their ratio; PASS / FAIL for the replayed call at 2048 tokens against the golden (<= 1x)
   and for the first call in the process against the second (>= 5x).
2. llama: one training step (forward, loss, backward) of a 2-layer, 64-hidden Llama (4 heads, 128 tokens) built
   from a config with attn_implementation="nki_attn" against "sdpa"; the first nki_attn step (traces) and the
   steady one (replays), wall clock and the process's CPU time (which a loaded machine distorts less: a long
   step is preempted more often than a short one), each ratio with PASS / FAIL against the target (3x) and
   whether it keeps the 2.5x margin.
   With --replay-loop N, the programs those steps recorded are then replayed alone: CPU time per program (best of
   N) and per step kind (compiled steps, instructions, refills).
3. matmul-loop (--matmul-tiles N): the per-instruction overhead of the simulator, N x (128x128x512 bf16
   nc_matmul + one exp activation) simulated vs the same arithmetic in plain numpy.
"""
    import platform

    import numpy as np
    import torch
    if a.torch_threads:
        torch.set_num_threads(a.torch_threads)
    print(f"machine: {os.cpu_count()} CPUs, python {platform.python_version()}, numpy {np.__version__}, torch "
          f"{torch.__version__} ({torch.get_num_threads()} threads); NKI_ATTN_SIM_REPLAY="
          f"{os.environ.get('NKI_ATTN_SIM_REPLAY', 'unset (on)')}; load {_load():.1f}")
    if not a.skip_kernels:
        _sim_speed_kernels([int(s) for s in a.seqlens.split(",") if s], a.heads, a.head_dim, a.repeats)
    if not a.skip_llama:
        _sim_speed_llama(a.repeats, a.profile_llama)
        if a.replay_loop:
            _sim_speed_replay_loop(a.replay_loop)
    if a.matmul_tiles:
        _sim_speed_matmul_loop(a.matmul_tiles, a.repeats)
    return 0


# ----------------------------------------------------------------------------------------------------- block-mask cost
def args_block_mask_cost(p):
    p.add_argument("--seqlen", type=int, default=16384, help="tokens (queries = keys)")
    p.add_argument("--heads", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--docs", type=int, default=8, help="equal documents of the document mask")
    p.add_argument("--density", type=float, default=0.5, help="fraction of FULL blocks of the random block masks")
    p.add_argument("--target", default="trn2", choices=("trn1", "trn2", "trn3"))
    p.add_argument("--kernels", default="fwd,bwd", help="comma-separated: fwd, bwd")
    p.add_argument("--masks", default="unmasked,document,document-causal,random-128x128,random-128x512",
                   help="comma-separated mask names (unmasked first: the baseline)")
    p.add_argument("--json", metavar="F")


def _block_mask_masks(s, docs, density):
    """name -> (mask_mod or None, description): the unmasked baseline, the document mask, random block masks."""
    import torch

    from nki_attn import masks
    ids = torch.arange(s) // (s // docs)
    g = torch.Generator().manual_seed(0)
    n = s // 128
    blocks128 = torch.rand(n, n, generator=g) < density
    # the same density drawn per 128 queries x 512 keys (the kernels' key tile), so skipped blocks are whole tiles
    blocks512 = (torch.rand(n, -(-n // 4), generator=g) < density).repeat_interleave(4, 1)[:, :n]

    def random128(b, h, q, kv):
        return blocks128[q // 128, kv // 128]

    def random512(b, h, q, kv):
        return blocks512[q // 128, kv // 128]
    return {
        "unmasked": (None, "no mask"),
        "document": (masks.document(ids), f"{docs} equal documents"),
        "document-causal": (masks.and_masks(masks.causal_mask, masks.document(ids)),
                            f"{docs} equal documents, causal (packed causal sequences)"),
        "random-128x128": (random128, f"random {density:.0%}-dense FULL/SKIP blocks of 128x128"),
        "random-128x512": (random512, f"random {density:.0%}-dense FULL/SKIP blocks of 128 queries x 512 keys"),
    }


def run_block_mask_cost(a):
    """modeled time of block-masked attention (document, random block-sparse) against the unmasked kernels"""
    import torch

    from nki_attn import kernel_api
    from nki_attn.block_mask import create_block_mask
    from nki_attn.profiler import generation, profile
    from nki_attn.sim.benchmark import run_benchmark
    s, h, d = a.seqlen, a.heads, a.head_dim
    kernels = a.kernels.split(",")
    x = kernel_inputs(1, h, h, s, d, dtype="bfloat16")
    o = lse = None
    rows = []
    all_masks = _block_mask_masks(s, a.docs, a.density)
    for name in a.masks.split(","):
        mm, what = all_masks[name]
        kw = {}
        if mm is not None:
            t0 = time.perf_counter()
            bm = create_block_mask(mm, None, None, s, s)
            build = time.perf_counter() - t0
            blk, store = bm.kernel_operands()
            kw = dict(block_mask=blk, block_bits=store)
            counts = bm.counts()
            print(bm.to_string(grid_size=(16, 16), limit=1), flush=True)
        else:
            build, counts = 0.0, None
        row = {"mask": name, "what": what, "blocks": counts, "build_s": build}
        for kernel in kernels:
            with target(a.target):
                if kernel == "fwd":
                    call, fn, kk = (x["q"], x["k"], x["v"]), kernel_api.attention_fwd, kw
                else:
                    if o is None:
                        o, lse = kernel_api.attention_fwd(x["q"], x["k"], x["v"])
                        o, lse = torch.as_tensor(o), torch.as_tensor(lse)
                    call, fn = (x["q"], x["k"], x["v"], o, x["dy"], lse), kernel_api.attention_bwd
                    kk = dict(kw, mixed_precision=True)
                t0 = time.perf_counter()
                _, res = run_benchmark(fn, call, kk, warmup=0, iters=1)
                wall = time.perf_counter() - t0
            p = profile(res.records, generation(a.target))
            row[kernel] = {"time_us": p.time_ns / 1e3, "instructions": len(res.records), "sim_wall_s": wall}
            print(f"{name:16s} {kernel}: {p.time_ns / 1e3:10.1f} us modeled ({len(res.records)} instructions, "
                  f"simulated in {wall:.0f} s)", flush=True)
        rows.append(row)
    base = rows[0]
    print(f"\nModeled time (cost model v2, scheduled, {a.target}), B=1 H={h} S={s} D={d} bf16, relative to "
          f"{base['mask']}:")
    print("| mask | blocks full / partial / skip | " + " | ".join(f"{k} us | {k} / {base['mask']}" for k in kernels)
          + " |")
    print("|---|---|" + "---|---|" * len(kernels))
    for r in rows:
        c = r["blocks"]
        cells = [f"{c['full']} / {c['partial']} / {c['skip']}" if c else "-"]
        for k in kernels:
            r[k]["ratio"] = r[k]["time_us"] / base[k]["time_us"]
            cells += [f"{r[k]['time_us']:.1f}", f"{r[k]['ratio']:.3f}"]
        print(f"| {r['mask']} ({r['what']}) | " + " | ".join(cells) + " |")
    _write_json(a.json, {"target": a.target, "shape": dict(batch=1, heads=h, seqlen=s, head_dim=d, dtype="bf16"),
                         "kernels": kernel_versions(), "rows": rows})
    return 0


# ----------------------------------------------------------------------------------------------------- main
COMMANDS = {
    "compile": (args_compile, run_compile),
    "frontend-overhead": (args_frontend_overhead, run_frontend_overhead),
    "sim-overhead": (args_sim_overhead, run_sim_overhead),
    "modeled-util": (args_modeled_util, run_modeled_util),
    "dropout-cost": (args_dropout_cost, run_dropout_cost),
    "dropout-stats": (args_dropout_stats, run_dropout_stats),
    "blas-orders": (args_blas_orders, run_blas_orders),
    "planted-bugs": (args_planted_bugs, run_planted_bugs),
    "sim-speed": (args_sim_speed, run_sim_speed),
    "block-mask-cost": (args_block_mask_cost, run_block_mask_cost),
}


def _blas_threads_first(argv):
    """numpy's OpenBLAS reads OPENBLAS_NUM_THREADS once, when numpy is first imported: apply --blas-threads
    before anything imports numpy (torch, which uses MKL/OpenMP, is not affected)."""
    for i, arg in enumerate(argv):
        if arg == "--blas-threads" and i + 1 < len(argv):
            os.environ["OPENBLAS_NUM_THREADS"] = argv[i + 1]
        elif arg.startswith("--blas-threads="):
            os.environ["OPENBLAS_NUM_THREADS"] = arg.split("=", 1)[1]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    _blas_threads_first(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n")[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (add, run) in COMMANDS.items():
        doc = run.__doc__ or ""
        p = sub.add_parser(name, help=doc.split("\n")[0], description=doc,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        add(p)
        p.set_defaults(run=run)
    a = ap.parse_args(argv)
    return a.run(a) or 0


if __name__ == "__main__":
    sys.exit(main())
