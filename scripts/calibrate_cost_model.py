"""Check the cost model against real hardware: public kernels whose timings AWS published, run unmodified on the
simulator and profiled by the cost model, side by side with the published figure.

The kernels and the figures live in the public aws-neuron/aws-neuron-sdk repository, which is not part of this
one: point the script at a local checkout (or set ``NKI_ATTN_SDK``)::

    python scripts/calibrate_cost_model.py --sdk /path/to/aws-neuron-sdk [--only trn2-mm,trn1-mm,mamba]
        [--cache DIR] [--json out.json] [--markdown]

The points (each with the file and line, or the screenshot, its figure comes from):

- trn2, fp32 matmul tutorial (``nki/guides/tutorials/kernel-optimization.rst``), versions v2-v5, lhsT [8192, 4096]
  and rhs [8192, 8192]: the kernels are the tutorial's code blocks, read from the .rst; the figures are read off
  its neuron-profile screenshots ``nki/img/how-to/v{2..5}-{full,pe,dma}.png``: total time (time axis of ``-full``),
  "Tensor Engine Active Time" (``-pe``) and "Dma Active Time" (``-dma``: the time at least one DMA queue is busy).
- trn1, bf16 matmul tutorial: the four kernels of ``nki/examples/matrix_multiplication/
  matrix_multiplication_nki_kernels.py`` (the current-API port of the ones the figures were measured with) at
  [4096, 8192] @ [8192, 8192]; figures: ``general/nki/tutorials/matrix_multiplication.rst`` at commit 8a38e733,
  lines 341-347 (``nki.benchmark`` latency on Trn1.32xlarge).
- fused Mamba tutorial (``nki/guides/tutorials/fused_mamba.rst``, the seq_len sweep table at lines 872-924;
  batch 1, channels 4096, state_size 16, fp32): kernels ``mamba_v2`` / ``mamba_v3`` of
  ``nki/examples/fused_mamba/mamba_nki_kernels.py``. The tutorial does not state the generation; the script costs
  both trn1 and trn2 and gates on trn2 (see docs/performance.md, "Calibration", for why).

Each kernel runs once on the simulator with the instruction trace on (capacity checks off: the real compiler
places these kernels' tiles, spilling where it must, while the simulator counts every Python-held tile as live;
the kernel code is untouched). The fp32 tutorial returns a tensor allocated in ``nl.hbm``, which the simulator
refuses only after the kernel has run, so the full trace is kept. Traces do not depend on the cost model's
parameters, so they are cached (``--cache``, default ``~/.cache/nki_attn_calibration``, keyed by kernel source,
arguments, target and the simulator's source): the first run takes minutes (the [4096, 8192] @ [8192, 8192]
matmuls are ~100 000 instructions each), a re-run after a model change seconds.

It prints one row per published figure: point, metric, published, source, modeled, ratio, and exits 1 when any
gated ratio is outside 1 +- 15 % (``--tolerance``). Every modeled figure is MODELED by the cost model named in
``nki_attn.profiler.params.MODEL``, never measured.
"""
import argparse
import hashlib
import importlib.util
import json
import os
import pathlib
import pickle
import re
import sys
import textwrap
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import nki_attn.sim as sim  # noqa: E402
from nki_attn.profiler import generation, profile  # noqa: E402
from nki_attn.profiler.params import MODEL  # noqa: E402
from nki_attn.sim import trace  # noqa: E402

MS = 1e6  # ns per ms

KO_RST = "nki/guides/tutorials/kernel-optimization.rst"
MM_KERNELS = "nki/examples/matrix_multiplication/matrix_multiplication_nki_kernels.py"
MM_RST_OLD = "general/nki/tutorials/matrix_multiplication.rst@8a38e733"
MAMBA_KERNELS = "nki/examples/fused_mamba/mamba_nki_kernels.py"
MAMBA_RST = "nki/guides/tutorials/fused_mamba.rst"

# (version, total ms, TensorE active ms, DMA active ms), read off the screenshots of KO_RST.
TRN2_MM = [(2, 39.89, 34.82, 39.87), (3, 28.20, 28.16, 28.12), (4, 28.41, 28.28, 27.19), (5, 28.30, 28.16, 6.10)]
# (kernel function, published ms, line in MM_RST_OLD)
TRN1_MM = [("nki_matmul_tiled_", 51.80, 341), ("nki_matmul_hoist_load_", 42.96, 343),
           ("nki_matmul_block_free_dimension_", 22.07, 345), ("nki_matmul_fully_optimized_", 6.97, 347)]
# (kernel, seq_len, published ms, line in MAMBA_RST)
MAMBA = [("mamba_v3", 512, 1.6, 876), ("mamba_v3", 2048, 6.6, 888), ("mamba_v3", 8192, 27.8, 924),
         ("mamba_v2", 512, 1.6, 874), ("mamba_v2", 1024, 4.4, 880)]
