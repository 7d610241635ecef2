"""Modeled cost of attention dropout per [128 x 512] score tile: the counter hash (nki_attn/kernels/dropout.py)
versus the hardware random generator (nki.isa rand_set_state + rng, XORWOW), under the same cost model.

Every figure is MODELED by nki_attn.profiler (cost model over the simulator's instruction trace), not measured.

Counter hash: the real tile step runs on the simulator and its trace is profiled, stage by stage:
  seed     load_dropout_seed (once per kernel call)
  rows     dropout_row_keys (once per 128 query rows and 65536-key block; can be hoisted out of the key loop)
  tile     dropout_scale_keys (per [128 x 512] tile)
Hardware generator (estimate): the simulator has no rand_set_state/rng, so the script traces stand-in
instructions with the same engine, operand shapes and dtypes, which the cost model prices by the same rules:
  reseed   the per-lane XORWOW state (6 uint32 words per lane on GpSimdE) must be a hash of (seed, b, h, tile):
           the same four mixing rounds as our row words, on a [128, 6] tile (small tiles cost the minimum
           instruction time whatever their width, so the stage costs what "rows" costs), once per tile, or once
           per 128 rows when all the row's tiles are reseeded from one [128, 6 x tiles] state block
  set      rand_set_state: one GpSimdE instruction on [128, 6] (stand-in: a GpSimdE tensor_copy of that shape)
  rng      rng into a uint32 [128, 512] tile: one VectorE instruction with no tensor input (stand-in: a VectorE
           memset of that tile, which the model prices identically)
  decide   16 random bits and the keep/scale decision: the same two tensor_scalar instructions as the hash

    python scripts/dropout_cost.py [--target trn2] [--tiles 8] [--no-context]

``--tiles``: key tiles per 128 query rows for the amortized figures (seqlen_k / 512). ``--no-context`` skips
the attention forward profile used to put the figures in proportion.
"""
import argparse
import os
import time
from types import SimpleNamespace

import numpy as np

from nki_attn.backend import nisa, nki, nl
from nki_attn.kernels import dropout as kd
from nki_attn.profiler import generation, profile
from nki_attn.sim import trace

ENGINES = ("VectorE", "GpSimdE", "ScalarE", "TensorE", "DMA")
P, COLS = 128, 512


@nki.jit
def _seed_only(dropout_seed):
    out = nl.ndarray((P, 2), dtype=nl.uint32, buffer=nl.shared_hbm)
    sb = kd.load_dropout_seed(dropout_seed)
    nisa.dma_copy(dst=out, src=sb)
    return out


@nki.jit
def _rows(dropout_seed):
    out = nl.ndarray((P, 4), dtype=nl.uint32, buffer=nl.shared_hbm)
    sb = kd.load_dropout_seed(dropout_seed)
    keys = kd.dropout_row_keys(sb, 0, 0, 0, P)
    nisa.dma_copy(dst=out, src=keys)
    return out


@nki.jit
def _tile(dropout_seed):
    out = nl.ndarray((P, COLS), dtype=nl.float32, buffer=nl.shared_hbm)
    sb = kd.load_dropout_seed(dropout_seed)
    keys = kd.dropout_row_keys(sb, 0, 0, 0, P)
    t = kd.dropout_scale_keys(keys, 0.1, 0, P, COLS)
    nisa.dma_copy(dst=out, src=t)
    return out


@nki.jit
def _hw_rng_standin(dropout_seed):
    """The hardware-generator path's instructions after the state hash (see the module docstring)."""
    out = nl.ndarray((P, COLS), dtype=nl.float32, buffer=nl.shared_hbm)
    state = nl.ndarray((P, 6), dtype=nl.uint32, buffer=nl.sbuf)
    nisa.memset(dst=state, value=1, engine=nisa.engine.gpsimd)
    # --- per tile from here
    lane_state = nl.ndarray((P, 6), dtype=nl.uint32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=lane_state, src=state, engine=nisa.engine.gpsimd)  # rand_set_state
    bits = nl.ndarray((P, COLS), dtype=nl.uint32, buffer=nl.sbuf)
    nisa.memset(dst=bits, value=7, engine=nisa.engine.vector)  # rng(dst=bits)
    v = nl.ndarray((P, COLS), dtype=nl.uint32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=v, data=bits, op0=nl.right_shift, operand0=16)
    scale = nl.ndarray((P, COLS), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=scale, data=v, op0=nl.less, operand0=58982.0, op1=nl.multiply, operand1=1.0 / 0.9)
    nisa.dma_copy(dst=out, src=scale)
    return out


def _records(kernel, seed):
    with trace.recording() as rec:
        kernel(seed)
    return list(rec.records)


