"""The fault battery, input side: pathological text, symlinked folders, inputs with nothing to ingest."""

from __future__ import annotations

import os

import pytest

from fusionrag.cli import main
from fusionrag.models import load_model
from fusionrag.prompt import PromptBuilder
from fusionrag.retrieval.chunking import Passage, expand_paths, make_chunks


class CountingTokenizer:
    """Wraps a tokenizer and counts the characters it is asked to encode."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.chars = 0
        self.chat_template = getattr(inner, "chat_template", None)

    def encode(self, text, add_special_tokens=False):
        self.chars += len(text)
        return self.inner.encode(text, add_special_tokens=add_special_tokens)

    def apply_chat_template(self, *args, **kwargs):
        return self.inner.apply_chat_template(*args, **kwargs)


@pytest.mark.parametrize("kb", [20, 80])
def test_chunking_text_without_whitespace_is_linear(kb):
    """Before: 200 KB without whitespace took ~100 s to split (50 KB: 15 s): each probe re-tokenised the rest."""
    tok = CountingTokenizer(load_model("tiny-llama").tokenizer)
    prompt = PromptBuilder(tok)
    text = ("abcdefghij" * (kb * 100))[: kb * 1000]
    prompt.system_token_ids  # noqa: B018 - built once, not counted below
    tok.chars = 0
    chunks = make_chunks(prompt, [Passage("T", text)], 64)
    assert "".join(c.text for c in chunks) == text and all(len(c.token_ids) <= 64 for c in chunks)
    assert tok.chars < 40 * len(text), f"{tok.chars / len(text):.0f} characters tokenised per input character"


def test_a_folder_reached_through_a_symlink_is_read(tmp_path):
    """Before: a symlinked folder was silently skipped (files: 0, exit 0)."""
    real = tmp_path / "real"
    (real / "sub").mkdir(parents=True)
    (real / "sub" / "a.txt").write_text("alpha")
    top = tmp_path / "top"
    top.mkdir()
    os.symlink(real, top / "linked")
    os.symlink(top, top / "loop")  # a cycle must not hang
    problems: list = []
    assert [p.name for p in expand_paths([top], problems)] == ["a.txt"] and not problems


def test_an_input_with_nothing_to_ingest_is_an_error(tmp_path, capsys, fusionrag_home):
    """Before: only empty/blank/binary files exited 0 with new_chunks 0."""
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "empty.txt").write_text("")
    (tmp_path / "in" / "blank.md").write_text("   \n\n")
    (tmp_path / "in" / "bin.txt").write_bytes(b"\x00\x01\x02binary")
    code = main(["ingest", str(tmp_path / "in"), "--store", str(tmp_path / "kb"), "--model", "tiny-llama",
                 "--embedder", "hashing-64", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "nothing was ingested" in err and "Traceback" not in err
    assert not (tmp_path / "kb").exists()  # a first ingest that stored nothing leaves no empty store behind


def test_document_ids_and_sources_follow_one_set_of_limits_at_every_door(tmp_path, capsys):
    """Before: the CLI's --id took newlines and 10,000 characters the API refused; the API took NUL and newline
    ids the CLI could not name. Now both refuse the same values, in one line."""
    from fusionrag.cli import main
    from fusionrag.retrieval.stored_docs import MAX_ID_CHARS, identity_problem

    for bad in ("a\nb", "x\x00y", "tab\there", "x" * (MAX_ID_CHARS + 1), "   "):
        assert identity_problem("id", bad)
    assert identity_problem("id", "docs/a.md") is None and identity_problem("source", "/srv/a b/c.pdf") is None
    (tmp_path / "a.txt").write_text("some text")
    assert main(["ingest", str(tmp_path / "a.txt"), "--store", str(tmp_path / "kb"), "--id", "a\nb"]) == 2
    err = capsys.readouterr().err
    assert "control characters" in err and not (tmp_path / "kb").exists()


def test_a_title_too_long_for_a_chunk_is_shortened_never_an_empty_document():
    """Before: a 10 KB title made the document's text vanish (job ready, 0 chunks)."""
    from fusionrag.models.tiny import byte_tokenizer
    from fusionrag.prompt import PromptBuilder
    from fusionrag.retrieval.chunking import make_chunks
    from fusionrag.retrieval.passages import Passage

    problems = []
    chunks = make_chunks(PromptBuilder(byte_tokenizer()), [Passage("T" * 10_000, "the body text " * 20, "d")], 256,
                         problems)
    assert chunks and all("the body text" in c.text for c in chunks)
    assert all(len(c.token_ids) <= 256 for c in chunks) and chunks[0].title.endswith("...")
    assert any("shortened" in p.message for p in problems)


