"""The knowledge store (retrieval/knowledge.py): chunks, index, KV files, model checks, CLI."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from fusionrag.errors import CacheIntegrityError, FusionRAGError
from fusionrag.execution.segments import chunk_kv_plain
from fusionrag.kvcache.kv import KV
from fusionrag.models import load_model
from fusionrag.offline import build
from fusionrag.prompt import chunk_text, passage_hash
from fusionrag.retrieval.chunk_table import UnknownChunkError
from fusionrag.retrieval.embedder import HashingEmbedder
from fusionrag.retrieval.knowledge import KnowledgeStore
from fusionrag.retrieval.store_info import store_info, stored_model

PASSAGES = [
    {"title": "Paris", "text": "Paris is the capital of France. It lies on the Seine river."},
    {"title": "Lyon", "text": "Lyon is a city in France on the Rhone and Saone rivers."},
    {"title": "Berlin", "text": "Berlin is the capital of Germany. It lies on the Spree river."},
    {"title": "Rhine", "text": "The Rhine river flows through Germany and the Netherlands."},
    {"title": "Cats", "text": "Cats are small domesticated carnivorous mammals that purr."},
]


@pytest.fixture(scope="module")
def lm():
    return load_model("tiny-llama")


def _kv(n=5, seed=0, base=7):
    g = torch.Generator().manual_seed(seed)
    return KV(torch.randn(2, 2, n, 16, generator=g), torch.randn(2, 2, n, 16, generator=g), base)


def _write_corpus(path, passages=PASSAGES, doc="q1"):
    path.write_text(json.dumps({"id": doc, "question": "?", "passages": passages}) + "\n")
    return path


def _store(tmp_path, lm, **kw):
    kw.setdefault("kv_dtype", "float32")
    return KnowledgeStore.create(tmp_path / "kb", lm, chunk_tokens=160, embedder=HashingEmbedder(64), **kw)


# ---------------------------------------------------------------- KnowledgeStore


def test_store_lifecycle(tmp_path, lm):
    ks = _store(tmp_path, lm)
    report = build.ingest(ks, lm, [_write_corpus(tmp_path / "c.jsonl")], progress=False)
    assert report.new_chunks == 5 and report.plain_computed == 5 and not report.problems
    ids = ks.chunk_ids()
    assert ids == [0, 1, 2, 3, 4]
    rec = ks.chunk(0)
    assert (rec.title, rec.doc, rec.n_tokens) == ("Paris", "c.jsonl#q1", len(rec.token_ids))
    assert rec.token_ids == ks.prompt.chunk_token_ids("Paris", PASSAGES[0]["text"])
    assert ks.find_by_hash(passage_hash("Lyon", PASSAGES[1]["text"])) == 1 and ks.find_by_hash("nope") is None
    with pytest.raises(UnknownChunkError):
        ks.chunk(99)

    # plain KV = S + chunk prefill, verified, at base len(S)
    s_len = len(ks.prompt.system_token_ids)
    plain = ks.kv.load(2, "plain")
    assert plain.base_position == s_len and len(plain) == ks.chunk(2).n_tokens
    ref = chunk_kv_plain(lm, ks.load_system_kv(), ks.chunk(2).token_ids)
    torch.testing.assert_close(plain.keys, ref.keys)
    assert ks.has_kv(2, "plain") and not ks.has_kv(2, "fused") and ks.load_entry(2, "plain").scores is None
    assert ks.search(chunk_text("Berlin", PASSAGES[2]["text"]), 2)[0] == 2

    # duplicates map to existing ids; new passages get plain KV
    got = build.add_passages(ks, lm, [PASSAGES[3], {"title": "Dogs", "text": "Dogs bark."}])
    assert got == [3, 5] and ks.has_kv(5, "plain")

    # ingesting the same file again adds nothing: unchanged, skipped before it is read
    again = build.ingest(ks, lm, [tmp_path / "c.jsonl"], progress=False)
    assert again.new_chunks == 0 and again.chunks == 0 and again.plain_computed == 0
    assert again.documents["unchanged"] == [str((tmp_path / "c.jsonl").resolve())]

    info = store_info(ks.path)
    assert info["chunks"] == 6 and info["plain_kv"] == 6 and info["fused_kv"] == 0 and info["model"] == "tiny-llama"
    assert info["bytes_on_disk"] > info["plain_kv_bytes"] > 0 and info["settings"]["kv_dtype"] == "float32"
    assert info["system_prompt"] == ks.prompt.system_prompt and info["system_prompt"]  # the text, not only a hash
    ks.close()

    # reopen: with the recorded model, and with the index file lost (rebuilt from SQLite)
    (tmp_path / "kb" / "index.faiss").unlink()
    assert stored_model(tmp_path / "kb") == "tiny-llama"
    ks2 = KnowledgeStore.open(tmp_path / "kb", lm=load_model(stored_model(tmp_path / "kb")))
    assert ks2.fingerprint == lm.fingerprint and len(ks2.index) == 6
    assert ks2.search("Dogs bark.", 1) == [5]
    torch.testing.assert_close(ks2.load_system_kv().keys, build.ensure_system_kv(ks2, lm).keys)


def test_store_refuses_another_model(tmp_path, lm):
    ks = _store(tmp_path, lm)
    build.ingest(ks, lm, [_write_corpus(tmp_path / "c.jsonl")], progress=False)
    ks.close()
    with pytest.raises(CacheIntegrityError, match="cannot reuse its caches"):
        KnowledgeStore.open(tmp_path / "kb", lm=load_model("tiny-qwen2"))
    with pytest.raises(FusionRAGError, match="embedded with hashing-64"):
        KnowledgeStore.open(tmp_path / "kb", lm=lm, embedder=HashingEmbedder(32))
    with pytest.raises(FusionRAGError, match="already exists"):
        _store(tmp_path, lm)
    with pytest.raises(FusionRAGError, match="no knowledge store"):
        KnowledgeStore.open(tmp_path / "nothing-here", lm=lm)
    with pytest.raises(FusionRAGError, match="no knowledge store"):
        stored_model(tmp_path / "nothing-here")


def test_corrupted_store_file_detected_on_load(tmp_path, lm):
    ks = _store(tmp_path, lm)
    build.ingest(ks, lm, [_write_corpus(tmp_path / "c.jsonl")], progress=False)
    path = ks.kv_path(1, "plain")
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CacheIntegrityError, match="chunk 1"):
        ks.kv.load(1, "plain")


def test_cli_ingest_preprocess_info(tmp_path, capsys):
    from fusionrag.offline.cli import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command", required=True))
    corpus = _write_corpus(tmp_path / "c.jsonl")
    (tmp_path / "bad.jsonl").write_text("{oops\n")
    store = str(tmp_path / "kb")

    def run(*argv):
        args = parser.parse_args(list(argv))
        return args.func(args)

    assert run("ingest", str(corpus), str(tmp_path / "bad.jsonl"), "--store", store, "--model", "tiny-llama",
               "--embedder", "hashing-64", "--chunk-tokens", "160", "--quiet", "--json") == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["new_chunks"] == 5 and "bad.jsonl:1: bad JSON" in out.err
    with pytest.raises(FusionRAGError, match="cannot change after creation"):
        run("ingest", str(corpus), "--store", store, "--chunk-tokens", "64", "--quiet")
    assert run("preprocess", "--store", store, "--top-n", "2", "--quiet") == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["computed"] == 5 and rep["same_document"] is False
    assert run("store", "info", "--store", store) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["fused_kv"] == 5 and info["settings"]["kv_dtype"] == "int8"  # fusionrag ingest's default
    assert info["settings"]["fuse"] == {"top_n": 2, "neighbour_order": "nearest_first", "same_document": False,
                                        "min_similarity": None}


def test_delete_doc_removes_chunks_vectors_and_kv(tmp_path):
    from fusionrag.models import load_model
    from fusionrag.retrieval.embedder import HashingEmbedder
    from fusionrag.retrieval.knowledge import KnowledgeStore

    lm = load_model("tiny-llama")
    store = build.create_store(tmp_path / "kb", lm, kv_dtype="float32", embedder=HashingEmbedder())
    keep = build.add_passages(store, lm, [{"title": "A", "text": "alpha beta"}], doc="keep")
    gone = build.add_passages(store, lm, [{"title": "B", "text": "gamma delta"}, {"title": "C", "text": "eps"}],
                              doc="gone")
    assert build.delete_document(store, "gone") == [(c, k) for c in sorted(gone) for k in ("plain", "fused")]
    assert store.chunk_ids() == keep and store.delete_doc("gone") == []
    assert all(not store.has_kv(c, "plain") for c in gone)
    assert store.search("gamma delta", 3) == keep
    reopened = KnowledgeStore.open(tmp_path / "kb", lm=lm, embedder=HashingEmbedder())
    assert reopened.chunk_ids() == keep


def test_the_store_owns_its_collaborators_and_keeps_its_database_index_and_kv_files_private(tmp_path, lm):
    """The store is no mixin: it owns one object per responsibility (chunks, index, kv, documents, jobs).
    Callers use their operations and the store's (neighbours, convert_kv_dtype, kv_source, ...), never the
    SQLite connection, the FAISS index or the KV file layer underneath."""
    import sqlite3

    from fusionrag.kvcache.store import KVStore
    from fusionrag.retrieval.chunk_table import ChunkTable
    from fusionrag.retrieval.index import VectorIndex
    from fusionrag.retrieval.jobs import JobStore
    from fusionrag.retrieval.store_index import StoreIndex
    from fusionrag.retrieval.stored_docs import Documents
    from fusionrag.retrieval.stored_kv import StoredKV

    assert KnowledgeStore.__bases__ == (object,)
    store = _store(tmp_path, lm)
    owned = {"chunks": ChunkTable, "index": StoreIndex, "kv": StoredKV, "documents": Documents, "jobs": JobStore}
    assert {name: type(getattr(store, name)) for name in owned} == owned
    for obj in (store, *(getattr(store, name) for name in owned)):
        leaked = [n for n, v in vars(obj).items()
                  if not n.startswith("_") and isinstance(v, sqlite3.Connection | VectorIndex | KVStore)]
        assert leaked == [], type(obj).__name__
    assert {"neighbours", "vectors", "convert_kv_dtype", "kv_source", "insert_chunks", "remove_unreferenced"} <= set(
        dir(KnowledgeStore))
    assert {"save", "load_entry", "is_current", "header"} <= set(dir(StoredKV))
    store.close()


def test_a_store_built_in_one_compute_dtype_answers_in_another(tmp_path):
    """Chunk KV is stored in fp16/int8 whatever the model computed in, so a store built in float32
    answers in bfloat16 and the reverse (before: refused, "use --dtype float32"). ``S``'s KV is kept when it
    was computed in float32 or in the engine's dtype, and recomputed by a float32 engine over a bf16-built
    store, so recomputing 100% there is still float32 Full Attention."""
    from fusionrag.models.fingerprint import fingerprint_dtype
    from fusionrag.online.engine import Engine
    from fusionrag.retrieval.knowledge import KnowledgeStore

    passages = [{"title": "A", "text": "alpha beta gamma delta " * 8}, {"title": "B", "text": "one two three " * 9}]
    for built, answered in (("float32", "bfloat16"), ("bfloat16", "float32")):
        path = tmp_path / f"kb-{built}"
        store = build.create_store(path, load_model("tiny-llama", dtype=built), embedder=HashingEmbedder(64))
        build.add_passages(store, load_model("tiny-llama", dtype=built), passages, doc="d")
        store.close()
        lm = load_model("tiny-llama", dtype=answered)
        store = KnowledgeStore.open(path, lm=lm)
        assert fingerprint_dtype(store.kv.header(store.chunk_ids()[0], "plain")["fingerprint"]) == built
        engine = Engine(store, lm)
        kept = store.load_system_kv(answered)
        assert (kept is not None) == (built == "float32")  # a bf16-built S is recomputed by a float32 engine
        full = engine.prepare("alpha?", method="full", top_k=2)
        everything = engine.prepare("alpha?", method="fusionrag", ratio=1.0, top_k=2)
        assert everything.pre.recomputed == everything.pre.context_tokens > 0
        if answered == "float32":
            assert (everything.pre.last_logits - full.pre.last_logits).abs().max() < 1e-4
        store.close()


def test_a_store_of_other_weights_is_refused_naming_the_model(tmp_path):
    from fusionrag.errors import StoreMismatchError, exit_code
    from fusionrag.retrieval.knowledge import KnowledgeStore

    KnowledgeStore.create(tmp_path / "kb", load_model("tiny-llama"), embedder=HashingEmbedder(64)).close()
    with pytest.raises(StoreMismatchError, match="--model tiny-llama") as info:
        KnowledgeStore.open(tmp_path / "kb", load_model("tiny-qwen2"))
    assert exit_code(info.value) == 2
