"""Figures of ring attention (docs/distributed.md): per-step traffic and kernel time, the modeled shard length
above which communication hides behind compute on trn2, the per-rank work balance, and the accuracy survey.

Device times are MODELED by nki_attn.profiler (cost model over the simulator's instruction trace), not measured;
wall-clock times are this machine's CPU running the simulator, not device times.

    python scripts/ring_figures.py steps [--world-size 4] [--seqlen-local 512] [--layout ring] [--causal] ...
    python scripts/ring_figures.py threshold [--heads 8] [--seqlens 512 1024 2048]
    python scripts/ring_figures.py balance [--seqlen 65536] [--world-size 8]
    python scripts/ring_figures.py tolerances [--seeds 3]

``steps`` runs one forward + backward on ``--world-size`` gloo processes (loopback) with every kernel call under
the simulator's instruction trace, and prints per step: bytes this rank posted, the modeled trn2 time of its
kernel calls (slowest / fastest rank), the simulator's wall time and the time blocked on transfers.
``threshold`` models one block pair's kernel time on trn2 for several shard lengths, fits a quadratic, and solves
compute(s) >= transfer(s) with the public NeuronLink / EFA figures below.
"""
import argparse
import json
import math
import os
import sys

import torch

# Public interconnect figures (aws-neuron-sdk documentation, cited by document name):
# - "Amazon EC2 Trn2 Architecture": trn2.48xlarge, 16 Trainium2 chips in a 4x4 2D torus, intra-instance
#   NeuronLink-v3 1,024 GB/s per chip; Trn2 UltraServer, inter-instance NeuronLink-v3 256 GB/s per chip;
#   EFAv3 3,200 Gbps per instance.
# - "Neuron Runtime: Collectives" (System Connectivity): each chip has a 200 Gbps EFA interface; each chip links
#   to 4 neighbours in the 2D torus (2 more on the Z dimension in an UltraServer); a minimal packet between
#   servers takes 15 us (ib_write_lat).
# - "Intra-node Collective Communications with AWS Neuron": per-hop latency of Ring about 1-2 us.
# Per link = per-chip figure / links; the documents do not say whether a figure counts both directions, so the
# ring (one direction per link) is given half of it (conservative; the other reading halves the thresholds).
SCENARIOS = [
    # name, ranks, GB/s available to one rank's hop, latency us, what it is
    ("trn2 8 ranks, NeuronLink", 8, 1024 / 4 / 2, 2.0,
     "8 chips of one trn2.48xlarge, one rank per chip; hop = one intra-instance NeuronLink-v3 link"),
    ("trn2 32 ranks, EFA", 32, 200 / 8, 15.0,
     "32 chips of two trn2.48xlarge, one rank per chip; the 2 hops between instances use the chip's 200 Gbps "
     "EFA share and set the step time"),
    ("trn2 32 ranks, UltraServer", 32, 256 / 2 / 2, 2.0,
     "32 chips of a Trn2 UltraServer, one rank per chip; the hops between instances use an inter-instance "
     "NeuronLink-v3 Z link (256 GB/s per chip over 2 links)"),
]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


# ----------------------------------------------------------------------------------------------------- modeled
def _modeled_hook(target):
    """A ``record_steps`` kernel hook: run the kernel under the instruction trace, return modeled times."""
    from nki_attn.profiler import generation, profile
    from nki_attn.sim import trace

    gen = generation(target)

    def hook(run):
        os.environ["NEURON_PLATFORM_TARGET_OVERRIDE"] = target
        with trace.recording() as rec:
            result = run()
        prof = profile(rec.records, gen)
        return result, {"overlap_us": prof.time_overlap_ns / 1e3, "serial_us": prof.time_serial_ns / 1e3}
    return hook


