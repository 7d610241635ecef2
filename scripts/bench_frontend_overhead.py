"""Cost of the simulator's NKI frontend check (nki_attn.sim.frontend) on the project's kernels.

Three numbers per shape, for attention_fwd followed by attention_bwd (bf16, causal):

- first call: gathering (parse + rule checks of every function the kernels reach) and compiling the instrumented
  copies, paid once per kernel function and process;
- per launch: the frontend's own work before a launch (argument and global checks, code swap), timed directly;
- the tracing checks: how many checked subscripts / isinstance calls one fwd + bwd pair makes, times the cost of
  one check call (measured on its own): an estimate that does not depend on the load of the machine;
- whole launches with the check off / gather-only / full (the tracing checks run inside the kernels), CPU time,
  runs alternated between the modes so that a load change on the machine hits all three alike (best and median
  of the repeats; on a shared machine the medians move by more than the overhead).

    python scripts/bench_frontend_overhead.py [--repeats 5] [--shapes 1x256x64,4x1024x128]

Shapes are HEADSxSEQLENxD_HEAD (batch 1, nheads_kv 1). The simulator, not the hardware, is what is timed.
"""
import argparse
import os
import statistics
import time

import ml_dtypes
import numpy as np

from nki_attn.sim import checking, frontend

# Every launch here must run the kernel body (a trace): a replayed launch runs no frontend check at all.
os.environ["NKI_ATTN_SIM_REPLAY"] = "0"


def _inputs(h, s, d, seed=0):
    rng = np.random.default_rng(seed)

    def draw(*shape):
        return rng.standard_normal(shape).astype(np.float32).astype(ml_dtypes.bfloat16)
    return draw(1, h, d, s), draw(1, 1, d, s), draw(1, 1, d, s), draw(1, h, d, s)


def _pair(fwd, bwd, x):
    q, k, v, dy = x
    o, lse = fwd(q, k, v, use_causal_mask=True)
    return bwd(q, k, v, o, dy, lse, use_causal_mask=True, mixed_precision=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--shapes", default="1x256x64,4x1024x128")
    args = ap.parse_args()

    t0 = time.process_time()
    from nki_attn.kernels.attention_bwd import attention_bwd
    from nki_attn.kernels.attention_fwd import attention_fwd
    t_import = time.process_time() - t0
    t0 = time.process_time()
    for k in (attention_fwd, attention_bwd):
        g = frontend.check_kernel(k)
        for info in g.functions:
            frontend.instrumented_code(info)
    t_first = time.process_time() - t0
    n_defs = sum(len(frontend.gather(k).definitions) for k in (attention_fwd, attention_bwd))
    n_fns = sum(len(frontend.gather(k).functions) for k in (attention_fwd, attention_bwd))
    print(f"first call (gather {n_defs} definitions, instrument {n_fns} functions, both kernels): "
          f"{1e3 * t_first:.1f} ms CPU (importing the kernels: {1e3 * t_import:.1f} ms)")

    x = _inputs(1, 256, 64)
    q, k, v, _ = x
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        with frontend.prepare(attention_fwd.fn, (q, k, v), {"use_causal_mask": True}):
            pass
    per = (time.perf_counter() - t0) / n
    print(f"per launch, frontend work before the kernel runs (prepare + code swap): {1e6 * per:.0f} us")

    # one check call, on the commonest operand (a tensor indexed by a tuple)
    checks = frontend._CHECKS
    t = _Probe()
    n = 200000
    t0 = time.perf_counter()
    for _ in range(n):
        checks.sub(t, (0, 1), 0)
    per_check = (time.perf_counter() - t0) / n - _bare(t, n)
    print(f"one tracing check (beyond the subscript itself): {1e9 * per_check:.0f} ns")

    print("\n| shape (heads x seqlen x d_head) | checks per pair | estimate | off | gather | full | full / off |")
    print("|---|---|---|---|---|---|---|")
    for spec in args.shapes.split(","):
        h, s, d = (int(p) for p in spec.lower().split("x"))
        x = _inputs(h, s, d)
        calls = _count_checks(lambda: _pair(attention_fwd, attention_bwd, x))
        times = {"off": [], "gather": [], "full": []}
        for mode in times:  # warm-up: caches, first-call costs
            with checking(frontend=mode):
                _pair(attention_fwd, attention_bwd, x)
        for _ in range(args.repeats):
            for mode in times:
                with checking(frontend=mode):
                    t0 = time.process_time()
                    _pair(attention_fwd, attention_bwd, x)
                    times[mode].append(time.process_time() - t0)
        best = {m: min(v) for m, v in times.items()}
        med = {m: statistics.median(v) for m, v in times.items()}
        est = calls * per_check + 2 * per
        print(f"| {h}x{s}x{d} | {calls} | {1e3 * est:.2f} ms ({100 * est / best['off']:.2f} %) | "
              + " | ".join(f"{best[m]:.3f} / {med[m]:.3f} s" for m in ("off", "gather", "full"))
              + f" | {best['full'] / best['off']:.3f} / {med['full'] / med['off']:.3f} |")
    print(f"\n(CPU seconds of attention_fwd + attention_bwd, bf16, causal: best / median of {args.repeats} alternated "
          f"runs; estimate = checks x one check + 2 x the per-launch work, as a share of the best run without the "
          f"check)")


class _Probe:
    def __getitem__(self, k):
        return k


def _bare(t, n):
    """Seconds per plain subscript of ``t`` (subtracted from the check's time)."""
    t0 = time.perf_counter()
    for _ in range(n):
        t[(0, 1)]
    return (time.perf_counter() - t0) / n


def _count_checks(run):
    """Tracing-check calls (subscripts, item stores, builtins, attributes, operators, 'in') made by ``run()`` in
    full mode."""
    counts = [0]
    saved = {n: getattr(frontend._Checks, n) for n in ("sub", "key", "bi", "attr", "binop", "contains")}

    def counting(fn):
        def wrapper(*args, **kwargs):
            counts[0] += 1
            return fn(*args, **kwargs)
        return staticmethod(wrapper)
    try:
        for n, f in saved.items():
            setattr(frontend._Checks, n, counting(f))
        with checking(frontend="full"):
            run()
    finally:
        for n, f in saved.items():
            setattr(frontend._Checks, n, staticmethod(f))
    return counts[0]


if __name__ == "__main__":
    main()
