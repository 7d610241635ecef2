"""Accuracy criterion shared by the kernel tests (backward now; the forward tests can reuse it).

docs/tolerances.md derives the rule. With every error the max absolute difference from a float64 reference
computed on the same (already dtype-rounded) inputs:

    err_kernel <= K * (err_golden + err_inputs) + u(dtype) * max|ref|          (K = 2)

* ``err_golden``: error of the torch golden run in the kernel's dtype (FlashAttention's baseline: "no worse than
  K times what the framework itself gets in this dtype").
* ``err_inputs``: error of the kernel's own formula evaluated by torch in float32 from exactly the inputs the
  kernel gets (backward: ``bwd_from_stats`` with O rounded to the input dtype and LSE rounded to float32, which
  the golden never reads). It carries what any implementation of that formula must show and the golden's
  self-normalised softmax hides. ``None`` (0) for a kernel without such inputs.
* ``u(dtype) * max|ref|``: one rounding of the largest output to the output dtype, a floor for outputs whose
  baselines are ~0.

Any NaN or inf in a kernel output fails. ``absolute_band`` is the secondary check: a fixed band per dtype,
``max|kernel - ref| <= atol + rtol * max|ref|``, valid for the test inputs (N(0, 1) q, k, v, dy; |LSE| <= ~50).

Use from a test module in tests/kernels: ``sys.path.insert(0, os.path.dirname(__file__)); import _compare``.
"""
import math

import ml_dtypes
import numpy as np
import torch

K_FACTOR = 2.0
UNIT_ROUNDOFF = {"float32": 2.0 ** -24, "bfloat16": 2.0 ** -8, "float16": 2.0 ** -11, "float64": 2.0 ** -53}
# Secondary absolute bands, max|kernel - ref| <= atol + rtol * max|ref| (see docs/tolerances.md).
ABS_BANDS = {"float32": (1e-4, 1e-5), "bfloat16": (0.0, 2e-2), "float16": (0.0, 2.5e-3)}


def to_np(x):
    """torch tensor -> numpy array of the same dtype (bfloat16 via ml_dtypes)."""
    x = x.detach().contiguous()
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return x.numpy()


def dtype_name(dt):
    s = str(dt)
    return s.split(".")[-1]


def as_f64(x):
    """numpy (incl. ml_dtypes bfloat16) or torch -> float64 numpy array."""
    if isinstance(x, torch.Tensor):
        return x.detach().to(torch.float64).numpy()
    return np.asarray(x).astype(np.float64)


def max_err(a, ref):
    return float(np.max(np.abs(as_f64(a) - as_f64(ref)))) if np.size(ref) else 0.0


def check_close(name, kernel, ref, golden, dtype, inputs_err=None, k=K_FACTOR):
    """Assert the criterion above for one output; returns the measured numbers (for reports)."""
    kern = as_f64(kernel)
    r = as_f64(ref)
    assert np.all(np.isfinite(kern)), f"{name}: kernel output has NaN/inf"
    assert kern.shape == r.shape, f"{name}: shape {kern.shape} != reference {r.shape}"
    u = UNIT_ROUNDOFF[dtype_name(dtype)]
    e_k = max_err(kern, r)
    e_g = max_err(golden, r)
    e_i = 0.0 if inputs_err is None else max_err(inputs_err, r)
    mx = float(np.max(np.abs(r))) if r.size else 0.0
    bound = k * (e_g + e_i) + u * mx
    assert e_k <= bound, (f"{name}: kernel error {e_k:.3e} > {k} * (golden {e_g:.3e} + inputs {e_i:.3e}) + "
                          f"u*max|ref| {u * mx:.3e} = {bound:.3e} (dtype {dtype_name(dtype)}, max|ref| {mx:.3e})")
    return {"err": e_k, "golden": e_g, "inputs": e_i, "max": mx, "bound": bound}


def absolute_band(name, kernel, ref, dtype):
    """Secondary fixed band: max|kernel - ref| <= atol + rtol * max|ref| (ABS_BANDS)."""
    atol, rtol = ABS_BANDS[dtype_name(dtype)]
    e = max_err(kernel, ref)
    mx = float(np.max(np.abs(as_f64(ref))))
    assert e <= atol + rtol * mx, f"{name}: error {e:.3e} outside the {dtype_name(dtype)} band {atol} + {rtol}*{mx:.3e}"
    return e


def _visible(seqlen_q, seqlen_k, causal, window, bound_min, bound_max):
    i = torch.arange(seqlen_q, dtype=torch.float64)[:, None]
    j = torch.arange(seqlen_k, dtype=torch.float64)[None, :]
    vis = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool)
    if causal:
        vis &= j <= i
    if window:
        vis &= j >= i - window + 1
    if bound_min is not None:
        vis &= (as_t64(bound_min)[:, None] <= j) & (j < as_t64(bound_max)[:, None])
    return vis


def as_t64(x):
    return torch.from_numpy(as_f64(x))


def _as_t(x, dt):
    return as_t64(x).to(dt)


def bwd_from_stats(q, k, v, o, dy, lse, sinks=None, bound_min=None, bound_max=None, causal=False, scale=None,
                   window=None, compute_dtype=torch.float64):
    """The backward kernel's own formula in ``compute_dtype``, reading the given O and LSE (kernel layouts):
    D = rowsum(O*dO), P = exp(S - LSE), dS = P*(dP - D), dV = P^T dO, dK = scale dS^T Q, dQ = scale dS K,
    dsinks = -sum_rows exp(sink - LSE) D. In float64 with exact O and LSE it equals the reference; in float32
    with the O and LSE handed to the kernel it is the ``err_inputs`` baseline. Returns numpy float64 arrays."""
    q, k, v, o, dy, lse = (_as_t(x, compute_dtype) for x in (q, k, v, o, dy, lse))
    bs, h, d, sq = q.shape
    hk, sk = k.shape[1], k.shape[3]
    g = h // hk
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qt, ot, dot = (x.transpose(-1, -2) for x in (q, o, dy))                       # [b, h, sq, d]
    kt = k.transpose(-1, -2).repeat_interleave(g, dim=1)
    vt = v.transpose(-1, -2).repeat_interleave(g, dim=1)
    rows = lse.transpose(-1, -2).reshape(bs, h, sq)                                 # row t*128+p
    s = torch.matmul(qt, kt.transpose(-1, -2)) * scale
    vis = _visible(sq, sk, causal, window, bound_min, bound_max)
    s = s.masked_fill(~vis, float("-inf"))
    p = torch.exp(s - rows[..., None])
    dd = (ot * dot).sum(-1)
    dp = torch.matmul(dot, vt.transpose(-1, -2))
    ds = p * (dp - dd[..., None])
    ds = torch.nan_to_num(ds, nan=0.0)
    dq = torch.matmul(ds, kt) * scale
    dk = (torch.matmul(ds.transpose(-1, -2), qt) * scale).reshape(bs, hk, g, sk, d).sum(2)
    dv = torch.matmul(p.transpose(-1, -2), dot).reshape(bs, hk, g, sk, d).sum(2)
    out = {"dq": as_f64(dq.transpose(-1, -2)), "dk": as_f64(dk.transpose(-1, -2)), "dv": as_f64(dv.transpose(-1, -2))}
    if sinks is not None:
        sk_ = _as_t(sinks, compute_dtype).reshape(bs, h, -1)
        psink = torch.exp(sk_[:, :, None, :] - rows[..., None])                     # [b, h, sq, ns]
        out["dsinks"] = as_f64((-(psink * dd[..., None]).sum(2)).reshape(as_t64(sinks).shape))
    return out
