"""A small demonstration kernel: ``out = exp(scale * lhsT.T @ rhs)`` tile by tile.

It exercises the path every attention kernel uses (DMA in, TensorE matmul into PSUM, one ScalarE activation
reading PSUM, DMA out) and serves as the simulator's speed benchmark workload (`scripts/bench.py sim-speed`).
"""
from ..backend import nisa, nki, nl


@nki.jit
def matmul_exp(lhsT, rhs, scale=1.0):
    """``out[m, n] = exp(scale * sum_k lhsT[k, m] * rhs[k, n])``.

    Args:
        lhsT: ``[K, M]`` in HBM, K <= 128 and M a multiple of 128 (already transposed: K on the partition axis).
        rhs: ``[K, N]`` in HBM, N a multiple of 512.
        scale: compile-time float applied inside the exponent.
    Returns:
        out: ``[M, N]`` float32 in shared HBM.
    """
    k, m = lhsT.shape
    _, n = rhs.shape
    out = nl.ndarray((m, n), dtype=nl.float32, buffer=nl.shared_hbm)
    for mi in range(m // 128):
        lhs_tile = nl.ndarray((k, 128), dtype=lhsT.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=lhs_tile, src=lhsT[:, mi * 128:(mi + 1) * 128])
        for ni in range(n // 512):
            rhs_tile = nl.ndarray((k, 512), dtype=rhs.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=rhs_tile, src=rhs[:, ni * 512:(ni + 1) * 512])
            acc = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.psum)
            nisa.nc_matmul(dst=acc, stationary=lhs_tile, moving=rhs_tile)
            res = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=res, op=nl.exp, data=acc, scale=scale)
            nisa.dma_copy(dst=out[mi * 128:(mi + 1) * 128, ni * 512:(ni + 1) * 512], src=res)
    return out
