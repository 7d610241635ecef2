"""Ring attention over torch.distributed on the NKI kernels: ``ring_flash_attn_func``, ``zigzag_ring_flash_attn_func``.

Each rank holds a shard of the sequence (``[batch, s_local, heads, head_dim]``, FlashAttention's layout) and
computes the rows of full-sequence attention that belong to its queries. Algorithm (docs/distributed.md):

Forward. K and V (stacked into one message) travel around the ring (``layout.Schedule``: forward R-1 hops for
the classic ring, fewer, or both directions, when windows leave ranks out). At each step a rank posts the next
hop with ``batch_isend_irecv``, runs the forward kernel of its queries against the K/V it holds (one call per
block pair, cropped to the rows and keys that see anything, with the block's mask as the kernels' native causal
flag or per-query bounds; skipped when fully masked), then waits. Partial results merge exactly through their
log-sum-exps in float32: ``lse = logaddexp(lse_a, lse_b)``, ``o = o_a exp(lse_a - lse) + o_b exp(lse_b - lse)``,
where a row that saw no key has lse -inf and weight 0 (never NaN). Sinks join the denominator once, after the
merge: ``lse' = logaddexp(lse, logsumexp(sinks))``, ``o' = o exp(lse - lse')``.

Backward. FlashAttention-2's backward of a block needs only the global o and lse (P = exp(S - lse), D =
rowsum(o * do)), so each block pair runs the backward kernel with the merged o and lse. K/V travel the same way
again; each rank adds its block's dQ to its own float32 dQ and its dK/dV to a float32 partial sum that travels
with the K/V, and after the last hop each partial sum is sent home, so every rank ends with the gradient of its
own keys and values. On XLA tensors (``comm.XlaRingComm.uniform_steps``) every step ends with the forward hop
and the forward partial sums always travel home, even where the schedule needs no transfer (the last step's
K/V hop returns them to their owner; with no forward travel the trip home is a shift by 0), so the XLA ring is
one program of steps whatever the world size: at world size 1 each of those is a ``collective_permute`` with
pairs [(0, 0)]. dsinks = -sum_i exp(sink - lse_i) D_i over the rank's own queries (see ``sinks`` below).
"""
import contextlib
import functools
import math
import numbers
import time

import torch

from ..ops import attention, attention_backward
from ..spec import MAX_EXACT_KEY, fail as _fail, flash_spec
from .comm import TAG_DKV_BWD, TAG_DKV_FWD, TAG_KV_BWD, TAG_KV_FWD, ring_comm
from .layout import plan_schedule, ring_layout, zigzag_chunk_lengths, zigzag_layout

__all__ = ["ring_flash_attn_func", "ring_flash_attn_kvpacked_func", "ring_flash_attn_qkvpacked_func",
           "zigzag_ring_flash_attn_func", "zigzag_ring_flash_attn_kvpacked_func",
           "zigzag_ring_flash_attn_qkvpacked_func", "record_steps"]


# ----------------------------------------------------------------------------------------------------- stats
_RECORDER = None


@contextlib.contextmanager
def record_steps(kernel_hook=None):
    """Record what every ring step of this process does (for scripts; nothing is recorded otherwise).

    Yields a list that receives one dict per (call, phase, step): ``phase`` (``fwd`` / ``bwd``), ``step``,
    ``sent_bytes`` (posted by this rank during the step), ``blocks`` (per kernel call: ``src`` rank, ``kind``,
    ``rows``, ``keys``, ``seconds`` of wall time and the hook's ``info``), ``wait_seconds`` (time blocked on
    transfers after the step's kernels). ``kernel_hook(run)`` may wrap each kernel call: it must call ``run()``
    once and return ``(result, info)`` (e.g. run it under the simulator's instruction trace).
    """
    global _RECORDER
    log, prev = [], _RECORDER
    _RECORDER = (log, kernel_hook)
    try:
        yield log
    finally:
        _RECORDER = prev


