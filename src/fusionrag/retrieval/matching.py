"""Client passages mapped onto stored chunks, whatever the client's framework did to the text.

A RAG framework sends the passages *it* retrieved: a LangChain document holding a whole file,
a LlamaIndex node of 1,024 tokens that starts mid-paragraph, a chunk fusionrag's own retriever
returned. Their KV is reusable only where a piece of the text is a chunk the store holds, so
each passage is mapped onto stored chunks in three steps, cheapest first:

1. **The passage is a stored chunk** (same title and text, by content hash): what fusionrag's
   retriever (``POST /v1/retrieve``) returns and a framework sends back unchanged.
2. **The store's chunker splits it into stored chunks**: the passage is split exactly as
   ingest splits a passage (same chunk size, same boundaries) and each piece is looked up by
   content hash; a document whose title and text equal an ingested passage reuses all of it.
3. **Stored chunks, or parts of them, occur in its text**: candidate chunks (the documents of the
   chunks the passage's text retrieves, and the document named by its ``source``) whose text occurs
   in the passage, whitespace aside, whole or in part (:mod:`.overlaps`), are reused where they
   occur: a whole chunk as stored, a part from the stored KV of its tokens (``Piece.span``; the
   prefill moves it to its place and recomputes its first tokens). The text between them becomes
   new pieces, computed once and kept in the prefix cache. A whole file read by a framework's
   loader reuses every chunk ingest made of it (its markdown headings, which ingest turned into
   titles, are not new text); a framework's own, finer split reuses the parts of chunks it holds.

A passage in which no stored chunk is found stays whole: one new chunk, as the client sent it.
The prompt a request gets is the passages' text in the client's order; only which pieces
have precomputed KV depends on the store.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fusionrag.prompt import PromptBuilder, chunk_text, passage_hash
from fusionrag.retrieval.chunking import DEFAULT_CHUNK_TOKENS, Passage, make_chunks
from fusionrag.retrieval.overlaps import Region, find_regions, normalise, positions, token_span

#: Stored chunks shorter than this (normalised characters) are not matched inside other text:
#: a two-word chunk occurs by chance.
MIN_MATCH_CHARS = 24
#: How many chunks the passage's text retrieves to find the documents it may come from.
CANDIDATE_SEARCH = 8
#: Candidate chunks checked per passage at most (the documents of the retrieved chunks).
MAX_CANDIDATES = 2048
#: Unmatched text shorter than this after the exact lookup is not searched by embedding (separators, a
#: template's lines): a part of a chunk worth finding there is longer.
SEARCHED_CHARS = 64
#: A long text is searched in windows of this many characters (~200 tokens: within an embedding's reach) ...
WINDOW_CHARS = 800
#: ... and at most this many of them, spread over the text.
MAX_WINDOWS = 32


@dataclass(frozen=True)
class Piece:
    """One chunk of a request's prompt: a stored chunk (``chunk_id``) or new text (``chunk_id`` None).

    ``span``: only tokens ``span[0]:span[1]`` of the stored chunk (a part of it the client's text holds;
    ``text`` is then that part), None for all of them. ``ids``: new text's token ids as a client's prompt
    holds them (a gap between stored chunks, :mod:`fusionrag.online.client_prompt`), not re-tokenized."""

    chunk_id: int | None
    title: str
    text: str
    source: str = ""
    span: tuple[int, int] | None = None
    ids: tuple[int, ...] | None = None

    def as_passage(self) -> dict[str, str]:
        return {"title": self.title, "text": self.text}


def match_passages(store, prompt: PromptBuilder, passages: Sequence[dict]) -> list[Piece]:
    """The pieces of ``passages`` (``{title, text, source?}``, in order), stored chunks where the store has them.

    ``store`` may be None (a server without a store): every passage is split into new pieces."""
    chunk_tokens = int(store.settings["chunk_tokens"]) if store is not None else DEFAULT_CHUNK_TOKENS
    out: list[Piece] = []
    for p in passages:
        title, text, source = str(p.get("title") or ""), str(p["text"]), str(p.get("source") or "")
        out.extend(_match_one(store, prompt, chunk_tokens, title, text, source))
    return out


def reused_fraction(pieces: Sequence[Piece]) -> float:
    """Share of the pieces whose KV was precomputed (1.0 for no pieces)."""
    return sum(p.chunk_id is not None for p in pieces) / len(pieces) if pieces else 1.0


def _match_one(store, prompt: PromptBuilder, chunk_tokens: int, title: str, text: str,
               source: str) -> list[Piece]:
    whole = [Piece(None, title, text, source)]
    if store is None:
        return whole
    cid = store.find_by_hash(passage_hash(title, text))
    if cid is not None:  # 1. a stored chunk, sent back as it was retrieved
        return [_stored(store, cid, source)]
    split = _split(store, prompt, chunk_tokens, title, text, source)
    if all(p.chunk_id is not None for p in split):
        return split  # 2. the chunker's pieces, all stored
    found = _contained(store, title, text, source)  # 3.
    best = found if found is not None and _stored_chars(found) > _stored_chars(split) else split
    # Nothing stored in it: the passage stays whole, one new chunk (no boundaries its attention would not have)
    return best if _stored_chars(best) else whole


def _stored(store, chunk_id: int, source: str = "") -> Piece:
    rec = store.chunk(chunk_id)
    return Piece(chunk_id, rec.title, rec.text, source or store.source_of(chunk_id))


def _stored_chars(pieces: Sequence[Piece]) -> int:
    return sum(len(p.text) for p in pieces if p.chunk_id is not None)


def _split(store, prompt: PromptBuilder, chunk_tokens: int, title: str, text: str, source: str) -> list[Piece]:
    """The passage cut by the store's chunker; each piece looked up by content hash."""
    return [Piece(store.find_by_hash(c.content_hash), c.title, c.text, source)
            for c in make_chunks(prompt, [Passage(title, text)], chunk_tokens)]