# ----------------------------------------------------------------------------------------------------- steps
def _steps_rank(rank, world_size, a):
    from nki_attn.distributed import record_steps, ring_flash_attn_func, zigzag_ring_flash_attn_func
    g = torch.Generator().manual_seed(0)
    S, dt = a["seqlen_local"] * world_size, DTYPES[a["dtype"]]
    full = [torch.randn(a["batch"], S, h, a["head_dim"], generator=g).to(dt)
            for h in (a["heads"], a["kv_heads"], a["kv_heads"], a["heads"])]
    if a["layout"] == "zigzag":
        from nki_attn.distributed import zigzag_shard as shard
        fn = zigzag_ring_flash_attn_func
    else:
        from nki_attn.distributed import ring_shard as shard
        fn = ring_flash_attn_func
    q, k, v, do = (shard(t, rank, world_size).requires_grad_(i < 3) for i, t in enumerate(full))
    from nki_attn import kernel_api
    x = torch.zeros(1, 1, a["head_dim"], 128, dtype=dt)
    kernel_api.attention_fwd(x, x, x)  # pay the one-time import / trace set-up outside the recorded steps
    with record_steps(_modeled_hook(a["target"])) as log:
        out = fn(q, k, v, causal=a["causal"], window_size=(a["window"] - 1 if a["window"] else -1, -1))
        out.backward(do)
    return log


def cmd_steps(a):
    from nki_attn.distributed import run_local
    args = vars(a).copy()
    args.pop("func")
    logs = run_local(_steps_rank, a.world_size, args, timeout=a.timeout)
    rows = []
    keys = sorted({(e["phase"] != "fwd", e["step"]) for log in logs for e in log})
    for bwd, step in keys:
        phase = "bwd" if bwd else "fwd"
        per = [next(e for e in log if e["phase"] == phase and e["step"] == step) for log in logs]
        modeled = [sum(b["info"]["overlap_us"] for b in e["blocks"]) for e in per]
        rows.append({"phase": phase, "step": step, "sent_bytes": max(e["sent_bytes"] for e in per),
                     "kernel_calls": [len(e["blocks"]) for e in per],
                     "modeled_us_max": max(modeled), "modeled_us_min": min(modeled),
                     "sim_wall_s": max(sum(b["seconds"] for b in e["blocks"]) for e in per),
                     "wait_s": max(e["wait_seconds"] for e in per)})
    title = (f"{a.layout} ring, {a.world_size} ranks x {a.seqlen_local} tokens, batch {a.batch}, heads {a.heads}/"
             f"{a.kv_heads}, d {a.head_dim} {a.dtype}, causal={a.causal}, window={a.window}; modeled on "
             f"{a.target} (perfect overlap), NOT measured")
    print(title)
    print(f"{'phase':<6}{'step':>5}{'MiB sent/rank':>15}{'calls/rank':>16}{'modeled us max':>16}"
          f"{'modeled us min':>16}{'sim wall s':>12}{'wait s':>9}")
    for r in rows:
        print(f"{r['phase']:<6}{r['step']:>5}{r['sent_bytes'] / 2**20:>15.3f}{str(r['kernel_calls']):>16}"
              f"{r['modeled_us_max']:>16.1f}{r['modeled_us_min']:>16.1f}{r['sim_wall_s']:>12.2f}{r['wait_s']:>9.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"title": title, "args": args, "steps": rows}, f, indent=1)
        print(f"wrote {a.json}")


# ----------------------------------------------------------------------------------------------------- threshold
def _block_times(sq, sk, heads, kv_heads, d, dtype, target):
    """Modeled (fwd, bwd) us of one unmasked block pair: sq queries x sk keys, ``heads`` / ``kv_heads``."""
    from nki_attn import kernel_api
    hook = _modeled_hook(target)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads, d, sq, generator=g).to(dtype)
    k = torch.randn(1, kv_heads, d, sk, generator=g).to(dtype)
    v = torch.randn(1, kv_heads, d, sk, generator=g).to(dtype)
    (o, lse), fwd = hook(lambda: kernel_api.attention_fwd(q, k, v))
    _, bwd = hook(lambda: kernel_api.attention_bwd(q, k, v, o, torch.randn_like(o), lse))
    return fwd["overlap_us"], bwd["overlap_us"]


def _fit(xs, ys):
    """Least-squares a*s^2 + b*s + c."""
    A = torch.tensor([[x * x, x, 1.0] for x in xs], dtype=torch.float64)
    y = torch.tensor(ys, dtype=torch.float64)
    return [float(c) for c in torch.linalg.lstsq(A, y[:, None]).solution[:, 0]]


