"""The backward kernel's grouping of (query head, query tile) members: the trace-time plan, the instruction trace
it produces, and numerical checks of its edge cases against the golden.

The plan (``BwdConfig.blocks``: blocks of members loaded by one DMA per tensor, groups of up to
``group_size`` members whose dV, dK and dQ stay in PSUM, visits of 512-key tiles with their PSUM write
segments) is checked against a brute-force enumeration of the visible (query tile, 128-key chunk) pairs, with
no error bound involved; the trace checks count the instructions the plan implies; the numerical cases are the
grouping edge cases (group sizes that do not divide the tile count, GQA groups of 1, 2, 3, 8 and 16, sections
that end inside a group, windows that give the members of a group different keys, several sections with the
fp32 dQ scratch) under the accuracy rule of docs/validation.md.
"""
import types

import numpy as np
import pytest

from .conftest import Case, run_bwd_case as run_case

from nki_attn.kernels import attention_bwd as kb  # noqa: E402
from nki_attn.kernels.band import band_tile_visible  # noqa: E402
from nki_attn.sim import trace  # noqa: E402

P = 128


@pytest.fixture
def target(monkeypatch):
    def set_target(name):
        monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", name)
    return set_target


def _shape(*shape, dtype="float32"):
    return types.SimpleNamespace(shape=shape, dtype=dtype)


def plan(h=1, hk=1, sq=512, sk=None, d=64, causal=False, window=None, packing=False, section=None,
         dtype="float32", mixed=False, **knobs):
    """The kernel's ``BwdConfig`` for these shapes (trace time only: no instruction runs); ``knobs``: the
    kernel's tuning keywords."""
    sk = sq if sk is None else sk
    q, kv = _shape(1, h, d, sq, dtype=dtype), _shape(1, hk, d, sk, dtype=dtype)
    bmin = _shape(sq) if packing else None
    return kb._configure(q, kv, None, bmin, causal, mixed, None, window, section, **knobs)


def members_of(cfg, s):
    """{(g, i): [visits in order]} of section s, checking each member is in exactly one group."""
    seen = {}
    for blk in cfg.blocks[s]:
        assert 1 <= blk.nh * blk.nt <= cfg.block_members
        for grp in blk.groups:
            assert 1 <= len(grp.members) <= cfg.group_size
            for mi, (g, i, col) in enumerate(grp.members):
                assert (g, i) not in seen, f"member {(g, i)} twice in section {s}"
                assert blk.h0 <= g < blk.h0 + blk.nh and blk.i0 <= i < blk.i0 + blk.nt
                assert col == ((g - blk.h0) * blk.nt + (i - blk.i0)) * P  # head-major block columns
                assert blk.first == (cfg.first_sec[i] == s) and blk.last == (cfg.last_sec[i] == s)
                seen[(g, i)] = [v for kt in grp.ktiles for v in kt.visits if v.m == mi]
    return seen


def check_plan(cfg):
    """Every invariant of the plan the kernel relies on."""
    for s, (k_lo, k_len) in enumerate(cfg.sections):
        seen = members_of(cfg, s)
        for g in range(cfg.group):
            for i in range(cfg.nq):
                want = cfg.tiles[s][i]
                if not want:
                    assert (g, i) not in seen
                    continue
                # the member visits exactly its visible key tiles, in order
                got = [v.kt for v in seen[(g, i)]]
                assert got == want
                # brute force: the visited 128-key chunks are exactly the visible ones
                vis = {c for c in range(k_lo, k_lo + k_len, P)
                       if band_tile_visible(i * P, (i + 1) * P, c, c + P, cfg.lo_rel, cfg.hi_rel)}
                chunks = [c for v in seen[(g, i)] for c in range(v.k0, v.k0 + v.kw, P)]
                assert sorted(chunks) == sorted(vis) and len(chunks) == len(set(chunks))
                assert seen[(g, i)][0].dq_first and not any(v.dq_first for v in seen[(g, i)][1:])
        for blk in cfg.blocks[s]:
            for grp in blk.groups:
                for kt in grp.ktiles:
                    assert kt.u0 % P == 0 and kt.uw % P == 0 and 0 < kt.uw <= kb.K_TILE
                    assert k_lo <= kt.u0 and kt.u0 + kt.uw <= k_lo + k_len
                    assert (kt.u0 - k_lo) // kb.K_TILE == (kt.u0 + kt.uw - 1 - k_lo) // kb.K_TILE
                    written = set()
                    for v in kt.visits:
                        assert v.off == v.k0 - kt.u0 and 0 <= v.off and v.off + v.kw <= kt.uw
                        assert v.dsT_dma == (cfg.dsT_dma and v.kw == kb.K_TILE)
                        # the segments tile the visit's columns; a matmul overwrites exactly the columns no
                        # earlier visit of the group wrote in this key tile, and accumulates onto the others
                        pos = v.off
                        for a, e, acc in v.segs:
                            assert a == pos and a < e and a % P == 0 and e % P == 0
                            for c in range(a, e, P):
                                assert acc == (c in written)
                            pos = e
                        assert pos == v.off + v.kw
                        written |= set(range(v.off, v.off + v.kw, P))
                    # every column of the group's dV/dK PSUM tiles is written before they are evicted
                    assert written == set(range(0, kt.uw, P))


