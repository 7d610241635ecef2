"""Run one harness row: candidate forward + backward against the float64 golden and the dtype baseline.

A *candidate* is anything with the kernels' two signatures (``fwd(q, k, v, sinks, bound_min, bound_max,
use_causal_mask=, mixed_precision=, softmax_scale=, sliding_window=) -> (o, lse)`` and ``bwd(q, k, v, o, dy,
lse, sinks, bound_min, bound_max, ...) -> (dq, dk, dv[, dsinks])``). ``KernelCandidate`` is the NKI kernels;
``candidate.ExternalCandidate`` someone else's (``nki-attn check --candidate-bwd``); the harness's own tests
pass deliberately broken ones.

Rows whose lengths are not multiples of 128 (``case.via_api``) run through the candidate's ``run_api`` when it
has one (ours: the public PyTorch API, ``nki_attn.flash_attn_func`` or ``flash_attn_varlen_func``, which pads
for the kernels); any other candidate gets the problem padded to multiples of 128 with packing bounds that hide
the padded keys (``run_padded``). The reference is the golden on the problem padded the golden's own way (zero
rows, padded keys outside the packing bounds of ``golden.packing_bounds``), cut back to the unpadded rows and
keys, so padding is never judged.
"""
import contextlib
import os
import time
import zlib

import torch

import golden

from ..spec import GRAD_MODS, MODS, SCORE_MODS
from . import mods, tolerance
from .mods import bloom_alibi_slopes  # noqa: F401 (part of this module's API)
from .errors import CandidateError, Unsupported

_TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_TILE = 128
# The golden and the baselines form matrices of (query heads of one kv group) x (query rows) x (keys): the
# float64 golden's backward holds about six at once. They run one block of query rows at a time (each row's
# softmax sees all its keys, so the results are the whole problem's), the block as many rows (a multiple of
# 128) as keep one such float64 matrix within this budget in MiB; a row that fits is one block, computed as
# it always was. 256 MiB: every row of the quick and full presets up to 4096 tokens is one block, and the full
# preset's 16K row peaks at 3.3 GB resident instead of 16 GB (docs/harness.md, "Memory").
BLOCK_MIB_ENV = "NKI_ATTN_GOLDEN_BLOCK_MIB"
BLOCK_MIB = 256.0


class KernelCandidate:
    """The NKI kernels on the current backend; ``lnc=2`` launches them on two cores."""

    name = "nki-kernels"

    def __init__(self, lnc=1):
        from ..kernel_api import attention_bwd, attention_fwd  # ValueError for bad arguments, before launching
        self._fwd = attention_fwd[lnc] if lnc == 2 else attention_fwd
        self._bwd = attention_bwd[lnc] if lnc == 2 else attention_bwd
        self.lnc = lnc

    def with_lnc(self, lnc):
        """The kernels launched on ``lnc`` cores."""
        return KernelCandidate(lnc=lnc)

    def fwd(self, *args, **kwargs):
        return self._fwd(*args, **kwargs)

    def bwd(self, *args, **kwargs):
        return self._bwd(*args, **kwargs)

    def run_api(self, ins, case):
        """Forward + backward of a row through the public PyTorch API (any length); outputs as ``run_api``."""
        with _lnc_env(self.lnc):
            return run_api(ins, case)


@contextlib.contextmanager
def _lnc_env(lnc):
    """The API reads NKI_ATTN_LNC at call time: set it for the duration of one row."""
    prev = os.environ.get("NKI_ATTN_LNC")
    os.environ["NKI_ATTN_LNC"] = str(lnc)
    try:
        yield
    finally:
        if prev is None:
            os.environ.pop("NKI_ATTN_LNC", None)
        else:
            os.environ["NKI_ATTN_LNC"] = prev


def case_seed(case):
    """A stable seed per row name, so a row always sees the same inputs."""
    return zlib.crc32(case.name.encode())


def make_inputs(case, seed=None):
    """Inputs of a row in the kernels' layout, drawn in float64 then rounded to the row dtype.

    Returns dict: q [b, h, d, sq], k, v [b, hk, d, sk], dy like q (row dtype); sinks float32 [b, h] or
    [b, h, n] or None; bound_min, bound_max float32 [sq] or None; with the variants, alibi_slopes, logit_scale
    float32 [b, h] and dropout_seed.
    """
    g = torch.Generator().manual_seed(case_seed(case) if seed is None else seed)
    dt = _TORCH[case.dtype]

    def draw(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dt)

    b, h, hk, d, dv = case.batch, case.heads, case.kv_heads, case.d_head, case.dv
    ins = {"q": draw(b, h, d, case.seqlen_q), "k": draw(b, hk, d, case.seqlen_k), "v": draw(b, hk, dv, case.seqlen_k),
           "dy": draw(b, h, dv, case.seqlen_q), "sinks": None, "bound_min": None, "bound_max": None}
    if case.num_sinks:
        # the API shares sinks across the batch, so API rows draw one set and repeat it
        shape = (1 if case.via_api else b, h) + (() if case.num_sinks == 1 else (case.num_sinks,))
        sinks = torch.randn(*shape, generator=g, dtype=torch.float64).to(torch.float32)
        if case.sinks_inf == "head":
            sinks[:, 0] = float("-inf")
        elif case.sinks_inf == "first":  # sink 0 of every head (with one sink per head: every sink)
            if sinks.dim() == 3:
                sinks[..., 0] = float("-inf")
            else:
                sinks.fill_(float("-inf"))
        ins["sinks"] = sinks.expand(b, *shape[1:]).contiguous()
    if case.cu_seqlens:
        cu = torch.tensor(case.cu_seqlens, dtype=torch.int64)
        ins["bound_min"], ins["bound_max"] = golden.packing_bounds(cu, seqlen_q=case.seqlen_q)
    if case.mask:
        # the golden takes the mask as per-query key bounds; the kernels get it as a block mask (_run_kernels)
        from ..masks import interval_example
        _, lo, hi = interval_example(case.mask, case.seqlen_q)
        ins["bound_min"], ins["bound_max"] = lo.to(torch.float32), hi.to(torch.float32)
    if case.dropout:
        ins["dropout_seed"] = dropout_seed(case)
    # each score modification's input, drawn by its row of mods.HARNESS_MODS in table order (the order of the
    # generator's draws)
    for m in mods.HARNESS_MODS:
        if m.draw is not None and getattr(case, m.name):
            ins[MODS[m.name].kernel] = m.draw(case, g, draw)
    return ins


def _refuse_api_dropout(case):
    if case.dropout and case.via_api:
        raise ValueError(f"row {case.name}: dropout rows need lengths that are multiples of 128 (the harness "
                         f"regenerates the kernels' keep mask from the seed; the API draws its own)")


