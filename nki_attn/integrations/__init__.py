"""Integrations of the NKI attention ops with other libraries (``nki_attn.integrations.transformers``)."""
