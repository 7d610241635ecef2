"""Configurations, the per-rank worker and the accuracy rule of the distributed tests (docs/distributed.md).

The rule, for every output of a configuration, with errors = max |x - truth| against the float64 golden on the
same dtype-rounded inputs and ``single`` = ``nki_attn.flash_attn_func`` on the full sequence in one process:

    err_ring <= 2 * err_single + n/2 * u * max|truth|                       (out, lse, dq, dk, dv)
    err_ring <= 2 * (err_single + err_inputs) + n/2 * u32 * max|truth|      (dsinks)

* ``2 * err_single``: FlashAttention's K = 2 against a baseline that runs the same kernels on the same inputs.
* ``n/2 * u * max|truth|``: the one thing the ring does that the single-process run does not: each block's
  partial result (o, dQ, dK, dV of one kernel call) is rounded to the dtype by the kernel before the float32
  merge, an error of at most u/2 of the partial each, and partials are of the order of the result. ``n`` is the
  largest number of partials that meet in one element (kernel calls covering a query row for o, lse, dQ;
  covering a key for dK, dV), from the schedule; ``u`` is the unit roundoff of the dtype (float32 for lse,
  whose partials are float32).
* dsinks is float32 arithmetic on the ring's own rounded o (D = rowsum(o * do)): ``err_inputs`` is the error of
  that formula evaluated in float64 from the ring's o (checked by its own rule) and the true lse, the
  "formula on the inputs it got" baseline of docs/validation.md. A missing or doubled rank share is not in it.
"""
import math

import torch

from nki_attn.distributed import (ring_flash_attn_func, ring_flash_attn_qkvpacked_func, ring_unshard,
                                  zigzag_ring_flash_attn_func, zigzag_shard, zigzag_unshard)
from nki_attn.distributed import layout
from nki_attn.distributed.layout import ring_layout, zigzag_layout

UNIT = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
OUTPUTS = ("out", "lse", "dq", "dk", "dv", "dsinks")


def case(name, layout="ring", causal=True, window=(-1, -1), dtype=torch.bfloat16, b=1, seqlen=512, h=4, hk=2,
         d=64, sinks=0, lengths=None, scale=None, seed=0):
    """One configuration: ``lengths`` gives uneven ring shard lengths (default: ``torch.tensor_split``)."""
    return dict(name=name, layout=layout, causal=causal, window=window, dtype=dtype, b=b, seqlen=seqlen, h=h, hk=hk,
                d=d, sinks=sinks, lengths=lengths, scale=scale, seed=seed)


def inputs(c):
    """Full-sequence q, k, v, do (rounded to the dtype) and sinks, the same in every process."""
    g = torch.Generator().manual_seed(1000 + c["seed"])
    b, S, h, hk, d, dt = c["b"], c["seqlen"], c["h"], c["hk"], c["d"], c["dtype"]
    q = torch.randn(b, S, h, d, generator=g).to(dt)
    k = torch.randn(b, S, hk, d, generator=g).to(dt)
    v = torch.randn(b, S, hk, d, generator=g).to(dt)
    do = torch.randn(b, S, h, d, generator=g).to(dt)
    s = torch.randn(h, c["sinks"], generator=g) if c["sinks"] else None
    if s is not None and c["sinks"] == 1:
        s = s[:, 0].contiguous()
    return q, k, v, do, s


def split_lengths(c, world_size):
    if c["lengths"] is not None:
        assert len(c["lengths"]) == world_size and sum(c["lengths"]) == c["seqlen"]
        return list(c["lengths"])
    return [len(t) for t in torch.tensor_split(torch.arange(c["seqlen"]), world_size)]


def shard(c, x, rank, world_size, dim=1):
    if c["layout"] == "zigzag":
        return zigzag_shard(x, rank, world_size, dim)
    return torch.split(x, split_lengths(c, world_size), dim)[rank].contiguous()


def unshard(c, parts, dim=1):
    return zigzag_unshard(parts, dim) if c["layout"] == "zigzag" else ring_unshard(parts, dim)


def shards_of(c, world_size):
    if c["layout"] == "zigzag":
        return zigzag_layout(c["seqlen"], world_size)
    return ring_layout(split_lengths(c, world_size))


def run_case(c, rank, world_size, group=None):
    """This rank's results for one configuration (``rank`` / ``world_size`` within ``group``): local out, lse
    and gradients; dsinks summed over the group."""
    q, k, v, do, s = inputs(c)
    fn = zigzag_ring_flash_attn_func if c["layout"] == "zigzag" else ring_flash_attn_func
    ql, kl, vl = (shard(c, t, rank, world_size).requires_grad_() for t in (q, k, v))
    sl = s.clone().requires_grad_() if s is not None else None
    out, lse = fn(ql, kl, vl, softmax_scale=c["scale"], causal=c["causal"], window_size=c["window"], sinks=sl,
                  return_lse=True, group=group)
    out.backward(shard(c, do, rank, world_size))
    ds = None
    if sl is not None:
        ds = sl.grad.clone()
        torch.distributed.all_reduce(ds, group=group)  # each rank holds its queries' share; the sum is the gradient
    return {"out": out.detach(), "lse": lse.detach(), "dq": ql.grad, "dk": kl.grad, "dv": vl.grad, "dsinks": ds}