class _Step:
    """Per-step bookkeeping for ``record_steps`` (a no-op when nothing records)."""

    def __init__(self, comm, phase, step):
        self.rec = _RECORDER
        if self.rec is not None:
            self.comm, self.sent0 = comm, comm.bytes_sent
            self.entry = {"phase": phase, "step": step, "rank": comm.rank, "blocks": [], "wait_seconds": 0.0}

    def kernel(self, src, plan, run):
        if self.rec is None:
            return run()
        hook = self.rec[1]
        t0 = time.perf_counter()
        result, info = hook(run) if hook is not None else (run(), None)
        self.entry["blocks"].append({"src": src, "kind": plan.kind, "rows": plan.rows, "keys": plan.keys,
                                     "seconds": time.perf_counter() - t0, "info": info})
        return result

    def wait(self, comm, works):
        if self.rec is None:
            return comm.wait(works)
        t0 = time.perf_counter()
        comm.wait(works)
        self.entry["wait_seconds"] += time.perf_counter() - t0

    def done(self):
        if self.rec is not None:
            self.entry["sent_bytes"] = self.comm.bytes_sent - self.sent0
            self.rec[0].append(self.entry)


# ----------------------------------------------------------------------------------------------------- setup
@functools.lru_cache(maxsize=64)
def _schedule(shards, left, right):
    return plan_schedule(shards, left, right)


class _Ring:
    """Everything one call needs besides tensors: communicator, layout, schedule, scale.

    Arguments are checked locally first, then every rank learns every rank's verdict with the one collective of
    the setup (the all_gather of the local lengths), so misuse on any rank raises on every rank instead of
    leaving the others waiting in a transfer.
    """

    def __init__(self, fn, layout, q, k, v, group, check_args):
        self.comm = ring_comm(group, q.device if isinstance(q, torch.Tensor) else "cpu")
        R = self.comm.size
        error = None
        try:
            self._check_local(fn, q, k, v, check_args())
        except (TypeError, ValueError, NotImplementedError) as e:
            error = e
        device = q.device if isinstance(q, torch.Tensor) else torch.device("cpu")
        n = int(q.shape[1]) if error is None else -1
        lengths = self.comm.all_lengths(n, device)
        if error is not None:
            raise error
        bad = [r for r, x in enumerate(lengths) if x < 0]
        if bad:
            raise ValueError(f"{fn}: group ranks {bad} rejected their arguments (their error says why); this rank's "
                             f"were valid")
        if min(lengths) < 1:
            _fail(fn, "local seqlens", lengths, "every rank must hold at least one token")
        total = sum(lengths)
        if layout == "zigzag":
            want = zigzag_chunk_lengths(total, R)
            want = [want[r] + want[2 * R - 1 - r] for r in range(R)]
            if lengths != want:
                _fail(fn, "local seqlens", lengths, f"do not form a zigzag layout of {total} tokens over {R} ranks "
                                                    f"(expected {want}: shard with zigzag_shard)")
            shards = zigzag_layout(total, R)
        else:
            shards = ring_layout(lengths)
        self.shards = shards
        self.sched = _schedule(shards, self.left, self.right)
        if self.sched.kv_pad > MAX_EXACT_KEY:
            _fail(fn, "local seqlen", max(lengths), f"must be at most {MAX_EXACT_KEY} (the key bounds are float32)")
        self.n = n
        self.q_pad = self.sched.q_pad[self.comm.rank]

    def _check_local(self, fn, q, k, v, spec):
        """The ring's own rules on top of ``flash_attn_func``'s (``spec``, already checked)."""
        b, n, hq, d = q.shape
        if k.shape[1] != n:
            _fail(fn, "k.shape", tuple(k.shape), f"batch and local seqlen must equal q's {(b, n)}: every rank "
                                                 f"holds the keys of its own queries")
        if v.shape != k.shape:
            _fail(fn, "v.shape", tuple(v.shape), f"must equal k.shape {tuple(k.shape)} (ring attention sends k and "
                                                 f"v as one buffer)")
        for name, x in (("batch", b), ("heads", hq), ("head_dim", d)):
            if x == 0:
                _fail(fn, f"q {name}", 0, "must be >= 1 for ring attention")
        self.left, self.right = spec.left, spec.right
        self.scale = spec.scale
        # one block's spec: lengths and mask are set per block pair; sinks join after the merge
        self.block = spec.with_mask(0, 0, sinks=None)

    def plans(self, src):
        return self.sched.blocks[self.comm.rank][src]


