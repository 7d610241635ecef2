"""Tolerance rules of the harness (the derivation and the measured margins are in docs/validation.md).

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
   * dq and dk only, ``LAMBDA * U_ACC * residue`` (``runner.residue_scales``): where dS = P (dP - D) cancels
     (a saturated softmax: O_i = V_j), dq and dk are far smaller than the float32 roundings of the two
     length-d_v reductions dP and D, which survive the difference; the term carries those roundings, sized by
     the floor's own length rule, through dq = scale dS K and dk = scale dS^T Q (docs/harness.md).
   * dsinks only, ``INPUT_LAMBDA * u(dtype) * ||t||_2`` (``dsinks_input_scale``): the backward reads O rounded
     to the dtype, and dsinks = -sum_i P_sink,i * sum_d O_id * dO_id carries that rounding term by term, an
     error the golden (which never reads O) does not make; and as dsinks has only heads x sinks elements, a
     sum that happens to cancel makes max|X64| a poor measure of its terms' size.

2. No systematic error (always applied)::

       |c| <= K[dtype] * (|c_b| + |c_i|) + SYS_LAMBDA * sigma + FLOOR[dtype] + sqrt(n) * U_ACC

   ``c = <X - X64, X64> / <X64, X64>`` is the relative scaling the error carries (a gradient scaled by 1.01 has
   c = 0.01), c_b and c_i the same for the two baselines (what their arithmetic makes systematically), sigma
   (``projection``) the size c reaches by chance when the errors of different vectors have no common direction
   (SYS_LAMBDA standard deviations), and the rule-1 floor the scaling that rule 1 would excuse anyway. Rule 1
   bounds the error's size, which for long reductions in 16-bit types exceeds 1 % of the output; rule 2 sees
   a scaling far below that, because rounding noise averages out of c and a scaling does not.

The seed's band ``atol + rtol * max|X64|`` is reported for every output (``band_ok``) but no longer judged:
rule 2 catches what it used to catch (docs/validation.md, "The band").
"""
import math

import numpy as np

from .mods import HARNESS_MODS

