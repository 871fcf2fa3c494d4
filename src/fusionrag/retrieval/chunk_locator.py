"""Where a store's chunks are: the one chunk locator, owned by the store, kept current with its generation.

Two questions are asked of a store's chunks while serving, and both are answered here, from one index
that follows the store:

- *In a prompt's token ids* (:meth:`ChunkLocator.match`): a client's own prompt in fusionrag's engine
  (:mod:`fusionrag.online.client_prompt`) and every prompt in the vLLM connector's scheduler
  (:mod:`fusionrag.vllm.planning`) keep their token ids; the stored chunks found in them are served from KV
  and the ids between them recomputed (:mod:`.token_matching`).
- *At a word start of a passage's text* (:meth:`ChunkLocator.starting_in`): passages a client sends as
  ``documents`` are matched onto stored chunks by text (:mod:`.matching`), whitespace aside; a short chunk
  inside a long passage is rarely among its embedding's nearest chunks, so every chunk is also indexed by the
  first :data:`~fusionrag.retrieval.overlaps.ANCHOR_CHARS` characters of its normalised text.

The index is built on first use and then updated, not rebuilt: when the store's generation moves (this
process wrote, or :meth:`~fusionrag.retrieval.knowledge.KnowledgeStore.refresh` saw another process write),
the chunks whose ``(id, content hash)`` changed are removed and added, read from the store one by one.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from fusionrag.retrieval.overlaps import ANCHOR_CHARS, normalise, word_starts
from fusionrag.retrieval.token_matching import ChunkMatcher, ContextMatch


class TextStarts:
    """Chunks by the start of their normalised text (its first ``ANCHOR_CHARS`` characters, all of it when
    shorter), with each text's length (a caller sets how short a chunk it matches)."""

    def __init__(self) -> None:
        self._by_start: dict[str, list[int]] = {}
        self._start_of: dict[int, tuple[str, int]] = {}

    def add(self, chunk_id: int, text: str) -> None:
        body = normalise(text)
        start = body[:ANCHOR_CHARS]
        self._start_of[chunk_id] = (start, len(body))
        self._by_start.setdefault(start, []).append(chunk_id)

    def remove(self, chunk_id: int) -> None:
        start, _ = self._start_of.pop(chunk_id, ("", 0))
        held = self._by_start.get(start)
        if held is not None and chunk_id in held:
            held.remove(chunk_id)
            if not held:
                del self._by_start[start]

    def starting_in(self, norm: str, min_chars: int) -> list[int]:
        """Chunks of at least ``min_chars`` normalised characters whose start occurs at a word start of ``norm``
        (a normalised text), in text order."""
        lengths = sorted({len(k) for k in self._by_start}, reverse=True)
        found: dict[int, None] = {}
        for i in word_starts(norm):
            for n in lengths:
                for cid in self._by_start.get(norm[i:i + n], ()):
                    if self._start_of[cid][1] >= min_chars:
                        found[cid] = None
        return list(found)


class ChunkLocator:
    """The store's chunks by token-id anchors and by text start (module doc); one per open store."""

    def __init__(self, store: Any) -> None:
        """``store``: a :class:`~fusionrag.retrieval.knowledge.KnowledgeStore` (its chunks, KV and ``S``)."""
        self._store = store
        self._lock = threading.Lock()
        self._generation: int | None = None
        self._known: dict[int, str] = {}  # chunk id -> content hash, as indexed
        self._ids = ChunkMatcher(store.prompt.system_token_ids, (), store.has_kv, kind="plain-first",
                                 title_ids=self._title_ids)
        self._text = TextStarts()
        self.updates = 0  #: how many times the index followed a store change (tests count)

    def match(self, ids: Sequence[int], kind: str) -> ContextMatch:
        """``S`` and the stored chunks in a prompt's ids, each with the entry a ``kind`` request reads."""
        with self._lock:
            self._follow()
            return self._ids.match(ids, kind)

    def starting_in(self, norm: str, min_chars: int) -> list[int]:
        """Stored chunks (of ``min_chars`` or more) whose text starts at a word start of ``norm`` (normalised)."""
        with self._lock:
            self._follow()
            return self._text.starting_in(norm, min_chars)

    def __len__(self) -> int:
        with self._lock:
            self._follow()
            return len(self._known)

    def _follow(self) -> None:
        """Bring the index to the store's generation: remove what went or changed, add what came."""
        generation = self._store.seen_generation
        if generation == self._generation:
            return
        current = self._store.chunks.hashes()
        for cid, digest in self._known.items():
            if current.get(cid) != digest:
                self._ids.remove(cid)
                self._text.remove(cid)
        for cid, digest in current.items():
            if self._known.get(cid) != digest:
                rec = self._store.chunk(cid)
                self._ids.add(cid, rec.token_ids)
                self._text.add(cid, rec.text)
        self._known, self._generation = current, generation
        self.updates += 1

    def _title_ids(self, chunk_id: int) -> int:
        """How many ids a chunk's ``[title]`` takes (asked only for short chunks, whose framing may differ)."""
        title = (self._store.chunk(chunk_id).title or "").strip()
        return len(self._store.prompt.encode(f"[{title}]")) if title else 0
