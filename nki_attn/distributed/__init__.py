"""Context parallelism: ring attention over torch.distributed on the NKI kernels.

Sequences too long for one NeuronCore are sharded along the sequence across the ranks of a process group; each
rank computes the attention rows of its own queries while the keys and values travel around the ring.

- ``ring_flash_attn_func`` (and ``_kvpacked`` / ``_qkvpacked``): contiguous shards, ring-flash-attn's /
  FlashAttention's argument names plus ``group``; ``ring_shard`` / ``ring_unshard`` cut and join.
- ``zigzag_ring_flash_attn_func`` (and packed variants): the load-balanced causal layout (rank r holds chunks r
  and 2R-1-r of 2R); ``zigzag_shard`` / ``zigzag_unshard``; ``work_balance_report`` compares the per-rank work
  of both layouts.
- ``run_local``: run a function on N local processes in a gloo group over loopback (tests, examples).
- ``record_steps``: per-step bytes sent and kernel time, for scripts/figures.py ring.

Any process-group backend with point-to-point isend/irecv works; gloo on CPU is what has been run (the kernels on
the simulator). docs/distributed.md explains the algorithm, layouts, tolerances and what was verified where.
"""
from .layout import work_balance  # noqa: F401
from .local import run_local  # noqa: F401
from .ring import (record_steps, ring_flash_attn_func, ring_flash_attn_kvpacked_func,  # noqa: F401
                   ring_flash_attn_qkvpacked_func, zigzag_ring_flash_attn_func, zigzag_ring_flash_attn_kvpacked_func,
                   zigzag_ring_flash_attn_qkvpacked_func)
from .shard import (format_work_balance, ring_shard, ring_unshard, work_balance_report, zigzag_shard,  # noqa: F401
                    zigzag_unshard)

__all__ = ["ring_flash_attn_func", "ring_flash_attn_kvpacked_func", "ring_flash_attn_qkvpacked_func",
           "zigzag_ring_flash_attn_func", "zigzag_ring_flash_attn_kvpacked_func",
           "zigzag_ring_flash_attn_qkvpacked_func", "ring_shard", "ring_unshard", "zigzag_shard", "zigzag_unshard",
           "work_balance_report", "format_work_balance", "work_balance", "run_local", "record_steps"]
