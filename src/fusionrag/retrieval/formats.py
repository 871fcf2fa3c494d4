"""Readers of the formats that need a parser: PDF (``pypdf``), HTML (a streaming tokenizer), DOCX (zip + XML).

Each takes ``(path, bytes, problems)`` and returns a :class:`ParsedFile`; a file it cannot use
is a :class:`Problem` naming the reason (encrypted, broken, no text), never an exception.
:mod:`fusionrag.retrieval.readers` registers them by suffix.
"""

from __future__ import annotations

import io
import logging
import os
import re
import zipfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any
from xml.etree import ElementTree

from fusionrag.retrieval.html_text import HEADING_MARK, PRE_MARK, page_text
from fusionrag.retrieval.passages import ParsedFile, Passage, Problem, sections, skipped_file


def read_pdf(path: Path, data: bytes, problems: list[Problem]) -> ParsedFile:
    """One passage per page that has text; titled with the metadata title, else the file's stem."""
    from pypdf import PdfReader

    quiet = logging.getLogger("pypdf")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # pypdf warns about every recoverable oddity; we report what matters
    try:
        reader = PdfReader(io.BytesIO(data))
        if reader.is_encrypted and not _decrypts(reader):
            return skipped_file(path, problems, "PDF", "encrypted PDF (password-protected): decrypt it first")
        meta = reader.metadata
        title = meta.title if meta is not None and isinstance(meta.title, str) and meta.title.strip() else ""
        over = _over_pdf_budget(reader)
        if over:
            return skipped_file(path, problems, "PDF", over)
        pages = [_clean(page.extract_text() or "") for page in reader.pages]
    except Exception as exc:  # a parser of untrusted bytes raises many kinds: any of them means "broken"
        return skipped_file(path, problems, "PDF", exc)
    finally:
        quiet.setLevel(level)
    title = " ".join(title.split()) or path.stem
    passages = [Passage(title, page, doc=path.name) for page in pages if page.strip()]
    if not passages:
        return skipped_file(path, problems, "PDF",
                            f"no extractable text in its {len(pages)} page(s) (a scan? OCR it first)")
    return ParsedFile(title, passages)


#: What the PDF reader takes (text extraction runs at ~1.3 MB/s of page content on one core): pages, and their
#: content streams once inflated. A 2,000-page book of dense text is ~8 MB; ``FUSIONRAG_MAX_FILE_MB`` raises both.
PDF_MAX_PAGES = 5000
PDF_MAX_CONTENT = 8 << 20


def _over_pdf_budget(reader: Any) -> str:
    """Why the PDF is too large to read in bounded time ('' when it is not), found before any text is
    extracted: inflating the content streams is fast, extracting text from them is not."""
    override = int(os.environ.get("FUSIONRAG_MAX_FILE_MB") or 0)
    max_pages = max(PDF_MAX_PAGES, override * 160)
    max_content = max(PDF_MAX_CONTENT, override << 20)
    n_pages = len(reader.pages)
    if n_pages > max_pages:
        return f"{n_pages:,} pages, over the PDF reader's {max_pages:,} (FUSIONRAG_MAX_FILE_MB raises it): split it"
    total = 0
    for page in reader.pages:
        contents = page.get_contents()
        total += len(contents.get_data()) if contents is not None else 0
        if total > max_content:
            return (f"its pages' content is over the PDF reader's {max_content >> 20} MiB (FUSIONRAG_MAX_FILE_MB "
                    "raises it): split it")
    return ""


def _decrypts(reader) -> bool:
    """Whether an encrypted PDF opens without a password (many have only an owner password)."""
    try:
        return bool(reader.decrypt(""))
    except Exception:  # an unsupported cipher (pypdf needs 'cryptography' for AES) or a broken dictionary
        return False


def _clean(page: str) -> str:
    """Extracted page text: lines without trailing spaces, no runs of blank lines."""
    lines = [line.rstrip() for line in page.splitlines()]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def read_html(path: Path, data: bytes, problems: list[Problem]) -> ParsedFile:
    try:
        title, passages = html_passages(path.name, path.stem, data, None)
    except Exception as exc:  # html.parser is lenient; anything it raises means the file is unusable
        return skipped_file(path, problems, "HTML", exc)
    if not passages:
        problems.append(Problem(str(path), None, "no text in the page's main content"))
    return ParsedFile(title, passages)


