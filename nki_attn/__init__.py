"""nki-attn: flash-attention forward and backward kernels for AWS Trainium in NKI, with a CPU simulator.

Public PyTorch API (autograd, torch.compile, FakeTensor/meta; CPU tensors on the simulator, XLA tensors on
Trainium): ``flash_attn_func``, ``flash_attn_varlen_func`` and FlashAttention's packed variants
(``flash_attn_qkvpacked_func``, ``flash_attn_kvpacked_func``, ``flash_attn_varlen_qkvpacked_func``,
``flash_attn_varlen_kvpacked_func``), ``scaled_dot_product_attention``. Each checks its arguments once into an
``nki_attn.spec.AttentionSpec`` and runs the one custom-op pair ``torch.ops.nki_attn.attention_fwd`` /
``attention_bwd`` (``nki_attn.ops.attention`` / ``attention_backward``, FlashAttention's layout, padding inside).
Hugging Face transformers: ``nki_attn.integrations.transformers.register()``.
Any mask, skipped by blocks (torch's FlexAttention API): ``create_block_mask`` -> ``BlockMask``, ``flex_attention``
(``nki_attn.flex``), prebuilt mask_mods in ``nki_attn.masks``.
Subpackages: ``nki_attn.kernels`` (the NKI kernels), ``nki_attn.sim`` (the simulator of the NKI API),
``nki_attn.backend`` (real ``nki`` or simulator), ``nki_attn.harness`` (the correctness harness),
``nki_attn.profiler`` (modeled profiles).
"""
__version__ = "0.1.0"
__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func",
           "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func", "scaled_dot_product_attention",
           "flex_attention", "create_block_mask", "BlockMask"]
_FLEX = {"flex_attention": "flex", "create_block_mask": "block_mask", "BlockMask": "block_mask"}


def __getattr__(name):
    # The torch API is imported on first use, so `import nki_attn.sim` (kernels, the simulator, the CLI's
    # other commands) does not pay for importing torch.
    if name in _FLEX:
        import importlib
        return getattr(importlib.import_module(f".{_FLEX[name]}", __name__), name)
    if name in __all__:
        from . import attention
        return getattr(attention, name)
    raise AttributeError(f"module 'nki_attn' has no attribute {name!r}")
