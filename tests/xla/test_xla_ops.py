"""Our ops on XLA tensors (torch-xla's CPU device): forward and backward bit-identical to the CPU path.

With the simulator as backend, the custom ops are implemented for CPU only and XLA tensors reach them through
torch-xla's CPU fallback, so every result must equal the CPU call's exactly (``torch.equal``, no tolerance): the
same kernels run on the same values; only the torch-side plumbing (device moves, autograd, the layout changes
around the kernels) differs, and that is what these tests check.
"""
import pytest
import torch

pytest.importorskip("torch_xla", reason="torch-xla is not installed (the XLA CI step installs it)")

import nki_attn  # noqa: E402

B, S, H, HK, D = 1, 200, 4, 2, 32


def _inputs(dtype=torch.float32, hk=HK, s=S, b=B, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, H, D, generator=g).to(dtype)
    k = torch.randn(b, s, hk, D, generator=g).to(dtype)
    v = torch.randn(b, s, hk, D, generator=g).to(dtype)
    do = torch.randn(b, s, H, D, generator=g).to(dtype)
    return q, k, v, do


def _fwd_bwd(device, fn, tensors, do, **kw):
    """``fn(*tensors, **kw)`` on ``device``, then backward of ``do``: (out, grads of every tensor), on CPU."""
    leaves = [t.detach().clone().to(device).requires_grad_() for t in tensors]
    extra = {name: (x.to(device) if isinstance(x, torch.Tensor) else x) for name, x in kw.items()}
    sinks = extra.pop("sinks_leaf", None)
    if sinks is not None:
        leaves.append(sinks.detach().clone().to(device).requires_grad_())
        extra["sinks"] = leaves[-1]
    out = fn(*leaves[:3], *[x.to(device) for x in extra.pop("positional", ())], **extra)
    out.backward(do.to(device))
    return [out.detach().cpu()] + [t.grad.cpu() for t in leaves]


def _assert_identical(cpu, xla):
    names = ["out", "dq", "dk", "dv", "dsinks"]
    for name, a, b in zip(names, cpu, xla):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a, b), f"{name}: max |cpu - xla| = {(a.float() - b.float()).abs().max().item()}"


VARIANTS = {
    "causal": dict(causal=True),
    "window": dict(window_size=(37, 11)),
    "softcap": dict(causal=True, softcap=5.0),
    "alibi": dict(causal=True, alibi_slopes=torch.tensor([[0.5, 0.25, 0.125, 0.0625]])),
    "dropout": dict(causal=True, dropout_p=0.2, dropout_seed=1234),
    "sinks": dict(causal=True, sinks_leaf=torch.tensor([0.5, -1.0, 2.0, 0.0])),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_flash_attn_func_bit_identical(xla_device, name):
    q, k, v, do = _inputs()
    kw = VARIANTS[name]
    _assert_identical(_fwd_bwd("cpu", nki_attn.flash_attn_func, (q, k, v), do, **kw),
                      _fwd_bwd(xla_device, nki_attn.flash_attn_func, (q, k, v), do, **kw))


@pytest.mark.parametrize("hk", [1, 4], ids=["gqa-1kv", "mha"])
def test_gqa_bit_identical(xla_device, hk):
    q, k, v, do = _inputs(hk=hk)
    _assert_identical(_fwd_bwd("cpu", nki_attn.flash_attn_func, (q, k, v), do, causal=True),
                      _fwd_bwd(xla_device, nki_attn.flash_attn_func, (q, k, v), do, causal=True))


def test_bf16_bit_identical(xla_device):
    q, k, v, do = _inputs(torch.bfloat16)
    _assert_identical(_fwd_bwd("cpu", nki_attn.flash_attn_func, (q, k, v), do, causal=True),
                      _fwd_bwd(xla_device, nki_attn.flash_attn_func, (q, k, v), do, causal=True))


def test_varlen_bit_identical(xla_device):
    lens = [70, 130, 1]
    q, k, v, do = (t[0] for t in _inputs(s=sum(lens)))
    cu = torch.tensor([0, 70, 200, 201], dtype=torch.int32)

    def fn(q, k, v, cu_q, cu_k, causal):
        return nki_attn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens), max(lens), causal=causal)

    kw = dict(positional=(cu, cu), causal=True)
    _assert_identical(_fwd_bwd("cpu", fn, (q, k, v), do, **kw), _fwd_bwd(xla_device, fn, (q, k, v), do, **kw))


def test_xla_inputs_stay_on_xla(xla_device):
    """The results come back as XLA tensors (the fallback moves them back), with the input's dtype."""
    q, k, v, _ = (t.to(xla_device) for t in _inputs())
    out = nki_attn.flash_attn_func(q, k, v, causal=True)
    assert out.device.type == "xla" and out.dtype == q.dtype and out.shape == q.shape


def test_compile_openxla_forward(xla_device):
    """``torch.compile(backend="openxla")`` of the forward: the ops stay opaque nodes that run through the
    fallback; the result equals eager CPU exactly."""
    q, k, v, _ = _inputs()

    def f(q, k, v):
        return nki_attn.flash_attn_func(q, k, v, causal=True, window_size=(63, 0))

    got = torch.compile(f, backend="openxla")(*(t.to(xla_device) for t in (q, k, v))).cpu()
    assert torch.equal(got, f(q, k, v))
