"""The host layer's import rules, read from the source: ring attention and the Hugging Face integration use only
public names of the other modules, the library never imports the top-level ``golden`` package, and the torch
layer reaches the kernels through the one op pair (only ``nki_attn.ops`` imports ``kernel_api``)."""
import ast
import pathlib

import pytest
import torch

import nki_attn
from nki_attn import ops
from nki_attn.spec import flash_spec

PKG = pathlib.Path(nki_attn.__file__).parent
HOST = sorted([*PKG.glob("*.py"), *(PKG / "distributed").glob("*.py"), *(PKG / "integrations").glob("*.py")])


def _imports(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            yield node.level, node.module or "", [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for a in node.names:
                yield 0, a.name, []


@pytest.mark.parametrize("path", [p for p in HOST if p.parent.name in ("distributed", "integrations")],
                         ids=lambda p: f"{p.parent.name}/{p.name}")
def test_distributed_and_integrations_use_public_names_only(path):
    for level, module, names in _imports(path):
        outside = level >= 2 or module.startswith("nki_attn")  # another part of the package
        private = [n for n in names if n.startswith("_")]
        assert not (outside and private), f"{path.name} imports private {private} from {module}"


@pytest.mark.parametrize("path", HOST, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_library_never_imports_golden_or_launches_kernels_outside_the_op_pair(path):
    for level, module, names in _imports(path):
        assert not (level == 0 and module.split(".")[0] == "golden"), f"{path.name} imports {module}"
        if path.name not in ("ops.py", "__init__.py", "cli.py"):
            assert "kernel_api" not in module and "kernel_api" not in names, f"{path.name} imports kernel_api"


def test_op_outputs_are_fresh_contiguous_tensors():
    """Every output of the op pair owns its storage (no view of a permuted or padded kernel buffer)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 200, 2, 32, generator=g) for _ in range(3))
    spec = flash_spec("t", q, k, v, causal=True, sinks=torch.zeros(2))
    out, lse = ops.attention(spec, q, k, v)
    grads = ops.attention_backward(spec, q, k, v, out, torch.ones_like(out), lse)
    for t in (out, lse) + tuple(grads):
        assert t.is_contiguous() and t._base is None


def test_one_custom_op_pair_serves_flex_attention_too():
    """flex_attention runs on the same op pair as flash_attn_func (its block mask as optional inputs): ops.py
    registers exactly two ops, no block-mask pair exists, and a compiled flex_attention graph holds
    ``nki_attn.attention_fwd`` (one node, no graph break)."""
    from nki_attn import flex, masks
    from nki_attn.block_mask import create_block_mask
    assert (PKG / "ops.py").read_text().count("torch.library.custom_op(") == 2
    for name in ("flex_fwd", "flex_bwd"):
        with pytest.raises((AttributeError, RuntimeError)):
            getattr(torch.ops.nki_attn, name)
    bm = create_block_mask(masks.causal_mask, None, None, 256, 256)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 256, 16, generator=g) for _ in range(3))
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(lambda q, k, v: flex.flex_attention(q, k, v, block_mask=bm), fullgraph=True,
                        backend=backend)(q, k, v)
    assert seen.count("nki_attn.attention_fwd.default") == 1, seen
    assert torch.equal(out, flex.flex_attention(q, k, v, block_mask=bm))