def _block_spec(ring, plan, device):
    """The ``AttentionSpec`` of one block pair: its lengths and its mask (the kernels' causal band, per-query
    bounds, or nothing)."""
    (r0, r1), (k0, k1) = plan.rows, plan.keys
    if plan.bound_min is not None:
        return ring.block.with_mask(r1 - r0, k1 - k0, key_lo=plan.bound_min.to(device, torch.int64),
                                    key_hi=plan.bound_max.to(device, torch.int64))
    if plan.causal:
        left = plan.window - 1 if plan.window else -1
        return ring.block.with_mask(r1 - r0, k1 - k0, left, 0, (k1 - k0) - (r1 - r0))
    return ring.block.with_mask(r1 - r0, k1 - k0)


def _fa(x):
    """A kernel-layout buffer ``[b, h, d, s]`` viewed in FlashAttention's layout ``[b, s, h, d]`` (no copy)."""
    return x.permute(0, 3, 1, 2)


def _kl(x):
    """FlashAttention's layout ``[b, s, h, d]`` viewed as the buffers' ``[b, h, d, s]`` (no copy)."""
    return x.permute(0, 2, 3, 1)


def _to_buffer(x, pad_to):
    """``[b, s, h, d]`` -> a fresh ``[b, h, d, pad_to]`` buffer, zero rows after the sequence."""
    y = torch.nn.functional.pad(_kl(x), (0, pad_to - x.shape[1]))
    return y if y.is_contiguous() else y.clone(memory_format=torch.contiguous_format)


def _merge(o_acc, lse_acc, o_b, lse_b):
    """Fold one block's (o_b, lse_b) into the float32 accumulators in place; lse -inf means "no key yet" and
    weighs 0 (the guard keeps -inf - -inf from producing NaN)."""
    lse_b = torch.where(torch.isposinf(lse_b), torch.full_like(lse_b, -math.inf), lse_b)
    new = torch.logaddexp(lse_acc, lse_b)
    empty = torch.isneginf(new)
    wa = torch.where(empty, 0.0, torch.exp(lse_acc - new))
    wb = torch.where(empty, 0.0, torch.exp(lse_b - new))
    o_acc.mul_(wa[:, :, None, :]).add_(o_b.float() * wb[:, :, None, :])
    lse_acc.copy_(torch.where(empty, lse_acc, new))


def _sink_lse(sinks):
    s = sinks.detach().float()
    return torch.logsumexp(s, -1) if s.dim() == 2 else s


# ----------------------------------------------------------------------------------------------------- forward
def _travel_post(ring, step, cur, tags):
    """Post the hop that brings step+1's K/V (or partial sums): returns (works, next buffers)."""
    s = ring.sched
    sends, recvs, nxt = [], [], {}
    # on XLA every step ends with the forward hop (``uniform_steps``, comm.py); the last one returns K/V home
    if step < s.forward or ring.comm.uniform_steps:
        nxt[1] = torch.empty_like(cur[1])
        sends.append((cur[1], 1, tags[0]))
        recvs.append((nxt[1], -1, tags[0]))
    if step < s.backward:
        nxt[-1] = torch.empty_like(cur[-1])
        sends.append((cur[-1], -1, tags[1]))
        recvs.append((nxt[-1], 1, tags[1]))
    return ring.comm.start(sends, recvs), nxt


