"""Hugging Face transformers with attn_implementation="nki_attn": tiny models built from configs (random weights,
no download) against transformers' own attention ("sdpa", or "eager" where the model does not support SDPA).

Criterion (docs/api.md, "Hugging Face models"): the truth is the model run in float64 with an exact attention
written out in this file (``exact_attention``: masked softmax in the input dtype, sinks as an extra
column; transformers' eager attention is not a float64 reference: it takes its softmax in float32, where the
float64 mask minimum becomes -inf and fully padded rows become NaN). The baseline is transformers' own attention
("sdpa", or "eager" where the model has no SDPA support) in float32. For the logits (non-padding positions),
the loss and every parameter gradient, our float32 error must satisfy
``err <= K * err_baseline + 2^-22 * max|truth|`` with K = 10, the harness's float32 factor (FlexAttention's;
docs/validation.md):
in float32 the baseline's error is summation-order noise, so a small multiple of it is the honest bound.

Skipped only when transformers is not installed (``pip install -e ".[hf]"``).
"""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import nki_attn.integrations.transformers as nki_hf  # noqa: E402

K = 10.0
FLOOR = 2.0 ** -22

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256)


def _configs():
    from transformers import GptOssConfig, Gemma2Config, LlamaConfig, MistralConfig, Qwen3Config
    return {
        # model: (config, reference attention implementation)
        "llama": (LlamaConfig(**COMMON), "sdpa"),
        "qwen3": (Qwen3Config(**COMMON, use_sliding_window=True, sliding_window=16, max_window_layers=1), "sdpa"),
        "mistral": (MistralConfig(**COMMON, sliding_window=16), "sdpa"),
        # Gemma-2 without attention soft-capping (the final-logit soft-capping is outside attention and stays
        # on); "gemma2_softcap" below adds Gemma-2's attention soft-capping (50.0) on top of its sliding window.
        "gemma2": (Gemma2Config(**COMMON, sliding_window=16, query_pre_attn_scalar=16, attn_logit_softcapping=None,
                                layer_types=["sliding_attention", "full_attention"]), "eager"),
        # a small cap (the scaled scores of this tiny model stay far below 50, where tanh is the identity)
        "gemma2_softcap": (Gemma2Config(**COMMON, sliding_window=16, query_pre_attn_scalar=16,
                                        attn_logit_softcapping=0.5,
                                        layer_types=["sliding_attention", "full_attention"]), "eager"),
        # every expert routed (top-2 of 2): a router near-tie cannot flip the expert choice between runs
        "gpt_oss": (GptOssConfig(**COMMON, num_local_experts=2, num_experts_per_tok=2, sliding_window=16,
                                 layer_types=["sliding_attention", "full_attention"]), "eager"),
    }


EXACT = "exact_reference"


def exact_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                    softcap=None, is_causal=None, s_aux=None, **kwargs):
    """Attention by the definition in the inputs' dtype (the float64 truth): [b, h, s, d] in, [b, s, h, d] out."""
    assert dropout == 0.0
    group = query.shape[1] // key.shape[1]
    k, v = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    s = (query @ k.transpose(-1, -2)) * scaling
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    sq, sk = s.shape[-2:]
    if attention_mask is None:  # no cache in these tests: sq == sk
        i, j = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
        causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
        vis = (j <= i) if causal else torch.ones(sq, sk, dtype=torch.bool)
        if sliding_window:
            vis &= j > i - sliding_window
    else:
        vis = attention_mask
    s = s.masked_fill(~vis, float("-inf"))
    if s_aux is not None:
        s = torch.cat([s, s_aux.to(s.dtype).reshape(1, -1, 1, 1).expand(*s.shape[:3], 1)], dim=-1)
    p = torch.nan_to_num(torch.softmax(s, dim=-1), nan=0.0)[..., :sk]
    return (p @ v).transpose(1, 2).contiguous(), None


@pytest.fixture(scope="module", autouse=True)
def registered():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    AttentionInterface.register(EXACT, exact_attention)
    AttentionMaskInterface.register(EXACT, sdpa_mask)
    return nki_hf.register()


def _batch(vocab, pad):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (2, 40), generator=g)
    am = torch.ones(2, 40, dtype=torch.long)
    if pad:
        am[0, :7] = 0  # left padding
        am[1, 33:] = 0  # right padding
    return ids, am, ids.masked_fill(am == 0, -100)


def _model(cfg, impl):
    from transformers import AutoModelForCausalLM
    extra = {"experts_implementation": "eager"} if cfg.model_type == "gpt_oss" else {}  # float64-capable experts
    return AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=impl, **extra)


