"""The store's one chunk locator (retrieval/chunk_locator.py): token-id and text-start anchors, following the
store's generation by updating what changed, never rebuilding, and never serving a chunk that is gone."""

from __future__ import annotations

import pytest

from fusionrag.models import load_model
from fusionrag.offline import build
from fusionrag.retrieval.overlaps import normalise

TEXTS = {
    "alpha": "The river Ostra floods the lower town of Velmora every spring, and the mills stop for a month.",
    "beta": "A narrow-gauge railway links Velmora with the salt mines in the hills to the north of the valley.",
    "gamma": "Every August the lantern festival floats a thousand paper lights down the Ostra after dark.",
}


@pytest.fixture()
def store(tmp_path):
    from fusionrag.retrieval.embedder import HashingEmbedder

    lm = load_model("tiny-llama")
    s = build.create_store(tmp_path / "kb", lm, chunk_tokens=4096, kv_dtype="float32", embedder=HashingEmbedder(),
                           model_source="tiny-llama")
    for doc in ("alpha", "beta"):
        build.add_passages(s, lm, [{"title": doc, "text": TEXTS[doc]}], doc=doc)
    yield s, lm
    s.close()


def _prompt(store, *chunk_ids: int) -> list[int]:
    """``S``, the chunks' ids as stored, and a question."""
    body = [t for c in chunk_ids for t in store.chunk(c).token_ids]
    return [*store.prompt.system_token_ids, *body, *store.prompt.question_token_ids("Where?")]


def _of(store, doc: str) -> int:
    return store.chunk_ids_of_docs([doc])[0]


def test_the_locator_follows_the_store_by_updating_what_changed(store, monkeypatch):
    s, lm = store
    alpha, beta = _of(s, "alpha"), _of(s, "beta")
    assert [c.chunk_id for c in s.locator.match(_prompt(s, beta, alpha), "plain").chunks] == [beta, alpha]
    assert s.locator.starting_in(normalise(f"see: {TEXTS['alpha']}"), 24) == [alpha]
    read = []
    real = type(s).chunk
    monkeypatch.setattr(type(s), "chunk", lambda self, cid: read.append(cid) or real(self, cid))
    build.add_passages(s, lm, [{"title": "gamma", "text": TEXTS["gamma"]}], doc="gamma")
    gamma = _of(s, "gamma")
    before, ids = s.locator.updates, _prompt(s, gamma, alpha)
    read.clear()
    assert [c.chunk_id for c in s.locator.match(ids, "plain").chunks] == [gamma, alpha]
    assert s.locator.updates == before + 1 and set(read) == {gamma}  # the new chunk read, the others kept
    build.delete_document(s, "alpha")
    assert [c.chunk_id for c in s.locator.match(_prompt(s, beta), "plain").chunks] == [beta]
    assert alpha not in s.chunk_ids() and s.locator.starting_in(normalise(TEXTS["alpha"]), 24) == []
    assert len(s.locator) == 2


def test_a_deleted_chunk_is_never_found_under_its_id_again(store):
    """The highest id, deleted, is not given to the next chunk (ids are never reused), and the locator forgets
    the text it held."""
    s, lm = store
    beta = _of(s, "beta")
    old_ids = list(s.chunk(beta).token_ids)
    assert s.locator.match([*s.prompt.system_token_ids, *old_ids], "plain").chunks
    build.delete_document(s, "beta")
    build.add_passages(s, lm, [{"title": "gamma", "text": TEXTS["gamma"]}], doc="gamma")
    assert _of(s, "gamma") > beta
    assert not s.locator.match([*s.prompt.system_token_ids, *old_ids], "plain").chunks


def test_one_kind_rule_for_both_engines(store):
    """A chunk is located with the entry the request's kind reads: plain-first reads the first chunk plain and
    the rest fused, falling back to plain where a chunk is not fused (as the engine's loader does)."""
    s, lm = store
    alpha, beta = _of(s, "alpha"), _of(s, "beta")
    ids = _prompt(s, alpha, beta)
    assert [c.kind for c in s.locator.match(ids, "plain-first").chunks] == ["plain", "plain"]  # nothing fused yet
    build.fuse(s, lm, top_n=1, progress=False)
    assert [c.kind for c in s.locator.match(ids, "plain-first").chunks] == ["plain", "fused"]
    assert [c.kind for c in s.locator.match(ids, "fused").chunks] == ["fused", "fused"]
    assert [c.kind for c in s.locator.match(ids, "plain").chunks] == ["plain", "plain"]
    s.kv.remove(alpha, "plain")  # a store whose plain KV was dropped: the first chunk reads its fused KV
    assert [c.kind for c in s.locator.match(ids, "plain-first").chunks] == ["fused", "fused"]
    assert [c.chunk_id for c in s.locator.match(ids, "plain").chunks] == [beta]  # plain never reads fused KV
