"""Reading documents: one reader per file format, behind a registry keyed by the file's suffix.

Formats: ``.txt`` (one passage titled with the file's stem), ``.md`` (one passage per heading
section), ``.jsonl`` (``{title, text}`` per line, or the shared-data schema with ``passages``),
``.pdf`` (``pypdf``: one passage per page with text, titled with the PDF's metadata title or the
stem), ``.html``/``.htm`` (``beautifulsoup4``: the main text without navigation, scripts and
styles; one passage per heading section, the first titled with ``<title>``) and ``.docx`` (the
standard library's zip + XML: one passage per heading section).

Readers never abort an ingest: a malformed line or file is reported as a :class:`Problem`
(file and line; ``file_skipped`` when the whole file could not be used) and skipped, and the
rest of the input is used. :func:`passages_from_text` splits a text already read (e.g. by a
framework's loader) exactly as the reader of its source would have split that file, so the
same passages get the same content hashes.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import zipfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit
from xml.etree import ElementTree

from fusionrag.prompt import is_valid_text


@dataclass(frozen=True)
class Passage:
    """A titled piece of text (before splitting), from document ``doc`` when it came from a file.

    The one passage type: readers, the evaluation sets and request-supplied documents all
    use it. Frozen and hashable, so passages shared by several questions de-duplicate.
    """

    title: str
    text: str
    doc: str = ""


@dataclass(frozen=True)
class Problem:
    """Input that was skipped, and why (``line`` is 1-based, ``None`` for the whole file).

    ``file_skipped``: nothing of the file was used (unreadable, broken, encrypted, unsupported);
    a skipped line or passage, or an empty file, is listed but is not a failed file."""

    path: str
    line: int | None
    message: str
    file_skipped: bool = False

    def __str__(self) -> str:
        where = self.path if self.line is None else f"{self.path}:{self.line}"
        return f"{where}: {self.message}"


@dataclass(frozen=True)
class ParsedFile:
    """What a reader made of one file: its title (for listings) and its passages."""

    title: str
    passages: list[Passage]


#: A reader: (path, the file's bytes, problems) -> the file's title and passages.
Reader = Callable[[Path, bytes, list[Problem]], ParsedFile]


@dataclass(frozen=True)
class Format:
    name: str
    read: Reader
    text: bool  # plain text (a NUL byte means a binary file, not this format)


READERS: dict[str, Format] = {}


def register_reader(suffixes: Iterable[str], name: str, read: Reader, text: bool = False) -> None:
    """Read files with these suffixes (lower case, with the dot) with ``read``."""
    for suffix in suffixes:
        READERS[suffix.lower()] = Format(name, read, text)


def supported_suffixes() -> tuple[str, ...]:
    return tuple(READERS)


# ---------------------------------------------------------------- files


def expand_paths(paths: Iterable[Path | str], problems: list[Problem]) -> list[Path]:
    """Files to read: files as given, folders searched recursively for supported suffixes."""
    out: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            out.extend(_walk(p))
        elif p.is_file():
            if p.suffix.lower() in READERS:
                out.append(p)
            else:
                problems.append(Problem(str(p), None, f"unsupported file type '{p.suffix}' "
                                        f"(supported: {', '.join(READERS)})", file_skipped=True))
        else:
            problems.append(Problem(str(p), None, "no such file or folder", file_skipped=True))
    return out


def _walk(root: Path) -> list[Path]:
    """Supported files under ``root``, following symlinked folders (each real folder once: no loops)."""
    found: list[Path] = []
    seen: set[str] = set()
    for folder, dirs, files in os.walk(root, followlinks=True):
        real = os.path.realpath(folder)
        if real in seen:
            dirs[:] = []
            continue
        seen.add(real)
        dirs.sort()
        found.extend(Path(folder) / f for f in sorted(files) if Path(f).suffix.lower() in READERS
                     and (Path(folder) / f).is_file())
    return found


def load_bytes(path: Path, problems: list[Problem]) -> bytes | None:
    """The file's bytes, or None with the reason in ``problems``."""
    try:
        return path.read_bytes()
    except OSError as exc:
        problems.append(Problem(str(path), None, f"cannot read: {exc.strerror or exc}", file_skipped=True))
        return None


