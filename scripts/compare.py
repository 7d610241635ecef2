"""Comparisons with external references, one subcommand each.

    python scripts/compare.py flash-attention --flash-attn PATH [--dtypes bf16 fp16] [--variants ...]

The NKI Library benchmark (scripts/bench_vs_nki_library.py) and the public-kernel conformance of the simulator
(scripts/conformance_public_kernels.py) have scripts of their own.

flash-attention: FlashAttention's own reference implementation against ours: soft-capping, ALiBi, two-sided
windows, causal with seqlen_q != seqlen_k, d_qk != d_v, forward and backward, under FlashAttention's rule.

FlashAttention is not part of this repository: point the subcommand at a local checkout of the public
Dao-AILab/flash-attention repository (its ``tests/test_flash_attn.py`` defines ``attention_ref`` and
``attn_bias_from_alibi_slopes``), after ``pip install einops`` (the reference's one dependency beyond torch),
with ``--flash-attn PATH`` or ``FLASH_ATTENTION_REPO``. The test module is imported as it is; the two things
it needs that a CPU machine lacks are stubbed for the duration of the import only: the ``flash_attn`` package
(the CUDA kernels it tests, never called here) and ``torch.cuda.get_device_capability`` (read at import time to
pick test parameters).

The rule, as FlashAttention's tests apply it (``test_flash_attn_output``, ``test_flash_attn_causal``): with the
reference run in float32 on the same (rounded) inputs as ``ref`` and the same reference run in the input dtype
with its operations reordered (``upcast=False, reorder_ops=True``) as ``pt``, a kernel passes when for each
tensor ``max|ours - ref| <= 2 * max|pt - ref|``. FlashAttention applies 2x to the output and 2x or 3x to the
gradients depending on the test; here 2x applies to o, dq, dk and dv alike. By default ``ref`` is the same
function run in float64 (``--reference float32`` for FlashAttention's exact choice: float32 compute, result
rounded to the input dtype). Inputs follow the tests too: N(0, 1), q multiplied by the cap when soft-capping (so
the scores reach the tanh's saturating range), ALiBi slopes U[0, 0.3) per (batch, head), FlashAttention's
causal ALiBi bias (``-slope * (seqlen_k - 1 - j)``), which differs from ours (``-slope * |i + off - j|``) by a
constant per query row: o and the gradients are the same, the LSE is not (docs/semantics.md), so the LSE is not
compared.

It prints one row per (variant, dtype) with each tensor's error ratio ours / pt (<= 2 passes), and exits 1 when a
row fails, 2 on bad arguments (a path that is not a FlashAttention checkout, a missing einops).
"""
import argparse
import contextlib
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import time
import types

import torch

ENV = "FLASH_ATTENTION_REPO"
RULE = 2.0
TENSORS = ("o", "dq", "dk", "dv")
DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}

# name -> (seqlen_q, seqlen_k, d_qk, d_v, causal, window_size, softcap, alibi); batch 2, 4 query / 2 kv heads
VARIANTS = {
    "softcap": (256, 256, 64, 64, False, (-1, -1), 50.0, False),
    "softcap-causal": (256, 256, 64, 64, True, (-1, -1), 50.0, False),
    "alibi": (256, 256, 64, 64, False, (-1, -1), 0.0, True),
    "alibi-causal": (256, 256, 64, 64, True, (-1, -1), 0.0, True),
    "alibi-causal-sq<sk": (128, 384, 64, 64, True, (-1, -1), 0.0, True),
    "local": (256, 256, 64, 64, False, (40, 17), 0.0, False),
    "local-causal": (256, 256, 64, 64, True, (75, -1), 0.0, False),
    "local-sq>sk": (384, 256, 64, 64, False, (30, 50), 0.0, False),
    "causal-sq<sk": (113, 203, 64, 64, True, (-1, -1), 0.0, False),
    "causal-sq>sk": (384, 256, 64, 64, True, (-1, -1), 0.0, False),
    "dqk192-dv128": (256, 256, 192, 128, True, (-1, -1), 0.0, False),
    "d80": (256, 256, 80, 80, True, (-1, -1), 0.0, False),
    "softcap+alibi+local": (256, 384, 64, 64, False, (60, 30), 50.0, True),
}
BATCH, HEADS, KV_HEADS = 2, 4, 2


