"""Run public NKI kernels, unmodified, on the nki_attn simulator and compare them with their own references.

The kernels are not part of this repository: point the script at local copies of the two public repositories
(see docs/simulator.md, "Conformance with public kernels", for how to get them at the recorded commits):

    python scripts/conformance_public_kernels.py --sdk /tmp/conf/sdk --nkilib /tmp/conf/nkilib

``--sdk`` is the root of an aws-neuron/aws-neuron-sdk tree (tutorial kernels under nki/examples), ``--nkilib``
the root of an aws-neuron/nki-library tree (package under src/nkilib_src). Each kernel runs through
``nki_attn.sim.install_as_nki()`` in strict mode (uninitialised reads raise) with the capacity checks and the NKI
frontend check (``nki_attn.sim.frontend``, all stages) on, at small shapes, and is compared with the reference
its authors ship (their numpy/torch function where one is importable, otherwise the torch call their test script
makes). Prints one line per case and exits non-zero if any case fails.

The frontend check also gathers, without running them, every ``@nki.jit`` kernel of the library's ``core/`` and
of the tutorials ("gather" lines): those kernels compile with the real NKI compiler, so a refusal is a false
positive of the check. Library modules that import NKI names the simulator lacks (MX dtypes, ``nki.isa.constants``,
``neuronxcc``) are imported with stand-ins for those names; their kernels are gathered, never run.

Pass criteria:
- tutorials: the check their own scripts make (``torch.allclose`` with their tolerances, or exact equality);
- NKI Library attention: their test tolerance in their "max" mode, ``|out - ref| <= atol + rtol * max|ref|``
  (rtol 2e-2, atol 1e-5), against their torch reference evaluated in float64. For bfloat16 inputs the bound is
  widened to the error of their own reference evaluated in bfloat16, since no bfloat16 kernel can be expected to
  beat the rounding of its dtype; both numbers are printed.
"""
import argparse
import importlib.abc
import importlib.util
import math
import os
import sys
import time
import traceback
import types

import ml_dtypes
import numpy as np

import nki_attn.sim as sim
from nki_attn.sim import frontend

BF16 = ml_dtypes.bfloat16
RESULTS = []
GATHERED = []  # (group, kernel, definitions, functions, problems) of the gather-only pass


def _record(group, name, target, lnc, err, scale, tol, ok, note="", seconds=0.0):
    stats = sim.last_launch_stats()
    mem = f"SBUF {stats.peak_sbuf_bytes} B/part, PSUM {stats.peak_psum_banks} banks" if stats else ""
    RESULTS.append((group, name, target, lnc, err, scale, tol, ok, note, mem))
    flag = "PASS" if ok else "FAIL"
    print(f"{flag}  {group:9s} {name:46s} {target} lnc={lnc}  max|err|={err:.3g}  max|ref|={scale:.3g}  "
          f"bound={tol:.3g}  {mem}  {seconds:.1f}s {note}", flush=True)


def _set_target(name):
    os.environ["NEURON_PLATFORM_TARGET_OVERRIDE"] = name


def _case(group, name, target, lnc, fn):
    """Run one case, turning any exception into a FAIL line with the traceback."""
    _set_target(target)
    t0 = time.perf_counter()
    try:
        with sim.checking(strict=True, capacity=True, frontend="full"):
            err, scale, tol, ok, note = fn()
    except Exception as exc:  # noqa: BLE001 - report and continue with the next case
        traceback.print_exc()
        RESULTS.append((group, name, target, lnc, math.nan, math.nan, math.nan, False, repr(exc)[:200], ""))
        print(f"FAIL  {group:9s} {name:46s} {target} lnc={lnc}  {exc!r}"[:400], flush=True)
        return
    _record(group, name, target, lnc, err, scale, tol, ok, note, time.perf_counter() - t0)


def _f64(a):
    return np.asarray(a).astype(np.float64)


def _allclose_case(out, ref, rtol, atol):
    """Their tutorials' torch.allclose check; returns (max abs err, max |ref|, bound, ok, note)."""
    o, r = _f64(out), _f64(ref)
    err = float(np.abs(o - r).max())
    ok = bool(np.all(np.abs(o - r) <= atol + rtol * np.abs(r)))
    return err, float(np.abs(r).max()), atol + rtol * float(np.abs(r).max()), ok, f"allclose(rtol={rtol}, atol={atol})"


