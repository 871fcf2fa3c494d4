"""The CLI's documents: ingest of real PDF/HTML files and bad files, documents, delete, absolute model paths."""

from __future__ import annotations

import json

from doc_files import NOISY_HTML, encrypt_pdf, make_pdf
from fusionrag.cli import main

COMMON = ["--model", "tiny-llama", "--quiet"]


def _ingest(*argv):
    return main(["ingest", *argv, "--embedder", "hashing-64", "--json", *COMMON])


def test_pdf_and_html_are_ingested_and_bad_files_fail_the_run_after_the_good_ones(tmp_path, capsys, fusionrag_home):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "paper.pdf").write_bytes(make_pdf(["Basalt is a volcanic rock.", "Granite is not."], title="Rocks"))
    (docs / "page.html").write_text(NOISY_HTML)
    (docs / "broken.pdf").write_bytes(make_pdf(["Cut."])[:120])
    (docs / "locked.pdf").write_bytes(encrypt_pdf(make_pdf(["Secret."])))
    kb = str(tmp_path / "kb")
    assert _ingest(str(docs), "--store", kb) == 2
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert report["document_counts"] == {"added": 2, "updated": 0, "unchanged": 0, "removed": 0}
    assert sorted(report["failed_files"]) == [str(docs / "broken.pdf"), str(docs / "locked.pdf")]
    lines = err.strip().splitlines()
    assert f"fusionrag: skipped {docs / 'broken.pdf'}: cannot read this PDF file (" in err
    assert f"fusionrag: skipped {docs / 'locked.pdf'}: encrypted PDF" in err
    assert lines[-1].startswith("fusionrag: error: 2 file(s) could not be ingested") and "Traceback" not in err
    # the good files are in; a rerun skips them and, with --skip-bad-files, exits 0 (problems still listed)
    assert _ingest(str(docs), "--store", kb, "--skip-bad-files") == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["document_counts"]["unchanged"] == 2 and "broken.pdf" in err

    assert main(["documents", "--store", kb, "--json"]) == 0
    listed = {d["id"]: d for d in json.loads(capsys.readouterr().out)}
    assert set(listed) == {str((docs / "paper.pdf").resolve()), str((docs / "page.html").resolve())}
    pdf = listed[str((docs / "paper.pdf").resolve())]
    assert (pdf["title"], pdf["chunks"], pdf["origin"]) == ("Rocks", 2, "file") and pdf["ingested"]
    assert listed[str((docs / "page.html").resolve())]["title"] == "Volcano Guide"
    assert main(["documents", "--store", kb]) == 0
    table = capsys.readouterr().out
    assert "2 document(s)" in table and "Volcano Guide" in table


def test_delete_by_path_or_id_and_an_unknown_one_is_one_line(tmp_path, capsys, fusionrag_home, monkeypatch):
    (tmp_path / "a.txt").write_text("Alpha is a word about alpha.")
    (tmp_path / "b.txt").write_text("Beta is a word about beta.")
    kb = str(tmp_path / "kb")
    assert _ingest(str(tmp_path / "a.txt"), "--store", kb) == 0
    assert _ingest(str(tmp_path / "b.txt"), "--store", kb, "--id", "beta") == 0
    assert main(["preprocess", "--store", kb, "--top-n", "1", "--quiet"]) == 0
    capsys.readouterr()
    assert main(["delete", "--store", kb, "nope", *COMMON]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fusionrag: error: no document 'nope'") and len(err.strip().splitlines()) == 1
    monkeypatch.chdir(tmp_path)
    assert main(["delete", "--store", kb, "a.txt", *COMMON]) == 0  # a relative path, resolved
    report = json.loads(capsys.readouterr().out)
    assert report["removed"] == [str((tmp_path / "a.txt").resolve())] and report["chunks_removed"] == 1
    assert report["fuse"] is not None and report["fuse"]["computed"] == 1  # b lost its neighbour: re-fused
    assert main(["delete", "--store", kb, "beta", *COMMON]) == 0
    capsys.readouterr()
    assert main(["documents", "--store", kb, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []


def test_a_store_built_with_a_relative_model_folder_works_from_another_folder(tmp_path, capsys, fusionrag_home,
                                                                              monkeypatch):
    from fusionrag.models.tiny import byte_tokenizer, tiny_model
    from fusionrag.retrieval.store_info import stored_model

    tiny_model("qwen2", seed=3).save_pretrained(tmp_path / "work" / "ckpt")
    byte_tokenizer().save_pretrained(tmp_path / "work" / "ckpt")
    (tmp_path / "work" / "doc.txt").write_text("Polonium was discovered by Marie Curie.")
    monkeypatch.chdir(tmp_path / "work")
    assert main(["ingest", "doc.txt", "--store", "kb", "--model", "./ckpt", "--embedder", "hashing-64",
                 "--quiet"]) == 0
    assert stored_model(tmp_path / "work" / "kb") == str((tmp_path / "work" / "ckpt").resolve())
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    capsys.readouterr()
    kb = str(tmp_path / "work" / "kb")  # the store's own model, found from here: verify and a further ingest
    assert main(["store", "verify", "--store", kb, "--json", "--quiet"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True
    (tmp_path / "elsewhere" / "more.txt").write_text("Radium was discovered in 1898.")
    assert main(["ingest", "more.txt", "--store", kb, "--quiet"]) == 0
    # a packaged name stays a name
    assert main(["ingest", str(tmp_path / "work" / "doc.txt"), "--store", "kb2", "--embedder", "hashing-64",
                 *COMMON]) == 0
    assert stored_model(tmp_path / "elsewhere" / "kb2") == "tiny-llama"


def test_a_store_that_recorded_a_relative_model_folder_records_the_absolute_one_when_opened_with_it(
        tmp_path, capsys, fusionrag_home, monkeypatch):
    import sqlite3

    from fusionrag.models.tiny import byte_tokenizer, tiny_model
    from fusionrag.retrieval.store_info import stored_model

    ckpt = tmp_path / "ckpt"
    tiny_model("llama", seed=4).save_pretrained(ckpt)
    byte_tokenizer().save_pretrained(ckpt)
    (tmp_path / "doc.txt").write_text("Argon is a noble gas.")
    assert main(["ingest", str(tmp_path / "doc.txt"), "--store", str(tmp_path / "kb"), "--model", str(ckpt),
                 "--embedder", "hashing-64", "--quiet"]) == 0
    db = sqlite3.connect(tmp_path / "kb" / "store.sqlite")  # as recorded before paths were made absolute
    with db:
        db.execute("UPDATE settings SET value = '\"./ckpt\"' WHERE key = 'model'")
    db.close()
    monkeypatch.chdir(tmp_path / "kb")
    assert main(["store", "verify", "--store", ".", "--model", "../ckpt", "--quiet"]) == 0
    assert stored_model(tmp_path / "kb") == str(ckpt.resolve())
