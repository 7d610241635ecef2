"""The XLA ring communicator's pairing logic as pure functions (runs without torch-xla): the pairs of each
``collective_permute``, how sends meet their receives, and a simulated multi-rank ring built on them."""
import pytest
import torch

from nki_attn.distributed.comm import XlaRingComm, match_transfers, ring_pairs


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("offset", [1, -1, 2, -3])
def test_ring_pairs_is_a_shift_permutation(size, offset):
    pairs = ring_pairs(size, offset)
    assert sorted(s for s, _ in pairs) == list(range(size))
    assert sorted(d for _, d in pairs) == list(range(size))  # every rank receives exactly once
    assert all((d - s - offset) % size == 0 for s, d in pairs)
    back = dict(ring_pairs(size, -offset))
    assert all(back[d] == s for s, d in pairs)  # the reverse shift brings every message home


def test_ring_pairs_rejects_bad_arguments():
    with pytest.raises(ValueError, match="size=0"):
        ring_pairs(0, 1)
    with pytest.raises(TypeError, match="offset"):
        ring_pairs(4, 1.0)


def test_match_transfers_pairs_by_tag_and_opposite_offset():
    a, b, ba, bb = torch.zeros(2), torch.ones(3), torch.empty(2), torch.empty(3)
    got = match_transfers([(a, 1, 11), (b, -1, 12)], [(bb, 1, 12), (ba, -1, 11)])
    assert [(t is x, buf is y, off) for (t, buf, off), (x, y) in zip(got, [(a, ba), (b, bb)])] == \
        [(True, True, 1), (True, True, -1)]


@pytest.mark.parametrize("sends,recvs,match", [
    ([(torch.zeros(2), 1, 11)], [], "no receive"),
    ([(torch.zeros(2), 1, 11)], [(torch.empty(2), 1, 11)], "no receive"),  # same direction: not a partner
    ([(torch.zeros(2), 1, 11)], [(torch.empty(2), -1, 12)], "no receive"),
    ([], [(torch.empty(2), -1, 11)], "no matching send"),
    ([(torch.zeros(2), 1, 11)], [(torch.empty(3), -1, 11)], "must match"),
])
def test_match_transfers_rejects_unpaired(sends, recvs, match):
    with pytest.raises(ValueError, match=match):
        match_transfers(sends, recvs)


class _World:
    """R simulated devices; each rank's ``collective_permute`` call is recorded, and when all R ranks have
    made their k-th call the data moves by its pairs (what XLA does when every rank joins the collective)."""

    def __init__(self, size):
        self.size, self.calls = size, [[] for _ in range(size)]

    def xm_for(self, rank):
        world = self

        class _XM:
            @staticmethod
            def collective_permute(t, pairs):
                world.calls[rank].append((t.clone(), pairs))
                return torch.full_like(t, float("nan"))  # filled in by deliver()
        return _XM

    def comm(self, rank):
        c = XlaRingComm.__new__(XlaRingComm)
        c._xm, c.group, c.rank, c.size, c.bytes_sent, c.permutes = self.xm_for(rank), None, rank, self.size, 0, 0
        return c


@pytest.mark.parametrize("size", [2, 3, 4])
def test_simulated_ring_circulates_every_shard(size):
    """K/V shards going around the ring (+1 per step, as the ring's forward does) and partial sums going back
    (-1, as dK/dV do): each step is one collective per direction with the same pairs on every rank, and after
    size - 1 steps every rank has seen every shard exactly once."""
    world = _World(size)
    comms = [world.comm(r) for r in range(size)]
    cur = [torch.full((2,), float(r)) for r in range(size)]
    seen = [[r] for r in range(size)]
    for _ in range(size - 1):
        bufs = [torch.empty(2) for _ in range(size)]
        for r in range(size):
            comms[r].start([(cur[r], 1, 11)], [(bufs[r], -1, 11)])
        # every rank issued the same collective: same pairs, in the same order
        assert len({tuple(world.calls[r][-1][1]) for r in range(size)}) == 1
        sent = {r: world.calls[r][-1][0] for r in range(size)}
        for src, dst in world.calls[0][-1][1]:
            bufs[dst].copy_(sent[src])
        cur = bufs
        for r in range(size):
            seen[r].append(int(cur[r][0]))
    assert all(sorted(s) == list(range(size)) for s in seen)
    assert [c.permutes for c in comms] == [size - 1] * size
    assert world.calls[0][0][1] == ring_pairs(size, 1)
    # the backward's partial sums travel the other way: one collective with the reversed pairs
    comms[0].start([(torch.zeros(2), -1, 14)], [(torch.empty(2), 1, 14)])
    assert world.calls[0][-1][1] == ring_pairs(size, -1)
