"""Prebuilt ``mask_mod``s for ``nki_attn.create_block_mask`` (and for torch's own FlexAttention: they are plain
torch functions of ``(b, h, q_idx, kv_idx)`` that work on broadcast index tensors and under ``torch.vmap``).

Each returns True where query ``q_idx`` sees key ``kv_idx``. Positions are the call's own indices (top-left
aligned, as FlexAttention's ``mask_mod``s are): ``causal`` is ``q_idx >= kv_idx``.

- ``causal_mask``: ``q_idx >= kv_idx``.
- ``sliding_window(window, causal=True)``: ``q_idx - window < kv_idx`` (and causal; two-sided
  ``|q_idx - kv_idx| < window`` with ``causal=False``). A window of W keys includes the query's own position.
- ``document(seq_ids)``: same document, ``seq_ids[b, q_idx] == seq_ids[b, kv_idx]`` (seq_ids int ``[S]`` or
  ``[B, S]``, one id per token, e.g. the packed sequences of a batch); combine with ``causal_mask`` by
  ``and_masks``.
- ``prefix_lm(prefix_lengths)``: bidirectional prefix, causal suffix: ``kv_idx < prefix[b] or q_idx >= kv_idx``
  (prefix_lengths int ``[B]``, or an int for every sequence).
- ``chunked_local(chunk_size, causal=True)``: Llama 4's chunked local attention, ``q_idx // chunk_size ==
  kv_idx // chunk_size`` (and causal).
- ``dilated(dilation, window=None, causal=True)``: every ``dilation``-th key back from the query,
  ``(q_idx - kv_idx) % dilation == 0``, at most ``window`` of them (``q_idx - kv_idx < window * dilation``),
  causal; with ``causal=False`` the same on both sides.
- ``and_masks(*mods)`` / ``or_masks(*mods)``: the conjunction / disjunction.
"""
import numbers

import torch

__all__ = ["causal_mask", "sliding_window", "document", "prefix_lm", "chunked_local", "dilated", "and_masks",
           "or_masks"]


def _pos_int(fn, name, x):
    if isinstance(x, bool) or not isinstance(x, numbers.Integral) or x < 1:
        raise ValueError(f"{fn}: {name}={x!r}: must be an int >= 1")
    return int(x)


def causal_mask(b, h, q_idx, kv_idx):
    """``q_idx >= kv_idx``: no query sees a later key."""
    return q_idx >= kv_idx


def sliding_window(window, causal=True):
    """The keys within ``window`` positions of the query, itself included: ``q_idx - kv_idx < window`` and
    causal (``|q_idx - kv_idx| < window`` with ``causal=False``)."""
    w = _pos_int("sliding_window", "window", window)

    def sliding_window_mask(b, h, q_idx, kv_idx):
        d = q_idx - kv_idx
        if causal:
            return (d >= 0) & (d < w)
        return d.abs() < w
    return sliding_window_mask


def document(seq_ids):
    """Tokens see the tokens of their own document: ``seq_ids[b, q_idx] == seq_ids[b, kv_idx]``; seq_ids an
    integer tensor ``[S]`` (every batch element) or ``[B, S]``."""
    if not isinstance(seq_ids, torch.Tensor) or seq_ids.is_floating_point() or seq_ids.dim() not in (1, 2):
        raise TypeError(f"document: seq_ids={type(seq_ids).__name__}: must be an integer tensor [S] or [B, S]")
    ids = seq_ids

    def document_mask(b, h, q_idx, kv_idx):
        if ids.dim() == 1:
            return ids[q_idx] == ids[kv_idx]
        return ids[b, q_idx] == ids[b, kv_idx]
    return document_mask


def prefix_lm(prefix_lengths):
    """Prefix-LM: every query sees the first ``prefix_lengths[b]`` keys (bidirectional prefix) and the keys up
    to itself (causal suffix); prefix_lengths an int or an integer tensor ``[B]``."""
    if isinstance(prefix_lengths, torch.Tensor):
        if prefix_lengths.is_floating_point() or prefix_lengths.dim() != 1:
            raise TypeError("prefix_lm: prefix_lengths must be an int or an integer tensor [B]")
        pl = prefix_lengths

        def prefix_lm_mask(b, h, q_idx, kv_idx):
            return (kv_idx < pl[b]) | (q_idx >= kv_idx)
        return prefix_lm_mask
    if isinstance(prefix_lengths, bool) or not isinstance(prefix_lengths, numbers.Integral) or prefix_lengths < 0:
        raise ValueError(f"prefix_lm: prefix_lengths={prefix_lengths!r}: must be an int >= 0 or a tensor [B]")
    n = int(prefix_lengths)

    def prefix_lm_mask(b, h, q_idx, kv_idx):
        return (kv_idx < n) | (q_idx >= kv_idx)
    return prefix_lm_mask


