"""Point-to-point traffic of the ring on ``torch.distributed``: any process-group backend with isend / irecv.

Every transfer goes through ``torch.distributed.batch_isend_irecv`` (one call per exchange, all of its sends and
receives posted together and completed later), so the kernel call that follows overlaps the transfer on
backends that progress P2P in the background (gloo's worker threads here; NCCL-style streams elsewhere). Each
kind of message has its own tag and at most one message per (peer, tag) is ever in flight, so no backend has to
order messages for us.
"""
import torch
import torch.distributed as dist

__all__ = ["RingComm", "TAG_KV_FWD", "TAG_KV_BWD", "TAG_DKV_FWD", "TAG_DKV_BWD"]

# Message kinds: K/V travelling forward (to rank + 1) / backward (to rank - 1), and the dK/dV partial sums
# travelling with them.
TAG_KV_FWD, TAG_KV_BWD, TAG_DKV_FWD, TAG_DKV_BWD = 11, 12, 13, 14


class RingComm:
    """Rank arithmetic and P2P exchanges within ``group`` (None: the default group)."""

    def __init__(self, group=None):
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("nki_attn.distributed: torch.distributed is not initialized: call "
                               "torch.distributed.init_process_group(...) in every process first (e.g. under "
                               "torchrun), or use nki_attn.distributed.run_local for a local test")
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        if self.rank < 0:
            raise ValueError("nki_attn.distributed: group: this process is not a member of the given group")
        self.bytes_sent = 0

    def peer(self, offset):
        """Global rank of the group member ``offset`` places further along the ring."""
        r = (self.rank + offset) % self.size
        if self.group is None or self.group is dist.group.WORLD:
            return r
        return dist.get_global_rank(self.group, r)

    def start(self, sends=(), recvs=()):
        """Post ``sends`` [(tensor, offset, tag)] and ``recvs`` [(buffer, offset, tag)] at once; returns the
        work handles for :meth:`wait`. ``offset`` is relative to this rank (+1: next rank)."""
        ops = []
        for t, off, tag in sends:
            ops.append(dist.P2POp(dist.isend, t, self.peer(off), self.group, tag))
            self.bytes_sent += t.numel() * t.element_size()
        for t, off, tag in recvs:
            ops.append(dist.P2POp(dist.irecv, t, self.peer(off), self.group, tag))
        return dist.batch_isend_irecv(ops) if ops else []

    @staticmethod
    def wait(works):
        for w in works:
            w.wait()

    def all_lengths(self, n, device):
        """Every member's local sequence length (list of ints, in group rank order): one small all_gather."""
        mine = torch.tensor([n], dtype=torch.int64, device=device)
        out = [torch.zeros_like(mine) for _ in range(self.size)]
        dist.all_gather(out, mine, group=self.group)
        return [int(t.item()) for t in out]
