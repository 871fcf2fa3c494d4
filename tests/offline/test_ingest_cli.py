"""``fusionrag ingest`` and ``documents`` on the command line: the one-line summary (``--json``: the full
record), files a folder holds that no reader takes, a failed first ingest that leaves no store behind, and
documents whose chunks lack KV listed as incomplete."""

from __future__ import annotations

import json

from fusionrag.cli import main

COMMON = ["--model", "tiny-llama", "--embedder", "hashing-64", "--quiet"]


def _docs(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("Basalt is a volcanic rock formed from lava.")
    (docs / "guide.rst").write_text("Guide\n=====\nIntro.\n\nInstall\n-------\nRun it.\n")
    (docs / "data.xlsx").write_bytes(b"PK\x03\x04")
    (docs / "photo.png").write_bytes(b"\x89PNG")
    return docs


def test_ingest_says_one_line_names_unsupported_files_and_json_keeps_the_record(tmp_path, capsys, fusionrag_home):
    docs, kb = _docs(tmp_path), str(tmp_path / "kb")
    assert main(["ingest", str(docs), "--store", kb, *COMMON]) == 0
    out, err = capsys.readouterr()
    assert len(out.strip().splitlines()) == 1
    assert out.startswith(f"ingested 2 file(s) into {kb}: 2 added; ")
    assert f"Next: fusionrag preprocess --store {kb}" in out  # never preprocessed: what to run next
    assert "2 file(s) of unsupported types not read: data.xlsx, photo.png" in err  # one line for the folder
    assert main(["ingest", str(docs), "--store", kb, "--json", *COMMON]) == 0  # the .rst file was read: 2 documents
    report = json.loads(capsys.readouterr().out)
    assert report["document_counts"] == {"added": 0, "updated": 0, "unchanged": 2, "removed": 0}
    assert report["failed_files"] == []  # files of other types in a folder do not fail the run
    assert main(["preprocess", "--store", kb, "--top-n", "1", "--quiet"]) == 0
    capsys.readouterr()
    (docs / "b.txt").write_text("Granite is an intrusive igneous rock.")
    assert main(["ingest", str(docs), "--store", kb, *COMMON]) == 0
    out = capsys.readouterr().out
    assert "1 added, 2 unchanged" in out and "fused KV for" in out and "Ready: fusionrag ask" in out


def test_a_failed_first_ingest_leaves_no_store_behind(tmp_path, capsys, fusionrag_home):
    bad = tmp_path / "bin.txt"
    bad.write_bytes(b"\x00\x01binary")
    kb = tmp_path / "new" / "kb"
    assert main(["ingest", str(bad), "--store", str(kb), *COMMON]) == 2
    err = capsys.readouterr().err
    assert "nothing was ingested" in err and "no store was created" in err
    assert not (tmp_path / "new").exists()  # the folders this run made are gone
    # a folder that was there keeps what it held; only what the run added is removed
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    assert main(["ingest", str(bad), "--store", str(mine), *COMMON]) == 2
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]


def test_documents_says_which_documents_are_complete(tmp_path, capsys, fusionrag_home, monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")  # the table's cells on one line each
    docs, kb = _docs(tmp_path), tmp_path / "kb"
    assert main(["ingest", str(docs), "--store", str(kb), *COMMON]) == 0
    capsys.readouterr()
    assert main(["documents", "--store", str(kb), "--json"]) == 0
    listed = {d["id"]: d for d in json.loads(capsys.readouterr().out)}
    assert all(d["complete"] and d["chunks_with_kv"] == d["chunks"] for d in listed.values())
    rst = str((docs / "guide.rst").resolve())
    assert listed[rst]["chunks"] == 2  # two heading sections
    # an interrupted ingest leaves chunks without KV: one KV file of the .rst document removed
    entry = next(iter(sorted((kb / "kv").glob("*/*.plain.safetensors"))[-1:]))
    entry.unlink()
    assert main(["documents", "--store", str(kb), "--json"]) == 0
    listed = {d["id"]: d for d in json.loads(capsys.readouterr().out)}
    assert [d for d, row in listed.items() if not row["complete"]] == [rst]
    assert main(["documents", "--store", str(kb)]) == 0
    table = capsys.readouterr().out
    assert "1 incomplete" in table and "incomplete: 1/2" in table and "complete" in table
