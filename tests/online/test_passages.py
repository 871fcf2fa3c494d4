"""Where a request's passages come from: the client, the store's retrieval, or nowhere.

A framework that retrieved its own passages must not get the store's on top; a
framework's split of an ingested file must still reuse the stored KV; a server without a store
is plain generation; ``method=auto`` runs ``full`` where reuse does not pay, and says so.
"""

from __future__ import annotations

import pytest
import torch

from fusionrag.errors import StoreMismatchError
from fusionrag.models import load_model
from fusionrag.offline import build
from fusionrag.online.engine import Engine
from fusionrag.retrieval.embedder import HashingEmbedder
from fusionrag.retrieval.knowledge import KnowledgeStore
from fusionrag.retrieval.matching import match_passages, reused_fraction

QUESTION = "Which river runs through the old town?"
PARAGRAPHS = [
    "The old town of Velmora sits on both banks of the river Ostra, which floods every spring.",
    "Its cathedral was finished in 1412 after ninety years of building and two fires.",
    "The market square holds a clock tower whose bells were cast from melted cannons.",
    "Velmora's university, founded in 1520, is known for its early school of cartography.",
    "A narrow-gauge railway links the town with the salt mines in the hills to the north.",
    "Every August the town hosts a festival of lanterns floated down the Ostra at night.",
]
TEXT = "\n\n".join(PARAGRAPHS) + "\n"


@pytest.fixture(scope="module")
def lm():
    return load_model("tiny-llama")


@pytest.fixture(scope="module")
def built(tmp_path_factory, lm):
    root = tmp_path_factory.mktemp("passages")
    doc = root / "velmora.txt"
    doc.write_text(TEXT, encoding="utf-8")
    store = build.create_store(root / "store", lm, chunk_tokens=64, kv_dtype="float32", embedder=HashingEmbedder(),
                               model_source="tiny-llama")
    build.ingest(store, lm, [doc], progress=False)
    return root / "store", doc


@pytest.fixture(scope="module")
def engine(built, lm):
    return Engine(KnowledgeStore.open(built[0], lm, embedder=HashingEmbedder()), lm)