def chunked_local(chunk_size, causal=True):
    """Llama 4's chunked local attention: queries see the keys of their own chunk of ``chunk_size`` positions
    (and only earlier ones with ``causal``)."""
    c = _pos_int("chunked_local", "chunk_size", chunk_size)

    def chunked_local_mask(b, h, q_idx, kv_idx):
        same = (q_idx // c) == (kv_idx // c)
        return same & (q_idx >= kv_idx) if causal else same
    return chunked_local_mask


def dilated(dilation, window=None, causal=True):
    """Dilated attention: the keys at distances ``0, dilation, 2 dilation, ...`` from the query (at most
    ``window`` of them when given), behind it (``causal``) or on both sides."""
    s = _pos_int("dilated", "dilation", dilation)
    w = None if window is None else _pos_int("dilated", "window", window)

    def dilated_mask(b, h, q_idx, kv_idx):
        d = q_idx - kv_idx
        if not causal:
            d = d.abs()
        m = (d >= 0) & (d % s == 0)
        if w is not None:
            m = m & (d < w * s)
        return m
    return dilated_mask


def and_masks(*mods):
    """The mask_mod true where every one of ``mods`` is."""
    if not mods or not all(callable(m) for m in mods):
        raise TypeError("and_masks: needs one or more callable mask_mods")

    def and_mask(b, h, q_idx, kv_idx):
        out = mods[0](b, h, q_idx, kv_idx)
        for m in mods[1:]:
            out = out & m(b, h, q_idx, kv_idx)
        return out
    return and_mask


def or_masks(*mods):
    """The mask_mod true where any one of ``mods`` is."""
    if not mods or not all(callable(m) for m in mods):
        raise TypeError("or_masks: needs one or more callable mask_mods")

    def or_mask(b, h, q_idx, kv_idx):
        out = mods[0](b, h, q_idx, kv_idx)
        for m in mods[1:]:
            out = out | m(b, h, q_idx, kv_idx)
        return out
    return or_mask


# the prebuilt masks whose visible keys are one interval per query row (so the float64 golden, which takes masks
# as per-query key intervals, can judge them): what ``nki-attn check``'s block-mask rows run
INTERVAL_EXAMPLES = ("causal", "sliding_window", "document", "prefix_lm", "chunked_local")


def interval_example(name, seqlen):
    """One of ``INTERVAL_EXAMPLES`` at ``seqlen`` tokens (queries = keys), as ``(mask_mod, key_lo, key_hi)``:
    the mask_mod and the same mask as per-query key intervals ``[key_lo[i], key_hi[i])`` (int64 ``[seqlen]``).
    Sizes are chosen so that tile boundaries cut documents, windows, prefixes and chunks: document 3 documents
    of unequal length (causal), prefix_lm a prefix of ``seqlen // 3 + 5``, chunked_local chunks of
    ``seqlen // 4 - 16`` (causal), sliding_window ``seqlen // 4 + 3`` keys."""
    i = torch.arange(seqlen)
    hi = i + 1
    if name == "causal":
        return causal_mask, torch.zeros_like(i), hi
    if name == "sliding_window":
        w = seqlen // 4 + 3
        return sliding_window(w), (i - w + 1).clamp(min=0), hi
    if name == "document":
        cut = (0, max(1, seqlen // 3 - 5), seqlen // 3 + seqlen // 2, seqlen)
        ids = torch.zeros(seqlen, dtype=torch.int64)
        for n in range(1, 3):
            ids[cut[n]:] = n
        start = torch.tensor(cut[:-1])[ids]
        return and_masks(causal_mask, document(ids)), start, hi
    if name == "prefix_lm":
        p = seqlen // 3 + 5
        return prefix_lm(p), torch.zeros_like(i), torch.clamp(hi, min=min(p, seqlen))
    if name == "chunked_local":
        c = max(1, seqlen // 4 - 16)
        return chunked_local(c), (i // c) * c, hi
    raise ValueError(f"interval_example: name={name!r}: must be one of {INTERVAL_EXAMPLES}")
