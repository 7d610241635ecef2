"""What both attention kernels share: the constants, the step protocol, and the small helpers written once.

**The step protocol.** Every variant of the attention (soft-capping, ALiBi, the masks, dropout) is a *step*:
a module-level function with ONE signature, the same in the forward and the backward::

    step(cfg, tile, item, x) -> x

``cfg`` is the kernel's trace-time config (built once per launch), ``tile`` the ``Tile`` being computed (its
position and band classification, fixed at trace time), ``item`` the ``Item`` of the (batch, kv head) work item
(its runtime tiles: slopes, packing bounds, the dropout seed, ...), and ``x`` the tile's data at that stage. Each
kernel picks its steps ONCE per launch from its config into a ``Steps`` object; the drivers run the lists in
order and never test a variant. The stages, in the order a tile goes through them:

    score         S -> S           before the exponent: the score modifications (``score_mods.SCORE_MODS``: the
                                   logit scale, soft-capping, ALiBi, the additive bias), in rank order
    mask_full     S -> S           masking of a FULL tile (forward: the eviction with the row max; backward: none)
    mask_partial  S -> S           masking of a PARTIAL tile (packing bounds; forward: also the band and the
                                   block mask's bitmap, ``block_mask_scores``)
    p_mask        P -> P           after the exponent (backward: the band's element masks on P, the block
                                   mask's bitmap, ``block_mask_probs``)
    prob          P -> P           the P operand of the value matmul (PV / dV): dropout
    grad          P -> P           backward: the P operand of dS (soft-capping's chain rule)
    ds            dP -> dS         backward: ``dS = (dP - D) * P`` (dropout multiplies dP first; with the bias's
                                   gradient it also writes dS of the logits to HBM)
    ds_post       dS -> dS         backward: the dS operand of dK / dQ (the logit scale's ``dS * scale[h]``)

and the hooks ``f(cfg, hbm, item)`` once per launch or work item (``Steps``: ``launch``, ``item_open``,
``item_start``, ``item_end``).

A step that needs what an earlier one made for the same tile reads it from ``tile.saved`` (a dict: soft-capping's
tanh for its gradient, dropout's keep multiplier for dS, P as the exponent left it). Each score modification is
declared ONCE, as a row of ``score_mods.SCORE_MODS`` naming its steps in both kernels by the stages above, its
argument check, its backward SBUF bytes and its gradient output; the per-head logit scale is the worked example
(one score step ``S -> S * scale[h]``, ``score_mods.logit_scale_scores``, the same function in both kernels,
and in the backward one ``ds_post`` step for its gradient and the scale of dS).

**The scale convention** (both kernels, no switch): ``softmax_scale`` is applied in float32, never to an
input-dtype operand. The score matmul gives the unscaled S = Q^T K in float32 PSUM; the forward takes its row max
m on S and the exponent applies the scale as the activation's float32 ``scale`` with the bias ``-scale m``
(with soft-capping the tanh's input ``scale`` is ``softmax_scale / cap`` and the exponent's is the cap); the
LSE it writes is ``scale m + log(l)``, the log-sum-exp of the float32 ``scale S`` (the configs' ``exp_scale``).
The backward recomputes the same S from the same Q and K and feeds it to ONE activation with the same float32
``scale`` and the bias ``-LSE``, so P is computed from exactly the scaled scores the forward's LSE was taken
over. The gradients get the scale on their way out of PSUM: dK = scale Q^T dS on the dK eviction, dQ = scale dS
K on the dQ eviction. Folding the scale into Q instead would round every ``scale q`` to the input dtype, one more
rounding of every score (2^-9 relative in bfloat16) unless the scale is a power of two.
"""
from ..backend import nisa, nl

PMAX = 128  # partitions: query rows per query tile, keys per chunk
K_TILE = 512  # keys per key tile: 128 x 512 fp32 is one 2 KiB PSUM bank per partition
FP32_MIN = -3.4028235e38  # the mask value (range_select accepts nothing else); exp of it is exactly 0
FP32_MAX = 3.4028235e38