def windows(norm: str, size: int = WINDOW_CHARS, most: int = MAX_WINDOWS) -> list[str]:
    """``norm`` (a normalised text) in consecutive windows of about ``size`` characters (at most ``most``, evenly
    spread over it): an embedding reads a few hundred tokens, so a long text is searched window by window."""
    starts = list(range(0, max(1, len(norm)), size))
    if len(starts) > most:
        starts = [starts[round(i * (len(starts) - 1) / (most - 1))] for i in range(most)] if most > 1 else starts[:1]
    return [norm[a:a + size] for a in starts]


def _candidates(store, norm: str, source: str, searched: Sequence[str]) -> list[int]:
    """Chunks a passage (``norm``, normalised) may contain: those whose text starts in it (an exact lookup), what
    the ``searched`` windows retrieve, the documents of both, and its ``source``'s."""
    hits = [*store.locator.starting_in(norm, MIN_MATCH_CHARS),
            *(store.search_each(searched, CANDIDATE_SEARCH) if searched else [])]
    docs = set(store.documents.using(hits))
    own = sorted(_own_chunks(store, source))  # the passage's own document's chunks are candidates first
    ids = list(dict.fromkeys([*own, *hits, *store.chunk_ids_of_docs(sorted(docs))]))
    return ids[:MAX_CANDIDATES]


def _own_chunks(store, source: str) -> frozenset[int]:
    """The chunks of the document a passage says it comes from (its ``source``: a path, a file name, a URL)."""
    if not source:
        return frozenset()
    path = Path(source)
    names = {source, path.name}
    with contextlib.suppress(OSError, RuntimeError, ValueError):
        names.add(str(path.expanduser().resolve()))
    return frozenset(store.chunk_ids_of_docs(sorted(names)))


def _contained(store, title: str, text: str, source: str) -> list[Piece] | None:
    """Stored chunks, or parts of them, found in the passage's text, in text order, with the text between
    them as new pieces.

    Two rounds: the chunks that start in the text (and their documents' chunks) first, then, only where
    text of :data:`SEARCHED_CHARS` or more is left unmatched, the chunks its windows retrieve by embedding
    (a part of a chunk that starts elsewhere). The second round looks only at chunks the first did not, and
    keeps what the first found: its regions fill what was left. A prompt of whole pasted chunks embeds just
    its question."""
    norm = normalise(text)
    records: dict[int, Any] = {}
    own = _own_chunks(store, source)
    first = _candidates(store, norm, source, [])
    chosen = _regions(store, norm, first, records, own)
    left = [norm[a:b] for a, b in _unmatched(norm, [r for r, _ in chosen]) if b - a >= SEARCHED_CHARS]
    if left:
        seen = set(first)
        more = [c for c in _candidates(store, norm, source, windows(" ".join(left))) if c not in seen]
        taken = [r for r, _ in chosen]
        found = [f for f in _regions(store, norm, more, records, own) if not _overlaps(f[0], taken)] if more else []
        chosen = sorted([*chosen, *found], key=lambda f: f[0].start)
    if not chosen:
        return None
    titles = {normalise(records[r.chunk_id].title).lower() for r, _ in chosen}
    out: list[Piece] = []
    pos = 0
    for region, span in [*chosen, (None, None)]:
        start = region.start if region is not None else len(norm)
        gap = _new_text(text_between(norm, pos, start), titles)
        if gap:
            out.append(Piece(None, title, gap, source))
        if region is not None:
            rec = records[region.chunk_id]
            if span is None:
                out.append(_stored(store, region.chunk_id, source))
            else:
                out.append(Piece(rec.id, rec.title, norm[region.start:region.end], source or
                                 store.source_of(rec.id), span))
            pos = region.end
    return out


