"""File-format readers (retrieval/readers.py): PDF, HTML, DOCX from real files made here; passages_from_text."""

from __future__ import annotations

import json

import pytest

from doc_files import NOISY_HTML, encrypt_pdf, make_docx, make_pdf
from fusionrag.retrieval.readers import (
    SUPPORTED_SUFFIXES,
    Passage,
    expand_paths,
    parse_file,
    passages_from_text,
    read_passages,
)


def _parse(path, data):
    path.write_bytes(data)
    problems = []
    return parse_file(path, data, problems), problems


def test_the_registry_covers_the_formats():
    assert {".txt", ".md", ".rst", ".jsonl", ".pdf", ".html", ".htm", ".docx"} <= set(SUPPORTED_SUFFIXES)


def test_pdf_one_passage_per_page_with_text_titled_by_its_metadata(tmp_path):
    parsed, problems = _parse(tmp_path / "paper.pdf", make_pdf(["Page one talks (briefly).", "", "Page three."],
                                                               title="A Study of Lava"))
    assert not problems and parsed.title == "A Study of Lava"
    assert [(p.title, p.text, p.doc) for p in parsed.passages] == [
        ("A Study of Lava", "Page one talks (briefly).", "paper.pdf"), ("A Study of Lava", "Page three.", "paper.pdf")]
    untitled, _ = _parse(tmp_path / "notes.pdf", make_pdf(["Just text."]))
    assert untitled.title == "notes" and untitled.passages[0].title == "notes"


def test_encrypted_broken_and_textless_pdfs_are_named_with_the_reason(tmp_path):
    cases = {"locked.pdf": (encrypt_pdf(make_pdf(["Secret."])), "encrypted PDF"),
             "broken.pdf": (make_pdf(["Cut short."])[:150], "cannot read this PDF file ("),
             "junk.pdf": (b"%PDF-1.4\nnot really a pdf at all", "cannot read this PDF file ("),
             "scan.pdf": (make_pdf(["", ""]), "no extractable text")}
    for name, (data, why) in cases.items():
        parsed, problems = _parse(tmp_path / name, data)
        assert parsed.passages == [] and len(problems) == 1, name
        assert problems[0].file_skipped and why in str(problems[0]) and str(problems[0]).startswith(str(tmp_path))
    opens, problems = _parse(tmp_path / "owner-only.pdf", encrypt_pdf(make_pdf(["Readable."]), user_password=""))
    assert not problems and [p.text for p in opens.passages] == ["Readable."]


def test_html_keeps_the_main_text_in_heading_sections_without_noise(tmp_path):
    parsed, problems = _parse(tmp_path / "page.html", NOISY_HTML.encode())
    assert not problems and parsed.title == "Volcano Guide"
    assert [p.title for p in parsed.passages] == ["Volcano Guide", "Eruptions", "Monitoring"]
    text = "\n".join(p.text for p in parsed.passages)
    assert "Volcanoes are openings in the crust. Magma rises through them." in text  # source line breaks joined
    assert "lava, ash and gas.\nSome are explosive." in text  # <br>
    for noise in ("tracking", "color: red", "Home", "About us", "banner", "hidden text", "inline noise", "Related",
                  "Copyright", "comment"):
        assert noise not in text, noise
    htm, _ = _parse(tmp_path / "bare.htm", b"<p>No title here.</p><pre>keep   spacing\n  here\n    <b>and</b> here"
                                          b"</pre><p>After.</p>")
    assert htm.title == "bare"  # preformatted lines keep their indentation (code, aligned text)
    assert htm.passages[0].text.strip() == "No title here.\n\nkeep   spacing\n  here\n    and here\n\nAfter."


