"""Ring attention on XLA tensors at world size 1 (XLA:CPU): the XLA-collective communicator is chosen by device,
its ``collective_permute`` / ``all_gather`` run on the device, and the ring's result equals the single-process
call's. More than one rank is not run here: XLA:CPU multi-device collectives hang (docs/xla.md)."""
import pytest
import torch

pytest.importorskip("torch_xla", reason="torch-xla is not installed (the XLA CI step installs it)")

import nki_attn  # noqa: E402
from nki_attn.distributed import comm as comm_mod  # noqa: E402
from nki_attn.distributed import ring_flash_attn_func  # noqa: E402


def test_comm_is_chosen_by_device(xla_device):
    c = comm_mod.ring_comm(None, xla_device)
    assert isinstance(c, comm_mod.XlaRingComm) and (c.rank, c.size) == (0, 1)
    with pytest.raises(ValueError, match="group=None"):
        comm_mod.ring_comm(object(), xla_device)


def test_collective_permute_and_all_gather_on_xla(xla_device):
    """One ring transfer at world size 1 is a collective_permute onto this device itself."""
    c = comm_mod.XlaRingComm()
    t = torch.arange(12.0).reshape(3, 4).to(xla_device)
    buf = torch.empty_like(t)
    c.wait(c.start([(t, 1, comm_mod.TAG_KV_FWD)], [(buf, -1, comm_mod.TAG_KV_FWD)]))
    assert c.permutes == 1 and c.bytes_sent == 48
    assert torch.equal(buf.cpu(), torch.arange(12.0).reshape(3, 4))
    assert c.all_lengths(257, xla_device) == [257]


@pytest.mark.parametrize("kw", [dict(causal=True), dict(causal=True, window_size=(63, 0))], ids=["causal", "causal-window"])
def test_ring_world_size_1_matches_single_process(xla_device, kw):
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 300, 4, 32, generator=g) for _ in range(3))

    def run(device, fn):
        t = [x.detach().clone().to(device).requires_grad_() for x in (q, k, v)]
        out = fn(*t, **kw)
        out.sum().backward()
        return [out.detach().cpu()] + [x.grad.cpu() for x in t]

    for name, a, b in zip(["out", "dq", "dk", "dv"], run("cpu", nki_attn.flash_attn_func),
                          run(xla_device, ring_flash_attn_func)):
        assert torch.equal(a, b), name
