"""Torch golden models for the nki-attn kernels.

Independent of the kernel code (nothing here imports ``nki_attn``).  Every
kernel result is judged against these functions; their semantics and
precision model are documented in the two modules and in
``docs/semantics.md``.
"""

from .attention_bwd_torch import attention_bwd_torch_ref, softmax_dx
from .attention_fwd_torch import attention_fwd_torch_ref, compute_o_lse, packing_bounds

__all__ = [
    "attention_bwd_torch_ref",
    "attention_fwd_torch_ref",
    "compute_o_lse",
    "packing_bounds",
    "softmax_dx",
]
