"""Regression test for a torch-xla behaviour that corrupts results: ``.contiguous()`` of a permuted view.

XLA tensors always report contiguous strides, so ``x.permute(...).contiguous()`` on an XLA tensor returns the
view itself instead of a copy. When a custom op returns such a view and a second custom op permutes it again,
the second op reads the data in the wrong order (seen with torch 2.9.0 + torch-xla 2.9.0 on PJRT_DEVICE=CPU).
The op layer's rule: every op output is a fresh tensor (``clone(memory_format=torch.contiguous_format)``), never
``.contiguous()`` of a view. docs/xla.md has the upstream-ready report.
"""
import pytest
import torch

pytest.importorskip("torch_xla", reason="torch-xla is not installed (the XLA CI step installs it)")



def _contiguous(t):
    return t.contiguous()


def fresh_contiguous(t):
    """The workaround: a new tensor with its own storage in row-major order, on every device."""
    return t.clone(memory_format=torch.contiguous_format)


def _two_ops(tag, materialize):
    """Two custom ops for every device: ``first`` swaps the last two dims, ``second`` swaps them back and
    doubles. ``second(first(x)) == 2 * x`` on any correct backend."""
    @torch.library.custom_op(f"nki_attn_xla_test::first_{tag}", mutates_args=())
    def first(x: torch.Tensor) -> torch.Tensor:
        return materialize(x.permute(0, 2, 1))

    @first.register_fake
    def _(x):
        return x.new_empty(x.shape[0], x.shape[2], x.shape[1])

    @torch.library.custom_op(f"nki_attn_xla_test::second_{tag}", mutates_args=())
    def second(y: torch.Tensor) -> torch.Tensor:
        return materialize(y.permute(0, 2, 1)) * 2

    @second.register_fake
    def _(y):
        return y.new_empty(y.shape[0], y.shape[2], y.shape[1])

    return first, second


_OPS = {"contiguous": _two_ops("contiguous", _contiguous), "fresh": _two_ops("fresh", fresh_contiguous)}


def _run(name, x):
    first, second = _OPS[name]
    return second(first(x))


def test_upstream_behaviour_reproduces(xla_device):
    """torch-xla's behaviour itself: ``.contiguous()`` of a view handed between two custom ops scrambles the
    data on XLA while the CPU result is right. If this starts failing, torch-xla fixed it: update docs/xla.md."""
    x = torch.arange(24.0).reshape(2, 3, 4)
    assert torch.equal(_run("contiguous", x), 2 * x)
    got = _run("contiguous", x.to(xla_device)).cpu()
    assert not torch.equal(got, 2 * x), "torch-xla no longer mis-reads the view: update docs/xla.md"


def test_fresh_contiguous_is_right_on_xla(xla_device):
    """The workaround the op layer uses (``clone(memory_format=torch.contiguous_format)``) gives the right result on XLA."""
    x = torch.arange(24.0).reshape(2, 3, 4)
    got = _run("fresh", x.to(xla_device)).cpu()
    assert torch.equal(got, 2 * x)


@pytest.mark.parametrize("shape,perm", [((2, 3, 4, 5), (0, 2, 3, 1)), ((1, 4, 8, 2), (0, 3, 1, 2))])
def test_fresh_contiguous_copies(shape, perm):
    """A fresh tensor on every device: its own storage, contiguous, same values as the view."""
    x = torch.randn(shape)
    view = x.permute(perm)
    y = fresh_contiguous(view)
    assert y.is_contiguous() and torch.equal(y, view)
    assert y.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()


# The op layer's own layout changes, as the real-nki path runs them: inside custom ops whose implementation gets
# the XLA tensors themselves (on the simulator the ops see CPU copies, where any copy is a real copy).
@torch.library.custom_op("nki_attn_xla_test::to_kernel", mutates_args=())
def _to_kernel_op(x: torch.Tensor, pad_to: int, front: int) -> torch.Tensor:
    from nki_attn.ops import _to_kernel
    return _to_kernel(x, pad_to, front)


@_to_kernel_op.register_fake
def _(x, pad_to, front):
    return x.new_empty(x.shape[0], x.shape[2], x.shape[3], pad_to)


@torch.library.custom_op("nki_attn_xla_test::from_kernel", mutates_args=())
def _from_kernel_op(x: torch.Tensor, front: int, n: int) -> torch.Tensor:
    from nki_attn.ops import _from_kernel
    return _from_kernel(x, front, n)


@_from_kernel_op.register_fake
def _(x, front, n):
    return x.new_empty(x.shape[0], n, x.shape[1], x.shape[2])


@pytest.mark.parametrize("n,pad_to,front", [(128, 128, 0), (100, 128, 0), (100, 256, 28)])
def test_op_layout_changes_survive_xla(xla_device, n, pad_to, front):
    """FlashAttention layout -> kernel layout -> back, each step one custom op running on the XLA tensors: the
    round trip returns the input exactly. Fails if the op layer hands out ``.contiguous()`` of a permuted view."""
    x = torch.randn(2, n, 3, 8, generator=torch.Generator().manual_seed(n + pad_to))

    def round_trip(t):
        return _from_kernel_op(_to_kernel_op(t, pad_to, front), front, n)

    def back_and_forth(t):  # kernel layout -> FlashAttention layout -> kernel layout
        return _to_kernel_op(_from_kernel_op(t, 0, t.shape[-1]), t.shape[-1], 0)

    kx = torch.randn(2, 3, 8, pad_to, generator=torch.Generator().manual_seed(1))
    assert torch.equal(round_trip(x.to(xla_device)).cpu(), x)
    assert torch.equal(back_and_forth(kx.to(xla_device)).cpu(), kx)
