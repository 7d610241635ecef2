"""The backward's D on rows whose keys fit one 128-key chunk (``attention_bwd._whole_row``): summed from the
visit's float32 P and dP, not from the bf16 O (docs/validation.md "Where the backward's error comes from")."""
import torch

from nki_attn.kernel_api import attention_bwd, attention_fwd

D = 128
SCALE = D ** -0.5


def _inputs(h, s, seed):
    """bf16 q, k ``[1, h, D, s]`` (standard normal) and v, dy whose every dP_ij = dO_i . V_j is the same c_i
    for all keys j, exactly: head dims in pairs (2m, 2m+1), dO_i equal on both (a_im), V_j = w_m +- b_jm on
    them, so dO_i . V_j = sum_m 2 a_im w_m. All of a, w, b are multiples of 1/8 below 2 in magnitude: every
    product and partial sum is exact in float32, whatever the summation order. O_i = w +- sum_j P_ij b_j is not
    representable in bf16, and its two halves round independently."""
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(1, h, D, s, generator=g, dtype=torch.float64).bfloat16() for _ in range(2))

    def grid(*shape):
        return torch.randint(-12, 13, shape, generator=g).double() / 8
    a, w, b = grid(1, h, D // 2, s), grid(1, h, D // 2, 1), grid(1, h, D // 2, s)
    dy = torch.stack([a, a], dim=3).reshape(1, h, D, s)
    v = torch.stack([w + b, w - b], dim=3).reshape(1, h, D, s)
    return q, k, v.bfloat16(), dy.bfloat16(), (2 * a * w).sum(dim=2)


def test_d_of_single_chunk_rows_is_the_sum_of_p_dp():
    # dP_ij = c_i for every key j (``_inputs``), so in exact arithmetic D_i = sum_j P_ij c_i = c_i,
    # dS = P (dP - D) = 0 and dq = dk = 0. Causal at 128 tokens: every row's keys lie in the first chunk. The
    # kernel's dP is c_i exactly, and its D~_i = c_i (sum_j P_ij)(1 + theta) with |theta| <= 127 * 2^-24 (a
    # float32 sum of 128 terms) and sum_j P_ij = 1 + eta, |eta| a few 2^-24 per unit of the LSE (|LSE| < 16
    # here) plus the forward's float32 sum of 128 exps: |c - D~| <= eps |c|, eps < 300 * 2^-24 < 2^-15.7. So
    # |dq_i| <= scale * eps * |c_i| * max|K| (sum_j P_ij = 1); bound 2^-14. D taken from the bf16 O instead
    # misses c_i by O's rounding, 2^-9 relative per element: checked below to break the bound.
    h, s = 4, 128
    q, k, v, dy, c = _inputs(h, s, seed=5)
    o, lse = attention_fwd(q, k, v, use_causal_mask=True, softmax_scale=SCALE, mixed_precision=True)
    dq, dk, dv = attention_bwd(q, k, v, o, dy, lse, use_causal_mask=True, softmax_scale=SCALE,
                               mixed_precision=True)[:3]
    kmax = k.double().abs().amax()
    dq_rows = torch.as_tensor(dq).double().abs().amax(dim=2)  # [1, h, s]: max_k |dq_ik|
    bound = 2.0 ** -14 * SCALE * kmax * c.abs()
    assert bool((dq_rows <= bound).all()), float((dq_rows / (SCALE * kmax * c.abs())).max())
    # dk_j = scale sum_i dS_ij Q_i: the same eps on every term
    qmax = q.double().abs().amax()
    dk_rows = torch.as_tensor(dk).double().abs().amax(dim=2)
    assert float(dk_rows.max()) <= 2.0 ** -14 * SCALE * qmax * float(c.abs().sum(dim=2).max())
    # FlashAttention-2's D, rowsum(dO * O) from the bf16 O the forward wrote, gives dS_ij = P_ij (c_i - D_i)
    # and dq_i = scale sum_j dS_ij K_j (P in float64): most rows break the bound
    d_o = (dy.double() * torch.as_tensor(o).double()).sum(dim=2)  # [1, h, s]
    qt, kt = q.double().transpose(-1, -2), k.double().transpose(-1, -2)  # [1, h, s, D]
    logits = (SCALE * qt @ kt.transpose(-1, -2)).masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), -torch.inf)
    dq_o = SCALE * (torch.softmax(logits, dim=-1) * (c - d_o)[..., None]) @ kt
    broken = dq_o.abs().amax(dim=3) > bound
    assert float(broken.double().mean()) > 0.5, float(broken.double().mean())


def test_d_from_o_for_a_block_of_a_larger_problem():
    # A block of ring attention: the forward ran over all 256 keys, the block's backward sees the first 128 with
    # the GLOBAL o and lse. Its rows' keys fit one chunk, but the visit holds only part of each row, so D must be
    # rowsum(o * dO) (``d_from_o=True``). The reference is the same formula in float64 on the same o and lse:
    # dS = P (dP - D) with P = exp(scale S - lse) over the block's keys. Everything is float32 here, so the
    # kernel matches it to float32 rounding (bound 1e-4 relative to the largest dq, as tests/api/test_ops.py);
    # D summed over the block's own keys instead (the default) misses the other block's sum P dP, an O(1) change.
    g = torch.Generator().manual_seed(3)
    h, s = 2, 256
    q, k, v, dy = (torch.randn(1, h, D, s, generator=g) for _ in range(4))
    o, lse = attention_fwd(q, k, v, softmax_scale=SCALE, mixed_precision=True)
    o, lse = torch.as_tensor(o), torch.as_tensor(lse)
    kb, vb = k[..., :128].contiguous(), v[..., :128].contiguous()
    lse_rows = lse.transpose(-1, -2).reshape(1, h, s).double()  # kernel layout [.., 128, s // 128] -> [.., s]
    qt, kt, vt = (t.double().transpose(-1, -2) for t in (q, kb, vb))  # [1, h, rows, D]
    p = torch.exp(SCALE * qt @ kt.transpose(-1, -2) - lse_rows[..., None])
    dp = dy.double().transpose(-1, -2) @ vt.transpose(-1, -2)
    d_glob = (o.double() * dy.double()).sum(dim=2)[..., None]
    ref = SCALE * (p * (dp - d_glob)) @ kt  # dq [1, h, s, D]
    dq_o = torch.as_tensor(attention_bwd(q, kb, vb, o, dy, lse, softmax_scale=SCALE, mixed_precision=True,
                                         d_from_o=True)[0]).double().transpose(-1, -2)
    dq_own = torch.as_tensor(attention_bwd(q, kb, vb, o, dy, lse, softmax_scale=SCALE,
                                           mixed_precision=True)[0]).double().transpose(-1, -2)
    scale_ref = float(ref.abs().max())
    assert float((dq_o - ref).abs().max()) <= 1e-4 * scale_ref
    assert float((dq_own - ref).abs().max()) > 1e-2 * scale_ref