@contextlib.contextmanager
def _cpu_import_shims():
    """For the import of FlashAttention's test module only: a stub ``flash_attn`` package (its names resolve to
    placeholders that raise if called) and a CUDA capability query that answers instead of failing."""
    def placeholder(name):
        def fail(*a, **k):
            raise RuntimeError(f"flash_attn.{name} is a stub: the CUDA kernels are not available here")
        return fail

    names = ["flash_attn", "flash_attn.bert_padding", "flash_attn.flash_attn_interface", "flash_attn.layers",
             "flash_attn.layers.rotary"]
    saved = {n: sys.modules.get(n) for n in names}
    for n in names:
        mod = types.ModuleType(n)
        mod.__getattr__ = placeholder  # PEP 562: any name imported from the stub is a placeholder
        mod.__path__ = []
        sys.modules[n] = mod
    cap = torch.cuda.get_device_capability
    torch.cuda.get_device_capability = lambda *a, **k: (8, 0)
    try:
        yield
    finally:
        torch.cuda.get_device_capability = cap
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m


def load_reference(path):
    """``(attention_ref, attn_bias_from_alibi_slopes, commit)`` from a FlashAttention checkout; ValueError when
    the path is not one or einops is missing."""
    test = pathlib.Path(path) / "tests" / "test_flash_attn.py"
    if not test.is_file():
        raise ValueError(f"--flash-attn {path}: no tests/test_flash_attn.py there; give a checkout of the public "
                         f"Dao-AILab/flash-attention repository")
    if importlib.util.find_spec("einops") is None:
        raise ValueError("FlashAttention's reference needs einops: pip install einops")
    spec = importlib.util.spec_from_file_location("flash_attn_reference_tests", test)
    mod = importlib.util.module_from_spec(spec)
    with _cpu_import_shims():
        spec.loader.exec_module(mod)
    for name in ("attention_ref", "attn_bias_from_alibi_slopes"):
        if not hasattr(mod, name):
            raise ValueError(f"--flash-attn {path}: tests/test_flash_attn.py has no {name}")
    try:
        commit = subprocess.run(["git", "-C", str(path), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    return mod.attention_ref, mod.attn_bias_from_alibi_slopes, commit


def _grads(fn, q, k, v, g):
    """fn(q, k, v) -> o; returns o and (dq, dk, dv) for the output gradient g (fresh leaves, no side effects)."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o = fn(q, k, v)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), g.to(o.dtype))
    return {"o": o.detach(), "dq": dq, "dk": dk, "dv": dv}


def check_variant(name, dtype, attention_ref, alibi_bias_fn, reference="float64", seed=0):
    """One (variant, dtype) row: errors of ours and of FlashAttention's same-dtype reference against the
    float64 (or float32) reference, their ratios, and the verdict."""
    from nki_attn import flash_attn_func

    sq, sk, dqk, dv, causal, window, softcap, alibi = VARIANTS[name]
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(BATCH, sq, HEADS, dqk, generator=g)
    k = torch.randn(BATCH, sk, KV_HEADS, dqk, generator=g)
    v = torch.randn(BATCH, sk, KV_HEADS, dv, generator=g)
    if softcap:
        q = q * softcap  # as FlashAttention's tests: scores large enough for the cap to bite
    q, k, v = (t.to(dtype) for t in (q, k, v))
    do = torch.randn(BATCH, sq, HEADS, dv, generator=g).to(dtype)
    slopes = (torch.rand(BATCH, HEADS, generator=g) * 0.3) if alibi else None
    bias = alibi_bias_fn(slopes, sq, sk, causal=causal) if alibi else None  # FlashAttention's convention

    def fa(upcast, reorder, as_dtype=None):
        def run(q_, k_, v_):
            if as_dtype is not None:
                q_, k_, v_ = (t.to(as_dtype) for t in (q_, k_, v_))
            # the bias as FlashAttention's tests pass it (float32), or in float64 for the float64 reference
            b = None if bias is None else bias.to(as_dtype or torch.float32)
            return attention_ref(q_, k_, v_, None, None, b, 0.0, None, causal=causal, window_size=window,
                                 softcap=softcap, upcast=upcast, reorder_ops=reorder)[0]
        return run

    if reference == "float64":
        ref = _grads(fa(False, False, torch.float64), q, k, v, do)
    else:  # FlashAttention's: float32 compute, rounded to the input dtype
        ref = _grads(fa(True, False), q, k, v, do)
    pt = _grads(fa(False, True), q, k, v, do)
    out = {"variant": name, "dtype": str(dtype).split(".")[-1], "shape": f"{sq}x{sk} d{dqk}/{dv}",
           "causal": causal, "window_size": list(window), "softcap": softcap, "alibi": alibi, "tensors": {}}
    try:
        ours = _grads(lambda q_, k_, v_: flash_attn_func(q_, k_, v_, causal=causal, window_size=window,
                                                         softcap=softcap, alibi_slopes=slopes), q, k, v, do)
    except (ValueError, NotImplementedError) as exc:  # a variant this build refuses: a failing row, said why
        out.update(error=f"{type(exc).__name__}: {exc}", **{"pass": False})
        return out
    for t in TENSORS:
        r = ref[t].double()
        e_ours = (ours[t].double() - r).abs().max().item()
        e_pt = (pt[t].double() - r).abs().max().item()
        ok = bool(e_ours <= RULE * e_pt)
        out["tensors"][t] = {"ours": e_ours, "pt": e_pt, "ratio": e_ours / e_pt if e_pt else float("inf"),
                             "ok": ok}
    out["pass"] = all(v["ok"] for v in out["tensors"].values())
    return out


def table(rows):
    head = f"{'variant':<22}{'dtype':<10}{'shape':<18}" + "".join(f"{t + ' ours/pt':>18}" for t in TENSORS) + "  pass"
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['variant']:<22}{r['dtype']:<10}{r['shape']:<18}  refused: {r['error'][:120]}")
            continue
        cells = "".join(f"{x['ratio']:.3f} ({x['ours']:.1e})".rjust(18) for x in r["tensors"].values())
        lines.append(f"{r['variant']:<22}{r['dtype']:<10}{r['shape']:<18}{cells}  {'ok' if r['pass'] else 'FAIL'}")
    return "\n".join(lines)


def args_flash_attention(ap):
    ap.add_argument("--flash-attn", metavar="PATH", default=os.environ.get(ENV),
                    help=f"checkout of Dao-AILab/flash-attention (default: ${ENV})")
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "fp16"], choices=sorted(DTYPES))
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--reference", choices=("float64", "float32"), default="float64",
                    help="the reference errors are measured against (float32: FlashAttention's own choice)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="F", help="write the rows as JSON to F")


def run_flash_attention(args, ap):
    """FlashAttention's reference (attention_ref of its tests) against flash_attn_func, under its 2x rule."""
    if not args.flash_attn:
        ap.error(f"give --flash-attn PATH or set {ENV} to a checkout of Dao-AILab/flash-attention")
    try:
        attention_ref, alibi_bias_fn, commit = load_reference(args.flash_attn)
    except ValueError as exc:
        ap.error(str(exc))
    rows, t0 = [], time.perf_counter()
    grid = [(v, d) for v in args.variants for d in dict.fromkeys(DTYPES[x] for x in args.dtypes)]
    for n, (variant, dtype) in enumerate(grid, 1):
        r = check_variant(variant, dtype, attention_ref, alibi_bias_fn, args.reference, args.seed)
        rows.append(r)
        print(f"[{n}/{len(grid)}] {variant} {r['dtype']}: {'ok' if r['pass'] else 'FAIL'} "
              f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    print(f"FlashAttention reference: tests/test_flash_attn.py attention_ref at commit {commit}; errors against "
          f"the {args.reference} reference; ratio = max|ours - ref| / max|pt - ref| (pt: the reference in the "
          f"input dtype, reordered), pass when <= {RULE:g} for o, dq, dk, dv; in parentheses max|ours - ref|")
    print(table(rows))
    failed = [f"{r['variant']}/{r['dtype']}" for r in rows if not r["pass"]]
    worst = max((x["ratio"] for r in rows for x in r["tensors"].values()), default=float("nan"))
    print(f"{len(rows) - len(failed)}/{len(rows)} rows pass; worst ratio {worst:.3f}" +
          (f"; FAILED: {', '.join(failed)}" if failed else ""))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"commit": commit, "reference": args.reference,
                                                       "rule": RULE, "rows": rows}, indent=1))
    return 1 if failed else 0


COMMANDS = {"flash-attention": (args_flash_attention, run_flash_attention)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n")[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (add, run) in COMMANDS.items():
        p = sub.add_parser(name, help=run.__doc__.split("\n")[0], description=run.__doc__)
        add(p)
        p.set_defaults(run=run, parser=p)
    a = ap.parse_args(argv)
    return a.run(a, a.parser)


if __name__ == "__main__":
    sys.exit(main())