def _fwd_block(ring, rec, q_kl, buf, src, plan, o_acc, lse_acc):
    (r0, r1), (k0, k1) = plan.rows, plan.keys
    spec = _block_spec(ring, plan, q_kl.device)

    def run():
        return attention(spec, _fa(q_kl[..., r0:r1]), _fa(buf[0][..., k0:k1]), _fa(buf[1][..., k0:k1]))
    o_b, lse_b = rec.kernel(src, plan, run)
    _merge(o_acc[..., r0:r1], lse_acc[..., r0:r1], _kl(o_b), lse_b)


def _forward(ring, q_kl, kv, sinks):
    """q_kl [b, h, d, q_pad], kv [2, b, hk, d, kv_pad] -> (o float32 [b, h, d, q_pad], lse float32 [b, h, q_pad])
    with lse -inf for rows that saw nothing (sinks included)."""
    b, h, d, q_pad = q_kl.shape
    o_acc = torch.zeros((b, h, d, q_pad), dtype=torch.float32, device=q_kl.device)
    lse_acc = torch.full((b, h, q_pad), -math.inf, dtype=torch.float32, device=q_kl.device)
    cur = {0: kv, 1: kv, -1: kv}
    for step in range(ring.sched.steps):
        rec = _Step(ring.comm, "fwd", step)
        works, nxt = _travel_post(ring, step, cur, (TAG_KV_FWD, TAG_KV_BWD))
        for direction, src in ring.sched.sources(ring.comm.rank, step):
            # no plan: fully masked, the K/V only pass through
            for plan in ring.plans(src):
                _fwd_block(ring, rec, q_kl, cur[direction], src, plan, o_acc, lse_acc)
        rec.wait(ring.comm, works)
        cur.update(nxt)
        rec.done()
    if sinks is not None:
        ls = _sink_lse(sinks).to(q_kl.device)[None, :, None].expand_as(lse_acc)
        new = torch.logaddexp(lse_acc, ls)
        w = torch.where(torch.isneginf(new), 0.0, torch.exp(lse_acc - new))
        o_acc.mul_(w[:, :, None, :])
        lse_acc = torch.where(torch.isneginf(new), lse_acc, new)
    return o_acc, lse_acc


# ----------------------------------------------------------------------------------------------------- backward
def _bwd_block(ring, rec, q_kl, buf, o_kl, do_kl, lse, src, plan, dq):
    """Backward kernel of one block with the global o and lse; adds dQ in place, returns (k0, k1, dk, dv)."""
    (r0, r1), (k0, k1) = plan.rows, plan.keys
    spec = _block_spec(ring, plan, q_kl.device)

    def run():
        return attention_backward(spec, _fa(q_kl[..., r0:r1]), _fa(buf[0][..., k0:k1]), _fa(buf[1][..., k0:k1]),
                                  _fa(o_kl[..., r0:r1]), _fa(do_kl[..., r0:r1]), lse[..., r0:r1],
                                  d_from_o=ring.comm.size > 1)  # one rank: the block holds every key of its rows
    dq_b, dk_b, dv_b, _ = rec.kernel(src, plan, run)
    dq[..., r0:r1] += _kl(dq_b).float()
    return k0, k1, _kl(dk_b), _kl(dv_b)