def _raises(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the type and message are what the test checks
        return type(e).__name__, str(e)
    return None


def bad_inputs(rank, world_size):
    """Misuse that must fail the same way on every rank (no rank left waiting in a transfer)."""
    n = 256
    q = torch.randn(1, n + (rank == 0) * 8, 2, 32)  # uneven: a ring layout, not a zigzag one
    kv = torch.randn(1, n + (rank == 0) * 8, 2, 32)
    qq = torch.randn(1, n, 2, 32)
    return {
        "zigzag_uneven": _raises(lambda: zigzag_ring_flash_attn_func(q, kv, kv, causal=True)),
        "kv_len": _raises(lambda: ring_flash_attn_func(qq, torch.randn(1, n + 1, 2, 32), torch.randn(1, n + 1, 2, 32))),
        "dropout": _raises(lambda: ring_flash_attn_func(qq, qq, qq, dropout_p=0.1)),
        "window": _raises(lambda: ring_flash_attn_func(qq, qq, qq, window_size=(3,))),
        "heads": _raises(lambda: ring_flash_attn_func(qq, torch.randn(1, n, 3, 32), torch.randn(1, n, 3, 32))),
        "sinks": _raises(lambda: ring_flash_attn_func(qq, qq, qq, sinks=torch.zeros(3))),
        # misuse on rank 0 only: rank 0 raises its own error, the others learn of it in the setup's gather
        "one_rank": _raises(lambda: ring_flash_attn_func(qq, qq, qq, dropout_p=0.5 if rank == 0 else 0.0)),
    }


def api_shapes(rank, world_size):
    """return_attn_probs / packed variants: same numbers as the plain call."""
    g = torch.Generator().manual_seed(7)
    qkv = torch.randn(1, 256 * world_size, 3, 2, 32, generator=g)
    local = torch.tensor_split(qkv, world_size, 1)[rank].contiguous()
    q, k, v = local.unbind(2)
    plain = ring_flash_attn_func(q, k, v, causal=True)
    packed = ring_flash_attn_qkvpacked_func(local, causal=True)
    probs = ring_flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    return {"same": bool(torch.equal(plain, packed)) and bool(torch.equal(plain, probs[0])),
            "probs": (len(probs), tuple(probs[1].shape), probs[2] is None)}


# Sub-groups of 4 processes whose members are not consecutive global ranks (group rank 1 = global rank 2):
# the ring must address its peers through the group.
SUBGROUPS = ([0, 2], [1, 3])


def worker(rank, world_size, cases, extras, sub_cases=()):
    """Entry point of every rank: all configurations in one process group (one spawn per world size), then
    ``sub_cases`` on the two 2-rank ``SUBGROUPS`` at once (when world_size is 4)."""
    out = {"cases": [run_case(c, rank, world_size) for c in cases]}
    if extras:
        out["bad"] = bad_inputs(rank, world_size)
        out["api"] = api_shapes(rank, world_size)
    if sub_cases:
        groups = [torch.distributed.new_group(m) for m in SUBGROUPS]  # every rank creates every group
        mine = next(i for i, m in enumerate(SUBGROUPS) if rank in m)
        out["sub"] = [run_case(c, SUBGROUPS[mine].index(rank), 2, groups[mine]) for c in sub_cases]
    return out


# ----------------------------------------------------------------------------------------------------- the rule
def partial_counts(c, world_size):
    """Most kernel calls (partials) meeting in one query row and in one key, from the schedule."""
    return layout.partial_counts(shards_of(c, world_size), c["window"][0], 0 if c["causal"] else c["window"][1])


def dsinks_from(out, do, lse, sinks):
    """dsinks = -sum_i exp(sink - lse_i) * D_i, D_i = rowsum(out * do), in float64 from the given out."""
    D = (out.double() * do.double()).sum(-1).transpose(1, 2)  # [b, h, S]
    s = sinks.double() if sinks.dim() == 2 else sinks.double()[:, None]
    p = torch.exp(s[None, :, None, :] - lse.double()[..., None])  # [b, h, S, n]
    g = -(p * D[..., None]).sum((0, 2))
    return g if sinks.dim() == 2 else g[:, 0]


def judge(c, world_size, got, truth, single, do, sinks):
    """Check every output against the rule; returns a list of rows (dicts) with the numbers."""
    n_row, n_key = partial_counts(c, world_size)
    rows = []
    for name in OUTPUTS:
        t = truth[name]
        if t is None:
            continue
        g = got[name]
        finite = bool(torch.isfinite(g).all())
        e_ring = float((g.double() - t).abs().max())
        e_single = float((single[name].double() - t).abs().max())
        n = n_key if name in ("dk", "dv") else n_row
        u = UNIT[torch.float32] if name in ("lse", "dsinks") else UNIT[c["dtype"]]
        e_inputs = 0.0
        if name == "dsinks":
            # what the ring's own (checked) rounded o contributes through D: the formula in float64 from it
            e_inputs = float((dsinks_from(got["out"], do, truth["lse"], sinks) - t).abs().max())
        bound = 2 * (e_single + e_inputs) + n / 2 * u * float(t.abs().max())
        rows.append({"case": c["name"], "output": name, "err_ring": e_ring, "err_single": e_single,
                     "err_inputs": e_inputs, "n": n,
                     "bound": bound, "used": e_ring / bound if bound else math.inf, "finite": finite,
                     "ok": finite and e_ring <= bound})
    return rows


def gather(c, world_size, per_rank):
    """Full-sequence results from the ranks' local ones."""
    full = {}
    for name in OUTPUTS:
        if name == "dsinks":
            full[name] = per_rank[0]["dsinks"]
        else:
            full[name] = unshard(c, [r[name] for r in per_rank], dim=2 if name == "lse" else 1)
    return full
