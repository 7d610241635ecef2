"""The harness's side of each score modification, declared once: one ``HarnessMod`` per row of
``nki_attn.spec.SCORE_MODS``, with the same name, in the same order (checked when this module is imported).

The spec's row says how the library takes a modification (its keyword, check, kernel keyword, gradient). This
row says how the harness exercises and judges one: the ``Case`` field it adds, the row's feature label, the
preset features that make it bite, how a row draws its input, its formula in the float32 "inputs" baseline, the
length of the sum behind its gradient (the tolerance), its form for torch's SDPA, and its ``nki-attn profile
--features`` entry. ``cases``, ``runner``, ``tolerance`` and the profiler's command line loop over ``HARNESS_MODS``.

The baseline formulas are the harness's own derivation in float32, written apart from the golden's on purpose:
the harness judges anyone's kernel against two references, and the second one must not share the first's
mistakes.
"""
import dataclasses
from typing import Callable, Optional

import torch
from golden.attention_fwd_torch import alibi_bias, block_offset

from .. import spec

# ALiBi slopes: "" none, "bloom" (BLOOM's geometric slopes per head), "random" (U[0, 0.3) per (batch, head):
# [b, h] slopes), "random_h" (U[0, 0.3) per head, shared by the batch: the API gets [h] slopes), "signed"
# (U[-0.3, 0.3) per (batch, head): a negative slope is a bias growing with the distance)
ALIBI_KINDS = ("", "bloom", "random", "random_h", "signed")
# The additive bias's shape: "" none, "heads" [1, h, sq, sk] (shared by the batch), "batch" [b, 1, sq, sk]
# (shared by the heads), "full" [b, h, sq, sk], "keys" [b, 1, 1, sk] (a key-padding bias, shared by the rows)
BIAS_KINDS = ("", "heads", "batch", "full", "keys")


@dataclasses.dataclass(frozen=True)
class HarnessMod:
    """How the harness exercises and judges one score modification (a row of ``HARNESS_MODS``).

    Fields:
        name: the ``spec.SCORE_MODS`` row's name; also the ``Case`` field, the profiler feature and the gradient
            output ``"d" + name``.
        field_type, off: the ``Case`` field's type and its "not applied" default (falsy).
        kinds: the accepted values of a string field (``Case`` refuses others), or () for any value.
        label: ``case -> str``: the row's feature label (``Case.features``), called when the field is set.
        features: ``{preset feature name: (seqlen, heads, batch, d_head) -> Case fields}``: the features
            (``cases.VARIANT_FEATURES``) whose rows make the modification bite at N(0, 1) inputs.
        draw: ``(case, g, randn) -> tensor``: the row's input (``ins[<kernel keyword>]``) from the row's generator
            ``g`` (``randn(*shape)``: N(0, 1) draws in the row dtype), or None for a number (the field's value).
        scores: ``(s, case, ins, hq, dt, rows=None) -> (s, state)``: the formula on the float scores
            ``[b, group, sq, sk]`` of the query heads ``hq`` in dtype ``dt`` (with ``rows``, a slice of the query
            rows, the scores are ``[b, group, rows, sk]``: those rows only); ``state`` is what its backward needs.
        chain: ``state -> factor``: d(its output) / d(its input scores), multiplying dS on its way back, or None
            when that is 1 (an additive term).
        grad: ``(ds, state) -> [b, group]``: its parameter's gradient in the baseline from the dS reaching its
            output, or None when the baseline does not derive one.
        grad_terms: ``(case, keys) -> n``: the number of terms its gradient sums (``keys``: the keys one query row
            sees), or None when the row has no such gradient.
        sdpa: ``(ins, case, sq, sk) -> float32 [b, h, sq, sk]``: the modification as an additive ``attn_mask`` of
            torch's SDPA, or None when SDPA cannot express it (the SDPA comparison is then skipped).
        profile: ``(value when none is given (True: a flag), parser, meaning)``: its ``--features`` entry.
    """
    name: str
    field_type: type
    off: object
    label: Callable
    features: dict
    scores: Callable
    profile: tuple
    kinds: tuple = ()
    draw: Optional[Callable] = None
    chain: Optional[Callable] = None
    grad: Optional[Callable] = None
    grad_terms: Optional[Callable] = None
    sdpa: Optional[Callable] = None


# ------------------------------------------------------------------------------------------------ soft-capping
def _softcap_scores(s, case, ins, hq, dt, rows=None):
    th = torch.tanh(s / case.softcap)
    return case.softcap * th, th


