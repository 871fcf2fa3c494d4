"""The caches of the paper's prefix-cache simulation: the plain radix baseline and the observer.

- :class:`Observed` counts what a study asks beyond the serving cache's statistics: recomputations of
  chunks seen before (maybe evicted since) and what an unbounded plain prefix cache would hold for the
  same stream (``plain_prefix_bytes``, so ``bytes_saved`` is reported by either structure alone). Both
  grow with every distinct chunk and path: a study's instrument, never in the server's cache.
- :class:`RadixPrefixCache`: the plain chunk-granular prefix cache (vLLM/SGLang), a trie over chunk
  hashes, one chunk per edge: chunk ``j`` hits only if chunks ``0..j`` are a cached path, and every
  miss is stored under its full prefix, so the same chunk retrieved in another order is recomputed and
  stored again.
- :class:`ObservedAlternativePathCache`: the package's :class:`AlternativePathCache`, observed.

Keys, result types and the alternative path's logic are the package's (``fusionrag.kvcache.prefix_cache``).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from fusionrag.kvcache.prefix_cache import (
    AlternativePathCache,
    CacheEntry,
    ChunkCache,
    ChunkResult,
    Compute,
    LookupResult,
    PrefixCacheStats,
    Source,
    path_key,
    value_nbytes,
)


@dataclass
class StudyStats(PrefixCacheStats):
    repeat_recomputations: int = 0  # (S, content) had been computed or preloaded before (maybe evicted since)
    plain_prefix_bytes: int = 0  # what an unbounded plain prefix cache would hold for the same stream

    @property
    def bytes_saved(self) -> int:
        """Bytes not stored compared with an unbounded plain prefix cache on the same stream."""
        return self.plain_prefix_bytes - self.bytes_stored

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(hits=self.hits, hit_rate=self.hit_rate, bytes_saved=self.bytes_saved)
        return d


class Observed:
    """Mixin over a :class:`ChunkCache`: the every-chunk-ever set and the plain-prefix shadow."""

    _stats: StudyStats

    def __init__(self, max_bytes: int | None = None) -> None:
        self._ever: set[tuple[str, str]] = set()  # (S, chunk) ever computed or preloaded
        self._plain: dict[bytes, int] = {}  # full-prefix keys seen -> nbytes: an unbounded plain cache
        super().__init__(max_bytes)  # type: ignore[call-arg]

    def _new_stats(self) -> StudyStats:
        return StudyStats()

    def _observe_path(self, system: str, path: Sequence[str], nbytes: int) -> None:
        key = path_key(system, path)
        if key not in self._plain:
            self._plain[key] = nbytes
            self._stats.plain_prefix_bytes += nbytes

    def _observe_chunk(self, system: str, chunk: str, computed: bool) -> None:
        if computed and (system, chunk) in self._ever:
            self._stats.repeat_recomputations += 1
        self._ever.add((system, chunk))


class ObservedAlternativePathCache(Observed, AlternativePathCache):
    """The serving cache with the study's counters."""


@dataclass(eq=False)
class _Node:
    """A trie node: the KV of ``chunk`` after its ancestors' chunks (the root holds none)."""

    chunk: str
    parent: _Node | None
    entry: CacheEntry | None = None
    children: dict[str, _Node] = field(default_factory=dict)
    last_access: int = 0

    def __lt__(self, other: _Node) -> bool:  # heap order for eviction: least recently used first
        return self.last_access < other.last_access


