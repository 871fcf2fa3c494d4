"""FusionRAG's chunk-granular prefix cache with the alternative path.

A RAG request is ``(S, [c_0, ..., c_{k-1}])``: a system-prompt hash and the content hashes
of its retrieved chunks, in prompt order. A chunk's cached KV is keyed by the hash of
``(S, c_0, ..., c_{j-1}, c_j)``, i.e. the context it was computed in plus the chunk itself
(chained like vLLM's block hashes, so a key is a fixed-size digest whatever the depth).

A plain prefix cache (vLLM/SGLang's radix cache, one chunk per edge: the baseline of the
paper's simulation in ``studies/prefix_cache``) hits chunk ``j`` only if chunks ``0..j`` are a
cached path and stores every miss under its full prefix: one replica per prefix.
:class:`AlternativePathCache` first takes the same longest exact prefix match; for each
remaining chunk it backs off by dropping earlier chunks, ``(S, c_i..c_j)`` for
``i = 0..j``, down to ``(S, c_j)`` alone. Misses are computed once and stored under
``(S, c_j)``, so every distinct chunk has one replica regardless of order. Reusing a
replica computed in another context is approximate; FusionRAG repairs that with the
offline fused caches and the online sparse recompute, which is why this is sound there
and not in a plain prefix cache.

Values are opaque (e.g. :class:`~fusionrag.kvcache.kv.KV`): only ``value.nbytes`` is read,
so the cache is testable without a model. Misses are produced by a caller-supplied
``compute(system, context, chunk)`` callback; ``context`` is the chunk tuple the value is
meant to be conditioned on (always ``()`` for the alternative path).

The cache runs inside a long-lived server, so everything it keeps is bounded by its entries: the
study's observers (what an unbounded plain cache would hold, every chunk ever seen) subclass it
through the ``_observe_*`` hooks in ``studies/prefix_cache``, never here.
"""

from __future__ import annotations

import copy
import hashlib
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

Source = Literal["prefix", "alt", "computed"]


Compute = Callable[[str, tuple[str, ...], str], Any]
"""``compute(system, context, chunk) -> value`` with ``value.nbytes``."""


def path_key(system: str, path: Sequence[str]) -> bytes:
    """Key of the last chunk of ``path`` computed after ``system + path[:-1]``.

    Chained (each step hashes the previous digest with the next chunk), length-prefixed so
    that different splits of the same characters never collide.
    """
    h = hashlib.blake2b(b"S" + _lp(system), digest_size=16).digest()
    for chunk in path:
        h = hashlib.blake2b(h + _lp(chunk), digest_size=16).digest()
    return h


def _lp(s: str) -> bytes:
    b = s.encode("utf-8")
    return len(b).to_bytes(4, "little") + b


@dataclass
class PrefixCacheStats:
    """Counters of one cache. ``lookups`` counts chunks, ``requests`` counts lookup calls."""

    requests: int = 0
    lookups: int = 0
    prefix_hits: int = 0  # leading chunks matched under their full prefix (what vLLM reuses)
    alt_hits: int = 0  # matched after backing off (dropping earlier chunks)
    recomputations: int = 0  # misses computed
    redundant_recomputations: int = 0  # a replica of (S, content) was cached under another key
    preloaded: int = 0
    evictions: int = 0
    entries: int = 0
    bytes_stored: int = 0
    bytes_reused: int = 0  # bytes served from the cache instead of recomputed
    bytes_computed: int = 0

    @property
    def hits(self) -> int:
        return self.prefix_hits + self.alt_hits

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(hits=self.hits, hit_rate=self.hit_rate)
        return d


@dataclass(frozen=True)
class ChunkResult:
    """One chunk of a looked-up request: where its value came from and in what context.

    ``context`` is the chunk tuple the returned value was computed after (``()`` means
    right after ``S``); it equals the request's own prefix only for prefix hits and for
    the baseline's computed chunks.
    """

    chunk: str
    value: Any
    source: Source
    context: tuple[str, ...]


