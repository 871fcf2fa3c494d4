"""The load stage: a request's chunks as KV entries, stored ones verified, the rest computed once.

Stored entries come through the engine's :class:`~fusionrag.kvcache.sources.KVSource` (verified on
read; one that fails verification is answered around with freshly computed plain KV and reported
once); passages the store does not hold get a plain ``S + chunk`` KV through the engine's
alternative-path prefix cache, so each distinct passage is computed once whatever its position.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from fusionrag.errors import CacheIntegrityError
from fusionrag.execution.segments import chunk_kv_plain
from fusionrag.kvcache.kv import KV
from fusionrag.kvcache.sources import Key
from fusionrag.kvcache.store import KVEntry
from fusionrag.prompt import passage_hash
from fusionrag.retrieval.kv_kinds import requested_kinds, served_kind

log = logging.getLogger(__name__)

#: The metadata key of a passage's entry that says where its KV came from (``prefix_cache`` or ``computed``).
ORIGIN = "origin"


def _none(chunk_id: int, kind: str) -> bool:
    """No store: no stored entry."""
    return False


class ChunkKVLoader:
    """Reads a request's chunk KV for one engine (its store, KV source, prefix cache, model and ``S``)."""

    def __init__(self, engine: Any) -> None:
        """``engine``: the :class:`~fusionrag.online.engine.Engine` it loads for (its parts are read when
        used, so a replaced KV source or a recomputed ``S`` is what the next request sees)."""
        self.engine = engine
        self.damaged: set[Key] = set()  # stored entries that failed verification (answered around, not repaired)

    def kinds_for(self, chunk_ids: Sequence[int | None], kind: str) -> list[str]:
        """The stored entry each chunk asks for (:func:`~fusionrag.retrieval.kv_kinds.requested_kinds`, the one
        rule of both engines)."""
        return requested_kinds(self.engine.store.has_kv if self.engine.store is not None else _none,
                               chunk_ids, kind)

    def stored_key(self, chunk_id: int | None, kind: str) -> Key | None:
        """The entry a chunk asking for ``kind`` reads (a fused one falls back to plain), or None: computed. An
        entry that is there but not a regular file is named once and not read."""
        if chunk_id is None:
            return None
        served = served_kind(self.engine.store.has_kv, chunk_id, kind, first=False)
        if served != kind and (chunk_id, kind) not in self.damaged and self.engine.store.kv.present(chunk_id, kind):
            self.damaged.add((chunk_id, kind))  # a link, FIFO or device where an entry belongs: named, not read
            log.error("stored %s KV of chunk %s (%s) is not a regular file (a link, FIFO or device); not read, "
                      "computing it for this request. Run 'fusionrag store verify --repair'.", kind, chunk_id,
                      self.engine.store.kv_path(chunk_id, kind))
        return (chunk_id, served) if served is not None else None

    def load(self, chunk_ids: Sequence[int | None], passages: Sequence[dict], token_ids: Sequence[list[int]],
              kind: str, spans: Sequence[tuple[int, int] | None] | None = None,
              fresh: bool = False, zero: Sequence[int] = ()) -> tuple[list[KVEntry], int]:
        """One entry per chunk: stored ones from the KV source, the rest through the prefix cache (``fresh``:
        computed, the cache not read). ``spans``: where a piece is part of its stored chunk, its tokens of it
        (the entry is cut to them). ``zero``: pieces whose KV the prefill computes anyway (a client's own tokens
        between stored chunks): zeros, not computed twice."""
        spans = list(spans) if spans is not None else [None] * len(chunk_ids)
        kinds = self.kinds_for(chunk_ids, kind)
        keys = [self.stored_key(cid, k) for cid, k in zip(chunk_ids, kinds, strict=True)]
        stored = [k for k in keys if k is not None]
        loaded = self.read_stored(stored)
        keys = [k if k is None or k in loaded else None for k in keys]  # damaged entries: computed like new passages
        zeroed = set(zero)
        missing = [(passage_hash(p.get("title", ""), p["text"]), ids)
                   for i, (key, p, ids) in enumerate(zip(keys, passages, token_ids, strict=True))
                   if key is None and i not in zeroed]
        adhoc = iter(self.adhoc_kvs(missing, fresh))
        entries, fallbacks = [], 0
        for i, (key, k, span) in enumerate(zip(keys, kinds, spans, strict=True)):
            if key is not None:
                entries.append(loaded[key] if span is None else part_of(loaded[key], span))
            elif i in zeroed:
                shape = self.engine.lm.adapter.empty_kv_shape(self.engine.lm.num_layers)
                blank = torch.zeros(*shape[:2], len(token_ids[i]), shape[3])
                entries.append(KVEntry(KV(blank, blank.clone(), 0), None, {ORIGIN: "computed"}))
            else:
                kv, origin = next(adhoc)
                entries.append(KVEntry(kv, None, {ORIGIN: origin}))
            fallbacks += k == "fused" and (key is None or key[1] != "fused")
        return entries, fallbacks

    def read_stored(self, keys: list[Key]) -> dict[Key, KVEntry]:
        """Stored entries by key; one that fails verification is left out (and reported once), so the
        request is answered from freshly computed plain KV instead of failing."""
        try:  # dequantized(): a no-op, unless a source handed out int8 codes (none of the engine's does)
            return {k: e.dequantized() for k, e in zip(keys, self.engine.kv_source.get_many(keys), strict=True)}
        except CacheIntegrityError:
            pass
        out: dict[Key, KVEntry] = {}
        for key in keys:
            try:
                out[key] = self.engine.kv_source.get_many([key])[0].dequantized()
            except CacheIntegrityError as exc:
                if key not in self.damaged:
                    log.error("stored %s KV of chunk %s failed verification (%s); computing it for this request. "
                              "Run 'fusionrag store verify --repair'.", key[1], key[0], exc)
                self.damaged.add(key)
        return out

    def cachecraft_scores(self, chunk_ids: Sequence[int | None], entries: Sequence[KVEntry],
                           kind: str, spans: Sequence[tuple[int, int] | None] | None = None,
                           ) -> list[torch.Tensor | None]:
        """Cache-Craft's scores are recorded with the fused entries: the ones just loaded when the
        method runs on fused KV, otherwise read through the same source (so a memory tier serves them)."""
        if kind == "fused":
            return [e.scores for e in entries]
        spans = list(spans) if spans is not None else [None] * len(chunk_ids)
        keys = [(c, "fused") for c in chunk_ids if c is not None and self.engine.store.has_kv(c, "fused")]
        fused = self.read_stored(keys)
        return [part_of(fused[(c, "fused")], span).scores if (c, "fused") in fused else None
                for c, span in zip(chunk_ids, spans, strict=True)]

    def adhoc_kvs(self, items: list[tuple[str, list[int]]], fresh: bool = False) -> list[tuple[KV, str]]:
        """Plain KVs of passages the store does not hold (by content hash, in order), through the
        alternative-path prefix cache, each with where it came from: ``prefix_cache`` (computed by an
        earlier request) or ``computed`` (by this one; every one with ``fresh``)."""
        if not items:
            return []
        ids_of = dict(items)
        if fresh:
            return [(chunk_kv_plain(self.engine.lm, self.engine.system_kv, ids), "computed") for _, ids in items]
        result = self.engine.prefix_cache.lookup(
            self.engine.prompt.system_hash, [h for h, _ in items],
            lambda _system, _context, chunk: chunk_kv_plain(self.engine.lm, self.engine.system_kv, ids_of[chunk]))
        return [(c.value, "computed" if c.source == "computed" else "prefix_cache") for c in result.chunks]


def part_of(entry: KVEntry, span: tuple[int, int] | None) -> KVEntry:
    """Tokens ``span[0]:span[1]`` of a stored entry (its KV at their stored positions, and their scores): a
    part of a chunk a client's text holds (:attr:`fusionrag.retrieval.matching.Piece.span`)."""
    if span is None:
        return entry
    a, b = span
    scores = entry.scores
    if scores is not None and scores.shape[-1] == len(entry.kv):
        scores = scores[..., a:b]
    return KVEntry(entry.kv.slice(a, b), scores, entry.metadata)
