"""Where a store's chunks are in a prompt's token ids: the scheduler side's whole job, without vLLM.

A prompt built the way fusionrag builds them (:class:`~fusionrag.prompt.PromptBuilder`) is ``S`` followed
by chunks, each tokenised as the store tokenised it, then the question. :class:`ChunkMatcher` checks that
the ids start with the store's ``S``, then walks the chunks that follow one after the other: at each
point it looks the next :data:`KEY_TOKENS` ids up in an index of every chunk's first ids and confirms a
candidate by comparing all of its ids (the longest first). It stops at the first passage it does not
hold (that text and everything after it is prefilled by vLLM, over the reused context before it). Only
chunks whose KV the store holds are taken (the kind the method reads: ``plain-first`` reads the first
chunk's plain KV and the others' fused KV, falling back to plain as the engine does).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

#: Ids of a chunk's start that index it (long enough to be nearly unique, short enough for short chunks).
KEY_TOKENS = 8


@dataclass(frozen=True)
class ChunkSpan:
    """One stored chunk found in the prompt: its id, the KV kind to read, and its token positions."""

    chunk_id: int
    kind: str
    start: int
    stop: int


@dataclass(frozen=True)
class ContextMatch:
    """``S`` and the stored chunks right after it, in prompt order; ``end``: the position after the last."""

    system_len: int
    chunks: tuple[ChunkSpan, ...]

    @property
    def end(self) -> int:
        return self.chunks[-1].stop if self.chunks else self.system_len

    @property
    def context_tokens(self) -> int:
        return self.end - self.system_len


class ChunkMatcher:
    """Finds ``S`` and the stored chunks at the start of a prompt (see the module doc).

    ``chunks``: ``(chunk_id, token_ids)`` of every stored chunk; ``has_kv(chunk_id, kind)``: whether the
    store holds that entry (checked when a chunk is matched, so entries written later are seen)."""

    def __init__(self, system_ids: Sequence[int], chunks: Iterable[tuple[int, Sequence[int]]],
                 has_kv: Callable[[int, str], bool], kind: str = "plain-first") -> None:
        self.system_ids = tuple(int(t) for t in system_ids)
        self.has_kv = has_kv
        self.kind = kind
        self._ids: dict[int, tuple[int, ...]] = {}
        self._index: dict[tuple[int, ...], list[int]] = defaultdict(list)
        for chunk_id, ids in chunks:
            self.add(chunk_id, ids)

    @classmethod
    def from_store(cls, store: Any, kind: str = "plain-first") -> ChunkMatcher:
        """Every chunk of a :class:`~fusionrag.retrieval.knowledge.KnowledgeStore` and its ``S``."""
        return cls(store.prompt.system_token_ids, ((c, store.chunk(c).token_ids) for c in store.chunk_ids()),
                   store.has_kv, kind)

    def add(self, chunk_id: int, token_ids: Sequence[int]) -> None:
        ids = tuple(int(t) for t in token_ids)
        if not ids:
            return
        self._ids[int(chunk_id)] = ids
        bucket = self._index[ids[:KEY_TOKENS]]
        bucket.append(int(chunk_id))
        bucket.sort(key=lambda c: -len(self._ids[c]))  # the longest candidate first

    def __len__(self) -> int:
        return len(self._ids)

    def match(self, ids: Sequence[int]) -> ContextMatch | None:
        """``S`` and the stored chunks that follow it in ``ids``, or None when ``ids`` do not start with ``S``."""
        s = len(self.system_ids)
        if len(ids) < s or tuple(ids[:s]) != self.system_ids:
            return None
        spans: list[ChunkSpan] = []
        pos = s
        while True:
            found = self._chunk_at(ids, pos, first=not spans)
            if found is None:
                break
            chunk_id, kind = found
            stop = pos + len(self._ids[chunk_id])
            spans.append(ChunkSpan(chunk_id, kind, pos, stop))
            pos = stop
        return ContextMatch(s, tuple(spans))

    def _chunk_at(self, ids: Sequence[int], pos: int, first: bool) -> tuple[int, str] | None:
        for chunk_id in self._index.get(tuple(ids[pos:pos + KEY_TOKENS]), ()):
            chunk = self._ids[chunk_id]
            if tuple(ids[pos:pos + len(chunk)]) != chunk:
                continue
            kind = self._kind_of(chunk_id, first)
            if kind is not None:
                return chunk_id, kind
        return None

    def _kind_of(self, chunk_id: int, first: bool) -> str | None:
        """The entry this chunk reads (the engine's rule: ``plain-first`` falls back to plain, fused to
        plain), or None when the store holds neither."""
        wanted = ("plain" if first else "fused") if self.kind == "plain-first" else self.kind
        for kind in dict.fromkeys((wanted, "fused" if wanted == "plain" else "plain")):
            if kind == "fused" and wanted == "plain" and self.kind != "plain-first":
                continue  # a plain method never reads fused KV
            if self.has_kv(chunk_id, kind):
                return kind
        return None