CASES = [
    dict(sq=640),                                           # 5 query tiles: groups of 4 + 1
    dict(sq=384, causal=True),                              # 3 tiles: one group of 3
    dict(sq=1024, causal=True, window=200),                 # members of a group see shifted key ranges
    dict(sq=1536, causal=True, window=700, section=384),    # sections end inside groups and key tiles
    dict(sq=1024, causal=True, section=640),                # sections not multiple of 512 keys
    dict(h=2, hk=1, sq=384, causal=True),                   # GQA 2
    dict(h=6, hk=2, sq=512, causal=True, window=150),       # GQA 3 (does not divide the group size 4)
    dict(h=8, hk=1, sq=256, causal=True),                   # GQA 8: blocks of 8 heads
    dict(h=16, hk=1, sq=256, d=128),                        # GQA 16: blocks split the heads
    dict(h=4, hk=4, sq=2048, d=128, causal=True, dtype="bfloat16", mixed=True),  # MHA, shape (d)
    dict(h=4, hk=1, sq=2048, d=128, causal=True, dtype="bfloat16", mixed=True),  # GQA, shape (a)
    dict(sq=384, sk=1280, section=256),                     # seqlen_q != seqlen_k
    dict(h=2, hk=1, sq=640, d=256, causal=True),            # d_head 256: groups of 2
    dict(h=4, hk=2, sq=640, causal=True, window=300, section=256, dtype="bfloat16", mixed=True),  # fp32 scratch
    dict(h=2, hk=1, sq=512, packing=True, causal=True, section=256),  # packing never skips a tile
]


