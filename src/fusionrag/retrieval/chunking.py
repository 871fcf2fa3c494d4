"""Reading documents and cutting them into token-bounded chunks.

A chunk is the unit of KV reuse, so its size is measured in the *LLM's* tokens, exactly
as the chunk will appear in the prompt (``PromptBuilder.chunk_token_ids(title, text)``, title
included). Chunks are cut on sentence boundaries (then whitespace, then characters for
pathological inputs) and a passage that already fits is kept verbatim, so its content
hash equals the hash of the same passage seen online (``chunk_text(title, text)``).

Readers never abort an ingest: a malformed line or file is reported as a
:class:`Problem` (file and line) and skipped, and the rest of the input is used.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from fusionrag.prompt import PromptBuilder, is_valid_text, passage_hash

SUPPORTED_SUFFIXES = (".txt", ".md", ".jsonl")
DEFAULT_CHUNK_TOKENS = 256

# A sentence ends after . ! or ? (optionally followed by closing quotes/brackets) and
# whitespace, or at a blank line.
_SENTENCE_END = re.compile(r"(?<=[.!?])[\"'\)\]»”’]*\s+|\n\s*\n")
_WORD = re.compile(r"\S+\s*")
_MD_HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$")


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
class Chunk:
    """A token-bounded piece of a passage, ready for the knowledge base."""

    doc: str
    title: str
    text: str
    token_ids: tuple[int, ...]
    content_hash: str

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class Problem:
    """Input that was skipped, and why (``line`` is 1-based, ``None`` for the whole file)."""

    path: str
    line: int | None
    message: str

    def __str__(self) -> str:
        where = self.path if self.line is None else f"{self.path}:{self.line}"
        return f"{where}: {self.message}"


# ---------------------------------------------------------------- readers


def expand_paths(paths: Iterable[Path | str], problems: list[Problem]) -> list[Path]:
    """Files to read: files as given, folders searched recursively for supported suffixes."""
    out: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            out.extend(_walk(p))
        elif p.is_file():
            if p.suffix.lower() in SUPPORTED_SUFFIXES:
                out.append(p)
            else:
                problems.append(Problem(str(p), None, f"unsupported file type '{p.suffix}' "
                                        f"(supported: {', '.join(SUPPORTED_SUFFIXES)})"))
        else:
            problems.append(Problem(str(p), None, "no such file or folder"))
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
        found.extend(Path(folder) / f for f in sorted(files) if Path(f).suffix.lower() in SUPPORTED_SUFFIXES
                     and (Path(folder) / f).is_file())
    return found


def read_passages(path: Path, problems: list[Problem]) -> list[Passage]:
    """All passages of one file; anything unreadable goes to ``problems`` instead."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        problems.append(Problem(str(path), None, f"cannot read: {exc.strerror or exc}"))
        return []
    if not data.strip():
        problems.append(Problem(str(path), None, "empty file"))
        return []
    if b"\x00" in data[:8192]:
        problems.append(Problem(str(path), None, "binary file (contains NUL bytes); skipped"))
        return []
    if path.suffix.lower() == ".jsonl":
        return _read_jsonl(path, data, problems)
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        problems.append(Problem(str(path), line, "not valid UTF-8 text; file skipped"))
        return []
    if path.suffix.lower() == ".md":
        return _markdown_sections(path, text)
    return [Passage(path.stem, text, doc=path.name)] if text.strip() else []


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


def _markdown_sections(path: Path, text: str) -> list[Passage]:
    """One passage per heading section, titled by the heading (the file stem before the first one)."""
    sections: list[tuple[str, list[str]]] = [(path.stem, [])]
    in_fence = False
    for line in text.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            in_fence = not in_fence
        m = None if in_fence else _MD_HEADING.match(line)
        if m:
            sections.append((m.group(2).strip(), []))
        else:
            sections[-1][1].append(line)
    return [Passage(title, "\n".join(lines), doc=path.name) for title, lines in sections if "\n".join(lines).strip()]


# ---------------------------------------------------------------- splitting


def split_passage(prompt: PromptBuilder, title: str, text: str, max_tokens: int) -> list[str]:
    """Texts of the chunks of one passage; each ``chunk_ids(title, piece)`` has <= ``max_tokens`` tokens."""
    text = text.strip()
    if not text:
        return []
    if len(prompt.chunk_token_ids(title, text)) <= max_tokens:
        return [text]  # verbatim: same hash as the passage seen online
    if len(prompt.chunk_token_ids(title, "x")) >= max_tokens:
        raise ValueError(f"the title alone needs {max_tokens}+ tokens")
    return [p for p in _pack(prompt, title, text, _spans(text, _SENTENCE_END), max_tokens, level=0) if p]