# ----------------------------------------------------------------------------------------------------- frontend
def _kernels_in(namespace, module_name=None):
    """The ``@nki.jit`` kernels a module (or script globals) defines itself."""
    from nki_attn.sim.runtime import Kernel
    out = {}
    for name, obj in namespace.items():
        if isinstance(obj, Kernel) and (module_name is None or obj.fn.__module__ == module_name):
            out[name] = obj
    return out


def gather_kernels(group, kernels):
    """Gathering-time frontend check of ``kernels`` ({label: kernel}) without running them: one line each."""
    for label, k in sorted(kernels.items()):
        g = frontend.gather(k)
        n_ins = len(frontend._swaps(g.functions))
        n_unchecked = sum(1 for info in g.functions if info.fn in frontend.UNCHECKED)
        GATHERED.append((group, label, len(g.definitions), len(g.functions), len(g.problems), n_ins, n_unchecked))
        flag = "PASS" if not g.problems else "FAIL"
        print(f"{flag}  gather    {group:9s} {label:60s} {len(g.definitions):3d} definitions, {len(g.functions):3d} "
              f"functions ({n_ins} instrumented, {n_unchecked} not instrumentable), {len(g.problems)} refused",
              flush=True)
        for p in g.problems[:10]:
            print(f"      {p.format()}", flush=True)


class _Stand:
    """Stands for an NKI name the simulator does not provide, so that a module using it at import time imports
    (its kernels are gathered, never run)."""

    __slots__ = ("name",)

    def __init__(self, name):
        self.name = name

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Stand(f"{self.name}.{attr}")

    def __call__(self, *args, **kwargs):
        return _Stand(f"{self.name}()")

    def __getitem__(self, key):
        return _Stand(f"{self.name}[]")

    def __repr__(self):
        return f"<not simulated: {self.name}>"


