"""Brute-force checks of the trace-time tile decisions against a naive dense mask.

``nki_attn/kernels/band.py`` decides, per (query tile, key tile), whether anything is visible (compute it) and
whether everything is visible (skip the element mask). An off-by-one there only shows for window widths near a
multiple of 128 (W = 127, 130, ...), so these tests compare the decisions with a boolean mask built the plain way
(``vis[i, j] = (j <= i if causal) and (j >= i - W + 1 if window)``) over many widths and positions:

* every (query range, key range) of a small universe, exhaustively (no 128 alignment assumed);
* every (128-row query tile, key range of 1..4 chunks of 128) the kernels can ask about, for the windows around
  the multiples of 128 and sequence lengths that are not multiples of 512;
* the plans the kernels derive from them: the backward's per-section tile list and the forward's key-block plan
  (per block of query tiles) must cover every visible element, and a tile planned without a mask must need none.

The kernels' plans are read through ``bwd_plan`` and ``fwd_plan`` below (the only places that know how); adapt
those two when the kernels' planning code changes shape.
"""
import itertools
import types

import numpy as np
import pytest

from nki_attn.kernels import attention_bwd as kb
from nki_attn.kernels import attention_fwd as kf
from nki_attn.kernels.band import attention_band, band_tile_fully_visible, band_tile_visible

P = 128  # query tile height and key chunk width of both kernels (the partition count)
WINDOWS = [1, 2, 3, 64, 126, 127, 128, 129, 130, 131, 254, 255, 256, 257, 258, 383, 384, 385, 386, 511, 512, 513,
           514, 639, 640, 641, 1000, 5000]


def dense_mask(sq, sk, causal, window):
    """Bool [sq, sk], True where query i sees key j, element by element (no tiles involved)."""
    i = np.arange(sq)[:, None]
    j = np.arange(sk)[None, :]
    vis = np.ones((sq, sk), dtype=bool)
    if causal:
        vis &= j <= i
    if window:
        vis &= j >= i - window + 1
    return vis


def _flag(causal, window):
    return f"causal={causal},W={window}"


def tile_visible(q0, q1, k0, k1, causal, window, n):
    """The band decision for the flags of ``dense_mask`` (equal lengths ``n``)."""
    return band_tile_visible(q0, q1, k0, k1, *attention_band(causal, window or None, None, n, n))


def tile_fully_visible(q0, q1, k0, k1, causal, window, n):
    return band_tile_fully_visible(q0, q1, k0, k1, *attention_band(causal, window or None, None, n, n))


# ----------------------------------------------------------------------------------------------- band.py
@pytest.mark.parametrize("causal", [False, True])
def test_tile_functions_exhaustive_small_universe(causal):
    # Every query range [q0, q1) and key range [k0, k1) inside 0..N and every window 0..N+2: the decisions must be
    # exactly "any" / "all" of the dense block. Small N keeps it exhaustive (~10^5 calls, well under a second).
    n = 11
    for window in range(0, n + 3):
        vis = dense_mask(n, n, causal, window)
        for q0, q1 in itertools.combinations(range(n + 1), 2):
            for k0, k1 in itertools.combinations(range(n + 1), 2):
                block = vis[q0:q1, k0:k1]
                assert tile_visible(q0, q1, k0, k1, causal, window, n) == block.any(), \
                    ("tile_visible", q0, q1, k0, k1, _flag(causal, window))
                assert tile_fully_visible(q0, q1, k0, k1, causal, window, n) == block.all(), \
                    ("tile_fully_visible", q0, q1, k0, k1, _flag(causal, window))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [0] + WINDOWS)
