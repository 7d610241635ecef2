"""NKI kernels. Each imports the NKI API only through ``nki_attn.backend``."""
