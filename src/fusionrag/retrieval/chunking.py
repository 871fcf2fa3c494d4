"""Cutting passages into token-bounded chunks (reading files: :mod:`fusionrag.retrieval.readers`).

A chunk is the unit of KV reuse, so its size is measured in the *LLM's* tokens, exactly
as the chunk will appear in the prompt (``PromptBuilder.chunk_token_ids(title, text)``, title
included). Chunks are cut on sentence boundaries (then whitespace, then characters for
pathological inputs) and a passage that already fits is kept verbatim, so its content
hash equals the hash of the same passage seen online (``chunk_text(title, text)``).

``Passage``, ``Problem``, ``expand_paths`` and ``read_passages`` live with the readers and are
importable from here too.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from fusionrag.prompt import PromptBuilder, passage_hash
from fusionrag.retrieval.readers import SUPPORTED_SUFFIXES, Passage, Problem, expand_paths, read_passages

__all__ = ["DEFAULT_CHUNK_TOKENS", "SUPPORTED_SUFFIXES", "Chunk", "Passage", "Problem", "dedup", "expand_paths",
           "make_chunks", "read_passages", "split_passage"]

DEFAULT_CHUNK_TOKENS = 256

# A sentence ends after . ! or ? (optionally followed by closing quotes/brackets) and
# whitespace, or at a blank line.
_SENTENCE_END = re.compile(r"(?<=[.!?])[\"'\)\]»”’]*\s+|\n\s*\n")
_WORD = re.compile(r"\S+\s*")


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


def fit_title(prompt: PromptBuilder, title: str, max_tokens: int) -> str:
    """``title``, shortened (at a word where it can) until it takes at most half of a chunk's tokens, so
    the passage's text always has room: a title never makes its document's text vanish."""
    budget = max_tokens // 2
    if len(prompt.chunk_token_ids(title, "")) <= budget:
        return title
    lo, hi = 0, len(title)
    while lo < hi:  # the longest prefix that fits
        mid = (lo + hi + 1) // 2
        if len(prompt.chunk_token_ids(title[:mid] + "...", "")) <= budget:
            lo = mid
        else:
            hi = mid - 1
    cut = title[:lo]
    word = cut.rfind(" ")
    return (cut[:word] if word > lo // 2 else cut).rstrip() + "..."


def make_chunks(prompt: PromptBuilder, passages: Iterable[Passage], max_tokens: int = DEFAULT_CHUNK_TOKENS,
                problems: list[Problem] | None = None) -> list[Chunk]:
    """Split passages into chunks (token ids included), in input order, duplicates kept. A title longer
    than half a chunk is shortened (:func:`fit_title`) and the shortening reported in ``problems``."""
    out: list[Chunk] = []
    for p in passages:
        title = fit_title(prompt, p.title, max_tokens)
        if title != p.title:
            if problems is not None:
                problems.append(Problem(p.doc, None, f"title of '{p.title[:40]}...' ({len(p.title)} characters) "
                                                     f"shortened to {len(title)} to leave room for its text"))
            p = dataclasses.replace(p, title=title)
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