# ------------------------------------------------------------------------------------------------------ ALiBi
def bloom_alibi_slopes(nheads):
    """BLOOM's ALiBi slopes, float32 ``[nheads]``: with n the largest power of two <= nheads, head i < n gets
    2^(-8 (i + 1) / n); the remaining heads take the odd powers 1, 3, 5, ... of 2^(-4 / n) (the geometric
    sequence of 2n heads, every other one), as in the ALiBi paper and BLOOM's modelling code."""
    n = 1 << (int(nheads).bit_length() - 1)
    slopes = [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]
    slopes += [2.0 ** (-4.0 * (2 * i + 1) / n) for i in range(nheads - n)]
    return torch.tensor(slopes, dtype=torch.float32)


def _alibi_draw(case, g, randn):
    """float32 ``[b, h]`` slopes of the row's kind."""
    b, h = case.batch, case.heads
    if case.alibi == "bloom":
        return bloom_alibi_slopes(h).expand(b, h).contiguous()
    if case.alibi == "random":  # as FlashAttention's tests draw them: U[0, 0.3) per (batch, head)
        return (torch.rand(b, h, generator=g, dtype=torch.float64) * 0.3).to(torch.float32)
    if case.alibi == "signed":  # either sign: U[-0.3, 0.3) per (batch, head)
        return ((torch.rand(b, h, generator=g, dtype=torch.float64) - 0.5) * 0.6).to(torch.float32)
    # random_h: the same per head, shared by the batch
    slopes = (torch.rand(h, generator=g, dtype=torch.float64) * 0.3).to(torch.float32)
    return slopes.expand(b, h).contiguous()


def _alibi_scores(s, case, ins, hq, dt, rows=None):
    if rows is None:
        return s + alibi_bias(ins["alibi_slopes"][:, hq], case.seqlen_q, case.seqlen_k, dt), None
    off = block_offset(case.seqlen_q, case.seqlen_k, rows.start)
    return s + alibi_bias(ins["alibi_slopes"][:, hq], s.shape[-2], case.seqlen_k, dt, off), None


def _alibi_sdpa(ins, case, sq, sk):
    return alibi_bias(ins["alibi_slopes"], sq, sk, torch.float32)


def _alibi_kind(text):
    if not text or text not in ALIBI_KINDS:
        raise ValueError(text)
    return text


# ------------------------------------------------------------------------------------------ the additive bias
def bias_shape(case):
    """The additive bias's shape ``[b or 1, h or 1, sq or 1, sk or 1]`` of a row (None without a bias)."""
    if not case.bias:
        return None
    b, h, sq, sk = case.batch, case.heads, case.seqlen_q, case.seqlen_k
    return {"heads": (1, h, sq, sk), "batch": (b, 1, sq, sk), "full": (b, h, sq, sk), "keys": (b, 1, 1, sk)}[case.bias]


def bias_head_slice(bias, hq):
    """The bias of the query heads ``hq`` (a slice): its head dim, or the whole bias when it is shared by the
    heads."""
    return bias[:, hq] if bias.shape[1] > 1 else bias


def _bias_scores(s, case, ins, hq, dt, rows=None):
    bias = bias_head_slice(ins["attn_bias"], hq)
    if rows is not None and bias.shape[2] > 1:
        bias = bias[:, :, rows]
    return s + bias.to(dt), None


def _bias_terms(case, keys):
    # dbias = P (dP - D): P normalised over the keys, times the terms the broadcast dims sum
    shape = getattr(case, "bias_shape", None)
    if shape is None:
        return None
    full = (case.batch, case.heads, case.seqlen_q, case.seqlen_k)
    summed = 1
    for n_b, n_f in zip(shape, full):
        if n_b == 1:
            summed *= n_f
    return keys * summed


def _bias_label(case):
    return "bias[{}]".format(",".join(str(n) if n > 1 else "1" for n in case.bias_shape))


# ---------------------------------------------------------------------------------------- the logit scale
def _logit_scale_draw(case, g, randn):
    # learned temperatures around 1 (U[0.5, 3)); packed API rows share one per head
    lam = 0.5 + 2.5 * torch.rand(1 if case.cu_seqlens else case.batch, case.heads, generator=g, dtype=torch.float64)
    return lam.to(torch.float32).expand(case.batch, case.heads).contiguous()


def _logit_scale_scores(s, case, ins, hq, dt, rows=None):
    lam = ins["logit_scale"][:, hq, None, None].to(dt)
    return s * lam, (s, lam)


