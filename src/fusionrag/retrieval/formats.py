"""Readers of the formats that need a parser: PDF (``pypdf``), HTML (``beautifulsoup4``), DOCX (zip + XML).

Each takes ``(path, bytes, problems)`` and returns a :class:`ParsedFile`; a file it cannot use
is a :class:`Problem` naming the reason (encrypted, broken, no text), never an exception.
:mod:`fusionrag.retrieval.readers` registers them by suffix.
"""

from __future__ import annotations

import io
import logging
import re
import zipfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

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


_HTML_NOISE = ("script", "style", "noscript", "template", "svg", "iframe", "nav", "header", "footer", "aside",
               "form", "button", "select", "head")
_HTML_BLOCKS = ("p", "div", "li", "ul", "ol", "pre", "blockquote", "table", "tr", "td", "th", "dt", "dd", "dl",
                "figcaption", "caption", "section", "article", "main", "hr", "address", "details", "summary")
_HEADINGS = ("h1", "h2", "h3", "h4", "h5", "h6")
_MARK = "\ue000"  # private use: marks a heading line in the flattened text
_PRE = "\ue001"  # private use: marks a line of preformatted text (its indentation is kept)


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
    elements left out). The tree is parsed once and read in one walk, never changed: every change to a
    bs4 tree searches the parent's children or the last descendant, quadratic on wide or deep pages."""
    from bs4 import BeautifulSoup

    soup = BeautifulSoup(markup, "html.parser")
    own = " ".join(soup.title.get_text(" ").split()) if soup.title else ""
    name = title if title is not None else (own or stem)
    root = soup.find("main") or soup.find("article") or soup.body or soup
    flat = _html_text(root)
    items = ((True, line[1:].strip()) if line.startswith(_MARK) else
             (False, line[1:].rstrip()) if line.startswith(_PRE) else (False, line.strip())
             for line in flat.replace("\r", "").split("\n"))
    passages = sections(doc, name, _squeeze(items))
    return name, passages


def _skipped(tag: Any) -> bool:
    """Navigation, scripts, styles and the like, and hidden elements: not the page's text."""
    return tag.name in _HTML_NOISE or tag.has_attr("hidden") or tag.get("aria-hidden") == "true"


def _walk_html(root: Any, emit: Any) -> None:
    """Depth-first over ``root`` without recursion: ``emit(node)`` for every node not under a skipped
    element; it returns False to skip the node's children, or a string to add after them."""
    from bs4 import Tag

    stack: list[tuple[Any, str | None]] = [(root, None)]
    while stack:
        node, after = stack.pop()
        if node is None:
            emit(after)
            continue
        if isinstance(node, Tag) and node is not root and _skipped(node):
            continue
        go = emit(node)
        if isinstance(node, Tag) and go is not False:
            if isinstance(go, str):
                stack.append((None, go))
            stack.extend((child, None) for child in reversed(node.contents))


def _raw_text(tag: Any) -> str:
    """A ``<pre>`` or heading's text as written (``<br>`` a newline), hidden parts left out."""
    from bs4 import CData, NavigableString, Tag

    parts: list[str] = []

    def emit(node: Any) -> Any:
        if isinstance(node, str) and not isinstance(node, NavigableString):
            return None  # a closing marker (none are used here)
        if isinstance(node, Tag):
            if node.name == "br":
                parts.append("\n")
            return None
        if type(node) in (NavigableString, CData):
            parts.append(str(node))
        return None

    _walk_html(tag, emit)
    return "".join(parts)


def _html_text(root: Any) -> str:
    """The text under ``root`` in one walk: whitespace runs squeezed, ``<br>`` a newline, a break at each
    block's start and end, headings marked on their own line, ``<pre>`` lines kept with their indentation."""
    from bs4 import CData, NavigableString, Tag

    blocks = frozenset(_HTML_BLOCKS) - {"pre"}
    headings = frozenset(_HEADINGS)
    parts: list[str] = []

    def emit(node: Any) -> Any:
        if isinstance(node, str) and not isinstance(node, NavigableString):
            parts.append(node)  # a block's closing break
            return None
        if isinstance(node, Tag):
            if node.name == "br":
                parts.append("\n")
            elif node.name == "pre":  # code and aligned text: every line keeps its leading whitespace
                lines = _raw_text(node).replace("\r", "").strip("\n").split("\n")
                parts.append("\n\n" + "\n".join(_PRE + line for line in lines) + "\n\n")
                return False
            elif node.name in headings:
                parts.append(f"\n{_MARK}{' '.join(_raw_text(node).split())}\n")
                return False
            elif node.name in blocks:
                parts.append("\n\n")
                return "\n\n"
            return None
        if type(node) in (NavigableString, CData):  # comments, doctypes and the like are not text
            parts.append(re.sub(r"\s+", " ", str(node)))
        return None

    _walk_html(root, emit)
    return "".join(parts)


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
_DOCX_MAX_XML = 256 << 20  # a document.xml larger than this is a zip bomb, not a document


def read_docx(path: Path, data: bytes, problems: list[Problem]) -> ParsedFile:
    """Paragraphs in order; paragraphs styled as headings (or Title) start sections."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            if z.getinfo("word/document.xml").file_size > _DOCX_MAX_XML:
                return skipped_file(path, problems, "DOCX",
                                    "not a usable DOCX file (its document.xml is implausibly large)")
            body = ElementTree.fromstring(z.read("word/document.xml"))
            core = z.read("docProps/core.xml") if "docProps/core.xml" in z.namelist() else b""
        items = list(_docx_paragraphs(body))
        title = ""
        if core:
            node = ElementTree.fromstring(core).find("{http://purl.org/dc/elements/1.1/}title")
            title = " ".join((node.text or "").split()) if node is not None else ""
    except Exception as exc:  # zip, XML and missing-part errors: the file is not a usable .docx
        return skipped_file(path, problems, "DOCX", exc)
    title = title or path.stem
    return ParsedFile(title, sections(path.name, title, items))


def _docx_paragraphs(body: ElementTree.Element) -> Iterator[tuple[bool, str]]:
    for p in body.iter(f"{_W}p"):
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
        yield heading, text.strip() if heading else text
