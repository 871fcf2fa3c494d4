"""Where stored chunks' text occurs in a client's text, whole or in part: the regions :mod:`.matching` serves from KV.

A framework that splits documents its own way (LangChain's ``RecursiveCharacterTextSplitter(500, 50)``,
LlamaIndex's ``SentenceSplitter(256)``) sends passages that are contiguous *parts* of the store's chunks,
or run across two of them. Each part is served from the stored KV of exactly those tokens, so reuse
does not depend on the client splitting as the store did.

Texts are compared normalised (:func:`normalise`: Unicode NFC, whitespace runs as one space). A region is
found from an *anchor*: the 32 characters from a word start of a chunk, looked up among the word starts
of the client's text (one dictionary of the client's anchors, so a request costs one pass over its text
plus a few lookups per candidate chunk), then extended left and right as far as both texts agree. Regions
are chosen longest first, without overlaps; a region is then cut to the chunk's whole tokens inside it
(:func:`token_span`): a token reaching outside it (a word cut in two) is left to the text around it.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

_SPACE = re.compile(r"\s+")
#: What regions are found in: a normalised text, or token ids.
Seq = str | tuple[int, ...]
_WORD = re.compile(r"\S+")
#: Characters an anchor compares: long enough that a chance hit is rare, short enough that every
#: region worth serving holds one (anchors start every ``ANCHOR_CHARS // 2`` characters of a chunk).
ANCHOR_CHARS = 32
#: A part of a chunk shorter than this (normalised characters; an anchor's length) is computed with the text around it:
#: a few shared words (a name, a common phrase) are not a passage.
MIN_PART_CHARS = 32
#: A part of a chunk is served from KV only with at least this many of its tokens.
MIN_PART_TOKENS = 8


def normalise(text: str) -> str:
    """Unicode NFC, whitespace runs as one space, ends stripped: frameworks re-flow whitespace and loaders
    compose or decompose accents (a macOS file name or a PDF's text is often NFD), not words."""
    return _SPACE.sub(" ", unicodedata.normalize("NFC", text)).strip()


@dataclass(frozen=True)
class Region:
    """Characters ``start:end`` of the client's normalised text equal characters ``at:at + end - start`` of
    chunk ``chunk_id``'s normalised text (``whole``: all of it)."""

    start: int
    end: int
    chunk_id: int
    at: int
    whole: bool

    def __len__(self) -> int:
        return self.end - self.start

    def cut(self, start: int, end: int) -> Region:
        """The part of this region over the client's characters ``start:end`` (within it)."""
        return replace(self, start=start, end=end, at=self.at + start - self.start, whole=False)


def find_regions(norm: Seq, bodies: Sequence[tuple[int, Seq]], min_whole: int, min_part: int = MIN_PART_CHARS,
                 anchor: int = ANCHOR_CHARS, framing: Mapping[int, tuple[int, int]] | None = None,
                 prefer: frozenset[int] = frozenset()) -> list[Region]:
    """Regions of ``norm`` that are chunks' ``bodies`` (``(chunk id, body)``), whole (``min_whole`` at least) or
    in part (``min_part``), without overlaps, in order. Longest first: a whole chunk wins over a part of another
    at the same place.

    ``norm`` and the bodies are normalised texts (anchors start at word starts) or token ids (a tuple: anchors
    start anywhere; a prompt's ids, :mod:`fusionrag.retrieval.token_matching`); ``anchor``: an anchor's length.
    ``framing``: for a chunk id, how many of its first and last items are its framing rather than its text (a
    title in brackets, a closing blank line: a client's template frames a passage its own way); a part that
    misses no more than those is the chunk's whole text and is taken at any length from ``anchor`` on.
    ``prefer``: chunk ids whose regions are taken before any other's (the document a client said it pasted: a
    text two files share is credited to it, even where the other file's chunk covers a little more)."""
    found: dict[tuple[int, int, int], Region] = {}
    for cid, body in bodies:  # a chunk shorter than an anchor is found whole (any chunk, in a text)
        if len(body) >= min_whole and (isinstance(norm, str) or len(body) < anchor):
            for at in _occurrences(norm, body):  # every one: a pipeline may paste the same passage twice
                found[(at, at + len(body), cid)] = Region(at, at + len(body), cid, 0, True)
    anchors = _anchors(norm, anchor)
    for cid, body in bodies:
        for r in _parts(norm, anchors, cid, body, max(min_part, anchor), anchor, (framing or {}).get(cid)):
            if r.whole and len(r) < min_whole:
                continue
            found.setdefault((r.start, r.end, r.chunk_id), r)
    ranked = sorted(found.values(), key=lambda r: (r.chunk_id not in prefer, -len(r), not r.whole, r.start))
    return _without_overlaps(ranked, min_part)


def word_starts(text: str) -> Iterator[int]:
    """Where each word of ``text`` starts."""
    return (m.start() for m in _WORD.finditer(text))


def _starts(seq: Seq) -> Iterator[int]:
    """Where an anchor may start: a word start of a text, any position of token ids."""
    return word_starts(seq) if isinstance(seq, str) else iter(range(len(seq)))


def _anchors(norm: Seq, n: int) -> dict[Seq, list[int]]:
    """``norm``'s anchors: its ``n`` items from each start (:func:`_starts`), where they occur."""
    out: dict[Seq, list[int]] = {}
    for i in _starts(norm):
        if i + n > len(norm):
            break
        out.setdefault(norm[i:i + n], []).append(i)
    return out


def _occurrences(norm: Seq, body: Seq) -> Iterator[int]:
    """Where ``body`` occurs in ``norm`` (a text's ``find``; token ids compared where the first id occurs)."""
    if isinstance(norm, str):
        at = norm.find(body)
        while at >= 0:
            yield at
            at = norm.find(body, at + 1)
        return
    if not body:
        return
    for at in range(len(norm) - len(body) + 1):
        if norm[at] == body[0] and norm[at:at + len(body)] == body:
            yield at


def _parts(norm: Seq, anchors: dict[Seq, list[int]], cid: int, body: Seq, min_part: int, n: int,
           framing: tuple[int, int] | None = None) -> list[Region]:
    """Maximal regions where ``body`` and ``norm`` agree, found from ``body``'s anchors (one every ``n // 2``);
    with ``framing`` (see :func:`find_regions`), a region missing only framing is taken at any length."""
    out: list[Region] = []
    covered: dict[int, list[tuple[int, int]]] = {}  # offset (client position - body position) -> body ranges
    next_at = 0
    for j in _starts(body):
        if j < next_at:
            continue
        if j + n > len(body):
            break
        next_at = j + max(1, n // 2)
        for i in anchors.get(body[j:j + n], ()):
            if any(a <= j < b for a, b in covered.get(i - j, ())):
                continue  # inside a region found from an earlier anchor on the same alignment
            left = _common_suffix(norm, i, body, j)
            right = _common_prefix(norm, i, body, j)
            covered.setdefault(i - j, []).append((j - left, j + right))
            whole = j - left == 0 and j + right == len(body)
            text = framing is not None and j - left <= framing[0] and len(body) - (j + right) <= framing[1]
            if whole or text or left + right >= min_part:  # a whole chunk at any length (min_whole checked after)
                out.append(Region(i - left, i + right, cid, j - left, whole))
    return out


def _common_prefix(a: Seq, i: int, b: Seq, j: int) -> int:
    """How many characters ``a[i:]`` and ``b[j:]`` share at their start."""
    return _agreement(lambda n, k: a[i + n:i + n + k] == b[j + n:j + n + k], min(len(a) - i, len(b) - j))


def _common_suffix(a: Seq, i: int, b: Seq, j: int) -> int:
    """How many characters ``a[:i]`` and ``b[:j]`` share at their end."""
    return _agreement(lambda n, k: a[i - n - k:i - n] == b[j - n - k:j - n], min(i, j))


def _agreement(same: Callable[[int, int], bool], most: int) -> int:
    """The longest ``n <= most`` with ``same(0, n)``, given ``same(n, k)``: whether the ``k`` characters after the
    first ``n`` agree. Doubling, then halving: a few slice comparisons (in C), not one per character."""
    n, step = 0, 64
    while n < most:
        k = min(step, most - n)
        if same(n, k):
            n, step = n + k, step * 2
        elif k == 1:
            break
        else:
            step = max(1, k // 2)
    return n


def _without_overlaps(ranked: Sequence[Region], min_part: int) -> list[Region]:
    """Regions taken best first; one overlapping those taken keeps its longest free stretch (if long enough)."""
    taken: list[Region] = []
    for r in ranked:
        free = _free_stretch(r.start, r.end, taken)
        if free is None:
            continue
        a, b = free
        if (a, b) == (r.start, r.end):
            taken.append(r)
        elif b - a >= min_part:
            taken.append(r.cut(a, b))
    return sorted(taken, key=lambda r: r.start)


def _free_stretch(start: int, end: int, taken: Sequence[Region]) -> tuple[int, int] | None:
    """The longest part of ``start:end`` no taken region covers."""
    cuts = sorted((max(start, t.start), min(end, t.end)) for t in taken if t.start < end and t.end > start)
    best, pos = None, start
    for a, b in [*cuts, (end, end)]:
        if a > pos and (best is None or a - pos > best[1] - best[0]):
            best = (pos, a)
        pos = max(pos, b)
    return best


@dataclass(frozen=True)
class Positions:
    """A chunk's normalised body and, for each of its characters, the index of that character in the
    chunk's prompt text (``[title] text\\n\\n``, what its token offsets count)."""

    body: str
    origin: tuple[int, ...]


@lru_cache(maxsize=4096)
def positions(prompt_text: str, body_start: int, body: str) -> Positions | None:
    """``body`` (the chunk's text as stored, at ``body_start`` in its ``prompt_text``) normalised, with where each
    character came from; None when NFC would change it (the offsets would not map: such a chunk is only
    served whole)."""
    if unicodedata.normalize("NFC", body) != body:
        return None
    chars: list[str] = []
    origin: list[int] = []
    for m in _WORD.finditer(body):
        if chars:
            chars.append(" ")
            origin.append(body_start + m.start() - 1)
        chars.extend(m.group())
        origin.extend(range(body_start + m.start(), body_start + m.end()))
    return Positions("".join(chars), tuple(origin))


@lru_cache(maxsize=1024)
def _offsets(tokenizer: Any, prompt_text: str) -> tuple[tuple[int, ...], tuple[tuple[int, int], ...]] | None:
    try:
        enc = tokenizer(prompt_text, add_special_tokens=False, return_offsets_mapping=True)
    except (NotImplementedError, ValueError, TypeError):  # a slow tokenizer has no offsets
        return None
    return tuple(enc["input_ids"]), tuple(tuple(o) for o in enc["offset_mapping"])


def token_span(tokenizer: Any, prompt_text: str, token_ids: Sequence[int], where: Positions, at: int,
               end: int) -> tuple[int, int, int, int] | None:
    """The chunk's tokens whose characters lie in its normalised body's ``at:end`` (whitespace at a token's
    ends aside: ``" word"`` starts at its word), as ``(first, stop)`` token indices and the body characters
    ``(from, to)`` those tokens cover; None when fewer than :data:`MIN_PART_TOKENS` are inside, or when the
    tokenizer does not give the stored ids for the chunk's text (offsets would not describe them)."""
    enc = _offsets(tokenizer, prompt_text)
    if enc is None or list(enc[0]) != list(token_ids) or end <= at:
        return None
    lo, hi = where.origin[at], where.origin[end - 1] + 1  # the region in the prompt text's characters
    inside = []
    for k, (s, e) in enumerate(enc[1]):
        piece = prompt_text[s:e]
        s2, e2 = s + len(piece) - len(piece.lstrip()), e - len(piece) + len(piece.rstrip())
        if (lo <= s2 and e2 <= hi) if s2 < e2 else (lo < s and e <= hi):
            inside.append(k)
    if not inside:
        return None
    first, stop = inside[0], inside[-1] + 1
    if stop - first < MIN_PART_TOKENS or len(inside) != stop - first:
        return None
    s_first, e_last = enc[1][first][0], enc[1][stop - 1][1]
    covered = [n for n in range(at, end) if s_first <= where.origin[n] < e_last]
    return first, stop, covered[0], covered[-1] + 1
