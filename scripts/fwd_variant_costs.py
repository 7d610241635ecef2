"""Modeled cost of each attention variant of the forward kernel against its default path, at one shape.

    python scripts/fwd_variant_costs.py [--target trn2] [--batch 1 --heads 4 --kv-heads 1 --seqlen 2048 \\
        --head-dim 128] [--only NAME ...]

Default shape: the benchmark's shape (a) (batch 1, 4 query heads / 1 kv head, S 2048, d 128, causal, bf16, mixed
precision). Each row runs ``attention_fwd`` once on the simulator under the instruction trace and prints the
MODELED time (nki_attn.profiler, perfect-overlap bound: the busiest engine or shared resource), its ratio to the
default row, the bottleneck and the busy time per engine. Every device time is modeled, never measured
(docs/performance.md). Rows whose shape differs from the default (head dims) say so in their name.
"""
import argparse
import os
import pathlib
import sys
import time

import ml_dtypes
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nki_attn.profiler import generation, profile  # noqa: E402
from nki_attn.sim import trace  # noqa: E402

BF16 = ml_dtypes.bfloat16
ENGINES = ("TensorE", "VectorE", "ScalarE", "GpSimdE", "DMA")


def variants(seqlen):
    """``(name, d_qk, d_v, kernel keywords)`` of every row; the first is the default path."""
    rows = [
        ("default (causal)", None, None, dict(use_causal_mask=True)),
        ("softcap 50", None, None, dict(use_causal_mask=True, softcap=50.0)),
        ("ALiBi, causal", None, None, dict(use_causal_mask=True, alibi=True)),
        ("ALiBi, non-causal", None, None, dict(alibi=True)),
        ("non-causal (reference for the row above)", None, None, dict()),
        ("softcap 50 + ALiBi", None, None, dict(use_causal_mask=True, softcap=50.0, alibi=True)),
        ("window_size (1023, 0) = sliding_window 1024", None, None, dict(use_causal_mask=True,
                                                                         window_size=(1023, 0))),
        ("sliding_window 1024 (legacy)", None, None, dict(use_causal_mask=True, sliding_window=1024)),
        ("window_size (256, 256), non-causal", None, None, dict(window_size=(256, 256))),
        ("causal, seqlen_k = seqlen_q / 2 (bottom-right)", None, None, dict(use_causal_mask=True, half_k=True)),
        ("d_qk 192 / d_v 128", 192, 128, dict(use_causal_mask=True)),
        ("d 199 (128 + 71)", 199, 199, dict(use_causal_mask=True)),
        ("d 256 (reference for d 199)", 256, 256, dict(use_causal_mask=True)),
        ("dropout 0.1", None, None, dict(use_causal_mask=True, dropout=0.1)),
    ]
    return rows


def make_args(rng, b, h, hk, d, dv, sq, sk, kw):
    def rand(*shape):
        return rng.standard_normal(shape).astype(np.float32).astype(BF16)
    q = rand(b, h, d, sq)
    k = rand(b, hk, d, sk)
    v = rand(b, hk, dv, sk)
    kw = dict(kw)
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = (2.0 ** (-8.0 * (np.arange(h) + 1) / h))[None, :].repeat(b, 0).astype(np.float32)
    p = kw.pop("dropout", 0.0)
    if p:
        kw["dropout_p"] = p
        kw["dropout_seed"] = np.array([1234, 5678], dtype=np.int32)
    return q, k, v, kw


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="trn2", choices=("trn1", "trn2", "trn3"))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--only", nargs="*", help="run only the rows whose name contains one of these words")
    args = ap.parse_args(argv)
    os.environ["NEURON_PLATFORM_TARGET_OVERRIDE"] = args.target
    from nki_attn.kernels.attention_fwd import attention_fwd

    gen = generation(args.target)
    rows = variants(args.seqlen)
    if args.only:
        rows = [r for r in rows if r is rows[0] or any(w in r[0] for w in args.only)]
    out = []
    base = None
    t0 = time.perf_counter()
    for i, (name, d, dv, kw) in enumerate(rows):
        d = d or args.head_dim
        dv = dv or args.head_dim
        sk = args.seqlen // 2 if kw.get("half_k") else args.seqlen
        kw = {key: val for key, val in kw.items() if key != "half_k"}
        q, k, v, kw = make_args(np.random.default_rng(0), args.batch, args.heads, args.kv_heads, d, dv,
                                args.seqlen, sk, kw)
        print(f"[{i + 1}/{len(rows)}] {name} ...", end="", flush=True, file=sys.stderr)
        try:
            with trace.recording() as rec:
                attention_fwd(q, k, v, mixed_precision=True, **kw)
        except (AssertionError, ImportError) as e:
            print(f" skipped ({str(e).splitlines()[0][:100]})", file=sys.stderr)
            out.append((name, None))
            continue
        prof = profile(rec.records, gen)
        us = prof.time_overlap_ns / 1000.0
        if base is None:
            base = us
        print(f" {us:.1f} us modeled (elapsed {time.perf_counter() - t0:.0f} s)", file=sys.stderr)
        out.append((name, (us, prof.bottleneck, [prof.engine_busy(e) / 1000.0 for e in ENGINES],
                           len(rec.records))))
    print(f"\nAll times MODELED on {args.target} by nki_attn.profiler (perfect-overlap bound), not measured. "
          f"Shape: batch {args.batch}, {args.heads}/{args.kv_heads} heads, S {args.seqlen}, d {args.head_dim}, "
          f"bf16, mixed precision.\n")
    print("| variant | modeled us | / default | bottleneck | " + " | ".join(ENGINES) + " | instructions |")
    print("|---|---:|---:|---|" + "---:|" * len(ENGINES) + "---:|")
    for name, res in out:
        if res is None:
            print(f"| {name} | not supported | | | " + " | " * len(ENGINES) + " |")
            continue
        us, bott, busy, n = res
        print(f"| {name} | {us:.1f} | {us / base:.2f} | {bott} | " + " | ".join(f"{x:.1f}" for x in busy)
              + f" | {n} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
