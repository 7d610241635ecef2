"""Modeled cost of each attention variant of issue #14 in the backward kernel, against the default path.

    python scripts/bwd_variant_cost.py [--target trn2] [--seqlen 2048] [--json out.json]

Shape (a) of scripts/bench_vs_nki_library.py: batch 1, 4 query heads on 1 kv head, seqlen 2048, head dim 128,
bfloat16 with mixed precision, causal; each row changes one thing (or a model's combination) and runs
``attention_bwd`` once on the simulator under the instruction trace. o and lse come from the torch golden
forward with the same variant (outside the trace). Every time printed is MODELED by ``nki_attn.profiler``
(docs/performance.md), not measured on hardware. The table goes into docs/kernel-bwd.md ("Variant costs").
"""
import argparse
import json
import os
import pathlib
import sys
import time

import ml_dtypes
import numpy as np
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from golden import dropout as gdrop  # noqa: E402
from golden.attention_fwd_torch import attention_fwd_torch_ref  # noqa: E402
from nki_attn.profiler import generation, profile  # noqa: E402
from nki_attn.sim import trace  # noqa: E402

BF16 = ml_dtypes.bfloat16
ENGINES = ("TensorE", "VectorE", "ScalarE", "GpSimdE", "DMA")

# (name, what changes against the default: kernel keywords, head dims (d_qk, d_v), causal)
VARIANTS = [
    ("default (causal)", {}, (128, 128), True),
    ("softcap 50", dict(softcap=50.0), (128, 128), True),
    ("ALiBi, causal", dict(alibi=True), (128, 128), True),
    ("window_size (1023, 0), causal", dict(window_size=(1023, 0)), (128, 128), True),
    ("dropout 0.1", dict(dropout_p=0.1), (128, 128), True),
    ("d_qk 192 / d_v 128 (MLA)", {}, (192, 128), True),
    ("d 199 (128 + 71)", {}, (199, 199), True),
    ("Gemma-2-like: softcap 50 + sliding window 1024", dict(softcap=50.0, sliding_window=1024), (128, 128), True),
    ("non-causal (reference for the next two)", {}, (128, 128), False),
    ("ALiBi, non-causal", dict(alibi=True), (128, 128), False),
    ("window_size (256, 256), non-causal", dict(window_size=(256, 256)), (128, 128), False),
]


def run_variant(kw, dims, causal, seqlen, seed=0):
    """Run attention_bwd once for one variant; returns the trace records."""
    from nki_attn.kernel_api import attention_bwd
    from nki_attn.sim.runtime import _numpy_to_torch, _torch_to_numpy

    rng = np.random.default_rng(seed)
    b, h, hk = 1, 4, 1
    d_qk, d_v = dims

    def rand(*shape):
        return rng.standard_normal(shape).astype(np.float32).astype(BF16)

    q, k, v, dy = rand(b, h, d_qk, seqlen), rand(b, hk, d_qk, seqlen), rand(b, hk, d_v, seqlen), rand(b, h, d_v, seqlen)
    kern = dict(use_causal_mask=causal, mixed_precision=True)
    gold = dict(use_causal_mask=causal, mixed_precision=True)
    for key, val in kw.items():
        if key == "alibi":
            slopes = np.array([[2.0 ** (-8.0 * (i + 1) / h) for i in range(h)]], np.float32)
            kern["alibi_slopes"] = slopes
            gold["alibi_slopes"] = torch.from_numpy(slopes)
        elif key == "dropout_p":
            seed_t = gdrop.make_seed(1234, 0)
            kern.update(dropout_p=val, dropout_seed=seed_t.numpy())
            gold.update(dropout_p=val, dropout_seed=seed_t)
        else:
            kern[key] = val
            gold[key] = val
    t = [_numpy_to_torch(x) for x in (q, k, v)]
    o, lse = attention_fwd_torch_ref(*t, **gold)
    o, lse = _torch_to_numpy(o), _torch_to_numpy(lse.float())
    with trace.recording() as rec:
        attention_bwd(q, k, v, o, dy, lse, **kern)
    return rec.records


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="trn2", choices=("trn1", "trn2", "trn3"))
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--json", metavar="F")
    args = ap.parse_args()
    os.environ["NEURON_PLATFORM_TARGET_OVERRIDE"] = args.target
    gen = generation(args.target)
    rows = []
    base = {}
    for name, kw, dims, causal in VARIANTS:
        t0 = time.perf_counter()
        recs = run_variant(kw, dims, causal, args.seqlen)
        p = profile(recs, gen)
        busy = {e: p.engine_busy(e) / 1e3 for e in ENGINES}
        row = {"variant": name, "time_us": p.time_overlap_ns / 1e3, "bottleneck": p.bottleneck, "busy_us": busy,
               "instructions": len(recs)}
        ref = base.setdefault("causal" if causal else "noncausal", row["time_us"])
        row["ratio"] = row["time_us"] / ref
        rows.append(row)
        print(f"[{len(rows)}/{len(VARIANTS)}] {name}: {row['time_us']:.1f} us modeled "
              f"({time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)
    print(f"All times MODELED on {args.target} by nki_attn.profiler, not measured. Shape: batch 1, 4/1 heads, "
          f"seqlen {args.seqlen}, bf16 mixed precision.\n")
    print("| variant | modeled time (us) | vs default | bottleneck | " + " | ".join(f"{e} busy" for e in ENGINES)
          + " | instructions |")
    print("|---|---|---|---|" + "---|" * len(ENGINES) + "---|")
    for r in rows:
        print(f"| {r['variant']} | {r['time_us']:.1f} | {r['ratio']:.3f} | {r['bottleneck']} | "
              + " | ".join(f"{r['busy_us'][e]:.1f}" for e in ENGINES) + f" | {r['instructions']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"target": args.target, "modeled": True, "seqlen": args.seqlen, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
