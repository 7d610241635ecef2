"""Tolerance rules of the harness (the derivation and the measured margins are in docs/tolerances.md).

Every candidate output X is compared with a float64 reference X64 computed by the golden module on the same
(rounded) inputs. The baseline is the golden run in the row's dtype. Two rules:

1. FlashAttention criterion with a derived floor (always applied)::

       max|X - X64| <= K[dtype] * (max|Xb - X64| + max|Xi - X64|) + (FLOOR[dtype] + sqrt(n) * U_ACC) * max|X64|

   Xb is the baseline: the candidate may be at most K times as wrong as a straightforward computation in the
   same precision. Xi (backward outputs only) is the backward's LSE-based formula evaluated in float32 from
   the O and LSE a backward is handed (rounded to the dtype and to float32): the error those inputs bring,
   which the golden, normalising its own P, does not have (the kernel tests' ``err_inputs``). The baseline's error is a measurement, and in float32 a lucky one (a summation order that
   happens to cancel) is a fraction of what any other correct order produces, so the bound also has a floor
   that no machine's luck moves:

   * ``FLOOR[dtype]``: a few roundings of the result to the row's dtype (n-independent);
   * ``sqrt(n) * U_ACC``: the probabilistic error of a length-n reduction accumulated in float32 (the kernels'
     PSUM and the golden's statistics; U_ACC = 2^-24 for every row dtype) over zero-mean data, relative to the
     result's size. ``n`` is the length of the reduction that produced the output (``reduction_lengths``):
     keys for o / lse / dq, queries (times the GQA group) for dk / dv, all query rows for dsinks.
   * dsinks only, ``INPUT_LAMBDA * u(dtype) * ||t||_2`` (``dsinks_input_scale``): the backward reads O rounded
     to the dtype, and dsinks = -sum_i P_sink,i * sum_d O_id * dO_id carries that rounding term by term, an
     error the golden (which never reads O) does not make; and as dsinks has only heads x sinks elements, a
     sum that happens to cancel makes max|X64| a poor measure of its terms' size.

2. The seed's band ``max|X - X64| <= ATOL + RTOL * max|X64|`` (normwise, as the NKI Library's tests and our
   kernel tests apply their bands), required exactly where it can hold: when the sum of the two baselines'
   errors meets it and the floor of rule 1 fits inside it. Where even the baseline misses it (long sequences, large gradients in 16-bit types) no kernel could, and
   rule 1 alone decides. An element-wise reading (``|X - X64| <= ATOL + RTOL * |X64|`` per element) was tried
   first and rejected: near-zero elements inherit absolute errors from their row's large terms, so it failed
   kernels whose max error was below the baseline's (docs/tolerances.md, "Harness").
"""
import math

import numpy as np

