"""Documents with identity: re-ingest replaces, unchanged files are skipped, sync, legacy stores, delete."""

from __future__ import annotations

import json
import sqlite3

import pytest

from fusionrag.errors import FusionRAGError
from fusionrag.models import load_model
from fusionrag.offline import build
from fusionrag.prompt import passage_hash
from fusionrag.retrieval.embedder import HashingEmbedder
from fusionrag.retrieval.knowledge import KnowledgeStore
from fusionrag.retrieval.store_info import list_documents

SECTIONS = {
    "Lava": "Lava is molten rock that flows from a volcano during an eruption.",
    "Ash": "Volcanic ash is made of tiny rock fragments blown out by explosive eruptions.",
    "Geysers": "Geysers spout hot water heated by magma deep under the ground.",
    "Glaciers": "Glaciers are rivers of ice that carve valleys as they move.",
    "Deserts": "Deserts get very little rain and have few plants.",
}


@pytest.fixture(scope="module")
def lm():
    return load_model("tiny-llama")


@pytest.fixture
def store(tmp_path, lm):
    s = build.create_store(tmp_path / "kb", lm, kv_dtype="float32", embedder=HashingEmbedder(64))
    yield s
    s.close()


def _md(path, sections=SECTIONS):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"# {title}\n{text}\n" for title, text in sections.items()))
    return path


def _id(store, title, text):
    return store.find_by_hash(passage_hash(title, text))


def test_an_edited_file_replaces_its_old_version_and_an_unchanged_one_is_skipped(store, lm, tmp_path):
    doc = _md(tmp_path / "docs" / "earth.md")
    first = build.ingest(store, lm, [doc], progress=False)
    key = str(doc.resolve())
    assert first.documents["added"] == [key] and first.new_chunks == 5
    old = _id(store, "Ash", SECTIONS["Ash"])
    kept = _id(store, "Lava", SECTIONS["Lava"])

    edited = {**SECTIONS, "Ash": SECTIONS["Ash"].replace("tiny", "small")}  # one word changed
    _md(doc, edited)
    report = build.ingest(store, lm, [doc], progress=False)
    assert report.documents["updated"] == [key] and report.new_chunks == 1
    assert report.removed_ids == [old] and set(report.removed_keys) == {(old, "plain"), (old, "fused")}
    assert _id(store, "Ash", SECTIONS["Ash"]) is None  # the old version is gone: metadata, vectors, KV files
    new = _id(store, "Ash", edited["Ash"])
    assert old not in store.chunk_ids() and not store.kv_path(old, "plain").exists() and store.has_kv(new, "plain")
    assert old not in store.search(SECTIONS["Ash"], 5) and _id(store, "Lava", SECTIONS["Lava"]) == kept
    assert store.documents.chunks_of(key) == sorted(_id(store, t, x) for t, x in edited.items())
    assert store.documents.using([new, kept]) == [key] and store.chunk(new).doc == "earth.md"  # id vs group

    again = build.ingest(store, lm, [doc], progress=False)
    assert again.documents["unchanged"] == [key] and again.chunks == 0 and again.removed_ids == []
    [rec] = store.documents.all()
    assert (rec.id, rec.source, rec.origin, rec.chunks, rec.title) == (key, key, "file", 5, "Lava")


def test_a_chunk_shared_with_another_document_survives_the_others_update(store, lm, tmp_path):
    a = _md(tmp_path / "a.md")
    b = _md(tmp_path / "b.md", {"Lava": SECTIONS["Lava"], "Other": "Something else entirely."})
    build.ingest(store, lm, [a, b], progress=False)
    lava = _id(store, "Lava", SECTIONS["Lava"])
    _md(b, {"Other": "Something else entirely."})
    report = build.ingest(store, lm, [a, b], progress=False)
    assert report.documents["updated"] == [str(b.resolve())] and report.documents["unchanged"] == [str(a.resolve())]
    assert report.removed_ids == [] and _id(store, "Lava", SECTIONS["Lava"]) == lava  # a still uses it
    mine = store.documents.chunks_of(str(a.resolve()))
    assert build.delete_documents(store, lm, [str(a.resolve())]).removed_ids == mine  # b no longer uses Lava
    assert _id(store, "Lava", SECTIONS["Lava"]) is None


def test_a_re_fuse_after_an_update_re_fuses_the_chunks_that_had_the_removed_one_as_neighbour(store, lm, tmp_path):
    doc = _md(tmp_path / "earth.md")
    build.ingest(store, lm, [doc], progress=False)
    build.fuse(store, lm, top_n=2, progress=False)
    users = {c: [x for x in store.chunk_ids() if c in (store.chunks.neighbours_of(x) or [])] for c in store.chunk_ids()}
    gone_title = next(t for t, x in SECTIONS.items() if users[_id(store, t, x)])
    gone = _id(store, gone_title, SECTIONS[gone_title])
    _md(doc, {**SECTIONS, gone_title: SECTIONS[gone_title] + " Changed."})
    report = build.ingest(store, lm, [doc], progress=False)
    assert report.removed_ids == [gone] and report.fuse is not None
    refused = {c for c, kind in report.changed_keys if kind == "fused"}
    assert set(users[gone]) <= refused  # every chunk that had it as a neighbour was re-fused ...
    assert all(gone not in store.chunks.neighbours_of(c) for c in store.chunk_ids())  # ... without it
    assert all(store.has_kv(c, "fused") for c in store.chunk_ids())