class Tile(nl.NKIObject):
    """One score tile at trace time: query rows ``[q0, q0 + 128)`` (query tile ``t``) of query head ``hq`` (``h``
    within the kv head's group) of batch ``b``, keys ``[k0, k0 + kw)``; ``needs_lo`` / ``needs_hi`` and ``kind``
    from ``band.classify_keys``. ``rows``: the per-row state of the tile's rows (dropout's row words, or None);
    ``row_max``: the forward's column for the masked row max; ``key_idx``: the key index of every column (trn1
    packing in the forward); ``d_col``: the backward's D column. ``saved``: what a step leaves for a later one.
    ``runs`` / ``srcs``: a block-mask tile the forward split at its SKIP chunks (``block_segments``): the ``Tile``
    of each run (the tile's columns hold their chunks back to back), and each run's score-step output (None: the
    tile's own S holds every run)."""

    def __init__(self, b, hq, h, t, k0, kw, needs_lo, needs_hi, kind, rows=None, row_max=None, key_idx=None,
                 d_col=None):
        self.b = b
        self.hq = hq
        self.h = h
        self.t = t
        self.q0 = t * PMAX
        self.k0 = k0
        self.kw = kw
        self.needs_lo = needs_lo
        self.needs_hi = needs_hi
        self.kind = kind
        self.rows = rows
        self.row_max = row_max
        self.key_idx = key_idx
        self.d_col = d_col
        self.saved = {}
        self.runs = None
        self.srcs = None


class Item(nl.NKIObject):
    """One (batch ``b``, kv head ``kvh``) work item and its runtime tiles (None when unused): ``slopes`` the ALiBi
    coefficient ``-slope / e`` ``[128, group]`` (e: the exponent's scale), ``slopes_pos`` its negation (backward);
    ``alibi_st`` / ``pos_tab`` the forward's TensorE ALiBi operands; ``bounds`` ``(bmin, bmax)`` key bounds
    ``[128, n_qt]``; ``seed`` the dropout seed tile; ``sinks`` the forward's starting statistics ``(m0, l0)``
    from the sinks; the backward's row statistics ``neg_lse`` / ``dsum`` ``[128, group, nq]`` (-LSE and D of
    every member), its D matmul's ``ones`` column and its dQ reload's ``ident`` identity (launch-wide); ``bias``
    the additive bias in HBM and ``dbias`` the backward's float32 HBM output of its gradient (``bias_scores``).
    ``state``: a score modification's own per-item operands by name, set by its ``item_start`` steps (the
    per-head logit scale's ``state["logit_scale"]`` ``[128, group]`` and the backward's ``state["dlogit"]``
    ``[128, group, nq]``): a new modification needs no new field here."""

    def __init__(self, b, kvh, slopes=None, slopes_pos=None, seed=None, bounds=None, alibi_st=None, pos_tab=None,
                 sinks=None, neg_lse=None, dsum=None, ones=None, ident=None, bias=None, dbias=None):
        self.b = b
        self.kvh = kvh
        self.slopes = slopes
        self.slopes_pos = slopes_pos
        self.seed = seed
        self.bounds = bounds
        self.alibi_st = alibi_st
        self.pos_tab = pos_tab
        self.sinks = sinks
        self.neg_lse = neg_lse
        self.dsum = dsum
        self.ones = ones
        self.ident = ident
        self.bias = bias
        self.dbias = dbias
        self.state = {}