def html_passages(doc: str, stem: str, markup: str | bytes, title: str | None) -> tuple[str, list[Passage]]:
    """The page's title and its main text as heading sections (navigation, scripts, styles and hidden
    elements left out), read in one streaming pass (:mod:`fusionrag.retrieval.html_text`): time linear in
    the page, memory its text. Bytes are decoded as a browser would (BOM, declared charset, then a guess)."""
    if isinstance(markup, bytes):
        from bs4.dammit import UnicodeDammit

        markup = UnicodeDammit(markup, is_html=True).unicode_markup or ""
    own, flat = page_text(markup)
    name = title if title is not None else (own or stem)
    items = ((True, line[1:].strip()) if line.startswith(HEADING_MARK) else
             (False, line[1:].rstrip()) if line.startswith(PRE_MARK) else (False, line.strip())
             for line in flat.replace("\r", "").split("\n"))
    return name, sections(doc, name, _squeeze(items))


def _squeeze(items: Iterable[tuple[bool, str]]) -> Iterator[tuple[bool, str]]:
    """At most one blank line in a row, none at a section's start."""
    blank = True
    for is_heading, line in items:
        if is_heading or line:
            yield is_heading, line
            blank = is_heading
        elif not blank:
            yield False, ""
            blank = True


_W = "{http://schemas.openxmlformats.org/wordprocessingml/2006/main}"
_P = f"{_W}p"
#: The largest document.xml read (a DOCX is deflated: 16 MB can hold gigabytes of XML); larger is a bomb.
DOCX_MAX_XML = 16 << 20


def read_docx(path: Path, data: bytes, problems: list[Problem]) -> ParsedFile:
    """Paragraphs in order; paragraphs styled as headings (or Title) start sections. The XML is streamed:
    each paragraph read when it ends and dropped, so memory is the text, not the tree."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            if z.getinfo("word/document.xml").file_size > DOCX_MAX_XML:
                return skipped_file(path, problems, "DOCX", "not a usable DOCX file (its document.xml is over "
                                    f"{DOCX_MAX_XML >> 20} MiB unpacked: a zip bomb or not a document)")
            with z.open("word/document.xml") as stream:
                items = list(_docx_paragraphs(stream))
            title = _docx_title(z)
    except Exception as exc:  # zip, XML and missing-part errors: the file is not a usable .docx
        return skipped_file(path, problems, "DOCX", exc)
    title = title or path.stem
    return ParsedFile(title, sections(path.name, title, items))


def _docx_title(z: zipfile.ZipFile) -> str:
    """The core properties' title ('' when absent or implausibly large)."""
    if "docProps/core.xml" not in z.namelist() or z.getinfo("docProps/core.xml").file_size > 1 << 20:
        return ""
    node = ElementTree.fromstring(z.read("docProps/core.xml")).find("{http://purl.org/dc/elements/1.1/}title")
    return " ".join((node.text or "").split()) if node is not None else ""


def _docx_paragraphs(stream: IO[bytes]) -> Iterator[tuple[bool, str]]:
    """``(is_heading, text)`` of each outermost ``<w:p>`` in document order (a paragraph inside another's
    text box is part of that paragraph's text), each dropped from the tree once read."""
    parser = ElementTree.XMLPullParser(events=("start", "end"))
    opened: list[ElementTree.Element] = []
    depth = 0
    while True:
        chunk = stream.read(1 << 20)
        if chunk:
            parser.feed(chunk)
        else:
            parser.close()  # a truncated or malformed document raises here
        for event, elem in parser.read_events():
            if event == "start":
                opened.append(elem)
                depth += elem.tag == _P
                continue
            opened.pop()
            if elem.tag == _P:
                depth -= 1
                if depth == 0:
                    yield _docx_paragraph(elem)
                    if opened and len(opened[-1]) and opened[-1][-1] is elem:
                        del opened[-1][-1]  # the paragraph just ended is its parent's last child
        if not chunk:
            return


def _docx_paragraph(p: ElementTree.Element) -> tuple[bool, str]:
    style = p.find(f"{_W}pPr/{_W}pStyle")
    kind = (style.get(f"{_W}val") or "") if style is not None else ""
    parts = []
    for node in p.iter():
        if node.tag == f"{_W}t":
            parts.append(node.text or "")
        elif node.tag == f"{_W}tab":
            parts.append("\t")
        elif node.tag in (f"{_W}br", f"{_W}cr"):
            parts.append("\n")
    text = "".join(parts)
    heading = bool(re.fullmatch(r"(?i)(heading\s*\d|title)", kind)) and bool(text.strip())
    return heading, text.strip() if heading else text
