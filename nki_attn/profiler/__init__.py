"""Modeled performance of kernels without hardware: a cost model over the simulator's instruction trace.

``params`` holds the per-generation hardware numbers (one table, each with its source), ``model`` turns trace
records into modeled engine time, ``flops`` counts attention FLOPs, ``cli`` implements ``nki-attn profile``.
Every device time this package reports is modeled, not measured (docs/performance.md).
"""
from .model import InstrCost, Profile, instruction_cost, profile  # noqa: F401
from .params import GENERATIONS, TRN1, TRN2, TRN3, Generation, generation  # noqa: F401
