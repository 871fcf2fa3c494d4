"""A prefill cut into pieces (the scheduler's token budget per step) equals the same prefill in one pass.

The scheduler runs decode steps between the pieces of a long prefill, so the pieces must give the
prompt KV and first-token logits of the whole pass: Full Attention's and the sparse recompute's,
on every backend that writes in place, for piece sizes that cut a chunk, the recompute set or the
question anywhere.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fusionrag.execution.attention_backends import triton_available
from fusionrag.execution.forward import prefill, run_pieces
from fusionrag.execution.recompute import sparse_recompute, sparse_recompute_pieces
from fusionrag.execution.segments import chunk_kv_plain
from fusionrag.models import wrap_model
from fusionrag.models.tiny import byte_tokenizer, tiny_model
from fusionrag.online.prefill import assemble_context, prefill_full, prefill_full_pieces

GEN = torch.Generator().manual_seed(5)
BACKENDS = ["blocked", "reference"] + (["triton-packed"] if triton_available() else [])


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def family_lm(request):
    return wrap_model(tiny_model(request.param, seed=4), byte_tokenizer(), name=f"tiny-{request.param}")


def _prompt():
    system = torch.randint(0, 250, (7,), generator=GEN).tolist()
    chunks = [torch.randint(0, 250, (n,), generator=GEN).tolist() for n in (21, 30, 13)]
    question = torch.randint(0, 250, (6,), generator=GEN).tolist()
    return system, chunks, question


def _count(pieces):
    """Run ``pieces`` one by one; (how many, the result)."""
    n = 0
    while True:
        n += 1
        try:
            next(pieces)
        except StopIteration as done:
            return n, done.value


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("piece", [1, 5, 16, 40])
def test_full_prefill_in_pieces_equals_one_pass(family_lm, backend, piece):
    lm = dataclasses.replace(family_lm, attention=backend)
    system, chunks, question = _prompt()
    whole = prefill_full(lm, system, chunks, question)
    n, got = _count(prefill_full_pieces(lm, system, chunks, question, piece))
    total = len(system) + sum(map(len, chunks)) + len(question)
    assert n == -(-total // piece)  # every piece ran, none longer than the budget
    assert (got.last_logits - whole.last_logits).abs().max().item() < 1e-4
    assert (got.kv.keys - whole.kv.keys).abs().max().item() < 1e-4
    assert (got.kv.values - whole.kv.values).abs().max().item() < 1e-4
    assert got.spans == whole.spans and got.recomputed == whole.recomputed


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("piece", [1, 3, 8])
def test_sparse_recompute_in_pieces_equals_one_pass(family_lm, backend, piece):
    lm = dataclasses.replace(family_lm, attention=backend)
    system, chunks, question = _prompt()
    s_kv, _ = prefill(lm, torch.tensor(system))
    ctx, ids, _ = assemble_context(lm, s_kv, [chunk_kv_plain(lm, s_kv, c) for c in chunks], system, chunks)
    idx = torch.tensor([7, 8, 20, 27, 28, 29, 44, 60, 70])
    before = ctx.keys.clone()
    whole = sparse_recompute(lm, ctx, ids, idx, torch.tensor(question))
    n, got = _count(sparse_recompute_pieces(lm, ctx, ids, idx, torch.tensor(question), piece))
    assert n == -(-(idx.numel() + len(question)) // piece)
    assert (got.last_logits - whole.last_logits).abs().max().item() < 1e-4
    assert (got.kv.keys - whole.kv.keys).abs().max().item() < 1e-4
    assert (got.kv.values - whole.kv.values).abs().max().item() < 1e-4
    assert torch.equal(ctx.keys, before)  # the shared context is read only, piece by piece too


def test_pieces_without_a_budget_are_one_pass(family_lm):
    system, chunks, question = _prompt()
    n, got = _count(prefill_full_pieces(family_lm, system, chunks, question, None))
    assert n == 1
    again = run_pieces(prefill_full_pieces(family_lm, system, chunks, question))
    assert torch.equal(got.last_logits, again.last_logits)
