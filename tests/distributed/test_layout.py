"""Geometry of ring attention in one process: shards, block masks as key intervals, kernel-call plans, the
ring's travel, work balance, shard/unshard helpers, the LSE merge, and the local launcher's failure modes."""
import math
import random

import pytest
import torch

from nki_attn.distributed import (format_work_balance, ring_flash_attn_func, ring_shard, ring_unshard, run_local,
                                  work_balance_report, zigzag_shard, zigzag_unshard)
from nki_attn.distributed.layout import (Shard, key_intervals, plan_schedule, ring_layout,
                                         work_balance, zigzag_layout)
from nki_attn.distributed.ring import _merge

PMAX = 128


def truth_mask(qs, ks, left, right):
    """bool [nq, nk]: query i of qs sees key j of ks, from global positions."""
    i = qs.positions()[:, None]
    j = ks.positions()[None, :]
    m = torch.ones(i.shape[0], j.shape[1], dtype=torch.bool)
    if left >= 0:
        m &= j >= i - left
    if right >= 0:
        m &= j <= i + right
    return m


def plan_mask(plans, nq, nk, q_pad, k_pad):
    """bool [q_pad, k_pad] of what the kernel calls compute as visible, and the count of calls per pair."""
    cover = torch.zeros(q_pad, k_pad, dtype=torch.int64)
    for p in plans:
        (r0, r1), (k0, k1) = p.rows, p.keys
        t = torch.arange(r1 - r0)[:, None]
        j = torch.arange(k1 - k0)[None, :]
        if p.kind == "full":
            m = torch.ones(r1 - r0, k1 - k0, dtype=torch.bool)
        elif p.kind == "causal":
            m = j <= t
            if p.window:
                m &= j >= t - p.window + 1
        else:
            m = (j >= p.bound_min[:, None]) & (j < p.bound_max[:, None])
        cover[r0:r1, k0:k1] += m.long()
    return cover


LAYOUTS = [
    ("ring-even", ring_layout([256, 256, 256, 256])),
    ("ring-uneven", ring_layout([200, 312, 1, 130])),
    ("zigzag-aligned", zigzag_layout(1024, 4)),
    ("zigzag-odd", zigzag_layout(1000, 3)),
    ("zigzag-small", zigzag_layout(512, 4)),
]
WINDOWS = [(-1, 0), (-1, -1), (100, 0), (0, 0), (300, 0), (60, 70), (0, 50), (-1, 40), (129, 200)]


@pytest.mark.parametrize("name,shards", LAYOUTS, ids=[n for n, _ in LAYOUTS])
@pytest.mark.parametrize("left,right", WINDOWS)
def test_plans_cover_exactly_the_mask(name, shards, left, right):
    """Every visible (query, key) pair of every block pair is computed by exactly one kernel call, no masked
    pair is, padded keys are never visible to a real query, and fully masked pairs make no call."""
    sched = plan_schedule(shards, left, right)
    for r, qs in enumerate(shards):
        for s, ks in enumerate(shards):
            plans = sched.blocks[r][s]
            truth = truth_mask(qs, ks, left, right)
            if not bool(truth.any()):
                assert plans == ()
                continue
            cover = plan_mask(plans, qs.length, ks.length, sched.q_pad[r], sched.kv_pad)
            real = cover[:qs.length]
            assert bool((real[:, :ks.length] == truth.long()).all()), (r, s, [p.kind for p in plans])
            assert int(real[:, ks.length:].sum()) == 0  # padded keys
            for p in plans:
                assert p.rows[0] % PMAX == 0 and p.rows[1] % PMAX == 0 and p.keys[0] % PMAX == 0
                assert p.keys[1] % PMAX == 0 and p.rows[1] <= sched.q_pad[r] and p.keys[1] <= sched.kv_pad
            assert sum(p.visible for p in plans) == int(truth.sum())