def test_docx_sections_by_heading_styles(tmp_path):
    parsed, problems = _parse(tmp_path / "report.docx", make_docx(
        [("", "Opening words."), ("Heading1", "Results"), ("", "It worked."), ("", "Twice.")], title="Q3 Report"))
    assert not problems and parsed.title == "Q3 Report"
    assert [(p.title, p.text) for p in parsed.passages] == [("Q3 Report", "Opening words."),
                                                            ("Results", "It worked.\nTwice.")]
    broken, problems = _parse(tmp_path / "broken.docx", b"PK\x03\x04 not a zip")
    assert broken.passages == [] and problems[0].file_skipped and "cannot read this DOCX file" in str(problems[0])


def test_a_folder_walk_finds_the_new_formats_and_names_the_files_it_does_not_read(tmp_path):
    for name in ("a.pdf", "b.html", "c.htm", "d.docx", "e.txt", "f.xlsx", "g.rst", ".DS_Store"):
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "HEAD").write_bytes(b"ref")
    problems = []
    assert [p.name for p in expand_paths([tmp_path], problems)] == ["a.pdf", "b.html", "c.htm", "d.docx", "e.txt",
                                                                    "g.rst"]
    # one line for the folder naming them (hidden files and folders aside); not a failed file
    assert len(problems) == 1 and not problems[0].file_skipped
    assert "1 file(s) of unsupported types not read: f.xlsx" in str(problems[0]) and ".git" not in str(problems[0])


def test_rst_is_read_as_text_in_heading_sections(tmp_path):
    text = ("=====\nGuide\n=====\n\nIntro text.\n\nInstall\n-------\n\nRun ``pip install x``.\n\n"
            "Use\n~~~\nCall it::\n\n    x()\n")
    (parsed, problems) = _parse(tmp_path / "guide.rst", text.encode())
    assert not problems and parsed.title == "Guide"
    assert [(p.title, p.text.strip()) for p in parsed.passages] == [
        ("Guide", "Intro text."), ("Install", "Run ``pip install x``."), ("Use", "Call it::\n\n    x()")]


@pytest.mark.parametrize("name,content", [
    ("guide.md", "Intro.\n# Install\nRun it.\n```\n# not a heading\n```\n## Use\nCall it.\n"),
    ("plain.txt", "Plain body.\nSecond line."),
    ("notes.rst", "Notes\n=====\nBody.\n\nMore\n----\nText under it.\n"),
    ("page.html", NOISY_HTML),
    ("rows.jsonl", json.dumps({"title": "T", "text": "row one"}) + "\n" + json.dumps({"text": "row two"}) + "\n"),
])
def test_passages_from_text_split_as_the_file_reader_did(tmp_path, name, content):
    """The server splits a framework's document (text + source) exactly as ingest split that file."""
    f = tmp_path / "docs" / name
    f.parent.mkdir()
    f.write_text(content)
    from_file = read_passages(f, [])
    assert from_file
    assert passages_from_text(content, str(f)) == from_file
    assert passages_from_text(content, f"https://example.org/docs/{name}?v=1") == from_file
    assert passages_from_text(content, f"file://{f}") == from_file


def test_passages_from_text_of_a_pdf_page_and_without_source():
    assert passages_from_text("Page text.", "/data/paper.pdf", "A Study") == [
        Passage("A Study", "Page text.", "paper.pdf")]
    assert passages_from_text("Page text.", "/data/paper.pdf") == [Passage("paper", "Page text.", "paper.pdf")]
    assert passages_from_text("Just text.", None, "T") == [Passage("T", "Just text.", "")]
    assert passages_from_text("   ", "a.txt") == []


def test_a_file_that_reads_as_no_text_is_named(tmp_path):
    """A text file holding only a UTF-8 byte-order mark (not whitespace to bytes.strip) gave no passage and
    no word (found by the reader property test)."""
    from fusionrag.retrieval.readers import parse_file

    problems: list = []
    assert parse_file(tmp_path / "bom.txt", b"\xef\xbb\xbf", problems).passages == []
    assert [p.message for p in problems] == ["no text in the file"]
