"""A prompt the client built, served token for token: its stored chunks found in its ids, the rest its own.

Issue 47: a raw completion with pasted context got no reuse, and a chat request was rewritten into the
store's layout (the store's system prompt first, the client's after the passages). Here the client's ids are
the prompt: ``prompt_tokens`` is their count, ratio 1 is Full Attention over exactly them, and the stored
chunks inside are served from the store, whatever template surrounds them.
"""

from __future__ import annotations

import pytest
import torch

from fusionrag.online.engine import Engine
from fusionrag.online.request import ReuseRequest
from store_helpers import sample_store

QUESTION = "Who discovered polonium?"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from fusionrag.models import load_model
    from fusionrag.retrieval.embedder import HashingEmbedder
    from fusionrag.retrieval.knowledge import KnowledgeStore

    path = sample_store(tmp_path_factory.mktemp("client") / "kb")
    lm = load_model("tiny-llama")
    return Engine(KnowledgeStore.open(path, lm, embedder=HashingEmbedder()), lm)


def pasted(engine, chunk_ids, template="Context documents follow.\n{docs}\nQ: {q}\nA:"):
    store = engine.store
    docs = "\n---\n".join(store.chunk(c).text for c in chunk_ids)
    return template.format(docs=docs, q=QUESTION)


def full_logits(engine, ids):
    with torch.no_grad():
        return engine.lm.model(torch.tensor([ids])).logits[0, -1].float()


def test_a_raw_prompt_is_served_token_for_token_with_its_stored_chunks_reused(engine):
    chunks = engine.store.chunk_ids()[:3]
    prompt = pasted(engine, chunks)
    ids = engine.prompt.raw_token_ids(prompt)
    at_one = engine.prepare(ReuseRequest(prompt, "fusionrag", 1.0, raw=True))
    assert at_one.prompt_token_ids == ids and at_one.prompt_tokens == len(ids)
    assert (at_one.pre.last_logits - full_logits(engine, ids)).abs().max() < 1e-4
    reused = engine.prepare(ReuseRequest(prompt, "fusionrag", 0.15, raw=True))
    stored = [s for s in reused.sources if s["stored"]]
    assert [s["chunk_id"] for s in stored] == chunks and all(s["origin"] == "store" for s in stored)
    assert reused.prompt_token_ids == ids and reused.reused_tokens > 0.5 * sum(
        len(engine.store.chunk(c).token_ids) for c in chunks)
    gaps = [s for s in reused.sources if not s["stored"]]
    assert gaps and all(s["origin"] == "computed" for s in gaps)  # the separators: the client's own tokens


def test_the_clients_own_tokens_between_chunks_are_always_recomputed(engine):
    chunks = engine.store.chunk_ids()[1:4]
    prompt = pasted(engine, chunks, "{docs}\n\n### Question\n{q}\n### Answer\n")
    reuse = engine.prepare(ReuseRequest(prompt, "reuse", 0.0, raw=True))  # Full Reuse: nothing selected ...
    spans = reuse.pre.spans
    gap_positions = {t for (a, b), s in zip(spans, reuse.sources, strict=True) if not s["stored"]
                     for t in range(a, b)}
    assert gap_positions and gap_positions <= set(reuse.pre.selected.tolist())  # ... but the gaps
    assert reuse.recomputed_tokens == len(gap_positions)


def test_a_raw_prompt_without_stored_chunks_or_with_full_is_computed_whole(engine):
    plain = engine.prepare(ReuseRequest("Just a sentence to continue", "fusionrag", 0.15, raw=True))
    assert plain.chunk_ids == [] and plain.method == "full"
    prompt = pasted(engine, engine.store.chunk_ids()[:2])
    full = engine.prepare(ReuseRequest(prompt, "full", 1.0, raw=True))
    ids = engine.prompt.raw_token_ids(prompt)
    assert full.prompt_token_ids == ids and (full.pre.last_logits - full_logits(engine, ids)).abs().max() < 1e-4