def _backward(ring, q_kl, kv, o_kl, do_kl, lse):
    """Gradients of the local shard: (dq float32 [b, h, d, q_pad], dkv float32 [2, b, hk, d, kv_pad])."""
    s, comm, rank = ring.sched, ring.comm, ring.comm.rank
    dq = torch.zeros(q_kl.shape, dtype=torch.float32, device=q_kl.device)
    zeros_dkv = functools.partial(torch.zeros, kv.shape, dtype=torch.float32, device=kv.device)
    cur = {0: kv, 1: kv, -1: kv}
    acc = {0: zeros_dkv()}       # partial dK/dV sums held this step, per direction
    acc_works = {1: [], -1: []}  # in-flight partial sums (sends of the last step, receive of the next one)
    incoming = {}
    home = {}
    for step in range(s.steps):
        rec = _Step(comm, "bwd", step)
        works, nxt = _travel_post(ring, step, cur, (TAG_KV_FWD, TAG_KV_BWD))
        for direction, src in s.sources(rank, step):
            contribs = [_bwd_block(ring, rec, q_kl, cur[direction], o_kl, do_kl, lse, src, plan, dq)
                        for plan in ring.plans(src)]
            if direction == 0:
                a = acc[0]
            else:
                # the partial sum of this source's dK/dV so far: from the previous rank on its path (sent at
                # the end of its previous step), or fresh where the path starts (backward direction, step 1)
                if step == 1 and direction == -1:
                    a = zeros_dkv()
                else:
                    rec.wait(comm, acc_works[direction])
                    acc_works[direction] = []
                    a = incoming[direction]
            for k0, k1, dk_b, dv_b in contribs:
                a[0][..., k0:k1] += dk_b.float()
                a[1][..., k0:k1] += dv_b.float()
            acc[direction] = a
        # pass the partial sums on (or home, after the last hop of their direction)
        for direction, hops, tag in ((1, s.forward, TAG_DKV_FWD), (-1, s.backward, TAG_DKV_BWD)):
            if hops == 0 and not (direction == 1 and comm.uniform_steps):
                continue  # nothing travelled this way: the partial sums are home (on XLA: a shift by 0, below)
            src_dir = 0 if (direction == 1 and step == 0) else direction
            if step == 0 and direction == -1:
                continue  # the backward path starts at step 1
            if step > hops:
                continue
            a = acc[src_dir]
            rec.wait(comm, acc_works[direction])  # the previous send of this direction has finished
            acc_works[direction] = []
            buf = torch.empty_like(a)
            if step < hops:
                acc_works[direction] = comm.start([(a, direction, tag)], [(buf, -direction, tag)])
                incoming[direction] = buf
            else:
                acc_works[direction] = comm.start([(a, -direction * hops, tag)], [(buf, direction * hops, tag)])
                home[direction] = buf
        rec.wait(comm, works)
        cur.update(nxt)
        rec.done()
    for direction in (1, -1):
        comm.wait(acc_works[direction])
    dkv = home[1] if 1 in home else acc[0]
    if s.backward:
        dkv = dkv + home[-1]
    return dq, dkv


# ----------------------------------------------------------------------------------------------------- autograd
class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, ring):
        n, kv_pad = ring.n, ring.sched.kv_pad
        q_kl = _to_buffer(q, ring.q_pad)
        kv = torch.stack([_to_buffer(k, kv_pad), _to_buffer(v, kv_pad)])
        o_acc, lse = _forward(ring, q_kl, kv, sinks)
        o_kl = o_acc.to(q.dtype)
        lse = torch.where(torch.isneginf(lse), math.inf, lse)
        lse[..., n:] = math.inf  # padded rows: P = exp(S - lse) = 0 in the backward
        ctx.save_for_backward(q_kl, kv, o_kl, lse, sinks)
        ctx.ring = ring
        ctx.k_dtype = k.dtype
        out = o_kl[..., :n].permute(0, 3, 1, 2).contiguous()
        lse_out = lse[..., :n].contiguous()
        ctx.mark_non_differentiable(lse_out)
        return out, lse_out

    @staticmethod
    def backward(ctx, dout, dlse):
        q_kl, kv, o_kl, lse, sinks = ctx.saved_tensors
        ring = ctx.ring
        n, nk = ring.n, ring.n
        do_kl = _to_buffer(dout.to(q_kl.dtype), ring.q_pad)  # padded rows get do = 0
        dq, dkv = _backward(ring, q_kl, kv, o_kl, do_kl, lse)
        dq = dq[..., :n].permute(0, 3, 1, 2).to(q_kl.dtype).contiguous()
        dk = dkv[0][..., :nk].permute(0, 3, 1, 2).to(ctx.k_dtype).contiguous()
        dv = dkv[1][..., :nk].permute(0, 3, 1, 2).to(ctx.k_dtype).contiguous()
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[3]:
            # dsinks = -sum_i exp(sink - lse_i) D_i, D_i = rowsum(o * do): this rank's queries only
            D = (o_kl.float() * do_kl.float()).sum(2)  # [b, h, q_pad]
            s = sinks.detach().float()
            s = s if s.dim() == 2 else s[:, None]
            p = torch.exp(s[None, :, None, :] - lse[..., None])  # [b, h, q_pad, n_sinks]
            g = -(p * D[..., None]).sum((0, 2))
            dsinks = (g if sinks.dim() == 2 else g[:, 0]).to(sinks.dtype)
        return dq, dk, dv, dsinks, None


