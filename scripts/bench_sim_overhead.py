"""Simulator overhead: wall time of the simulated attention_fwd + attention_bwd against the torch golden forward +
backward on the same CPU, same shape, in one process.

Default shape (issue #9): batch 1, 4 heads, seqlen 2048, d_head 128, bf16, causal. The golden computes the full
score matrix with torch BLAS calls; the simulator runs the kernels instruction by instruction in numpy. Target:
simulated / golden <= 3x.

    python scripts/bench_sim_overhead.py [--seqlen 2048] [--heads 4] [--repeats 3] [--blas-threads 1]
                                         [--profile out.prof]

``--profile F`` also runs the simulated pair once under cProfile and writes the stats to F, then prints the 25
most expensive functions (by own time) and the per-instruction totals.
"""
import argparse
import os
import platform
import sys


def _blas_threads_from_argv():
    # numpy's OpenBLAS reads OPENBLAS_NUM_THREADS once, when numpy is first imported, so --blas-threads must be
    # applied before the imports below (it does not touch torch, which uses MKL/OpenMP).
    for i, a in enumerate(sys.argv):
        if a == "--blas-threads" and i + 1 < len(sys.argv):
            os.environ["OPENBLAS_NUM_THREADS"] = sys.argv[i + 1]
        elif a.startswith("--blas-threads="):
            os.environ["OPENBLAS_NUM_THREADS"] = a.split("=", 1)[1]


_blas_threads_from_argv()

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from golden.attention_bwd_torch import attention_bwd_torch_ref  # noqa: E402
from golden.attention_fwd_torch import attention_fwd_torch_ref  # noqa: E402
from nki_attn.kernels.attention_bwd import attention_bwd  # noqa: E402
from nki_attn.kernels.attention_fwd import attention_fwd  # noqa: E402
from bench_sim_speed import best_of  # noqa: E402 - the sibling script in scripts/


from nki_attn.harness.report import cpu_model  # noqa: E402


def make_inputs(b, h, hkv, s, d, seed=0):
    """bf16 q, k, v, dy in the kernel layout, as numpy (for the kernels) and torch (for the golden)."""
    rng = np.random.default_rng(seed)
    arrs = {"q": (b, h, d, s), "k": (b, hkv, d, s), "v": (b, hkv, d, s), "dy": (b, h, d, s)}
    npx = {n: rng.standard_normal(shape).astype(np.float32).astype(ml_dtypes.bfloat16) for n, shape in arrs.items()}
    tx = {n: torch.from_numpy(a.view(np.int16)).view(torch.bfloat16) for n, a in npx.items()}
    return npx, tx


def simulated(npx, causal):
    o, lse = attention_fwd(npx["q"], npx["k"], npx["v"], use_causal_mask=causal)
    return attention_bwd(npx["q"], npx["k"], npx["v"], o, npx["dy"], lse, use_causal_mask=causal)


def golden(tx, causal):
    o, lse = attention_fwd_torch_ref(tx["q"], tx["k"], tx["v"], use_causal_mask=causal)
    return attention_bwd_torch_ref(tx["q"], tx["k"], tx["v"], o, tx["dy"], lse, use_causal_mask=causal)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=None)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--non-causal", action="store_true")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of each side, alternating; the best counts")
    ap.add_argument("--profile", metavar="F", help="also cProfile one simulated run into F")
    ap.add_argument("--blas-threads", type=int, default=None,
                    help="set OPENBLAS_NUM_THREADS for numpy (the simulator's matmuls) before importing it")
    args = ap.parse_args()
    hkv = args.kv_heads or args.heads
    causal = not args.non_causal
    npx, tx = make_inputs(args.batch, args.heads, hkv, args.seqlen, args.head_dim)

    # Warm-up: imports, numpy/torch thread pools, first-call caches, on both sides.
    golden(tx, causal)
    simulated(npx, causal)
    # Alternate the two sides so a change in machine load hits both alike; keep the best of each.
    gold, sim = [], []
    for _ in range(args.repeats):
        gold.append(best_of(lambda: golden(tx, causal), 1))
        sim.append(best_of(lambda: simulated(npx, causal), 1))
    t_gold, t_sim = min(gold), min(sim)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")

    print(f"machine: {os.cpu_count()} CPUs ({cpu_model()}), torch {torch.__version__} "
          f"({torch.get_num_threads()} threads), numpy {np.__version__} "
          f"(OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}), "
          f"python {platform.python_version()}")
    print(f"shape: B={args.batch} H={args.heads} HKV={hkv} S={args.seqlen} D={args.head_dim} bf16 "
          f"{'causal' if causal else 'non-causal'}; best of {args.repeats} alternating runs; "
          f"1-min load average {load:.1f}")
    print(f"torch golden fwd+bwd:    {t_gold:8.2f} s  (runs: {', '.join(f'{t:.2f}' for t in gold)})")
    print(f"simulated kernels f+b:   {t_sim:8.2f} s  (runs: {', '.join(f'{t:.2f}' for t in sim)})")
    print(f"ratio simulated/golden:  {t_sim / t_gold:8.2f}x  (target <= 3x)")

    if args.profile:
        import cProfile
        import pstats
        from collections import Counter

        from nki_attn.sim import trace
        prof = cProfile.Profile()
        with trace.recording() as rec:
            prof.enable()
            simulated(npx, causal)
            prof.disable()
        prof.dump_stats(args.profile)
        print(f"\ncProfile of one simulated fwd+bwd (traced) -> {args.profile}")
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        print("instructions executed:", dict(Counter(r.instr for r in rec.records).most_common()))


if __name__ == "__main__":
    main()
