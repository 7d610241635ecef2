"""Ring attention on XLA tensors at world size 1 (XLA:CPU): the XLA-collective communicator is chosen by device,
its ``collective_permute`` / ``all_gather`` run on the device, the ring issues its per-step collectives at world
size 1 too (pairs [(0, 0)], counted by wrapping torch-xla's functions), and the ring's result equals the
single-process call's. More than one rank is not run here: XLA:CPU multi-device collectives hang
(docs/xla.md)."""
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


def _inputs(seed=3, n=300):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, n, 4, 32, generator=g) for _ in range(3)]


def _run(device, fn, qkv, backward=True, **kw):
    t = [x.detach().clone().to(device).requires_grad_(backward) for x in qkv]
    out = fn(*t, **kw)
    if not backward:
        return [out.detach().cpu()]
    out.sum().backward()
    return [out.detach().cpu()] + [x.grad.cpu() for x in t]


@pytest.fixture
def counted(monkeypatch):
    """torch-xla's collective_permute and all_gather wrapped: every call recorded (pairs / dim), then run.
    ``calls["permute_fn"]`` may replace what the permute returns (a fault, to see where results come from)."""
    import torch_xla.core.xla_model as xm
    calls = {"permute": [], "all_gather": [], "permute_fn": None}
    permute, gather = xm.collective_permute, xm.all_gather

    def collective_permute(t, pairs):
        calls["permute"].append([tuple(p) for p in pairs])
        got = permute(t, pairs=pairs)
        return calls["permute_fn"](got) if calls["permute_fn"] else got

    def all_gather(t, dim=0, **kw):
        calls["all_gather"].append(dim)
        return gather(t, dim=dim, **kw)
    monkeypatch.setattr(xm, "collective_permute", collective_permute)
    monkeypatch.setattr(xm, "all_gather", all_gather)
    return calls


@pytest.mark.parametrize("kw", [dict(causal=True), dict(causal=False), dict(causal=True, window_size=(63, 0))],
                         ids=["causal", "full", "causal-window"])
def test_ring_world_size_1_runs_through_collective_permute(xla_device, counted, kw):
    """World size 1 takes the multi-rank path: the forward's one step ends with its K/V hop, the backward's with
    its K/V hop and the dK/dV partial sums' trip home, each a collective_permute with pairs [(0, 0)]; the
    lengths are one all_gather per pass. Results equal the single-process call's bit for bit."""
    qkv = _inputs()
    ref = _run("cpu", nki_attn.flash_attn_func, qkv, **kw)
    fwd = _run(xla_device, ring_flash_attn_func, qkv, backward=False, **kw)
    assert counted["permute"] == [[(0, 0)]] and counted["all_gather"] == [0]
    assert torch.equal(fwd[0], ref[0])
    counted["permute"].clear(), counted["all_gather"].clear()
    got = _run(xla_device, ring_flash_attn_func, qkv, **kw)
    assert counted["permute"] == [[(0, 0)]] * 3 and counted["all_gather"] == [0]
    for name, a, b in zip(["out", "dq", "dk", "dv"], ref, got):
        assert torch.equal(a, b), name


def test_ring_gradients_of_k_and_v_come_through_the_collective(xla_device, counted):
    """At world size 1 the dK/dV partial sums reach home through collective_permute: a permute that adds 1 to
    what it moves changes dk and dv (and only them: the K/V the forward's last hop brings home are not used, and
    dq never travels), so the ring's result really depends on the collective path."""
    qkv = _inputs(n=130)
    ref = _run("cpu", nki_attn.flash_attn_func, qkv, causal=True)
    counted["permute_fn"] = lambda t: t + 1
    got = _run(xla_device, ring_flash_attn_func, qkv, causal=True)
    assert len(counted["permute"]) == 3
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    for name, a, b in (("dk", ref[2], got[2]), ("dv", ref[3], got[3])):
        assert torch.allclose(b, a + 1, atol=1e-5), name