def _stand_module(name):
    mod = types.ModuleType(name)
    mod.__path__ = []  # a package, so that stand-in submodules import too

    def missing(attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Stand(f"{name}.{attr}")
    mod.__getattr__ = missing
    return mod


class _StandFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports stand-in modules for the packages the simulator does not provide."""

    PREFIXES = ("neuronxcc", "neuron_dtypes", "nki.isa.constants")

    def find_spec(self, name, path, target=None):
        if any(name == p or name.startswith(p + ".") for p in self.PREFIXES):
            return importlib.util.spec_from_loader(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _stand_module(spec.name)

    def exec_module(self, module):
        pass


def import_leniently(module_name):
    """Import ``module_name`` with stand-ins for the NKI names the simulator lacks; returns (module, None) or
    (None, the error)."""
    finder = _StandFinder()
    sys.meta_path.insert(0, finder)
    before = set(sys.modules)
    api = (sim, sim.language, sim.isa)
    saved = {m: m.__dict__.get("__getattr__") for m in api}
    for m, name in zip(api, ("nki", "nki.language", "nki.isa")):
        m.__getattr__ = _stand_module(name).__getattr__
    sim.isa.__path__ = []  # so that nki.isa.constants (a package in the real nki) can be a stand-in
    strict_jit = sim.jit

    def jit(fn=None, **kwargs):  # newer @nki.jit options the simulator does not know are dropped here
        known = {k: v for k, v in kwargs.items() if k in ("mode", "debug_kernel", "show_compiler_tool",
                                                           "additional_compile_opt")}
        return strict_jit(fn, **known)
    sim.jit = jit
    try:
        return importlib.import_module(module_name), None
    except Exception as exc:  # noqa: BLE001 - reported, the module is skipped
        return None, exc
    finally:
        sim.jit = strict_jit
        del sim.isa.__path__
        for m, old in saved.items():
            if old is None:
                m.__dict__.pop("__getattr__", None)
            else:
                m.__getattr__ = old
        sys.meta_path.remove(finder)
        for n in set(sys.modules) - before:
            if isinstance(sys.modules[n].__spec__ and sys.modules[n].__spec__.loader, _StandFinder):
                del sys.modules[n]


def gather_nkilib(root):
    """Gather every kernel of the NKI Library's ``core/`` (``root``/src/nkilib_src), without running it."""
    src = os.path.join(root, "src", "nkilib_src")
    if src not in sys.path:
        sys.path.insert(0, src)
    kernels, failed = {}, []
    core = os.path.join(src, "nkilib", "core")
    for dirpath, _, files in sorted(os.walk(core)):
        for f in sorted(files):
            if not f.endswith(".py") or f.endswith("_torch.py") or f == "__init__.py":
                continue
            name = os.path.relpath(os.path.join(dirpath, f), src)[:-3].replace(os.sep, ".")
            mod, err = import_leniently(name)
            if mod is None:
                failed.append((name, err))
                continue
            for k_name, k in _kernels_in(vars(mod), name).items():
                kernels[f"{name[len('nkilib.core.'):]}.{k_name}"] = k
    for name, err in failed:
        print(f"skip  gather    nkilib    {name}: does not import ({type(err).__name__}: {str(err)[:100]})")
    gather_kernels("nkilib", kernels)


def _max_case(out, ref, rtol, atol):
    """The NKI Library test harness's check (maxAllClose, 'max' mode): max|out - ref| <= atol + rtol * max|ref|."""
    o, r = _f64(out), _f64(ref)
    err = float(np.abs(o - r).max())
    scale = float(np.abs(r).max())
    bound = atol + rtol * scale
    return err, scale, bound, err <= bound, f"max mode (rtol={rtol:g}, atol={atol:g})"


# ----------------------------------------------------------------------------------------------------- tutorials
def run_tutorials(sdk, targets):
    """The tutorial kernels of aws-neuron-sdk ``nki/examples`` (root ``sdk``) on each target."""
    ex = os.path.join(sdk, "nki", "examples")
    for sub in ("tensor_addition", "matrix_multiplication", "transpose2d", "average_pool2d", "fused_mamba"):
        sys.path.insert(0, os.path.join(ex, sub))
    # Their torch scripts import torch_xla at module level for the device; the references we call are plain
    # torch, so an empty stand-in module lets them import on a CPU-only machine.
    sys.modules.setdefault("torch_xla", types.ModuleType("torch_xla"))
    import torch

    saved = os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE")
    import tensor_addition_nki_kernels as ta  # sets NEURON_PLATFORM_TARGET_OVERRIDE=trn1 on import
    if saved is None:
        os.environ.pop("NEURON_PLATFORM_TARGET_OVERRIDE", None)
    else:
        os.environ["NEURON_PLATFORM_TARGET_OVERRIDE"] = saved
    import average_pool2d_nki_kernels as ap
    import mamba_nki_kernels as mb
    import mamba_torch as mt
    import matrix_multiplication_nki_kernels as mm
    import transpose2d_nki_kernels as tp

    import runpy

    def script(rel, check):
        """Run one of their example scripts as __main__ (it makes its own assertions), then ``check`` its globals."""
        def run():
            g = runpy.run_path(os.path.join(ex, rel), run_name="__main__")
            script_kernels.update({f"{rel}:{n}": k for n, k in _kernels_in(g).items()})
            return check(g)
        return run

    script_kernels = {}

    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    for tgt in targets:
        _case("tutorial", "simulate/nki_simulate_example.py (script)", tgt, 1,
              script("simulate/nki_simulate_example.py", lambda g: _allclose_case(g["result"], g["a"] + g["b"],
                                                                                  1e-5, 0.0)))
        _case("tutorial", "getting_started_baremetal.py nki_tensor_add_kernel", tgt, 1,
              script("getting_started_baremetal.py", lambda g: _allclose_case(g["c"], g["a"] + g["b"], 0.0, 0.0)))
        a = rng.random((256, 1024)).astype(np.float32)
        b = rng.random((256, 1024)).astype(np.float32)
        _case("tutorial", "nki_tensor_add fp32 [256,1024]", tgt, 1,
              lambda: _allclose_case(ta.nki_tensor_add(a, b), a + b, 0.0, 0.0))

        lhs = torch.rand((64, 128), dtype=torch.bfloat16)
        rhs = torch.rand((128, 512), dtype=torch.bfloat16)
        _case("tutorial", "nki_matmul_basic_ bf16 64x128x512", tgt, 1,
              lambda: _allclose_case(mm.nki_matmul_basic_(lhs.T.contiguous(), rhs).float(),
                                     torch.matmul(lhs, rhs).float(), 1e-2, 1e-4))
        big_l = torch.rand((4096, 1024), dtype=torch.bfloat16)
        big_r = torch.rand((1024, 2048), dtype=torch.bfloat16)
        big_ref = torch.matmul(big_l, big_r).float()
        for fn in (mm.nki_matmul_tiled_, mm.nki_matmul_hoist_load_, mm.nki_matmul_block_free_dimension_,
                   mm.nki_matmul_fully_optimized_):
            _case("tutorial", f"{fn.__name__} bf16 4096x1024x2048", tgt, 1,
                  lambda fn=fn: _allclose_case(fn(big_l.T.contiguous(), big_r).float(), big_ref, 1e-2, 1e-4))

        p, x, y = 5, 3, 4
        t_in = np.arange(p * x * y, dtype=np.int8).reshape((p, x * y))
        _case("tutorial", "tensor_transpose2D_kernel_ int8 [5,12]", tgt, 1,
              lambda: _allclose_case(tp.tensor_transpose2D_kernel_(t_in, (x, y)),
                                     np.transpose(t_in.reshape(p, x, y), (0, 2, 1)).reshape(p, x * y), 0.0, 0.0))

        pool_in = np.arange(2 * 6 * 6, dtype=np.float16).reshape(2, 6, 6)
        _case("tutorial", "tensor_avgpool_kernel fp16 [2,6,6] pool 2", tgt, 1,
              lambda: _allclose_case(ap.tensor_avgpool_kernel(pool_in, 2), ap.np_average_pool_2D(pool_in, 2),
                                     0.0, 0.0))
        pool_t = torch.arange(2 * 6 * 6, dtype=torch.bfloat16).reshape(2, 6, 6)
        _case("tutorial", "tensor_avgpool_kernel bf16 vs torch avg_pool2d", tgt, 1,
              lambda: _allclose_case(ap.tensor_avgpool_kernel(pool_t, 2).float(),
                                     torch.nn.functional.avg_pool2d(pool_t, 2, 2).float(), 0.0, 0.0))

        for label, gen in (("ones (their toy)", "ones"), ("random", "random")):
            bsz, ch, seq, st = 1, 256, 1024, 8
            if gen == "ones":
                delta, u = np.ones((bsz, ch, seq), np.float32), np.ones((bsz, ch, seq), np.float32)
                a_m = -np.ones((ch, st), np.float32)
                b_m, c_m = np.ones((bsz, st, seq), np.float32), np.ones((bsz, st, seq), np.float32)
            else:
                delta = (rng.random((bsz, ch, seq)) * 0.1).astype(np.float32)
                u = rng.standard_normal((bsz, ch, seq)).astype(np.float32)
                a_m = -rng.random((ch, st)).astype(np.float32)
                b_m = rng.standard_normal((bsz, st, seq)).astype(np.float32)
                c_m = rng.standard_normal((bsz, st, seq)).astype(np.float32)
            ref = mt.mamba_layer(*(torch.from_numpy(v) for v in (delta, a_m, b_m, u, c_m)))
            for fn in (mb.mamba_v1, mb.mamba_v2, mb.mamba_v3):
                _case("tutorial", f"{fn.__name__} fp32 {label} [1,256,1024] state 8", tgt, 1,
                      lambda fn=fn: _allclose_case(fn(delta, u, a_m, b_m, c_m), ref, 1e-2, 1e-2))
    kernels = dict(script_kernels)
    for mod in (ta, ap, mb, mm, tp):
        kernels.update({f"{mod.__name__}.{n}": k for n, k in _kernels_in(vars(mod), mod.__name__).items()})
    gather_kernels("tutorial", kernels)


# ----------------------------------------------------------------------------------------------------- NKI Library
def _max_mode(out, ref_hi, ref_dt, rtol=2e-2, atol=1e-5):
    """Their 'max' tolerance against the float64 reference, widened to their own bf16 reference's error."""
    o, hi = _f64(out), _f64(ref_hi)
    scale = float(np.abs(hi).max())
    err = float(np.abs(o - hi).max())
    own = float(np.abs(_f64(ref_dt) - hi).max())
    plain = atol + rtol * scale
    bound = max(plain, own)
    return err, scale, bound, err <= bound, "" if err <= plain else "(within the widened bound only)"


def _merge(results):
    """Combine several outputs' (err, scale, bound, ok, note) into one line: the worst ratio err/bound."""
    worst = max(results, key=lambda r: r[0] / r[2] if r[2] else math.inf)
    note = "; ".join(f"{n}: {r[0]:.3g}/{r[2]:.3g}{' ' + r[4] if r[4] else ''}"
                     for n, r in zip(("out", "o2", "o3", "o4"), results))
    return worst[0], worst[1], worst[2], all(r[3] for r in results), note


def run_nkilib(root, targets):
    """The NKI Library attention kernels (``root``/src/nkilib_src) on each target, LNC1 and LNC2."""
    sys.path.insert(0, os.path.join(root, "src", "nkilib_src"))
    import torch
    from nkilib.core.attention.attention_bwd import attention_bwd
    from nkilib.core.attention.attention_bwd_torch import attention_bwd_torch_ref, compute_o_lse
    from nkilib.core.attention.attention_cte import attention_cte
    from nkilib.core.attention.attention_cte_torch import attention_cte_torch_ref

    rng = np.random.default_rng(0)

    def as_t(a, dtype):
        if a is None:
            return None
        if isinstance(a, np.ndarray) and a.dtype == np.int32:
            return torch.from_numpy(a)
        t = torch.from_numpy(np.asarray(a).astype(np.float64))
        return t.to(dtype)

    def cte(lnc=1, bs=1, bs_kv=1, s=256, d=64, causal=True, sw=0, sink=False, cache=False, tp_q=True,
            tp_k=False, tp_out=False, scale=1.0, prior=None, pack=None):
        q = rng.standard_normal((bs, s, d) if tp_q else (bs, d, s)).astype(BF16)
        k = rng.standard_normal((bs_kv, s, d) if tp_k else (bs_kv, d, s)).astype(BF16)
        v = rng.standard_normal((bs_kv, s, d)).astype(BF16)
        kw = dict(scale=scale, causal_mask=causal, sliding_window=sw, tp_q=tp_q, tp_k=tp_k, tp_out=tp_out,
                  cache_softmax=cache)
        arrays = {}
        if sink:
            arrays["sink"] = rng.uniform(15.0, 25.0, (bs, 1)).astype(np.float32)
        if prior:
            sp, used = prior
            arrays["k_prior"] = rng.standard_normal((bs_kv, sp, d) if tp_k else (bs_kv, d, sp)).astype(BF16)
            arrays["v_prior"] = rng.standard_normal((bs_kv, sp, d)).astype(BF16)
            arrays["prior_used_len"] = np.array([used], np.int32)
        if pack:
            lo, hi, start = np.zeros((s, 1), np.float32), np.zeros((s, 1), np.float32), 0
            for n in pack:
                lo[start:start + n], hi[start:start + n] = start, start + n
                start += n
            kw.update(bound_min=lo, bound_max=hi)
        kern = attention_cte if lnc == 1 else attention_cte[lnc]
        out = kern(q, k, v, **kw, **arrays)
        outs = out if isinstance(out, tuple) else (out,)
        refs = {}
        for dt in (torch.float64, torch.bfloat16):
            r = attention_cte_torch_ref(as_t(q, dt), as_t(k, dt), as_t(v, dt), **kw,
                                        **{n: as_t(a, dt if a.dtype == BF16 else torch.float32)
                                           for n, a in arrays.items()})
            refs[dt] = r if isinstance(r, tuple) else (r,)
        # the bf16 reference rounds its outputs the way the kernel's bf16 output is rounded
        return _merge([_max_mode(o, hi, lo.to(torch.float32).numpy() if i == 0 else hi)
                       for i, (o, hi, lo) in enumerate(zip(outs, refs[torch.float64], refs[torch.bfloat16]))])

    def bwd(lnc=1, b=1, hq=1, hkv=1, s=256, d=64, causal=True, sw=None, sinks=0, dtype=BF16, scale=None,
            pack=None):
        q = rng.standard_normal((b, hq, d, s)).astype(dtype)
        k = rng.standard_normal((b, hkv, d, s)).astype(dtype)
        v = rng.standard_normal((b, hkv, d, s)).astype(dtype)
        dy = rng.standard_normal((b, hq, d, s)).astype(dtype)
        tdt = torch.bfloat16 if dtype == BF16 else torch.float32
        sk = rng.standard_normal((b, hq) if sinks == 1 else (b, hq, sinks)).astype(dtype) if sinks else None
        lo = hi = None
        if pack:
            lo, hi, start = np.zeros(s, np.float32), np.zeros(s, np.float32), 0
            for n in pack:
                lo[start:start + n], hi[start:start + n] = start, start + n
                start += n
        # As their test does: o and lse from their forward reference in the test dtype, mixed precision.
        o, lse, _ = compute_o_lse(as_t(q, tdt), as_t(k, tdt), as_t(v, tdt), causal, True, softmax_scale=scale,
                                  sliding_window=sw or -1, sinks=as_t(sk, tdt),
                                  bound_min=None if lo is None else torch.from_numpy(lo),
                                  bound_max=None if hi is None else torch.from_numpy(hi))
        o = o.float().numpy().astype(dtype)
        lse = lse.float().numpy()
        kw = dict(use_causal_mask=causal, mixed_precision=True, softmax_scale=scale, sliding_window=sw)
        kern = attention_bwd if lnc == 1 else attention_bwd[lnc]
        out = kern(q, k, v, o, dy, lse, sinks_ref=sk, bound_min=lo, bound_max=hi, **kw)
        refs = {}
        for dt in (torch.float64, tdt):
            refs[dt] = attention_bwd_torch_ref(
                as_t(q, dt), as_t(k, dt), as_t(v, dt), as_t(o, dt), as_t(dy, dt),
                torch.from_numpy(lse).to(torch.float64 if dt == torch.float64 else torch.float32),
                sinks_ref=as_t(sk, dt), bound_min=None if lo is None else torch.from_numpy(lo),
                bound_max=None if hi is None else torch.from_numpy(hi), **kw)
        names = ["out_dq_ref", "out_dk_ref", "out_dv_ref", "out_dsinks_ref"]
        return _merge([_max_mode(o_, refs[torch.float64][n].numpy(), refs[tdt][n].float().numpy())
                       for o_, n in zip(out, names)])

    cte_cases = [
        ("causal bs1 s256 d64", 1, dict()),
        ("non-causal bs1 s256 d64", 1, dict(causal=False)),
        ("causal s300 (partial tile)", 1, dict(s=300)),
        ("causal s1024 d128", 1, dict(s=1024, d=128)),
        ("GQA bs4 bs_kv2 causal", 1, dict(bs=4, bs_kv=2)),
        ("sliding window 128 s512", 1, dict(s=512, sw=128)),
        ("sink", 1, dict(sink=True)),
        ("cache_softmax (out, -max, 1/sum)", 1, dict(cache=True)),
        ("tp_q=F tp_k=T tp_out=T", 1, dict(tp_q=False, tp_k=True, tp_out=True)),
        ("prefix caching prior 512 used 300", 1, dict(prior=(512, 300))),
        ("sequence packing [100, 156]", 1, dict(pack=[100, 156])),
        ("LNC2 bs2 causal", 2, dict(bs=2)),
        ("LNC2 bs1 s1024 (seq-sharded)", 2, dict(s=1024)),
    ]
    bwd_cases = [
        ("causal bf16 s256 d64", 1, dict()),
        ("non-causal scale=1 bf16", 1, dict(causal=False, scale=1.0)),
        ("causal fp32 d128", 1, dict(dtype=np.float32, d=128)),
        ("GQA hq4 hkv2 bf16", 1, dict(hq=4, hkv=2)),
        ("sliding window 128 s512 bf16", 1, dict(s=512, sw=128)),
        ("sinks=1 bf16", 1, dict(sinks=1)),
        ("sinks=2 fp32", 1, dict(sinks=2, dtype=np.float32)),
        ("sinks=2 bf16", 1, dict(sinks=2)),
        ("sequence packing [128, 128] bf16", 1, dict(pack=[128, 128])),
        ("LNC2 hq2 hkv2 bf16", 2, dict(hq=2, hkv=2)),
        ("LNC2 b2 GQA hq4 hkv2 fp32", 2, dict(b=2, hq=4, hkv=2, dtype=np.float32)),
    ]
    for tgt in targets:
        for name, lnc, kw in cte_cases:
            _case("nkilib", f"attention_cte {name}", tgt, lnc, lambda kw=kw, lnc=lnc: cte(lnc=lnc, **kw))
        for name, lnc, kw in bwd_cases:
            _case("nkilib", f"attention_bwd {name}", tgt, lnc, lambda kw=kw, lnc=lnc: bwd(lnc=lnc, **kw))
    run_nkilib_more(targets)


def run_nkilib_more(targets):
    """The other NKI Library core kernels the simulator supports: cumsum, RoPE, rope_hf, with the inputs and
    tolerances of their own integration tests (test_cumsum.py, test_rope.py, test_rope_hf.py: N(0, 1) inputs,
    their torch reference in float32, their harness's 'max' mode)."""
    import torch
    from nkilib.core.cumsum.cumsum import cumsum
    from nkilib.core.cumsum.cumsum_torch import cumsum_torch_ref
    from nkilib.core.embeddings.rope import RoPE
    from nkilib.core.embeddings.rope_hf import rope_hf
    from nkilib.core.embeddings.rope_hf_torch import rope_hf_torch_ref
    from nkilib.core.embeddings.rope_torch import rope_torch_ref

    def t(a):
        return torch.from_numpy(np.asarray(a).astype(np.float32))

    def cumsum_case(batch, hidden, ndim, seq, dtype):
        rng = np.random.default_rng(42)
        x = rng.standard_normal((batch, seq, hidden) if ndim == 3 else (batch, hidden)).astype(dtype)
        ref = cumsum_torch_ref(t(x))
        ref = next(iter(ref.values())) if isinstance(ref, dict) else ref
        bf16 = dtype == BF16
        return _max_case(cumsum(x), ref.numpy(), 1e-2 if bf16 else 1e-3, 1e-2 if hidden > 5000 else 1e-3)

    def rope_case(lnc, d_head, b, heads, s, contiguous, relayout):
        rng = np.random.default_rng(42)
        x = rng.standard_normal((d_head, b, heads, s)).astype(BF16)
        cos = rng.standard_normal((d_head // 2, b, s)).astype(BF16)
        sin = rng.standard_normal((d_head // 2, b, s)).astype(BF16)
        kw = dict(lnc_shard=lnc == 2, contiguous_layout=contiguous, relayout_in_sbuf=relayout)
        out = (RoPE if lnc == 1 else RoPE[lnc])(x, cos, sin, **kw)
        ref = rope_torch_ref(t(x), t(cos), t(sin), **kw)["x_out"]
        return _max_case(out, ref.numpy(), 2.0 ** -7, 1e-3)

    def rope_hf_case(lnc, b, hq, hk, s, d, backward, packed):
        rng = np.random.default_rng(42)
        q = rng.standard_normal((b, hq, s, d)).astype(np.float32)
        k = rng.standard_normal((b, hk, s, d)).astype(np.float32)
        extra = ({"rope_cache": rng.standard_normal((s, 2 * d)).astype(np.float32)} if packed else
                 {"cos": rng.standard_normal((b, s, d)).astype(np.float32),
                  "sin": rng.standard_normal((b, s, d)).astype(np.float32)})
        q_out, k_out = np.zeros_like(q), np.zeros_like(k)
        out = (rope_hf if lnc == 1 else rope_hf[lnc])(q, k, q_out, k_out, backward=backward, **extra)
        ref = rope_hf_torch_ref(t(q), t(k), t(q_out), t(k_out), backward=backward,
                                **{n: t(a) for n, a in extra.items()})
        refs = list(ref.values()) if isinstance(ref, dict) else list(ref)
        return _merge([_max_case(o, r.numpy(), 1e-6, 1e-6) for o, r in zip(out, refs)])

    cases = [
        ("cumsum fp32 [1, 256]", 1, lambda: cumsum_case(1, 256, 2, 1, np.float32)),
        ("cumsum bf16 [64, 4, 1024]", 1, lambda: cumsum_case(64, 1024, 3, 4, BF16)),
        ("cumsum fp32 [128, 2048]", 1, lambda: cumsum_case(128, 2048, 2, 1, np.float32)),
        ("RoPE bf16 d64 B8 h8 S128 contiguous", 1, lambda: rope_case(1, 64, 8, 8, 128, True, False)),
        ("RoPE bf16 d128 B1 h1 S16 interleaved", 1, lambda: rope_case(1, 128, 1, 1, 16, False, False)),
        ("RoPE bf16 d128 B8 h8 S128 relayout in SBUF", 1, lambda: rope_case(1, 128, 8, 8, 128, True, True)),
        ("RoPE bf16 d64 B8 h8 S128 LNC2 sharded", 2, lambda: rope_case(2, 64, 8, 8, 128, True, False)),
        ("rope_hf fp32 b1 hq32 hk8 s256 d128", 1, lambda: rope_hf_case(1, 1, 32, 8, 256, 128, False, False)),
        ("rope_hf fp32 b1 hq32 hk8 s512 d64 LNC2", 2, lambda: rope_hf_case(2, 1, 32, 8, 512, 64, False, False)),
        ("rope_hf fp32 backward b1 hq32 hk8 s256 d128", 1,
         lambda: rope_hf_case(1, 1, 32, 8, 256, 128, True, False)),
        # (their rope_cache shapes, s256 d128 and up, give an HBM access-pattern stride of 32768 elements, which
        # the simulator refuses as beyond the int16 ISA field: docs/simulator.md, "Gaps")
        ("rope_hf fp32 rope_cache b1 hq32 hk8 s256 d64 LNC2", 2,
         lambda: rope_hf_case(2, 1, 32, 8, 256, 64, False, True)),
    ]
    for tgt in targets:
        for name, lnc, fn in cases:
            _case("nkilib", name, tgt, lnc, fn)


def main():
    """Parse the command line, run the selected groups, print the summary, exit 1 on any failure."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sdk", help="root of an aws-neuron/aws-neuron-sdk checkout (tutorial kernels)")
    ap.add_argument("--nkilib", help="root of an aws-neuron/nki-library checkout (attention kernels)")
    ap.add_argument("--targets", default="trn2,trn3",
                    help="comma-separated targets (tutorials also accept trn1); default trn2,trn3")
    args = ap.parse_args()
    if not (args.sdk or args.nkilib):
        ap.error("give --sdk and/or --nkilib")
    if not sim.install_as_nki():
        sys.exit("a real 'nki' package is importable; this script tests the simulator")
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    if args.sdk:
        run_tutorials(args.sdk, targets)
    if args.nkilib:
        run_nkilib(args.nkilib, [t for t in targets if t != "trn1"])
        gather_nkilib(args.nkilib)
    failed = [r for r in RESULTS if not r[7]]
    refused = [g for g in GATHERED if g[4]]
    print(f"\n{len(RESULTS) - len(failed)}/{len(RESULTS)} cases passed (strict mode, capacity checks and the NKI "
          f"frontend check, all stages, on in every case)")
    for group in ("tutorial", "nkilib"):
        mine = [g for g in GATHERED if g[0] == group]
        if mine:
            print(f"frontend gather, {group}: {len(mine)} kernels, {sum(g[2] for g in mine)} definitions, "
                  f"{sum(g[3] for g in mine)} functions ({sum(g[5] for g in mine)} instrumented, "
                  f"{sum(g[6] for g in mine)} not instrumentable); {sum(1 for g in mine if g[4])} kernels with "
                  f"refusals")
    sys.exit(1 if failed or refused else 0)


if __name__ == "__main__":
    main()