HARNESS_MODS = (
    HarnessMod(
        "softcap", float, 0.0, label=lambda c: f"softcap{c.softcap:g}",
        # 2.0: the scaled scores are about N(0, 1), so tanh saturates on the tails (a cap of 50 would be almost
        # linear there)
        features={"softcap": lambda s, h, b, d: dict(softcap=2.0, causal=True)},
        scores=_softcap_scores, chain=lambda th: 1.0 - th * th,
        profile=(50.0, float, "logit soft-capping c * tanh(S / c), c = 50 (Gemma-2's) unless given")),
    HarnessMod(
        "alibi", str, "", kinds=ALIBI_KINDS,
        label=lambda c: {"random": "alibi", "random_h": "alibi[h]"}.get(c.alibi, f"alibi-{c.alibi}"),
        # random slopes per (batch, head) over a batch of 2 (FlashAttention's tests draw U[0, 0.3)); BLOOM's
        features={"alibi": lambda s, h, b, d: dict(alibi="random", batch=max(b, 2)),
                  "alibi_causal": lambda s, h, b, d: dict(alibi="bloom", causal=True, heads=max(h, 4),
                                                       kv_heads=max(h, 4))},
        draw=_alibi_draw, scores=_alibi_scores, sdpa=_alibi_sdpa,
        profile=("bloom", _alibi_kind, "ALiBi slopes of KIND = bloom (BLOOM's geometric slopes per head) unless "
                                       "given (random, random_h, signed: the harness's random slopes)")),
    HarnessMod(
        "bias", str, "", kinds=BIAS_KINDS, label=_bias_label,
        # a per-head bias shared by a batch of 2 with causal GQA; a key-padding bias with a two-sided window
        features={"bias": lambda s, h, b, d: dict(bias="heads", causal=True, heads=2 * h, kv_heads=h, batch=max(b, 2)),
                  "bias_keys": lambda s, h, b, d: dict(bias="keys", window_size=(s // 4 + 3, s // 8 + 1),
                                                    batch=max(b, 2))},
        draw=lambda case, g, randn: randn(*case.bias_shape), scores=_bias_scores, grad_terms=_bias_terms,
        sdpa=lambda ins, case, sq, sk: ins["attn_bias"].to(torch.float32),
        profile=("heads", str, "additive bias attn_bias of shape KIND = heads [1,h,s,s] unless given (batch "
                               "[b,1,s,s], full [b,h,s,s], keys [b,1,1,s]); the backward computes its gradient "
                               "(--set bias_grad=False: without)")),
    HarnessMod(
        "logit_scale", bool, False, label=lambda c: "logit_scale",
        # a scale per (batch, head) over a batch of 2, with soft-capping after it (the order the semantics fix)
        features={"logit_scale": lambda s, h, b, d: dict(logit_scale=True, causal=True, softcap=3.0, batch=max(b, 2),
                                                      kv_heads=max(1, h // 2))},
        draw=_logit_scale_draw, scores=_logit_scale_scores, chain=lambda st: st[1],
        grad=lambda ds, st: (ds * st[0]).sum((2, 3)),
        # every visible (query, key) pair of the head
        grad_terms=lambda case, keys: case.seqlen_q * keys,
        profile=(True, None, "a per-head logit scale (learned temperature; the backward also returns its "
                             "gradient)")),
)
HMODS = {m.name: m for m in HARNESS_MODS}
# the order the scores apply them (the kernels' and the golden's: ``ScoreMod.rank``); gradients run backwards
APPLY_ORDER = tuple(sorted(HARNESS_MODS, key=lambda m: spec.MODS[m.name].rank))


def check_table(harness_mods, score_mods):
    """Raise ImportError unless ``harness_mods`` names the rows of ``score_mods`` (``spec.SCORE_MODS``) in order,
    each drawing an input exactly when its spec row takes a tensor."""
    if tuple(m.name for m in harness_mods) != tuple(m.name for m in score_mods):
        raise ImportError(f"nki_attn.harness.mods.HARNESS_MODS names {[m.name for m in harness_mods]}; it must "
                          f"name the rows of nki_attn.spec.SCORE_MODS in order: {[m.name for m in score_mods]}")
    for m, s in zip(harness_mods, score_mods):
        if (m.draw is None) != (not s.is_tensor):
            raise ImportError(f"HarnessMod {m.name!r}: a tensor modification draws its input, a number does not")


check_table(HARNESS_MODS, spec.SCORE_MODS)

def active(case):
    """The modifications a row sets, in score order, each with its spec row: [(HarnessMod, ScoreMod)]."""
    return [(m, spec.MODS[m.name]) for m in APPLY_ORDER if getattr(case, m.name)]


def apply_scores(s, case, ins, hq, dt, rows=None):
    """The row's modifications applied to the scores ``s`` in score order: (scores, [(HarnessMod, state)]).
    ``s`` is ``[b, group, sq, sk]``, or with ``rows`` (a slice of the query rows) ``[b, group, rows, sk]``."""
    states = []
    for m, _ in active(case):
        s, st = m.scores(s, case, ins, hq, dt, rows)
        states.append((m, st))
    return s, states