def _threshold(seqlens, comp, bytes_per_token, gbps, lat_us):
    """Shard length above which a step's kernel time ``comp[i]`` (at ``seqlens[i]``) covers its transfer
    ``lat + bytes_per_token * s / bandwidth``: the last crossing, linearly interpolated between measured points;
    beyond the largest point, extrapolated with a quadratic fit of the three largest. Returns (s, how)."""
    margin = [c - (lat_us + bytes_per_token * s / (gbps * 1e3)) for s, c in zip(seqlens, comp)]  # GB/s = 1e3 B/us
    if margin[-1] < 0:
        a, b, c = _fit(seqlens[-3:], comp[-3:])
        beta = bytes_per_token / (gbps * 1e3)
        disc = (b - beta) ** 2 - 4 * a * (c - lat_us)
        if a <= 0 or disc < 0:
            return math.inf, "never (fit)"
        return (-(b - beta) + math.sqrt(disc)) / (2 * a), "extrapolated"
    last_bad = max((i for i, m in enumerate(margin) if m < 0), default=None)
    if last_bad is None:
        return seqlens[0], "at or below"
    s0, s1, m0, m1 = seqlens[last_bad], seqlens[last_bad + 1], margin[last_bad], margin[last_bad + 1]
    return s0 + (s1 - s0) * (-m0) / (m1 - m0), "interpolated"