def test_an_id_names_one_file_and_the_same_id_replaces_it(store, lm, tmp_path):
    v1 = _md(tmp_path / "v1" / "guide.md", {"Intro": "Version one of the guide."})
    v2 = _md(tmp_path / "v2" / "guide.md", {"Intro": "Version two of the guide."})
    assert build.ingest(store, lm, [v1], progress=False, doc_id="guide").documents["added"] == ["guide"]
    report = build.ingest(store, lm, [v2], progress=False, doc_id="guide")
    assert report.documents["updated"] == ["guide"] and len(report.removed_ids) == 1
    assert [d.source for d in store.documents.all()] == [str(v2.resolve())]
    with pytest.raises(FusionRAGError, match="one file"):
        build.ingest(store, lm, [v1, v2], progress=False, doc_id="guide")


def test_sync_removes_only_the_gone_files_under_the_given_folders(store, lm, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    files = [_md(a / "one.md", {"One": "First file text."}), _md(a / "two.md", {"Two": "Second file text."}),
             _md(b / "three.md", {"Three": "Third file text."})]
    build.ingest(store, lm, [a, b], progress=False)
    files[1].unlink()
    files[2].unlink()
    report = build.ingest(store, lm, [a], progress=False, sync=True)
    assert report.documents["removed"] == [str(files[1].resolve())] and len(report.removed_ids) == 1
    assert report.documents["unchanged"] == [str(files[0].resolve())]
    assert str(files[2].resolve()) in {d.id for d in store.documents.all()}  # b was not synced
    gone = build.ingest(store, lm, [b / "three.md"], progress=False, sync=True)  # a missing path given with --sync
    assert gone.documents["removed"] == [str(files[2].resolve())] and not gone.problems
    assert build.ingest(store, lm, [tmp_path / "never"], progress=False, sync=True).failed_files == [
        str(tmp_path / "never")]


def _as_before_document_ids(kb, name: str) -> None:
    """The store as one built before documents were recorded: no documents table, chunks named by ``name``."""
    db = sqlite3.connect(kb / "store.sqlite")
    with db:
        db.execute("DROP TABLE documents")
        db.execute("UPDATE chunk_refs SET doc = ?", (name,))
    db.close()


def test_an_old_store_with_bare_file_names_opens_lists_and_is_replaced_by_a_re_ingest(tmp_path, lm):
    doc = _md(tmp_path / "docs" / "earth.md")
    store = build.create_store(tmp_path / "kb", lm, kv_dtype="float32", embedder=HashingEmbedder(64))
    build.ingest(store, lm, [doc], progress=False)
    old = _id(store, "Ash", SECTIONS["Ash"])
    store.close()
    _as_before_document_ids(tmp_path / "kb", "earth.md")
    assert [(d.id, d.origin, d.chunks) for d in list_documents(tmp_path / "kb")] == [("earth.md", "legacy", 5)]
    store = KnowledgeStore.open(tmp_path / "kb", lm, embedder=HashingEmbedder(64))  # writable: migrated
    assert [(d.id, d.origin) for d in store.documents.all()] == [("earth.md", "legacy")]
    _md(doc, {**SECTIONS, "Ash": "Ash, edited."})
    report = build.ingest(store, lm, [doc], progress=False)
    assert report.documents["removed"] == ["earth.md"] and report.removed_ids == [old]
    assert [(d.id, d.chunks) for d in store.documents.all()] == [(str(doc.resolve()), 5)]
    store.close()


def test_delete_by_file_path_finds_the_file_in_a_store_built_before_document_ids(tmp_path, lm, capsys):
    """Before: `fusionrag delete docs/earth.md` on such a store said "no document" (its chunks are named by the
    bare file name there)."""
    from fusionrag.cli import main

    doc = _md(tmp_path / "docs" / "earth.md")
    store = build.create_store(tmp_path / "kb", lm, kv_dtype="float32", embedder=HashingEmbedder(64),
                               model_source="tiny-llama")
    build.ingest(store, lm, [doc], progress=False)
    store.close()
    _as_before_document_ids(tmp_path / "kb", "earth.md")
    assert main(["delete", str(doc), "--store", str(tmp_path / "kb"), "--quiet"]) == 0
    assert json.loads(capsys.readouterr().out)["removed"] == ["earth.md"]
    assert list_documents(tmp_path / "kb") == []


def test_a_passage_source_splits_like_the_reader_and_set_document_replaces(store, lm):
    ids = build.add_passages(store, lm, [{"text": "# A\nalpha text\n# B\nbeta text", "source": "notes.md"}],
                             doc="posted")
    assert [store.chunk(i).title for i in ids] == ["A", "B"]
    keys = build.set_document(store, "posted", ids[:1], source="notes.md", title="A")
    assert keys == [(ids[1], "plain"), (ids[1], "fused")]
    assert [(d.id, d.origin, d.chunks, d.source)
            for d in store.documents.all()] == [("posted", "passages", 1, "notes.md")]
