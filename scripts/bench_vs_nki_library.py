"""Modeled time of our attention kernels against the NKI Library's, side by side, in one run.

The NKI Library is not part of this repository: point the script at a local checkout of the public
aws-neuron/nki-library repository (its package lives under src/nkilib_src)::

    python scripts/bench_vs_nki_library.py --nkilib /path/to/nki-library [--sensitivity] \\
        [--max-bwd-ratio 0.70] [--max-fwd-ratio 0.80] [--max-bwd-floor-ratio 2.5] [--json out.json] \\
        [--model-steps [--models llama3-8b,...] [--model-seqlens 4096,8192]] [--ablation]

For each of its four shapes it runs, on the simulator with the instruction trace on and identical inputs (bf16,
mixed precision, target trn2 unless ``--target`` says otherwise):

- backward: our ``attention_bwd`` and the library's ``attention_bwd`` (same signature and layouts; ``o`` and
  ``lse`` from the torch golden forward, outside the trace);
- forward: our ``attention_fwd`` and the library's ``attention_cte`` with ``cache_softmax=True`` (its training
  mode: it also writes the softmax statistics ``-max`` and ``1/sum``, from which ``lse = -(-max) - log(1/sum)``),
  called with the layouts ours uses (``tp_q=False, tp_k=False, tp_out=True``; V is ``[seqlen, d]`` in its API).
  With a sliding window the library requires ``scale=1``, so q is pre-scaled on the host for it.

The library's kernels run unmodified through ``nki_attn.sim.install_as_nki()``. Both kernels' outputs are compared
with each other (a gross mismatch means they did not solve the same problem and fails the run). Every device time
is MODELED by nki_attn.profiler (docs/performance.md), never measured.

It prints the ratio table (our modeled time / the library's, perfect-overlap bound), the busy time per engine and
shared resource, the engine balance per (128-query x 512-key) tile pair, how far each kernel is from the
useful-FLOP bound (TensorE peak on the FlashAttention FLOP count), and with ``--model-versions`` the same ratios
under each earlier version of the cost model. ``--sensitivity`` re-costs the same traces with every parameter
the docs leave uncertain at its extremes; the ratio limits then apply to the worst case (all of them at the
setting worst for us at once). ``--model-steps`` adds the models preset's shapes (``MODEL_SHAPES``: one layer's
forward and backward on one NeuronCore, ours and the library's where it runs, the worst-case ratio, the
useful-FLOP bound and tokens per second); ``--ablation`` runs our backward at each of its design points
(``ABLATION``, the kernel's tuning keywords) instead. It exits 1 when a figure is past a limit given on the
command line (``--max-bwd-floor-ratio`` applies to shape (a), ``--max-model-*-floor-ratio`` to the d128 / d256
model shapes at 4096 tokens or more), 2 on bad arguments.
"""
import argparse
import hashlib
import json
import math
import os
import pathlib
import subprocess
import sys
import time
from dataclasses import dataclass

import ml_dtypes
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import nki_attn.sim as sim  # noqa: E402
from nki_attn.profiler import generation, profile  # noqa: E402
from nki_attn.profiler.flops import useful_attention_flops  # noqa: E402
from nki_attn.profiler.model import RESOURCES  # noqa: E402
from nki_attn.profiler.params import CORRECTIONS, revert  # noqa: E402
from nki_attn.profiler.params import MODEL  # noqa: E402
from nki_attn.sim.benchmark import run_benchmark  # noqa: E402

BF16 = ml_dtypes.bfloat16
ENGINES = ("TensorE", "VectorE", "ScalarE", "GpSimdE", "DMA")
Q_TILE, K_TILE = 128, 512


@dataclass(frozen=True)
class Shape:
    """One benchmark case: ``B`` batch, ``H`` query heads, ``HKV`` kv heads, ``S`` sequence length (queries and
    keys), ``D`` head dim, ``causal``, ``window`` (None: none), ``sinks`` per head (0 or 1)."""

    label: str
    B: int
    H: int
    HKV: int
    S: int
    D: int
    causal: bool
    window: int = None
    sinks: int = 0


SHAPES = {
    "a": Shape("B1, 4 heads / 1 kv head, S 2048, d128, causal", 1, 4, 1, 2048, 128, True),
    "b": Shape("1x1x1 heads, S 4096, d128, non-causal", 1, 1, 1, 4096, 128, False),
    "c": Shape("GPT-OSS-like 8/1 heads, S 2048, d64, causal, window 128, 1 sink/head", 1, 8, 1, 2048, 64, True,
               128, 1),
    "d": Shape("4/4 heads, S 2048, d128, causal", 1, 4, 4, 2048, 128, True),
}



@dataclass(frozen=True)
class ModelShape:
    """One layer's attention of a real model (the harness's models preset): ``H`` query heads, ``HKV`` kv heads,
    ``D`` the q/k head dim and ``DV`` v's (None: D), ``window`` (None: none), ``sinks`` per head, ``softcap``
    (0: none). ``--model-steps`` simulates ONE kv head with its ``H / HKV`` query heads (batch 1): the kernels
    run the (batch, kv head) work items one after another with the same instruction stream, so the layer's time
    on one NeuronCore is ``HKV`` times that (said in the output)."""

    label: str
    H: int
    HKV: int
    D: int
    causal: bool = True
    window: int = None
    sinks: int = 0
    softcap: float = 0.0
    DV: int = None