def cmd_threshold(a):
    d, dt = a.head_dim, DTYPES[a.dtype]
    item = torch.empty(0, dtype=dt).element_size()
    out = {"args": {k: v for k, v in vars(a).items() if k != "func"}, "scenarios": SCENARIOS, "configs": []}
    print(f"Kernel times MODELED on {a.target} (nki_attn.profiler, perfect overlap of engines), one NeuronCore per "
          f"rank; d {d} {a.dtype}; per step the ring computes a full s x s block, zigzag an s/2 x s or s x s/2 "
          f"block")
    for kv in a.kv_heads:
        group = a.heads // kv
        pts = []
        for s in a.seqlens:
            # the kernel runs the kv heads one after another: model one GQA group, times kv
            ff, fb = _block_times(s, s, group, 1, d, dt, a.target)
            # zigzag: ranks holding later chunks run s/2 queries x s keys, the others s queries x s/2 keys; the
            # slower of the two sets the step
            h = max(128, s // 2)  # the kernels pad a shorter half to 128, as the ring does
            hf, hb = (max(x, y) for x, y in zip(_block_times(h, s, group, 1, d, dt, a.target),
                                                 _block_times(s, h, group, 1, d, dt, a.target)))
            pts.append({"s": s, "full_fwd": ff * kv, "full_bwd": fb * kv, "half_fwd": hf * kv, "half_bwd": hb * kv})
            print(f"  heads {a.heads}/{kv} s {s:>5}: full block fwd {ff * kv:8.1f} bwd {fb * kv:8.1f} us, half block "
                  f"fwd {hf * kv:8.1f} bwd {hb * kv:8.1f} us (modeled)", flush=True)
        ss = [p["s"] for p in pts]
        kv_bytes = 2 * kv * d * item  # K and V of one token
        dkv_bytes = 2 * kv * d * 4  # float32 dK/dV partial sums of one token, sent with them in the backward
        cfg = {"heads": a.heads, "kv_heads": kv, "points": pts, "thresholds": []}
        print(f"heads {a.heads}/{kv}: shard length above which each step's transfer hides behind its kernel")
        print(f"  {'scenario':<28}{'GB/s':>6}{'lat us':>7}{'fwd ring':>16}{'fwd zigzag':>16}{'bwd ring':>16}"
              f"{'bwd zigzag':>16}")
        for name, ranks, gbps, lat, what in SCENARIOS:
            t = {"scenario": name, "ranks": ranks, "gbps": gbps, "latency_us": lat}
            cells = []
            for key, col, per_token in (("fwd_ring", "full_fwd", kv_bytes), ("fwd_zigzag", "half_fwd", kv_bytes),
                                        ("bwd_ring", "full_bwd", kv_bytes + dkv_bytes),
                                        ("bwd_zigzag", "half_bwd", kv_bytes + dkv_bytes)):
                val, how = _threshold(ss, [p[col] for p in pts], per_token, gbps, lat)
                t[key] = {"s": val, "how": how}
                mark = {"interpolated": "", "extrapolated": " (x)", "at or below": " (<=)"}.get(how, " (-)")
                cells.append(f"{val:.0f}{mark}" if math.isfinite(val) else "never")
            cfg["thresholds"].append(t)
            print(f"  {name:<28}{gbps:>6.0f}{lat:>7.0f}" + "".join(f"{c:>16}" for c in cells))
        out["configs"].append(cfg)
    print("(<=): already hidden at the smallest length modeled; (x): beyond the largest, from a quadratic fit")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {a.json}")


# ----------------------------------------------------------------------------------------------------- balance
def cmd_balance(a):
    from nki_attn.distributed import format_work_balance, work_balance_report
    w = (a.window - 1, 0) if a.window else (-1, -1)
    rep = work_balance_report(a.seqlen, a.world_size, causal=True, window_size=w)
    print(f"causal, {a.seqlen} tokens, {a.world_size} ranks, window {a.window}: per-rank work (tiles = 128 x 128 "
          f"score tiles the kernels compute under the block plans)")
    print(format_work_balance(rep))


# ----------------------------------------------------------------------------------------------------- accuracy
def cmd_tolerances(a):
    """The distributed tests' configurations with more seeds: worst fraction of the rule's bound used."""
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.join(here, "..", "tests", "distributed"))
    import _cases
    import test_ring
    from nki_attn.distributed import run_local
    worst = {}
    for world_size, base in ((2, test_ring.CASES_2), (4, test_ring.CASES_4)):
        cases = [dict(c, seed=s, name=f"{c['name']}/seed{s}") for s in range(a.seeds) for c in base]
        results = run_local(_cases.worker, world_size, cases, False, timeout=a.timeout)
        for i, c in enumerate(cases):
            q, k, v, do, s = _cases.inputs(c)
            truth, single = test_ring._references(c)
            got = _cases.gather(c, world_size, [r["cases"][i] for r in results])
            for row in _cases.judge(c, world_size, got, truth, single, do, s):
                key = (str(c["dtype"]).split(".")[-1], row["output"])
                if key not in worst or row["used"] > worst[key]["used"]:
                    worst[key] = dict(row, world_size=world_size)
        print(f"{world_size} ranks: {len(cases)} runs checked", flush=True)
    print(f"{'dtype':<10}{'output':<8}{'worst used':>11}  {'ring/single':>11}  case")
    for (dt, out), r in sorted(worst.items()):
        ratio = r["err_ring"] / r["err_single"] if r["err_single"] else math.inf
        print(f"{dt:<10}{out:<8}{r['used']:>11.2f}  {ratio:>11.2f}  {r['case']} ({r['world_size']} ranks)")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("steps", help="per-step bytes sent and kernel time on gloo processes")
    s.add_argument("--world-size", type=int, default=4)
    s.add_argument("--seqlen-local", type=int, default=512)
    s.add_argument("--batch", type=int, default=1)
    s.add_argument("--heads", type=int, default=8)
    s.add_argument("--kv-heads", type=int, default=2)
    s.add_argument("--head-dim", type=int, default=128)
    s.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    s.add_argument("--layout", choices=("ring", "zigzag"), default="ring")
    s.add_argument("--causal", action="store_true")
    s.add_argument("--window", type=int, default=None, help="sliding window W (keys i-W+1..i; implies --causal)")
    s.add_argument("--target", default="trn2")
    s.add_argument("--timeout", type=float, default=1800)
    s.add_argument("--json")
    s.set_defaults(func=cmd_steps)
    t = sub.add_parser("threshold", help="modeled shard length above which transfers hide behind compute")
    t.add_argument("--heads", type=int, default=8)
    t.add_argument("--kv-heads", type=int, nargs="+", default=[8, 1])
    t.add_argument("--head-dim", type=int, default=128)
    t.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    t.add_argument("--seqlens", type=int, nargs="+", default=[128, 256, 512, 1024, 2048, 4096])
    t.add_argument("--target", default="trn2")
    t.add_argument("--json")
    t.set_defaults(func=cmd_threshold)
    b = sub.add_parser("balance", help="per-rank work of the ring and zigzag layouts")
    b.add_argument("--seqlen", type=int, default=65536)
    b.add_argument("--world-size", type=int, default=8)
    b.add_argument("--window", type=int, default=None)
    b.set_defaults(func=cmd_balance)
    o = sub.add_parser("tolerances", help="the distributed tests' cases over more seeds: worst bound fraction")
    o.add_argument("--seeds", type=int, default=3)
    o.add_argument("--timeout", type=float, default=3600)
    o.set_defaults(func=cmd_tolerances)
    a = p.parse_args(argv)
    if getattr(a, "window", None):
        a.causal = True
    a.func(a)


if __name__ == "__main__":
    main()
