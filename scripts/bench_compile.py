"""torch.compile over the NKI attention ops: first-call time, per-call overhead against eager, graph breaks,
recompiles, and bit-for-bit agreement with eager (forward output and every input gradient).

    python scripts/bench_compile.py [--calls 20] [--json out.json]

Each case is a small training step ``loss = (attn(q, k, v) * w).sum(); loss.backward()`` with ``attn`` eager and
with ``attn = torch.compile(attn, fullgraph=True)`` (default Inductor backend; the loss is the same eager code).
Times are wall-clock on this machine's CPU, where the kernels run on the NKI simulator: the per-call ratio is the
compile machinery's overhead around the opaque kernel ops, not a device time. Graph breaks come from ``torch._dynamo.explain``; recompiles are detected by
``torch._dynamo.config.error_on_recompile`` over the timed calls (same shapes, fresh tensors each call).

OpenMP: Inductor's generated CPU code runs OpenMP regions whose worker threads then busy-wait (libgomp's default
spin) while the single-threaded simulator runs, which on a small, loaded machine slows the simulated kernels
down. ``OMP_WAIT_POLICY=PASSIVE`` (set before Python starts) makes the workers sleep instead; the JSON records
the policy in effect. Real Trainium runs (XLA tensors) have no Inductor CPU code around the kernels.
"""
import argparse
import json
import os
import statistics
import time

import torch

import nki_attn

CASES = {
    "causal-gqa-sinks": dict(shape=(2, 256, 4, 2, 64), kw=dict(causal=True, window_size=(100, 0)), sinks=True),
    "noncausal-pad": dict(shape=(1, 200, 2, 2, 64), kw=dict(), sinks=False),
    "bottom-right": dict(shape=(1, 128, 2, 1, 64), kw=dict(causal=True), sinks=False, sk=300),
}


def _inputs(case, seed):
    b, s, h, hk, d = case["shape"]
    sk = case.get("sk", s)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, h, d, generator=g, requires_grad=True)
    k = torch.randn(b, sk, hk, d, generator=g, requires_grad=True)
    v = torch.randn(b, sk, hk, d, generator=g, requires_grad=True)
    w = torch.randn(b, s, h, d, generator=g)
    sinks = torch.randn(h, generator=g, requires_grad=True) if case["sinks"] else None
    return q, k, v, w, sinks


def _step(case):
    kw = case["kw"]

    def step(q, k, v, w, sinks):
        out = nki_attn.flash_attn_func(q, k, v, sinks=sinks, **kw)
        (out * w).sum().backward()
        return out.detach()
    return step


def _fwd(case):
    kw = case["kw"]
    return lambda q, k, v, sinks: nki_attn.flash_attn_func(q, k, v, sinks=sinks, **kw)


def _grads(q, k, v, sinks):
    return [t.grad for t in (q, k, v) + ((sinks,) if sinks is not None else ())]


def run_case(name, case, calls):
    torch._dynamo.reset()
    step = _step(case)
    fwd = _fwd(case)
    q, k, v, w, sinks = _inputs(case, 0)
    explain = torch._dynamo.explain(fwd)(q, k, v, sinks)

    # the attention function compiled with fullgraph=True (its backward through AOTAutograd); the loss around it
    # is the same eager code in both runs
    compiled_fwd = torch.compile(fwd, fullgraph=True)

    def compiled_step(q, k, v, w, s):
        out = compiled_fwd(q, k, v, s)
        (out * w).sum().backward()

    t0 = time.perf_counter()
    compiled_step(*_inputs(case, 0))
    first = time.perf_counter() - t0

    # bit-for-bit: same inputs, eager vs compiled, output and gradients
    a = _inputs(case, 1)
    out_e = fwd(a[0], a[1], a[2], a[4])
    (out_e * a[3]).sum().backward()
    b_ = _inputs(case, 1)
    out_c = compiled_fwd(b_[0], b_[1], b_[2], b_[4])
    (out_c * b_[3]).sum().backward()
    exact = torch.equal(out_e, out_c) and all(torch.equal(x, y) for x, y in zip(_grads(a[0], a[1], a[2], a[4]),
                                                                                _grads(b_[0], b_[1], b_[2], b_[4])))

    # timed calls: interleaved eager / compiled, fresh inputs; any recompile raises
    torch._dynamo.config.error_on_recompile = True
    te, tc = [], []
    try:
        for i in range(calls):
            ins = _inputs(case, 100 + i)
            t0 = time.perf_counter()
            step(*ins)
            te.append(time.perf_counter() - t0)
            ins = _inputs(case, 100 + i)
            t0 = time.perf_counter()
            compiled_step(*ins)
            tc.append(time.perf_counter() - t0)
        recompiles = 0
    except torch._dynamo.exc.RecompileError:
        recompiles = 1
    finally:
        torch._dynamo.config.error_on_recompile = False
    me, mc = statistics.median(te), statistics.median(tc) if tc else float("nan")
    return {"case": name, "shape [b, s, h, hk, d]": list(case["shape"]), "graph_breaks": explain.graph_break_count,
            "graphs": explain.graph_count, "first_call_s": round(first, 2), "eager_ms": round(me * 1e3, 2),
            "compiled_ms": round(mc * 1e3, 2), "ratio": round(mc / me, 3), "recompiles": recompiles,
            "bit_exact": exact}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    for name, case in CASES.items():
        r = run_case(name, case, args.calls)
        rows.append(r)
        print(json.dumps(r), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "calls": args.calls, "cpus": os.cpu_count(),
                       "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"), "rows": rows}, f, indent=1)
    bad = [r for r in rows if r["graph_breaks"] or r["recompiles"] or not r["bit_exact"]]
    raise SystemExit(1 if bad else 0)


if __name__ == "__main__":
    main()