def _spans(text: str, boundary: re.Pattern[str]) -> list[tuple[int, int]]:
    """Cut ``text`` after each boundary match; the spans cover the whole text."""
    spans, start = [], 0
    for m in boundary.finditer(text):
        if m.end() > start:
            spans.append((start, m.end()))
            start = m.end()
    if start < len(text):
        spans.append((start, len(text)))
    return spans


def _pack(prompt: PromptBuilder, title: str, text: str, spans: list[tuple[int, int]], max_tokens: int,
          level: int) -> Iterator[str]:
    """Greedily join consecutive spans into pieces that fit; too-long spans are cut finer.

    Token counts of single spans estimate the joint count (tokenising each candidate
    from scratch would be quadratic); every emitted piece is checked exactly, and
    shortened by one span at a time if the estimate was optimistic.
    """

    def fits(a: int, b: int) -> bool:
        return len(prompt.chunk_token_ids(title, text[a:b])) <= max_tokens

    overhead = len(prompt.chunk_token_ids(title, "")) if title else 0
    costs = [len(prompt.encode(text[a:b])) for a, b in spans]
    i = 0
    while i < len(spans):
        a = spans[i][0]
        if not fits(a, spans[i][1]):  # one span alone is too long: cut it finer
            yield from _split_long(prompt, title, text, spans[i], max_tokens, level)
            i += 1
            continue
        j, total = i + 1, overhead + costs[i]
        while j < len(spans) and total + costs[j] <= max_tokens:
            total += costs[j]
            j += 1
        while j > i + 1 and not fits(a, spans[j - 1][1]):
            j -= 1
        yield text[a:spans[j - 1][1]].strip()
        i = j


def _split_long(prompt: PromptBuilder, title: str, text: str, span: tuple[int, int], max_tokens: int,
                level: int) -> Iterator[str]:
    a, b = span
    if level == 0:  # sentence too long: pack its words
        words = [(a + s, a + e) for s, e in _spans(text[a:b], _WORD)]
        if len(words) > 1:
            yield from _pack(prompt, title, text, words, max_tokens, level=1)
            return
    # a single "word" longer than a chunk (e.g. a URL or base64 blob): cut by characters. The
    # search window grows from a guess until it no longer fits, so each probe tokenises about
    # one chunk's worth of text, never the whole remainder: linear in the input, not quadratic.
    while a < b:
        window = max(16, 4 * max_tokens)
        while a + window < b and len(prompt.chunk_token_ids(title, text[a:a + window])) <= max_tokens:
            window *= 2
        lo, hi = a + 1, min(b, a + window)
        while lo < hi:  # the longest prefix that fits
            mid = (lo + hi + 1) // 2
            if len(prompt.chunk_token_ids(title, text[a:mid])) <= max_tokens:
                lo = mid
            else:
                hi = mid - 1
        yield text[a:lo].strip()
        a = lo


def make_chunks(prompt: PromptBuilder, passages: Iterable[Passage], max_tokens: int = DEFAULT_CHUNK_TOKENS,
                problems: list[Problem] | None = None) -> list[Chunk]:
    """Split passages into chunks (token ids included), in input order, duplicates kept."""
    out: list[Chunk] = []
    for p in passages:
        try:
            pieces = split_passage(prompt, p.title, p.text, max_tokens)
        except ValueError as exc:
            if problems is not None:
                problems.append(Problem(p.doc, None, f"passage '{p.title[:40]}' skipped: {exc}"))
            continue
        for piece in pieces:
            ids = tuple(prompt.chunk_token_ids(p.title, piece))
            out.append(Chunk(p.doc, p.title.strip(), piece, ids, passage_hash(p.title, piece)))
    return out


def dedup(chunks: Iterable[Chunk]) -> tuple[list[Chunk], int]:
    """Drop exact duplicates (same content hash); the first occurrence (and its document) wins.

    Returns the unique chunks and how many duplicates were dropped.
    """
    seen: set[str] = set()
    out, dropped = [], 0
    for c in chunks:
        if c.content_hash in seen:
            dropped += 1
        else:
            seen.add(c.content_hash)
            out.append(c)
    return out, dropped
