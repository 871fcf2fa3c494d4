"""RoPE re-positioning: a chunk computed at 0.. and moved by delta equals the chunk computed at delta.."""

import torch

from fusionrag.execution.forward import prefill
from fusionrag.kvcache.kv import KV, assemble
from fusionrag.models.rope import rotate_keys


def test_shift_equals_computing_at_target_positions(tiny_lm):
    ids = torch.randint(0, 250, (37,), generator=torch.Generator().manual_seed(0))
    at_zero, _ = prefill(tiny_lm, ids, start=0)
    for delta in (1, 17, 1000, 3000):
        at_delta, _ = prefill(tiny_lm, ids, start=delta)
        moved = at_zero.moved_to(delta, tiny_lm.inv_freq)
        assert moved.base_position == delta
        assert torch.allclose(moved.keys, at_delta.keys, atol=2e-4), (moved.keys - at_delta.keys).abs().max()
        # Values carry no position: attention is relative, so they agree too.
        assert torch.allclose(moved.values, at_delta.values, atol=1e-4)
    # and the shift is not a no-op
    assert not torch.allclose(at_zero.moved_to(17, tiny_lm.inv_freq).keys, at_zero.keys, atol=1e-3)


def test_rotation_composes_and_inverts(tiny_lm):
    keys = torch.randn(2, 2, 5, 16)
    inv = tiny_lm.inv_freq[:8]
    there_and_back = rotate_keys(rotate_keys(keys, 123, inv), -123, inv)
    assert torch.allclose(there_and_back, keys, atol=1e-5)
    two_steps = rotate_keys(rotate_keys(keys, 100, inv), 23, inv)
    assert torch.allclose(two_steps, rotate_keys(keys, 123, inv), atol=1e-5)


def test_rotation_does_not_mutate_input(tiny_lm):
    ids = torch.arange(10)
    kv, _ = prefill(tiny_lm, ids)
    before = kv.keys.clone()
    kv.moved_to(50, tiny_lm.inv_freq)
    assert torch.equal(kv.keys, before)


def test_assemble_places_chunks_consecutively(tiny_lm):
    s, _ = prefill(tiny_lm, torch.arange(5))
    a, _ = prefill(tiny_lm, torch.arange(10, 17), past=s)  # computed at 5..11
    b, _ = prefill(tiny_lm, torch.arange(20, 24), past=s)  # computed at 5..8
    ctx, spans = assemble(s, [b, a], tiny_lm.inv_freq)
    assert spans == [(5, 9), (9, 16)]
    assert len(ctx) == 16 and ctx.base_position == 0
    # b stayed where it was; a moved from 5 to 9
    assert torch.allclose(ctx.keys[:, :, 5:9], b.keys)
    assert torch.allclose(ctx.keys[:, :, 9:16], a.moved_to(9, tiny_lm.inv_freq).keys)


def test_concat_rejects_gaps():
    z = torch.zeros(1, 1, 2, 4)
    import pytest

    with pytest.raises(ValueError):
        KV.concat([KV(z, z, 0), KV(z, z, 5)])