def _busy(records, gen):
    p = profile(records, gen)
    return {e: p.engine_busy(e) for e in ENGINES}, len(records)


def _row(name, busy, n, note=""):
    cells = "".join(f"{busy[e] / 1e3:10.3f}" for e in ENGINES[:2])
    crit = max(busy[e] for e in ENGINES[:4])
    print(f"  {name:<44}{n:6d}{cells}{crit / 1e3:11.3f}  {note}")


def stage_costs(gen, seed):
    """``{stage: (busy_by_engine_ns, instructions)}`` of the counter hash and the hardware-generator estimate."""
    r_seed = _records(_seed_only, seed)
    r_rows = _records(_rows, seed)
    r_tile = _records(_tile, seed)
    # each kernel's trace starts with the previous one's (same instructions), minus its final output DMA
    a, b = len(r_seed) - 1, len(r_rows) - 1
    assert [r.instr for r in r_rows[:a]] == [r.instr for r in r_seed[:a]]
    assert [r.instr for r in r_tile[:b]] == [r.instr for r in r_rows[:b]]
    out = {
        "seed": _busy(r_seed[:a], gen),
        "rows": _busy(r_rows[a:b], gen),
        "tile": _busy(r_tile[b:-1], gen),
    }
    r_hw = _records(_hw_rng_standin, seed)
    out["hw_per_tile"] = _busy(r_hw[1:-1], gen)  # set + rng + 2 decisions (the state memset is setup)
    return out


def attention_context(target):
    """Modeled per-tile busy time of attention_fwd (bf16, d 128, 1 head, 2048 x 2048, non-causal)."""
    from nki_attn.profiler.cli import run_kernel
    args = SimpleNamespace(kernel="fwd", batch=1, heads=1, kv_heads=1, seqlen=2048, head_dim=128, dtype="bf16",
                           causal=False, window=None, sinks=0, target=target, lnc=1, seed=0)
    records, _ = run_kernel(args)
    p = profile(records, generation(target))
    tiles = (2048 // P) * (2048 // COLS)
    return {e: p.engine_busy(e) / tiles for e in ENGINES}, p.time_overlap_ns / tiles


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="trn2", choices=("trn1", "trn2", "trn3"))
    ap.add_argument("--tiles", type=int, default=8, help="key tiles per 128 query rows (seqlen_k / 512)")
    ap.add_argument("--no-context", action="store_true", help="skip the attention forward profile")
    args = ap.parse_args(argv)
    os.environ["NEURON_PLATFORM_TARGET_OVERRIDE"] = args.target
    gen = generation(args.target)
    seed = np.array([1234, 0], dtype=np.int32)
    t0 = time.perf_counter()
    c = stage_costs(gen, seed)
    print(f"Dropout cost per [128 x 512] score tile, target {args.target} -- MODELED (nki_attn.profiler), "
          f"microseconds of engine busy time")
    print(f"  {'stage':<44}{'instr':>6}{'VectorE':>10}{'GpSimdE':>10}{'busiest':>11}")
    print(" counter hash (simulated tile step):")
    _row("seed: load_dropout_seed (once per call)", *c["seed"])
    _row("rows: dropout_row_keys (per 128 rows)", *c["rows"])
    _row("tile: dropout_scale_keys (per tile)", *c["tile"])
    tb, tn = c["tile"]
    rb, rn = c["rows"]
    k = args.tiles
    amort = {e: tb[e] + rb[e] / k for e in ENGINES}
    per_call = {e: tb[e] + rb[e] for e in ENGINES}
    _row(f"per tile, row words hoisted ({k} tiles per row block)", amort, tn + rn // k)
    _row("per tile, dropout_scale_tile (row words every call)", per_call, tn + rn)
    print(" hardware generator (estimate, stand-in instructions):")
    hb, hn = c["hw_per_tile"]
    _row("set + rng + decide (per tile)", hb, hn)
    hw_amort = {e: hb[e] + rb[e] / k for e in ENGINES}
    hw_call = {e: hb[e] + rb[e] for e in ENGINES}
    _row(f"per tile, states hashed per row block ({k} tiles)", hw_amort, hn + rn // k, "state hash ~ rows stage")
    _row("per tile, state hashed per tile", hw_call, hn + rn)
    if not args.no_context:
        busy, t_overlap = attention_context(args.target)
        print(f" context: attention_fwd bf16 d128 2048x2048 non-causal, per tile: busiest-engine time "
              f"{t_overlap / 1e3:.3f} us (VectorE {busy['VectorE'] / 1e3:.3f}, GpSimdE {busy['GpSimdE'] / 1e3:.3f},"
              f" ScalarE {busy['ScalarE'] / 1e3:.3f}, TensorE {busy['TensorE'] / 1e3:.3f})")
    print(f" (simulator wall time {time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