def _plain_logits(lm, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return lm.model(torch.tensor([ids]), use_cache=False).logits[0, -1].float()


@pytest.mark.parametrize("off", [{"retrieval": False}, {"top_k": 0}, {"chunks": []}])
def test_retrieval_off_is_a_full_prefill_of_the_question(engine, lm, off):
    """``retrieval: false``, ``top_k: 0`` and ``documents: []`` mean no passages: S + question only."""
    prep = engine.prepare(QUESTION, method="fusionrag", **off)
    assert prep.chunk_ids == [] and prep.sources == []
    assert prep.method == "full" and "no passages" in prep.note
    ids = engine.prompt.system_token_ids + engine.prompt.question_token_ids(QUESTION)
    assert torch.allclose(prep.pre.last_logits.float().flatten(), _plain_logits(lm, ids), atol=1e-4)


def test_retrieval_on_returns_scored_sources(engine, built):
    prep = engine.prepare(QUESTION, method="fusionrag", top_k=2)
    assert len(prep.chunk_ids) == 2 and all(c is not None for c in prep.chunk_ids)
    assert [s["chunk_id"] for s in prep.sources] == prep.chunk_ids
    assert all(isinstance(s["score"], float) and s["stored"] for s in prep.sources)
    assert all(s["source"] for s in prep.sources)


def test_an_engine_without_a_store_generates_and_computes_passages(lm):
    engine = Engine(None, lm)
    prep = engine.prepare(QUESTION, method="auto")
    assert prep.chunk_ids == [] and "no store" in prep.note
    prep = engine.prepare(QUESTION, method="fusionrag", chunks=[{"title": "T", "text": PARAGRAPHS[0]}])
    assert prep.chunk_ids == [None] and prep.sources[0]["stored"] is False
    done = engine.answer(QUESTION, method="full", max_new_tokens=3)
    assert 1 <= len(done.token_ids) <= 3


def test_a_whole_file_as_one_passage_reuses_every_chunk(engine, built):
    """A framework's loader gives the file as one document, titled differently, whitespace re-flowed."""
    store, path = engine.store, built[1]
    stored = store.chunk_ids_of_docs([str(path.resolve())])
    assert len(stored) >= 3
    for text in (TEXT, " ".join(TEXT.split()), TEXT.replace("\n\n", "\n \n")):
        pieces = match_passages(store, engine.prompt, [{"title": "", "text": text, "source": str(path)}])
        assert [p.chunk_id for p in pieces] == stored, text[:40]
        assert reused_fraction(pieces) == 1.0
    prep = engine.prepare(QUESTION, method="fusionrag", chunks=[{"title": "x", "text": TEXT}])
    assert prep.chunk_ids == stored


def test_a_node_starting_mid_chunk_reuses_the_chunks_it_holds(engine, built):
    store = engine.store
    stored = store.chunk_ids_of_docs([str(built[1].resolve())])
    first = store.chunk(stored[0]).text
    text = first[len(first) // 2:] + "\n\n" + "\n\n".join(store.chunk(c).text for c in stored[1:])
    pieces = match_passages(store, engine.prompt, [{"title": "", "text": text}])
    assert pieces[0].chunk_id is None and first[len(first) // 2:].split()[-1] in pieces[0].text
    assert [p.chunk_id for p in pieces[1:]] == stored[1:]


@pytest.mark.parametrize(("stored_form", "sent_form"), [("NFD", "NFC"), ("NFC", "NFD")])
def test_the_same_text_composed_or_decomposed_reuses_every_chunk(tmp_path, lm, stored_form, sent_form):
    """A file ingested with decomposed accents (NFD) and sent back composed (NFC), or the other way round."""
    import unicodedata

    text = "\n\n".join(p.replace("town", "bourg à l'été").replace("river", "rivière") for p in PARAGRAPHS) + "\n"
    doc = tmp_path / "velmora-fr.txt"
    doc.write_text(unicodedata.normalize(stored_form, text), encoding="utf-8")
    store = build.create_store(tmp_path / "store", lm, chunk_tokens=64, kv_dtype="float32",
                               embedder=HashingEmbedder(), model_source="tiny-llama")
    build.ingest(store, lm, [doc], progress=False)
    stored = store.chunk_ids_of_docs([str(doc.resolve())])
    prompt = Engine(store, lm).prompt

    def reused(form: str) -> list[int | None]:
        passage = {"title": "", "text": unicodedata.normalize(form, text), "source": str(doc)}
        return [p.chunk_id for p in match_passages(store, prompt, [passage])]

    assert unicodedata.normalize(sent_form, text) != unicodedata.normalize(stored_form, text)
    accented = [c for c in stored if "à" in unicodedata.normalize("NFC", store.chunk(c).text)]
    assert len(accented) >= 2 and set(accented) <= set(reused(sent_form))
    assert reused(sent_form) == reused(stored_form)  # what the file's own form reuses, no less


def test_passages_pasted_into_the_prompt_are_served_from_the_store_where_they_occur(engine, built, lm):
    """A pipeline that pastes its passages into the prompt (any template, no ``documents``), retrieval off: the
    prompt is the one fusionrag builds for that question (``S`` and the question segment), token for token; the
    stored chunks found in its ids reuse their KV at their place and the ids around them are computed, as the
    vLLM connector serves the same prompt (issue 48: one behaviour in both engines)."""
    store = engine.store
    stored = [c for c in store.chunk_ids_of_docs([str(built[1].resolve())]) if len(store.chunk(c).text) >= 24]
    pasted = ("Answer the question using only the context below.\n\nContext:\n"
              + "\n---\n".join(store.chunk(c).text for c in stored) + f"\n\nQuestion: {QUESTION}\nAnswer:")
    got = engine.prepare(pasted, method="fusionrag", ratio=1.0, retrieval=False)
    assert [c for c in got.chunk_ids if c is not None] == stored
    assert got.kv_origins.count("store") == len(stored)
    ids = [*engine.prompt.system_token_ids, *engine.prompt.question_token_ids(pasted)]
    assert got.prompt_token_ids == ids  # not rewritten: the prompt without passages, as built
    stored_ids = sum(len(store.chunk(c).token_ids) for c in stored)
    assert 0.7 * stored_ids <= got.precomputed_tokens <= stored_ids  # the chunks' ids, less their framing (titles)
    with torch.no_grad():
        want = lm.model(torch.tensor([ids])).logits[0, -1].float()
    assert (got.pre.last_logits.flatten() - want).abs().max().item() < 1e-4  # ratio 1 = Full Attention
    unrelated = engine.prepare(f"Context: nothing stored here at all, honestly.\n{QUESTION}", retrieval=False)
    assert unrelated.chunk_ids == [] and unrelated.method == "full"
    retrieved = engine.prepare(pasted, method="fusionrag", top_k=2)  # retrieval on: the store is searched instead
    assert len(retrieved.chunk_ids) == 2 and all(c is not None for c in retrieved.chunk_ids)


def test_a_passage_of_new_text_is_new_pieces(engine):
    pieces = match_passages(engine.store, engine.prompt, [{"title": "N", "text": "Nothing stored says this at all."}])
    assert [p.chunk_id for p in pieces] == [None] and reused_fraction(pieces) == 0.0


@pytest.mark.parametrize(("threshold", "expected"), [(10**6, "full"), (1, "fusionrag")])
def test_auto_reuses_only_from_the_break_even_length(built, lm, threshold, expected):
    engine = Engine(KnowledgeStore.open(built[0], lm, embedder=HashingEmbedder()), lm, min_reuse_tokens=threshold)
    prep = engine.prepare(QUESTION, method="auto", top_k=2)
    assert prep.method == expected
    assert prep.note.startswith("auto:") and str(threshold) in prep.note
    assert (prep.kv_kind == "none") == (expected == "full")


def test_another_models_name_is_refused_before_loading(built, monkeypatch):
    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the mismatch was found")

    monkeypatch.setattr("fusionrag.models.load_model", no_load)
    with pytest.raises(StoreMismatchError, match="built with tiny-llama"):
        Engine.open(built[0], model="tiny-qwen2")


def test_a_checkpoint_of_another_family_is_refused_before_loading(built, tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text('{"model_type": "qwen2"}', encoding="utf-8")
    monkeypatch.setattr("fusionrag.models.load_model", lambda *a, **k: pytest.fail("loaded"))
    with pytest.raises(StoreMismatchError, match="qwen2 model"):
        Engine.open(built[0], model=str(tmp_path))


# -- a client's own, finer split: parts of stored chunks ------------------------------------------


def _split(text: str, size: int, overlap: int) -> list[str]:
    """Windows of about ``size`` characters at word boundaries, each starting ``overlap`` characters
    before the last one ended (what LangChain's ``RecursiveCharacterTextSplitter`` does to flat text)."""
    words, out, cur = text.split(), [], []
    for w in words:
        if cur and len(" ".join([*cur, w])) > size:
            out.append(" ".join(cur))
            keep: list[str] = []
            while cur and len(" ".join([cur[-1], *keep])) <= overlap:
                keep.insert(0, cur.pop())
            cur = keep
        cur.append(w)
    return [*out, " ".join(cur)]


@pytest.fixture(scope="module")
def coarse(tmp_path_factory, lm):
    """The same file in chunks of 256 tokens (tiny-llama's tokens are characters: ~250 per chunk)."""
    root = tmp_path_factory.mktemp("coarse")
    doc = root / "velmora.txt"
    doc.write_text(TEXT, encoding="utf-8")
    store = build.create_store(root / "store", lm, chunk_tokens=256, kv_dtype="float32",
                               embedder=HashingEmbedder(), model_source="tiny-llama")
    build.ingest(store, lm, [doc], progress=False)
    return Engine(KnowledgeStore.open(root / "store", lm, embedder=HashingEmbedder()), lm)


def test_a_finer_split_is_served_from_the_parts_of_chunks_it_holds(coarse):
    store = coarse.store
    splits = _split(TEXT, 120, 30)
    assert len(splits) > len(store.chunk_ids()) > 1
    pieces = match_passages(store, coarse.prompt, [{"title": "", "text": s} for s in splits])
    parts = [p for p in pieces if p.span is not None]
    assert parts and all(p.chunk_id is not None for p in parts)
    for p in parts:
        ids = store.chunk(p.chunk_id).token_ids[p.span[0]:p.span[1]]
        assert " ".join(coarse.lm.tokenizer.decode(ids).split()) == p.text or p.text in " ".join(
            coarse.lm.tokenizer.decode(ids).split())
        assert any(p.text in " ".join(s.split()) for s in splits)  # a part is text the client sent
    resolved_ids = [store.chunk(p.chunk_id).token_ids[slice(*(p.span or (None,)))] if p.chunk_id is not None
                    else coarse.prompt.chunk_token_ids(p.title, p.text) for p in pieces]
    stored = sum(len(i) for p, i in zip(pieces, resolved_ids, strict=True) if p.chunk_id is not None)
    assert stored >= 0.9 * sum(map(len, resolved_ids))


def test_pasted_parts_at_ratio_one_are_full_attention(coarse):
    splits = _split(TEXT, 120, 30)
    pasted = "Context:\n" + "\n\n".join(splits[1:5]) + f"\n\nQuestion: {QUESTION}"
    got = coarse.prepare(pasted, method="fusionrag", ratio=1.0, retrieval=False)
    assert any(s is not None and s[0] > 0 for s in got.chunk_parts)
    full = coarse.prepare(pasted, method="full", retrieval=False)
    assert got.prompt_token_ids == full.prompt_token_ids
    assert (got.pre.last_logits - full.pre.last_logits).abs().max().item() < 1e-4


def test_a_part_is_its_stored_kv_moved_to_its_place_and_its_first_tokens_recomputed(coarse, lm):
    splits = _split(TEXT, 120, 30)
    pasted = "Context:\n" + "\n\n".join(splits[2:4]) + f"\n\nQuestion: {QUESTION}"
    reuse = coarse.prepare(pasted, method="reuse", retrieval=False, kv="plain")
    fused = coarse.prepare(pasted, method="fusionrag", ratio=0.05, retrieval=False, kv="plain")
    cut = [i for i, s in enumerate(reuse.chunk_parts) if s is not None and s[0] > 0]
    assert cut
    chosen = set(fused.pre.selected.tolist())
    for i in cut:
        cid, (a, b) = reuse.chunk_ids[i], reuse.chunk_parts[i]
        start, stop = reuse.pre.spans[i]
        entry = coarse.kv_source.get_many([(cid, "plain")])[0]
        moved = entry.kv.slice(a, b).moved_to(start, lm.inv_freq)
        assert torch.allclose(reuse.pre.kv.keys[:, :, start:stop].float(), moved.keys.float(), atol=1e-5)
        assert torch.equal(reuse.pre.kv.values[:, :, start:stop].float(), moved.values.float())
        assert set(range(start, start + 4)) <= chosen


@pytest.mark.parametrize(("new_words", "expected"), [(0, "fusionrag"), (400, "full")])
def test_auto_counts_the_context_that_has_kv_ready(coarse, lm, new_words, expected):
    engine = Engine(coarse.store, lm, min_reuse_tokens=1)
    fresh = " ".join(f"novel{i}" for i in range(new_words))
    pasted = ("Context:\n" + "\n\n".join(_split(TEXT, 120, 30)[:4])
              + f"\n\n{fresh}\n\n{PARAGRAPHS[-1]}\nQuestion: {QUESTION}")
    prep = engine.prepare(pasted, method="auto", retrieval=False)
    assert prep.method == expected, prep.note
    assert "have KV ready" in prep.note


def test_a_pasted_chunk_is_found_by_its_start_whatever_the_search_returns(engine, built, monkeypatch):
    """A template that moves the search windows (DSPy's ``[N] «««`` markers, indented) and a chunk the
    embedding search does not return: each stored chunk is still found, by where its text starts when the
    passages are sent as documents, by its token ids when they are pasted into the question."""
    store = engine.store
    stored = [c for c in store.chunk_ids_of_docs([str(built[1].resolve())]) if len(store.chunk(c).text) >= 24]
    body = "\n".join(f"[{i + 1}] «««\n    {store.chunk(c).text}\n»»»" for i, c in enumerate(stored))
    monkeypatch.setattr(store, "search_each", lambda queries, k: [])
    pieces = match_passages(store, engine.prompt, [{"title": "", "text": body}])
    assert [p.chunk_id for p in pieces if p.chunk_id is not None] == stored
    prep = engine.prepare(f"[[ ## context ## ]]\n{body}\n\n[[ ## question ## ]]\n{QUESTION}", retrieval=False)
    assert [s["chunk_id"] for s in prep.sources if s["chunk_id"] is not None] == stored


def test_a_section_two_files_share_is_credited_to_the_file_pasted_and_computed_pieces_say_so(tmp_path, lm):
    """Issue 47: a section two files share word for word was credited to one of them even when only the other was
    pasted; pieces the server computed showed ``{"chunk_id": null, "source": ""}`` with nothing saying why."""
    shared = "\n\n".join(PARAGRAPHS[:3])
    a, b = tmp_path / "alpha.txt", tmp_path / "beta.txt"
    a.write_text(shared + "\n\nAlpha alone: the western gate was walled up in 1701.\n", encoding="utf-8")
    b.write_text(shared + "\n\nBeta alone: the eastern bridge was rebuilt in stone.\n", encoding="utf-8")
    store = build.create_store(tmp_path / "kb", lm, chunk_tokens=64, kv_dtype="float32",
                               embedder=HashingEmbedder(), model_source="tiny-llama")
    build.ingest(store, lm, [a, b], progress=False)
    for path in (a, b):
        own = set(store.chunk_ids_of_docs([str(path.resolve())]))
        pieces = match_passages(store, store.prompt, [{"title": "", "text": shared, "source": str(path)}])
        assert pieces and all(p.chunk_id in own for p in pieces), path.name
    prep = Engine(store, lm).prepare(QUESTION, method="fusionrag", chunks=[
        {"title": "", "text": shared, "source": str(b)}, {"title": "note", "text": "Nothing stored says this."}])
    assert prep.sources[-1]["chunk_id"] is None and prep.sources[-1]["origin"] == "computed"
    assert all(s["origin"] == "store" for s in prep.sources[:-1])


def test_the_second_round_looks_only_at_chunks_the_first_did_not(engine, built, monkeypatch):
    """Issue 48: the embedding round (for text the first round left unmatched) re-found every region of the first
    round; it now compares only chunks the first round did not, and keeps what the first round found. Here the
    text left over retrieves only chunks the first round compared (its document's): no second comparison at all
    (there used to be one, over the same chunks)."""
    import fusionrag.retrieval.matching as matching_module

    store = engine.store
    first = store.chunk(store.chunk_ids_of_docs([str(built[1].resolve())])[0])
    text = first.text + "\n\n" + " ".join(f"unmatched{i} words that no stored chunk holds" for i in range(4))
    calls: list[set[int]] = []
    real = matching_module.find_regions

    def recording(norm, bodies, *args, **kwargs):
        calls.append({cid for cid, _ in bodies})
        return real(norm, bodies, *args, **kwargs)

    monkeypatch.setattr(matching_module, "find_regions", recording)
    pieces = match_passages(store, engine.prompt, [{"title": "", "text": text}])
    assert len(calls) == 1, calls
    assert first.id in [p.chunk_id for p in pieces]  # what round 1 found is kept
