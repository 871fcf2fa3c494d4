"""Reading documents: one reader per file format, behind a registry keyed by the file's suffix.

Formats: ``.txt`` (one passage titled with the file's stem), ``.md`` and ``.rst`` (one passage per
heading section; reStructuredText read as text, without docutils), ``.jsonl`` (``{title, text}`` per
line, or the shared-data schema with ``passages``), ``.pdf`` (``pypdf``: one passage per page with
text, titled with the PDF's metadata title or the stem), ``.html``/``.htm`` (``beautifulsoup4``:
the main text without navigation, scripts and styles; one passage per heading section, the first
titled with ``<title>``) and ``.docx`` (the standard library's zip + XML: one passage per heading
section). A folder's files of other types are named in one problem (not failed files).

Readers never abort an ingest: a malformed line or file is reported as a :class:`Problem`
(file and line; ``file_skipped`` when the whole file could not be used) and skipped, and the
rest of the input is used. :func:`passages_from_text` splits a text already read (e.g. by a
framework's loader) exactly as the reader of its source would have split that file, so the
same passages get the same content hashes.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

from fusionrag.errors import FusionRAGError
from fusionrag.prompt import is_valid_text
from fusionrag.retrieval.formats import html_passages, read_docx, read_html, read_pdf
from fusionrag.retrieval.passages import ParsedFile, Passage, Problem, sections

__all__ = ["READERS", "SUPPORTED_SUFFIXES", "ParsedFile", "Passage", "Problem", "expand_paths", "load_bytes",
           "max_file_bytes", "parse_file", "passages_from_text", "read_passages", "register_reader"]

#: A reader: (path, the file's bytes, problems) -> the file's title and passages.
Reader = Callable[[Path, bytes, list[Problem]], ParsedFile]


@dataclass(frozen=True)
class Format:
    name: str
    read: Reader
    text: bool  # plain text (a NUL byte means a binary file, not this format)
    max_mb: int = 256  # the largest file it takes (see max_file_bytes)


READERS: dict[str, Format] = {}


def register_reader(suffixes: Iterable[str], name: str, read: Reader, text: bool = False, max_mb: int = 256) -> None:
    """Read files with these suffixes (lower case, with the dot) with ``read``, files up to ``max_mb`` MiB."""
    for suffix in suffixes:
        READERS[suffix.lower()] = Format(name, read, text, max_mb)


def supported_suffixes() -> tuple[str, ...]:
    return tuple(READERS)


# ---------------------------------------------------------------- files


def expand_paths(paths: Iterable[Path | str], problems: list[Problem]) -> list[Path]:
    """Files to read: files as given, folders searched recursively for supported suffixes."""
    out: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            out.extend(_walk(p, problems))
        elif p.is_file():
            if p.suffix.lower() in READERS:
                out.append(p)
            else:
                problems.append(Problem(str(p), None, f"unsupported file type '{p.suffix}' "
                                        f"(supported: {', '.join(READERS)})", file_skipped=True))
        elif p.exists():
            problems.append(Problem(str(p), None, f"not a regular file ({_file_kind(p)}); skipped", file_skipped=True))
        else:
            problems.append(Problem(str(p), None, "no such file or folder", file_skipped=True))
    return out


def _walk(root: Path, problems: list[Problem]) -> list[Path]:
    """Supported files under ``root``, following symlinked folders (each real folder once: no loops); a FIFO,
    device or socket with a supported suffix is named in ``problems`` (reading one could block forever)."""
    found: list[Path] = []
    unsupported: list[str] = []
    seen: set[str] = set()
    for folder, dirs, files in os.walk(root, followlinks=True):
        real = os.path.realpath(folder)
        if real in seen:
            dirs[:] = []
            continue
        seen.add(real)
        dirs.sort()
        for f in sorted(files):
            path = Path(folder) / f
            if path.suffix.lower() not in READERS:
                if not _hidden(path.relative_to(root)):  # .git/, .DS_Store: not documents anyone meant
                    unsupported.append(str(path.relative_to(root)))
                continue
            if path.is_file():
                found.append(path)
            elif path.exists():
                problems.append(Problem(str(path), None, f"not a regular file ({_file_kind(path)}); skipped",
                                        file_skipped=True))
    if unsupported:  # named, one line for the folder; not failed files (a folder holds other things too)
        shown = ", ".join(unsupported[:10]) + (f" and {len(unsupported) - 10} more" if len(unsupported) > 10 else "")
        problems.append(Problem(str(root), None, f"{len(unsupported)} file(s) of unsupported types not read: {shown} "
                                                 f"(supported: {', '.join(READERS)})"))
    return found


def _hidden(rel: Path) -> bool:
    return any(part.startswith(".") for part in rel.parts)


def _file_kind(path: Path) -> str:
    mode = path.stat().st_mode
    return ("FIFO" if stat.S_ISFIFO(mode) else "socket" if stat.S_ISSOCK(mode) else
            "device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "special file")


#: The largest file of any format (a reader holds its file in memory); ``FUSIONRAG_MAX_FILE_MB`` sets every
#: format's limit to one value instead of the per-format ones (``Format.max_mb``).
MAX_FILE_BYTES = 256 << 20


def max_file_bytes(suffix: str) -> int:
    """The largest file the reader of ``suffix`` takes: its format's limit, measured to read in under 10 s and
    500 MB at that size in its worst shapes (``benchmarks/readers``), or ``FUSIONRAG_MAX_FILE_MB``."""
    override = os.environ.get("FUSIONRAG_MAX_FILE_MB", "").strip()
    if override:
        try:
            mb = float(override)
        except ValueError:
            mb = float("nan")
        if not (0 < mb < float("inf")):
            raise FusionRAGError(f"FUSIONRAG_MAX_FILE_MB={override!r} is not a size: give a positive number of "
                                 "megabytes (e.g. 64), or unset it for each format's own limit")
        return int(mb * (1 << 20))
    fmt = READERS.get(suffix.lower())
    return MAX_FILE_BYTES if fmt is None else min(MAX_FILE_BYTES, fmt.max_mb << 20)


def load_bytes(path: Path, problems: list[Problem]) -> bytes | None:
    """The file's bytes, or None with the reason in ``problems``. Checked before anything is read: a regular
    file, at most its format's :func:`max_file_bytes`; a text format's first 8 KB hold no NUL byte (a binary file is
    refused after 8 KB, not after reading gigabytes of it)."""
    try:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode):
            problems.append(Problem(str(path), None, f"not a regular file ({_file_kind(path)}); skipped",
                                    file_skipped=True))
            return None
        fmt = READERS.get(path.suffix.lower())
        limit = max_file_bytes(path.suffix)
        if st.st_size > limit:
            kind = f"{fmt.name}; " if fmt is not None else ""
            problems.append(Problem(str(path), None, f"{st.st_size / 2**20:,.1f} MiB is over the {limit / 2**20:,.0f} "
                                    f"MiB limit of one file ({kind}FUSIONRAG_MAX_FILE_MB changes it); skipped",
                                    file_skipped=True))
            return None
        with path.open("rb") as f:
            head = f.read(8192)
            if fmt is not None and fmt.text and b"\x00" in head:
                problems.append(Problem(str(path), None, "binary file (contains NUL bytes); skipped",
                                        file_skipped=True))
                return None
            return head + f.read(limit + 1 - len(head))
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
    said = len(problems)
    parsed = fmt.read(path, data, problems)
    if not parsed.passages and len(problems) == said:  # e.g. only a byte-order mark: nothing read is said
        problems.append(Problem(str(path), None, "no text in the file"))
    return parsed


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
    if suffix == ".rst":
        return _restructured(doc, name, text)
    if suffix in (".html", ".htm"):
        return html_passages(doc, stem, text, title)[1]
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


def _read_rst(path: Path, data: bytes, problems: list[Problem]) -> ParsedFile:
    text = _decode(path, data, problems)
    passages = [] if text is None else _restructured(path.name, path.stem, text)
    return ParsedFile(passages[0].title if passages and passages[0].title != path.stem else path.stem, passages)


#: A reStructuredText section underline (or overline): one punctuation character repeated.
_RST_RULE = re.compile(r"^([=\-`:'\"~^_*+#<>.])\1{2,}\s*$")


def _restructured(doc: str, stem: str, text: str) -> list[Passage]:
    """reStructuredText as text, one passage per section (a title line with an underline at least as long, and
    its optional overline); the markup stays as written. No docutils: the same file makes the same chunks
    whatever is installed (what a framework's loader sends back must split the same way)."""
    lines = text.splitlines()

    def items() -> Iterator[tuple[bool, str]]:
        i = 0
        while i < len(lines):
            line = lines[i]
            title = line.strip()
            nxt = lines[i + 1] if i + 1 < len(lines) else ""
            if (title and not _RST_RULE.match(line) and not line[:1].isspace() and _RST_RULE.match(nxt)
                    and len(nxt.rstrip()) >= len(title)):
                yield True, title
                i += 2
                continue
            if _RST_RULE.match(line) and i + 2 < len(lines) and _RST_RULE.match(lines[i + 2]) and lines[i + 1].strip():
                yield True, lines[i + 1].strip()  # overline + title + underline
                i += 3
                continue
            yield False, line
            i += 1

    return sections(doc, stem, items())


def _markdown(doc: str, stem: str, text: str) -> list[Passage]:
    """One passage per heading section, titled by the heading (``stem`` before the first one)."""

    def lines() -> Iterator[tuple[bool, str]]:
        in_fence = False
        for line in text.splitlines():
            if line.lstrip().startswith(("```", "~~~")):
                in_fence = not in_fence
            m = None if in_fence else _MD_HEADING.match(line)
            yield (True, m.group(2).strip()) if m else (False, line)

    return sections(doc, stem, lines())


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


# Each limit keeps its reader inside 10 s and 500 MB on the worst shapes measured at that size
# (benchmarks/readers/results: tiny sections, deep nesting, compressed parts).
register_reader([".txt"], "text", _read_txt, text=True, max_mb=128)
register_reader([".md"], "markdown", _read_md, text=True, max_mb=16)
register_reader([".rst"], "reStructuredText", _read_rst, text=True, max_mb=16)  # a line scan, like Markdown's
register_reader([".jsonl"], "JSON lines", _read_jsonl_file, text=True, max_mb=32)
register_reader([".pdf"], "PDF", read_pdf, max_mb=32)
register_reader([".html", ".htm"], "HTML", read_html, max_mb=8)
register_reader([".docx"], "DOCX", read_docx, max_mb=16)

#: Suffixes the readers handle (files with others are skipped when a folder is searched).
SUPPORTED_SUFFIXES = supported_suffixes()