# ----------------------------------------------------------------------------------------------------- public
def _ring_attention(fn, layout, q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                    deterministic, return_attn_probs, group, sinks, return_lse):
    def check_args():
        if isinstance(dropout_p, numbers.Real) and not isinstance(dropout_p, bool) and dropout_p != 0.0:
            _fail(fn, "dropout_p", dropout_p, "ring attention does not implement dropout; only 0.0",
                  NotImplementedError)
        if alibi_slopes is not None:
            shape = tuple(alibi_slopes.shape) if isinstance(alibi_slopes, torch.Tensor) else \
                type(alibi_slopes).__name__
            _fail(fn, "alibi_slopes", shape, "ALiBi is not implemented here; only None", NotImplementedError)
        return flash_spec(fn, q, k, v, dropout_p, softmax_scale, causal, window_size, 0.0, None, deterministic,
                          return_attn_probs, sinks=sinks, return_lse=return_lse)
    ring = _Ring(fn, layout, q, k, v, group, check_args)
    out, lse = _RingAttention.apply(q, k, v, sinks, ring)
    if return_attn_probs:
        return out, lse, None
    if return_lse:
        return out, lse
    return out


_SHAPES = """
    Args:
        q: ``[batch, s_local, nheads, head_dim]``: this rank's queries; k, v: ``[batch, s_local, nheads_k,
            head_dim]``, the keys and values of the same tokens (``nheads % nheads_k == 0``: GQA / MQA).
        dropout_p: must be 0.0; alibi_slopes: must be None (NotImplementedError otherwise).
        softmax_scale: scale of q·k, finite > 0; default ``1/sqrt(head_dim)``.
        causal: bool, over global positions; window_size: ``(left, right)``, -1 = unbounded, over global
            positions (query i sees keys ``i - left .. i + right``; causal forces right = 0). Windows shorten
            the ring: K/V travel only as far as some query can see.
        deterministic: accepted; results are bit-identical run to run (fixed merge and summation order).
        return_attn_probs: return ``(out, softmax_lse, None)`` as ring-flash-attn does.
        group: the process group of the ring (None: the default group); its members in group-rank order hold
            consecutive shards.
        sinks: keyword only, ``[nheads]`` or ``[nheads, num_sinks]`` logits joining every row's softmax
            denominator once (not scaled, no value). The same tensor on every rank, like any replicated
            parameter: its gradient on each rank is that rank's share (its queries), and the full-sequence
            gradient is the sum over the group, which data-parallel gradient reduction over the group (or an
            explicit ``all_reduce``) forms, exactly as for the weights that produced q, k and v.
        return_lse: keyword only; return ``(out, lse)``.
    Returns:
        out ``[batch, s_local, nheads, head_dim]`` in q's dtype: the rows of full-sequence attention that
        belong to this rank's queries. lse float32 ``[batch, nheads, s_local]`` (+inf for a row that sees no
        key and has no sink) takes no gradient. Gradients flow to q, k, v (this rank's shard) and sinks.
"""