def test_tile_functions_on_kernel_tiles(causal, window):
    # The calls the kernels make: 128-row query tiles against key ranges of 1..4 whole chunks of 128 (up to one
    # 512-key score tile), over a sequence long enough for every window above to start and end inside it.
    sq = 1536
    vis = dense_mask(sq, sq, causal, window)
    # any / all of every (query tile, key chunk) block, then of runs of chunks via cumulative counts
    blocks = vis.reshape(sq // P, P, sq // P, P)
    n_vis = blocks.sum(axis=(1, 3))  # visible elements per (query tile, key chunk)
    for qt in range(sq // P):
        q0 = qt * P
        for c0 in range(sq // P):
            for n_ch in range(1, 5):
                if c0 + n_ch > sq // P:
                    break
                k0, k1 = c0 * P, (c0 + n_ch) * P
                count = int(n_vis[qt, c0:c0 + n_ch].sum())
                assert tile_visible(q0, q0 + P, k0, k1, causal, window, sq) == (count > 0), \
                    ("tile_visible", q0, k0, k1, _flag(causal, window))
                assert tile_fully_visible(q0, q0 + P, k0, k1, causal, window, sq) == (count == P * (k1 - k0)), \
                    ("tile_fully_visible", q0, k0, k1, _flag(causal, window))


# ----------------------------------------------------------------------------------------------- kernel plans
def bwd_plan(sq, sk, causal, window, section_len):
    """The backward kernel's trace-time plan as ``[(query tile row q0, k0, kw, needs_causal, needs_window)]`` over
    all sections, plus the section list ``[(lo, len)]``. Reads ``BwdConfig.tiles`` through ``_configure`` with
    shape-only stand-ins (planning runs before any instruction)."""
    def t(*shape):
        return types.SimpleNamespace(shape=shape, dtype="float32")
    q, kv = t(1, 1, 64, sq), t(1, 1, 64, sk)
    cfg = kb._configure(q, kv, None, None, causal, False, None, window or None, section_len)
    planned = []
    for s in range(cfg.n_sections):
        for i in range(cfg.nq):
            for kt in cfg.tiles[s][i]:
                planned.append((i * P, kt.k0, kt.k1 - kt.k0, kt.needs_hi, kt.needs_lo))
    return planned, list(cfg.sections)


def fwd_plan(sq, sk, causal, window):
    """The forward kernel's plan as ``[(q0, k0, kw, needs_causal, needs_window)]``: the blocks of query tiles the
    kernel forms (one head), the key blocks ``_key_blocks`` plans for each, and per (query tile, 512-key key
    tile) the visible chunk run and the band sides its ``band.KeyTile`` says cut it (what ``_mask_affine`` masks). Reads
    ``_FwdConfig`` with shape-only stand-ins (planning runs before any instruction)."""
    def t(*shape):
        return types.SimpleNamespace(shape=shape, dtype="float32")
    shp = kf.attention_shape(t(1, 1, 64, sq), t(1, 1, 64, sk), use_causal_mask=causal,
                             sliding_window=window or None)
    cfg = kf._FwdConfig(shp, kf.nl.float32, kf.nl.float32, False)
    planned = []
    for s0 in range(0, cfg.n_qt, cfg.slab_tiles):
        for j0, j1 in kf._blocks(cfg, min(cfg.slab_tiles, cfg.n_qt - s0)):
            tiles = [s0 + j for j in range(j0, j1)]
            for kb in kf._key_blocks(cfg, tiles):
                for u, qt in enumerate(tiles):
                    for i in range(kb.kt_n):
                        kt = kb.vis[u][i]
                        if kt.k1 <= kt.k0:
                            continue
                        lo, hi = (kt.k0 - (kb.kt0 + i) * kf.K_TILE) // P, (kt.k1 - (kb.kt0 + i) * kf.K_TILE) // P
                        q0, k0, kw = qt * P, kt.k0, kt.k1 - kt.k0
                        assert 0 <= lo < hi <= kf.K_TILE // P
                        assert kb.c_lo <= i * (kf.K_TILE // P) + lo and i * (kf.K_TILE // P) + hi <= kb.c_hi
                        planned.append((q0, k0, kw, kt.needs_hi, kt.needs_lo))
    return planned


def check_plan(planned, sq, sk, causal, window, key_tile_bounds):
    """Every visible element lies in exactly one planned tile; a tile planned without a mask needs none (for
    each rule separately); no planned tile lies outside its key tile or is entirely masked."""
    vis = dense_mask(sq, sk, causal, window)
    causal_ok = dense_mask(sq, sk, causal, 0)
    window_ok = dense_mask(sq, sk, False, window)
    covered = np.zeros((sq, sk), dtype=np.int32)
    for q0, k0, kw, need_c, need_w in planned:
        what = (q0, k0, kw, _flag(causal, window))
        assert q0 % P == 0 and k0 % P == 0 and kw % P == 0 and kw > 0, what
        assert any(lo <= k0 and k0 + kw <= hi for lo, hi in key_tile_bounds), ("tile crosses its bounds", what)
        rows, cols = slice(q0, q0 + P), slice(k0, k0 + kw)
        covered[rows, cols] += 1
        assert vis[rows, cols].any(), ("planned tile sees nothing", what)
        if not need_c:
            assert causal_ok[rows, cols].all(), ("causal mask skipped where needed", what)
        if not need_w:
            assert window_ok[rows, cols].all(), ("window mask skipped where needed", what)
    missed = np.argwhere(vis & (covered == 0))
    assert missed.size == 0, f"visible (query, key) pairs in no planned tile, e.g. {missed[:3].tolist()} " \
                             f"({_flag(causal, window)}, {len(missed)} in all)"
    assert covered.max() <= 1, f"a (query, key) pair is computed twice ({_flag(causal, window)})"


# (sq, sk, causal, window): lengths that are not multiples of 512, causal ones with every window of WINDOWS
PLAN_CASES = ([(384, 384, True, w) for w in WINDOWS]
              + [(640, 640, True, w) for w in WINDOWS]
              + [(1152, 1152, True, w) for w in (127, 130, 255, 258, 511, 514)]
              + [(s, s, True, 0) for s in (128, 384, 640, 1152)]
              + [(256, 640, False, 0), (640, 384, False, 0), (384, 1152, False, 0)])


@pytest.mark.parametrize("section_len", [None, 128, 256, 384, 512])
def test_bwd_plan_covers_exactly_the_visible_pairs(section_len):
    for sq, sk, causal, window in PLAN_CASES:
        planned, sections = bwd_plan(sq, sk, causal, window, section_len)
        bounds = []  # a planned tile must stay inside one section and one 512-key tile of it
        for lo, n in sections:
            for t0 in range(lo, lo + n, kb.K_TILE):
                bounds.append((t0, min(t0 + kb.K_TILE, lo + n)))
        check_plan(planned, sq, sk, causal, window, bounds)


def test_fwd_plan_covers_exactly_the_visible_pairs():
    for sq, sk, causal, window in PLAN_CASES:
        bounds = [(t0, min(t0 + kf.K_TILE, sk)) for t0 in range(0, sk, kf.K_TILE)]
        check_plan(fwd_plan(sq, sk, causal, window), sq, sk, causal, window, bounds)