MAMBA_GATED_TARGET = "trn2"
MAMBA_TRN1_SEQ = (512, 2048)  # trn1 is costed at these only, to show which generation fits (not gated)
# Points the model cannot reach with physically sensible parameters, and why (printed, not gated).
SPILL = ("the kernel's tiles exceed SBUF (the simulator's capacity check refuses it), so the compiler spilled; "
         "the spill/reload DMA traffic is not in the simulator's trace")
EXCLUDED = {
    ("trn2 fp32 matmul v4", "DMA active"): SPILL + " (hardware: same DMA packet time as v3 for half the bytes)",
    ("trn2 fp32 matmul v5", "DMA active"): "the simulator gives every tile fresh storage, so loads run ahead of "
                                           "the matmuls and their queues stay full; on hardware the compiler's "
                                           "buffer reuse spaces them out and each transfer's latency shows "
                                           "(published 6.10 ms for ~1.4 GiB, 230 GB/s, below v3's 305 GB/s)",
    ("trn2 fp32 mamba_v2 seq_len=1024", "total"): "mamba_v2's measured latency grows faster than its work (the "
                                                  "tutorial's table: 72 % scaling efficiency from 1024 on, SBUF "
                                                  "spill/reload rows in its profiles); the trace's work grows "
                                                  "linearly",
}


def sdk_path(arg):
    path = arg or os.environ.get("NKI_ATTN_SDK")
    if not path:
        raise SystemExit("calibrate_cost_model: give --sdk PATH (a checkout of aws-neuron/aws-neuron-sdk) or set "
                         "NKI_ATTN_SDK")
    p = pathlib.Path(path)
    if not (p / KO_RST).is_file():
        raise SystemExit(f"calibrate_cost_model: --sdk {path}: no {KO_RST} there; expected the root of an "
                         f"aws-neuron/aws-neuron-sdk checkout")
    return p


def _sim_digest():
    h = hashlib.sha256()
    # the simulator's sources decide the trace (benchmark.py only wraps launches: left out)
    for f in sorted((ROOT / "nki_attn" / "sim").glob("*.py")):
        if f.name != "benchmark.py":
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


class Runner:
    """Runs kernels under the trace, with an on-disk cache of the records."""

    def __init__(self, cache):
        self.cache = pathlib.Path(cache) if cache else None
        self.sim_digest = _sim_digest()

    def records(self, label, source, fn, args, target):
        key = hashlib.sha256(repr((source, [(a.shape, str(a.dtype)) for a in args], target,
                                   self.sim_digest)).encode()).hexdigest()[:24]
        path = self.cache / f"{key}.pkl" if self.cache else None
        if path is not None and path.is_file():
            with open(path, "rb") as f:
                return pickle.load(f)
        prev = os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE")
        os.environ["NEURON_PLATFORM_TARGET_OVERRIDE"] = target
        t0 = time.perf_counter()
        try:
            with trace.recording() as rec, sim.checking(capacity=False):
                try:
                    fn(*args)
                except sim.NkiValidationError as exc:
                    # Only the check on the returned tensor's buffer, made after the kernel ran, is tolerated.
                    if "kernel outputs must be allocated" not in str(exc):
                        raise
        finally:
            if prev is None:
                os.environ.pop("NEURON_PLATFORM_TARGET_OVERRIDE", None)
            else:
                os.environ["NEURON_PLATFORM_TARGET_OVERRIDE"] = prev
        print(f"  simulated {label} on {target}: {len(rec.records)} instructions, "
              f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "wb") as f:
                pickle.dump(rec.records, f)
        return rec.records