def parse_file(path: Path, data: bytes, problems: list[Problem]) -> ParsedFile:
    """The file's title and passages, read by the reader of its suffix (none: see ``problems``)."""
    fmt = READERS.get(path.suffix.lower())
    if fmt is None:
        problems.append(Problem(str(path), None, f"unsupported file type '{path.suffix}'", file_skipped=True))
        return ParsedFile(path.stem, [])
    if not data.strip():
        problems.append(Problem(str(path), None, "empty file"))
        return ParsedFile(path.stem, [])
    if fmt.text and b"\x00" in data[:8192]:
        problems.append(Problem(str(path), None, "binary file (contains NUL bytes); skipped", file_skipped=True))
        return ParsedFile(path.stem, [])
    return fmt.read(path, data, problems)


def read_passages(path: Path, problems: list[Problem]) -> list[Passage]:
    """All passages of one file; anything unreadable goes to ``problems`` instead."""
    data = load_bytes(path, problems)
    return [] if data is None else parse_file(path, data, problems).passages


def passages_from_text(text: str, source: str | None = None, title: str | None = None) -> list[Passage]:
    """The passages the reader of ``source``'s format makes of ``text``, a file's content already read.

    ``source`` is a file path or URL (its suffix picks the format; none or an unknown suffix: plain
    text); ``.md`` splits into heading sections, ``.html``/``.htm`` runs the HTML reader on ``text``,
    ``.pdf``/``.docx`` take ``text`` as one page's (or the document's) extracted text, ``.jsonl`` its
    lines. ``title`` names the passages where the reader would use the file's stem or the document's
    own title (a PDF's metadata title; HTML's ``<title>``): None splits exactly as ingest did."""
    location = unquote(urlsplit(source).path) if source and "://" in source else (source or "")
    path = Path(location or "text")
    stem = path.stem if location else ""
    name = stem if title is None else title
    doc = path.name if location else ""
    suffix = path.suffix.lower()
    if suffix == ".md":
        return _markdown(doc, name, text)
    if suffix in (".html", ".htm"):
        return _html_passages(doc, stem, text, title)[1]
    if suffix == ".jsonl":
        return _read_jsonl(path, text.encode("utf-8"), [])
    if suffix == ".pdf":
        return [Passage(name, page, doc=doc) for page in text.split("\f") if page.strip()]
    return [Passage(name, text, doc=doc)] if text.strip() else []


# ---------------------------------------------------------------- text formats


def _decode(path: Path, data: bytes, problems: list[Problem]) -> str | None:
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        problems.append(Problem(str(path), line, "not valid UTF-8 text; file skipped", file_skipped=True))
        return None


def _read_txt(path: Path, data: bytes, problems: list[Problem]) -> ParsedFile:
    text = _decode(path, data, problems)
    return ParsedFile(path.stem, [Passage(path.stem, text, doc=path.name)] if text and text.strip() else [])


def _read_md(path: Path, data: bytes, problems: list[Problem]) -> ParsedFile:
    text = _decode(path, data, problems)
    passages = [] if text is None else _markdown(path.name, path.stem, text)
    first = next((m.group(2).strip() for line in (text or "").splitlines()[:50]
                  if (m := _MD_HEADING.match(line)) and len(m.group(1)) == 1), None)
    return ParsedFile(first or path.stem, passages)


_MD_HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$")


def _markdown(doc: str, stem: str, text: str) -> list[Passage]:
    """One passage per heading section, titled by the heading (``stem`` before the first one)."""

    def lines() -> Iterator[tuple[bool, str]]:
        in_fence = False
        for line in text.splitlines():
            if line.lstrip().startswith(("```", "~~~")):
                in_fence = not in_fence
            m = None if in_fence else _MD_HEADING.match(line)
            yield (True, m.group(2).strip()) if m else (False, line)

    return _sections(doc, stem, lines())