class Hbm(nl.NKIObject):
    """The HBM tensors of one launch, inputs and outputs (None when the kernel has no such tensor): q ``[bs,
    nheads, d_qk, seqlen_q]``, k ``[bs, nheads_kv, d_qk, seqlen_k]``, v ``[bs, nheads_kv, d_v, seqlen_k]``, o /
    dy ``[bs, nheads, d_v, seqlen_q]``, lse ``[bs, nheads, 128, seqlen_q // 128]``, sinks; the backward's
    gradients dq, dk, dv, dsinks shaped like their inputs and its fp32 dQ scratch. ``mods``: the score
    modifications' kernel arguments by keyword (``score_mods``: e.g. ``mods["attn_bias"]``); ``grads``: the
    backward's gradient outputs of the score modifications by their name (``grads["logit_scale"]``: float32
    ``[bs, nheads]``)."""

    def __init__(self, q, k, v, o=None, dy=None, lse=None, sinks=None, dq=None, dk=None, dv=None, dsinks=None,
                 dq_scratch=None, mods=None, grads=None):
        self.q = q
        self.k = k
        self.v = v
        self.o = o
        self.dy = dy
        self.lse = lse
        self.sinks = sinks
        self.dq = dq
        self.dk = dk
        self.dv = dv
        self.dsinks = dsinks
        self.dq_scratch = dq_scratch
        self.mods = mods
        if mods is None:
            self.mods = {}
        self.grads = grads
        if grads is None:
            self.grads = {}


class Steps(nl.NKIObject):
    """The steps of one launch, chosen once from the config (module docstring): lists run in order, or one
    function per tile kind. ``key_block`` / ``lse`` / ``rows`` are the forward's once-per-key-block, LSE and
    per-slab row-state steps (``score_mods._alibi_positions``, ``score_mods._alibi_lse``, ``_dropout_slab``).
    ``ds_post``: the backward's dS steps. The per-launch and per-work-item hooks ``f(cfg, hbm, item)``:
    ``launch`` (once per launch, on the launch-wide ``Item``), ``item_open`` (the backward: before the work
    item's own loads), ``item_start`` (after them: loading per-head operands into ``item``, zero fills) and
    ``item_end`` (writing per-head results)."""

    def __init__(self, score, mask_full, mask_partial, p_mask, prob, grad=None, ds=None, key_block=None, lse=None,
                 rows=None, ds_post=None, launch=None, item_open=None, item_start=None, item_end=None):
        self.score = score
        self.mask_full = mask_full
        self.mask_partial = mask_partial
        self.p_mask = p_mask
        self.prob = prob
        self.grad = grad
        self.ds = ds
        self.key_block = key_block
        self.lse = lse
        self.rows = rows
        self.ds_post = ds_post
        self.launch = launch
        self.item_open = item_open
        self.item_start = item_start
        self.item_end = item_end


def run_steps(cfg, fns, tile, item, x):
    """``x`` through the steps ``fns`` in order."""
    for f in fns:
        x = f(cfg, tile, item, x)
    return x


def mask_step(steps, tile):
    """The masking step of ``tile``'s kind."""
    if tile.kind == "full":
        return steps.mask_full
    return steps.mask_partial


def no_step(cfg, tile, item, x):
    """The identity step (a stage with nothing to do for this tile kind)."""
    return x


# ----------------------------------------------------------------------------------------------- shared helpers
def itemsize(dtype):
    """Bytes per element of the kernels' dtypes (float32, or a 16-bit type)."""
    if str(dtype) == str(nl.float32):
        return 4
    return 2


def head_dim_tiles(d):
    """Partition tiles of a head dimension ``d`` (1..256): ``[(first row, rows), ...]``, full tiles of 128 rows
    and one remainder tile (199 -> ``[(0, 128), (128, 71)]``). Q/K (``d_qk``) and V/O (``d_v``) get one list
    each."""
    tiles = []
    for start in range(0, d, PMAX):
        tiles.append((start, min(PMAX, d - start)))
    return tiles


def shape_of(t):
    """The shape of a tensor argument as a tuple (comparable with ``==``)."""
    return tuple(t.shape)


def is_number(x):
    """An int or float, not a bool."""
    return (isinstance(x, int) or isinstance(x, float)) and not isinstance(x, bool)


def is_array(x):
    """What the kernels receive for a tensor argument: not a Python scalar, sequence or string."""
    return not (is_number(x) or isinstance(x, bool) or isinstance(x, str) or isinstance(x, tuple)
                or isinstance(x, list))