def test_readers_are_bounded_in_time_and_memory(tmp_path, monkeypatch):
    """Before: a 2 GiB sparse .txt was read whole (2.7 GB RSS), a FIFO in a folder was skipped without a word,
    and 8,000 nested <div>s took 68 s."""
    import time

    from fusionrag.retrieval import readers

    sparse = tmp_path / "big.txt"
    with sparse.open("wb") as f:
        f.truncate(3 << 30)  # 3 GiB of holes: nothing is read to find out
    monkeypatch.setenv("FUSIONRAG_MAX_FILE_MB", "1024")
    problems = []
    assert readers.load_bytes(sparse, problems) is None and "limit of one file" in problems[-1].message
    small_binary = tmp_path / "b.txt"
    small_binary.write_bytes(b"\x00" * 100 + b"text" * 10)
    assert readers.load_bytes(small_binary, problems) is None and "binary" in problems[-1].message
    folder = tmp_path / "docs"
    folder.mkdir()
    os.mkfifo(folder / "pipe.txt")
    (folder / "ok.txt").write_text("fine")
    found = readers.expand_paths([folder], problems)
    assert found == [folder / "ok.txt"] and "FIFO" in problems[-1].message
    deep = tmp_path / "deep.html"
    deep.write_text("<html><body>" + "<div>" * 20_000 + "deep text" + "</div>" * 20_000 + "</body></html>")
    t0 = time.perf_counter()
    passages = readers.read_passages(deep, problems)
    # A complexity guard, not a speed measurement: the quadratic reader needed ~400 s at this depth.
    assert time.perf_counter() - t0 < 60 and passages and "deep text" in passages[0].text