def _sections(doc: str, first_title: str, items: Iterable[tuple[bool, str]]) -> list[Passage]:
    """Passages from ``(is_heading, line)`` items: each heading starts a section titled by it."""
    sections: list[tuple[str, list[str]]] = [(first_title, [])]
    for is_heading, line in items:
        if is_heading:
            sections.append((line, []))
        else:
            sections[-1][1].append(line)
    return [Passage(title, "\n".join(lines), doc=doc) for title, lines in sections if "\n".join(lines).strip()]


def _read_jsonl_file(path: Path, data: bytes, problems: list[Problem]) -> ParsedFile:
    return ParsedFile(path.stem, _read_jsonl(path, data, problems))


def _read_jsonl(path: Path, data: bytes, problems: list[Problem]) -> list[Passage]:
    """The shared-data schema (``passages`` per question) or one ``{title, text}`` per line."""
    out: list[Passage] = []
    for lineno, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw.decode("utf-8-sig" if lineno == 1 else "utf-8"))
        except UnicodeDecodeError:
            problems.append(Problem(str(path), lineno, "not valid UTF-8; line skipped"))
            continue
        except json.JSONDecodeError as exc:
            problems.append(Problem(str(path), lineno, f"bad JSON ({exc.msg}); line skipped"))
            continue
        if not isinstance(obj, dict):
            problems.append(Problem(str(path), lineno, "expected a JSON object; line skipped"))
            continue
        if isinstance(obj.get("passages"), list):
            # One question: its passages form one document group (used by same-document neighbours).
            doc = f"{path.name}#{obj.get('id', lineno)}"
            for j, item in enumerate(obj["passages"]):
                if not _valid_passage(item):
                    problems.append(Problem(str(path), lineno, f"passage {j} is not a {{title, text}} object; skipped"))
                    continue
                if not _valid_unicode(item):
                    problems.append(Problem(str(path), lineno, f"passage {j} ({str(item.get('title') or '')[:40]!r}) "
                                                               "is not valid Unicode (a lone surrogate); skipped"))
                    continue
                out.append(Passage(str(item.get("title") or ""), item["text"], doc=doc))
        elif _valid_passage(obj) and not _valid_unicode(obj):
            problems.append(Problem(str(path), lineno, "the passage is not valid Unicode (a lone surrogate); skipped"))
        elif _valid_passage(obj):
            doc = str(obj.get("doc") or obj.get("doc_id") or path.name)
            out.append(Passage(str(obj.get("title") or ""), obj["text"], doc=doc))
        else:
            problems.append(Problem(str(path), lineno, "no 'passages' list and no 'text' string; line skipped"))
    return out


def _valid_unicode(item: dict) -> bool:
    """Whether a passage's title and text encode as UTF-8 (JSON can carry lone surrogates; tokenizers cannot)."""
    return is_valid_text(str(item.get("title") or "")) and is_valid_text(item["text"])


def _valid_passage(item: object) -> bool:
    return (isinstance(item, dict) and isinstance(item.get("text"), str)
            and isinstance(item.get("title", ""), str | None))


# ---------------------------------------------------------------- PDF, HTML, DOCX


def _broken(path: Path, problems: list[Problem], fmt: str, why: BaseException | str) -> ParsedFile:
    """A file of format ``fmt`` that cannot be used: ``why`` is an exception (the parser's words) or a sentence."""
    if isinstance(why, BaseException):
        why = f"cannot read this {fmt} file ({' '.join(str(why).split())[:160] or type(why).__name__})"
    problems.append(Problem(str(path), None, f"{why}; skipped", file_skipped=True))
    return ParsedFile(path.stem, [])


def _read_pdf(path: Path, data: bytes, problems: list[Problem]) -> ParsedFile:
    """One passage per page that has text; titled with the metadata title, else the file's stem."""
    from pypdf import PdfReader

    quiet = logging.getLogger("pypdf")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # pypdf warns about every recoverable oddity; we report what matters
    try:
        reader = PdfReader(io.BytesIO(data))
        if reader.is_encrypted and not _decrypts(reader):
            return _broken(path, problems, "PDF", "encrypted PDF (password-protected): decrypt it first")
        meta = reader.metadata
        title = meta.title if meta is not None and isinstance(meta.title, str) and meta.title.strip() else ""
        pages = [_clean(page.extract_text() or "") for page in reader.pages]
    except Exception as exc:  # a parser of untrusted bytes raises many kinds: any of them means "broken"
        return _broken(path, problems, "PDF", exc)
    finally:
        quiet.setLevel(level)
    title = " ".join(title.split()) or path.stem
    passages = [Passage(title, page, doc=path.name) for page in pages if page.strip()]
    if not passages:
        return _broken(path, problems, "PDF", f"no extractable text in its {len(pages)} page(s) (a scan? OCR it first)")
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


