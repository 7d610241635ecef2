"""Host side of attention dropout: seeds, and the debug path that returns a kernel-generated keep mask.

    from nki_attn.dropout import make_seed, dropout_mask
    seed = make_seed(1234, offset=step)                 # int32 [2] (seed, offset), the kernels' dropout_seed
    keep = dropout_mask(seed, 0.1, bs, nheads, sq, sk)  # bool [bs, nheads, sq, sk] computed by the NKI tile step

``dropout_mask`` runs ``nki_attn.kernels.dropout.dropout_mask_kernel`` (the same ``dropout_scale_tile`` the
attention kernels call) and returns its decisions; ``golden.dropout.keep_mask`` computes the same mask in torch
(the tests compare the two bit for bit). Use it at small sizes: it writes ``bs * nheads * sq * sk`` floats.
The hash, the seed format and the keep rule are in docs/semantics.md, section "Dropout".
"""
import numbers

import numpy as np
import torch

from .kernels import dropout as _kd

MAX_ELEMENTS = 1 << 26  # the debug path materialises the mask; refuse what would not fit comfortably


def make_seed(seed: int, offset: int = 0) -> torch.Tensor:
    """The kernels' ``dropout_seed``: int32 ``[2]`` = ``(seed, offset)``; each an int in ``[-2**31, 2**32)``
    taken modulo 2**32. A new ``offset`` per training step gives a new, independent mask for a fixed ``seed``."""
    for name, val in (("seed", seed), ("offset", offset)):
        if isinstance(val, bool) or not isinstance(val, numbers.Integral):
            raise ValueError(f"make_seed: {name} = {val!r} must be an int")
        if not -(1 << 31) <= int(val) < (1 << 32):
            raise ValueError(f"make_seed: {name} = {val} must be in [-2**31, 2**32)")
    words = [int(v) & 0xFFFFFFFF for v in (seed, offset)]
    return torch.tensor([w - (1 << 32) if w >= (1 << 31) else w for w in words], dtype=torch.int32)


def seed_from_generator(generator: torch.Generator) -> torch.Tensor:
    """A ``dropout_seed`` drawn from ``generator`` (two 32-bit words), for APIs that take a ``torch.Generator``."""
    if not isinstance(generator, torch.Generator):
        raise ValueError(f"generator: got {type(generator).__name__}; must be a torch.Generator")
    words = torch.randint(-(1 << 31), 1 << 31, (2,), generator=generator, dtype=torch.int64)
    return words.to(torch.int32)


def _check_seed(dropout_seed):
    if not isinstance(dropout_seed, (torch.Tensor, np.ndarray)):
        raise ValueError(f"dropout_seed: got {type(dropout_seed).__name__}; must be an int32 or uint32 tensor of "
                         f"shape [2] (seed, offset), e.g. nki_attn.dropout.make_seed(1234)")
    name = str(dropout_seed.dtype).split(".")[-1]
    if name not in ("int32", "uint32"):
        raise ValueError(f"dropout_seed.dtype = {dropout_seed.dtype}; must be int32 or uint32")
    if tuple(dropout_seed.shape) not in ((1,), (2,)):
        raise ValueError(f"dropout_seed.shape = {tuple(dropout_seed.shape)}; must be (2,) (seed, offset) or (1,) "
                         f"(seed; offset 0)")


def dropout_mask(dropout_seed, dropout_p: float, bs: int, nheads: int, seqlen_q: int, seqlen_k: int,
                 q_tile: int = 128, k_tile: int = 512, k_start: int = 0, return_scale: bool = False):
    """The keep mask the kernels use, computed by the NKI dropout tile step (debug path).

    Args:
        dropout_seed: int32/uint32 tensor (torch or numpy) ``[2]`` (or ``[1]``: offset 0).
        dropout_p: float in ``[0, 1)``.
        bs, nheads, seqlen_q, seqlen_k: problem sizes (``h`` is the query head).
        q_tile (1..128), k_tile (1..512): the tile decomposition the kernel uses (the result does not depend on
            it; the tests vary it). k_start: absolute key column of output column 0.
        return_scale: also return the float32 multiplier tile values ``M / (1 - p)``.
    Returns:
        bool torch tensor ``[bs, nheads, seqlen_q, seqlen_k]`` (True = kept), element ``[b, h, i, c]`` for key
        column ``k_start + c``; with ``return_scale``, ``(mask, scale)``.
    """
    _check_seed(dropout_seed)
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p = {dropout_p!r}; must be a float in [0, 1)")
    for name, val, lo, hi in (("bs", bs, 1, _kd.MAX_INDEX_IMM), ("nheads", nheads, 1, _kd.MAX_INDEX_IMM),
                              ("seqlen_q", seqlen_q, 1, 1 << 31), ("seqlen_k", seqlen_k, 1, 1 << 31),
                              ("q_tile", q_tile, 1, _kd.PMAX), ("k_tile", k_tile, 1, _kd.MAX_COLS),
                              ("k_start", k_start, 0, (1 << 31) - 1)):
        if isinstance(val, bool) or not isinstance(val, numbers.Integral) or not lo <= int(val) <= hi:
            raise ValueError(f"dropout_mask: {name} = {val!r} must be an int in [{lo}, {hi}]")
    if k_start + seqlen_k > (1 << 31):
        raise ValueError(f"dropout_mask: k_start + seqlen_k = {k_start + seqlen_k} exceeds 2**31")
    n = bs * nheads * seqlen_q * seqlen_k
    if n > MAX_ELEMENTS:
        raise ValueError(f"dropout_mask: {n} elements exceed the debug path's limit {MAX_ELEMENTS}; use smaller "
                         f"sizes (the mask depends on (b, h, i, j) only, so any window of it can be checked)")
    seed = dropout_seed.numpy() if isinstance(dropout_seed, torch.Tensor) else dropout_seed
    out = _kd.dropout_mask_kernel(seed, float(dropout_p), int(bs), int(nheads), int(seqlen_q), int(seqlen_k),
                                  q_tile=int(q_tile), k_tile=int(k_tile), k_start=int(k_start))
    scale = torch.from_numpy(np.array(out, dtype=np.float32))
    mask = scale != 0
    return (mask, scale) if return_scale else mask