@pytest.mark.parametrize("name,shards", LAYOUTS, ids=[n for n, _ in LAYOUTS])
@pytest.mark.parametrize("left,right", WINDOWS)
def test_travel_reaches_every_needed_pair_once(name, shards, left, right):
    sched = plan_schedule(shards, left, right)
    R = len(shards)
    assert sched.forward + sched.backward <= R - 1  # no source is visited twice
    for r in range(R):
        visited = [src for step in range(sched.steps) for _, src in sched.sources(r, step)]
        assert len(visited) == len(set(visited))
        for s in range(R):
            if sched.blocks[r][s]:
                assert s in visited, (r, s, sched.forward, sched.backward)


def test_windows_shorten_the_ring():
    even = ring_layout([256] * 8)
    assert (plan_schedule(even, -1, 0).forward, plan_schedule(even, -1, 0).backward) == (7, 0)  # classic
    assert (plan_schedule(even, -1, -1).forward, plan_schedule(even, -1, -1).backward) == (7, 0)
    s = plan_schedule(even, 100, 0)  # causal window shorter than a shard: one hop
    assert (s.forward, s.backward) == (1, 0)
    s = plan_schedule(even, 300, 0)  # reaches two shards back
    assert (s.forward, s.backward) == (2, 0)
    s = plan_schedule(even, 60, 70)  # both sides: one hop each way instead of 7 forward
    assert (s.forward, s.backward) == (1, 1)
    s = plan_schedule(zigzag_layout(4096, 8), 100, 0)  # zigzag: the late chunk's neighbour is on rank r + 1
    assert (s.forward, s.backward) == (1, 1)


def test_native_masks_where_possible():
    """The diagonal block is the kernels' native causal mask (tile skipping); fully visible blocks have no
    mask; only partial off-diagonal blocks need bounds, cropped to the rows and keys that see anything."""
    shards = ring_layout([512] * 4)
    sched = plan_schedule(shards, 100, 0)
    (diag,) = sched.blocks[2][2]
    assert diag.kind == "causal" and diag.window == 101 and diag.rows == (0, 512)
    (prev,) = sched.blocks[2][1]
    assert prev.kind == "bounds" and prev.rows == (0, 128) and prev.keys == (384, 512)
    full = plan_schedule(shards, -1, 0)
    assert full.blocks[3][0][0].kind == "full" and full.blocks[0][3] == ()
    zz = plan_schedule(zigzag_layout(4096, 4), -1, 0)
    for r in range(4):
        kinds = sorted(p.kind for pair in zz.blocks[r] for p in pair)
        assert kinds == ["causal", "full", "full", "full"]  # ring-flash-attn's zigzag: diagonal + 3 half blocks


def test_key_intervals_against_positions():
    rng = random.Random(0)
    for _ in range(50):
        def shard():
            starts = sorted(rng.sample(range(0, 400), 3))
            chunks, end = [], 0
            for s in starts:
                s = max(s, end)
                n = rng.randint(0, 40)
                chunks.append((s, n))
                end = s + n
            return Shard(tuple(chunks))
        qs, ks = shard(), shard()
        left, right = rng.choice([-1, 0, 5, 60]), rng.choice([-1, 0, 7, 90])
        lo, hi = key_intervals(qs, ks, left, right)
        m = truth_mask(qs, ks, left, right)
        j = torch.arange(ks.length)[None, :]
        assert bool(((j >= lo[:, None]) & (j < hi[:, None]) == m).all())


def test_shard_rejects_unordered_chunks():
    with pytest.raises(ValueError, match="increasing"):
        Shard(((100, 10), (0, 10)))