@dataclass
class LookupResult:
    chunks: list[ChunkResult]

    @property
    def values(self) -> list[Any]:
        return [c.value for c in self.chunks]

    @property
    def sources(self) -> list[Source]:
        return [c.source for c in self.chunks]


@dataclass
class CacheEntry:
    key: Hashable
    system: str
    chunk: str
    context_len: int
    value: Any
    nbytes: int


class ChunkCache:
    """Shared bookkeeping of a chunk cache: statistics, the replica index, the lock; the hooks a study's
    observer overrides (no-ops here, so nothing grows with the stream)."""

    def __init__(self, max_bytes: int | None = None) -> None:
        if max_bytes is not None and max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        self.max_bytes = max_bytes
        self._stats = self._new_stats()
        self._replicas: Counter[tuple[str, str]] = Counter()  # (S, chunk) -> cached entries ending in it
        self._lock = threading.RLock()

    def _new_stats(self) -> PrefixCacheStats:
        return PrefixCacheStats()

    # -- public -------------------------------------------------------------------------
    def stats(self) -> PrefixCacheStats:
        with self._lock:
            return copy.copy(self._stats)

    @property
    def nbytes(self) -> int:
        return self._stats.bytes_stored

    def __len__(self) -> int:
        return self._stats.entries

    # -- hooks: a study's observer overrides them (called under the lock) ---------------------
    def _observe_path(self, system: str, path: Sequence[str], nbytes: int) -> None:
        """``path[-1]`` was served, computed or preloaded after ``system + path[:-1]``."""

    def _observe_chunk(self, system: str, chunk: str, computed: bool) -> None:
        """``(system, chunk)`` was computed (``computed``) or preloaded, before it is counted or stored."""

    # -- helpers for subclasses -----------------------------------------------------------
    def _count_computed(self, system: str, chunk: str, nbytes: int) -> None:
        s = self._stats
        s.recomputations += 1
        s.bytes_computed += nbytes
        if self._replicas.get((system, chunk), 0) > 0:
            s.redundant_recomputations += 1
        self._observe_chunk(system, chunk, computed=True)

    def _added(self, e: CacheEntry) -> None:
        self._replicas[(e.system, e.chunk)] += 1
        self._stats.entries += 1
        self._stats.bytes_stored += e.nbytes

    def _removed(self, e: CacheEntry) -> None:
        r = (e.system, e.chunk)
        self._replicas[r] -= 1
        if self._replicas[r] <= 0:
            del self._replicas[r]
        self._stats.entries -= 1
        self._stats.bytes_stored -= e.nbytes
        self._stats.evictions += 1

    def _fits_at_all(self, nbytes: int) -> bool:
        return self.max_bytes is None or nbytes <= self.max_bytes


def value_nbytes(value: Any) -> int:
    n = int(value.nbytes)
    if n < 0:
        raise ValueError("value.nbytes must be >= 0")
    return n


