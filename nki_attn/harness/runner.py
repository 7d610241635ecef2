"""Run one harness row: candidate forward + backward against the float64 golden and the dtype baseline.

A *candidate* is anything with the kernels' two signatures (``fwd(q, k, v, sinks, bound_min, bound_max,
use_causal_mask=, mixed_precision=, softmax_scale=, sliding_window=) -> (o, lse)`` and ``bwd(q, k, v, o, dy,
lse, sinks, bound_min, bound_max, ...) -> (dq, dk, dv[, dsinks])``). ``KernelCandidate`` is the NKI kernels;
the harness's own tests pass deliberately broken ones.
"""
import time
import zlib

import torch

import golden

from . import tolerance

_TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class KernelCandidate:
    """The NKI kernels on the current backend; ``lnc=2`` launches them on two cores."""

    name = "nki-kernels"

    def __init__(self, lnc=1):
        from ..kernel_api import attention_bwd, attention_fwd  # ValueError for bad arguments, before launching
        self._fwd = attention_fwd[lnc] if lnc == 2 else attention_fwd
        self._bwd = attention_bwd[lnc] if lnc == 2 else attention_bwd
        self.lnc = lnc

    def fwd(self, *args, **kwargs):
        return self._fwd(*args, **kwargs)

    def bwd(self, *args, **kwargs):
        return self._bwd(*args, **kwargs)


def case_seed(case):
    """A stable seed per row name, so a row always sees the same inputs."""
    return zlib.crc32(case.name.encode())


def make_inputs(case, seed=None):
    """Inputs of a row in the kernels' layout, drawn in float64 then rounded to the row dtype.

    Returns dict: q [b, h, d, sq], k, v [b, hk, d, sk], dy like q (row dtype); sinks float32 [b, h] or
    [b, h, n] or None; bound_min, bound_max float32 [sq] or None.
    """
    g = torch.Generator().manual_seed(case_seed(case) if seed is None else seed)
    dt = _TORCH[case.dtype]

    def draw(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dt)

    b, h, hk, d = case.batch, case.heads, case.kv_heads, case.d_head
    ins = {"q": draw(b, h, d, case.seqlen_q), "k": draw(b, hk, d, case.seqlen_k), "v": draw(b, hk, d, case.seqlen_k),
           "dy": draw(b, h, d, case.seqlen_q), "sinks": None, "bound_min": None, "bound_max": None}
    if case.num_sinks:
        shape = (b, h) if case.num_sinks == 1 else (b, h, case.num_sinks)
        ins["sinks"] = torch.randn(*shape, generator=g, dtype=torch.float64).to(torch.float32)
    if case.cu_seqlens:
        cu = torch.tensor(case.cu_seqlens, dtype=torch.int64)
        ins["bound_min"], ins["bound_max"] = golden.packing_bounds(cu, seqlen_q=case.seqlen_q)
    return ins


def _kwargs(case):
    return dict(use_causal_mask=case.causal, softmax_scale=case.scale or None, sliding_window=case.window or None)


def _golden(ins, case, as_dtype):
    """Golden forward + backward with inputs converted to ``as_dtype`` (float64: the reference).

    Run one kv head (with its query heads) at a time: the golden materialises [heads, seqlen_q, seqlen_k]
    matrices, which for a whole model's heads at 4096 tokens in float64 would need tens of GiB. Each kv head's
    slice is an independent attention problem, so the results are the same.
    """
    cv = (lambda t: None if t is None else t.to(as_dtype)) if as_dtype is not None else (lambda t: t)
    q, k, v, dy = (cv(ins[n]) for n in ("q", "k", "v", "dy"))
    sinks = ins["sinks"].to(torch.float64) if (ins["sinks"] is not None and as_dtype == torch.float64) \
        else ins["sinks"]
    group = case.heads // case.kv_heads
    parts = []
    for g in range(case.kv_heads):
        hq, hk = slice(g * group, (g + 1) * group), slice(g, g + 1)
        s_g = None if sinks is None else sinks[:, hq]
        o, lse = golden.attention_fwd_torch_ref(q[:, hq], k[:, hk], v[:, hk], s_g, ins["bound_min"],
                                                ins["bound_max"], mixed_precision=True, **_kwargs(case))
        gr = golden.attention_bwd_torch_ref(q[:, hq], k[:, hk], v[:, hk], o, dy[:, hq], lse, s_g, ins["bound_min"],
                                            ins["bound_max"], mixed_precision=True, **_kwargs(case))
        part = {"o": o, "lse": lse, "dq": gr["out_dq_ref"], "dk": gr["out_dk_ref"], "dv": gr["out_dv_ref"]}
        if sinks is not None:
            part["dsinks"] = gr["out_dsinks_ref"]
        parts.append(part)
    return {name: torch.cat([p[name] for p in parts], dim=1) for name in parts[0]}


def run_candidate(candidate, ins, case):
    """Candidate forward then backward on the candidate's own o and lse; dict of outputs."""
    o, lse = candidate.fwd(ins["q"], ins["k"], ins["v"], ins["sinks"], ins["bound_min"], ins["bound_max"],
                           mixed_precision=True, **_kwargs(case))
    res = candidate.bwd(ins["q"], ins["k"], ins["v"], o, ins["dy"], lse, ins["sinks"], ins["bound_min"],
                        ins["bound_max"], mixed_precision=True, **_kwargs(case))
    out = {"o": o, "lse": lse, "dq": res[0], "dk": res[1], "dv": res[2]}
    if ins["sinks"] is not None:
        out["dsinks"] = res[3]
    return out


def run_case(case, candidate):
    """Check one row. Returns the report row: case facts, per-output errors and verdicts, ``pass``, seconds."""
    t0 = time.perf_counter()
    row = {"case": case.as_dict()}
    try:
        ins = make_inputs(case)
        ref = _golden(ins, case, torch.float64)
        base = _golden(ins, case, None)
        got = run_candidate(candidate, ins, case)
        checks = {}
        for name in ref:
            # lse and dsinks are float32 but carry the row dtype's input rounding: judged by the row dtype.
            checks[name] = tolerance.compare(name, _np(got[name]), _np(ref[name]), _np(base[name]), case.dtype)
        row["outputs"] = checks
        row["pass"] = all(c["ok"] for c in checks.values())
        row["worst_ratio"] = max((c["max_abs"] / c["bound"] if c.get("bound") else 0.0) for c in checks.values())
    except Exception as exc:  # noqa: BLE001 - a crash is a failing row, reported with its message
        row["pass"] = False
        row["error"] = f"{type(exc).__name__}: {exc}"
    row["seconds"] = round(time.perf_counter() - t0, 3)
    return row


def _np(t):
    return t.detach().to(torch.float64).numpy() if isinstance(t, torch.Tensor) else t
