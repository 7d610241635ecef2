"""Cut a full sequence into the ranks' shards and put it back together; the per-rank work-balance report."""
import torch

from ..spec import window_pair
from .layout import ring_layout, work_balance, zigzag_chunk_lengths, zigzag_layout

__all__ = ["ring_shard", "ring_unshard", "zigzag_shard", "zigzag_unshard", "work_balance_report",
           "format_work_balance"]


def _check(fn, x, rank, world_size, dim):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: x={type(x).__name__}: must be a torch.Tensor")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"{fn}: world_size={world_size!r}: must be an int >= 1")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"{fn}: rank={rank!r}: must be an int in [0, {world_size})")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"{fn}: dim={dim}: out of range for a {x.dim()}-D tensor")


def ring_shard(x, rank, world_size, dim=1):
    """Rank ``rank``'s contiguous shard of ``x`` along ``dim`` (``torch.tensor_split`` into ``world_size``
    parts: lengths differ by at most one). E.g. ``[batch, seqlen, heads, d]`` -> ``[batch, s_local, heads, d]``."""
    _check("ring_shard", x, rank, world_size, dim)
    if x.shape[dim] < world_size:
        raise ValueError(f"ring_shard: x.shape[{dim}]={x.shape[dim]}: needs at least world_size={world_size} "
                         f"tokens (one per rank)")
    return torch.tensor_split(x, world_size, dim)[rank].contiguous()


def ring_unshard(shards, dim=1):
    """Inverse of :func:`ring_shard`: the ranks' shards (in rank order) concatenated along ``dim``."""
    return torch.cat(list(shards), dim)


def zigzag_shard(x, rank, world_size, dim=1):
    """Rank ``rank``'s zigzag shard of ``x`` along ``dim``: chunks ``rank`` and ``2 * world_size - 1 - rank`` of
    the ``2 * world_size``-way ``torch.tensor_split``, concatenated. Any length >= 2 * world_size works (chunk
    lengths differ by at most one)."""
    _check("zigzag_shard", x, rank, world_size, dim)
    if x.shape[dim] < 2 * world_size:
        raise ValueError(f"zigzag_shard: x.shape[{dim}]={x.shape[dim]}: needs at least 2 * world_size = "
                         f"{2 * world_size} tokens (two chunks per rank)")
    chunks = torch.tensor_split(x, 2 * world_size, dim)
    return torch.cat([chunks[rank], chunks[2 * world_size - 1 - rank]], dim).contiguous()


def zigzag_unshard(shards, dim=1):
    """Inverse of :func:`zigzag_shard`: the full sequence from all ranks' shards (a list in rank order)."""
    shards = list(shards)
    R = len(shards)
    total = sum(s.shape[dim] for s in shards)
    sizes = zigzag_chunk_lengths(total, R)
    chunks = [None] * (2 * R)
    for r, s in enumerate(shards):
        want = sizes[r] + sizes[2 * R - 1 - r]
        if s.shape[dim] != want:
            raise ValueError(f"zigzag_unshard: shards[{r}].shape[{dim}]={s.shape[dim]}: a zigzag layout of {total} "
                             f"tokens over {R} ranks gives rank {r} {want} tokens")
        chunks[r], chunks[2 * R - 1 - r] = torch.split(s, [sizes[r], sizes[2 * R - 1 - r]], dim)
    return torch.cat(chunks, dim)


def work_balance_report(seqlen, world_size, causal=True, window_size=(-1, -1)):
    """Per-rank work of one attention call over ``seqlen`` tokens on ``world_size`` ranks, for both layouts:
    ``{"ring": rows, "zigzag": rows}`` with rows as ``layout.work_balance`` (``visible`` pairs, kernel
    ``tiles`` of 128 x 128, ``blocks``, ``imbalance`` = max / mean tiles)."""
    left, right = window_pair("work_balance_report", window_size, causal)
    lengths = [len(t) for t in torch.tensor_split(torch.arange(seqlen), world_size)]
    return {"ring": work_balance(ring_layout(lengths), left, right),
            "zigzag": work_balance(zigzag_layout(seqlen, world_size), left, right)}


def format_work_balance(report):
    """The report as a text table (one line per rank and layout)."""
    lines = [f"{'layout':<8}{'rank':>5}{'tokens':>8}{'visible pairs':>15}{'tiles':>8}{'blocks':>8}"
             f"{'max/mean':>10}"]
    for name, rows in report.items():
        for x in rows:
            lines.append(f"{name:<8}{x['rank']:>5}{x['tokens']:>8}{x['visible']:>15}{x['tiles']:>8}"
                         f"{x['blocks']:>8}{x['imbalance']:>10.2f}")
    return "\n".join(lines)