@pytest.mark.parametrize("kw", CASES, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
@pytest.mark.parametrize("tgt", ["trn1", "trn2"])
def test_plan_invariants(kw, tgt, target):
    target(tgt)
    cfg = plan(**kw)
    check_plan(cfg)
    assert cfg.group_size == kb.GROUP_MAX // cfg.d_tiles
    # the group's dQ columns fit one PSUM bank: members x Q/K head-dim tiles x 128 fp32 <= 512
    assert cfg.group_size * cfg.d_tiles * P <= 512


def test_plan_groups_gqa_heads_of_one_query_tile(target):
    target("trn2")
    cfg = plan(h=8, hk=1, sq=256, causal=True, dtype="bfloat16")
    # bf16: blocks of the 8 query heads x 1 query tile; groups of 4 heads of the same tile see the same keys
    blk = cfg.blocks[0][0]
    assert (blk.h0, blk.nh, blk.nt) == (0, 8, 1)
    for grp in blk.groups:
        assert len({i for _, i, _ in grp.members}) == 1 and len(grp.members) == 4
        for kt in grp.ktiles:
            assert all(v.segs == [(v.off, v.off + v.kw, v.m > 0)] for v in kt.visits)


def test_plan_mha_groups_of_consecutive_tiles(target):
    target("trn2")
    cfg = plan(sq=640)  # non-causal: one 512-key tile + one 128-key tile per query tile
    groups = [grp for blk in cfg.blocks[0] for grp in blk.groups]
    assert [[i for _, i, _ in grp.members] for grp in groups] == [[0, 1, 2, 3], [4]]
    # one dV/dK eviction per group and key tile: 2 + 2, instead of 2 per member (10)
    assert sum(len(grp.ktiles) for grp in groups) == 4


def test_plan_blocks_split_at_first_and_last_section(target):
    target("trn2")
    cfg = plan(sq=1536, causal=True, window=700, section=384)
    for s in range(cfg.n_sections):
        for blk in cfg.blocks[s]:
            tiles = range(blk.i0, blk.i0 + blk.nt)
            assert len({cfg.first_sec[i] == s for i in tiles}) == 1
            assert len({cfg.last_sec[i] == s for i in tiles}) == 1


def test_dma_transpose_choice(target):
    target("trn2")
    # off by default (the worst case over the cost model's sensitivity set, docs/kernel-bwd.md)
    assert not plan(sq=2048, d=128, dtype="bfloat16").dsT_dma
    on = dict(ds_dma_transpose=True)
    assert plan(sq=2048, d=128, dtype="bfloat16", **on).dsT_dma          # whole tiles, TensorE-bound
    assert not plan(sq=2048, d=128, **on).dsT_dma                        # fp32: DMA transposes are 2-byte only
    assert not plan(sq=2048, d=64, causal=True, window=128, dtype="bfloat16", **on).dsT_dma  # no whole tile
    # a mix by tile: every 3rd whole tile
    cfg = plan(sq=2048, d=128, dtype="bfloat16", ds_dma_every=3, **on)
    whole = [v for blk in cfg.blocks[0] for grp in blk.groups for kt in grp.ktiles for v in kt.visits
             if v.kw == kb.K_TILE]
    assert [v.dsT_dma for v in whole] == [(n + 1) % 3 == 0 for n in range(len(whole))]
    target("trn1")
    assert not plan(sq=2048, d=128, dtype="bfloat16", **on).dsT_dma       # no DMA transpose on trn1


# --------------------------------------------------------------------------------------------- trace vs plan
def _exp_count(rec):
    return sum(1 for r in rec.records if r.instr == "activation" and len(r.srcs) == 2)


def _evictions(rec):
    """dV/dK leaving PSUM: VectorE instructions reading a PSUM tile and writing an fp32 SBUF accumulator (the
    allocations DMAed out as dK / dV): an add in place, or the copy (scaled for dK) of the columns no earlier
    eviction wrote. Returns ``(instructions, columns written)``. With the streamed keys a transposed dK
    accumulator (``[128 keys, rn]`` per chunk, rn < 128) leaves by TensorE transposes of its chunks instead of a DMA:
    those count too (a float32 dS is transposed by whole 128-key chunks)."""
    accs = {r.srcs[0].uid for r in rec.records if r.instr == "dma_copy" and r.srcs and r.srcs[0].buffer == "sbuf"
            and r.srcs[0].dtype == "float32" and r.dst.buffer != "sbuf"}
    accs |= {r.srcs[0].uid for r in rec.records if r.instr == "nc_transpose" and r.srcs[0].buffer == "sbuf"
             and r.srcs[0].dtype == "float32" and r.dst.dtype == "float32" and r.srcs[0].shape[-1] < 128}
    ev = [r for r in rec.records if r.engine == "VectorE" and r.dst is not None and r.dst.uid in accs
          and any(s.buffer == "psum" for s in r.srcs)]
    return len(ev), sum(r.dst.free_elems for r in ev)


def expected_dmas(cfg, sinks=0):
    """DMA count the plan implies, one work item: -LSE; per section K, V, dK, dV; per block dO, Q, (O or the
    previous dQ), the dQ store; sinks load and store."""
    n = 1
    for s in range(cfg.n_sections):
        n += 2 * len(cfg.qk_rows) + 2 * len(cfg.v_rows)
        for blk in cfg.blocks[s]:
            n += len(cfg.v_rows) + len(cfg.qk_rows) + len(cfg.qk_rows)
            n += len(cfg.v_rows) if blk.first else len(cfg.qk_rows)
    return n + (2 if sinks else 0)


@pytest.mark.parametrize("kw", [
    dict(sq=640, causal=True, window=200),
    dict(h=8, hk=1, sq=256, causal=True, sinks=1),
    dict(h=4, hk=2, sq=512, causal=True, window=300, dtype="bfloat16", mixed=True, section=256),
    dict(sq=512, dtype="bfloat16", mixed=True),
], ids=["mha-window", "gqa8-sinks", "gqa2-sections-scratch", "bf16-dma-transpose"])
def test_trace_matches_plan(kw, target):
    target("trn2")
    kw = dict(kw)
    section = kw.pop("section", None)
    c = Case(**kw)
    with trace.recording() as rec:
        out = c.bwd(k_section_len=section)
    c.check_bwd(out)
    # the DMA count below is the section path's (K, V loaded per section, dK, dV stored at its end)
    with trace.recording() as rec_sec:
        out_sec = c.bwd(k_section_len=section, stream_keys=False)
    for x, y in zip(out, out_sec):
        assert np.array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))
    cfg = plan(h=kw.get("h", 1), hk=kw.get("hk", 1), sq=kw["sq"], causal=kw.get("causal", False),
               window=kw.get("window"), section=section, dtype=kw.get("dtype", "float32"),
               mixed=kw.get("mixed", False))
    visits = sum(len(kt.visits) for blks in cfg.blocks for blk in blks for grp in blk.groups for kt in grp.ktiles)
    ktiles = sum(len(grp.ktiles) for blks in cfg.blocks for blk in blks for grp in blk.groups)
    sinks = kw.get("sinks", 0)
    items = kw.get("hk", 1)  # work items (batch 1): the plan is per item
    # one exp per visit, one per (head, sink)
    assert _exp_count(rec) == visits * items + kw.get("h", 1) * sinks
    # dV and dK leave PSUM once per (group, key tile), not once per visit: every column of the group's key tile
    # once per head-dim tile (the first eviction of a column overwrites, later ones add: one or two instructions)
    n_ev, cols = _evictions(rec)
    uw = sum(kt.uw for blks in cfg.blocks for blk in blks for grp in blk.groups for kt in grp.ktiles)
    tiles = len(cfg.v_rows) + len(cfg.qk_rows)
    # a transposed dK tile (``qk_t``) writes its rn columns per 128-key chunk instead of 128
    per_col = len(cfg.v_rows) + sum(rt[1] / 128 if t else 1 for rt, t in zip(cfg.qk_rows, cfg.qk_t))
    assert cols == uw * per_col * items
    assert _evictions(rec_sec)[1] == uw * tiles * items
    assert ktiles * tiles * items <= n_ev <= 2 * ktiles * tiles * items
    assert ktiles < visits
    n_dma = sum(1 for r in rec_sec.records if r.instr == "dma_copy")
    assert n_dma == expected_dmas(cfg, sinks) * items
    n_tr = rec.count("dma_transpose")
    assert n_tr == sum(v.dsT_dma for blks in cfg.blocks for blk in blks for grp in blk.groups
                       for kt in grp.ktiles for v in kt.visits) * items
    assert (n_tr > 0) == cfg.dsT_dma