def _regions(store, norm: str, candidates: Sequence[int], records: dict[int, Any],
             own: frozenset[int] = frozenset()) -> list[tuple[Region, tuple[int, int] | None]]:
    """Where ``candidates`` occur in ``norm``, each as served (:func:`_served`), in text order, the passage's
    own document's chunks (``own``) before any other's; their records are kept in ``records``."""
    for cid in candidates:
        if cid not in records:
            records[cid] = store.chunk(cid)
    bodies = {cid: _positions(records[cid]) for cid in candidates}
    found = [_served(store.prompt.tokenizer, r, records[r.chunk_id], bodies[r.chunk_id])
             for r in find_regions(norm, [(c, w.body) for c, w in bodies.items()], MIN_MATCH_CHARS, prefer=own)]
    return [f for f in found if f is not None]


def _overlaps(region: Region, taken: Sequence[Region]) -> bool:
    return any(region.start < t.end and t.start < region.end for t in taken)


def _unmatched(norm: str, regions: Sequence[Region]) -> list[tuple[int, int]]:
    """The stretches of ``norm`` no region covers."""
    out, pos = [], 0
    for r in [*regions, None]:
        start = r.start if r is not None else len(norm)
        if start > pos:
            out.append((pos, start))
        pos = max(pos, r.end) if r is not None else pos
    return out


def _positions(rec):
    """A stored chunk's normalised text with where each character is in its prompt text (whole-only chunks,
    whose text NFC changes, get their normalised text and no positions)."""
    prompt_text, body = chunk_text(rec.title, rec.text), rec.text.strip()
    where = positions(prompt_text, len(prompt_text) - len(body) - 2, body)  # the text between "[title] " and "\n\n"
    return where if where is not None else _WholeOnly(normalise(rec.text))


@dataclass(frozen=True)
class _WholeOnly:
    body: str
    origin: tuple[int, ...] = ()


def _served(tokenizer, region: Region, rec, where) -> tuple[Region, tuple[int, int] | None] | None:
    """How a region is served: a whole chunk (span None), or the chunk's whole tokens inside it (the region
    narrowed to what they cover); None when too little of it is whole tokens (its text is computed)."""
    if region.whole:
        return region, None
    if not where.origin:
        return None
    cut = token_span(tokenizer, chunk_text(rec.title, rec.text), rec.token_ids, where, region.at,
                     region.at + len(region))
    if cut is None:
        return None
    first, stop, a, b = cut
    shift = region.start - region.at
    return region.cut(a + shift, b + shift), (first, stop)


def find_in_prompt(store, text: str) -> tuple[list[Piece], str] | None:
    """Stored chunks pasted into a prompt's text, whatever template and separators surround them: the pieces up
    to the last stored chunk found (the stored chunks, and the text before and between them as new pieces) and
    the text after it (the question part, computed whole), or None when no stored chunk occurs in it.

    A pipeline that pastes its retrieved passages into the prompt gets the stored chunks' KV where they
    occur, without sending them as ``documents``."""
    if store is None or len(normalise(text)) < MIN_MATCH_CHARS:
        return None
    found = _contained(store, "", text, "")
    if not found or all(p.chunk_id is None for p in found):
        return None
    last = max(i for i, p in enumerate(found) if p.chunk_id is not None)
    return found[:last + 1], " ".join(p.text for p in found[last + 1:])


def text_between(norm: str, start: int, end: int) -> str:
    return norm[start:end].strip() if end > start else ""


def _new_text(gap: str, titles: set[str]) -> str:
    """``gap`` without what the stored chunks already say: markdown headings ingest made titles of,
    separators and stray punctuation. Empty when nothing with letters or digits is left."""
    if not gap:
        return ""
    words = gap
    for t in sorted(titles, key=len, reverse=True):
        if t:
            words = re.sub(r"#{1,6}\s*" + re.escape(t), " ", words, flags=re.IGNORECASE)
    words = re.sub(r"(^|\s)#{1,6}(?=\s|$)", " ", words)
    words = normalise(words)
    return words if sum(ch.isalnum() for ch in words) >= 3 else ""
