"""Simulator speed: the simulated attention kernels against torch on the same CPU, and a tiny Hugging Face model.

Wall-clock CPU times (nothing here is a device time). Every figure is printed with the 1-minute load average read
right after it, and each ratio is taken from figures of the same run, sides alternated, best of ``--repeats``:

1. ``kernels``: simulated ``attention_fwd`` + ``attention_bwd`` (bf16, causal, batch 1) against the torch golden
   forward + backward (``golden/``) and against torch SDPA forward + backward on CPU, at each ``--seqlens``. The
   simulated figure is given twice: the first call of a signature (the kernel body runs: a trace, recorded) and a
   repeated call (a replay of the recording, ``nki_attn.sim.replay``; when the signature is not replayable, a
   second trace, and the row says why), with their ratio.
2. ``llama``: one training step (forward, loss, backward) of a 2-layer, 64-hidden Llama (4 heads, 128 tokens)
   built from a config with ``attn_implementation="nki_attn"`` against ``"sdpa"``; the first nki_attn step (traces)
   and the steady one (replays).
3. ``matmul-loop`` (``--matmul-tiles N``): the per-instruction overhead of the simulator, N x (128x128x512 bf16
   nc_matmul + one exp activation) simulated vs the same arithmetic in plain numpy.

    python scripts/bench_sim_speed.py [--seqlens 512,2048,8192] [--heads 1] [--head-dim 128] [--repeats 3]
                                      [--skip-kernels] [--skip-llama] [--matmul-tiles 200] [--profile-llama F]
                                      [--torch-threads N]
"""
import argparse
import os
import platform
import sys
import time

import ml_dtypes
import numpy as np

from nki_attn.sim import isa as nisa
from nki_attn.sim import jit
from nki_attn.sim import language as nl

BF16 = ml_dtypes.bfloat16


def load():
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


def best_of(fn, repeats):
    """The best wall time of ``repeats`` calls of ``fn`` (seconds)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# ----------------------------------------------------------------------------------------------------- matmul loop
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


def bench_matmul_loop(tiles, repeats):
    rng = np.random.default_rng(0)
    stat = rng.standard_normal((128, 128)).astype(BF16)
    mov = rng.standard_normal((128, 512)).astype(BF16)
    sim_out = matmul_act_loop(stat, mov, tiles)
    assert np.array_equal(sim_out.astype(np.float32), numpy_loop(stat, mov, 1).astype(np.float32)), \
        "simulator and numpy disagree"
    t_sim = best_of(lambda: matmul_act_loop(stat, mov, tiles), repeats)
    t_np = best_of(lambda: numpy_loop(stat, mov, tiles), repeats)
    print(f"\nmatmul-loop: {tiles} x (128x128x512 bf16 nc_matmul + exp activation), best of {repeats}")
    print(f"  simulator {t_sim * 1e3:8.1f} ms ({t_sim / tiles * 1e6:.0f} us per pair)  load {load():.1f}")
    print(f"  numpy     {t_np * 1e3:8.1f} ms ({t_np / tiles * 1e6:.0f} us per pair)  load {load():.1f}")
    print(f"  ratio     {t_sim / t_np:8.2f}x")


# ----------------------------------------------------------------------------------------------------- kernels
def bench_kernels(seqlens, heads, head_dim, repeats):
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
        npx = {n: rng.standard_normal(sh).astype(np.float32).astype(BF16) for n, sh in shapes.items()}
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
            t_gold.append(timed(golden))
            l_gold = load()
            t_sdpa.append(timed(sdpa))
            l_sdpa = load()
            replay.clear()                  # the first call of the signature: a trace (recorded)
            t_first.append(timed(simulated))
            l_first = load()
            t_rep.append(timed(simulated))  # a repeated call: a replay
            l_rep = load()
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
          f"{f:.3f} s, {f / r:.1f}x the second call")
    return rows


# ----------------------------------------------------------------------------------------------------- llama
def bench_llama(repeats, profile=None):
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
        first[impl] = (timed(lambda: step(m)), load())
    times = {impl: [] for impl in models}
    loads = {}
    for _ in range(repeats):
        for impl, m in models.items():
            times[impl].append(timed(lambda: step(m)))
            loads[impl] = load()
    n, s = min(times[name]), min(times["sdpa"])
    print(f"\nllama: one training step, 2 layers, hidden 64, 4 heads, 128 tokens, float32; best of {repeats}, "
          f"sides alternated (torch {torch.get_num_threads()} threads)")
    print(f"  sdpa     step {s * 1e3:8.1f} ms  load {loads['sdpa']:.1f}   (first step {first['sdpa'][0] * 1e3:.1f} ms)")
    print(f"  nki_attn step {n * 1e3:8.1f} ms  load {loads[name]:.1f}   (first step {first[name][0] * 1e3:.1f} ms, "
          f"load {first[name][1]:.1f}: {first[name][0] / n:.1f}x the steady step)")
    print(f"  ratio nki_attn / sdpa: {n / s:.2f}x")
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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlens", default="512,2048,8192", help="comma-separated sequence lengths (kernels)")
    ap.add_argument("--heads", type=int, default=1)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-kernels", action="store_true")
    ap.add_argument("--skip-llama", action="store_true")
    ap.add_argument("--matmul-tiles", type=int, default=0, help="also run the matmul loop with this many tiles")
    ap.add_argument("--profile-llama", metavar="F", help="cProfile nki_attn llama steps into F")
    ap.add_argument("--torch-threads", type=int, default=None,
                    help="torch.set_num_threads (default: torch's own; the simulator runs numpy single-threaded)")
    args = ap.parse_args(argv)
    import torch
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    print(f"machine: {os.cpu_count()} CPUs, python {platform.python_version()}, numpy {np.__version__}, torch "
          f"{torch.__version__} ({torch.get_num_threads()} threads); NKI_ATTN_SIM_REPLAY="
          f"{os.environ.get('NKI_ATTN_SIM_REPLAY', 'unset (on)')}; load {load():.1f}")
    if not args.skip_kernels:
        bench_kernels([int(s) for s in args.seqlens.split(",") if s], args.heads, args.head_dim, args.repeats)
    if not args.skip_llama:
        bench_llama(args.repeats, args.profile_llama)
    if args.matmul_tiles:
        bench_matmul_loop(args.matmul_tiles, args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