def ring_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                         alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None, *, sinks=None,
                         return_lse=False):
    """Ring attention over contiguous shards: group rank r holds the tokens after those of ranks 0..r-1.

    Shard lengths may differ between ranks (each at least 1 token; ``torch.tensor_split`` of the sequence, as
    :func:`ring_shard` does, or any split): shards are padded to a multiple of 128 internally and the padding is
    masked. Under a causal mask the work grows with the rank (rank R-1 attends to every shard);
    :func:`zigzag_ring_flash_attn_func` balances it.
    """
    return _ring_attention("ring_flash_attn_func", "ring", q, k, v, dropout_p, softmax_scale, causal, window_size,
                           alibi_slopes, deterministic, return_attn_probs, group, sinks, return_lse)


def zigzag_ring_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None, *,
                                sinks=None, return_lse=False):
    """Ring attention over zigzag shards: rank r of R holds chunks r and 2R-1-r of the sequence cut into 2R
    chunks (``torch.tensor_split`` sizes), concatenated in that order; :func:`zigzag_shard` /
    :func:`zigzag_unshard` convert. Under a causal mask every rank does the same work
    (``layout.work_balance``). Any mask works (non-causal too: it is only a permutation of the tokens).
    """
    return _ring_attention("zigzag_ring_flash_attn_func", "zigzag", q, k, v, dropout_p, softmax_scale, causal,
                           window_size, alibi_slopes, deterministic, return_attn_probs, group, sinks, return_lse)


ring_flash_attn_func.__doc__ += _SHAPES
zigzag_ring_flash_attn_func.__doc__ += _SHAPES


def _unpack(fn, x, n, dim_len, what):
    if not isinstance(x, torch.Tensor):
        _fail(fn, what, type(x).__name__, "must be a torch.Tensor", TypeError)
    if x.dim() != 5 or x.shape[2] != dim_len:
        _fail(fn, f"{what}.shape", tuple(x.shape), f"must be [batch, s_local, {dim_len}, heads, head_dim]")
    return x.unbind(2)


def ring_flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                   alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None, *,
                                   sinks=None, return_lse=False):
    """``ring_flash_attn_func`` on ``qkv [batch, s_local, 3, nheads, head_dim]``."""
    q, k, v = _unpack("ring_flash_attn_qkvpacked_func", qkv, 3, 3, "qkv")
    return ring_flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                                deterministic, return_attn_probs, group, sinks=sinks, return_lse=return_lse)


def ring_flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                  alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None, *,
                                  sinks=None, return_lse=False):
    """``ring_flash_attn_func`` on q and ``kv [batch, s_local, 2, nheads_k, head_dim]``."""
    k, v = _unpack("ring_flash_attn_kvpacked_func", kv, 2, 2, "kv")
    return ring_flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                                deterministic, return_attn_probs, group, sinks=sinks, return_lse=return_lse)


def zigzag_ring_flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                                          window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                                          return_attn_probs=False, group=None, *, sinks=None, return_lse=False):
    """``zigzag_ring_flash_attn_func`` on ``qkv [batch, s_local, 3, nheads, head_dim]``."""
    q, k, v = _unpack("zigzag_ring_flash_attn_qkvpacked_func", qkv, 3, 3, "qkv")
    return zigzag_ring_flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                                       deterministic, return_attn_probs, group, sinks=sinks, return_lse=return_lse)


def zigzag_ring_flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                                         window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                                         return_attn_probs=False, group=None, *, sinks=None, return_lse=False):
    """``zigzag_ring_flash_attn_func`` on q and ``kv [batch, s_local, 2, nheads_k, head_dim]``."""
    k, v = _unpack("zigzag_ring_flash_attn_kvpacked_func", kv, 2, 2, "kv")
    return zigzag_ring_flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                                       deterministic, return_attn_probs, group, sinks=sinks, return_lse=return_lse)
