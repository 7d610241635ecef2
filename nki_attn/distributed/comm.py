"""The ring's communication: one small interface, two implementations, chosen by the tensors' device.

The interface (what ``ring.py`` uses): ``rank``, ``size``, ``bytes_sent``, ``uniform_steps``, ``peer(offset)``,
``start(sends, recvs) -> works``, ``wait(works)`` and ``all_lengths(n, device)``. Every rank posts the same list
of transfers at each step (the schedule is the same everywhere); a send ``(tensor, offset, tag)`` goes
``offset`` places along the ring and is received by a ``(buffer, -offset, tag)`` on its destination.

``RingComm`` (CPU / CUDA tensors): torch.distributed point-to-point, any backend with isend / irecv (gloo, NCCL).
``XlaRingComm`` (XLA tensors, torch-xla / torch-neuronx): XLA collectives. torch-xla's process group turns each
isend / irecv into its own ``collective_permute`` for one rank pair, so a ring's sequence of collectives would
differ from rank to rank, which XLA cannot match up; here every transfer of the ring is one
``xm.collective_permute(tensor, pairs=[(r, (r + offset) % R) for every r])`` that every rank joins (offset +1
for K/V, -1 for the dK/dV partial sums going back), and the lengths are one ``xm.all_gather``.

``uniform_steps`` (False for P2P, True for XLA): every ring step ends with the forward K/V hop and the forward
dK/dV partial sums always make their trip home, even where the schedule needs no transfer (after the last step,
at world size 1). The XLA ring is then the same sequence of collectives at every world size, so the
world-size-1 run on XLA:CPU (the only one that runs here: multi-device XLA:CPU collectives hang) goes through
the ``collective_permute`` path a multi-rank ring uses; it costs one K/V transfer more per pass on R ranks (the
hop home after the last step, overlapping that step's kernels), and at world size 1 it moves the data onto the
device itself (pairs [(0, 0)]). P2P rings skip those transfers.

P2P details: every transfer goes through ``torch.distributed.batch_isend_irecv`` (one call per exchange, all of its sends and
receives posted together and completed later), so the kernel call that follows overlaps the transfer on
backends that progress P2P in the background (gloo's worker threads here; NCCL-style streams elsewhere). Each
kind of message has its own tag and at most one message per (peer, tag) is ever in flight, so no backend has to
order messages for us.
"""
import torch
import torch.distributed as dist

__all__ = ["RingComm", "XlaRingComm", "ring_comm", "ring_pairs", "match_transfers", "TAG_KV_FWD", "TAG_KV_BWD", "TAG_DKV_FWD", "TAG_DKV_BWD"]

# Message kinds: K/V travelling forward (to rank + 1) / backward (to rank - 1), and the dK/dV partial sums
# travelling with them.
TAG_KV_FWD, TAG_KV_BWD, TAG_DKV_FWD, TAG_DKV_BWD = 11, 12, 13, 14


class _Comm:
    """What both communicators share: completing the works ``start`` returned (XLA's are already complete, an
    empty list)."""

    @staticmethod
    def wait(works):
        """Block until every work handle of ``works`` (from :meth:`start`) has completed."""
        for w in works:
            w.wait()


class RingComm(_Comm):
    """Rank arithmetic and P2P exchanges within ``group`` (None: the default group)."""

    def __init__(self, group=None):
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("nki_attn.distributed: torch.distributed is not initialized: call "
                               "torch.distributed.init_process_group(...) in every process first (e.g. under "
                               "torchrun), or use nki_attn.distributed.run_local for a local test")
        self.group = group
        self.uniform_steps = False
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

    def all_lengths(self, n, device):
        """Every member's local sequence length (list of ints, in group rank order): one small all_gather."""
        mine = torch.tensor([n], dtype=torch.int64, device=device)
        out = [torch.zeros_like(mine) for _ in range(self.size)]
        dist.all_gather(out, mine, group=self.group)
        return [int(t.item()) for t in out]


