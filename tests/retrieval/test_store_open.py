"""An open reads the store's settings once: the model check, the collaborators and the index check share them."""

from __future__ import annotations

from fusionrag.models import load_model
from fusionrag.offline import build
from fusionrag.retrieval import knowledge, store_index
from fusionrag.retrieval.embedder import HashingEmbedder
from fusionrag.retrieval.knowledge import KnowledgeStore
from fusionrag.retrieval.store_info import read_settings
from store_helpers import sample_store


def test_an_open_and_a_refresh_read_the_settings_once(tmp_path, monkeypatch):
    path = sample_store(tmp_path / "kb", passages=4, fuse=False)
    lm = load_model("tiny-llama")
    reads = []

    def counted(db):
        reads.append(1)
        return read_settings(db)

    monkeypatch.setattr(knowledge, "read_settings", counted)
    monkeypatch.setattr(store_index, "read_settings", counted)
    store = KnowledgeStore.open(path, lm, embedder=HashingEmbedder())
    assert len(reads) == 1 and store.index.mismatch(store.settings) is None
    reads.clear()
    other = KnowledgeStore.open(path, lm, embedder=HashingEmbedder())  # as another process would
    build.add_passages(other, lm, [{"title": "Extra", "text": "A passage added by another writer."}], doc="extra")
    other.close()
    reads.clear()
    assert store.refresh() and len(reads) == 1
    store.close()
