"""One attention call, described once: ``AttentionSpec``, and the argument checks that build it.

Every PyTorch entry point (``flash_attn_*``, ``scaled_dot_product_attention``, ring attention, the Hugging Face
integration) checks its arguments here, once, before any work starts, and gets an ``AttentionSpec``; everything
below (``nki_attn.ops``: the custom-op pair, the padding, the kernel keywords) takes the spec as given. A bad
argument raises ``TypeError`` / ``ValueError`` (``NotImplementedError`` for what the kernels cannot express) with
the message ``"<entry point>: <argument>=<value>: <rule>"``.

Score modifications (soft-capping, ALiBi, the additive bias, the per-head logit scale) are declared once, in
``SCORE_MODS`` (one ``ScoreMod`` row each: names, check, formula, gradient, kernel padding); the spec's fields,
the op pair's inputs, the entry points' keyword-only arguments and ``nki_attn.flex``'s markers come from it.

Public: ``AttentionSpec``, ``ScoreMod`` / ``SCORE_MODS`` / ``Dims`` / ``check_mods``, ``flash_spec`` (the checks of ``flash_attn_func``, for callers that bring their own
entry point), ``check_bias`` (an additive bias as the spec's 4-D view), ``window_pair``, ``window_intervals``, ``resolve_scale``, ``check_device``, ``dropout_seed_tensor``,
``fail``, ``PMAX``, ``MAX_D_HEAD``, ``MAX_EXACT_KEY``, ``DTYPES``.
"""
import dataclasses
import inspect
import math
import numbers
from typing import Optional

import torch

from .backend import BACKEND
from .dropout import make_seed, seed_from_generator

PMAX = 128  # the kernels' tile: sequence lengths reach them as multiples of it
MAX_D_HEAD = 256
MAX_EXACT_KEY = 1 << 24  # key bounds are float32 in the kernels: key indices up to 2**24 are exact
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SEED_MAX = (1 << 32) - 1

__all__ = ["AttentionSpec", "ScoreMod", "SCORE_MODS", "Dims", "check_mods", "flash_spec", "check_bias", "window_pair", "window_intervals", "resolve_scale",
           "check_device", "dropout_seed_tensor", "fail", "PMAX", "MAX_D_HEAD", "MAX_EXACT_KEY", "DTYPES"]


# ----------------------------------------------------------------------------------------------------- checks
def fail(fn, name, value, rule, exc=ValueError):
    """Raise ``exc("<fn>: <name>=<value>: <rule>")``, the message format of every host-side check."""
    raise exc(f"{fn}: {name}={value}: {rule}")


def _is_int(x):
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _check_tensor(fn, name, t):
    if not isinstance(t, torch.Tensor):
        fail(fn, name, type(t).__name__, "must be a torch.Tensor", TypeError)


def _check_bool(fn, name, x):
    if not isinstance(x, bool):
        fail(fn, name, repr(x), "must be a bool (True or False)", TypeError)
    return x


def _check_real(fn, name, x):
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        fail(fn, name, repr(x), "must be a real number", TypeError)
    return float(x)


def _check_dropout(fn, dropout_p):
    p = _check_real(fn, "dropout_p", dropout_p)
    if not 0.0 <= p < 1.0:
        fail(fn, "dropout_p", p, "must be a probability in [0, 1) (kept probabilities are scaled by 1/(1-p))")
    return p


def _check_softcap(fn, softcap):
    cap = _check_real(fn, "softcap", softcap)
    if not (math.isfinite(cap) and cap >= 0.0):
        fail(fn, "softcap", cap, "must be finite and >= 0 (0.0 deactivates soft-capping)")
    return cap


def _check_alibi(fn, alibi_slopes, batch, hq, device):
    """FlashAttention's ALiBi slopes: float32 ``[nheads]`` or ``[batch, nheads]`` (None: no ALiBi)."""
    if alibi_slopes is None:
        return None
    _check_tensor(fn, "alibi_slopes", alibi_slopes)
    shape = tuple(alibi_slopes.shape)
    if shape != (hq,) and shape != (batch, hq):
        fail(fn, "alibi_slopes.shape", shape, f"must be [nheads] = [{hq}] or [batch, nheads] = [{batch}, {hq}]")
    if alibi_slopes.dtype != torch.float32:
        fail(fn, "alibi_slopes.dtype", alibi_slopes.dtype, "must be torch.float32 (as FlashAttention)")
    if alibi_slopes.device != device:
        fail(fn, "alibi_slopes.device", alibi_slopes.device, f"must equal q.device {device}")
    return alibi_slopes