def dropout_seed(case):
    """The dropout seed of a row: the kernels' runtime seed tensor, int32 ``[2]`` = (seed, offset)
    (docs/semantics.md, "Dropout"), the seed derived from the row name like its inputs, offset 0."""
    return torch.tensor([case_seed(case) & 0x7FFFFFFF, 0], dtype=torch.int32)


def keep_mask(ins, case):
    """The bool keep mask ``[b, heads, seqlen_q, seqlen_k]`` the row's seed gives (``golden.dropout``), or None."""
    if not case.dropout:
        return None
    _refuse_api_dropout(case)
    from golden import dropout as gd
    return gd.keep_mask(ins["dropout_seed"], case.dropout, case.batch, case.heads, case.seqlen_q, case.seqlen_k)


def _kwargs(case):
    return dict(use_causal_mask=case.causal, softmax_scale=case.scale or None, sliding_window=case.window or None)


def variant_kwargs(case, ins):
    """The variant keywords of a row, only those it uses (so candidates without them still run other rows): the
    window and dropout, then every score modification of ``nki_attn.spec.SCORE_MODS`` the row sets (its
    ``Case`` field has the row's name; a tensor's input is ``ins[<kernel keyword>]``, a number is the field's
    value)."""
    kw = {}
    for m in SCORE_MODS:
        if getattr(case, m.name):
            kw[m.kernel] = ins[m.kernel] if m.is_tensor else getattr(case, m.name)
    if case.window_size:
        kw["window_size"] = tuple(case.window_size)
    if case.dropout:
        kw["dropout_p"] = case.dropout
        kw["dropout_seed"] = ins["dropout_seed"]
    return kw


def _group_slice(t, hq, cv):
    """A score modification's input for the query heads ``hq`` of one kv group: ``[b, h]`` -> ``[b, hq]``;
    a 4-D additive bias -> its heads' slice (``mods.bias_head_slice``), converted by ``cv`` like q, k, v."""
    return t[:, hq].contiguous() if t.dim() == 2 else cv(mods.bias_head_slice(t, hq))


def _sum_to(x, shape):
    """``x`` ``[b, h, sq, sk]`` summed over the dims a bias of ``shape`` broadcasts (the gradient of that bias);
    any other gradient (its input's own shape) as it is."""
    dims = [i for i in range(len(shape)) if shape[i] == 1 and x.shape[i] != 1]
    return x.sum(dim=dims, keepdim=True) if dims else x