def test_work_balance():
    rep = work_balance_report(8192, 4, causal=True)
    total = 8192 * 8193 // 2
    for rows in rep.values():
        assert sum(x["visible"] for x in rows) == total
    assert rep["zigzag"][0]["imbalance"] == 1.0
    assert len({x["tiles"] for x in rep["zigzag"]}) == 1
    ring = [x["tiles"] for x in rep["ring"]]
    assert ring == sorted(ring) and rep["ring"][0]["imbalance"] > 1.5  # rank R-1 does most of the work
    text = format_work_balance(rep)
    assert "zigzag" in text and "max/mean" in text
    # without a causal mask both layouts are balanced
    full = work_balance_report(4096, 4, causal=False)
    assert full["ring"][0]["imbalance"] == 1.0 and full["zigzag"][0]["imbalance"] == 1.0
    assert work_balance(ring_layout([100]))[0]["blocks"] == 1


@pytest.mark.parametrize("S,R", [(1024, 4), (1000, 3), (7, 3)])
def test_shard_roundtrips(S, R):
    x = torch.arange(2 * S * 3).reshape(2, S, 3)
    parts = [ring_shard(x, r, R) for r in range(R)]
    assert torch.equal(ring_unshard(parts), x)
    if S >= 2 * R:
        z = [zigzag_shard(x, r, R) for r in range(R)]
        assert torch.equal(zigzag_unshard(z), x)
        lse = x.transpose(1, 2)
        assert torch.equal(zigzag_unshard([zigzag_shard(lse, r, R, dim=2) for r in range(R)], dim=2), lse)
        # rank r holds chunks r and 2R-1-r
        chunks = torch.tensor_split(x, 2 * R, 1)
        assert torch.equal(z[0], torch.cat([chunks[0], chunks[-1]], 1))


def test_shard_errors():
    x = torch.zeros(1, 5, 2)
    with pytest.raises(ValueError, match="2 \\* world_size"):
        zigzag_shard(x, 0, 3)
    with pytest.raises(ValueError, match="rank"):
        ring_shard(x, 3, 3)
    with pytest.raises(ValueError, match="gives rank 0"):
        zigzag_unshard([torch.zeros(1, 3, 2), torch.zeros(1, 1, 2)])


def test_merge_empty_rows_never_nan():
    """A block whose row sees no key (lse +inf from the kernel) contributes nothing; two empty rows stay empty."""
    o = torch.zeros(1, 1, 2, 3)
    lse = torch.full((1, 1, 3), -math.inf)
    o_b = torch.tensor([[[[1.0, 2.0, 0.0], [3.0, 4.0, 0.0]]]])
    lse_b = torch.tensor([[[0.5, math.inf, math.inf]]])
    _merge(o, lse, o_b, lse_b)
    assert torch.equal(lse, torch.tensor([[[0.5, -math.inf, -math.inf]]]))
    assert torch.equal(o[..., 0], o_b[..., 0]) and not bool(o.isnan().any())
    _merge(o, lse, 3 * o_b, torch.tensor([[[0.5, 1.0, math.inf]]]))
    assert torch.allclose(o[..., 0], 2 * o_b[..., 0]) and torch.allclose(o[..., 1], 3 * o_b[..., 1])
    assert math.isclose(float(lse[0, 0, 0]), 0.5 + math.log(2), rel_tol=1e-6)
    assert not bool(o.isnan().any()) and float(lse[0, 0, 2]) == -math.inf


def test_needs_an_initialized_group():
    q = torch.zeros(1, 128, 2, 32)
    with pytest.raises(RuntimeError, match="init_process_group"):
        ring_flash_attn_func(q, q, q)


def _fails(rank, world_size):
    if rank == 1:
        raise KeyError("rank one broke")
    torch.distributed.barrier()  # rank 0 would wait here forever


def _sleeps(rank, world_size):
    import time
    time.sleep(120)


def test_run_local_reports_failures_and_timeouts():
    with pytest.raises(RuntimeError, match="rank 1 of 2 failed(.|\\n)*rank one broke"):
        run_local(_fails, 2, timeout=60)
    with pytest.raises(TimeoutError, match="killed"):
        run_local(_sleeps, 2, timeout=5)