class AlternativePathCache(ChunkCache):
    """Prefix cache with FusionRAG's alternative path: one replica per distinct chunk.

    A flat LRU map from path keys to entries (entries at depth > 1 can only come from
    :meth:`insert`, e.g. caches produced by a full prefill; online misses go to depth 1).
    Eviction is plain LRU by bytes: entries do not depend on each other, unlike a trie.
    """

    def __init__(self, max_bytes: int | None = None) -> None:
        super().__init__(max_bytes)
        self._entries: OrderedDict[bytes, CacheEntry] = OrderedDict()

    def insert(self, system: str, path: Sequence[str], value: Any) -> bool:
        """Store ``value`` as the KV of ``path[-1]`` computed after ``system + path[:-1]``.

        Used to preload the knowledge base's caches (``path=[chunk]``). Returns whether it
        was stored (an entry larger than the whole budget is not).
        """
        if not path:
            raise ValueError("path must name at least the chunk itself")
        path = tuple(path)
        with self._lock:
            self._stats.preloaded += 1
            self._observe_chunk(system, path[-1], computed=False)
            self._observe_path(system, path, value_nbytes(value))
            return self._put(system, path, value)

    def peek(self, system: str, chunks: Sequence[str]) -> list[Source | None]:
        """Where each chunk would come from, without computing, inserting or counting.

        ``None`` marks a miss. Chunks repeated within the request are reported as the
        lookup would serve them (the second occurrence hits the first one's replica).
        """
        with self._lock:
            pending: set[bytes] = set()
            out: list[Source | None] = []
            prefix_ok = True
            for j, chunk in enumerate(chunks):
                src, _ = self._match(system, chunks, j, prefix_ok, extra=pending)
                if src != "prefix":
                    prefix_ok = False
                if src is None:
                    pending.add(path_key(system, (chunk,)))
                out.append(src)
            return out

    def lookup(self, system: str, chunks: Sequence[str], compute: Compute) -> LookupResult:
        """Serve each chunk from the longest prefix, then the alternative path, else compute.

        Chunks are processed in order and misses are inserted as they are computed, so a
        chunk repeated within one request is computed once. ``compute`` runs outside the
        lock; two concurrent requests missing the same new chunk may both compute it (the
        second insert replaces the first and is counted as a redundant recomputation).
        """
        chunks = tuple(chunks)
        results: list[ChunkResult] = []
        with self._lock:
            self._stats.requests += 1
        prefix_ok = True
        for j, chunk in enumerate(chunks):
            with self._lock:
                self._stats.lookups += 1
                src, entry = self._match(system, chunks, j, prefix_ok)
                if src != "prefix":
                    prefix_ok = False
                if entry is not None:
                    self._entries.move_to_end(entry.key)  # type: ignore[arg-type]
                    if src == "prefix":
                        self._stats.prefix_hits += 1
                    else:
                        self._stats.alt_hits += 1
                    self._stats.bytes_reused += entry.nbytes
                    self._observe_path(system, chunks[: j + 1], entry.nbytes)
                    ctx = chunks[j - entry.context_len : j]
                    results.append(ChunkResult(chunk, entry.value, src, ctx))  # type: ignore[arg-type]
                    continue
            value = compute(system, (), chunk)
            nbytes = value_nbytes(value)
            with self._lock:
                self._count_computed(system, chunk, nbytes)
                self._observe_path(system, chunks[: j + 1], nbytes)
                self._put(system, (chunk,), value)
            results.append(ChunkResult(chunk, value, "computed", ()))
        return LookupResult(results)

    # -- internals ------------------------------------------------------------------------
    def _match(
        self, system: str, chunks: Sequence[str], j: int, prefix_ok: bool, extra: set[bytes] | None = None
    ) -> tuple[Source | None, CacheEntry | None]:
        """Longest context first: the full prefix (a prefix hit while the run is unbroken),
        then drop earlier chunks one at a time down to ``(S, c_j)``."""
        for i in range(j + 1):
            key = path_key(system, chunks[i : j + 1])
            entry = self._entries.get(key)
            if entry is not None or (extra is not None and key in extra):
                return ("prefix" if (i == 0 and prefix_ok) else "alt"), entry
        return None, None

    def _put(self, system: str, path: tuple[str, ...], value: Any) -> bool:
        nbytes = value_nbytes(value)
        key = path_key(system, path)
        old = self._entries.pop(key, None)
        if old is not None:
            self._removed(old)
            self._stats.evictions -= 1  # a replacement, not an eviction
        if not self._fits_at_all(nbytes):
            return False
        if self.max_bytes is not None:
            while self._entries and self._stats.bytes_stored + nbytes > self.max_bytes:
                _, victim = self._entries.popitem(last=False)
                self._removed(victim)
        e = CacheEntry(key, system, path[-1], len(path) - 1, value, nbytes)
        self._entries[key] = e
        self._added(e)
        return True
