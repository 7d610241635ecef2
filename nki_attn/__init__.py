"""nki-attn: flash-attention forward and backward kernels for AWS Trainium in NKI, with a CPU simulator.

Subpackages: ``nki_attn.kernels`` (the NKI kernels), ``nki_attn.sim`` (the simulator of the NKI API),
``nki_attn.backend`` (real ``nki`` or simulator).
"""
__version__ = "0.1.0"
