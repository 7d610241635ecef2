"""Drift check: a 1-layer toy transformer trained with the kernels and with a reference attention.

The task is sorting: each sample is N random digits followed by the same digits sorted; the model predicts
the next token and the loss is taken on the sorted half. Both runs share the seed, data and initial weights;
only the attention differs. The loss curves pass when they overlap within ``BOUND`` (docs/harness.md): the
mean relative gap over the last 10% of the steps is at most ``BOUND['tail']`` and no step's relative gap
exceeds ``BOUND['max']``. A wrong gradient changes the trajectory far beyond that.
"""
import json
import math
import os

import torch
import torch.nn.functional as F

BOUND = {"tail": 0.02, "max": 0.10}


def reference_attention(q, k, v):
    """Causal attention in float64, [b, s, h, d] layout, the plain way."""
    s = q.shape[1]
    x = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) / math.sqrt(q.shape[-1])
    x = x.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", x.softmax(-1), v.double()).to(q.dtype)


class ToyTransformer(torch.nn.Module):
    """Embedding + one pre-norm attention/MLP block + output head; ``attn(q, k, v)`` in [b, s, h, d]."""

    def __init__(self, attn, vocab=12, dim=32, heads=1, seqlen=32):
        super().__init__()
        self.attn, self.heads = attn, heads
        self.tok = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Parameter(torch.randn(seqlen, dim) * 0.1)
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, x):
        b, s = x.shape
        h = self.tok(x) + self.pos[:s]
        q, k, v = self.qkv(self.norm1(h)).reshape(b, s, 3, self.heads, -1).unbind(2)
        h = h + self.proj(self.attn(q, k, v).reshape(b, s, -1))
        h = h + self.mlp(self.norm2(h))
        return self.head(h)


def sorting_batch(g, batch, n, vocab):
    digits = torch.randint(0, vocab, (batch, n), generator=g)
    return torch.cat([digits, digits.sort(dim=1).values], dim=1)


def progress_steps(steps):
    """The steps after which a training run reports progress: about every 10% (at most 10 per run)."""
    return sorted({max(1, round(steps * k / 10)) for k in range(1, 11)})


def train(attn, steps, seed=0, batch=8, n=16, vocab=12, lr=3e-3, progress=None, label="run"):
    """Loss per step of one training run with ``attn``; ``progress(text)`` after each of ``progress_steps``."""
    marks = set(progress_steps(steps)) if progress else set()
    torch.manual_seed(seed)
    model = ToyTransformer(attn, vocab=vocab, seqlen=2 * n)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed + 1)
    losses = []
    for _ in range(steps):
        x = sorting_batch(g, batch, n, vocab)
        logits = model(x[:, :-1])
        loss = F.cross_entropy(logits[:, n - 1:].reshape(-1, vocab), x[:, n:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if len(losses) in marks:
            progress(f"{label} run: step {len(losses)}/{steps} loss {losses[-1]:.4f}")
    return losses


def compare_curves(cand, ref):
    gaps = [abs(a - b) / max(abs(b), 1e-6) for a, b in zip(cand, ref)]
    tail = gaps[-max(1, len(gaps) // 10):]
    tail_gap = sum(tail) / len(tail)
    return {"tail_mean_rel_gap": tail_gap, "max_rel_gap": max(gaps), "bound": BOUND,
            "pass": tail_gap <= BOUND["tail"] and max(gaps) <= BOUND["max"]}


class CandidateAttention(torch.autograd.Function):
    """Causal attention in ``[b, s, h, d]`` through a harness candidate's forward and backward (``runner``'s
    contract, kernels' layout ``[b, h, d, s]``), as a training step uses them: the forward's o and lse are saved
    and handed to the backward. Lengths are padded to multiples of 128 with zeros at the end; the causal mask
    hides the padded keys from every real query (no packing bounds needed), and the padded query rows get
    dO = 0, so they add nothing to the real gradients."""

    @staticmethod
    def forward(ctx, q, k, v, candidate):
        s = q.shape[1]
        s_pad = -(-s // 128) * 128

        def kernel_layout(t):  # [b, s, h, d] -> [b, h, d, s_pad]
            return torch.nn.functional.pad(t.detach().permute(0, 2, 3, 1), (0, s_pad - s)).contiguous()

        qk, kk, vk = kernel_layout(q), kernel_layout(k), kernel_layout(v)
        o, lse = candidate.fwd(qk, kk, vk, None, None, None, use_causal_mask=True, mixed_precision=True)
        o, lse = torch.as_tensor(o), torch.as_tensor(lse)
        ctx.save_for_backward(qk, kk, vk, o, lse)
        ctx.candidate, ctx.s = candidate, s
        return o[..., :s].permute(0, 3, 1, 2).to(q.dtype)

    @staticmethod
    def backward(ctx, do):
        qk, kk, vk, o, lse = ctx.saved_tensors
        s = ctx.s
        dy = torch.nn.functional.pad(do.permute(0, 2, 3, 1), (0, qk.shape[-1] - s)).to(qk.dtype).contiguous()
        res = ctx.candidate.bwd(qk, kk, vk, o, dy, lse, None, None, None, use_causal_mask=True,
                                mixed_precision=True)

        def api_layout(t):  # [b, h, d, s_pad] -> [b, s, h, d]
            return torch.as_tensor(t)[..., :s].permute(0, 3, 1, 2).to(do.dtype)

        return api_layout(res[0]), api_layout(res[1]), api_layout(res[2]), None


def candidate_attention(candidate):
    """``attn(q, k, v)`` for ``train``: causal attention through ``candidate`` (``CandidateAttention``)."""
    return lambda q, k, v: CandidateAttention.apply(q, k, v, candidate)


def check_drift(steps=1000, out_dir=".", attn=None, progress=None, label="nki-attn kernels"):
    """Train with the kernels (``attn``, default nki_attn.flash_attn_func causal; ``candidate_attention`` for
    another candidate) and with the reference; write drift.json and drift.png into ``out_dir``; return the
    verdict dict. ``label`` names the candidate in the plot. ``progress(text)`` is called
    ``2 * len(progress_steps(steps))`` times."""
    from ..attention import flash_attn_func
    cand_attn = attn or (lambda q, k, v: flash_attn_func(q, k, v, causal=True))
    cand = train(cand_attn, steps, progress=progress, label="candidate")
    ref = train(reference_attention, steps, progress=progress, label="reference")
    res = compare_curves(cand, ref)
    res.update({"steps": steps, "final_loss_candidate": cand[-1], "final_loss_reference": ref[-1],
                "candidate": label})
    os.makedirs(out_dir, exist_ok=True)
    jpath = os.path.join(out_dir, "drift.json")
    with open(jpath, "w") as f:
        json.dump({"verdict": res, "loss_candidate": cand, "loss_reference": ref}, f)
    res["json"] = jpath
    res["png"] = _plot(cand, ref, os.path.join(out_dir, "drift.png"), label)
    return res


def _plot(cand, ref, path, label="nki-attn kernels"):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(ref, label="reference attention (float64)", lw=2.5, alpha=0.6)
    ax.plot(cand, label=label, lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (sorted half)")
    ax.set_yscale("log")
    ax.set_title("drift check: 1-layer transformer on a sorting task")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