# K: FlashAttention uses 2 for fp16/bf16; FlexAttention uses 10 for fp32, where the baseline's own error is
# at the level of summation-order noise and the online softmax reorders sums.
K = {"float32": 10.0, "bfloat16": 2.0, "float16": 2.0}
# n-independent floor relative to max|X64|: a few roundings to the dtype (u = 2^-24 fp32, 2^-8 bf16, 2^-11 fp16).
FLOOR = {"float32": 2.0 ** -22, "bfloat16": 2.0 ** -9, "float16": 2.0 ** -12}
# Unit roundoff of the accumulation (float32 PSUM in the kernels, float32 statistics in the golden) and the
# number of standard deviations the length term allows (docs/tolerances.md, "The floor").
U_ACC = 2.0 ** -24
LAMBDA = 1.0
# Standard deviations allowed to the random-walk sum of the O roundings in dsinks (Hoeffding: a failure
# probability of at most 2 exp(-LAMBDA^2 / 2) = 7e-4 per element even if every rounding were as large as u).
INPUT_LAMBDA = 4.0
U = {"float32": 2.0 ** -24, "bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}
# The seed's (atol, rtol) bands.
BANDS = {"float32": (1e-5, 1e-4), "bfloat16": (5e-3, 5e-3), "float16": (1e-3, 1e-3)}


def reduction_lengths(case):
    """Length of the longest reduction behind each output of a harness row (``cases.Case``).

    o, lse, dq sum over the keys one query row sees (at most seqlen_k; the window or the longest packed
    sequence caps it; lse also sums the sinks); dk, dv over the query rows that see one key, times the query
    heads of its GQA group; dsinks over every query row of the head. Returns dict output name -> n.
    """
    keys, queries = case.seqlen_k, case.seqlen_q
    if case.window:
        keys, queries = min(keys, case.window), min(queries, case.window)
    if getattr(case, "window_size", ()):
        left, right = case.window_size
        if case.causal:  # causal clips the right side to the diagonal
            right = 0
        if left >= 0 and right >= 0:  # the band i + off - left <= j <= i + off + right
            keys, queries = min(keys, left + right + 1), min(queries, left + right + 1)
    if case.cu_seqlens:
        longest = max(b - a for a, b in zip(case.cu_seqlens[:-1], case.cu_seqlens[1:]))
        keys, queries = min(keys, longest), min(queries, longest)
    group = case.heads // case.kv_heads
    n = {"o": keys, "lse": keys + case.num_sinks, "dq": keys, "dk": queries * group, "dv": queries * group,
         "dsinks": case.seqlen_q}
    return {k: max(1, v) for k, v in n.items()}


def floor_rel(dtype, n):
    """The floor of rule 1 relative to max|X64|: ``FLOOR[dtype] + LAMBDA * sqrt(n) * U_ACC``."""
    return FLOOR[dtype] + LAMBDA * math.sqrt(n) * U_ACC


def dsinks_input_scale(o, lse_rows, sinks, dy, over_batch=False):
    """The 2-norm of the terms t[i, d] = P_sink[i] * O[d, i] * dO[d, i] whose sum is -dsinks, per dsinks element,
    from the float64 reference; its maximum over the elements.

    Args:
        o, dy: [b, h, d, sq] (reference O and the incoming gradient); lse_rows: [b, h, sq] (+inf where a row
        sees nothing); sinks: [b, h] or [b, h, n]; over_batch: the dsinks element sums over the batch too (the
        API's sinks are shared by the batch).
    """
    o, dy, lse = (np.asarray(x, dtype=np.float64) for x in (o, dy, lse_rows))
    s = np.asarray(sinks, dtype=np.float64)
    s = s[..., None] if s.ndim == 2 else s                                        # [b, h, n]
    with np.errstate(over="ignore", invalid="ignore"):
        p = np.where(np.isinf(lse)[..., None], 0.0, np.exp(s[:, :, None, :] - lse[..., None]))  # [b, h, sq, n]
    sq_terms = np.einsum("bhin,bhi->bhn", p ** 2, np.sum((o * dy) ** 2, axis=2))
    if over_batch:
        sq_terms = sq_terms.sum(axis=0)
    return float(np.sqrt(np.max(sq_terms))) if sq_terms.size else 0.0


def compare(name, got, ref64, base, dtype, n=1, input_scale=0.0, inputs=None):
    """Errors of one output and the verdict.

    Args:
        got, ref64, base: arrays of one output (candidate, float64 reference, dtype baseline), same shape.
        dtype: the row's dtype name ("float32", "bfloat16", "float16").
        n: length of the reduction that produced the output (``reduction_lengths``).
        input_scale: dsinks only, ``dsinks_input_scale``; adds INPUT_LAMBDA * u(dtype) * input_scale.
        inputs: backward outputs only, the formula evaluated from the handed O and LSE (``runner.inputs_baseline``).
    Returns:
        dict with max_abs, max_rel (max_abs / max|ref64|), base_abs, base_rel, inputs_abs, n, input_floor, floor
        (absolute, input_floor included), bound
        (rule 1), k, band ([atol, rtol]), band_bound (atol + rtol * max|ref64|), band_required, band_ok,
        nonfinite, ok.
    """
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref64, dtype=np.float64)
    base = np.asarray(base, dtype=np.float64)
    if got.shape != ref.shape:
        return {"name": name, "ok": False, "error": f"shape {got.shape} != reference {ref.shape}"}
    # +inf LSE rows (no visible key) must match exactly and are excluded from the error arithmetic.
    inf_ref = np.isinf(ref)
    nonfinite = int(np.count_nonzero(~np.isfinite(got) & ~inf_ref) + np.count_nonzero(got[inf_ref] != ref[inf_ref]))
    fin = ~inf_ref
    g, r, b = got[fin], ref[fin], base[fin]
    scale = float(np.max(np.abs(r))) if r.size else 0.0
    with np.errstate(invalid="ignore"):
        err = float(np.max(np.abs(g - r))) if r.size else 0.0
        berr = float(np.max(np.abs(b - r))) if r.size else 0.0
        ierr = 0.0
        if inputs is not None and r.size:
            ierr = float(np.max(np.abs(np.asarray(inputs, dtype=np.float64)[fin] - r)))
    input_floor = INPUT_LAMBDA * U[dtype] * input_scale
    floor = floor_rel(dtype, n) * scale + input_floor
    bound = K[dtype] * (berr + ierr) + floor
    atol, rtol = BANDS[dtype]
    band = atol + rtol * scale
    # required where a correct implementation can meet it: its error may reach the two baselines' sum (its own
    # arithmetic like the golden's, plus what the handed O and LSE bring), so that sum and the floor must fit
    band_required = bool(berr + ierr <= band and floor <= band)
    band_ok = bool(err <= band)
    ok = nonfinite == 0 and np.isfinite(err) and err <= bound and (band_ok or not band_required)
    return {"name": name, "max_abs": err, "max_rel": err / scale if scale else 0.0, "base_abs": berr,
            "base_rel": berr / scale if scale else 0.0, "inputs_abs": ierr, "n": int(n), "input_floor": input_floor, "floor": floor, "bound": bound, "k": K[dtype],
            "band": [atol, rtol], "band_bound": band, "band_required": band_required, "band_ok": band_ok,
            "nonfinite": nonfinite, "ok": bool(ok)}
