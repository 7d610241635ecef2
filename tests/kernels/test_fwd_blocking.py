"""The forward kernel's grouping and batching (nki_attn/kernels/attention_fwd.py, docs/kernel-fwd.md "Loop nest"):
query slabs, blocks of (query tile, head) members, key blocks, statistics batched over a block's members, and
transfers batched per (head, slab).

Pinned two ways: structurally (the trace-time plans against brute force, instruction and transfer counts from the
simulator's trace) and numerically at the edges of each grouping (against the golden with the project's criterion,
tests/kernels/conftest.py).
"""
import math
import types

import numpy as np
import pytest
import torch

from .conftest import check_fwd_outputs, make_qkv, run_and_check

import nki_attn.sim as sim  # noqa: E402
from golden import packing_bounds  # noqa: E402
from nki_attn.backend import nl  # noqa: E402
from nki_attn.kernels import attention_fwd as fwd  # noqa: E402
from nki_attn.kernels.attention_fwd import attention_fwd  # noqa: E402
from nki_attn.kernels.validation import attention_shape  # noqa: E402
from nki_attn.sim.trace import recording  # noqa: E402

KB_KEYS = fwd.KB_TILES * fwd.K_TILE


def config(bs=1, nheads=1, nheads_kv=1, d=64, sq=256, sk=None, dtype=nl.bfloat16, causal=False, window=None,
           packing=False, sinks=0, range_select=True, mixed=True):
    """The kernel's trace-time configuration for these arguments (built on the host from shapes only)."""
    sk = sq if sk is None else sk
    q = np.zeros((bs, nheads, d, sq), np.float32)
    k = np.zeros((bs, nheads_kv, d, sk), np.float32)
    s = np.zeros((bs, nheads, sinks), np.float32) if sinks else None
    bmin = np.zeros((sq,), np.float32) if packing else None
    shp = attention_shape(q, k, sinks=s, bound_min=bmin, use_causal_mask=causal, sliding_window=window)
    return fwd._FwdConfig(shp, dtype, nl.float32 if mixed else dtype, range_select)


def traced(q, k, v, **kw):
    with recording() as rec:
        out = attention_fwd(q, k, v, **kw)
    return out, rec.records


def dmas(records, src=None, dst_hbm_dtype=None):
    """dma_copy records reading kernel argument ``src`` (arg0 = q, arg1 = k, arg2 = v, ...) or writing HBM in
    ``dst_hbm_dtype``."""
    out = []
    for r in records:
        if r.instr != "dma_copy":
            continue
        if src is not None and r.srcs[0].name == src:
            out.append(r)
        elif dst_hbm_dtype is not None and r.dst.buffer == "hbm" and r.dst.dtype == dst_hbm_dtype \
                and len(r.dst.shape) == 2:  # (not the V^T scratch of d_v > 128, [128, chunks, d_v])
            out.append(r)
    return out


def n_members_blocks(cfg):
    """Blocks of every slab of one kv head."""
    blocks = []
    for t0 in range(0, cfg.n_qt, cfg.slab_tiles):
        n = min(cfg.slab_tiles, cfg.n_qt - t0)
        for j0, j1 in fwd._blocks(cfg, n):
            blocks.append((t0, j0, j1))
    return blocks


