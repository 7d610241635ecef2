"""Brute-force checks of the band planner ``nki_attn/kernels/band.py`` against dense masks.

The band ``(lo_rel, hi_rel)`` of ``attention_band`` stands for causal + sliding window + two-sided
``window_size`` with bottom-right alignment (``off = seqlen_k - seqlen_q``). Here every rule is written out
element by element, straight from docs/semantics.md (no band involved), and compared with:

* the band itself (``i + lo_rel <= j <= i + hi_rel``) on every small problem, exhaustively;
* the tile decisions (any visible / all visible / lower and upper element mask needed) and the key / query
  ranges, for every sub-rectangle of small problems (no 128 alignment assumed), and for the 128-row tiles
  and 1..4-chunk key ranges the kernels ask about, with windows around multiples of 128 and lengths that are
  not multiples of 512, seqlen_q != seqlen_k both ways;
* the classification both kernels plan with (``classify_keys``: skip / full / partial, trimmed to the visible
  chunks, with the band sides that cut the tile) and the host's whole-problem ``band_plan``.

The band functions are kernel code: the last test gathers them with the simulator's NKI frontend check.
"""
import itertools

import numpy as np
import pytest

from nki_attn.kernels import band as band_mod
from nki_attn.kernels.band import (FULL, PARTIAL, SKIP, attention_band, band_is_full, band_key_range,
                                   band_needs_hi_mask, band_needs_lo_mask, band_plan, band_query_range,
                                   band_tile_fully_visible, band_tile_visible, classify_keys)

P = 128


def rule_masks(sq, sk, causal, sliding_window, window_size):
    """(lower-side mask, upper-side mask) as bool [sq, sk], each rule applied on its own, as the docs state it."""
    off = sk - sq
    i = np.arange(sq)[:, None]
    j = np.arange(sk)[None, :]
    lower = np.ones((sq, sk), dtype=bool)
    upper = np.ones((sq, sk), dtype=bool)
    if causal:
        upper &= j <= i + off
    if sliding_window:
        lower &= j >= i + off - sliding_window + 1
    if window_size is not None:
        left, right = window_size
        if left >= 0:
            lower &= j >= i + off - left
        if right >= 0:
            upper &= j <= i + off + right
    return lower, upper


def configs(sk, windows):
    """(causal, sliding_window, window_size) combinations: every valid pairing of the three rules."""
    out = [(False, None, None), (True, None, None)]
    out += [(True, w, None) for w in windows if w >= 1]
    sides = sorted({-1, 0, 1} | {w for w in windows if w >= 0})
    for left in sides:
        for right in sides:
            out += [(False, None, (left, right)), (True, None, (left, right))]
    return out


def check_band_equals_mask(sq, sk, cfg):
    lo, hi = attention_band(cfg[0], cfg[1], cfg[2], sq, sk)
    assert lo <= hi, (sq, sk, cfg, lo, hi)
    lower, upper = rule_masks(sq, sk, *cfg)
    i = np.arange(sq)[:, None]
    j = np.arange(sk)[None, :]
    assert np.array_equal((j >= i + lo), lower), ("lower side", sq, sk, cfg, lo)
    assert np.array_equal((j <= i + hi), upper), ("upper side", sq, sk, cfg, hi)
    assert band_is_full(lo, hi, sq, sk) == bool((lower & upper).all()), (sq, sk, cfg)
    return lo, hi, lower, upper


def check_tile(q0, q1, k0, k1, lo, hi, lower, upper, what):
    lb, ub = lower[q0:q1, k0:k1], upper[q0:q1, k0:k1]
    vis = lb & ub
    assert band_tile_visible(q0, q1, k0, k1, lo, hi) == bool(vis.any()), ("visible", q0, q1, k0, k1, what)
    assert band_tile_fully_visible(q0, q1, k0, k1, lo, hi) == bool(vis.all()), ("fully", q0, q1, k0, k1, what)
    assert band_needs_lo_mask(q0, q1, k0, k1, lo) == (not lb.all()), ("lo mask", q0, q1, k0, k1, what)
    assert band_needs_hi_mask(q0, q1, k0, k1, hi) == (not ub.all()), ("hi mask", q0, q1, k0, k1, what)


