"""What each design point of the backward kernel buys: its modeled time with one point switched off at a time.

    python scripts/bwd_ablation.py [--target trn2] [--shapes a,b,c,d] [--json out.json]

Runs our ``attention_bwd`` on the four shapes of issue #13 (``scripts/bench_vs_nki_library.py``: bf16, mixed
precision, same inputs) once with the kernel as it is and once per variant below, each in its own process (the
switches are module constants of nki_attn/kernels/attention_bwd.py, set before the kernel's first launch):

- ``GROUP_MAX=1``: no groups; each member's dV and dK leave PSUM after every key tile it visits;
- ``BLOCK_MEMBERS_MAX=4``: blocks of at most 4 members (one group) instead of 8;
- ``BLOCK_MEMBERS_MAX=1``: one DMA per tensor per member; groups live within a block, so this also means groups
  of one member (``GROUP_MAX=1`` and one DMA per member);
- ``DS_DMA_TRANSPOSE=False``: every dS transpose on TensorE (and its copy on ScalarE);
- ``P_CAST_ON_GPSIMD=False``: the fp32 -> bf16 cast of P on ScalarE instead of GpSimdE;
- ``FOLD_SCALE_INTO_Q=False``: softmax_scale in the exp and the dK eviction instead of Q.

It prints, per shape, the modeled time (perfect overlap, us) and the bottleneck of each. Every device time is
MODELED by nki_attn.profiler (docs/performance.md), never measured. No NKI Library checkout is needed.
"""
import argparse
import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]

VARIANTS = [
    ("as is", {}),
    ("GROUP_MAX=1", {"GROUP_MAX": 1}),
    ("BLOCK_MEMBERS_MAX=4", {"BLOCK_MEMBERS_MAX": 4}),
    ("BLOCK_MEMBERS_MAX=1", {"BLOCK_MEMBERS_MAX": 1}),
    ("DS_DMA_TRANSPOSE=False", {"DS_DMA_TRANSPOSE": False}),
    ("P_CAST_ON_GPSIMD=False", {"P_CAST_ON_GPSIMD": False}),
    ("FOLD_SCALE_INTO_Q=False", {"FOLD_SCALE_INTO_Q": False}),
]
ENGINES = ("TensorE", "VectorE", "ScalarE", "GpSimdE", "DMA")


def run_variant(consts, shapes, target):
    """Modeled figures of our backward on ``shapes`` with the module constants ``consts``, in this process."""
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "scripts"))
    os.environ["NEURON_PLATFORM_TARGET_OVERRIDE"] = target
    from nki_attn.kernels import attention_bwd as kb
    for name, value in consts.items():
        assert hasattr(kb, name), name
        setattr(kb, name, value)
    import bench_vs_nki_library as bench
    from nki_attn.profiler import generation
    from nki_attn.sim import trace
    gen = generation(target)
    out = {}
    for s in shapes:
        sh = bench.SHAPES[s]
        x = bench.make_inputs(sh, 0)
        o, lse = bench.golden_o_lse(sh, x)
        with trace.recording() as rec:
            kb.attention_bwd(x["q"], x["k"], x["v"], o, x["dy"], lse, sinks_ref=x["sinks"],
                             use_causal_mask=sh.causal, mixed_precision=True, sliding_window=sh.window)
        f = bench.figures(sh, "bwd", rec.records, gen)
        out[s] = {"time_us": f["time_us"], "bottleneck": f["bottleneck"],
                  "busy_us": {e: f["busy_us"][e] for e in ENGINES}}
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="trn2", choices=("trn1", "trn2", "trn3"))
    ap.add_argument("--shapes", default="a,b,c,d")
    ap.add_argument("--json", metavar="F")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    shapes = [s for s in args.shapes.split(",") if s]
    if args.child is not None:
        print(json.dumps(run_variant(json.loads(args.child), shapes, args.target)))
        return 0
    results = {}
    for name, consts in VARIANTS:
        print(f"{name} ...", end="", flush=True, file=sys.stderr)
        p = subprocess.run([sys.executable, __file__, "--target", args.target, "--shapes", ",".join(shapes),
                            "--child", json.dumps(consts)], capture_output=True, text=True, cwd=ROOT)
        if p.returncode != 0:
            sys.stderr.write(p.stderr)
            return 1
        results[name] = json.loads(p.stdout.strip().splitlines()[-1])
        print(" done", file=sys.stderr)
    print(f"\nModeled time of our backward (us, perfect overlap, {args.target}; MODELED, not measured), one design "
          f"point switched off per row; in parentheses the change against the kernel as is, and the bottleneck:\n")
    print("| variant | " + " | ".join(f"({s})" for s in shapes) + " |")
    print("|---|" + "---|" * len(shapes))
    base = results["as is"]
    for name, _ in VARIANTS:
        cells = []
        for s in shapes:
            r = results[name][s]
            d = r["time_us"] - base[s]["time_us"]
            delta = "" if name == "as is" else f" ({d:+.1f})"
            cells.append(f"{r['time_us']:.1f}{delta} {r['bottleneck']}")
        print(f"| {name} | " + " | ".join(cells) + " |")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"target": args.target, "modeled": True,
                                                       "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