def _pad_to_tiles(ins, case):
    """The row's problem padded for the golden (which needs multiples of 128): q, dy with zero query rows, k, v
    with zero keys that the packing bounds hide from every query; padded query rows see no key. Returns
    (padded inputs, cut) with ``cut(outputs)`` restoring the unpadded problem's outputs."""
    sq, sk = case.seqlen_q, case.seqlen_k
    # the golden needs seqlen_q a multiple of 128 (any seqlen_k); padding the keys by as much as the queries keeps
    # the diagonal offset seqlen_k - seqlen_q, so bottom-right causal masks, windows and ALiBi distances of the
    # real rows are those of the unpadded problem
    sq_p = -(-sq // _TILE) * _TILE
    sk_p = sk + (sq_p - sq)
    pad = dict(ins)
    for n, s_p in (("q", sq_p), ("dy", sq_p), ("k", sk_p), ("v", sk_p)):
        pad[n] = torch.nn.functional.pad(ins[n], (0, s_p - ins[n].shape[-1]))
    if case.cu_seqlens:
        pad["bound_min"], pad["bound_max"] = golden.packing_bounds(torch.tensor(case.cu_seqlens), seqlen_q=sq_p)
    else:
        pad["bound_min"], pad["bound_max"] = golden.packing_bounds(torch.tensor([0, sq]), torch.tensor([0, sk]),
                                                                   seqlen_q=sq_p)

    def cut(out):
        res = dict(out)
        b, h = out["o"].shape[:2]
        res["o"], res["dq"] = out["o"][..., :sq], out["dq"][..., :sq]
        res["dk"], res["dv"] = out["dk"][..., :sk], out["dv"][..., :sk]
        res["lse"] = out["lse"].permute(0, 1, 3, 2).reshape(b, h, sq_p)[..., :sq]  # row t * 128 + p at [p, t]
        if "dsinks" in out:
            res["dsinks"] = out["dsinks"].sum(dim=0)  # the API's sinks are shared by the batch
        return res

    return pad, cut


def block_mib():
    """The block budget in MiB: ``NKI_ATTN_GOLDEN_BLOCK_MIB`` (a number > 0) when set, else ``BLOCK_MIB``.
    Raises ValueError naming the variable when it is not a positive number."""
    text = os.environ.get(BLOCK_MIB_ENV, "")
    if not text:
        return BLOCK_MIB
    try:
        mib = float(text)
    except ValueError:
        mib = float("nan")
    if not mib > 0 or mib == float("inf"):
        raise ValueError(f"{BLOCK_MIB_ENV}={text!r} must be a finite number of MiB > 0 (default {BLOCK_MIB:g})")
    return mib


def query_block_rows(batch, group, seqlen_q, seqlen_k):
    """Query rows per block of the golden and the baselines: ``seqlen_q`` (one block) when a float64
    ``[batch, group, seqlen_q, seqlen_k]`` matrix fits in ``block_mib()``, else the largest multiple of 128
    whose ``[batch, group, rows, seqlen_k]`` matrix fits (at least 128). ``seqlen_k`` counts the sinks'
    columns too."""
    per_row = 8 * max(1, batch * group * seqlen_k)
    rows = int(block_mib() * 2 ** 20) // per_row
    if rows >= seqlen_q:
        return seqlen_q
    return max(_TILE, rows // _TILE * _TILE)


def _slices(seqlen_q, rows):
    """Slices of ``rows`` query rows (the last shorter), in order, covering ``[0, seqlen_q)``; one empty slice
    for no rows."""
    return [slice(i, min(seqlen_q, i + rows)) for i in range(0, seqlen_q, rows)] or [slice(0, 0)]


def _row_blocks(batch, group, seqlen_q, seqlen_k):
    """The query-row slices of ``query_block_rows``, in order, covering ``[0, seqlen_q)``."""
    return _slices(seqlen_q, query_block_rows(batch, group, seqlen_q, seqlen_k))


def _keep_rows(ins, case, hq, rows):
    """The dropout keep mask of query heads ``hq`` and query rows ``rows`` (slices), bool ``[b, group, rows,
    seqlen_k]``: ``golden.dropout``'s hash of just those rows (``keep_mask``'s values, without forming the whole
    ``[b, heads, seqlen_q, seqlen_k]`` mask), or None without dropout."""
    if not case.dropout:
        return None
    _refuse_api_dropout(case)
    from golden import dropout as gd
    h = gd.hash_values(ins["dropout_seed"], case.batch, case.heads, case.seqlen_q, case.seqlen_k,
                       q_range=range(rows.start, rows.stop))
    return h[:, hq] < gd.keep_threshold(case.dropout)


def reference(ins, case, as_dtype):
    """Golden outputs of a row: ``as_dtype=torch.float64`` gives the reference, ``None`` the dtype baseline.

    Kernel rows: o, dq [b, h, d, sq], dk, dv [b, hk, d, sk], lse [b, h, 128, sq // 128], dsinks [b, h(, n)].
    API rows: the same for the unpadded problem, except lse [b, h, sq] and dsinks [h(, n)] (the API's layouts).
    """
    if not case.via_api:
        return _golden(ins, case, as_dtype)
    pad, cut = _pad_to_tiles(ins, case)
    return cut(_golden(pad, case, as_dtype))


def _softmax_groups(ins, ref, case, dt):
    """``_softmax_blocks`` with every query row in one block, without the rows: ``(hq, g, p, dp, drop, states)``
    per kv head g, each matrix ``[b, group, sq, sk]``."""
    sq = case.seqlen_q
    for hq, g, _, p, dp, drop, states in _softmax_blocks(ins, ref, case, dt, rows=max(1, sq)):
        yield hq, g, p, dp, drop, states


def _softmax_blocks(ins, ref, case, dt, rows=None, with_dp=True):
    """The backward's softmax pieces in dtype ``dt``, one kv group and one block of query rows at a time, from
    the reference LSE rounded to float32 (the LSE a backward kernel is handed) on the unpadded problem.

    Yields ``(hq, g, r, p, dp, drop, states)`` per kv head g and block ``r`` (a slice of the query rows, of
    ``rows`` rows; default ``query_block_rows``): ``hq`` the slice of its query heads; p = exp(S - LSE)
    [b, group, r, sk] (0 where a row sees no key); dp = dO V^T [b, group, r, sk]; drop the dropout multiplier
    M / (1 - p) or None; states the score modifications the row sets, in score order, each ``(HarnessMod,
    state)`` with what its backward needs (``mods.apply_scores``). Every row's values are those of the whole
    head's matrices (the rows are independent), so a caller summing over rows adds up its blocks.
    ``with_dp=False`` yields None for dp (a caller that does not read it holds one matrix less).
    """
    from golden.attention_fwd_torch import block_offset, visibility_mask

    lse = ref["lse"]
    if lse.dim() == 4:  # kernel layout [b, h, 128, sq // 128]: row t * 128 + p at [p, t]
        lse = lse.permute(0, 1, 3, 2).reshape(lse.shape[0], lse.shape[1], -1)
    lse = lse.to(torch.float32).to(dt)
    q, k, v, dy = (ins[n].to(dt) for n in ("q", "k", "v", "dy"))
    scale = case.scale or case.d_head ** -0.5
    sq, sk = case.seqlen_q, case.seqlen_k
    bounds = case.cu_seqlens or case.mask
    group = case.heads // case.kv_heads
    if rows is None:
        blocks = _row_blocks(case.batch, group, sq, sk)
    else:
        blocks = _slices(sq, rows)
    whole = len(blocks) == 1
    keep = keep_mask(ins, case) if whole else None
    for g in range(case.kv_heads):
        hq = slice(g * group, (g + 1) * group)
        for r in blocks:
            vis = visibility_mask(r.stop - r.start, sk, case.causal, case.window or None,
                                  ins["bound_min"][r] if bounds else None, ins["bound_max"][r] if bounds else None,
                                  window_size=tuple(case.window_size) or None,
                                  diag_offset=block_offset(sq, sk, r.start))
            s = torch.einsum("bhdq,bdk->bhqk", q[:, hq, :, r], k[:, g]) * scale
            s, states = mods.apply_scores(s, case, ins, hq, dt, None if whole else r)
            # in place: the scores after the modifications are no modification's state (each keeps its input)
            p = s.masked_fill_(~vis, float("-inf")).sub_(lse[:, hq, r, None]).exp_()
            del s, vis
            p = torch.nan_to_num(p, nan=0.0, out=p)                                      # rows with no key: 0
            dp = torch.einsum("bhdq,bdk->bhqk", dy[:, hq, :, r], v[:, g]) if with_dp else None
            kb = None if not case.dropout else keep[:, hq] if whole else _keep_rows(ins, case, hq, r)
            drop = None if kb is None else kb.to(dt) / (1.0 - case.dropout)
            yield hq, g, r, p, dp, drop, states


def _add(acc, t):
    """``acc + t``, or ``t`` itself when ``acc`` is None (so a single block's sum is its own value, bit for
    bit)."""
    return t if acc is None else acc + t


def inputs_baseline(ins, ref, case):
    """The backward's LSE-based formula in float32, reading the reference O rounded to the row's dtype and the
    reference LSE rounded to float32 (the inputs a backward kernel is handed): D = rowsum(O * dO),
    P = exp(S - LSE), dS = P * (dP - D), dV = P^T dO, dQ = scale dS K, dK = scale dS^T Q, dsinks =
    -sum_rows P_sink D; the score modifications' own formulas (``mods.HARNESS_MODS``: ``scores`` on S, then
    back in reverse order ``grad`` for their parameter's gradient and ``chain`` on dS; e.g. a logit scale lam:
    S scaled by lam first, dS by lam on its way to dQ, dK, and dlogit_scale = sum dS * scale S). Its error is
    what any implementation of that formula gets from those inputs, which the golden baseline (it normalises its
    own P and never reads O) does not make (docs/validation.md). The formulas are the harness's own, written apart
    from the golden's on purpose (a second reference must not share the first's mistakes).

    Works on the unpadded problem for every row; returns dq, dk, dv (and dsinks, and the gradient ``"d" + name``
    of each modification whose row has ``grad``) in ``reference``'s layouts.
    """
    f32, dt = torch.float32, _TORCH[case.dtype]
    o = ref["o"].to(dt).to(f32)
    q, k, v, dy = (ins[n].to(f32) for n in ("q", "k", "v", "dy"))
    scale = case.scale or case.d_head ** -0.5
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dd = (o * dy).sum(2)                                                              # D [b, h, sq] (dropped O)
    grads = {m.name: torch.zeros(q.shape[:2], dtype=f32) for m, _ in mods.active(case) if m.grad is not None}
    # dk, dv and the parameters' gradients sum over the query rows: their blocks' terms are added up in float32
    acc = {}
    for hq, g, r, p, dp, drop, states in _softmax_blocks(ins, ref, case, f32):
        p_v = p                                                                      # P as dV and O see it
        if drop is not None:
            p_v, dp = p * drop, dp * drop
        ds = p * (dp - dd[:, hq, r, None])
        for m, st in reversed(states):                # dS at each modification's output, last applied first
            if m.grad is not None:
                acc[m.name, g] = _add(acc.get((m.name, g)), m.grad(ds, st))
            if m.chain is not None:
                ds = ds * m.chain(st)
        dq[:, hq, :, r] = torch.einsum("bhqk,bdk->bhdq", ds, k[:, g]) * scale
        acc["dk", g] = _add(acc.get(("dk", g)), torch.einsum("bhqk,bhdq->bdk", ds, q[:, hq, :, r]) * scale)
        acc["dv", g] = _add(acc.get(("dv", g)), torch.einsum("bhqk,bhdq->bdk", p_v, dy[:, hq, :, r]))
    group = case.heads // case.kv_heads
    for (name, g), t in acc.items():
        if name == "dk":
            dk[:, g] = t
        elif name == "dv":
            dv[:, g] = t
        else:
            grads[name][:, g * group:(g + 1) * group] = t
    out = {"dq": dq, "dk": dk, "dv": dv}
    for name, grad in grads.items():
        out["d" + name] = grad
    if ins["sinks"] is not None:
        lse = ref["lse"]
        if lse.dim() == 4:
            lse = lse.permute(0, 1, 3, 2).reshape(lse.shape[0], lse.shape[1], -1)
        lse = lse.to(f32)
        sinks = ins["sinks"].to(f32)
        sinks = sinks[..., None] if sinks.dim() == 2 else sinks                      # [b, h, n]
        psink = torch.nan_to_num(torch.exp(sinks[:, :, None, :] - lse[..., None]), nan=0.0)
        ds = -(psink * dd[..., None]).sum(2).reshape(ins["sinks"].shape)
        out["dsinks"] = ds.sum(0) if case.via_api else ds
    return out


def residue_scales(ins, ref, case):
    """The float32 residue dS = P * (dP - D) leaves in dq and dk where dP and D cancel (``tolerance.compare``'s
    ``residue``; derivation: docs/harness.md, "Cancellation in dS").

    dP_ij = dO_i . V_j and D_i = dO_i . O_i are float32 reductions of length d_v, each in error by about
    sqrt(d_v) * u * ||terms||_2 (the floor's length rule applied to them), and that error survives their
    difference even where the difference, and so dq and dk, is tiny (a saturated softmax: O_i = V_j, P_ij = 1).
    With a_ij = ||dO_i * V_j||_2 (times the dropout multiplier), b_i = ||dO_i * O_i||_2 and P' = P times the
    score modifications' |chain| factors (1 - tanh^2 with soft-capping, |logit_scale| with one), from the
    float64 reference, the residue's size per element is

        dq[i, c]: scale * sqrt(d_v) * (sqrt(sum_j (P'_ij a_ij K_jc)^2) + b_i |sum_j P'_ij K_jc|)
        dk[j, c]: scale * sqrt(d_v) * (sqrt(sum_i (P'_ij a_ij Q_ic)^2) + sqrt(sum_i (P'_ij b_i Q_ic)^2))

    (the dP errors are independent per (i, j) and add like a random walk; D's is shared by a query row's keys,
    so it adds coherently in dq). Returns {"dq": max over dq's elements, "dk": max over dk's}, both without the
    factor u, which ``tolerance.compare`` applies."""
    f64 = torch.float64
    o = ref["o"].to(f64)
    q, k, v, dy = (ins[n].to(f64) for n in ("q", "k", "v", "dy"))
    scale = case.scale or case.d_head ** -0.5
    b_i = ((o * dy) ** 2).sum(2).sqrt()                                               # [b, h, sq]
    rq, rk = torch.zeros_like(q), torch.zeros_like(k)
    sums = {}  # dk's two sums of squares over the query rows, per kv head, added up over the blocks
    # (in place where a matrix is not read again: a block holds about three [b, group, rows, sk] matrices)
    for hq, g, r, p, _, drop, states in _softmax_blocks(ins, ref, case, f64, with_dp=False):
        for m, st in reversed(states):  # dS reaches dq and dk times each modification's chain factor
            if m.chain is not None:
                p = p * m.chain(st).abs()
        del states
        pk = torch.einsum("bhqk,bdk->bhdq", p, k[:, g]).abs()
        pa2 = torch.einsum("bhdq,bdk->bhqk", dy[:, hq, :, r] ** 2, v[:, g] ** 2).sqrt_()  # ||dO_i * V_j||_2
        if drop is not None:
            pa2.mul_(drop)
        del drop
        pa2.mul_(p).square_()                                                              # (P a)^2
        rq[:, hq, :, r] = torch.einsum("bhqk,bdk->bhdq", pa2, k[:, g] ** 2).sqrt() + b_i[:, hq, None, r] * pk
        q2 = q[:, hq, :, r] ** 2
        s_a = torch.einsum("bhqk,bhdq->bdk", pa2, q2)
        del pa2
        pb2 = p.mul_(b_i[:, hq, r, None]).square_()                                        # (P b)^2
        del p
        s_b = torch.einsum("bhqk,bhdq->bdk", pb2, q2)
        del pb2
        acc_a, acc_b = sums.get(g, (None, None))
        sums[g] = (_add(acc_a, s_a), _add(acc_b, s_b))
    for g, (s_a, s_b) in sums.items():
        rk[:, g] = s_a.sqrt() + s_b.sqrt()
    d = case.dv ** 0.5 * scale

    def top(t):
        return float(t.max()) * d if t.numel() else 0.0

    return {"dq": top(rq), "dk": top(rk)}


def _golden(ins, case, as_dtype):
    """Golden forward + backward with inputs converted to ``as_dtype`` (float64: the reference).

    Run one kv head (with its query heads) at a time, and within it one block of query rows at a time
    (``query_block_rows``): the golden materialises [heads, seqlen_q, seqlen_k] matrices, which for a whole
    model's heads at 4096 tokens, or one head at 16K tokens, in float64 would need tens of GiB. Each kv head's
    slice is an independent attention problem, so the results are the same; so is each block of query rows
    against all keys (``_golden_blocks``).
    """
    cv = (lambda t: None if t is None else t.to(as_dtype)) if as_dtype is not None else (lambda t: t)
    q, k, v, dy = (cv(ins[n]) for n in ("q", "k", "v", "dy"))
    sinks = ins["sinks"].to(torch.float64) if (ins["sinks"] is not None and as_dtype == torch.float64) \
        else ins["sinks"]
    group = case.heads // case.kv_heads
    blocks = _row_blocks(q.shape[0], group, q.shape[-1], k.shape[-1] + case.num_sinks)
    # the keep mask is a function of the QUERY head: regenerate it once for all heads and hand each kv group its
    # query heads' slice (the golden would otherwise number a group's heads from 0); blocks hash their own rows
    keep = keep_mask(ins, case) if len(blocks) == 1 else None
    parts = []
    for g in range(case.kv_heads):
        hq, hk = slice(g * group, (g + 1) * group), slice(g, g + 1)
        s_g = None if sinks is None else sinks[:, hq]
        kw = dict(_kwargs(case), softcap=case.softcap, window_size=tuple(case.window_size) or None)
        for m in SCORE_MODS:
            if m.is_tensor and getattr(case, m.name):
                kw[m.kernel] = _group_slice(ins[m.kernel], hq, cv)
        if len(blocks) > 1:
            parts.append(_golden_blocks(q[:, hq], k[:, hk], v[:, hk], dy[:, hq], s_g, ins, case, hq, kw, blocks))
            continue
        if keep is not None:
            kw.update(dropout_p=case.dropout, dropout_mask=keep[:, hq].contiguous())
        o, lse = golden.attention_fwd_torch_ref(q[:, hq], k[:, hk], v[:, hk], s_g, ins["bound_min"],
                                                ins["bound_max"], mixed_precision=True, **kw)
        gr = golden.attention_bwd_torch_ref(q[:, hq], k[:, hk], v[:, hk], o, dy[:, hq], lse, s_g, ins["bound_min"],
                                            ins["bound_max"], mixed_precision=True, **kw)
        part = {"o": o, "lse": lse, "dq": gr["out_dq_ref"], "dk": gr["out_dk_ref"], "dv": gr["out_dv_ref"]}
        if sinks is not None:
            part["dsinks"] = gr["out_dsinks_ref"]
        for m in GRAD_MODS:
            if getattr(case, m.name):
                part["d" + m.name] = gr[f"out_d{m.name}_ref"]
        parts.append(part)
    out = {name: torch.cat([p[name] for p in parts], dim=1) for name in parts[0]}
    for m in GRAD_MODS:  # an input shared by the heads (a bias [., 1, ., .]): every kv group adds to its gradient
        if getattr(case, m.name) and ins[m.kernel].shape[1] == 1:
            out["d" + m.name] = sum(p["d" + m.name] for p in parts)
    return out


def _golden_blocks(q, k, v, dy, sinks, ins, case, hq, kw, blocks):
    """One kv group's golden forward + backward, one block of query rows at a time (``blocks``: slices of the
    rows, multiples of 128 long but the last): the golden's ``diag_offset`` hook gives a block the whole
    problem's masks and ALiBi distances (``golden.attention_fwd_torch.block_offset``), and the block's rows of
    the packing bounds, of a bias with a query dim and of the dropout keep mask go with it. Each block's o, lse
    and dq rows are the whole problem's (every row's softmax sees all its keys); dk and dv come back unrounded
    (``kv_partial``) and are summed over the blocks in float32 (float64 for the reference), then rounded to the
    inputs' dtype once, like the unblocked matmul; dsinks and the parameters' gradients are summed over the
    blocks (a bias with a query dim takes its blocks' rows). Returns ``_golden``'s part of one group."""
    from golden.attention_fwd_torch import block_offset

    def has_rows(t):  # a [b, h, sq, sk] input with a query dim (not broadcast over the rows)
        return t is not None and t.dim() == 4 and t.shape[2] > 1

    sq, sk = q.shape[-1], k.shape[-1]
    rows_of = {}  # the gradients of inputs with a query dim: their blocks' rows, concatenated
    for m in GRAD_MODS:
        if getattr(case, m.name) and has_rows(kw.get(m.kernel)):
            rows_of["d" + m.name] = 2
    cat, total = {}, {}
    for r in blocks:
        kb = dict(kw, diag_offset=block_offset(sq, sk, r.start))
        for m in SCORE_MODS:
            if m.is_tensor and has_rows(kw.get(m.kernel)):
                kb[m.kernel] = kw[m.kernel][:, :, r]
        if case.dropout:
            kb.update(dropout_p=case.dropout, dropout_mask=_keep_rows(ins, case, hq, r))
        bmin = None if ins["bound_min"] is None else ins["bound_min"][r]
        bmax = None if ins["bound_max"] is None else ins["bound_max"][r]
        qb, dyb = q[..., r], dy[..., r]
        o, lse = golden.attention_fwd_torch_ref(qb, k, v, sinks, bmin, bmax, mixed_precision=True, **kb)
        gr = golden.attention_bwd_torch_ref(qb, k, v, o, dyb, lse, sinks, bmin, bmax, mixed_precision=True,
                                            kv_partial=True, **kb)
        for name, t in (("o", o), ("lse", lse), ("dq", gr["out_dq_ref"])):
            cat.setdefault(name, []).append(t)
        sums = {"dk": gr["out_dk_ref"], "dv": gr["out_dv_ref"]}
        if sinks is not None:
            sums["dsinks"] = gr["out_dsinks_ref"]
        for m in GRAD_MODS:
            if getattr(case, m.name):
                name = "d" + m.name
                if name in rows_of:
                    cat.setdefault(name, []).append(gr[f"out_d{m.name}_ref"])
                else:
                    sums[name] = gr[f"out_d{m.name}_ref"]
        for name, t in sums.items():
            total[name] = _add(total.get(name), t)
    part = {name: torch.cat(ts, dim=rows_of.get(name, -1)) for name, ts in cat.items()}
    part.update(total)
    part["dk"], part["dv"] = part["dk"].to(q.dtype), part["dv"].to(q.dtype)
    order = ("o", "lse", "dq", "dk", "dv", "dsinks") + tuple("d" + m.name for m in GRAD_MODS)  # _golden's order
    return {name: part[name] for name in order if name in part}


def run_candidate(candidate, ins, case):
    """Candidate forward then backward on the candidate's own o and lse; dict of outputs.

    API rows (``case.via_api``) call ``candidate.run_api(ins, case)`` when the candidate has one, else
    ``run_padded``.
    """
    if case.via_api and case.bias:
        raise ValueError(f"row {case.name}: bias rows need lengths that are multiples of 128 (kernel rows)")
    if case.via_api:
        if hasattr(candidate, "run_api"):
            return candidate.run_api(ins, case)
        return run_padded(candidate, ins, case)
    return _run_kernels(candidate, ins, case)


def _run_kernels(candidate, ins, case):
    """Forward then backward in the kernels' layout (lengths multiples of 128); dict of outputs."""
    extra = variant_kwargs(case, ins)
    bmin, bmax = ins["bound_min"], ins["bound_max"]
    if case.mask and isinstance(candidate, KernelCandidate):
        # our kernels take the row's mask as a block mask (a candidate of yours gets the same mask as bounds)
        from ..block_mask import create_block_mask
        from ..masks import interval_example
        bm = create_block_mask(interval_example(case.mask, case.seqlen_q)[0], None, None, case.seqlen_q,
                               case.seqlen_k)
        blk, store = bm.kernel_operands()
        bmin, bmax = None, None
        extra.update(block_mask=blk, block_bits=store)
    o, lse = candidate.fwd(ins["q"], ins["k"], ins["v"], ins["sinks"], bmin, bmax,
                           mixed_precision=True, **_kwargs(case), **extra)
    for m in GRAD_MODS:  # a gradient computed on request (the bias's) is requested
        if m.grad_flag and m.kernel in extra:
            extra = dict(extra, **{m.grad_flag: True})
    res = candidate.bwd(ins["q"], ins["k"], ins["v"], o, ins["dy"], lse, ins["sinks"], bmin,
                        bmax, mixed_precision=True, **_kwargs(case), **extra)
    out = {"o": o, "lse": lse, "dq": res[0], "dk": res[1], "dv": res[2]}
    if ins["sinks"] is not None:
        out["dsinks"] = res[3]
    # the kernel's outputs after dsinks: one gradient per score modification given, in SCORE_MODS order (a
    # broadcast bias's summed over its broadcast dims)
    rest = list(res[3 + (ins["sinks"] is not None):])
    for m in GRAD_MODS:
        if m.kernel in extra:
            out["d" + m.name] = _sum_to(rest.pop(0), tuple(ins[m.kernel].shape))
    return out


def candidate_bounds(case, seqlen_q_padded):
    """Packing bounds of the padded problem ``run_padded`` hands a candidate, float32 ``[seqlen_q_padded]``.

    Real query rows keep the row's visibility (its packing, else every real key); padded query rows see every
    real key, so that the padding itself leaves no row without keys (their dO is 0: they add nothing to dK, dV
    or dsinks, and their outputs are cut away); padded keys are outside every row's bounds. A causal row with
    seqlen_q == seqlen_k and no packing needs no bounds, (None, None): the padded keys come after every real
    query, so the causal mask hides them, and a candidate without packing support can run it.
    """
    sq, sk = case.seqlen_q, case.seqlen_k
    if case.causal and sq == sk and not case.cu_seqlens:
        return None, None
    if case.cu_seqlens:
        bmin, bmax = golden.packing_bounds(torch.tensor(case.cu_seqlens), seqlen_q=seqlen_q_padded)
    else:
        bmin = torch.zeros(seqlen_q_padded, dtype=torch.float32)
        bmax = torch.full((seqlen_q_padded,), float(sk), dtype=torch.float32)
    bmin[sq:], bmax[sq:] = 0.0, float(sk)
    return bmin, bmax


def run_padded(candidate, ins, case):
    """A row of any length run by a kernels-only candidate: q, dy padded with zero query rows and k, v with zero
    keys to multiples of 128, bounds from ``candidate_bounds``; forward + backward as for aligned rows; outputs
    cut back to the unpadded problem in ``reference``'s layouts. The candidate must support packing bounds.

    Padding at the end keeps the diagonal offset seqlen_k - seqlen_q only when both lengths pad by the same
    amount (seqlen_k - seqlen_q a multiple of 128); otherwise the zero rows and keys go in FRONT
    (``_pad_front``), which keeps every offset i + seqlen_k - seqlen_q - j (bottom-right masks, windows, ALiBi
    distances) whatever the two paddings are."""
    if (case.seqlen_k - case.seqlen_q) % _TILE:
        pad, cut = _pad_front(ins, case)
        return cut(_run_kernels(candidate, pad, case))
    pad, cut = _pad_to_tiles(ins, case)
    pad["bound_min"], pad["bound_max"] = candidate_bounds(case, pad["q"].shape[-1])
    return cut(_run_kernels(candidate, pad, case))


def _pad_front(ins, case):
    """The row's problem for a candidate with seqlen_q and seqlen_k padded to multiples of 128 by ``P_q`` zero
    query rows and ``P_k`` zero keys in front: query i becomes i + P_q and key j becomes j + P_k, so
    ``i + sk - sq - j`` is unchanged; bounds ``[P_k, sk_p)`` hide the padded keys from every row (packed rows
    never come here: their seqlen_q == seqlen_k). Returns (padded inputs, cut) as ``_pad_to_tiles``."""
    sq, sk = case.seqlen_q, case.seqlen_k
    sq_p, sk_p = -(-sq // _TILE) * _TILE, -(-sk // _TILE) * _TILE
    pq, pk = sq_p - sq, sk_p - sk
    pad = dict(ins)
    for n, front in (("q", pq), ("dy", pq), ("k", pk), ("v", pk)):
        pad[n] = torch.nn.functional.pad(ins[n], (front, 0))
    pad["bound_min"] = torch.full((sq_p,), float(pk), dtype=torch.float32)
    pad["bound_max"] = torch.full((sq_p,), float(sk_p), dtype=torch.float32)

    def cut(out):
        res = dict(out)
        b, h = out["o"].shape[:2]
        res["o"], res["dq"] = out["o"][..., pq:], out["dq"][..., pq:]
        res["dk"], res["dv"] = out["dk"][..., pk:], out["dv"][..., pk:]
        res["lse"] = out["lse"].permute(0, 1, 3, 2).reshape(b, h, sq_p)[..., pq:]  # row t * 128 + p at [p, t]
        if "dsinks" in out:
            res["dsinks"] = out["dsinks"].sum(dim=0)  # the API's sinks are shared by the batch
        return res

    return pad, cut


def run_api(ins, case):
    """Forward + backward of a row through ``nki_attn.flash_attn_func`` (``flash_attn_varlen_func`` for packed
    rows) with ``return_lse=True``; o.backward(dy). Inputs in the kernels' layout (``make_inputs``); outputs
    o, dq [b, h, d, sq], dk, dv [b, hk, d, sk], lse [b, h, sq], dsinks [h(, n)] (the gradient of the shared
    sinks), dlogit_scale [b, h] (packed rows: the [h] scale they share, as [1, h])."""
    from ..attention import flash_attn_func, flash_attn_varlen_func

    def api_layout(t):  # [b, h, d, s] -> [b, s, h, d]
        return t.permute(0, 3, 1, 2).contiguous()

    def kernel_layout(t):  # [b, s, h, d] -> [b, h, d, s]
        return t.permute(0, 2, 3, 1)

    q, k, v = (api_layout(ins[n]).requires_grad_() for n in ("q", "k", "v"))
    sinks = ins["sinks"][0].clone().requires_grad_() if ins["sinks"] is not None else None
    window = (case.window - 1, 0) if case.window else (tuple(case.window_size) or (-1, -1))
    keep_mask(ins, case)  # refuses dropout rows
    common = dict(softmax_scale=case.scale or None, causal=case.causal, window_size=window, sinks=sinks,
                  return_lse=True)
    if case.softcap:
        common["softcap"] = case.softcap
    if case.alibi:
        # FlashAttention's two slope layouts: [h] (shared by the batch) for random_h and for packed rows (whose
        # one batch row holds every sequence: varlen's [b, h] would mean per sequence), [b, h] otherwise
        common["alibi_slopes"] = ins["alibi_slopes"][0].contiguous() if case.alibi == "random_h" \
            or case.cu_seqlens else ins["alibi_slopes"]
    leaves = {}
    for m in GRAD_MODS:
        # a keyword-only [b, h] input with a gradient (the logit scale): varlen takes one per head ([h]),
        # flash_attn_func one per (batch, head)
        if m.extra and m.varlen and getattr(case, m.name):
            t = ins[m.kernel][0] if case.cu_seqlens else ins[m.kernel]
            leaves[m.name] = common[m.keyword] = t.clone().requires_grad_()
    if case.cu_seqlens:
        if case.batch != 1 or case.seqlen_q != case.seqlen_k:
            raise ValueError(f"row {case.name}: packed rows need batch 1 and seqlen_q == seqlen_k")
        cu = list(case.cu_seqlens)
        cu_q, cu_k = cu, cu
        if cu[-1] < case.seqlen_q:  # trailing query rows that see no key: one more sequence without keys
            cu_q, cu_k = cu + [case.seqlen_q], cu + [cu[-1]]
        lens_q = [b - a for a, b in zip(cu_q[:-1], cu_q[1:])]
        lens_k = [b - a for a, b in zip(cu_k[:-1], cu_k[1:])]
        kk, vk = k[0, :cu_k[-1]], v[0, :cu_k[-1]]
        o, lse = flash_attn_varlen_func(q[0], kk, vk, torch.tensor(cu_q), torch.tensor(cu_k), max(lens_q),
                                        max(lens_k), **common)
        o, lse = o.unsqueeze(0), lse.unsqueeze(0)
    else:
        o, lse = flash_attn_func(q, k, v, **common)
    o.backward(api_layout(ins["dy"]))
    out = {"o": kernel_layout(o.detach()), "lse": lse.detach(), "dq": kernel_layout(q.grad),
           "dk": kernel_layout(k.grad), "dv": kernel_layout(v.grad)}
    if sinks is not None:
        # no grad at all when no query row sees a key (every packed sequence empty: the API's output does not
        # depend on the sinks there): the gradient is zero
        out["dsinks"] = sinks.grad if sinks.grad is not None else torch.zeros_like(sinks)
    for name, t in leaves.items():
        grad = t.grad if t.grad is not None else torch.zeros_like(t)
        out["d" + name] = grad.reshape(-1, case.heads)
    return out


# outputs whose elements come in vectors sharing their rounding errors: d_head, axis 2 of [b, h, d, s]
VECTOR_AXIS = {"o": 2, "dq": 2, "dk": 2, "dv": 2}


def run_case(case, candidate):
    """Check one row. Returns the report row: case facts, per-output errors and verdicts, ``status`` ("pass",
    "fail", "error": the candidate or the harness crashed, "unsupported": the candidate refused the row, see
    ``candidate``), ``pass`` (status == "pass"), ``worst_ratio``, seconds."""
    t0 = time.perf_counter()
    row = {"case": case.as_dict()}
    try:
        ins = make_inputs(case)
        # the candidate first, so that a row it refuses costs no golden run; on copies, so that a candidate
        # writing into its inputs cannot change what the reference sees
        got = run_candidate(candidate, {n: t.clone() if isinstance(t, torch.Tensor) else t for n, t in ins.items()},
                            case)
        ref = reference(ins, case, torch.float64)
        base = reference(ins, case, None)
        from_inputs = inputs_baseline(ins, ref, case)
        lengths = tolerance.reduction_lengths(case)
        residues = residue_scales(ins, ref, case)
        checks = {}
        for name in ref:
            if got.get(name) is None:
                raise CandidateError(f"the candidate returned no {name}")
            # lse and dsinks are float32 but carry the row dtype's input rounding: judged by the row dtype.
            scale = _dsinks_input_scale(ref, ins, case) if name == "dsinks" else 0.0
            zs = zero_scale(name, ins, case, lengths[name]) if name in ("dq", "dk") and not torch.any(ref[name]) \
                else 0.0
            checks[name] = tolerance.compare(name, _np(got[name]), _np(ref[name]), _np(base[name]), case.dtype,
                                             n=lengths[name], input_scale=scale,
                                             inputs=_np(from_inputs[name]) if name in from_inputs else None,
                                             vec_axis=VECTOR_AXIS.get(name), zero_scale=zs,
                                             residue=residues.get(name, 0.0))
        row["outputs"] = checks
        if case.dtype in ("bfloat16", "float16"):
            vs_sdpa(checks, got, ref, sdpa_low_precision(ins, case))
        row["status"] = "pass" if all(c["ok"] for c in checks.values()) else "fail"
        row["worst_ratio"] = max(max(tolerance.ratios(c)) for c in checks.values())
    except Unsupported as exc:
        row["status"] = "unsupported"
        row["error"] = str(exc)
    except Exception as exc:  # noqa: BLE001 - a crash is a failing row, reported with its message
        row["status"] = "error"
        row["error"] = f"{type(exc).__name__}: {exc}"
    row["pass"] = row["status"] == "pass"
    row["seconds"] = round(time.perf_counter() - t0, 3)
    return row


def zero_scale(name, ins, case, n):
    """The size dq or dk would have if the terms whose cancellation makes it identically zero did not cancel
    (``tolerance.compare``'s ``zero_scale``): a sum of ``n`` (its reduction length) terms of random sign, each
    at most softmax_scale * T * max|K| for dq (max|Q| for dk), is about sqrt(n) times that. T = max sum_d
    |dO_d| |V_d| over every (query, key) pair of a GQA group (an upper bound of the visible ones) is the size of
    the two float32 dot products dP = dO . V and D = O . dO (O = V where P = 1) whose rounding residues the
    cancellation leaves, times 1 / (1 - dropout_p) with dropout."""
    q, k, v, dy = (ins[n].to(torch.float64) for n in ("q", "k", "v", "dy"))
    group = case.heads // case.kv_heads
    blocks = _row_blocks(case.batch, group, case.seqlen_q, case.seqlen_k)  # the [group, sq, sk] matrix in blocks
    dp = max(float(torch.einsum("bhdq,bdk->bhqk", dy[:, g * group:(g + 1) * group, :, r].abs(),
                                v[:, g].abs()).max())
             for g in range(case.kv_heads) for r in blocks) if q.numel() and k.numel() else 0.0
    other = k if name == "dq" else q
    return n ** 0.5 * (case.scale or case.d_head ** -0.5) * dp * float(other.abs().max()) / (1.0 - case.dropout)


def _dsinks_input_scale(ref, ins, case):
    """``tolerance.dsinks_input_scale`` of a row, from its float64 reference and inputs."""
    lse = ref["lse"]
    if lse.dim() == 4:  # kernel layout [b, h, 128, sq // 128]: row t * 128 + p at [p, t]
        b, h = lse.shape[:2]
        lse = lse.permute(0, 1, 3, 2).reshape(b, h, -1)
    return tolerance.dsinks_input_scale(_np(ref["o"]), _np(lse), _np(ins["sinks"]), _np(ins["dy"]),
                                        over_batch=case.via_api)


def _np(t):
    return t.detach().to(torch.float64).numpy() if isinstance(t, torch.Tensor) else t


# ------------------------------------------------------------------------ accuracy against torch's own SDPA
SDPA_OUTPUTS = ("o", "dq", "dk", "dv")


def sdpa_low_precision(ins, case):
    """o, dq, dk, dv of torch's SDPA math path (``aten._scaled_dot_product_attention_math``) computed in the
    row's dtype (``allow_fp16_bf16_reduction_math_sdp(True)``: its matmuls, softmax and gradients in bf16/fp16,
    like FlashAttention's tests' low-precision reference) on the row's inputs, in the reference's layouts
    (``[b, h, d, sq]``, ``[b, hk, d, sk]``); None when SDPA cannot express the row (soft-capping, dropout, a logit scale).

    Masks (causal, windows, packing) and ALiBi become its float ``attn_mask``; sinks become extra keys with a
    zero key and value whose mask entry is the sink logit (exactly a sink's softmax term). Query rows that see
    no key (NaN in SDPA) are left out of every output: zero rows in o and dq of both, their keys' terms absent."""
    from golden.attention_fwd_torch import visibility_mask
    if case.dropout or any(m.sdpa is None for m, _ in mods.active(case)):
        return None
    dt = _TORCH[case.dtype]
    q, k, v, dy = (ins[n] for n in ("q", "k", "v", "dy"))
    b, h, d_qk, sq = q.shape
    hk, sk, group = k.shape[1], k.shape[3], q.shape[1] // k.shape[1]
    vis = visibility_mask(sq, sk, case.causal, case.window or None,
                          ins["bound_min"] if case.cu_seqlens or case.mask else None,
                          ins["bound_max"] if case.cu_seqlens or case.mask else None,
                          window_size=tuple(case.window_size) or None)
    # (SDPA takes whole rows and sums dk, dv over all of them in the row dtype: it is not run in blocks, but its
    # mask is built in place and only its dtype copy is kept for the call)
    bias = torch.zeros(b, h, sq, sk, dtype=torch.float32)
    for m in mods.HARNESS_MODS:  # the additive ones, in table order
        if getattr(case, m.name):
            bias.add_(m.sdpa(ins, case, sq, sk))
    bias.masked_fill_(~vis, float("-inf"))
    seen = vis.any(dim=1)  # [sq]
    del vis
    kx = k.repeat_interleave(group, dim=1).transpose(-1, -2)
    vx = v.repeat_interleave(group, dim=1).transpose(-1, -2)
    if ins["sinks"] is not None:
        sinks = ins["sinks"].to(torch.float32)
        sinks = sinks[..., None] if sinks.dim() == 2 else sinks  # [b, h, n]
        n = sinks.shape[-1]
        kx = torch.cat([kx, torch.zeros(b, h, n, d_qk, dtype=kx.dtype)], dim=2)
        vx = torch.cat([vx, torch.zeros(b, h, n, vx.shape[-1], dtype=vx.dtype)], dim=2)
        bias = torch.cat([bias, sinks[:, :, None, :].expand(b, h, sq, n)], dim=-1)
        seen = seen | True
    mask = bias.to(dt)
    del bias
    was = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)
    try:
        leaves = [t.to(dt).detach().requires_grad_(True) for t in (q.transpose(-1, -2), kx, vx)]
        o = torch.ops.aten._scaled_dot_product_attention_math(*leaves, mask, 0.0, False,
                                                              scale=case.scale or d_qk ** -0.5)[0]
        keep = seen[None, None, :, None]
        o = torch.where(keep, o, torch.zeros((), dtype=dt))
        o.backward(torch.where(keep, dy.transpose(-1, -2).to(dt), torch.zeros((), dtype=dt)))
    finally:
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(was)
    dq, dkx, dvx = (t.grad for t in leaves)

    def kv_grad(g):  # [b, h, sk(+n), d] -> [b, hk, d, sk], summed over each kv head's query heads
        return g[:, :, :sk].float().reshape(b, hk, group, sk, -1).sum(2).transpose(-1, -2).to(dt)
    return {"o": o.detach().transpose(-1, -2), "dq": dq.transpose(-1, -2), "dk": kv_grad(dkx), "dv": kv_grad(dvx)}


def vs_sdpa(checks, got, ref, sdpa):
    """Add to each of o, dq, dk, dv's checks the relative Frobenius errors against the float64 reference of ours
    (``rel_fro``) and of torch's SDPA math in the row's dtype (``sdpa_rel_fro``, ``sdpa_low_precision``), and
    their ratio ``vs_sdpa`` (ours / SDPA; None when SDPA cannot express the row). Information, not a verdict."""
    for name in SDPA_OUTPUTS:
        if name not in checks:
            continue
        r = ref[name].to(torch.float64)
        norm = float(r.norm()) or 1.0

        def rel(t):
            return float((torch.as_tensor(t).to(torch.float64) - r).norm()) / norm
        c = checks[name]
        c["rel_fro"] = rel(got[name])
        c["sdpa_rel_fro"] = None if sdpa is None else rel(sdpa[name])
        c["vs_sdpa"] = (c["rel_fro"] / c["sdpa_rel_fro"] if c["sdpa_rel_fro"] else None)
