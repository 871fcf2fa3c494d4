"""The model adapter: the one place that reads a decoder's structure, checked on both tiny families."""

import torch

from fusionrag.execution.forward import prefill
from fusionrag.models.rope import rotate_half


def test_adapter_reads_the_shapes_the_cache_has(tiny_lm):
    a = tiny_lm.adapter
    kv, _ = prefill(tiny_lm, torch.arange(5))
    assert kv.keys.shape == (tiny_lm.num_layers, a.num_kv_heads, 5, a.head_dim)
    assert a.num_heads % a.num_kv_heads == 0 and a.attention_scale() == a.head_dim ** -0.5
    assert a.empty_kv_shape(tiny_lm.num_layers) == (tiny_lm.num_layers, a.num_kv_heads, 0, a.head_dim)
    assert tiny_lm.adapter is a  # built once per model


def test_finished_queries_are_the_models_rotary_embedding_applied_per_head(tiny_lm):
    """The adapter's queries are the raw projection rotated with the model's own (cos, sin) at their
    positions (the tiny families have no per-head norm); the eager-attention check of the selection
    scores (tests/online/test_policies.py) covers the rest of the path."""
    a = tiny_lm.adapter
    assert getattr(a.last_attention, "q_norm", None) is None
    pos = torch.arange(3, 7)
    cos, sin = a.rotary(torch.zeros(1), pos[None])
    x = torch.randn(4, a.head_dim, generator=torch.Generator().manual_seed(0))
    expected = x * cos[0] + rotate_half(x) * sin[0]
    raw = x.repeat(1, a.num_heads)[None]  # [1, n, heads*d]: every head the same vector
    out = a.finish_queries(raw, pos)
    assert out.shape == (a.num_heads, 4, a.head_dim)
    assert torch.allclose(out[0], expected.float(), atol=1e-5) and torch.allclose(out[-1], out[0])