def supported_dtype(dtype):
    """True for the kernels' input dtypes: float32, bfloat16, float16 (compared by name, as NKI dtypes are)."""
    name = str(dtype)
    return name == str(nl.float32) or name == str(nl.bfloat16) or name == str(nl.float16)


def per_member(cfg, stat, j0, n_members):
    """The forward's view of a per-head ``[128, group]`` statistic in the member order of the block starting at
    member ``j0`` (member j is head ``j % group``): whole query tiles repeat the group (stride-0 pattern), a block
    inside one query tile is a slice."""
    group = cfg.group
    if group <= cfg.block_members_max:
        return stat.ap(pattern=[[group, PMAX], [0, n_members // group], [1, group]], offset=0)
    h0 = j0 % group
    return stat[:, h0:h0 + n_members]


def spmd_items(n_items):
    """``[start, stop)`` of the work items this core runs: the items are split into contiguous ranges over the
    cores of the launch (LNC2: ``nl.program_id``)."""
    if nl.program_ndim() == 0:
        n_prog = 1
        pid = 0
    else:
        n_prog = nl.num_programs(0)
        pid = nl.program_id(0)
    per_core = (n_items + n_prog - 1) // n_prog
    start = pid * per_core
    stop = min(n_items, start + per_core)
    return start, stop


def load_slopes(alibi_slopes, nheads, group, b, kvh):
    """ALiBi slopes of the kv head's query heads broadcast to the 128 partitions: ``[128, group]`` float32, one
    stride-0 DMA from the ``[bs, nheads]`` HBM tensor."""
    sl = nl.ndarray((PMAX, group), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=sl, src=alibi_slopes.ap(pattern=[[0, PMAX], [1, group]], offset=b * nheads + kvh * group))
    return sl


def load_packing_bounds(bound_min, bound_max, n_qt):
    """Packing bounds as SBUF ``[128, n_qt]`` float32 columns (element ``(p, t)`` is query row ``t * 128 + p``):
    key j is visible to query q iff ``bmin[q] <= j < bmax[q]``."""
    bmin = nl.ndarray((PMAX, n_qt), dtype=nl.float32, buffer=nl.sbuf)
    bmax = nl.ndarray((PMAX, n_qt), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=bmin, src=bound_min.ap(pattern=[[1, PMAX], [PMAX, n_qt]], offset=0))
    nisa.dma_copy(dst=bmax, src=bound_max.ap(pattern=[[1, PMAX], [PMAX, n_qt]], offset=0))
    return bmin, bmax


# ----------------------------------------------------------------------------------------------- block masks
# The element mask of a PARTIAL key tile of a block mask (``band`` "Block masks"). The tile's run of 128-key
# chunks is cut into *segments* of one union class (``block_segments``): a FULL segment needs no mask, a SKIP
# segment (hidden for every pair) is filled with the mask value by one memset, and only a PARTIAL segment reads
# its bits from the HBM store (one DMA of ``width / 8`` bytes per query row), turns them into a uint8 keep
# predicate by ONE VectorE bitwise AND with the launch's bit-select constant and is masked by one select. A random mask
# of FULL and SKIP blocks thus never touches a bitmap, and a diagonal block costs its own 128 columns, not the
# tile's 512. FULL tiles never reach these steps.
BLOCK_SKIP = 0
BLOCK_PARTIAL = 1
BLOCK_FULL = 2
CHUNK_BYTES = PMAX // 8  # bytes of one query row of one 128-key chunk's bitmap


def block_partial_count(row, c0, c1):
    """The PARTIAL chunks among chunks ``[c0, c1)`` of a row of union classes (their store slots)."""
    n = 0
    for c in range(c0, c1):
        if row[c] == BLOCK_PARTIAL:
            n = n + 1
    return n


def block_segments(cfg, tile):
    """The segments of ``tile``'s run: ``[[class, first column, end column, first key column], ...]`` in key
    order, each a maximal run of chunks of one union class; columns count from the tile's first column, key
    columns from its first key ``tile.k0``. They are equal unless the forward split the tile (``tile.runs``:
    its columns then hold only the runs' chunks, back to back): a segment then never spans two runs when each run
    has its own source (``tile.srcs``), and spans the gap between them otherwise (one instruction for both)."""
    row = cfg.block_mask.rows[tile.t]
    c0 = tile.k0 // PMAX
    keys = []  # the key column of each of the tile's chunks, and the run it belongs to
    run_of = []
    if tile.runs is None:
        for c in range(tile.kw // PMAX):
            keys.append(c * PMAX)
            run_of.append(0)
    else:
        for r in range(len(tile.runs)):
            rt = tile.runs[r]
            for c in range(rt.kw // PMAX):
                keys.append(rt.k0 - tile.k0 + c * PMAX)
                run_of.append(r)
    segs = []
    for j in range(len(keys)):
        a = j * PMAX
        cls = row[c0 + keys[j] // PMAX]
        joined = False
        if len(segs) > 0 and segs[len(segs) - 1][0] == cls:
            joined = tile.srcs is None or run_of[j] == run_of[j - 1]
        if joined:
            segs[len(segs) - 1][2] = a + PMAX
        else:
            segs.append([cls, a, a + PMAX, keys[j]])
    return segs


def block_bitsel():
    """The bit-select constant of a launch: uint8 ``[128, 512]``, column c holds ``1 << (c % 8)`` (eight
    memsets, once per launch); ANDed with a row's bytes read 8 times over (a stride-0 view) it is non-zero
    exactly where the key's bit is set."""
    sel = nl.ndarray((PMAX, K_TILE // 8, 8), dtype=nl.uint8, buffer=nl.sbuf)
    for j in range(8):
        nisa.memset(dst=sel[:, :, j], value=1 << j, engine=nisa.engine.gpsimd)
    return sel.reshape((PMAX, K_TILE))


def block_keep(cfg, tile, ka, w):
    """The keep predicate of a PARTIAL segment of ``w`` columns whose first key is ``tile.k0 + ka`` (a segment of
    ``block_segments``; its PARTIAL chunks have consecutive slots even across SKIP chunks, which have none): uint8
    ``[128, w]``, non-zero where the key is visible to the query row. Its bytes are one DMA from the store (the
    segment's chunks have consecutive slots), the bits one VectorE AND. (On GpSimdE, the choice while a PARTIAL
    tile ANDed all its 512 columns, the modeled schedule of cost model v2 is slower for every mask measured at
    4096 tokens now that only the PARTIAL chunks are: causal documents, windows within documents, dilated.)"""
    bl = cfg.block_mask
    bb = 0
    if bl.n_b > 1:
        bb = tile.b
    hh = 0
    if bl.n_h > 1:
        hh = tile.hq
    c0 = tile.k0 // PMAX
    # the slot of the segment's first chunk for this (batch, head) pair (``band.block_slot``; not imported:
    # band imports steps)
    # slot0 numbers the key tile's PARTIAL chunks from its first key; a tile may start inside it (the backward
    # splits a key tile at its SKIP chunks), so count from the key tile's first chunk
    kt0 = (tile.k0 // K_TILE) * (K_TILE // PMAX)
    slot = bl.slot0[tile.t][tile.k0 // K_TILE] + block_partial_count(bl.rows[tile.t], kt0, c0 + ka // PMAX)
    col = ((bb * bl.n_h + hh) * bl.n_slots + slot) * CHUNK_BYTES
    nb = w // 8
    raw = nl.ndarray((PMAX, nb), dtype=nl.uint8, buffer=nl.sbuf)
    nisa.dma_copy(dst=raw, src=bl.bits[:, col:col + nb])
    keep = nl.ndarray((PMAX, w), dtype=nl.uint8, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=keep, data1=raw.ap(pattern=[[nb, PMAX], [1, nb], [0, 8]], offset=0),
                       data2=bl.bitsel[:, 0:w], op=nl.bitwise_and, engine=nisa.engine.vector)
    return keep


def block_mask_scores(cfg, tile, item, s):
    """Forward mask step of a PARTIAL block-mask tile: S (PSUM, or a score step's SBUF output) -> float32 SBUF
    with FP32_MIN where the mask hides the key, and the row max into ``tile.row_max``. Per segment
    (``block_segments``): FULL one eviction (``tensor_scalar_reduce``), PARTIAL one select against its keep
    predicate (``block_keep``, made before the chain), SKIP one GpSimdE memset of FP32_MIN. The VectorE
    instructions chain the row max through the engine's accumulator (the first resets it, the last writes it
    out); nothing else runs on VectorE between them (the memsets are GpSimdE's)."""
    segs = block_segments(cfg, tile)
    keeps = []
    last = -1
    for i in range(len(segs)):
        keeps.append(None)
        if segs[i][0] == BLOCK_PARTIAL:
            keeps[i] = block_keep(cfg, tile, segs[i][3], segs[i][2] - segs[i][1])
        if segs[i][0] != BLOCK_SKIP:
            last = i
    dst = nl.ndarray((PMAX, tile.kw), dtype=nl.float32, buffer=nl.sbuf)
    cmd = nisa.reduce_cmd.reset_reduce
    for i in range(len(segs)):
        a = segs[i][1]
        b = segs[i][2]
        res = None
        if i == last:
            res = tile.row_max
        src = _segment_source(tile, s, a, b)
        if segs[i][0] == BLOCK_SKIP:
            nisa.memset(dst=dst[:, a:b], value=FP32_MIN, engine=nisa.engine.gpsimd)
        elif segs[i][0] == BLOCK_FULL:
            nisa.tensor_scalar_reduce(dst=dst[:, a:b], data=src, op0=nl.multiply, operand0=1.0,
                                      reduce_op=nl.maximum, reduce_res=res, reduce_cmd=cmd)
            cmd = nisa.reduce_cmd.reduce
        else:
            nisa.select_reduce(dst=dst[:, a:b], predicate=keeps[i], on_true=src, on_false=FP32_MIN,
                               reduce_res=res, reduce_cmd=cmd, reduce_op=nl.maximum)
            cmd = nisa.reduce_cmd.reduce
    return dst


def _segment_source(tile, s, a, b):
    """The scores of the tile's columns ``[a, b)`` (one segment of ``block_segments``): ``s`` itself, or for a
    split tile whose runs went through score steps one by one, the slice of its run's output."""
    if tile.srcs is None:
        return s[:, a:b]
    r0 = 0
    for r in range(len(tile.runs)):
        r1 = r0 + tile.runs[r].kw
        if a >= r0 and b <= r1:
            return tile.srcs[r][:, a - r0:b - r0]
        r0 = r1
    assert False, "a segment spans two runs of a split tile"


def block_mask_probs(cfg, tile, item, p):
    """Backward P step of a block mask: on a PARTIAL tile, per segment (``block_segments``), a SKIP segment is
    zeroed by one GpSimdE memset and a PARTIAL one by one select against its keep predicate (the exponent read
    S straight from PSUM; a hidden score's exp may overflow, the memset or select replaces it); FULL segments
    and FULL tiles pass unchanged."""
    if tile.kind != "partial":
        return p
    segs = block_segments(cfg, tile)
    for i in range(len(segs)):
        a = segs[i][1]
        b = segs[i][2]
        if segs[i][0] == BLOCK_SKIP:
            nisa.memset(dst=p[:, a:b], value=0.0, engine=nisa.engine.gpsimd)
        elif segs[i][0] == BLOCK_PARTIAL:
            keep = block_keep(cfg, tile, segs[i][3], b - a)
            nisa.select_reduce(dst=p[:, a:b], predicate=keep, on_true=p[:, a:b], on_false=0.0)
    return p