def _check_logit_scale(fn, logit_scale, batch, hq, device, batched=True):
    """The per-head logit scale: float32 ``[nheads]`` or (``batched``) ``[batch, nheads]`` (None: none). Its values
    (finite) are checked where the tensors are real, in the op's body (its row's ``ScoreMod.values``)."""
    if logit_scale is None:
        return None
    if not isinstance(logit_scale, torch.Tensor):
        fail(fn, "logit_scale", type(logit_scale).__name__, "must be a float32 torch.Tensor [nheads] or None",
             TypeError)
    shape = tuple(logit_scale.shape)
    if shape != (hq,) and not (batched and shape == (batch, hq)):
        rule = f"must be [nheads] = [{hq}]" + (f" or [batch, nheads] = [{batch}, {hq}]" if batched else
                                                " (one scale per head, shared by the packed sequences)")
        fail(fn, "logit_scale.shape", shape, rule)
    if logit_scale.dtype != torch.float32:
        fail(fn, "logit_scale.dtype", logit_scale.dtype, "must be torch.float32 (the kernels apply it in float32)",
             TypeError)
    if logit_scale.device != device:
        fail(fn, "logit_scale.device", logit_scale.device, f"must equal q.device {device}")
    return logit_scale


def _logit_rows(logit_scale, batch, hq):
    """``[nheads]`` or ``[batch, nheads]`` logit scales -> float32 ``[batch, nheads]``, differentiable (a
    ``[nheads]`` scale gets the gradient summed over the batch)."""
    if logit_scale is None:
        return None
    return logit_scale.expand(batch, hq).clone(memory_format=torch.contiguous_format)


def check_bias(fn, attn_bias, batch, heads, seqlen_q, seqlen_k, device, name="attn_bias"):
    """An additive bias broadcastable to ``[batch, heads, seqlen_q, seqlen_k]`` (None: no bias) -> its 4-D view
    ``[batch or 1, heads or 1, seqlen_q or 1, seqlen_k or 1]`` for ``AttentionSpec.bias`` (views only, so autograd
    sums the gradient back into the caller's tensor). TypeError for a non-tensor or a dtype other than float32 /
    bfloat16 / float16, ValueError for a shape that does not broadcast or another device. A dim of size > 1
    with stride 0 (an ``expand``-ed view) is narrowed to 1: the kernels then read one copy and the gradient is
    summed over it."""
    if attn_bias is None:
        return None
    _check_tensor(fn, name, attn_bias)
    if attn_bias.dtype not in DTYPES:
        fail(fn, f"{name}.dtype", attn_bias.dtype, "must be float32, bfloat16 or float16 (an additive bias; a "
                                                   "bool mask goes to attn_mask)", TypeError)
    full = (batch, heads, seqlen_q, seqlen_k)
    shape = tuple(int(n) for n in attn_bias.shape)
    ok = len(shape) <= 4
    if ok:
        for n, f in zip(shape[::-1], full[::-1]):
            if n != 1 and n != f:
                ok = False
    if not ok:
        fail(fn, f"{name}.shape", shape, f"must broadcast to [batch, heads, seqlen_q, seqlen_k] = {list(full)} "
                                         f"(each dim 1 or the full size, at most 4 dims)")
    if attn_bias.device != device:
        fail(fn, f"{name}.device", attn_bias.device, f"must equal q.device {device}")
    bias = attn_bias.reshape((1,) * (4 - len(shape)) + shape)
    for i in range(4):
        if bias.shape[i] > 1 and bias.stride(i) == 0:
            bias = bias.narrow(i, 0, 1)
    return bias