def _read_html(path: Path, data: bytes, problems: list[Problem]) -> ParsedFile:
    try:
        title, passages = _html_passages(path.name, path.stem, data, None)
    except Exception as exc:  # html.parser is lenient; anything it raises means the file is unusable
        return _broken(path, problems, "HTML", exc)
    if not passages:
        problems.append(Problem(str(path), None, "no text in the page's main content"))
    return ParsedFile(title, passages)


def _html_passages(doc: str, stem: str, markup: str | bytes, title: str | None) -> tuple[str, list[Passage]]:
    """The page's title and its main text as heading sections (navigation, scripts and styles removed)."""
    from bs4 import BeautifulSoup, NavigableString

    soup = BeautifulSoup(markup, "html.parser")
    own = " ".join(soup.title.get_text(" ").split()) if soup.title else ""
    name = title if title is not None else (own or stem)
    for tag in soup.find_all(_HTML_NOISE):
        tag.decompose()
    for tag in soup.find_all(lambda t: t.has_attr("hidden") or t.get("aria-hidden") == "true"):
        tag.decompose()
    root = soup.find("main") or soup.find("article") or soup.body or soup
    for s in list(root.find_all(string=True)):
        if type(s) is NavigableString and not any(p.name == "pre" for p in s.parents):
            s.replace_with(NavigableString(re.sub(r"\s+", " ", str(s))))
    for br in root.find_all("br"):
        br.replace_with("\n")
    for tag in root.find_all(_HEADINGS):
        tag.replace_with(f"\n{_MARK}{' '.join(tag.get_text(' ').split())}\n")
    for tag in root.find_all(_HTML_BLOCKS):
        tag.insert_before("\n\n")
        tag.insert_after("\n\n")
    flat = root.get_text("")
    items = ((True, line[1:].strip()) if line.startswith(_MARK) else (False, line.strip())
             for line in flat.replace("\r", "").split("\n"))
    passages = _sections(doc, name, _squeeze(items))
    return name, passages


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


def _read_docx(path: Path, data: bytes, problems: list[Problem]) -> ParsedFile:
    """Paragraphs in order; paragraphs styled as headings (or Title) start sections."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            if z.getinfo("word/document.xml").file_size > _DOCX_MAX_XML:
                return _broken(path, problems, "DOCX", "not a usable DOCX file (its document.xml is implausibly large)")
            body = ElementTree.fromstring(z.read("word/document.xml"))
            core = z.read("docProps/core.xml") if "docProps/core.xml" in z.namelist() else b""
        items = list(_docx_paragraphs(body))
        title = ""
        if core:
            node = ElementTree.fromstring(core).find("{http://purl.org/dc/elements/1.1/}title")
            title = " ".join((node.text or "").split()) if node is not None else ""
    except Exception as exc:  # zip, XML and missing-part errors: the file is not a usable .docx
        return _broken(path, problems, "DOCX", exc)
    title = title or path.stem
    return ParsedFile(title, _sections(path.name, title, items))


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


register_reader([".txt"], "text", _read_txt, text=True)
register_reader([".md"], "markdown", _read_md, text=True)
register_reader([".jsonl"], "JSON lines", _read_jsonl_file, text=True)
register_reader([".pdf"], "PDF", _read_pdf)
register_reader([".html", ".htm"], "HTML", _read_html)
register_reader([".docx"], "DOCX", _read_docx)

#: Suffixes the readers handle (files with others are skipped when a folder is searched).
SUPPORTED_SUFFIXES = supported_suffixes()