def check_ranges(sq, sk, lo, hi, vis, what, q_steps, k_steps):
    """band_key_range over query runs / band_query_range over key runs equal the span of the visible pairs."""
    for q0, q1 in q_steps:
        cols = np.flatnonzero(vis[q0:q1].any(axis=0))
        k_start, k_end = band_key_range(q0, q1, lo, hi, sk)
        if cols.size:
            assert (k_start, k_end) == (cols[0], cols[-1] + 1), ("key range", q0, q1, what)
            # one interval: everything in between is visible to some query of the run
            assert cols.size == cols[-1] + 1 - cols[0], ("key range has a gap", q0, q1, what)
        else:
            assert k_end <= k_start, ("key range should be empty", q0, q1, what, k_start, k_end)
    for k0, k1 in k_steps:
        rows = np.flatnonzero(vis[:, k0:k1].any(axis=1))
        q_start, q_end = band_query_range(k0, k1, lo, hi, sq)
        if rows.size:
            assert (q_start, q_end) == (rows[0], rows[-1] + 1), ("query range", k0, k1, what)
            assert rows.size == rows[-1] + 1 - rows[0], ("query range has a gap", k0, k1, what)
        else:
            assert q_end <= q_start, ("query range should be empty", k0, k1, what, q_start, q_end)


# ----------------------------------------------------------------------------------------------- small, exhaustive
@pytest.mark.parametrize("sq", [1, 2, 3, 5, 7])
def test_band_exhaustive_small(sq):
    # every length pair up to 7, every rule combination with widths up to past the sequence, every sub-rectangle
    for sk in (1, 2, 3, 4, 6, 7):
        for cfg in configs(sk, list(range(0, sk + 2))):
            lo, hi, lower, upper = check_band_equals_mask(sq, sk, cfg)
            what = (sq, sk, cfg)
            spans_q = list(itertools.combinations(range(sq + 1), 2))
            spans_k = list(itertools.combinations(range(sk + 1), 2))
            for q0, q1 in spans_q:
                for k0, k1 in spans_k:
                    check_tile(q0, q1, k0, k1, lo, hi, lower, upper, what)
            check_ranges(sq, sk, lo, hi, lower & upper, what, spans_q, spans_k)


# ----------------------------------------------------------------------------------------------- kernel tiles
WIDTHS = [0, 1, 2, 63, 64, 126, 127, 128, 129, 130, 255, 256, 257, 383, 384, 385, 511, 512, 513, 640, 4096]
# (seqlen_q, seqlen_k): equal, more keys, more queries; lengths that are not multiples of 512
LENGTHS = [(640, 640), (384, 1152), (1152, 384), (256, 640), (640, 256)]


def kernel_configs():
    out = [(False, None, None), (True, None, None)]
    out += [(True, w, None) for w in WIDTHS if w >= 1]
    for w in WIDTHS:
        out += [(False, None, (w, w)), (False, None, (w, -1)), (False, None, (-1, w)), (True, None, (w, -1)),
                (True, None, (w, 7))]
    out += [(False, None, (127, 129)), (False, None, (0, 255)), (False, None, (255, 0)), (False, None, (-1, -1))]
    return out


@pytest.mark.parametrize("sq,sk", LENGTHS)
def test_band_on_kernel_tiles(sq, sk):
    for cfg in kernel_configs():
        lo, hi, lower, upper = check_band_equals_mask(sq, sk, cfg)
        what = (sq, sk, cfg)
        # per (query tile, key chunk) block: counts of elements meeting each side, then runs of 1..4 chunks
        nq, nk = sq // P, sk // P
        lo_ok = lower.reshape(nq, P, nk, P).sum(axis=(1, 3))
        hi_ok = upper.reshape(nq, P, nk, P).sum(axis=(1, 3))
        both = (lower & upper).reshape(nq, P, nk, P).sum(axis=(1, 3))
        for t in range(nq):
            q0 = t * P
            for c0 in range(nk):
                for n in range(1, 5):
                    if c0 + n > nk:
                        break
                    k0, k1 = c0 * P, (c0 + n) * P
                    full = P * (k1 - k0)
                    vis = int(both[t, c0:c0 + n].sum())
                    assert band_tile_visible(q0, q0 + P, k0, k1, lo, hi) == (vis > 0), ("visible", q0, k0, k1, what)
                    assert band_tile_fully_visible(q0, q0 + P, k0, k1, lo, hi) == (vis == full), \
                        ("fully", q0, k0, k1, what)
                    assert band_needs_lo_mask(q0, q0 + P, k0, k1, lo) == (int(lo_ok[t, c0:c0 + n].sum()) < full), \
                        ("lo mask", q0, k0, k1, what)
                    assert band_needs_hi_mask(q0, q0 + P, k0, k1, hi) == (int(hi_ok[t, c0:c0 + n].sum()) < full), \
                        ("hi mask", q0, k0, k1, what)
        check_ranges(sq, sk, lo, hi, lower & upper, what, [(t * P, t * P + P) for t in range(nq)],
                     [(c * P, c * P + P) for c in range(nk)] + [(0, sk)])


