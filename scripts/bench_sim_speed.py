"""Simulator speed: a loop of 128x128x512 bf16 matmuls plus one activation per tile, simulated vs plain numpy.

Both sides do the same arithmetic (bf16 operands widened to fp32, fp32 matmul, exp, round to bf16); the ratio
is the simulator's per-instruction overhead (checks, views, rounding, bookkeeping) over the bare numpy work.

    python scripts/bench_sim_speed.py [--tiles 200] [--repeats 3]
"""
import argparse
import time

import ml_dtypes
import numpy as np

from nki_attn.sim import isa as nisa
from nki_attn.sim import jit
from nki_attn.sim import language as nl

BF16 = ml_dtypes.bfloat16


@jit
def matmul_act_loop(stat, mov, n_tiles):
    """stat [128, 128] bf16, mov [128, 512] bf16 in HBM; n_tiles matmul + activation pairs; returns the last."""
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


def numpy_loop(stat, mov, n_tiles):
    res = None
    for _ in range(n_tiles):
        acc = stat.astype(np.float32).T @ mov.astype(np.float32)
        res = np.exp(acc * np.float32(0.01)).astype(BF16)
    return res


def best_of(fn, repeats):
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiles", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    stat = rng.standard_normal((128, 128)).astype(BF16)
    mov = rng.standard_normal((128, 512)).astype(BF16)
    sim_out = matmul_act_loop(stat, mov, args.tiles)
    np_out = numpy_loop(stat, mov, 1)
    assert np.array_equal(sim_out.astype(np.float32), np_out.astype(np.float32)), "simulator and numpy disagree"
    t_sim = best_of(lambda: matmul_act_loop(stat, mov, args.tiles), args.repeats)
    t_np = best_of(lambda: numpy_loop(stat, mov, args.tiles), args.repeats)
    per = t_sim / args.tiles * 1e6
    print(f"{args.tiles} x (128x128x512 bf16 nc_matmul + exp activation), best of {args.repeats}")
    print(f"simulator {t_sim * 1e3:8.1f} ms  ({per:.0f} us per matmul+activation pair)")
    print(f"numpy     {t_np * 1e3:8.1f} ms  ({t_np / args.tiles * 1e6:.0f} us per pair)")
    print(f"ratio     {t_sim / t_np:8.2f}x")


if __name__ == "__main__":
    main()