def _check_flags(fn, deterministic, return_attn_probs, return_lse=False):
    _check_bool(fn, "deterministic", deterministic)  # always honoured: the kernels are deterministic
    _check_bool(fn, "return_attn_probs", return_attn_probs)
    _check_bool(fn, "return_lse", return_lse)


def resolve_scale(fn, softmax_scale, d_head, name="softmax_scale"):
    """``softmax_scale`` as a float: ``1/sqrt(d_head)`` for None, else a finite real > 0 (checked)."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(d_head)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        fail(fn, name, repr(softmax_scale), "must be None or a real number", TypeError)
    if not (math.isfinite(softmax_scale) and softmax_scale > 0):
        fail(fn, name, softmax_scale, "must be finite and > 0 (the kernels scale the scores by it in float32)")
    return float(softmax_scale)


def dropout_seed_tensor(seed, offset=0, device="cpu"):
    """The kernels' dropout seed for ints ``seed`` and ``offset`` in ``[0, 2**32)``: int32 ``[2]`` =
    ``(seed, offset)`` (``nki_attn.dropout.make_seed``; docs/semantics.md, "Dropout")."""
    return make_seed(int(seed), int(offset)).to(device)


def _dropout_seed(fn, p, dropout_seed, generator, device):
    """The seed tensor of a call with dropout ``p`` (None when p == 0): from ``dropout_seed`` (an int, or an
    int32/uint32 ``[2]`` (seed, offset) tensor), else drawn from ``generator`` (default: torch's global generator,
    so ``torch.manual_seed`` makes the call reproducible, as FlashAttention's CUDA generator state does)."""
    if generator is not None and not isinstance(generator, torch.Generator):
        fail(fn, "generator", type(generator).__name__, "must be a torch.Generator or None", TypeError)
    if dropout_seed is not None and generator is not None:
        fail(fn, "dropout_seed", repr(dropout_seed), "give dropout_seed or generator, not both")
    if isinstance(dropout_seed, torch.Tensor):
        if tuple(dropout_seed.shape) not in ((2,), (1,)) or dropout_seed.dtype not in (torch.int32, torch.uint32):
            fail(fn, "dropout_seed", f"{dropout_seed.dtype} {tuple(dropout_seed.shape)}",
                 "a seed tensor must be int32 or uint32 [2] = (seed, offset) or [1] = (seed,) (or pass an int)")
        seed = dropout_seed.to(device)
    elif dropout_seed is not None:
        if not _is_int(dropout_seed) or not 0 <= dropout_seed <= SEED_MAX:
            fail(fn, "dropout_seed", repr(dropout_seed), f"must be an int in [0, {SEED_MAX}], a seed tensor or None")
        seed = dropout_seed_tensor(dropout_seed, 0, device)
    elif p == 0.0:
        seed = None
    else:
        seed = seed_from_generator(torch.default_generator if generator is None else generator).to(device)
    return seed if p != 0.0 else None


def window_pair(fn, window_size, causal):
    """FlashAttention's ``window_size`` -> ``(left, right)`` ints, -1 = unbounded; ``causal`` forces right = 0.

    ``window_size`` is any 2-element sequence of ints or a 1-D integer tensor of 2 elements (FlashAttention's
    tests pass ``torch.randint(0, seqlen_k, (2,))``); anything else raises TypeError, entries below -1 ValueError.
    """
    if isinstance(window_size, torch.Tensor):
        if window_size.dim() != 1 or window_size.shape[0] != 2 or window_size.is_floating_point() \
                or window_size.is_complex() or window_size.dtype == torch.bool:
            fail(fn, "window_size", f"a {window_size.dtype} tensor of shape {tuple(window_size.shape)}",
                 "a tensor window must be 1-D with 2 integer entries (left, right), -1 meaning unbounded", TypeError)
        window_size = tuple(int(x) for x in window_size.tolist())
    if isinstance(window_size, (str, bytes)) or not _is_sequence(window_size) or len(window_size) != 2:
        fail(fn, "window_size", repr(window_size), "must be a pair (left, right) of ints, -1 meaning unbounded",
             TypeError)
    for x in window_size:
        if not _is_int(x):
            fail(fn, "window_size", repr(tuple(window_size)), "entries must be ints (-1 means unbounded)", TypeError)
    left, right = int(window_size[0]), int(window_size[1])
    if left < -1 or right < -1:
        fail(fn, "window_size", (left, right), "entries must be >= -1 (-1 means unbounded)")
    if causal:
        right = 0  # FlashAttention: causal attention sees nothing to the right, whatever the window says
    return left, right


def _is_sequence(x):
    try:
        len(x)
        x[0] if len(x) else None
    except (TypeError, KeyError, IndexError):
        return False
    return True


def _check_qkv(fn, q, k, v, rank, names=("q", "k", "v")):
    for name, t in zip(names, (q, k, v)):
        _check_tensor(fn, name, t)
        if t.dim() != rank:
            fail(fn, f"{name}.shape", tuple(t.shape), f"must be {rank}-D")
    for name, t in zip(names[1:], (k, v)):
        if t.dtype != q.dtype:
            fail(fn, f"{name}.dtype", t.dtype, f"must equal {names[0]}.dtype {q.dtype}")
        if t.device != q.device:
            fail(fn, f"{name}.device", t.device, f"must equal {names[0]}.device {q.device}")
    if q.dtype not in DTYPES:
        fail(fn, f"{names[0]}.dtype", q.dtype, "must be float32, bfloat16 or float16")
    if k.shape[:-1] != v.shape[:-1]:
        fail(fn, f"{names[2]}.shape", tuple(v.shape), f"must equal {names[1]}.shape {tuple(k.shape)} except in "
                                                      f"the last dim (head_dim_v may differ from head_dim)")
    check_device(q, names[0])


def check_device(t, name="q"):
    """Where tensor ``t`` can run: CPU tensors on the simulator, XLA (Neuron) tensors on the real nki, ``meta``
    tensors only get shapes; RuntimeError when the selected backend cannot take ``t``, ValueError for any other
    device (naming ``name``)."""
    if t.device.type == "cpu":
        if BACKEND != "sim":
            raise RuntimeError("CPU tensors run on the simulator; set NKI_ATTN_BACKEND=sim to use it alongside the "
                               "real nki, or move the tensors to the XLA (Neuron) device")
    elif t.device.type == "xla":
        pass  # the real kernels with nki; with the simulator, torch-xla's CPU fallback (nki_attn.ops)
    elif t.device.type != "meta":
        raise ValueError(f"{name} is on {t.device}: use CPU (simulator), XLA (Trainium) or meta (shapes only)")


def _check_heads(fn, hq, hk, name):
    if hk == 0 and hq == 0:
        return
    if hk < 1 or hq % hk != 0:
        fail(fn, name, hk, f"the number of key/value heads must be >= 1 and divide the {hq} query heads")


def _check_head_dim(fn, d, name):
    if d > MAX_D_HEAD:
        fail(fn, name, d, f"head_dim must be at most {MAX_D_HEAD}")  # 0 is fine: empty output, as torch


def _check_sinks(fn, sinks, hq, device):
    if sinks is None:
        return
    _check_tensor(fn, "sinks", sinks)
    if sinks.dim() not in (1, 2) or sinks.shape[0] != hq or (sinks.dim() == 2 and sinks.shape[1] < 1):
        fail(fn, "sinks.shape", tuple(sinks.shape), f"must be [heads] = [{hq}] or [heads, num_sinks]")
    if not sinks.is_floating_point():
        fail(fn, "sinks.dtype", sinks.dtype, "must be a floating dtype")
    if sinks.device != device:
        fail(fn, "sinks.device", sinks.device, f"must equal q.device {device}")


def _check_key_range(fn, sq, sk, shift):
    if -(-max(sk, sq + shift) // PMAX) * PMAX > MAX_EXACT_KEY:
        fail(fn, "seqlen_k", sk, f"must be at most {MAX_EXACT_KEY} (the kernels' key bounds are float32)")


def _alibi_rows(alibi, batch, hq):
    """FlashAttention's ``[nheads]`` or ``[batch, nheads]`` slopes -> float32 ``[batch, nheads]``."""
    if alibi is None:
        return None
    return alibi.to(torch.float32).expand(batch, hq).clone(memory_format=torch.contiguous_format)


def _sizes(q, k, v):
    """(batch, seqlen_q, seqlen_k, heads, heads_kv, d_qk, d_v) of 4-D FlashAttention-layout q, k, v."""
    return int(q.shape[0]), int(q.shape[1]), int(k.shape[1]), int(q.shape[2]), int(k.shape[2]), \
        int(q.shape[3]), int(v.shape[3])


# ----------------------------------------------------------------------------------------------------- score mods
def _kernel_bias(bias, pl, spec):
    """The spec's bias ``[bb, hb, sqb, skb]`` (each dim 1 or the call's size) in the kernels' lengths: a full
    query dim gets ``pl.front`` zero rows before and zeros after (to ``pl.sq_k``), a full key dim zeros after
    (to ``pl.sk_k``; padded keys are masked), a broadcast dim stays 1. Contiguous, in the bias's dtype."""
    sq, sk = spec.seqlen_q, spec.seqlen_k
    rows = (pl.front, pl.sq_k - sq - pl.front) if bias.shape[2] > 1 else (0, 0)
    cols = (0, pl.sk_k - sk) if bias.shape[3] > 1 else (0, 0)
    if rows != (0, 0) or cols != (0, 0):
        bias = torch.nn.functional.pad(bias, (*cols, *rows))
    return bias.contiguous()


def _bias_grad(dbias, bias, pl, spec):
    """The kernel's float32 dbias ``[b, h, sq_k, sk_k]`` -> the gradient of the spec's bias: the call's rows and
    keys, summed over the bias's broadcast dims (on the host: see docs/kernel-bwd.md, "The additive bias"), in
    the bias's dtype."""
    g = dbias[:, :, pl.front:pl.front + spec.seqlen_q, :spec.seqlen_k]
    dims = [i for i in range(4) if bias.shape[i] == 1 and g.shape[i] != 1]
    if dims:
        g = g.sum(dim=dims, keepdim=True)
    return g.to(bias.dtype).clone(memory_format=torch.contiguous_format)


def _finite(name, what, rule):
    """A value check (``ScoreMod.values``): every element of the tensor finite, else ValueError."""
    def check(fn, t):
        if not bool(torch.isfinite(t).all()):
            bad = t[~torch.isfinite(t)]
            raise ValueError(f"{fn}: {name}=a {what}with {bad.numel()} non-finite value(s), e.g. {float(bad[0])}: "
                             f"{rule}")
    return check


@dataclasses.dataclass(frozen=True)
class Dims:
    """What a score modification's host check needs of the call: ``batch`` (a varlen call: its number of
    sequences, ``packed`` True, all in one kernel batch row), ``heads``, the lengths and q's device."""
    batch: int
    heads: int
    seqlen_q: int
    seqlen_k: int
    device: object
    packed: bool = False


@dataclasses.dataclass(frozen=True)
class ScoreMod:
    """One score modification, declared once; every layer reads it from ``SCORE_MODS``.

    Fields:
        name: the ``AttentionSpec`` field, the op pair's input and the ``nki_attn.flex`` score-mod marker name.
        keyword: the argument of ``flash_attn_*`` (and ``interval_attention``); FlashAttention's own name where
            it has one.
        kernel: the kernels' keyword (``attention_fwd`` / ``attention_bwd``).
        off: the value meaning "not applied" (the spec's default).
        check: ``(fn, value, dims) -> spec value``: the host check (type, shape rule, dtype, device; messages
            ``"<fn>: <keyword>...: <rule>"``) and the spec's layout (a tensor broadcast to ``[batch, heads]``).
        scores: ``(s, value, at) -> s``: the formula on float scores ``[b, h, sq, sk]`` (the golden's line;
            ``at.distance()`` gives ``|i + shift - j|`` float32 ``[sq, sk]``); used for ``return_attn_probs``.
        rank: where it applies in the score pipeline (the kernels' step order: smaller first).
        grad: "none"; "always" (a given tensor gets its gradient: the kernel returns it); "requested" (only when
            autograd asks: the kernel keyword ``grad_flag`` turns its gradient work on).
        values: ``(fn, tensor)`` raising ValueError for bad values, run in the op's body where tensors are real
            (also under ``torch.compile``), or None.
        to_kernel: ``(value, plan, spec) -> kernel argument`` (padding to the kernels' lengths), default as is.
        from_kernel: ``(g, value, plan, spec) -> gradient`` shaped like the spec's value, default a copy.
        extra: True for a keyword-only addition to FlashAttention's signatures (its own arguments stay where
            FlashAttention has them); varlen: the varlen entry points take it.
    """
    name: str
    keyword: str
    kernel: str
    off: object
    check: object
    scores: object
    rank: int
    grad: str = "none"
    grad_flag: Optional[str] = None
    values: object = None
    to_kernel: object = None
    from_kernel: object = None
    extra: bool = True
    varlen: bool = True

    @property
    def is_tensor(self):
        return self.off is None


def _softcap_mod(fn, value, dims):
    return _check_softcap(fn, value)


def _alibi_mod(fn, value, dims):
    slopes = _check_alibi(fn, value, dims.batch, dims.heads, dims.device)
    # a varlen call places each sequence's slopes itself (flash_attn_varlen_func)
    return slopes if dims.packed else _alibi_rows(slopes, dims.batch, dims.heads)


def _bias_mod(fn, value, dims):
    return check_bias(fn, value, dims.batch, dims.heads, dims.seqlen_q, dims.seqlen_k, dims.device)


def _logit_scale_mod(fn, value, dims):
    lscale = _check_logit_scale(fn, value, dims.batch, dims.heads, dims.device, batched=not dims.packed)
    return _logit_rows(lscale, 1 if dims.packed else dims.batch, dims.heads)


# The table: declaration order is the op pair's input order and the order of the kernels' gradient outputs.
SCORE_MODS = (
    ScoreMod("softcap", "softcap", "softcap", 0.0, _softcap_mod, rank=1,
             scores=lambda s, c, at: c * torch.tanh(s / c), extra=False),
    ScoreMod("alibi", "alibi_slopes", "alibi_slopes", None, _alibi_mod, rank=2,
             scores=lambda s, slopes, at: s - slopes[:, :, None, None] * at.distance(), extra=False,
             values=_finite("alibi_slopes", "tensor ", "every slope must be finite (any sign: a negative slope "
                                                         "favours distant keys)")),
    ScoreMod("bias", "attn_bias", "attn_bias", None, _bias_mod, rank=3,
             scores=lambda s, bias, at: s + bias.detach().float(), grad="requested", grad_flag="bias_grad",
             to_kernel=_kernel_bias, from_kernel=_bias_grad, varlen=False),
    ScoreMod("logit_scale", "logit_scale", "logit_scale", None, _logit_scale_mod, rank=0,
             scores=lambda s, lam, at: s * lam.detach()[:, :, None, None], grad="always",
             values=_finite("logit_scale", "[batch, heads] tensor ", "every scale must be finite")),
)
MODS = {m.name: m for m in SCORE_MODS}
GRAD_MODS = tuple(m for m in SCORE_MODS if m.grad != "none")


def check_mods(fn, given, dims, mods=SCORE_MODS):
    """``{name: spec value}`` of the score modifications in ``given`` (``{keyword: argument}``), each checked by
    its row (``ScoreMod.check``)."""
    return {m.name: m.check(fn, given[m.keyword], dims) for m in mods if m.keyword in given}


def extra_keywords(fn, given, varlen=False):
    """The keyword-only score modifications an entry point received in ``**given``: TypeError for any other
    keyword, as Python raises for an unknown one."""
    names = {m.keyword for m in SCORE_MODS if m.extra and (m.varlen or not varlen)}
    for k in given:
        if k not in names:
            raise TypeError(f"{fn}() got an unexpected keyword argument {k!r}")
    return given


def with_extra_keywords(varlen=False):
    """Decorator: the function's ``**kwargs`` are the table's keyword-only score modifications; its signature
    (``inspect.signature``, help) lists them by name, each defaulting to its "off" value."""
    def wrap(f):
        sig = inspect.signature(f)
        params = [p for p in sig.parameters.values() if p.kind != p.VAR_KEYWORD]
        params += [inspect.Parameter(m.keyword, inspect.Parameter.KEYWORD_ONLY, default=m.off)
                   for m in SCORE_MODS if m.extra and (m.varlen or not varlen)]
        f.__signature__ = sig.replace(parameters=params)
        return f
    return wrap


def _with_score_mods(cls):
    """Add one ``AttentionSpec`` field per row of ``SCORE_MODS`` (default: its "off" value)."""
    for m in SCORE_MODS:
        cls.__annotations__[m.name] = Optional[torch.Tensor] if m.is_tensor else float
        setattr(cls, m.name, m.off)
    return cls


@dataclasses.dataclass(frozen=True)
@_with_score_mods
class AttentionSpec:
    """Everything about one attention call except q, k and v themselves; checked when built, trusted after.

    Shapes (FlashAttention's layout, the one the op pair takes): q ``[batch, seqlen_q, heads, d_qk]``, k
    ``[batch, seqlen_k, heads_kv, d_qk]``, v ``[batch, seqlen_k, heads_kv, d_v]``.

    Fields:
        fn: str, the entry point that built the spec (prefixes every message).
        batch, seqlen_q, seqlen_k, heads, heads_kv, d_qk, d_v: int sizes (``heads % heads_kv == 0``; d_qk, d_v
            0..256; any size may be 0: the result is then torch's, without a kernel launch).
        dtype: torch.dtype of q, k, v (float32 / bfloat16 / float16).
        scale: float > 0, the softmax scale of q·k (resolved: ``1/sqrt(d_qk)`` when not given).
        left, right, shift: int, the mask as a window: query i sees keys ``i + shift - left .. i + shift +
            right`` within ``[0, seqlen_k)``, a side of -1 unbounded (causal: right = 0; FlashAttention's
            bottom-right alignment: shift = seqlen_k - seqlen_q). Ignored when ``key_lo`` is given.
        key_lo, key_hi: int64 ``[seqlen_q]`` or None: explicit per-query key intervals ``[lo, hi)`` (packing:
            varlen sequences, boolean masks); they replace the window.
        dropout_p: float in [0, 1); dropout_seed: int32 / uint32 ``[2]`` = (seed, offset) (or ``[1]``), given
            iff dropout_p > 0 (``nki_attn.dropout``).
        sinks: ``[heads]`` or ``[heads, num_sinks]`` logits joining the softmax denominator, or None.
        block_mask: None, or a block mask's kernel operands ``(rows, bits, n_b, n_h)`` (``nki_attn.BlockMask``:
            ``union_rows()`` uint8 ``[ceil(seqlen_q / 128), ceil(seqlen_k / 128)]``, ``kernel_operands()``' bit
            store uint8 ``[128, n]`` or None, its batch / head extents); it replaces the window and intervals.
        Then one field per row of ``SCORE_MODS``, named ``ScoreMod.name``, in the layout its check returns:
        softcap: float >= 0; the scaled scores become ``softcap * tanh(S / softcap)`` (0.0: off).
        alibi: float32 ``[batch, heads]`` or None: adds ``-slope * |i + shift - j|`` to the scores.
        bias: the additive bias ``[batch or 1, heads or 1, seqlen_q or 1, seqlen_k or 1]`` (float32 / bfloat16 /
            float16, q's device) added to the scaled and capped scores after ALiBi, or None (``check_bias``).
        logit_scale: float32 ``[batch, heads]`` or None: the per-head logit scale, the logits are ``scale *
            logit_scale[b, h] * q·k`` before soft-capping and ALiBi (docs/semantics.md, "Per-head logit scale").

    Derived specs (``dataclasses.replace``, ``with_mask``) are not re-checked: the caller keeps them consistent.
    """
    fn: str
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads: int
    heads_kv: int
    d_qk: int
    d_v: int
    dtype: torch.dtype
    scale: float
    left: int = -1
    right: int = -1
    shift: int = 0
    key_lo: Optional[torch.Tensor] = None
    key_hi: Optional[torch.Tensor] = None
    dropout_p: float = 0.0
    dropout_seed: Optional[torch.Tensor] = None
    sinks: Optional[torch.Tensor] = None
    block_mask: Optional[tuple] = None
    # then one field per score modification of SCORE_MODS (softcap, alibi, bias, logit_scale), added by
    # ``_with_score_mods`` from the table

    @property
    def causal(self):
        """True when no query sees a key after its own (bottom-right) position."""
        return self.key_lo is None and self.right == 0

    @property
    def packed(self):
        """True when the mask is explicit per-query intervals (``key_lo`` / ``key_hi``)."""
        return self.key_lo is not None

    def with_mask(self, seqlen_q, seqlen_k, left=-1, right=-1, shift=0, key_lo=None, key_hi=None, **changes):
        """This spec for another block of the same call: new lengths and mask (and any other ``changes``,
        e.g. ``sinks=None``), not re-checked."""
        return dataclasses.replace(self, seqlen_q=seqlen_q, seqlen_k=seqlen_k, left=left, right=right, shift=shift,
                                   key_lo=key_lo, key_hi=key_hi, **changes)


# ----------------------------------------------------------------------------------------------------- builders
def flash_spec(fn, q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
               alibi_slopes=None, deterministic=False, return_attn_probs=False, *, sinks=None, return_lse=False,
               dropout_seed=None, generator=None, **mods):
    """Check ``flash_attn_func``'s arguments (same names, shapes and rules; ``fn`` names the caller in the
    messages) and return their ``AttentionSpec``: q ``[batch, seqlen_q, nheads, head_dim]``, k ``[batch,
    seqlen_k, nheads_k, head_dim]``, v ``[batch, seqlen_k, nheads_k, head_dim_v]``, the mask bottom-right
    aligned (shift = seqlen_k - seqlen_q). Draws the dropout seed when dropout_p > 0 and none is given.
    ``mods``: the keyword-only score modifications of ``SCORE_MODS`` (``attn_bias``: an additive bias
    broadcastable to ``[batch, nheads, seqlen_q, seqlen_k]``; ``logit_scale``: float32 ``[nheads]`` or
    ``[batch, nheads]``), each checked by its row."""
    extra_keywords(fn, mods)
    p = _check_dropout(fn, dropout_p)
    _check_softcap(fn, softcap)
    _check_flags(fn, deterministic, return_attn_probs, return_lse)
    causal = _check_bool(fn, "causal", causal)
    _check_qkv(fn, q, k, v, 4)
    b, sq, sk, hq, hk, d, dv = _sizes(q, k, v)
    if int(k.shape[0]) != b:
        fail(fn, "k.shape[0]", int(k.shape[0]), f"batch must equal q.shape[0] = {b}")
    if int(k.shape[3]) != d:
        fail(fn, "k.shape[3]", int(k.shape[3]), f"head_dim must equal q.shape[3] = {d}")
    _check_heads(fn, hq, hk, "k.shape[2]")
    _check_head_dim(fn, d, "q.shape[3]")
    _check_head_dim(fn, dv, "v.shape[3]")
    _check_sinks(fn, sinks, hq, q.device)
    left, right = window_pair(fn, window_size, causal)
    seed = _dropout_seed(fn, p, dropout_seed, generator, q.device)
    scale = resolve_scale(fn, softmax_scale, max(d, 1))
    _check_key_range(fn, sq, sk, sk - sq)
    checked = check_mods(fn, dict(mods, softcap=softcap, alibi_slopes=alibi_slopes), Dims(b, hq, sq, sk, q.device))
    return AttentionSpec(fn, b, sq, sk, hq, hk, d, dv, q.dtype, scale, left, right, sk - sq, dropout_p=p,
                         dropout_seed=seed, sinks=sinks, **checked)


def window_intervals(sq, sk, left, right, shift, device=None):
    """Key interval ``[lo, hi)`` of each query i < sq (int64 ``[sq]`` each): keys ``i + shift - left ..
    i + shift + right`` (a side of -1 is unbounded) within ``[0, sk)``; ``hi == lo`` when none is visible."""
    i = torch.arange(sq, dtype=torch.int64, device=device)
    lo = (i + shift - left).clamp(0, sk) if left >= 0 else torch.zeros_like(i)
    hi = (i + shift + right + 1).clamp(0, sk) if right >= 0 else torch.full_like(i, sk)
    return lo, torch.maximum(hi, lo)
