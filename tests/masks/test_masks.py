"""The prebuilt mask_mods of ``nki_attn.masks`` against their definitions (element by element, plain Python),
and under ``torch.vmap`` (torch's own ``create_block_mask`` evaluates them that way)."""
import pytest
import torch

from nki_attn import masks
from nki_attn.block_mask import create_block_mask

S = 40
IDS = torch.tensor([0] * 7 + [1] * 13 + [2] * 1 + [3] * 19)
IDS2 = torch.stack([IDS, torch.tensor([0] * 25 + [1] * 15)])
PREFIX = torch.tensor([5, 17])

DEFINITIONS = {
    "causal": (masks.causal_mask, lambda b, q, k: q >= k),
    "sliding_window": (masks.sliding_window(6), lambda b, q, k: 0 <= q - k < 6),
    "sliding_window_two_sided": (masks.sliding_window(6, causal=False), lambda b, q, k: abs(q - k) < 6),
    "document": (masks.document(IDS), lambda b, q, k: IDS[q] == IDS[k]),
    "document_batched": (masks.document(IDS2), lambda b, q, k: IDS2[b, q] == IDS2[b, k]),
    "prefix_lm": (masks.prefix_lm(PREFIX), lambda b, q, k: k < PREFIX[b] or q >= k),
    "prefix_lm_int": (masks.prefix_lm(9), lambda b, q, k: k < 9 or q >= k),
    "chunked_local": (masks.chunked_local(8), lambda b, q, k: q // 8 == k // 8 and q >= k),
    "chunked_local_bidirectional": (masks.chunked_local(8, causal=False), lambda b, q, k: q // 8 == k // 8),
    "dilated": (masks.dilated(3), lambda b, q, k: q >= k and (q - k) % 3 == 0),
    "dilated_window": (masks.dilated(3, window=4), lambda b, q, k: q >= k and (q - k) % 3 == 0 and q - k < 12),
    "dilated_two_sided": (masks.dilated(2, causal=False), lambda b, q, k: (q - k) % 2 == 0),
    "and": (masks.and_masks(masks.causal_mask, masks.document(IDS)), lambda b, q, k: q >= k and IDS[q] == IDS[k]),
    "or": (masks.or_masks(masks.sliding_window(3), masks.prefix_lm(4)),
           lambda b, q, k: 0 <= q - k < 3 or k < 4 or q >= k),
}


@pytest.mark.parametrize("name", sorted(DEFINITIONS))
def test_mask_matches_definition(name):
    mm, definition = DEFINITIONS[name]
    nb = 2
    want = torch.tensor([[[bool(definition(b, q, k)) for k in range(S)] for q in range(S)] for b in range(nb)])
    bm = create_block_mask(mm, nb, None, S, S)
    assert torch.equal(bm.to_dense()[:, 0], want)
    # the same function under vmap, one (b, h, q, kv) at a time, as torch's create_block_mask calls it
    fn = mm
    for dims in ((None, None, None, 0), (None, None, 0, None), (None, 0, None, None), (0, None, None, None)):
        fn = torch.vmap(fn, in_dims=dims, out_dims=0)
    got = fn(torch.arange(nb), torch.arange(1), torch.arange(S), torch.arange(S))[:, 0]
    assert torch.equal(got, want)


@pytest.mark.parametrize("call, exc", [
    (lambda: masks.sliding_window(0), ValueError),
    (lambda: masks.chunked_local(-1), ValueError),
    (lambda: masks.dilated(2, window=0), ValueError),
    (lambda: masks.document(torch.zeros(4)), TypeError),
    (lambda: masks.prefix_lm(-1), ValueError),
    (lambda: masks.and_masks(), TypeError),
    (lambda: masks.or_masks(masks.causal_mask, 3), TypeError),
])
def test_bad_arguments(call, exc):
    with pytest.raises(exc):
        call()