def _module(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rst_kernels(rst_text):
    """The tutorial's kernel code blocks (``def matrix_multiply_kernel``), in document order: v1, v2, ..."""
    blocks = re.findall(r"\.\. code-block:: python\n\n((?:[ \t]+.*\n|[ \t]*\n)+)", rst_text)
    return [textwrap.dedent(b) for b in blocks if "def matrix_multiply_kernel" in b]


# ----------------------------------------------------------------------------------------------------- points
def trn2_matmul(sdk, runner):
    blocks = _rst_kernels((sdk / KO_RST).read_text())
    rng = np.random.default_rng(0)
    lhsT = rng.random((8192, 4096), dtype=np.float32)
    rhs = rng.random((8192, 8192), dtype=np.float32)
    rows = []
    for v, total, pe, dma in TRN2_MM:
        code = blocks[v - 1]
        ns = {}
        exec(compile(code, f"{KO_RST} (v{v})", "exec"), ns)  # the block sets its own target: trn2
        recs = runner.records(f"matmul v{v}", code, ns["matrix_multiply_kernel"], (lhsT, rhs), "trn2")
        p = profile(recs, generation("trn2"))
        s = p.schedule
        img = f"nki/img/how-to/v{v}"
        pt = f"trn2 fp32 matmul v{v}"
        rows += [(pt, "total", total, f"{img}-full.png (time axis)", p.time_ns / MS, True),
                 (pt, "TensorE active", pe, f"{img}-pe.png (Tensor Engine Active Time)",
                  s.active_ns("TensorE") / MS, True),
                 (pt, "DMA active", dma, f"{img}-dma.png (Dma Active Time)", s.active_ns("DMA q") / MS,
                  (pt, "DMA active") not in EXCLUDED)]
    return rows


def trn1_matmul(sdk, runner):
    import ml_dtypes
    sim.install_as_nki(force=True)
    mod = _module(sdk / MM_KERNELS, "calib_mm_kernels")
    src = (sdk / MM_KERNELS).read_text()
    rng = np.random.default_rng(0)
    lhsT = rng.random((8192, 4096), dtype=np.float32).astype(ml_dtypes.bfloat16)
    rhs = rng.random((8192, 8192), dtype=np.float32).astype(ml_dtypes.bfloat16)
    rows = []
    for name, ms, line in TRN1_MM:
        recs = runner.records(name, src + name, getattr(mod, name), (lhsT, rhs), "trn1")
        p = profile(recs, generation("trn1"))
        rows.append((f"trn1 bf16 matmul {name.strip('_')}", "total", ms, f"{MM_RST_OLD} L{line}",
                     p.time_ns / MS, True))
    return rows


def mamba(sdk, runner):
    sim.install_as_nki(force=True)
    mod = _module(sdk / MAMBA_KERNELS, "calib_mamba_kernels")
    src = (sdk / MAMBA_KERNELS).read_text()
    rows = []
    for name, seq, ms, line in MAMBA:
        b, c, st = 1, 4096, 16
        f32 = np.float32
        # the tutorial's own perf-mode inputs
        args = (np.ones((b, c, seq), f32), np.ones((b, c, seq), f32), -np.ones((c, st), f32),
                np.ones((b, st, seq), f32), np.ones((b, st, seq), f32))
        for target in ("trn2", "trn1"):
            if target == "trn1" and seq not in MAMBA_TRN1_SEQ:
                continue
            recs = runner.records(f"{name} seq_len={seq}", src + name, getattr(mod, name), args, target)
            p = profile(recs, generation(target))
            pt = f"{target} fp32 {name} seq_len={seq}"
            gated = target == MAMBA_GATED_TARGET and (pt, "total") not in EXCLUDED
            rows.append((pt, "total", ms, f"{MAMBA_RST} L{line}", p.time_ns / MS, gated))
    return rows


POINT_SETS = {"trn2-mm": trn2_matmul, "trn1-mm": trn1_matmul, "mamba": mamba}


def markdown(rows, tol):
    out = [f"| point | metric | published (ms) | source | modeled (ms) | ratio | within {tol:.0%} |",
           "|---|---|---|---|---|---|---|"]
    for point, metric, pub, src, mod, gated in rows:
        r = mod / pub
        ok = ("yes" if abs(r - 1) <= tol else "**no**") if gated else "not gated"
        out.append(f"| {point} | {metric} | {pub:.2f} | {src} | {mod:.2f} | {r:.2f} | {ok} |")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sdk", help="root of an aws-neuron/aws-neuron-sdk checkout (default: $NKI_ATTN_SDK)")
    ap.add_argument("--only", default=",".join(POINT_SETS), help=f"comma-separated subset of {list(POINT_SETS)}")
    ap.add_argument("--cache", default=os.path.expanduser("~/.cache/nki_attn_calibration"),
                    help="directory of cached traces ('' for none)")
    ap.add_argument("--tolerance", type=float, default=0.15, help="allowed |modeled / published - 1|")
    ap.add_argument("--json", help="write the rows as JSON")
    ap.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    args = ap.parse_args(argv)
    sdk = sdk_path(args.sdk)
    sim.install_as_nki(force=True)
    runner = Runner(args.cache or None)
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    bad = [n for n in names if n not in POINT_SETS]
    if bad:
        ap.error(f"--only: unknown {bad}; choose from {list(POINT_SETS)}")
    rows = []
    for n in names:
        rows += POINT_SETS[n](sdk, runner)
    print(f"Modeled by {MODEL}; published figures are hardware measurements.\n")
    if args.markdown:
        print(markdown(rows, args.tolerance))
    else:
        print(f"{'point':<44}{'metric':<16}{'published':>10}{'modeled':>10}{'ratio':>7}  source")
        for point, metric, pub, src, mod, gated in rows:
            flag = "" if not gated else ("" if abs(mod / pub - 1) <= args.tolerance else "  <-- outside")
            print(f"{point:<44}{metric:<16}{pub:>10.2f}{mod:>10.2f}{mod / pub:>7.2f}  {src}"
                  f"{'' if gated else '  (not gated)'}{flag}")
    for (pt, metric), why in EXCLUDED.items():
        print(f"not gated: {pt}, {metric}: {why}")
    print("not gated: trn1 fp32 mamba rows (the tutorial does not state the generation; trn2 is the one gated)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": MODEL, "tolerance": args.tolerance,
                       "rows": [dict(zip(("point", "metric", "published_ms", "source", "modeled_ms", "gated"), r))
                                for r in rows]}, f, indent=1)
    failed = [r for r in rows if r[5] and abs(r[4] / r[2] - 1) > args.tolerance]
    print(f"\n{len(rows) - len(failed)} of {len(rows)} points fine; {len(failed)} gated point(s) outside "
          f"+-{args.tolerance:.0%}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