def test_dma_transpose_and_tensor_transpose_agree(target):
    # the same bf16 problem with dS transposed by DMA (trn2) and by TensorE (trn1): identical bits
    c = Case(sq=512, dtype="bfloat16", mixed=True, h=2, hk=1)
    target("trn2")
    with trace.recording() as rec:
        a = c.bwd(ds_dma_transpose=True)
    assert rec.count("dma_transpose") > 0
    target("trn1")
    with trace.recording() as rec:
        b = c.bwd()
    assert rec.count("dma_transpose") == 0
    c.check_bwd(a)
    for x, y in zip(a, b):
        assert np.array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))


# --------------------------------------------------------------------------------------------- numerics
@pytest.mark.parametrize("kw", [
    dict(sq=640),                                                     # groups of 4 + 1 (MHA)
    dict(sq=640, causal=True, window=200),                            # partial PSUM coverage in a group
    dict(h=2, hk=1, sq=384, causal=True, dtype="bfloat16", mixed=True),  # GQA 2
    dict(h=6, hk=2, sq=384, causal=True, window=150),                 # GQA 3
    dict(h=8, hk=1, sq=256, causal=True, sinks=1),                    # GQA 8, sinks of every head at once
    dict(h=16, hk=1, sq=128, sinks=2),                                # GQA 16: two blocks of heads
    dict(h=2, hk=1, sq=384, d=256, causal=True),                      # d_head 256: groups of 2
    dict(h=4, hk=1, cu=[0, 100, 250, 384], sq=384, causal=True),      # packing with GQA
], ids=["mha-5-tiles", "mha-window", "gqa2-bf16", "gqa3-window", "gqa8-sinks", "gqa16", "d256", "packing-gqa"])
def test_grouping_numerics(kw):
    run_case(**kw)