MODEL_SHAPES = {
    "llama3-8b": ModelShape("Llama-3 8B: 32 heads / 8 kv heads, d128, causal", 32, 8, 128),
    "llama3-70b-tp8": ModelShape("Llama-3 70B, one rank of TP8: 8 heads / 1 kv head, d128, causal", 8, 1, 128),
    "mistral-7b": ModelShape("Mistral 7B: 32 / 8, d128, causal, sliding window 4096", 32, 8, 128, window=4096),
    "gemma2-9b": ModelShape("Gemma-2 9B local layer: 16 / 8, d256, causal, window 4096, softcap 50", 16, 8, 256,
                            window=4096, softcap=50.0),
    "gpt-oss-20b": ModelShape("GPT-OSS 20B: 64 / 8, d64, causal, window 128, 1 sink per head", 64, 8, 64,
                              window=128, sinks=1),
    "deepseek-mla": ModelShape("DeepSeek-V3 MLA, one rank of TP8: 16 / 16, d_qk 192, d_v 128, causal", 16, 16, 192,
                               DV=128),
}


def model_flops(ms, S, backward):
    """Useful FLOPs of one kv head's group at ``S`` tokens: 2 per visible (query, key) pair per head-dim element
    of each matmul: forward S (d_qk) and PV (d_v); backward S, dK, dQ (d_qk) and dP, dV (d_v). With d_qk = d_v
    these are the FlashAttention convention's (``useful_attention_flops``)."""
    from nki_attn.profiler.flops import visible_pairs
    dv = ms.DV or ms.D
    pairs = visible_pairs(S, S, ms.causal, ms.window) * (ms.H // ms.HKV)
    return 2 * pairs * ((3 * ms.D + 2 * dv) if backward else (ms.D + dv))


# ----------------------------------------------------------------------------------------------------- setup
def load_library(path):
    """Import the NKI Library's attention kernels from a checkout at ``path``; returns (bwd, cte, commit)."""
    pkg = pathlib.Path(path) / "src" / "nkilib_src"
    if not (pkg / "nkilib" / "core" / "attention" / "attention_bwd.py").is_file():
        raise SystemExit(f"--nkilib {path}: no src/nkilib_src/nkilib/core/attention/attention_bwd.py under it; "
                         f"give the root of an aws-neuron/nki-library checkout")
    if not sim.install_as_nki():
        raise SystemExit("a real 'nki' package is importable; this script compares kernels on the simulator")
    sys.path.insert(0, str(pkg))
    from nkilib.core.attention.attention_bwd import attention_bwd
    from nkilib.core.attention.attention_cte import attention_cte
    try:
        commit = subprocess.run(["git", "-C", str(path), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown (not a git checkout)"
    return attention_bwd, attention_cte, commit


def kernel_versions():
    """sha256[:12] of our kernel sources (the figures go stale when they change)."""
    root = ROOT / "nki_attn" / "kernels"
    return {f: hashlib.sha256((root / f).read_bytes()).hexdigest()[:12]
            for f in ("attention_fwd.py", "attention_bwd.py")}


def make_inputs(sh, seed):
    """bf16 q, dy ``[B, H, D, S]``, k, v ``[B, HKV, D, S]``; float32 sinks ``[B, H]`` when the shape has them."""
    rng = np.random.default_rng(seed)

    def rand(*shape):
        return rng.standard_normal(shape).astype(np.float32).astype(BF16)

    x = {"q": rand(sh.B, sh.H, sh.D, sh.S), "k": rand(sh.B, sh.HKV, sh.D, sh.S), "v": rand(sh.B, sh.HKV, sh.D, sh.S),
         "dy": rand(sh.B, sh.H, sh.D, sh.S), "sinks": None}
    if sh.sinks:
        x["sinks"] = rng.standard_normal((sh.B, sh.H)).astype(np.float32)
    return x


def golden_o_lse(sh, x):
    """o (bf16) and lse (float32) from the torch golden forward, mixed precision (the backward's inputs)."""
    from golden.attention_fwd_torch import attention_fwd_torch_ref
    from nki_attn.sim.runtime import _numpy_to_torch, _torch_to_numpy
    t = {k: (_numpy_to_torch(v) if v is not None else None) for k, v in x.items()}
    o, lse = attention_fwd_torch_ref(t["q"], t["k"], t["v"], sinks_ref=t["sinks"], use_causal_mask=sh.causal,
                                     mixed_precision=True, sliding_window=sh.window)
    return _torch_to_numpy(o), _torch_to_numpy(lse.float())


def visible_tile_pairs(sh):
    """(128-query x 512-key) tiles that hold at least one visible (query, key) pair, over all batches and heads."""
    i = np.arange(sh.S)[:, None]
    j = np.arange(sh.S)[None, :]
    vis = np.ones((sh.S, sh.S), bool)
    if sh.causal:
        vis &= j <= i
    if sh.window:
        vis &= j >= i - sh.window + 1
    per_head = vis.reshape(sh.S // Q_TILE, Q_TILE, sh.S // K_TILE, K_TILE).any(axis=(1, 3)).sum()
    return int(per_head) * sh.B * sh.H


# ----------------------------------------------------------------------------------------------------- runs
class Progress:
    def __init__(self, total):
        self.total, self.done, self.t0 = total, 0, time.perf_counter()

    def run(self, what, fn):
        """Run ``fn`` under the trace; returns (result, records)."""
        self.done += 1
        print(f"[{self.done}/{self.total}] {what} ...", end="", flush=True)
        t = time.perf_counter()
        # through nki.benchmark (the simulator's: modeled latency from the trace; a real NKI's on Trainium)
        out, res = run_benchmark(fn, (), warmup=0, iters=1)
        if res.records is None:
            raise SystemExit("a real NeuronDevice measured this run: the per-engine comparison needs the simulator")
        print(f" {time.perf_counter() - t:.1f} s, {len(res.records)} instructions, modeled "
              f"{res.nc_latency.get_latency_percentile(50):.1f} us (elapsed {time.perf_counter() - self.t0:.0f} s)",
              flush=True)
        return out, res.records


def _f32(a):
    return np.asarray(a).astype(np.float32)


def _mismatch(ours, theirs):
    """max |ours - theirs| / max |theirs|."""
    a, b = _f32(ours), _f32(theirs)
    return float(np.abs(a - b).max() / max(float(np.abs(b).max()), 1e-30))


def run_shape(name, sh, lib_bwd, lib_cte, kernels, prog, seed):
    """Run the chosen kernels (``bwd``, ``fwd``) of one shape, ours and the library's; returns
    ``{kernel: {"ours": records, "lib": records, "mismatch": {...}}}``."""
    from nki_attn.kernels.attention_bwd import attention_bwd
    from nki_attn.kernels.attention_fwd import attention_fwd

    x = make_inputs(sh, seed)
    out = {}
    if "fwd" in kernels:
        (o, lse), ours = prog.run(f"({name}) forward, ours: attention_fwd",
                                  lambda: attention_fwd(x["q"], x["k"], x["v"], sinks_ref=x["sinks"],
                                                        use_causal_mask=sh.causal, mixed_precision=True,
                                                        sliding_window=sh.window))
        scale = 1.0 / math.sqrt(sh.D)
        q = x["q"].reshape(sh.B * sh.H, sh.D, sh.S)
        if sh.window:  # the library asks for scale=1 with a sliding window: pre-scale q outside the trace
            q, scale = (q.astype(np.float32) * scale).astype(BF16), 1.0
        k = x["k"].reshape(sh.B * sh.HKV, sh.D, sh.S)
        v = np.ascontiguousarray(x["v"].reshape(sh.B * sh.HKV, sh.D, sh.S).transpose(0, 2, 1))
        kw = dict(scale=scale, causal_mask=sh.causal, sliding_window=sh.window, tp_q=False, tp_k=False,
                  tp_out=True, cache_softmax=True)
        if sh.sinks:
            kw["sink"] = x["sinks"].reshape(sh.B * sh.H, 1)
        (lo, neg_max, recip), lib = prog.run(f"({name}) forward, NKI Library: attention_cte",
                                             lambda: lib_cte(q, k, v, **kw))
        lib_lse = -_f32(neg_max) - np.log(_f32(recip))
        out["fwd"] = {"ours": ours, "lib": lib, "mismatch": {
            "o": _mismatch(o, _f32(lo).reshape(sh.B, sh.H, sh.D, sh.S)),
            "lse": _mismatch(lse, lib_lse.reshape(sh.B, sh.H, Q_TILE, -1))}}
    if "bwd" in kernels:
        o, lse = golden_o_lse(sh, x)
        kw = dict(sinks_ref=x["sinks"], use_causal_mask=sh.causal, mixed_precision=True, sliding_window=sh.window)
        grads, ours = prog.run(f"({name}) backward, ours: attention_bwd",
                               lambda: attention_bwd(x["q"], x["k"], x["v"], o, x["dy"], lse, **kw))
        lib_grads, lib = prog.run(f"({name}) backward, NKI Library: attention_bwd",
                                  lambda: lib_bwd(x["q"], x["k"], x["v"], o, x["dy"], lse, **kw))
        out["bwd"] = {"ours": ours, "lib": lib, "mismatch": {
            n: _mismatch(a, b) for n, a, b in zip(("dq", "dk", "dv", "dsinks"), grads, lib_grads)}}
    return out


def model_inputs(ms, S, seed):
    """One kv head's group of a model shape at ``S`` tokens: bf16 q ``[1, G, D, S]``, k ``[1, 1, D, S]``, v
    ``[1, 1, DV, S]``, dy ``[1, G, DV, S]``; float32 sinks ``[1, G]`` when the model has them."""
    rng = np.random.default_rng(seed)
    g, dv = ms.H // ms.HKV, ms.DV or ms.D

    def rand(*shape):
        return rng.standard_normal(shape).astype(np.float32).astype(BF16)
    x = {"q": rand(1, g, ms.D, S), "k": rand(1, 1, ms.D, S), "v": rand(1, 1, dv, S), "dy": rand(1, g, dv, S),
         "sinks": rng.standard_normal((1, g)).astype(np.float32) if ms.sinks else None}
    return x


def lib_unsupported(ms):
    """Why the NKI Library's kernels do not run this model shape (None: they do)."""
    if ms.softcap:
        return "no soft-capping in its attention_bwd / attention_cte"
    if ms.DV is not None and ms.DV != ms.D:
        return "d_qk != d_v"
    return None


def run_model_shape(name, ms, S, lib_bwd, lib_cte, prog, seed):
    """Both kernels of one model shape at ``S`` tokens, ours and (where it runs) the library's; returns
    ``{kernel: {"ours": records, "lib": records or None, "lib_why": reason or None}}``."""
    from nki_attn.kernels.attention_bwd import attention_bwd
    from nki_attn.kernels.attention_fwd import attention_fwd
    x = model_inputs(ms, S, seed)
    kw = dict(sinks_ref=x["sinks"], use_causal_mask=ms.causal, mixed_precision=True, sliding_window=ms.window)
    if ms.softcap:
        kw["softcap"] = ms.softcap
    tag = f"{name} S={S}"
    f_ours, f_why = None, None
    try:
        (o, lse), f_ours = prog.run(f"{tag} forward, ours", lambda: attention_fwd(x["q"], x["k"], x["v"], **kw))
    except Exception as e:  # our forward refusing a shape is a result too: the backward then runs on the golden's
        f_why = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:100]}"
        print(f" {f_why}")
        from golden.attention_fwd_torch import attention_fwd_torch_ref
        from nki_attn.sim.runtime import _numpy_to_torch, _torch_to_numpy
        t = {k: (_numpy_to_torch(v) if v is not None else None) for k, v in x.items()}
        o, lse = attention_fwd_torch_ref(t["q"], t["k"], t["v"], sinks_ref=t["sinks"], use_causal_mask=ms.causal,
                                         mixed_precision=True, sliding_window=ms.window, softcap=ms.softcap)
        o, lse = _torch_to_numpy(o), _torch_to_numpy(lse.float())
    _, b_ours = prog.run(f"{tag} backward, ours", lambda: attention_bwd(x["q"], x["k"], x["v"], o, x["dy"], lse, **kw))
    out = {"fwd": {"ours": f_ours, "lib": None, "ours_why": f_why}, "bwd": {"ours": b_ours, "lib": None}}
    why = lib_unsupported(ms)
    if why is None:
        g = ms.H // ms.HKV
        scale = 1.0 / math.sqrt(ms.D)
        q = x["q"].reshape(g, ms.D, S)
        if ms.window:  # the library asks for scale=1 with a sliding window
            q, scale = (q.astype(np.float32) * scale).astype(BF16), 1.0
        ckw = dict(scale=scale, causal_mask=ms.causal, sliding_window=ms.window, tp_q=False, tp_k=False,
                   tp_out=True, cache_softmax=True)
        if ms.sinks:
            ckw["sink"] = x["sinks"].reshape(g, 1)
        v = np.ascontiguousarray(x["v"].reshape(1, -1, S).transpose(0, 2, 1))
        try:
            _, out["fwd"]["lib"] = prog.run(f"{tag} forward, NKI Library",
                                            lambda: lib_cte(q, x["k"].reshape(1, ms.D, S), v, **ckw))
            _, out["bwd"]["lib"] = prog.run(f"{tag} backward, NKI Library",
                                            lambda: lib_bwd(x["q"], x["k"], x["v"], o, x["dy"], lse, **kw))
        except Exception as e:  # the library refusing a shape is a result, reported in the table
            why = f"refused: {type(e).__name__}: {str(e).splitlines()[0][:80]}"
            print(f" {why}")
    else:
        prog.done += 2
    for r in out.values():
        r["lib_why"] = why if r["lib"] is None else None
    return out


def model_figures(ms, S, kernel, r, gen):
    """Figures of one model shape's kernel: layer times (us, one NeuronCore: ``HKV`` x the simulated kv head),
    useful-FLOP bound, ratios (plain and the worst case over the sensitivity set)."""
    flops = model_flops(ms, S, kernel == "bwd")
    if r["ours"] is None:
        return {"ours_us": None, "floor_us": model_flops(ms, S, kernel == "bwd") / gen.peak_flops_per_ns / 1e3 * ms.HKV,
                "floor_ratio": None, "lib_us": None, "ratio": None, "worst_ratio": None, "lib_why": r["lib_why"],
                "ours_why": r.get("ours_why")}
    p = profile(r["ours"], gen, flops)
    f = {"ours_us": p.time_ns / 1e3 * ms.HKV, "floor_us": p.tensor_floor_ns / 1e3 * ms.HKV,
         "floor_ratio": p.floor_ratio("scheduled"), "lib_us": None, "ratio": None, "worst_ratio": None,
         "lib_why": r["lib_why"]}
    if r["lib"] is not None:
        f["lib_us"] = profile(r["lib"], gen).time_ns / 1e3 * ms.HKV
        sens = sensitivity(None, kernel, r["ours"], r["lib"], gen)
        f["ratio"], f["worst_ratio"] = sens["plain"], sens["combined"]
    return f


def print_model_steps(rows, target):
    print(f"\nModel shapes (MODELED on {target} by {MODEL}, not measured): one layer's attention of one sequence "
          f"on ONE NeuronCore, bf16 with mixed precision. Each row simulates one kv head with its query heads and "
          f"multiplies by the kv heads (the work items run back to back with the same instructions). ratio = ours "
          f"/ the NKI Library's scheduled time; worst case = all docs-uncertain parameters at the setting worst for "
          f"us at once; bound = the useful-FLOP bound (TensorE peak on the useful FLOPs); tokens/s = tokens / "
          f"(forward + backward) of the layer.\n")
    print("| model | tokens | kernel | ours us | NKI Library us | ratio | worst-case ratio | bound us | "
          "ours / bound | tokens/s per NeuronCore (fwd+bwd) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, S, figs in rows:
        both = figs["fwd"]["ours_us"] is not None and figs["bwd"]["ours_us"] is not None
        tps = f"{S / ((figs['fwd']['ours_us'] + figs['bwd']['ours_us']) * 1e-6):,.0f}" if both else "-"
        for kernel in ("fwd", "bwd"):
            f = figs[kernel]
            if f["ours_us"] is None:
                print(f"| {name} | {S} | {kernel} | - ({f['ours_why']}) | - | - | - | {f['floor_us']:.1f} | - | - |")
                continue
            lib = f"{f['lib_us']:.1f}" if f["lib_us"] is not None else f"- ({f['lib_why']})"
            rat = f"{f['ratio']:.2f}" if f["ratio"] is not None else "-"
            wr = f"**{f['worst_ratio']:.2f}**" if f["worst_ratio"] is not None else "-"
            print(f"| {name} | {S} | {kernel} | {f['ours_us']:.1f} | {lib} | {rat} | {wr} | {f['floor_us']:.1f} | "
                  f"{f['floor_ratio']:.2f} | {tps} |")


# The backward's design points (``attention_bwd`` tuning keywords; docs/kernel-bwd.md, "Tuning keywords"), each
# against the default for ``--ablation``.
ABLATION = (
    ("default", {}),
    ("no software pipeline: visit by visit", dict(pipe_lead=0, pipe_lag_b=0, pipe_lag_d=0)),
    ("pipeline without the load lead", dict(pipe_lead=0)),
    ("pipeline lags 1 / 2 (dV, dK / dQ)", dict(pipe_lag_b=1, pipe_lag_d=2)),
    ("pipeline lags 3 / 6", dict(pipe_lag_b=3, pipe_lag_d=6)),
    ("dS^T by DMA, every whole tile", dict(ds_dma_transpose=True)),
    ("dS^T by DMA, every 4th whole tile", dict(ds_dma_transpose=True, ds_dma_every=4)),
    ("P cast on ScalarE", dict(p_cast_on_gpsimd=False)),
    ("groups of 1 member (dV/dK out of PSUM per visit)", dict(group_max=1)),
    ("blocks of 1 member (one load per member)", dict(block_members_max=1)),
    ("K/V sections of 512 keys", dict(k_section_len=512)),
    ("K/V loaded per section, dK / dV stored at its end (no streamed keys)", dict(stream_keys=False)),
)


def run_ablation(name, sh, lib_bwd, prog, seed, gen):
    """Our backward at each design point of ``ABLATION`` on shape ``name``, and the library's once; returns
    ``[(label, knobs, ours_us, ratio, worst_ratio)]``."""
    from nki_attn.kernels.attention_bwd import attention_bwd
    x = make_inputs(sh, seed)
    o, lse = golden_o_lse(sh, x)
    kw = dict(sinks_ref=x["sinks"], use_causal_mask=sh.causal, mixed_precision=True, sliding_window=sh.window)
    _, lib = prog.run(f"({name}) backward, NKI Library", lambda: lib_bwd(x["q"], x["k"], x["v"], o, x["dy"], lse,
                                                                         **kw))
    rows = []
    for label, knobs in ABLATION:
        _, ours = prog.run(f"({name}) backward, ours, {label}",
                           lambda: attention_bwd(x["q"], x["k"], x["v"], o, x["dy"], lse, **kw, **knobs))
        sens = sensitivity(sh, "bwd", ours, lib, gen)
        rows.append((label, knobs, profile(ours, gen).time_ns / 1e3, sens["plain"], sens["combined"]))
    return rows


def print_ablation(name, rows, target):
    base = rows[0][2]
    print(f"\n({name}) backward design points (MODELED on {target} by {MODEL}, not measured; knobs are "
          f"attention_bwd keywords, e.g. nki-attn profile --kernel bwd --set KNOB=VALUE --vs default):\n")
    print("| design point | keywords | ours us | vs default | ratio to the NKI Library | worst-case ratio |")
    print("|---|---|---|---|---|---|")
    for label, knobs, us, ratio, worst in rows:
        kws = ", ".join(f"{k}={v}" for k, v in knobs.items()) or "-"
        print(f"| {label} | {kws} | {us:.1f} | {us / base:.2f} | {ratio:.2f} | **{worst:.2f}** |")


# ----------------------------------------------------------------------------------------------------- figures
def figures(sh, kernel, records, gen):
    """Modeled figures of one trace (times in us)."""
    flops = useful_attention_flops(sh.B, sh.H, sh.S, sh.S, sh.D, causal=sh.causal, window=sh.window,
                                   backward=kernel == "bwd")
    p = profile(records, gen, flops)
    pairs = visible_tile_pairs(sh)
    busy = {e: p.engine_busy(e) / 1e3 for e in ENGINES + RESOURCES}
    by_instr = {}
    for (e, instr), (n, ns) in p.by_instr.items():
        if e in ("VectorE", "ScalarE", "GpSimdE"):
            by_instr[f"{e} {instr}"] = {"count_per_pair": n / pairs, "us_per_pair": ns / 1e3 / pairs}
    return {
        "time_us": p.time_ns / 1e3, "overlap_us": p.time_overlap_ns / 1e3, "serial_us": p.time_serial_ns / 1e3,
        "bottleneck": p.bottleneck,
        "critical_path_us": {k: v / 1e3 for k, v in p.critical_path_by_kind().items()},
        "busy_us": busy, "per_pair_us": {e: b / pairs for e, b in busy.items()}, "tile_pairs": pairs,
        "floor_us": p.tensor_floor_ns / 1e3, "floor_ratio": p.floor_ratio("scheduled"),
        "useful_util": p.useful_tensor_utilisation(), "executed_util": p.tensor_utilisation(),
        "instructions": len(records), "dma_transfers": p.dma_transfers, "dependent": p.dependent,
        "by_instr": by_instr,
    }


def sensitivity_variants(gen):
    """``[(label, Generation)]``: each parameter the docs leave uncertain at its plausible extremes, one at a time
    (docs/performance.md, "Sensitivity")."""
    from dataclasses import replace
    return [
        ("dma_transpose efficiency 0.25", replace(gen, dma_transpose_sbuf_eff=0.25, dma_transpose_hbm_eff=0.45)),
        ("dma_transpose efficiency 0.5", replace(gen, dma_transpose_sbuf_eff=0.5, dma_transpose_hbm_eff=0.9)),
        ("GpSimd 1x VectorE", replace(gen, gpsimd_vector_factor=1.0)),
        ("GpSimd 4x VectorE", replace(gen, gpsimd_vector_factor=4.0)),
        ("fp32 VectorE 1 elem/lane/cycle", replace(gen, vector_width_other=128)),
        ("fp32 VectorE 2 elem/lane/cycle", replace(gen, vector_width_other=256)),
        ("DMA floor 0 ns", replace(gen, dma_min_piece_ns=0.0)),
        ("DMA floor 850 ns", replace(gen, dma_min_piece_ns=850.0)),
        ("access overhead 0", replace(gen, access_overhead_cycles=0)),
        ("access overhead 60", replace(gen, access_overhead_cycles=60)),
        ("hardware-DGE split off", replace(gen, dge_transpose_split=False)),
        ("hardware-DGE split on", replace(gen, dge_transpose_split=True)),
        ("semaphore wait 0", replace(gen, sem_wait_ns=0.0)),
        ("semaphore wait 1300 ns", replace(gen, sem_wait_ns=1300.0)),
    ]


def sensitivity(sh, kernel, rec_ours, rec_lib, gen):
    """Our time / the library's under every sensitivity variant, and under the combination of the individually
    worst settings for us; returns a dict with ``plain``, ``rows``, ``worst``, ``best``, ``combined``."""
    from dataclasses import replace

    def ratio(g):
        return profile(rec_ours, g).time_ns / profile(rec_lib, g).time_ns
    plain = ratio(gen)
    rows = [(label, ratio(g)) for label, g in sensitivity_variants(gen)]
    # the worst setting of each parameter (pairs of rows), combined
    changes = {}
    variants = sensitivity_variants(gen)
    for i in range(0, len(variants), 2):
        (la, ga), (lb, gb) = variants[i], variants[i + 1]
        pick = ga if dict(rows)[la] >= dict(rows)[lb] else gb
        changes.update({f: getattr(pick, f) for f in pick.__dataclass_fields__
                        if getattr(pick, f) != getattr(gen, f)})
    combined = ratio(replace(gen, **changes))
    worst = max(rows, key=lambda r: r[1])
    best = min(rows, key=lambda r: r[1])
    return {"plain": plain, "rows": rows, "worst": worst, "best": best, "combined": combined,
            "combined_changes": {k: v for k, v in changes.items()}}


def print_sensitivity(results):
    print(f"\nSensitivity (MODELED by {MODEL}): our time / the NKI Library's with each docs-uncertain parameter at "
          f"its extremes, one at a time, and all at the setting worst for us at once\n")
    print("| shape | kernel | plain | lowest (parameter) | highest (parameter) | all worst-for-us at once |")
    print("|---|---|---|---|---|---|")
    for name, per in results.items():
        for kernel in ("bwd", "fwd"):
            if kernel in per and "sens" in per[kernel]:
                s = per[kernel]["sens"]
                print(f"| ({name}) | {kernel} | {s['plain']:.2f} | {s['best'][1]:.2f} ({s['best'][0]}) | "
                      f"{s['worst'][1]:.2f} ({s['worst'][0]}) | **{s['combined']:.2f}** |")


def model_steps(sh, kernel, rec_ours, rec_lib, gen):
    """Our time / the library's under the earlier model and after each correction in turn (cumulative)."""
    names = list(CORRECTIONS)
    rows = []
    for k in range(len(names) + 1):
        g = revert(gen, names[k:])
        a = figures(sh, kernel, rec_ours, g)
        b = figures(sh, kernel, rec_lib, g)
        rows.append({"after": names[k - 1] if k else "earlier model", "ours_us": a["time_us"],
                     "lib_us": b["time_us"], "ratio": a["time_us"] / b["time_us"],
                     "ours_bottleneck": a["bottleneck"], "lib_bottleneck": b["bottleneck"]})
    return rows


# ----------------------------------------------------------------------------------------------------- output
def _us(v):
    return f"{v:.1f}"


def print_report(results, target, versions):
    print(f"\nAll device times are MODELED on {target} by {MODEL} (docs/performance.md), not measured.")
    print("ratio = our modeled time / the NKI Library's (scheduled time: the dependency-aware schedule)\n")
    print("| shape | kernel | ours us | NKI Library us | ratio | ours / floor | library / floor | floor us | "
          "bottleneck (ours / library) | max output mismatch |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, per in results.items():
        for kernel in ("bwd", "fwd"):
            if kernel not in per:
                continue
            r = per[kernel]
            a, b = r["ours_fig"], r["lib_fig"]
            mm = max(r["mismatch"].values())
            print(f"| ({name}) | {kernel} | {_us(a['time_us'])} | {_us(b['time_us'])} | "
                  f"**{a['time_us'] / b['time_us']:.2f}** | {a['floor_ratio']:.2f} | {b['floor_ratio']:.2f} | "
                  f"{_us(a['floor_us'])} | {a['bottleneck']} / {b['bottleneck']} | {mm:.1e} |")
    # shared resources no kernel used (e.g. the v2-only PSUM port on trn2) are left out
    used = {c for per in results.values() for r in per.values() for f in (r["ours_fig"], r["lib_fig"])
            for c in RESOURCES if f["busy_us"][c] > 0}
    cols = ENGINES + tuple(c for c in RESOURCES if c in used)
    short = {"VectorE/GpSimdE SBUF port": "V/G SBUF port", "VectorE/ScalarE PSUM port": "V/S PSUM port"}
    print("\nBusy time per engine and shared resource (us), and per (128-query x 512-key) tile pair (us/pair):\n")
    print("| shape | kernel | who | tile pairs | " + " | ".join(short.get(c, c) for c in cols) +
          " | useful util | executed util |")
    print("|---|---|---|---|" + "---|" * len(cols) + "---|---|")
    for name, per in results.items():
        for kernel in ("bwd", "fwd"):
            if kernel not in per:
                continue
            for who, key in (("ours", "ours_fig"), ("NKI Library", "lib_fig")):
                f = per[kernel][key]
                cells = " | ".join(f"{f['busy_us'][c]:.0f} ({f['per_pair_us'][c]:.2f})" for c in cols)
                print(f"| ({name}) | {kernel} | {who} | {f['tile_pairs']} | {cells} | {f['useful_util']:.1%} | "
                      f"{f['executed_util']:.1%} |")
    if versions:
        print("\nRatio under each version of the cost model (cumulative corrections, docs/performance.md):\n")
        print("| shape | kernel | model | ours us | NKI Library us | ratio | bottleneck (ours / library) |")
        print("|---|---|---|---|---|---|---|")
        for name, per in results.items():
            for kernel in ("bwd", "fwd"):
                for row in per.get(kernel, {}).get("steps", []):
                    print(f"| ({name}) | {kernel} | {row['after']} | {_us(row['ours_us'])} | {_us(row['lib_us'])} | "
                          f"{row['ratio']:.2f} | {row['ours_bottleneck']} / {row['lib_bottleneck']} |")


def print_breakdown(name, per, kernel):
    """Per tile pair: VectorE / ScalarE / GpSimdE time by instruction, ours beside the library's."""
    if kernel not in per:
        return
    a, b = per[kernel]["ours_fig"]["by_instr"], per[kernel]["lib_fig"]["by_instr"]
    keys = sorted(set(a) | set(b), key=lambda k: -max(a.get(k, {}).get("us_per_pair", 0),
                                                      b.get(k, {}).get("us_per_pair", 0)))
    print(f"\n({name}) {kernel}: element-wise engines per (128 x 512) tile pair, by instruction "
          f"(count / us per pair):\n")
    print("| engine instruction | ours | NKI Library |")
    print("|---|---|---|")
    for k in keys:
        cell = [f"{d[k]['count_per_pair']:.2f} / {d[k]['us_per_pair']:.3f}" if k in d else "-" for d in (a, b)]
        print(f"| {k} | {cell[0]} | {cell[1]} |")


# ----------------------------------------------------------------------------------------------------- main
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nkilib", required=True, help="root of a local aws-neuron/nki-library checkout")
    ap.add_argument("--target", default="trn2", choices=("trn1", "trn2", "trn3"))
    ap.add_argument("--shapes", default="a,b,c,d", help="comma-separated subset of a,b,c,d (default all)")
    ap.add_argument("--kernels", default="bwd,fwd", help="comma-separated subset of bwd,fwd (default both)")
    ap.add_argument("--max-bwd-ratio", type=float, help="fail if any backward ratio exceeds this")
    ap.add_argument("--max-fwd-ratio", type=float, help="fail if any forward ratio exceeds this")
    ap.add_argument("--max-bwd-floor-ratio", type=float,
                    help="fail if our backward at shape (a) exceeds this multiple of the useful-FLOP bound")
    ap.add_argument("--max-mismatch", type=float, default=0.05,
                    help="fail if ours and the library's outputs differ by more than this fraction of the "
                         "library's largest |value| (default 0.05: bf16 rounding stays near 1e-2)")
    ap.add_argument("--model-versions", action="store_true",
                    help="also print the ratios under each earlier version of the cost model")
    ap.add_argument("--model-steps", action="store_true",
                    help="also run the models preset's shapes (Llama-3 8B / 70B, Mistral, Gemma-2, GPT-OSS, "
                         "DeepSeek MLA; --models, --model-seqlens): one layer's forward + backward per NeuronCore")
    ap.add_argument("--models", default=",".join(MODEL_SHAPES),
                    help=f"comma-separated subset of {','.join(MODEL_SHAPES)} for --model-steps (default all)")
    ap.add_argument("--model-seqlens", default="4096",
                    help="comma-separated token counts for --model-steps, multiples of 512 (default 4096; 8192 "
                         "to 32768 take minutes to hours on the simulator)")
    ap.add_argument("--max-model-bwd-floor-ratio", type=float,
                    help="fail if our backward on a d128 / d256 model shape at >= 4096 tokens exceeds this multiple "
                         "of its useful-FLOP bound")
    ap.add_argument("--max-model-fwd-floor-ratio", type=float, help="the same for the forward")
    ap.add_argument("--ablation", action="store_true",
                    help="run our backward at each design point (tuning keywords) on --shapes, against the default "
                         "and the library, plain and worst case; skips the main comparison")
    ap.add_argument("--breakdown", default="a", help="shapes whose per-instruction breakdown to print ('' none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="F", help="write all figures as JSON to F")
    ap.add_argument("--sensitivity", action="store_true",
                    help="re-cost the same traces with each docs-uncertain parameter at its extremes and print the "
                         "plain and worst-case ratios per shape")
    args = ap.parse_args(argv)
    args.shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    bad_m = [m for m in args.models if m not in MODEL_SHAPES]
    if bad_m:
        ap.error(f"--models takes a subset of {','.join(MODEL_SHAPES)}; got {bad_m}")
    try:
        args.model_seqlens = [int(v) for v in args.model_seqlens.split(",") if v.strip()]
    except ValueError:
        ap.error(f"--model-seqlens takes integers, got {args.model_seqlens!r}")
    if not args.model_seqlens or any(v < 512 or v % 512 for v in args.model_seqlens):
        ap.error(f"--model-seqlens takes multiples of 512, got {args.model_seqlens}")
    args.kernels = [k.strip() for k in args.kernels.split(",") if k.strip()]
    bad = [s for s in args.shapes if s not in SHAPES] + [k for k in args.kernels if k not in ("bwd", "fwd")]
    if bad or not args.shapes or not args.kernels:
        ap.error(f"--shapes takes a subset of {','.join(SHAPES)} and --kernels of bwd,fwd; got {bad or 'nothing'}")
    for name in ("max_bwd_ratio", "max_fwd_ratio", "max_bwd_floor_ratio", "max_mismatch",
                 "max_model_bwd_floor_ratio", "max_model_fwd_floor_ratio"):
        v = getattr(args, name)
        if v is not None and not v > 0:
            ap.error(f"--{name.replace('_', '-')} must be > 0, got {v}")
    return args


def check_limits(results, args, model_rows=()):
    """Messages for every figure past its limit. With ``--sensitivity`` the ratio limits apply to the worst case
    (all docs-uncertain parameters at the setting worst for us at once), else to the plain ratio."""
    fails = []
    for name, per in results.items():
        for kernel, limit in (("bwd", args.max_bwd_ratio), ("fwd", args.max_fwd_ratio)):
            if kernel in per and limit is not None:
                r = per[kernel]["ours_fig"]["time_us"] / per[kernel]["lib_fig"]["time_us"]
                if r > limit:
                    fails.append(f"({name}) {kernel}: ratio {r:.2f} > --max-{kernel}-ratio {limit}")
                if "sens" in per[kernel] and per[kernel]["sens"]["combined"] > limit:
                    fails.append(f"({name}) {kernel}: worst-case ratio {per[kernel]['sens']['combined']:.2f} > "
                                 f"--max-{kernel}-ratio {limit}")
        if name == "a" and "bwd" in per and args.max_bwd_floor_ratio is not None:
            fr = per["bwd"]["ours_fig"]["floor_ratio"]
            if fr > args.max_bwd_floor_ratio:
                fails.append(f"(a) bwd: {fr:.2f}x the useful-FLOP bound > --max-bwd-floor-ratio "
                             f"{args.max_bwd_floor_ratio}")
        for kernel in per:
            for out, m in per[kernel]["mismatch"].items():
                if not m <= args.max_mismatch:
                    fails.append(f"({name}) {kernel}: output {out} differs from the library's by {m:.2e} of its "
                                 f"largest value (> --max-mismatch {args.max_mismatch}): not the same problem?")
    for name, S, figs in model_rows:
        ms = MODEL_SHAPES[name]
        for kernel in ("bwd", "fwd"):
            limit = getattr(args, f"max_model_{kernel}_floor_ratio", None)
            fr = figs[kernel]["floor_ratio"]
            if limit is not None and ms.D in (128, 256) and S >= 4096 and (fr is None or fr > limit):
                fails.append(f"{name} S={S} {kernel}: " + ("did not run" if fr is None else
                             f"{fr:.2f}x the useful-FLOP bound > --max-model-{kernel}-floor-ratio {limit}"))
    return fails


def main(argv=None):
    args = parse_args(argv)
    lib_bwd, lib_cte, commit = load_library(args.nkilib)
    gen = generation(args.target)
    os.environ["NEURON_PLATFORM_TARGET_OVERRIDE"] = args.target
    versions = kernel_versions()
    print(f"NKI Library at {commit}; our kernels (sha256[:12]): "
          + ", ".join(f"{k} {v}" for k, v in versions.items()))
    if args.ablation:
        prog = Progress(len(args.shapes) * (1 + len(ABLATION)))
        for name in args.shapes:
            print_ablation(name, run_ablation(name, SHAPES[name], lib_bwd, prog, args.seed, gen), args.target)
        return 0
    runs = len(args.shapes) * 2 * len(args.kernels)
    if args.model_steps:
        runs += 4 * len(args.models) * len(args.model_seqlens)
    prog = Progress(runs)
    results = {}
    for name in args.shapes:
        sh = SHAPES[name]
        per = run_shape(name, sh, lib_bwd, lib_cte, args.kernels, prog, args.seed)
        for kernel, r in per.items():
            r["ours_fig"] = figures(sh, kernel, r["ours"], gen)
            r["lib_fig"] = figures(sh, kernel, r["lib"], gen)
            if args.model_versions:
                r["steps"] = model_steps(sh, kernel, r["ours"], r["lib"], gen)
            if args.sensitivity:
                r["sens"] = sensitivity(sh, kernel, r["ours"], r["lib"], gen)
        results[name] = per
    model_rows = []
    if args.model_steps:
        for name in args.models:
            for S in args.model_seqlens:
                ms = MODEL_SHAPES[name]
                r = run_model_shape(name, ms, S, lib_bwd, lib_cte, prog, args.seed)
                model_rows.append((name, S, {k: model_figures(ms, S, k, r[k], gen) for k in ("fwd", "bwd")}))
    print_report(results, args.target, args.model_versions)
    if args.sensitivity:
        print_sensitivity(results)
    if model_rows:
        print_model_steps(model_rows, args.target)
    for name in [s.strip() for s in args.breakdown.split(",") if s.strip() in results]:
        for kernel in ("bwd", "fwd"):
            print_breakdown(name, results[name], kernel)
    fails = check_limits(results, args, model_rows)
    if args.json:
        dump = {"target": args.target, "modeled": True, "model": MODEL, "nki_library_commit": commit,
                "kernel_sha256_12": versions,
                "shapes": {n: SHAPES[n].__dict__ for n in results},
                "results": {n: {k: {kk: vv for kk, vv in r.items() if kk not in ("ours", "lib")}
                                for k, r in per.items()} for n, per in results.items()},
                "model_shapes": [{"model": n, "tokens": S, **figs} for n, S, figs in model_rows],
                "limit_failures": fails}
        pathlib.Path(args.json).write_text(json.dumps(dump, indent=1))
        print(f"\nwrote {args.json}")
    if fails:
        print("\nPAST THE LIMITS:\n  " + "\n  ".join(fails))
        return 1
    print("\nall figures within the given limits" if any(
        getattr(args, n) is not None for n in ("max_bwd_ratio", "max_fwd_ratio", "max_bwd_floor_ratio",
                                               "max_model_bwd_floor_ratio", "max_model_fwd_floor_ratio"))
        else "\n(no ratio limits given)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
