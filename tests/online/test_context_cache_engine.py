"""A repeated context (same S and chunks in the same order, a new question) prefills only its question."""

from __future__ import annotations

import pytest
import torch

from fusionrag.models import load_model
from fusionrag.offline import build
from fusionrag.online.engine import DEFAULT_CONTEXT_CACHE_BYTES, Engine
from fusionrag.retrieval.embedder import HashingEmbedder
from fusionrag.sample import load_sample

Q1 = "In which city was the discoverer of polonium born?"
Q2 = "Who discovered polonium?"


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    lm = load_model("tiny-llama")
    store = build.create_store(tmp_path_factory.mktemp("kb") / "s", lm, chunk_tokens=4096, kv_dtype="float32",
                               embedder=HashingEmbedder(), model_source="tiny-llama")
    build.add_passages(store, lm, [p for ex in load_sample()[:2] for p in ex["passages"]], doc="sample")
    build.fuse(store, lm, top_n=2, progress=False)
    return store, lm


def _chunks(store, order):
    ids = store.chunk_ids()
    return [{"title": store.chunk(ids[i]).title, "text": store.chunk(ids[i]).text} for i in order]


def test_the_second_question_on_a_context_prefills_only_itself_and_equals_full_attention(parts):
    store, lm = parts
    engine = Engine(store, lm, context_cache_bytes=1 << 30)
    chunks = _chunks(store, [2, 0, 1])
    first = engine.prepare(Q1, method="full", chunks=chunks)
    second = engine.prepare(Q2, method="full", chunks=chunks)
    assert not first.context_cache_hit and second.context_cache_hit and "context cache" in second.note
    assert second.ttft_ms["load"] == second.ttft_ms["select"] == 0.0
    fresh = Engine(store, lm).prepare(Q2, method="full", chunks=chunks)  # no cache
    assert not fresh.context_cache_hit
    assert (second.pre.last_logits - fresh.pre.last_logits).abs().max() < 1e-4
    assert second.prompt_tokens == fresh.prompt_tokens
    # and it decodes the same answer
    assert engine.answer(Q2, method="full", chunks=chunks, max_new_tokens=6).token_ids == \
        Engine(store, lm).answer(Q2, method="full", chunks=chunks, max_new_tokens=6).token_ids


def test_fusionrag_reuses_its_own_context_and_a_full_one(parts):
    store, lm = parts
    engine = Engine(store, lm, context_cache_bytes=1 << 30)
    chunks = _chunks(store, [0, 1, 2])
    a = engine.prepare(Q1, method="fusionrag", ratio=0.5, chunks=chunks)
    b = engine.prepare(Q2, method="fusionrag", ratio=0.5, chunks=chunks)
    assert not a.context_cache_hit and b.context_cache_hit and b.recomputed_tokens == 0
    assert not engine.prepare(Q2, method="fusionrag", ratio=0.25, chunks=chunks).context_cache_hit  # other ratio
    assert not engine.prepare(Q2, method="fusionrag", ratio=0.5, chunks=chunks[::-1]).context_cache_hit  # order
    other = _chunks(store, [3, 1])
    engine.prepare(Q1, method="full", chunks=other)
    hit = engine.prepare(Q2, method="fusionrag", ratio=0.15, chunks=other)  # a full context serves any method
    exact = Engine(store, lm).prepare(Q2, method="full", chunks=other)
    assert hit.context_cache_hit and (hit.pre.last_logits - exact.pre.last_logits).abs().max() < 1e-4


def test_a_store_change_drops_the_contexts_built_on_the_changed_chunks(parts):
    store, lm = parts
    engine = Engine(store, lm, context_cache_bytes=1 << 30)
    chunks = _chunks(store, [0, 1])
    engine.prepare(Q1, method="fusionrag", chunks=chunks)
    engine.invalidate([(store.chunk_ids()[5], "fused")])  # another chunk: kept
    assert engine.prepare(Q2, method="fusionrag", chunks=chunks).context_cache_hit
    engine.invalidate([(store.chunk_ids()[1], "fused")])
    assert not engine.prepare(Q2, method="fusionrag", chunks=chunks).context_cache_hit
    assert engine.stats()["context_cache"].invalidations == 1


def test_decoding_from_a_hit_leaves_the_cached_context_as_it_was(parts):
    store, lm = parts
    engine = Engine(store, lm, context_cache_bytes=1 << 30)
    chunks = _chunks(store, [1, 2])
    engine.answer(Q1, method="reuse", chunks=chunks, max_new_tokens=4)
    (cached,) = [e.value for e in engine.context_cache._entries.values()]
    before = cached.kv.keys.clone(), cached.kv.values.clone()
    for q in (Q2, Q1):
        assert engine.answer(q, method="reuse", chunks=chunks, max_new_tokens=4).context_cache_hit
    assert torch.equal(cached.kv.keys, before[0]) and torch.equal(cached.kv.values, before[1])


def test_the_cache_is_off_in_the_constructor_and_on_in_open(parts, tmp_path):
    store, lm = parts
    assert Engine(store, lm).context_cache.max_bytes == 0  # studies compare methods on one engine
    engine = Engine.open(None, model="tiny-llama")
    assert engine.context_cache.max_bytes == DEFAULT_CONTEXT_CACHE_BYTES