def test_a_closed_stdout_pipe_is_a_quiet_exit_not_a_disk_fault(tmp_path):
    """Before: `fusionrag documents | head -c1` reported a disk I/O error and exited 3."""
    import subprocess
    import sys

    code = ("import fusionrag.offline.cli as c\n"
            "def closed(args):\n    raise BrokenPipeError(32, 'Broken pipe')\n"
            "c.cmd_documents = closed\n"
            "from fusionrag.cli import main\n"
            f"raise SystemExit(main(['documents', '--store', {str(tmp_path)!r}]))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 141 and "error" not in done.stderr


def test_each_format_has_its_own_limit_checked_before_reading(tmp_path, monkeypatch):
    """An 8 MB HTML page of tiny tags takes ~7 s to read, a 128 MB text file 0.2 s: each format's limit is
    what its reader reads inside the budget (benchmarks/readers); FUSIONRAG_MAX_FILE_MB sets one for all."""
    from fusionrag.retrieval import readers

    monkeypatch.delenv("FUSIONRAG_MAX_FILE_MB", raising=False)
    assert readers.max_file_bytes(".html") < readers.max_file_bytes(".txt")
    page = tmp_path / "big.html"
    with page.open("wb") as f:
        f.truncate(readers.max_file_bytes(".html") + 1)  # holes: refused from its size, nothing read
    problems = []
    assert readers.load_bytes(page, problems) is None
    assert "limit of one file (HTML" in problems[-1].message
    text = tmp_path / "same size.txt"
    text.write_bytes(b"words " * ((readers.max_file_bytes(".html") + 6) // 6))
    assert readers.load_bytes(text, problems) is not None  # the text reader takes it
    monkeypatch.setenv("FUSIONRAG_MAX_FILE_MB", "1")
    assert readers.load_bytes(text, problems) is None and "limit of one file (text" in problems[-1].message


def test_a_pdf_over_the_readers_page_or_content_budget_is_refused_before_extraction(tmp_path, monkeypatch):
    from doc_files import make_pdf
    from fusionrag.retrieval import formats, readers

    monkeypatch.delenv("FUSIONRAG_MAX_FILE_MB", raising=False)
    pdf = tmp_path / "book.pdf"
    pdf.write_bytes(make_pdf(["a page of words " * 20] * 12, title="Book"))
    assert len(readers.read_passages(pdf, [])) == 12
    extracted = []
    monkeypatch.setattr(formats, "_clean", lambda page: extracted.append(page) or page)
    monkeypatch.setattr(formats, "PDF_MAX_PAGES", 10)
    problems = []
    assert readers.read_passages(pdf, problems) == [] and extracted == []
    assert "12 pages, over the PDF reader's 10" in problems[-1].message and problems[-1].file_skipped
    monkeypatch.setattr(formats, "PDF_MAX_PAGES", 5000)
    monkeypatch.setattr(formats, "PDF_MAX_CONTENT", 1000)
    assert readers.read_passages(pdf, problems) == [] and extracted == []
    assert "content is over the PDF reader's" in problems[-1].message


def test_docx_is_streamed_paragraph_by_paragraph_with_nested_text_boxes_read_once(tmp_path):
    """The XML is read as a stream (a 16 MB document.xml of tiny sections: 5 s, 216 MB; the tree took 10 s and
    955 MB at 64 MB); a paragraph inside another's text box is that paragraph's text, not a second copy."""
    import io
    import zipfile

    from fusionrag.retrieval import formats, readers

    w = "http://schemas.openxmlformats.org/wordprocessingml/2006/main"
    body = (f'<w:document xmlns:w="{w}"><w:body>'
            '<w:p><w:pPr><w:pStyle w:val="Heading1"/></w:pPr><w:r><w:t>Intro</w:t></w:r></w:p>'
            '<w:p><w:r><w:t>outer </w:t><w:pict><w:txbxContent><w:p><w:r><w:t>boxed</w:t></w:r></w:p>'
            '</w:txbxContent></w:pict></w:r></w:p>'
            '<w:tbl><w:tr><w:tc><w:p><w:r><w:t>cell</w:t><w:tab/><w:t>two</w:t></w:r></w:p></w:tc></w:tr></w:tbl>'
            '</w:body></w:document>')
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("word/document.xml", body)
    path = tmp_path / "d.docx"
    path.write_bytes(buf.getvalue())
    passages = readers.read_passages(path, [])
    assert [p.text for p in passages] == ["outer boxed\ncell\ttwo"] and passages[0].title.endswith("Intro")
    truncated = tmp_path / "t.docx"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("word/document.xml", body[: len(body) // 2])
    truncated.write_bytes(buf.getvalue())
    problems = []
    assert readers.read_passages(truncated, problems) == [] and "cannot read this DOCX" in problems[-1].message
    assert formats.DOCX_MAX_XML <= 16 << 20


@pytest.mark.parametrize("value", ["abc", "-1", "0", "inf", "nan"])
def test_a_file_limit_that_is_not_a_size_is_one_line_before_anything_is_read(tmp_path, monkeypatch, capsys, value,
                                                                              fusionrag_home):
    """Issue 47 bug 11: ``FUSIONRAG_MAX_FILE_MB=abc`` was a traceback and ``-1`` skipped every file. Now either is
    one line naming the variable, and no store is made."""
    from fusionrag.cli import main

    monkeypatch.setenv("FUSIONRAG_MAX_FILE_MB", value)
    (tmp_path / "a.txt").write_text("Polonium was discovered by Marie Curie.")
    assert main(["ingest", str(tmp_path / "a.txt"), "--store", str(tmp_path / "kb"), "--model", "tiny-llama"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "FUSIONRAG_MAX_FILE_MB" in err[0] and "Traceback" not in err[0]
    assert not (tmp_path / "kb").exists()
