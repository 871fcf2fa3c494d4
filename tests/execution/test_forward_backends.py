"""The model-level passes on every attention backend: mask-free equals masked, ratio 1 equals Full Attention.

The ``reference`` backend is the old path (a dense additive mask for every pass); the
others must reproduce it: contiguous prefill (no past: the model's causal SDPA kernel;
on a past: a sparse pass), the sparse recompute and, at ratio 1, Full Attention itself.
Tests marked ``gpu`` run the same invariants on CUDA and skip, saying so, without one.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fusionrag.execution.attention_backends import triton_available
from fusionrag.execution.forward import prefill
from fusionrag.execution.recompute import sparse_recompute
from fusionrag.execution.segments import chunk_kv_plain
from fusionrag.online.prefill import all_chunk_indices, assemble_context, prefill_full, prefill_reused

BACKENDS = ["reference", "blocked"] + (["triton", "triton-packed"] if triton_available() else [])
GEN = torch.Generator().manual_seed(7)


def _with(lm, backend: str, device: str | None = None):
    """A view of ``lm`` using ``backend`` (the session fixture itself is left alone)."""
    model = lm.model if device is None else lm.model.to(device)
    return dataclasses.replace(lm, model=model, attention=backend)


def _prompt():
    system = torch.randint(0, 250, (7,), generator=GEN).tolist()
    chunks = [torch.randint(0, 250, (n,), generator=GEN).tolist() for n in (19, 26, 11)]
    question = torch.randint(0, 250, (6,), generator=GEN).tolist()
    return system, chunks, question


def _assembled(lm, system, chunks):
    s_kv, _ = prefill(lm, torch.tensor(system))
    return assemble_context(lm, s_kv, [chunk_kv_plain(lm, s_kv, c) for c in chunks], system, chunks)


@pytest.mark.parametrize("backend", BACKENDS)
def test_contiguous_prefill_without_mask_equals_masked_path(tiny_lm, backend):
    ref, other = _with(tiny_lm, "reference"), _with(tiny_lm, backend)
    ids = torch.randint(0, 250, (40,), generator=GEN)
    kv_ref, logits_ref = prefill(ref, ids, logits_to_keep=0)
    kv, logits = prefill(other, ids, logits_to_keep=0)
    assert (logits - logits_ref).abs().max().item() < 1e-5
    more = torch.randint(0, 250, (13,), generator=GEN)  # on a past: a sparse pass with no stale slot
    on_ref, l_ref = prefill(ref, more, past=kv_ref)
    on, l_other = prefill(other, more, past=kv)
    assert (l_other - l_ref).abs().max().item() < 1e-5
    assert (on.keys - on_ref.keys).abs().max().item() < 1e-5 and on.base_position == on_ref.base_position == 40


@pytest.mark.parametrize("backend", BACKENDS)
def test_ratio_one_equals_full_attention_on_every_backend(tiny_lm, backend):
    lm = _with(tiny_lm, backend)
    system, chunks, question = _prompt()
    full = prefill_full(lm, system, chunks, question)
    ctx, ids, spans = _assembled(lm, system, chunks)
    everything = prefill_reused(lm, ctx, ids, spans, question, all_chunk_indices(spans))
    assert (everything.last_logits - full.last_logits).abs().max().item() < 1e-4
    assert torch.allclose(everything.kv.keys, full.kv.keys, atol=1e-4)
    reuse = prefill_reused(lm, ctx, ids, spans, question)  # can fail: Full Reuse is measurably different
    assert (reuse.last_logits - full.last_logits).abs().max().item() > 1e-3


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "reference"])
def test_sparse_recompute_matches_reference_and_leaves_context_untouched(tiny_lm, backend):
    system, chunks, question = _prompt()
    ref = _with(tiny_lm, "reference")
    ctx, ids, _ = _assembled(ref, system, chunks)
    before = ctx.keys.clone(), ctx.values.clone()
    idx = torch.tensor([7, 8, 15, 30, 31, 32, 50, 62])  # ragged: across chunk boundaries, gaps
    q = torch.tensor(question)
    expected = sparse_recompute(ref, ctx, ids, idx, q)
    got = sparse_recompute(_with(tiny_lm, backend), ctx, ids, idx, q)
    assert (got.last_logits - expected.last_logits).abs().max().item() < 1e-5
    assert (got.kv.values - expected.kv.values).abs().max().item() < 1e-5
    assert torch.equal(ctx.keys, before[0]) and torch.equal(ctx.values, before[1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here: the GPU invariants run on a GPU host")
@pytest.mark.parametrize("backend", ["reference", "blocked", "triton", "triton-packed"])
def test_invariants_on_cuda(tiny_llama, backend):
    """Same invariants on CUDA: ratio 1 equals Full Attention, KV stays on the device, stored KV on the CPU moves."""
    if backend.startswith("triton") and not triton_available():
        pytest.skip("Triton is not installed on this GPU host")
    lm = _with(tiny_llama, backend, device="cuda")
    try:
        system, chunks, question = _prompt()
        full = prefill_full(lm, system, chunks, question)
        ctx, ids, spans = _assembled(lm, system, chunks)
        assert ctx.keys.device.type == "cuda"
        cpu_ctx = ctx.to(device="cpu")  # KV read from disk arrives on the CPU
        everything = prefill_reused(lm, cpu_ctx, ids, spans, question, all_chunk_indices(spans))
        assert everything.kv.keys.device.type == "cuda"
        assert (everything.last_logits - full.last_logits).abs().max().item() < 1e-4
    finally:
        tiny_llama.model.to("cpu")
