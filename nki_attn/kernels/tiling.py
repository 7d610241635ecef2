"""Trace-time decisions about which (query tile, key tile) pairs a mask leaves visible.

Positions are absolute token indices: a query tile covers rows [q0, q1), a key tile columns [k0, k1). Causal
keeps key j for query i when j <= i; a sliding window W additionally needs j >= i - W + 1. Sequence-packing
bounds are runtime data, so they never skip a tile.
"""


def tile_visible(q0, q1, k0, k1, causal, window):
    """True when at least one (query, key) pair of the two tiles is visible: the tile must be computed."""
    if causal and k0 > q1 - 1:
        return False  # every key is after every query
    if window and k1 - 1 < q0 - window + 1:
        return False  # every key is before every query's window
    return True


def tile_fully_visible(q0, q1, k0, k1, causal, window):
    """True when every pair of the two tiles is visible: no element mask is needed."""
    if causal and k1 - 1 > q0:
        return False  # some key is after the first query
    if window and k0 < q1 - 1 - window + 1:
        return False  # some key is before the last query's window
    return True