class RadixPrefixCache(Observed, ChunkCache):
    """The baseline: a trie over chunk hashes, one tree per system prompt (SGLang-style), observed.

    A node exists only if its whole path does, so a lookup walks down until the first
    missing chunk and computes everything after it, each under its full prefix. Eviction
    removes least-recently-used leaves (interior nodes are needed by their descendants),
    never a node on the path of the request being served.
    """

    def __init__(self, max_bytes: int | None = None) -> None:
        super().__init__(max_bytes)
        self._roots: dict[str, _Node] = {}
        self._tick = 0

    def insert(self, system: str, path: Sequence[str], value: Any) -> bool:
        """Store ``value`` as the KV of ``path[-1]`` after ``system + path[:-1]``.

        The parent path must already be cached (a trie has no holes).
        """
        if not path:
            raise ValueError("path must name at least the chunk itself")
        path = tuple(path)
        with self._lock:
            parent = self._walk(system, path[:-1])
            if parent is None:
                raise KeyError("parent path is not cached")
            self._stats.preloaded += 1
            self._observe_chunk(system, path[-1], computed=False)
            self._observe_path(system, path, value_nbytes(value))
            return self._add_child(system, parent, path, value, protected=set()) is not None

    def peek(self, system: str, chunks: Sequence[str]) -> list[Source | None]:
        """``"prefix"`` for the leading cached path, ``None`` for the rest; no side effects."""
        with self._lock:
            node = self._roots.get(system)
            out: list[Source | None] = []
            for chunk in chunks:
                node = node.children.get(chunk) if node is not None else None
                out.append("prefix" if node is not None else None)
            return out

    def lookup(self, system: str, chunks: Sequence[str], compute: Compute) -> LookupResult:
        """Longest cached path, then compute and insert every remaining chunk under its prefix."""
        chunks = tuple(chunks)
        results: list[ChunkResult] = []
        with self._lock:
            self._stats.requests += 1
            node: _Node | None = self._root(system)
            on_path: set[int] = {id(node)}
        matching = True
        for j, chunk in enumerate(chunks):
            with self._lock:
                self._stats.lookups += 1
                child = node.children.get(chunk) if (matching and node is not None) else None
                if child is not None and child.entry is not None:
                    self._touch(child)
                    on_path.add(id(child))
                    self._stats.prefix_hits += 1
                    self._stats.bytes_reused += child.entry.nbytes
                    self._observe_path(system, chunks[: j + 1], child.entry.nbytes)
                    results.append(ChunkResult(chunk, child.entry.value, "prefix", chunks[:j]))
                    node = child
                    continue
                matching = False
            value = compute(system, chunks[:j], chunk)
            nbytes = value_nbytes(value)
            with self._lock:
                self._count_computed(system, chunk, nbytes)
                self._observe_path(system, chunks[: j + 1], nbytes)
                if node is not None and self._attached(node):
                    node = self._add_child(system, node, chunks[: j + 1], value, protected=on_path)
                    if node is not None:
                        on_path.add(id(node))
                else:
                    node = None  # the path could not be kept; later chunks are computed uncached
            results.append(ChunkResult(chunk, value, "computed", chunks[:j]))
        return LookupResult(results)

    # -- internals ------------------------------------------------------------------------
    def _root(self, system: str) -> _Node:
        root = self._roots.get(system)
        if root is None:
            root = self._roots[system] = _Node(chunk="", parent=None)
        return root

    def _walk(self, system: str, path: Sequence[str]) -> _Node | None:
        node: _Node | None = self._root(system)
        for chunk in path:
            node = node.children.get(chunk) if node is not None else None
        return node

    def _attached(self, node: _Node) -> bool:
        """False once an ancestor (or the node) was evicted while we computed outside the lock."""
        while node.parent is not None:
            if node.parent.children.get(node.chunk) is not node:
                return False
            node = node.parent
        return True

    def _touch(self, node: _Node) -> None:
        self._tick += 1
        node.last_access = self._tick

    def _add_child(
        self, system: str, parent: _Node, path: tuple[str, ...], value: Any, protected: set[int]
    ) -> _Node | None:
        nbytes = value_nbytes(value)
        old = parent.children.get(path[-1])
        if old is not None and old.entry is not None:  # a concurrent request computed it too: replace value
            self._stats.bytes_stored += nbytes - old.entry.nbytes
            old.entry = CacheEntry(old.entry.key, system, path[-1], len(path) - 1, value, nbytes)
            self._touch(old)
            return old
        if not self._fits_at_all(nbytes) or not self._make_room(nbytes, protected):
            return None
        node = _Node(chunk=path[-1], parent=parent)
        node.entry = CacheEntry(path_key(system, path), system, path[-1], len(path) - 1, value, nbytes)
        parent.children[path[-1]] = node
        self._touch(node)
        self._added(node.entry)
        return node

    def _make_room(self, nbytes: int, protected: set[int]) -> bool:
        if self.max_bytes is None or self._stats.bytes_stored + nbytes <= self.max_bytes:
            return True
        leaves = [n for n in self._iter_nodes() if not n.children and id(n) not in protected]
        heapq.heapify(leaves)
        while leaves and self._stats.bytes_stored + nbytes > self.max_bytes:
            victim = heapq.heappop(leaves)
            parent = victim.parent
            assert parent is not None and victim.entry is not None
            del parent.children[victim.chunk]
            self._removed(victim.entry)
            if parent.parent is not None and not parent.children and id(parent) not in protected:
                heapq.heappush(leaves, parent)
        return self._stats.bytes_stored + nbytes <= self.max_bytes

    def _iter_nodes(self):
        stack = [c for r in self._roots.values() for c in r.children.values()]
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())