# ------------------------------------------------------------------------------------------------- XLA collectives
def ring_pairs(size, offset):
    """The ``(source, destination)`` pairs of one ring-wide shift by ``offset`` places, for every rank of a ring
    of ``size``: ``[(r, (r + offset) % size) for r in range(size)]`` (``xm.collective_permute``'s ``pairs``)."""
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"ring_pairs: size={size!r}: must be an int >= 1")
    if not isinstance(offset, int):
        raise TypeError(f"ring_pairs: offset={offset!r}: must be an int")
    return [(r, (r + offset) % size) for r in range(size)]


def match_transfers(sends, recvs):
    """Pair every send ``(tensor, offset, tag)`` with the receive ``(buffer, -offset, tag)`` that takes the same
    message on the destination rank; returns ``[(tensor, buffer, offset)]`` in the order of ``sends``. Raises
    ValueError when a send or a receive has no partner (a collective shift moves every rank's message at once,
    so one without the other cannot be expressed)."""
    left = list(recvs)
    out = []
    for t, off, tag in sends:
        i = next((i for i, (_, roff, rtag) in enumerate(left) if rtag == tag and roff == -off), None)
        if i is None:
            raise ValueError(f"match_transfers: send (offset {off}, tag {tag}) has no receive with offset {-off} "
                             f"and the same tag")
        buf = left.pop(i)[0]
        if buf.shape != t.shape or buf.dtype != t.dtype:
            raise ValueError(f"match_transfers: tag {tag}: receive buffer {tuple(buf.shape)} {buf.dtype} must "
                             f"match the sent tensor {tuple(t.shape)} {t.dtype}")
        out.append((t, buf, off))
    if left:
        raise ValueError(f"match_transfers: receives {[(off, tag) for _, off, tag in left]} (offset, tag) have "
                         f"no matching send")
    return out


class XlaRingComm(_Comm):
    """The ring's transfers as XLA collectives over every device of the torch-xla world (``group`` must be None:
    ``collective_permute`` pairs are global ordinals).

    ``start`` issues one ``collective_permute`` per send and copies its result into the receive buffer; XLA
    orders the work itself, so the returned works are already complete and ``wait`` has nothing to do.
    ``permutes`` counts the collectives issued (what the tests check)."""

    def __init__(self, group=None):
        if group is not None:
            raise ValueError("nki_attn.distributed: group: XLA tensors run the ring over the whole torch-xla world; "
                             "pass group=None")
        import torch_xla.core.xla_model as xm
        import torch_xla.runtime as xr
        self._xm = xm
        self.group = None
        self.uniform_steps = True
        self.rank = xr.global_ordinal()
        self.size = xr.world_size()
        self.bytes_sent = 0
        self.permutes = 0

    def peer(self, offset):
        """Ordinal of the device ``offset`` places further along the ring."""
        return (self.rank + offset) % self.size

    def start(self, sends=(), recvs=()):
        """Every send with its receive (see ``match_transfers``) as one ring-wide ``collective_permute``."""
        for t, buf, off in match_transfers(sends, recvs):
            got = self._xm.collective_permute(t, pairs=ring_pairs(self.size, off))
            buf.copy_(got)
            self.bytes_sent += t.numel() * t.element_size()
            self.permutes += 1
        return []

    def all_lengths(self, n, device):
        """Every device's local sequence length (list of ints, in ordinal order): one ``xm.all_gather``."""
        mine = torch.tensor([n], dtype=torch.int64, device=device)
        return [int(x) for x in self._xm.all_gather(mine, dim=0).cpu().tolist()]


def ring_comm(group, device):
    """The communicator for tensors on ``device``: XLA collectives for XLA tensors, torch.distributed P2P
    otherwise."""
    if torch.device(device).type == "xla":
        return XlaRingComm(group)
    return RingComm(group)
