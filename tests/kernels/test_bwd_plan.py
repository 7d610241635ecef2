"""The backward kernel's trace-time plan read directly (kernel internals: ``bwd_problem``, ``_configure`` and the
``BwdConfig`` it returns): the plan visits exactly the band's chunks, a bounded window costs linear in the sequence,
and shapes whose per-row statistics outgrow SBUF are refused before any instruction. These tests follow the
kernel's internal names; the numerical behaviour is in test_matrix.py.
"""
import types

import numpy as np
import pytest

from golden.attention_fwd_torch import visibility_mask
from nki_attn.kernels import attention_bwd as kb


def _ids(kw):
    return ",".join(f"{k}={v}" for k, v in kw.items())


@pytest.mark.parametrize("kw", [
    dict(sq=1024, window_size=(64, 64)),
    dict(sq=640, sk=1152, window_size=(300, 100), section=256),
    dict(sq=1152, sk=640, causal=True, window_size=(200, -1)),
    dict(sq=768, sk=512, causal=True, window=130, section=384),
    dict(sq=512, sk=896, window_size=(-1, 0)),
    dict(sq=384, sk=128, causal=True),                                   # query tiles that see no key
], ids=_ids)
def test_plan_follows_the_band(kw):
    """The trace-time plan visits exactly the 128-key chunks holding a visible (query, key) pair of the golden's
    visibility matrix, and flags an element mask exactly where a visited chunk run holds an invisible pair on
    that side of the band (brute force, no error bound)."""
    sq, sk = kw["sq"], kw.get("sk", kw["sq"])
    cfg = kb._configure(np.zeros((1, 1, 64, sq), np.float32), np.zeros((1, 1, 64, sk), np.float32), None, None,
                        kw.get("causal", False), False, None, kw.get("window"), kw.get("section"),
                        window_size=kw.get("window_size"))
    vis = visibility_mask(sq, sk, kw.get("causal", False), kw.get("window"), None, None,
                          kw.get("window_size")).numpy()
    i = np.arange(sq)[:, None]
    j = np.arange(sk)[None, :]
    above = j > i + cfg.hi_rel   # invisible by the band's upper side
    below = j < i + cfg.lo_rel   # invisible by its lower side
    assert np.array_equal(vis, ~(above | below))
    for s, (k_lo, k_len) in enumerate(cfg.sections):
        for qt in range(cfg.nq):
            rows = slice(qt * 128, (qt + 1) * 128)
            want = [c for c in range(k_lo, k_lo + k_len, 128) if vis[rows, c:c + 128].any()]
            got = [c for tile in cfg.tiles[s][qt] for c in range(tile.k0, tile.k1, 128)]
            assert got == want, (s, qt)
            for tile in cfg.tiles[s][qt]:
                assert tile.needs_hi == bool(above[rows, tile.k0:tile.k1].any())
                assert tile.needs_lo == bool(below[rows, tile.k0:tile.k1].any())
    for qt in range(cfg.nq):
        sees = bool(vis[qt * 128:(qt + 1) * 128].any())
        assert (qt in cfg.no_key_tiles) == (not sees)


def test_window_cost_is_linear_in_seqlen():
    counts = []
    for sq in (1024, 2048):
        c = kb._configure(np.zeros((1, 1, 64, sq), np.float32), np.zeros((1, 1, 64, sq), np.float32), None, None,
                          False, False, None, None, None, window_size=(64, 64))
        counts.append(sum(len(t) for row in c.tiles for t in row))
        chunks = sum((tile.k1 - tile.k0) // 128 for row in c.tiles for t in row for tile in t)
        # every visible 128-key chunk of a (64, 64) window: at most 3 per query tile
        assert chunks <= 3 * (sq // 128)
    assert counts[1] <= 2 * counts[0] + 2


def test_sbuf_budget_refusal(target):
    # 64 query heads on one kv head at 32K tokens: -LSE and D of every row of the group no longer fit SBUF.
    # Shapes only (validation runs before any instruction), so no 32K-token arrays are built.
    target("trn2")

    def t(*shape, dt="float32"):
        return types.SimpleNamespace(shape=shape, dtype=dt)
    q, kv = t(1, 64, 128, 32768), t(1, 1, 128, 32768)
    lse = t(1, 64, 128, 256)
    assert "SBUF bytes per partition" in kb.bwd_problem(q, kv, kv, q, q, lse, use_causal_mask=True)
    # the same shapes with 8 query heads per kv head fit (llama-style GQA at 16K)
    q8, lse8, kv8 = t(1, 8, 128, 16384), t(1, 8, 128, 128), t(1, 1, 128, 16384)
    assert kb.bwd_problem(q8, kv8, kv8, q8, q8, lse8, use_causal_mask=True) is None
    cfg = kb._configure(q8, kv8, None, None, True, False, None, None, None)
    assert cfg.n_sections == -(-16384 // cfg.section_len) >= 2


def test_several_work_items_keep_two_sections_within_sbuf(target):
    """The software pipeline loads the next work item's K/V section while the last one drains, so a launch of
    several work items (batch x kv heads) holds two sections at once even when one section covers the keys.
    Gemma-2-like shapes (d 256, 4096 keys, bf16, 2 query heads per kv head): one work item takes all 4096 keys
    in one section; two work items take half each, and the budget check counts both live sections, so the
    whole-length section a single item uses would be refused for two (it overflowed trn2's SBUF in the
    simulator's allocation before the fix, the models preset's Gemma-2 row)."""
    target("trn2")

    def t(*shape, dt="bfloat16"):
        return types.SimpleNamespace(shape=shape, dtype=dt)

    def shapes(kvh):
        q, kv, lse = t(1, 2 * kvh, 256, 4096), t(1, kvh, 256, 4096), t(1, 2 * kvh, 128, 32, dt="float32")
        return q, kv, kv, q, q, lse

    one = kb._configure(*shapes(1)[:2], None, None, True, True, None, 1024, None, mods={"softcap": 50.0})
    two = kb._configure(*shapes(2)[:2], None, None, True, True, None, 1024, None, mods={"softcap": 50.0})
    assert one.n_sections == 1 and one.section_len == 4096
    assert two.n_sections == 2 and two.section_len == 2048
    for kvh in (1, 2):
        assert kb.bwd_problem(*shapes(kvh), use_causal_mask=True, mixed_precision=True, sliding_window=1024,
                              softcap=50.0) is None
    # forcing the single item's whole-length section on two items is refused before any instruction
    msg = kb.bwd_problem(*shapes(2), use_causal_mask=True, mixed_precision=True, sliding_window=1024, softcap=50.0,
                         k_section_len=4096)
    assert msg is not None and "SBUF bytes per partition" in msg