def _run(cfg, impl, state, dtype, ids, am, labels, use_mask):
    model = _model(cfg, impl)
    model.load_state_dict(state)
    model.to(dtype).train()
    out = model(input_ids=ids, attention_mask=am if use_mask else None, labels=labels)
    out.loss.backward()
    grads = {n: p.grad.detach().double() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach().double(), out.loss.detach().double(), grads


def _check(name, ours, truth, base, worst):
    err = float((ours - truth).abs().max()) if truth.numel() else 0.0
    berr = float((base - truth).abs().max()) if truth.numel() else 0.0
    bound = K * berr + FLOOR * float(truth.abs().max() if truth.numel() else 0.0)
    assert torch.isfinite(ours).all(), f"{name}: non-finite values"
    assert err <= bound, f"{name}: error {err:.3e} > {K} x baseline {berr:.3e} + floor (bound {bound:.3e})"
    if bound > 0:
        worst[0] = max(worst[0], (err / bound, name))


@pytest.mark.parametrize("pad", [True, False], ids=["padded", "unpadded"])
@pytest.mark.parametrize("model", ["llama", "qwen3", "mistral", "gemma2", "gemma2_softcap", "gpt_oss"])
def test_tiny_model_matches_reference(model, pad):
    cfg, ref_impl = _configs()[model]
    torch.manual_seed(0)
    state = _model(cfg, ref_impl).state_dict()
    if model == "gpt_oss":
        assert any("sinks" in n for n in state), "GPT-OSS should have attention sinks"
    ids, am, labels = _batch(cfg.vocab_size, pad)
    truth = _run(cfg, EXACT, state, torch.float64, ids, am, labels, pad)
    base = _run(cfg, ref_impl, state, torch.float32, ids, am, labels, pad)
    ours = _run(cfg, nki_hf.NAME, state, torch.float32, ids, am, labels, pad)
    keep = am.bool()
    worst = [(0.0, "")]
    _check("logits", ours[0][keep], truth[0][keep], base[0][keep], worst)
    _check("loss", ours[1], truth[1], base[1], worst)
    assert set(ours[2]) == set(truth[2]), "the same parameters must receive gradients"
    for n in truth[2]:
        _check(f"grad {n}", ours[2][n], truth[2][n], base[2][n], worst)
    print(f"{model} pad={pad}: worst err/bound {worst[0][0]:.3f} ({worst[0][1]})")


def test_tiny_llama_trains_like_sdpa():
    from transformers import AutoModelForCausalLM
    cfg, _ = _configs()["llama"]
    torch.manual_seed(0)
    state = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="sdpa").state_dict()
    ids, am, labels = _batch(cfg.vocab_size, True)

    def losses(impl):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=impl)
        model.load_state_dict(state)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        out = []
        for _ in range(4):
            loss = model(input_ids=ids, attention_mask=am, labels=labels).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            out.append(loss.item())
        return out

    ours, theirs = losses(nki_hf.NAME), losses("sdpa")
    assert ours[-1] < ours[0] - 0.05, f"loss did not decrease: {ours}"
    for a, b in zip(ours, theirs):
        assert abs(a - b) <= 1e-5 * abs(b), f"loss curves diverge: {ours} vs {theirs}"


def test_dropout_training_is_seeded():
    """attention_dropout 0.1 in training: the same torch.manual_seed gives bit-identical loss and gradients, a
    different seed a different loss; eval mode (dropout 0) matches SDPA's eval-mode logits."""
    from transformers import AutoModelForCausalLM, LlamaConfig
    cfg = LlamaConfig(**COMMON, attention_dropout=0.1)
    torch.manual_seed(0)
    state = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="sdpa").state_dict()
    ids, am, labels = _batch(cfg.vocab_size, False)

    def step(seed):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=nki_hf.NAME)
        model.load_state_dict(state)
        model.train()
        torch.manual_seed(seed)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    (l1, g1), (l2, g2), (l3, _) = step(1), step(1), step(2)
    assert torch.equal(l1, l2) and all(torch.equal(a, b) for a, b in zip(g1, g2))
    assert not torch.equal(l1, l3)


def test_mask_with_gaps_is_refused():
    q = torch.randn(1, 2, 8, 16)
    mask = torch.ones(1, 1, 8, 8, dtype=torch.bool)
    mask[..., 3] = False  # a hole in the middle of every row
    module = torch.nn.Module()
    with pytest.raises(NotImplementedError, match="contiguous run"):
        nki_hf.attention_forward(module, q, q, q, mask)
    bias = torch.zeros(1, 1, 8, 8)
    bias[..., 0] = 0.5
    with pytest.raises(NotImplementedError, match="additive bias"):
        nki_hf.attention_forward(module, q, q, q, bias)


def test_generation_with_cache_matches_sdpa():
    """Decoding with a KV cache (one query against a growing cache, left padding): same tokens and scores as
    SDPA within the float32 criterion's scale."""
    cfg, _ = _configs()["mistral"]
    torch.manual_seed(0)
    state = _model(cfg, "sdpa").state_dict()
    ids, am, _ = _batch(cfg.vocab_size, False)
    ids, am = ids[:, :20], am[:, :20].clone()
    am[0, :4] = 0  # left padding, as for batched generation
    runs = {}
    for impl in (nki_hf.NAME, "sdpa"):
        model = _model(cfg, impl)
        model.load_state_dict(state)
        model.eval()
        with torch.no_grad():
            runs[impl] = model.generate(input_ids=ids, attention_mask=am, max_new_tokens=4, do_sample=False,
                                        output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    ours, ref = runs[nki_hf.NAME], runs["sdpa"]
    assert torch.equal(ours.sequences, ref.sequences)
    for a, b in zip(ours.scores, ref.scores):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4 * float(b.abs().max()))