# K: FlashAttention uses 2 for fp16/bf16; FlexAttention uses 10 for fp32, where the baseline's own error is
# at the level of summation-order noise and the online softmax reorders sums.
K = {"float32": 10.0, "bfloat16": 2.0, "float16": 2.0}
# n-independent floor relative to max|X64|: a few roundings to the dtype (u = 2^-24 fp32, 2^-8 bf16, 2^-11 fp16).
FLOOR = {"float32": 2.0 ** -22, "bfloat16": 2.0 ** -9, "float16": 2.0 ** -12}
# Unit roundoff of the accumulation (float32 PSUM in the kernels, float32 statistics in the golden) and the
# number of standard deviations the length term allows (docs/validation.md, "The floor").
U_ACC = 2.0 ** -24
LAMBDA = 1.0
# Standard deviations allowed to the random-walk sum of the O roundings in dsinks (Hoeffding: a failure
# probability of at most 2 exp(-LAMBDA^2 / 2) = 7e-4 per element even if every rounding were as large as u).
INPUT_LAMBDA = 4.0
# Standard deviations allowed to the projection of the error on the reference (rule 2): a chance failure needs
# a 5-sigma coincidence, probability at most 2 exp(-25 / 2) = 7.5e-6 per output by Hoeffding.
SYS_LAMBDA = 5.0
U = {"float32": 2.0 ** -24, "bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}
# The seed's (atol, rtol) bands.
BANDS = {"float32": (1e-5, 1e-4), "bfloat16": (5e-3, 5e-3), "float16": (1e-3, 1e-3)}


def reduction_lengths(case):
    """Length of the longest reduction behind each output of a harness row (``cases.Case``).

    o, lse, dq sum over the keys one query row sees (at most seqlen_k; the window or the longest packed
    sequence caps it; lse also sums the sinks); dk, dv over the query rows that see one key, times the query
    heads of its GQA group; dsinks over every query row of the head; a score modification's gradient ``"d" + name``
    over what its row of ``mods.HARNESS_MODS`` counts (dlogit_scale: every visible (query, key) pair of the head;
    dbias: the keys times what its broadcast dims sum). Returns dict output name -> n.
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
    if getattr(case, "mask", ""):  # a prebuilt block mask: its longest row and its longest column
        from ..masks import interval_example
        _, lo, hi = interval_example(case.mask, case.seqlen_q)
        keys = int((hi - lo).max())
        j = np.arange(case.seqlen_k)[None, :]
        queries = int(((j >= lo.numpy()[:, None]) & (j < hi.numpy()[:, None])).sum(0).max())
    group = case.heads // case.kv_heads
    n = {"o": keys, "lse": keys + case.num_sinks, "dq": keys, "dk": queries * group, "dv": queries * group,
         "dsinks": case.seqlen_q}
    for m in HARNESS_MODS:  # a score modification's gradient: the terms its row counts (``grad_terms``)
        terms = m.grad_terms(case, keys) if m.grad_terms is not None else None
        if terms is not None:
            n["d" + m.name] = terms
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


def projection(err, ref, vec_axis=None):
    """The error's projection on the reference and the chance size of that projection.

    Args:
        err, ref: float64 arrays of one output (candidate - reference, reference), same shape, finite.
        vec_axis: the axis whose elements share their rounding errors (d_head for o, dq, dk, dv: one query row's
            or one key's vector is computed from the same P row, LSE, D or dS column); None treats every element
            as its own vector.
    Returns:
        (c, sigma, n_eff): ``c = <err, ref> / <ref, ref>``, the relative scaling the error carries;
        ``sigma = sqrt(sum_v ||n_v||^2 ||ref_v||^2 * n_eff / (n_eff - 1)) / <ref, ref>`` over the vectors v, with
        ``n = err - c * ref`` the error's noise around that scaling (the factor undoes what fitting c removed
        from it): the size ``c`` reaches by chance when the vectors' errors have no common direction;
        ``n_eff = <ref, ref>^2 / sum_v ||ref_v||^4``, how many vectors carry the reference's weight. All 0 when
        the reference is 0; sigma is inf when n_eff <= 1. Derivation: docs/validation.md, "Systematic error".
    """
    err = np.asarray(err, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    rr = float(np.sum(ref * ref))
    if rr == 0.0 or not np.isfinite(rr):
        return 0.0, 0.0, 0.0
    c = float(np.sum(err * ref)) / rr
    noise = err - c * ref
    if vec_axis is None:
        e2, r2 = noise * noise, ref * ref
    else:
        e2, r2 = np.sum(noise * noise, axis=vec_axis), np.sum(ref * ref, axis=vec_axis)
    n_eff = rr * rr / float(np.sum(r2 * r2))
    if n_eff <= 1.0 + 1e-9:
        return c, float("inf"), n_eff
    return c, math.sqrt(float(np.sum(e2 * r2)) * n_eff / (n_eff - 1.0)) / rr, n_eff


def compare(name, got, ref64, base, dtype, n=1, input_scale=0.0, inputs=None, vec_axis=None, zero_scale=0.0,
            residue=0.0):
    """Errors of one output and the verdict of the two rules (module docstring).

    Args:
        got, ref64, base: arrays of one output (candidate, float64 reference, dtype baseline), same shape.
        dtype: the row's dtype name ("float32", "bfloat16", "float16").
        n: length of the reduction that produced the output (``reduction_lengths``).
        input_scale: dsinks only, ``dsinks_input_scale``; adds INPUT_LAMBDA * u(dtype) * input_scale.
        inputs: backward outputs only, the formula evaluated from the handed O and LSE (``runner.inputs_baseline``).
        vec_axis: the axis of one vector's elements for the systematic check (``projection``): 2 (d_head) for
            o, dq, dk, dv in the kernels' layout; None for lse and dsinks.
        zero_scale: used only when the reference is identically zero (dq and dk of a problem in which every
            query row sees exactly one key and no sink: P = 1, so dP = D and dS = 0 by cancellation): the size
            the output would have if its terms did not cancel (``runner.zero_scale``), which then stands in for
            max|X64| in the floor.
            A zero max|X64| would otherwise demand an exact 0 from any candidate, whose D and dP are float32
            reductions in different orders; no other output is affected.
        residue: dq and dk only, ``runner.residue_scales``: the size of the float32 residue that dS = P (dP - D)
            keeps where dP and D cancel, divided by u; adds LAMBDA * U_ACC * residue to the floor.
    Returns:
        dict with max_abs, max_rel (max_abs / max|ref64|), base_abs, base_rel, inputs_abs, n, input_floor,
        residue_floor, floor (absolute, input_floor and residue_floor included), bound (rule 1), k; proj, proj_base, proj_inputs (the projections c of
        the candidate's, the baseline's and the inputs baseline's errors), proj_sigma, proj_bound, proj_vectors
        (n_eff), proj_applies (n_eff >= SYS_LAMBDA^2), proj_ok (rule 2); band ([atol, rtol]), band_bound (atol + rtol * max|ref64|) and band_ok (reported, not judged);
        nonfinite, ok.
    """
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref64, dtype=np.float64)
    base = np.asarray(base, dtype=np.float64)
    if got.shape != ref.shape:
        raise ValueError(f"output {name}: shape {tuple(got.shape)}, expected {tuple(ref.shape)}")
    # +inf LSE rows (no visible key) must match exactly and are excluded from the error arithmetic.
    inf_ref = np.isinf(ref)
    nonfinite = int(np.count_nonzero(~np.isfinite(got) & ~inf_ref) + np.count_nonzero(got[inf_ref] != ref[inf_ref]))
    fin = ~inf_ref
    if not fin.all():
        vec_axis = None
        got, ref, base = got[fin], ref[fin], base[fin]
        inputs = None if inputs is None else np.asarray(inputs, dtype=np.float64)[fin]
    inputs = None if inputs is None else np.asarray(inputs, dtype=np.float64)
    scale = float(np.max(np.abs(ref))) if ref.size else 0.0
    if scale == 0.0:
        scale = float(zero_scale)
    with np.errstate(invalid="ignore", over="ignore"):
        err = float(np.max(np.abs(got - ref))) if ref.size else 0.0
        berr = float(np.max(np.abs(base - ref))) if ref.size else 0.0
        ierr = float(np.max(np.abs(inputs - ref))) if inputs is not None and ref.size else 0.0
    input_floor = INPUT_LAMBDA * U[dtype] * input_scale
    residue_floor = LAMBDA * U_ACC * residue
    floor = floor_rel(dtype, n) * scale + input_floor + residue_floor
    bound = K[dtype] * (berr + ierr) + floor
    finite = nonfinite == 0 and bool(np.isfinite(err))
    # rule 2: the error's projection on the reference (systematic error), judged like rule 1 judges its size
    proj, sigma, n_eff = projection(got - ref, ref, vec_axis) if finite else (float("nan"), float("nan"), 0.0)
    if not finite:
        n_eff = projection(ref, ref, vec_axis)[2]
    proj_b = projection(base - ref, ref, vec_axis)[0]
    proj_i = projection(inputs - ref, ref, vec_axis)[0] if inputs is not None else 0.0
    proj_bound = K[dtype] * (abs(proj_b) + abs(proj_i)) + SYS_LAMBDA * sigma + floor_rel(dtype, n)
    # with fewer than SYS_LAMBDA^2 vectors carrying the weight, even a noise-free scaling cannot stand out from
    # the vectors' own errors: rule 2 does not apply and rule 1 decides alone (dsinks, tiny problems)
    proj_applies = bool(n_eff >= SYS_LAMBDA ** 2)
    proj_ok = bool(finite and (abs(proj) <= proj_bound or not proj_applies))
    atol, rtol = BANDS[dtype]
    band = atol + rtol * scale
    ok = finite and err <= bound and proj_ok
    return {"name": name, "max_abs": err, "max_rel": err / scale if scale else 0.0, "base_abs": berr,
            "base_rel": berr / scale if scale else 0.0, "inputs_abs": ierr, "n": int(n), "input_floor": input_floor,
            "residue_floor": residue_floor,
            "floor": floor, "bound": bound, "k": K[dtype],
            "proj": proj, "proj_base": proj_b, "proj_inputs": proj_i, "proj_sigma": sigma, "proj_bound": proj_bound,
            "proj_vectors": n_eff, "proj_applies": proj_applies, "proj_ok": proj_ok, "band": [atol, rtol], "band_bound": band, "band_ok": bool(err <= band),
            "nonfinite": nonfinite, "ok": bool(ok)}


def ratios(check):
    """(rule-1 ratio max_abs / bound, rule-2 ratio |proj| / proj_bound) of one ``compare`` result: above 1 fails."""
    r1 = check["max_abs"] / check["bound"] if check["bound"] else (0.0 if check["max_abs"] == 0 else float("inf"))
    if not check.get("proj_applies", True):
        return r1, 0.0
    if not math.isfinite(check["proj"]):
        return r1, float("inf")
    r2 = abs(check["proj"]) / check["proj_bound"] if check["proj_bound"] else 0.0
    return r1, r2
