"""The whole-context cache: a prompt's context KV, kept after its prefill, for the next question on it.

A repeated context (the same ``S`` and the same chunks in the same order, a new question: a
follow-up turn, a second question over the same documents) is where the exact engines are at their
best: vLLM's prefix cache answers it by prefilling only the question. This cache gives fusionrag the
same: after a request's prefill its context KV (``S`` + chunks, positions ``0..T-1``, the selected
tokens already recomputed) is kept under the exact token ids of that context and how it was
computed (method, ratio, KV kind, compute dtype), and a later request with the same context
prefills only its question over it (decision 052).

What a hit reuses is the context *as the first request computed it*: for ``full`` that is exactly
Full Attention's; for FusionRAG it is the context with the first question's critical tokens
recomputed, which the new question reads as it would read Full Reuse of those refreshed caches.
A ``full`` entry serves any method (it is the better KV for the same work). Chunk-level prefix
reuse (a context that shares only its first chunks) is the alternative-path prefix cache's job
(:mod:`fusionrag.kvcache.prefix_cache`), not this one's.

Values are opaque to the cache (``value.nbytes`` is read; the engine stores :class:`CachedContext`), keys
are bytes, so the structure is testable alone.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from fusionrag.kvcache.kv import KV


def context_key(token_ids: Sequence[int], how: str) -> bytes:
    """The key of a context: its exact token ids (``S`` + chunks) and how its KV was computed (``how``)."""
    h = hashlib.blake2b(digest_size=20)
    h.update(how.encode("utf-8") + b"\0")
    h.update(b"".join(int(t).to_bytes(4, "little", signed=False) for t in token_ids))
    return h.digest()


def context_keys(cache: ContextCache, system_ids: Sequence[int], chunk_token_ids: Sequence[Sequence[int]],
                 method: str, ratio: str, kv_kind: str, dtype: torch.dtype) -> list[bytes]:
    """A context's keys, best first: computed as this request would compute it, then by Full Attention (the
    better KV for the same work, so it serves any method); none when the cache is off or there are no chunks.
    ``ratio`` as :func:`fusionrag.online.auto_ratio.ratio_key` writes it (``0.150000``, or ``auto`` and its
    settings)."""
    if not cache.max_bytes or not chunk_token_ids:
        return []
    ids = [*system_ids, *(t for c in chunk_token_ids for t in c)]
    name = str(dtype).removeprefix("torch.")
    how = [f"{method}|{ratio}|{kv_kind}|{name}", f"full|1.000000|none|{name}"]
    return [context_key(ids, h) for h in dict.fromkeys(how)]


@dataclass(frozen=True)
class CachedContext:
    """A request's context KV (``S`` + chunks, positions ``0..T-1``) as its prefill left it, its token ids and
    chunk spans. A view of the request's prompt KV, never written: a later prefill copies it into its own
    buffer, and decoding appends elsewhere."""

    kv: KV
    ids: torch.Tensor
    spans: list[tuple[int, int]]

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes

    @classmethod
    def of(cls, prompt_kv: KV, system_ids: Sequence[int], chunk_token_ids: Sequence[Sequence[int]],
           spans: Sequence[tuple[int, int]]) -> CachedContext:
        """The context part of a prompt's KV (its first ``len(S) + chunk tokens`` slots, as a view)."""
        ids = torch.tensor([*system_ids, *(t for c in chunk_token_ids for t in c)], dtype=torch.long)
        n = ids.numel()
        return cls(KV(prompt_kv.keys[:, :, :n], prompt_kv.values[:, :, :n], 0), ids, list(spans))


@dataclass
class ContextCacheStats:
    """Counters of one cache (requests that looked it up; bytes held now)."""

    lookups: int = 0
    hits: int = 0
    stores: int = 0
    evictions: int = 0
    invalidations: int = 0
    entries: int = 0
    bytes_stored: int = 0
    max_bytes: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass(frozen=True)
class _Entry:
    value: Any
    chunk_ids: frozenset[int]
    nbytes: int


class ContextCache:
    """A byte-bounded LRU of whole-context KVs (see the module doc); thread-safe; ``max_bytes`` 0: off."""

    def __init__(self, max_bytes: int = 0) -> None:
        self.max_bytes = max(0, int(max_bytes))
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        self._stats = ContextCacheStats(max_bytes=self.max_bytes)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._stats.bytes_stored

    def get(self, keys: Sequence[bytes]) -> Any | None:
        """The value of the first of ``keys`` held (most recently used from now on), or None."""
        with self._lock:
            self._stats.lookups += 1
            for key in keys:
                entry = self._entries.get(key)
                if entry is not None:
                    self._entries.move_to_end(key)
                    self._stats.hits += 1
                    return entry.value
            return None

    def put(self, key: bytes, value: Any, chunk_ids: Iterable[int | None] = ()) -> bool:
        """Keep ``value`` (its ``nbytes``) under ``key``, evicting the least recently used entries to fit;
        ``chunk_ids``: the stored chunks it was computed from (:meth:`invalidate`). False if it cannot fit."""
        size = int(value.nbytes)
        if size > self.max_bytes:
            return False
        with self._lock:
            self._remove(key)
            while self._entries and self._stats.bytes_stored + size > self.max_bytes:
                self._remove(next(iter(self._entries)))
                self._stats.evictions += 1
            self._entries[key] = _Entry(value, frozenset(c for c in chunk_ids if c is not None), size)
            self._stats.bytes_stored += size
            self._stats.stores += 1
            self._stats.entries = len(self._entries)
            return True

    def invalidate(self, chunk_ids: Iterable[int] | None) -> int:
        """Drop the entries computed from any of ``chunk_ids`` (None: every entry); how many were dropped."""
        with self._lock:
            if chunk_ids is None:
                gone = list(self._entries)
            else:
                changed = set(chunk_ids)
                gone = [k for k, e in self._entries.items() if e.chunk_ids & changed]
            for key in gone:
                self._remove(key)
            self._stats.invalidations += len(gone)
            return len(gone)

    def stats(self) -> ContextCacheStats:
        with self._lock:
            return ContextCacheStats(**asdict(self._stats))

    def _remove(self, key: bytes) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._stats.bytes_stored -= entry.nbytes
        self._stats.entries = len(self._entries)