@pytest.mark.parametrize("section,kw", [
    (384, dict(sq=512, causal=True)),                                         # section ends inside a group
    (256, dict(sq=768, causal=True, window=300, h=2, hk=1)),                  # first/last runs split blocks
    (256, dict(h=4, hk=2, sq=640, causal=True, window=300, dtype="bfloat16", mixed=True)),  # fp32 dQ scratch
    (256, dict(sq=384, sk=640)),                                              # seqlen_q != seqlen_k
], ids=["inside-group", "window-runs", "gqa-scratch", "unequal"])
def test_grouping_numerics_sections(section, kw):
    run_case(k_section_len=section, **kw)


# ----------------------------------------------------------------------------------------------- tuning keywords
def _bwd_inputs(dtype=np.float32, seed=70):
    import ml_dtypes
    from nki_attn.kernels.attention_fwd import attention_fwd
    dt = ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, 4, 64, 1024)).astype(dt)
    k = rng.standard_normal((1, 1, 64, 1024)).astype(dt)
    v = rng.standard_normal((1, 1, 64, 1024)).astype(dt)
    dy = rng.standard_normal((1, 4, 64, 1024)).astype(dt)
    o, lse = attention_fwd(q, k, v)
    return q, k, v, o, dy, lse


def _run_bwd(x, **kw):
    with trace.recording() as rec:
        out = kb.attention_bwd(*x, **kw)
    return [np.asarray(t).astype(np.float64) for t in out], rec.records


def test_tuning_keywords_change_the_plan_not_the_gradients(target):
    """group_max and block_members_max reach the plan (the instruction stream changes) and leave the gradients
    equal to the default launch's up to float32 summation order (dV and dK add over a group's members in another
    order); invalid values fail the kernel's assert naming the keyword."""
    target("trn2")
    x = _bwd_inputs()
    base, rec0 = _run_bwd(x, use_causal_mask=True)
    for kw in (dict(group_max=1), dict(block_members_max=1), dict(group_max=2, block_members_max=6)):
        got, rec1 = _run_bwd(x, use_causal_mask=True, **kw)
        assert len(rec1) != len(rec0), kw
        for a, b in zip(got, base):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    q, k, v = x[:3]
    c = kb._configure(q, k, None, None, True, False, None, None, None, v, group_max=2, block_members_max=2)
    assert (c.group_size, c.block_members) == (2, 2)
    for name, bad in (("group_max", 0), ("block_members_max", 2.0), ("p_cast_on_gpsimd", 1),
                      ("ds_dma_transpose", "no")):
        with pytest.raises(AssertionError, match=rf"{name}="):
            kb.attention_bwd(*x, **{name: bad})


def test_engine_keywords_move_instructions_not_results(target):
    """bf16, mixed precision, trn2: p_cast_on_gpsimd=False moves the P cast from GpSimdE to ScalarE and
    ds_dma_transpose=True the whole-tile dS transposes from TensorE to DMA; the arithmetic is the same, so the
    gradients are bit-identical."""
    target("trn2")
    x = _bwd_inputs("bfloat16")
    base, rec0 = _run_bwd(x, mixed_precision=True)

    def casts(rec, engine):
        return sum(1 for r in rec if r.engine == engine and r.dst is not None and r.dst.dtype == "bfloat16"
                   and r.srcs and r.srcs[0].dtype == "float32" and r.dst.shape == (128, 512)
                   and r.instr in ("tensor_copy", "activation"))
    assert casts(rec0, "GpSimdE") > 0 and casts(rec0, "ScalarE") == 0
    got, rec1 = _run_bwd(x, mixed_precision=True, p_cast_on_gpsimd=False)
    assert casts(rec1, "GpSimdE") == 0 and casts(rec1, "ScalarE") == casts(rec0, "GpSimdE")
    assert all(np.array_equal(a, b) for a, b in zip(got, base))
    assert not any(r.instr == "dma_transpose" for r in rec0)
    got, rec2 = _run_bwd(x, mixed_precision=True, ds_dma_transpose=True)
    assert any(r.instr == "dma_transpose" for r in rec2)
    assert all(np.array_equal(a, b) for a, b in zip(got, base))