# ----------------------------------------------------------------------------------------------- plans (structure)
@pytest.mark.parametrize("group", [1, 2, 3, 5, 8, 9, 16, 24])
@pytest.mark.parametrize("n_tiles", [1, 3, 7])
def test_blocks_partition_the_members(group, n_tiles):
    cfg = config(nheads=group, nheads_kv=1)
    blocks = fwd._blocks(cfg, n_tiles)
    covered = []
    for j0, j1 in blocks:
        assert 0 < j1 - j0 <= fwd.BLOCK_MEMBERS_MAX
        covered += list(range(j0, j1))
        if group <= fwd.BLOCK_MEMBERS_MAX:
            # whole query tiles: every head of the group, so per-head statistics repeat with period `group`
            assert j0 % group == 0 and (j1 - j0) % group == 0
        else:
            assert j0 // group == (j1 - 1) // group  # never across a query tile
    assert covered == list(range(n_tiles * group))  # in order, each member once
    if group <= fwd.BLOCK_MEMBERS_MAX:
        assert cfg.members == (fwd.BLOCK_MEMBERS_MAX // group) * group
        assert len(blocks) == math.ceil(n_tiles * group / cfg.members)


def _brute_visible(q0, k0, k1, causal, window):
    i = np.arange(q0, q0 + 128)[:, None]
    j = np.arange(k0, k1)[None, :]
    vis = np.ones((128, k1 - k0), bool)
    if causal:
        vis &= j <= i
    if window:
        vis &= j >= i - window + 1
    return vis.any(axis=0)


@pytest.mark.parametrize("sk,causal,window", [(2560, True, None), (4608, True, 300), (2176, False, None),
                                              (4096, True, 128), (6144, True, 2200)])
@pytest.mark.parametrize("tiles", [[0, 1], [3, 4, 5], [15, 16, 17, 18], [30, 31]])
def test_key_block_plan_matches_brute_force(sk, causal, window, tiles):
    tiles = [t for t in tiles if t * 128 < sk]
    cfg = config(sq=sk, sk=sk, causal=causal, window=window)
    plan = fwd._key_blocks(cfg, tiles)
    seen = {}
    for kb in plan:
        kt0, kt_n, c_lo, c_hi, gaps = kb.kt0, kb.kt_n, kb.c_lo, kb.c_hi, kb.gaps
        assert kt0 % cfg.kb_tiles == 0 and kt_n == min(cfg.kb_tiles, cfg.n_kt - kt0)
        union = []
        want_gaps = kt_n < cfg.kb_tiles
        for u, t in enumerate(tiles):
            for i in range(kt_n):
                k0 = (kt0 + i) * 512
                k1 = min(k0 + 512, sk)
                chunks = np.flatnonzero(_brute_visible(t * 128, k0, k1, causal, window).reshape(-1, 128).any(1))
                kt = kb.vis[u][i]
                lo, hi = (kt.k0 - k0) // 128, (kt.k1 - k0) // 128
                if len(chunks):
                    assert (lo, hi) == (chunks[0], chunks[-1] + 1)  # exactly the visible chunks (contiguous)
                    union += [i * 4 + lo, i * 4 + hi]
                    seen[(u, kt0 + i)] = True
                else:
                    assert lo == hi
                    want_gaps = True
        assert (c_lo, c_hi) == (min(union), max(union))  # K/V loaded for the union of the members' chunks
        assert gaps == want_gaps
    # every visible (member, key tile) is in exactly one key block; key blocks nobody sees are absent
    for u, t in enumerate(tiles):
        for kt in range(cfg.n_kt):
            k0 = kt * 512
            if _brute_visible(t * 128, k0, min(k0 + 512, sk), causal, window).any():
                assert seen.get((u, kt))
    assert len(plan) == len({kb.kt0 for kb in plan})


@pytest.mark.parametrize("target", ["trn1", "trn2", "trn3"])
@pytest.mark.parametrize("dtype,d,group,s", [("float32", 256, 8, 32768), ("bfloat16", 128, 4, 32768),
                                             ("bfloat16", 64, 8, 4096), ("bfloat16", 128, 4, 4096),
                                             ("float32", 96, 1, 16384), ("bfloat16", 256, 16, 8192)])
def test_slabs_are_balanced_and_sized_by_the_budget(monkeypatch, target, dtype, d, group, s):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", target)
    dt = nl.float32 if dtype == "float32" else nl.bfloat16
    cfg = config(nheads=group, d=d, sq=s, dtype=dt, packing=True, sinks=2, causal=True,
                 range_select=target != "trn1")
    assert 1 <= cfg.slab_tiles <= cfg.n_qt
    n_sec = math.ceil(cfg.n_qt / cfg.slab_tiles)
    assert cfg.slab_tiles == math.ceil(cfg.n_qt / n_sec)  # balanced: no short last slab
    e = 4 if dtype == "float32" else 2
    staging = cfg.slab_tiles * group * (2 * len(cfg.qk_tiles) * 128 * e + 4)  # Q, O, LSE of one slab
    # the pipeline holds three slabs (finishing, current, next) beside two units' scores (float32)
    scores = 2 * cfg.members * cfg.kb_tiles * fwd.K_TILE * 4
    assert 3 * staging + scores <= fwd.sbuf_bytes_per_partition()
    assert 1 <= cfg.kb_tiles <= fwd.KB_TILES
    if cfg.kb_tiles > 1:  # the key block shrinks before a slab gets shorter than two blocks' query tiles
        assert cfg.slab_tiles >= min(cfg.n_qt, 2 * max(1, cfg.members // group))


@pytest.mark.parametrize("target", ["trn1", "trn2", "trn3"])
@pytest.mark.parametrize("dtype,d,group,s", [("bfloat16", 128, 4, 4096), ("bfloat16", 128, 1, 4096),
                                             ("float32", 64, 4, 4096), ("bfloat16", 256, 2, 8192)])
def test_exponent_lead_never_costs_a_key_block_tile(monkeypatch, target, dtype, d, group, s):
    # the deeper exponent lead holds more P tiles in flight; it is taken only where the key block keeps its size
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", target)
    dt = nl.float32 if dtype == "float32" else nl.bfloat16
    cfg = config(nheads=group, d=d, sq=s, dtype=dt, causal=True, range_select=target != "trn1")
    assert cfg.exp_lead in (fwd.EXP_LEAD, fwd.EXP_LEAD_MIN)
    e = 4 if dtype == "float32" else 2
    kb = {}
    for lead in (fwd.EXP_LEAD_MIN, fwd.EXP_LEAD):
        cfg.exp_lead = lead
        cfg.fin_delay = fwd.FIN_DELAY_MIN
        kb[lead] = fwd._kb_tiles(cfg, e, 4)
    want = fwd.EXP_LEAD if kb[fwd.EXP_LEAD] >= kb[fwd.EXP_LEAD_MIN] else fwd.EXP_LEAD_MIN
    assert config(nheads=group, d=d, sq=s, dtype=dt, causal=True, range_select=target != "trn1").exp_lead == want


# ----------------------------------------------------------------------------------------------- traces (structure)
def test_transfers_once_per_head_and_slab():
    # 4 query heads / 1 kv head, 1024 queries, d 256 (two partition tiles), bf16, causal, sinks: balanced slabs
    q, k, v = make_qkv(nheads=4, nheads_kv=1, d=256, sq=1024, dtype=torch.bfloat16, seed=30)
    cfg = config(nheads=4, d=256, sq=1024, causal=True, sinks=1)
    n_sec = cfg.n_qt // cfg.slab_tiles
    assert n_sec * cfg.slab_tiles == cfg.n_qt
    _, rec = traced(q, k, v, sinks_ref=torch.zeros(1, 4), use_causal_mask=True)
    # Q: one DMA per (head, d tile, slab); a group of one head, or (here) head dims > 128, loads the first
    # slab's first block's tiles apart
    split = 1 if cfg.slab_tiles > 2 else 0
    assert len(dmas(rec, src="arg0")) == 4 * 2 * (n_sec + split)
    # O and LSE: one store per (head, d tile) / head and slab; the last slab stores its earlier blocks early only
    # when its last block (query tiles 6, 7: 7 and 8 visible 128-key chunks per head) scores at least twice the O
    # elements that store moves
    done = cfg.slab_tiles - 2
    early = 0 < done and 4 * (7 + 8) * 128 >= fwd.EARLY_STORE_RATIO * done * 4 * 256
    stores = n_sec + (1 if early else 0)
    assert len(dmas(rec, dst_hbm_dtype="bfloat16")) == 4 * 2 * stores
    lse = dmas(rec, dst_hbm_dtype="float32")
    assert len(lse) == 4 * stores and sum(r.dst.shape[1] for r in lse) == 4 * cfg.n_qt
    assert all(r.dst.shape == (128, cfg.slab_tiles) for r in lse[:4 * (n_sec - 1)])  # LSE: per head, slab
    assert len(dmas(rec, src="arg3")) == 1  # the sinks: once per kv head
    # K and V: one DMA per (block, key block, d tile); blocks of 2 query tiles x 4 heads, one key block each
    blocks = n_members_blocks(cfg)
    assert len(blocks) == 4
    n_kb = sum(len(fwd._key_blocks(cfg, [t0 + j // 4 for j in range(j0, j1)])) for t0, j0, j1 in blocks)
    assert len(dmas(rec, src="arg1")) == n_kb * 2
    # V: one DMA per d tile, or (d_v > 128, the work item's V^T past the SBUF) one load of its V^T from the work
    # item's HBM scratch, or none when the unit before holds the same chunks' V^T (``_plan_vt``)
    vt_loads = [r for r in rec if r.instr == "dma_copy" and r.srcs[0].buffer == "hbm" and len(r.srcs[0].shape) == 3]
    slabs = [(t0, min(t0 + cfg.slab_tiles, cfg.n_qt)) for t0 in range(0, cfg.n_qt, cfg.slab_tiles)]
    units = fwd._plan_units(cfg, 0, 1, slabs)
    shared = sum(1 for u in units if u.vt_prev is not None)
    assert cfg.vt_scratch and len(vt_loads) == sum(1 for u in units if u.vt_load)
    assert len(dmas(rec, src="arg2")) + 2 * len(vt_loads) + 2 * shared == n_kb * 2


def test_transfers_with_several_slabs(monkeypatch):
    # trn1, float32, d 256, 8 query heads per kv head: the budget leaves room for less than a head per slab
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn1")
    cfg = config(nheads=8, d=256, sq=1024, dtype=nl.float32, causal=True, packing=True, sinks=2,
                 range_select=False)
    assert cfg.slab_tiles < cfg.n_qt and cfg.n_qt % cfg.slab_tiles == 0
    q, k, v = make_qkv(nheads=8, d=256, sq=1024, seed=31)
    bmin, bmax = packing_bounds([0, 300, 700, 1024])
    sinks = torch.randn(1, 8, 2, generator=torch.Generator().manual_seed(32))
    with recording() as rec:
        run_and_check(q, k, v, sinks=sinks, bound_min=bmin, bound_max=bmax, causal=True)
    n_sec = cfg.n_qt // cfg.slab_tiles
    stats = sim.last_launch_stats()
    assert stats.peak_sbuf_bytes <= stats.sbuf_capacity_bytes  # (capacity checking raises anyway)
    assert len(dmas(rec.records, src="arg0")) == 8 * 2 * n_sec
    assert len(dmas(rec.records, dst_hbm_dtype="float32")) == 8 * 2 * n_sec + 8 * n_sec  # O (float32) + LSE


def test_statistics_batched_per_block():
    # trn2, no sinks, no packing: per block one reciprocal and two selects (finishing), per (block, key block)
    # one max reduction and one sum reduction, each on the [128, members] columns of the whole block
    q, k, v = make_qkv(nheads=2, nheads_kv=1, d=64, sq=2560, dtype=torch.bfloat16, seed=33)
    cfg = config(nheads=2, d=64, sq=2560, causal=True)
    _, rec = traced(q, k, v, use_causal_mask=True)
    blocks = n_members_blocks(cfg)
    widths = []
    n_kb = 0
    for t0, j0, j1 in blocks:
        tiles = [t0 + j // 2 for j in range(j0, j1)]
        n_kb += len(fwd._key_blocks(cfg, tiles))
        widths.append(j1 - j0)
    recips = [r for r in rec if r.instr == "reciprocal"]
    # one per block, over all its members (the pipeline's last block finishes its statistics before the block
    # ahead of it, whose finishing waits FIN_DELAY steps)
    assert sorted(r.dst.shape[1] for r in recips) == sorted(widths)
    assert sum(1 for r in rec if r.instr == "select_reduce") == 2 * len(blocks)
    reduces = [r for r in rec if r.instr == "tensor_reduce"]
    assert len(reduces) == 2 * n_kb
    assert all(r.srcs[0].shape[2] == cfg.kb_tiles + 1 for r in reduces)  # tile maxima / sums + running value
    # one online-softmax rescale of O per member and key block after its first; PV accumulated over a key block
    o_updates = sum(1 for r in rec if r.instr == "scalar_tensor_tensor")
    want = 0
    for t0, j0, j1 in blocks:
        for j in range(j0, j1):
            want += len(fwd._key_blocks(cfg, [t0 + j // 2])) - 1
    assert o_updates == want > 0


@pytest.mark.parametrize("nheads,sq,d,causal,early", [
    (1, 512, 128, True, False), (2, 1024, 128, False, False),  # one and two units: nothing in flight
    (4, 2048, 128, True, True),  # shape (a): 12 units, the last one's PVs 60 chunks x 128 columns
    (1, 1536, 128, True, False),  # 3 units, the last one a causal diagonal of 10 chunks
    (2, 2048, 64, False, False),  # 8 units, the last one full (64 chunks) but d_v 64
    (8, 1024, 64, True, True),  # 8 units, light, but its block's only one
    (2, 2048, 256, True, True),  # 10 units, light, but head dims > 128 (one-tile key blocks) keep the step
])
def test_last_block_statistics_early_only_before_enough_pv_work(nheads, sq, d, causal, early):
    # the pipeline's last block takes its statistics (its reciprocal) before its last PV matmuls only in a launch
    # of more than STATS_EARLY_MIN_UNITS units whose last unit is its block's only one, has a head dim > 128 or PVs
    # moving at least STATS_EARLY_PV_COLUMNS columns; with less the last PVs would wait behind the statistics
    q, k, v = make_qkv(nheads=nheads, nheads_kv=1, d=d, sq=sq, dtype=torch.bfloat16, seed=34)
    _, rec = traced(q, k, v, use_causal_mask=causal)
    instrs = [r.instr for r in rec]
    last_recip = max(i for i, n in enumerate(instrs) if n == "reciprocal")
    last_mm = max(i for i, n in enumerate(instrs) if n == "nc_matmul")
    assert (last_recip < last_mm) == early


# ----------------------------------------------------------------------------------------------- edges (numbers)
@pytest.mark.parametrize("nheads", [3, 5, 16])
def test_gqa_groups_and_sinks_at_block_edges(nheads):
    # 3: blocks of 2 query tiles x 3 heads; 5: one query tile per block; 16: two blocks inside each query tile.
    # Per-head sink statistics are spread over the members of each block.
    q, k, v = make_qkv(nheads=nheads, nheads_kv=1, d=64, sq=384, seed=40 + nheads)
    sinks = torch.randn(1, nheads, generator=torch.Generator().manual_seed(41)) * 2.0
    run_and_check(q, k, v, sinks=sinks, causal=True, window=200)


@pytest.mark.parametrize("mixed", [True, False])
def test_several_key_blocks_rescale_o(mixed):
    # 2688 keys: key blocks of 2048 + 640 keys; the second rescales O and l from the first (bf16 accumulator when
    # unmixed), the last key block is partial
    q, k, v = make_qkv(nheads=2, nheads_kv=1, d=64, sq=256, sk=2688, dtype=torch.bfloat16, seed=42)
    run_and_check(q, k, v, mixed=mixed)


def test_window_across_a_key_block_boundary():
    q, k, v = make_qkv(nheads=2, nheads_kv=1, d=64, sq=2560, seed=43)
    run_and_check(q, k, v, causal=True, window=300)


@pytest.mark.parametrize("scale", [None, 2.5])
def test_rows_masked_in_a_whole_key_block_then_visible(scale):
    # sequence 2 (queries 2200..2559) sees nothing in key block 0: its statistics hold only masked scores until
    # key block 1 (alpha = 0 wipes them); rows 2500.. see no key at all (o = 0, lse = +inf)
    bmin, bmax = packing_bounds([0, 2200, 2500], seqlen_q=2560)
    q, k, v = make_qkv(nheads=1, d=64, sq=2560, seed=44)
    o, lse, _, lse_ref = run_and_check(q, k, v, bound_min=bmin, bound_max=bmax, scale=scale)
    assert torch.isinf(lse).sum() == 60 and torch.isinf(lse_ref).sum() == 60


def test_trn1_fallbacks_match_trn2_across_key_blocks(monkeypatch):
    bmin, bmax = packing_bounds([0, 1500, 2600, 3000], seqlen_q=3072)
    q, k, v = make_qkv(nheads=2, nheads_kv=1, d=64, sq=3072, seed=45)
    out = {}
    for target in ("trn1", "trn2"):
        monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", target)
        out[target] = attention_fwd(q, k, v, bound_min=bmin, bound_max=bmax, use_causal_mask=True,
                                    sliding_window=700)
    assert torch.equal(out["trn1"][0], out["trn2"][0]) and torch.equal(out["trn1"][1], out["trn2"][1])


def test_minus_inf_sinks_equal_no_sinks_across_blocks():
    q, k, v = make_qkv(nheads=3, nheads_kv=1, d=64, sq=2560, seed=46)
    o0, l0 = attention_fwd(q, k, v, use_causal_mask=True, sliding_window=900)
    o1, l1 = attention_fwd(q, k, v, sinks_ref=torch.full((1, 3, 2), -math.inf), use_causal_mask=True,
                           sliding_window=900)
    assert torch.equal(o0, o1) and torch.equal(l0, l1)


@pytest.mark.parametrize("scale", [0.3, 2.5])
def test_scale_in_exponent_across_blocks(scale):
    # the scale in the float32 exponent (statistics in raw members, sinks divided by the scale, the bias capped
    # for scale > 1) with packing, sinks and a window across key blocks: the same criterion
    bmin, bmax = packing_bounds([0, 100, 333, 450], seqlen_q=512)
    sinks = torch.tensor([[0.4, -math.inf], [-1.0, 2.0]]).reshape(1, 2, 2)
    run_and_check(*make_qkv(nheads=2, nheads_kv=1, sq=512, seed=47), sinks=sinks, bound_min=bmin,
                  bound_max=bmax, causal=True, window=150, scale=scale)
    run_and_check(*make_qkv(nheads=2, nheads_kv=1, sq=384, dtype=torch.bfloat16, seed=48), causal=True,
                  scale=scale)


def test_v_transposed_once_per_work_item():
    # one head, 4096 keys, d 64, non-causal: four blocks of 8 query tiles each read every key. V^T is kept for
    # the work item: each 128-key chunk is loaded and transposed once, not once per block
    q, k, v = make_qkv(nheads=1, nheads_kv=1, d=64, sq=4096, dtype=torch.bfloat16, seed=32)
    cfg = config(nheads=1, d=64, sq=4096)
    assert cfg.vt_cache and cfg.n_qt // cfg.members == 4
    _, rec = traced(q, k, v)
    v_loads = dmas(rec, src="arg2")
    assert sum(r.dst.shape[1] for r in v_loads) == 4096
    vt = [r for r in rec if r.instr == "nc_transpose" and r.srcs[0].shape == (64, 128)]
    assert len(vt) == 4096 // 128
    # a work item of one block has nothing to share: V^T per unit, as before
    small = config(nheads=1, d=64, sq=1024)
    assert small.n_qt <= small.members and not small.vt_cache


def test_window_keeps_its_v_transposes_per_chunk_at_any_length():
    # causal, window 512, d 128, one head: the work item's V^T store is a ring of the chunks the band keeps in
    # flight, so it is taken at 8192 tokens as at 4096 (sized by seqlen_k it did not fit at 8192, where every unit
    # transposed its V again): each 128-key chunk loaded and transposed once, and the instruction count grows
    # with the length (the docs' window figure, target 2.1)
    counts = {}
    for s in (4096, 8192):
        cfg = config(nheads=1, d=128, sq=s, causal=True, window=512)
        assert cfg.vt_cache and cfg.vt_ring < s // 128
        q, k, v = make_qkv(nheads=1, nheads_kv=1, d=128, sq=s, dtype=torch.bfloat16, seed=36)
        _, rec = traced(q, k, v, use_causal_mask=True, sliding_window=512)
        assert sum(r.dst.shape[1] for r in dmas(rec, src="arg2")) == s  # V of each key once
        counts[s] = len(rec)
    assert counts[8192] <= 2.1 * counts[4096]


def test_ring_claims_transpose_an_evicted_chunk_again():
    # the ring's trace-time bookkeeping: a slot holds one chunk; a chunk whose slot another took is claimed (and
    # so loaded and transposed) again
    done = [-1] * 8
    assert fwd._claim_chunks(done, 0, 6) == [0, 1, 2, 3, 4, 5]
    assert fwd._claim_chunks(done, 4, 10) == [6, 7, 8, 9]  # 8 and 9 take the slots of 0 and 1
    assert fwd._claim_chunks(done, 0, 4) == [0, 1]  # 2 and 3 are still held
    assert done == [0, 1, 2, 3, 4, 5, 6, 7]


def test_ring_slots_reused_give_the_per_unit_result():
    # 4096 keys, window 256, key blocks of 2 tiles: the ring holds 24 of the 32 chunks, so slots are reused (each
    # chunk still transposed once); a deeper PV lag leaves no room for a store (V^T per unit, transposed again by
    # every unit). Moving V^T changes no arithmetic: bit for bit the same, and the golden's criterion
    q, k, v = make_qkv(nheads=1, nheads_kv=1, d=64, sq=4096, dtype=torch.bfloat16, seed=37)
    shp = attention_shape(np.zeros((1, 1, 64, 4096), np.float32), np.zeros((1, 1, 64, 4096), np.float32),
                          use_causal_mask=True, sliding_window=256)
    ring = fwd._FwdConfig(shp, nl.bfloat16, nl.float32, True, kb_tiles=2)
    per_unit = fwd._FwdConfig(shp, nl.bfloat16, nl.float32, True, kb_tiles=2, pv_lag=64)
    assert ring.vt_cache and ring.vt_ring < 32 and not per_unit.vt_cache
    out = {}
    for lag in (None, 64):
        (o, lse), rec = traced(q, k, v, use_causal_mask=True, sliding_window=256, kb_tiles=2, pv_lag=lag)
        out[lag] = (o, lse, sum(1 for r in rec if r.instr == "nc_transpose" and r.srcs[0].shape == (64, 128)))
    assert out[None][2] == 32 < out[64][2]
    assert torch.equal(out[None][0], out[64][0]) and torch.equal(out[None][1], out[64][1])
    check_fwd_outputs(out[None][0], out[None][1], q, k, v, None, True,
                      dict(bound_min=None, bound_max=None, use_causal_mask=True, softmax_scale=None,
                           sliding_window=256))


def test_first_loads_split_and_last_slab_stored_early():
    # one head, 4096 queries and keys, d 64, non-causal: slabs of 8-tile blocks, whole 512-key tiles. The
    # pipeline's first unit loads the first block's Q (a group of one head) and its first key tile's K apart, so
    # the first scores wait for less; the last block scores 8 x 4096 keys per row, far more than twice the O
    # elements of the last slab's earlier blocks, so those are stored as soon as they finish and only the last
    # block's O and LSE after the pipeline's end
    q, k, v = make_qkv(nheads=1, nheads_kv=1, d=64, sq=4096, dtype=torch.bfloat16, seed=31)
    cfg = config(nheads=1, d=64, sq=4096)
    assert cfg.members == 8 and cfg.slab_tiles % 8 == 0 and cfg.slab_tiles > 8
    n_sec = cfg.n_qt // cfg.slab_tiles
    o, rec = traced(q, k, v)
    q_loads = dmas(rec, src="arg0")
    assert len(q_loads) == n_sec + 1
    assert q_loads[0].dst.shape == (64, 8 * 128)  # the first block's query tiles
    assert q_loads[1].dst.shape == (64, (cfg.slab_tiles - 8) * 128)
    k_loads = dmas(rec, src="arg1")
    assert k_loads[0].dst.shape == (64, 512)  # the first unit's first key tile
    assert sum(r.dst.shape[1] for r in k_loads[:2]) == cfg.kb_tiles * 512
    o_stores = dmas(rec, dst_hbm_dtype="bfloat16")
    assert len(o_stores) == n_sec + 1
    assert o_stores[-2].dst.shape == (64, (cfg.slab_tiles - 8) * 128) and o_stores[-1].dst.shape == (64, 8 * 128)
    # the early store comes before the last block's last exponent
    order = {id(r): n for n, r in enumerate(rec)}
    last_exp = max(n for n, r in enumerate(rec) if r.instr == "activation" and r.dst.shape[-1] == 512)
    assert order[id(o_stores[-2])] < last_exp < order[id(o_stores[-1])]
    want, _ = attention_fwd(q, k, v)  # untraced: the same result
    assert torch.equal(o[0], want)


@pytest.mark.parametrize("target,dtype,want_dma", [("trn2", torch.bfloat16, True), ("trn3", torch.float16, True),
                                                   ("trn2", torch.float32, False), ("trn1", torch.bfloat16, False)])
def test_p_transposes_split_between_tensor_engine_and_dma(monkeypatch, target, dtype, want_dma):
    # 2 heads x 8 query tiles, 1024 keys non-causal: every (member, key tile) is a full 512-key tile; on trn2+
    # with 16-bit P every P_DMA_PERIOD-th member has its full tiles of a key block transposed by DMA, consecutive
    # such members of a block sharing ONE dma_transpose of up to P_DMA_BATCH_TILES tiles (or a key block's), the
    # rest by 4 TensorE transposes per tile; the pipeline's last unit transposes all of its tiles on TensorE
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", target)
    q, k, v = make_qkv(nheads=2, nheads_kv=1, d=64, sq=1024, dtype=dtype, seed=50)
    _, rec = traced(q, k, v)
    n_tiles = 16 * 2
    by_dma = [r for r in rec if r.instr == "dma_transpose"]
    p_transposes = [r for r in rec if r.instr == "nc_transpose" and r.dst.shape == (128, 128) and
                    r.srcs[0].shape == (128, 128) and r.dst.dtype == str(dtype).split(".")[1]]
    cfg = config(nheads=2, d=64, sq=1024, dtype=nl.bfloat16)
    per_member = math.ceil(2 / cfg.kb_tiles)  # key blocks per member: 1024 keys are 2 key tiles
    if want_dma:
        batch = max(cfg.kb_tiles, fwd.P_DMA_BATCH_TILES)
        # 8 members per unit, whole batches; the pipeline's last unit (its drain) has none by DMA
        dma_tiles = 8 * (2 * per_member - 1) // fwd.P_DMA_PERIOD * cfg.kb_tiles
        assert dma_tiles > 0
        assert len(by_dma) == dma_tiles // batch
        assert all(r.srcs[0].buffer == "sbuf" and r.dst.shape == (128, 4 * batch, 128) for r in by_dma)
    else:
        assert not by_dma
    n_by_dma = sum(r.dst.shape[1] // 4 for r in by_dma)
    assert len(p_transposes) == 4 * (n_tiles - n_by_dma)


# ----------------------------------------------------------------------------------------------- tuning keywords
def test_tuning_keywords_change_the_plan_not_the_result():
    """kb_tiles, block_members_max and slab_tiles reach the config (the plan and the instruction stream change)
    and leave the result equal to the default launch's up to float32 summation order (the online softmax
    rescales at other key-block boundaries); invalid values fail the kernel's assert naming the keyword."""
    q, k, v = make_qkv(nheads=4, nheads_kv=1, d=64, sq=1024, seed=60)
    (o0, l0), rec0 = traced(q, k, v, use_causal_mask=True)
    kb0 = config(nheads=4, d=64, sq=1024, causal=True, dtype=nl.float32).kb_tiles
    for kw in (dict(kb_tiles=2 if kb0 == 1 else 1), dict(block_members_max=2), dict(slab_tiles=3)):
        (o1, l1), rec1 = traced(q, k, v, use_causal_mask=True, **kw)
        assert len(rec1) != len(rec0), kw
        np.testing.assert_allclose(np.asarray(o1), np.asarray(o0), rtol=0, atol=1e-6)
        np.testing.assert_allclose(np.asarray(l1), np.asarray(l0), rtol=0, atol=1e-5)
    cfg = fwd._setup_config(q, k, v, None, None, True, True, None, None, None, 0.0, 2, 3, 1)
    assert (cfg.kb_tiles, cfg.block_members_max, cfg.members, cfg.slab_tiles) == (2, 3, 3, 1)
    for name, bad in (("kb_tiles", 0), ("block_members_max", True), ("slab_tiles", 1.5)):
        with pytest.raises(AssertionError, match=rf"{name}={bad!r} must be None \(the default\) or an int >= 1"):
            attention_fwd(q, k, v, **{name: bad})


# ----------------------------------------------------------------------------------------------- V^T scratch (d_v > 128)
@pytest.mark.parametrize("case", [dict(causal=True, sq=2048, nheads=2),
                                  dict(causal=True, sq=1536, sk=2560, nheads=4, window=700, sinks=1),
                                  dict(causal=False, sq=1024, sk=3072, nheads=2, d_v=200),
                                  dict(causal=True, sq=2048, nheads=2, packing=True)])
def test_wide_v_transposed_once_per_chunk_through_the_scratch(case):
    # d_v > 128: a chunk's V^T is transposed once per work item and parked in private HBM; a unit three or more
    # behind the one that stored it loads it from there instead of V. The transposes are exact, so the result
    # is the TensorE-only path's bit for bit, with fewer V loads and V^T transposes, and within the project's
    # criterion of the golden.
    d_v = case.get("d_v", 256)
    sq = case["sq"]
    sk = case.get("sk", sq)
    nheads = case["nheads"]
    q, k, v = make_qkv(nheads=nheads, nheads_kv=1, d=256, sq=sq, sk=sk, dtype=torch.bfloat16, seed=70)
    v = v[:, :, :d_v].contiguous()
    opts = dict(bound_min=None, bound_max=None, use_causal_mask=case["causal"], softmax_scale=None,
                sliding_window=case.get("window"))
    if case.get("packing"):
        opts["bound_min"], opts["bound_max"] = packing_bounds([0, 700, 1300, sq])
    sinks = None
    if case.get("sinks"):
        sinks = torch.randn(1, nheads, generator=torch.Generator().manual_seed(71))
    runs = {}
    for cache in (False, True):
        with recording() as rec:
            o, lse = attention_fwd(q, k, v, sinks_ref=sinks, vt_scratch=cache, **opts)
        stores = [r for r in rec.records if r.instr == "dma_copy" and r.dst.buffer == "hbm"
                  and len(r.dst.shape) == 3]
        transposes = sum(1 for r in rec.records if r.instr == "nc_transpose")
        runs[cache] = (o, lse, len(dmas(rec.records, src="arg2")), len(stores), transposes)
    (o0, l0, v0, s0, t0), (o1, l1, v1, s1, t1) = runs[False], runs[True]
    assert torch.equal(o0, o1) and torch.equal(l0, l1)
    assert s0 == 0 < s1  # V^T stored only with the scratch
    assert v1 < v0  # some units load V^T instead of V
    n_vt = 2  # V^T transposes per chunk (d_v tiles of 128 + remainder)
    assert t1 < t0 and (t0 - t1) % n_vt == 0
    check_fwd_outputs(o1, l1, q, k, v, sinks, True, opts)
