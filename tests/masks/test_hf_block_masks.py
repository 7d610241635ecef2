"""Hugging Face transformers through block masks: the ``nki_attn`` mask builder turns a model's mask functions
(packed sequences from ``position_ids``, a prefix-LM pattern) into ``nki_attn.BlockMask``s and the attention runs
on them; checked against attention by the definition in float64 with transformers' own dense mask, by the
criterion of tests/api/test_transformers.py (K = 10 times the float32 baseline's error plus 2^-22 max|truth|)."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import nki_attn.integrations.transformers as nki_hf  # noqa: E402
from nki_attn.block_mask import BlockMask  # noqa: E402

K, FLOOR = 10.0, 2.0 ** -22
SEEN = []


def _exact(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None, **kwargs):
    group = query.shape[1] // key.shape[1]
    k, v = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    s = (query @ k.transpose(-1, -2)) * scaling
    s = s.masked_fill(~attention_mask, float("-inf"))
    p = torch.nan_to_num(torch.softmax(s, dim=-1), nan=0.0)
    return (p @ v).transpose(1, 2).contiguous(), None


def _spy(module, query, key, value, attention_mask, **kwargs):
    SEEN.append(type(attention_mask))
    return nki_hf.attention_forward(module, query, key, value, attention_mask, **kwargs)


@pytest.fixture(scope="module", autouse=True)
def registered():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    AttentionInterface.register("exact_bm", _exact)
    AttentionMaskInterface.register("exact_bm", lambda *a, **kw: sdpa_mask(*a, **dict(kw, allow_is_causal_skip=False)))
    AttentionInterface.register("nki_spy", _spy)
    AttentionMaskInterface.register("nki_spy", nki_hf.block_mask_builder)
    nki_hf.register()


def _check(name, ours, truth, base):
    err = float((ours - truth).abs().max())
    bound = K * float((base - truth).abs().max()) + FLOOR * float(truth.abs().max())
    assert torch.isfinite(ours).all() and err <= bound, f"{name}: error {err:.3e} > bound {bound:.3e}"


def test_packed_sequences_run_through_block_masks():
    from transformers import AutoModelForCausalLM, LlamaConfig
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 96, (1, 150), generator=g)
    pos = torch.cat([torch.arange(40), torch.arange(70), torch.arange(40)])[None]  # 3 packed sequences
    state = AutoModelForCausalLM.from_config(copy.deepcopy(cfg)).state_dict()
    runs = {}
    for impl, dtype in (("exact_bm", torch.float64), ("sdpa", torch.float32), ("nki_spy", torch.float32)):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=impl)
        model.load_state_dict(state)
        model.to(dtype).train()
        out = model(input_ids=ids, position_ids=pos, labels=ids, use_cache=False)  # no cache: packing is detected
        out.loss.backward()
        grads = {n: p.grad.detach().double() for n, p in model.named_parameters() if p.grad is not None}
        runs[impl] = (out.logits.detach().double(), out.loss.detach().double(), grads)
    assert SEEN and all(t is BlockMask for t in SEEN)  # the packed mask reached the kernels as a block mask
    truth, base, ours = runs["exact_bm"], runs["sdpa"], runs["nki_spy"]
    _check("logits", ours[0], truth[0], base[0])
    _check("loss", ours[1], truth[1], base[1])
    for n in truth[2]:
        _check(n, ours[2][n], truth[2][n], base[2][n])


def test_prefix_lm_mask_function_becomes_a_block_mask():
    from transformers import masking_utils as mu
    prefix = 37

    def prefix_fn(b, h, q, kv):
        return kv < prefix
    fn = mu.or_masks(mu.causal_mask_function, prefix_fn)
    am = torch.ones(2, 200, dtype=torch.bool)
    am[1, :9] = False  # left padding of the second sequence
    bm = nki_hf.block_mask_builder(2, 200, 200, mask_function=fn, attention_mask=am)
    assert isinstance(bm, BlockMask) and bm.shape == (2, 1, 200, 200)
    dense = mu.sdpa_mask(2, 200, 200, mask_function=fn, attention_mask=am, allow_is_causal_skip=False)
    assert torch.equal(bm.to_dense(), dense)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, 200, 16, generator=g) for _ in range(3))
    module = torch.nn.Module()
    ours, _ = nki_hf.attention_forward(module, q, k[:, :2], v[:, :2], bm, scaling=0.25)
    truth, _ = _exact(module, q.double(), k[:, :2].double(), v[:, :2].double(), dense, scaling=0.25)
    base, _ = _exact(module, q, k[:, :2], v[:, :2], dense, scaling=0.25)
    _check("out", ours.double(), truth, base.double())
    # no mask needed (causal, no padding): the builder skips it, as SDPA's does
    assert nki_hf.block_mask_builder(1, 64, 64, mask_function=mu.causal_mask_function) is None