def test_bounded_window_visits_linear_number_of_tiles():
    """The point of the band: with a bounded window the visible tiles grow linearly with the length."""
    counts = []
    lengths = (1024, 2048, 4096, 8192)
    for s in lengths:
        lo, hi = attention_band(False, None, (64, 64), s, s)
        n = 0
        for q0 in range(0, s, P):
            k_start, k_end = band_key_range(q0, q0 + P, lo, hi, s)
            n += -(-k_end // P) - k_start // P
        counts.append(n)
    # the diagonal tile and one on each side, except at the two ends
    assert counts == [3 * (s // P) - 2 for s in lengths], counts


# ----------------------------------------------------------------------------------------------- classification
PLAN_CASES = [(384, 384, True, None, None), (384, 384, True, 130, None), (640, 640, True, 127, None),
              (256, 640, True, None, None), (640, 256, True, None, None), (384, 896, False, None, (200, 130)),
              (896, 384, False, None, (0, 300)), (512, 512, False, None, (128, 0)), (256, 1152, False, None, None),
              (640, 640, False, None, (-1, 129)), (384, 1024, True, 257, None)]


@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("sq,sk,causal,sw,ws", PLAN_CASES)
def test_band_plan_classifies_every_tile(sq, sk, causal, sw, ws, packing):
    """Each (128-row query tile, 512-key tile) of ``band_plan``: SKIP iff no pair is visible; otherwise the
    trimmed keys [k0, k1) hold every visible pair of the tile and start and end on a chunk with one; needs_lo /
    needs_hi iff that side of the rules cuts the trimmed tile; FULL iff nothing is cut and no packing."""
    lower, upper = rule_masks(sq, sk, causal, sw, ws)
    vis = lower & upper
    lo, hi = attention_band(causal, sw, ws, sq, sk)
    plan = band_plan(sq, sk, lo, hi, packing)
    assert len(plan) == sq // P and all(len(row) == -(-sk // 512) for row in plan)
    for qt, row in enumerate(plan):
        rows = slice(qt * P, qt * P + P)
        for j, kt in enumerate(row):
            t0, t1 = j * 512, min(j * 512 + 512, sk)
            what = (sq, sk, causal, sw, ws, packing, qt, j)
            assert kt.kind == classify_keys(qt * P, qt * P + P, t0, t1, lo, hi, packing).kind
            if not vis[rows, t0:t1].any():
                assert kt.kind == SKIP and kt.k0 == kt.k1, what
                continue
            assert t0 <= kt.k0 < kt.k1 <= t1 and kt.k0 % P == 0 and kt.k1 % P == 0, what
            assert vis[rows, kt.k0:kt.k1].sum() == vis[rows, t0:t1].sum(), ("a visible pair trimmed away", what)
            assert vis[rows, kt.k0:kt.k0 + P].any() and vis[rows, kt.k1 - P:kt.k1].any(), what
            assert kt.needs_lo == (not lower[rows, kt.k0:kt.k1].all()), what
            assert kt.needs_hi == (not upper[rows, kt.k0:kt.k1].all()), what
            full = vis[rows, kt.k0:kt.k1].all() and not packing
            assert kt.kind == (FULL if full else PARTIAL), what


def test_examples():
    """docs/semantics.md: causal with 4 queries and 6 keys is the band (-4, 2); ModernBERT's (64, 64) on 1024
    tokens is (-64, 64); Gemma-2's causal 4096 sliding window (window_size (4095, 0)) on 8192 tokens is
    (-4095, 0); an unbounded side is -seqlen_q / seqlen_k."""
    assert attention_band(True, None, None, 4, 6) == (-4, 2)
    assert attention_band(False, None, (64, 64), 1024, 1024) == (-64, 64)
    assert attention_band(True, 4096, None, 8192, 8192) == attention_band(True, None, (4095, 0), 8192, 8192) \
        == (-4095, 0)
    assert attention_band(True, None, (-1, 9), 256, 128) == (-256, -128)
    assert band_is_full(*attention_band(False, None, None, 256, 128), 256, 128)


# ----------------------------------------------------------------------------------------------- NKI subset
def test_band_functions_pass_the_nki_frontend_gathering():
    from nki_attn.sim import frontend
    for name in ("attention_band", "band_is_full", "band_tile_visible", "band_tile_fully_visible",
                 "band_needs_lo_mask", "band_needs_hi_mask", "band_key_range", "band_query_range", "classify_keys",
                 "band_plan"):
        g = frontend.gather(getattr(band_mod, name))
        assert not g.problems, (name, [p.format() for p in g.problems])
