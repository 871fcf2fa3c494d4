"""RoPE re-positioning: a chunk computed at 0.. and moved by delta equals the chunk computed at delta.."""

import pytest
import torch
from assemble_reference import assemble_per_chunk

from fusionrag.execution.forward import prefill
from fusionrag.kvcache.kv import KV, assemble
from fusionrag.models.rope import rotate_half, rotate_keys


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


def test_rotation_is_rotate_half_bit_for_bit(tiny_lm):
    """The halves form (x1 c - x2 s, x2 c + x1 s) is the textbook k c + rotate_half(k) s to the bit."""
    keys = torch.randn(3, 2, 9, 16, generator=torch.Generator().manual_seed(4))
    inv = tiny_lm.inv_freq[:8]
    for delta in (5, -3000, torch.arange(9) * 37 - 100):
        angles = torch.as_tensor(delta, dtype=torch.float64).reshape(-1, 1) * inv.reshape(1, -1)
        angles = torch.cat((angles, angles), dim=-1)
        cos, sin = angles.cos().float(), angles.sin().float()
        assert torch.equal(rotate_keys(keys, delta, inv), keys * cos + rotate_half(keys) * sin)


@pytest.mark.parametrize(("stored", "dtype"), [(torch.float32, torch.float32), (torch.float16, torch.float32),
                                               (torch.float16, torch.bfloat16), (torch.float32, torch.float16)])
def test_batched_assembly_equals_chunk_by_chunk(stored, dtype):
    """One rotation per layer for all chunks gives the chunk-by-chunk result exactly: ragged chunks computed
    at different positions (plain after S, fused at S's end, one already in place, one of length 0)."""
    g = torch.Generator().manual_seed(9)
    kv = lambda t, base: KV(torch.randn(3, 2, t, 16, generator=g).to(stored),  # noqa: E731
                            torch.randn(3, 2, t, 16, generator=g).to(stored), base)
    prefix = KV(torch.randn(3, 2, 5, 16, generator=g), torch.randn(3, 2, 5, 16, generator=g), 0)
    chunks = [kv(7, 5), kv(1, 5), kv(0, 40), kv(11, 13), kv(4, 2000), kv(6, 5)]
    inv = 1.0 / (10000 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    got, spans = assemble(prefix, chunks, inv, dtype=dtype)
    want, want_spans = assemble_per_chunk(prefix, chunks, inv, dtype=dtype)
    assert spans == want_spans == [(5, 12), (12, 13), (13, 13), (13, 24), (24, 28), (28, 34)]
    assert got.keys.dtype == dtype and got.base_position == want.base_position == 0
    assert torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values)
    alone, no_spans = assemble(prefix, [], inv, dtype=dtype)
    assert no_spans == [] and torch.equal(alone.keys, prefix.keys.to(dtype))
    assert alone.keys.data_ptr() != prefix.keys.data_ptr()  # a new tensor: the prefix may be shared


def test_concat_rejects_gaps():
    z = torch.zeros(1, 1, 2, 4)

    with pytest.raises(ValueError):
        KV.concat([KV(z, z, 0), KV(z, z, 5)])
