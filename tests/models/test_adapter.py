"""The model adapter: the one place that reads a decoder's structure, checked on both tiny families."""

import torch

from fusionrag.execution.forward import prefill


def test_adapter_reads_the_shapes_the_cache_has(tiny_lm):
    a = tiny_lm.adapter
    kv, _ = prefill(tiny_lm, torch.arange(5))
    assert kv.keys.shape == (tiny_lm.num_layers, a.num_kv_heads, 5, a.head_dim)
    assert a.num_heads % a.num_kv_heads == 0 and a.attention_scale() == a.head_dim ** -0.5
    assert a.empty_kv_shape(tiny_lm.num_layers) == (tiny_lm.num_layers, a.num_kv_heads, 0, a.head_dim)
    assert tiny_lm.adapter is a  # built once per model


def test_captured_queries_are_the_projection_normed_and_rotated_by_the_model(tiny_lm):
    """What the attention function captures equals the layer's query projection finished by hand (the
    per-head norm where there is one, the model's rotary embedding at the positions)."""
    from fusionrag.execution.attention import capture_queries
    from policy_helpers import queries_by_hand

    a = tiny_lm.adapter
    raw: list[torch.Tensor] = []
    handle = a.last_attention.q_proj.register_forward_hook(lambda _m, _i, out: raw.append(out.detach()))
    try:
        with capture_queries(tiny_lm) as captured:
            prefill(tiny_lm, torch.arange(3, 9), start=3)
    finally:
        handle.remove()
    assert captured[-1].shape == (a.num_heads, 6, a.head_dim)
    assert torch.allclose(captured[-1], queries_by_hand(tiny_lm, raw[-1], torch.arange(3, 9)), atol=1e-6)
