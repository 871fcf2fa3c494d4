"""Where the engine gets stored chunk KV from: one interface, several tiers.

Every place that reads chunk KV online (the engine's load step, Cache-Craft's scores,
the asynchronous loader, the TTFT benchmark's hot and cold tiers) goes through a
:class:`KVSource`. Keys are ``(chunk_id, kind)`` with kind ``plain`` or ``fused``;
values are verified :class:`~fusionrag.kvcache.store.KVEntry` objects, which carry the
KV *and* Cache-Craft's stored scores, so a policy that needs scores never reads a file
a second time or around the tier.

Sources stack: :class:`MemoryTier` holds hot entries in RAM over any slower source
(:class:`DiskSource`, :class:`ColdDiskSource`, or a shared tier). Invalidation goes all
the way down: whoever changes the store (re-fuse, delete, re-ingest) gets back the keys
it changed, and ``invalidate(keys)`` drops every cached copy, so no tier ever returns KV
that no longer matches the disk.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from fusionrag.kvcache.store import KVEntry, KVStore
from fusionrag.kvcache.tiers import TieredKVCache

Key = tuple[int, str]
"""``(chunk_id, kind)``: one stored entry."""


@runtime_checkable
class KVSource(Protocol):
    """Read access to stored chunk KV, with optional caching underneath."""

    def get_many(self, keys: Sequence[Key]) -> list[KVEntry]:
        """Verified entries of ``keys``, in order (raises ``CacheIntegrityError`` rather than guess)."""
        ...

    def prefetch(self, keys: Iterable[Key]) -> None:
        """Start fetching ``keys`` in the background (a no-op for sources without a cache)."""
        ...

    def invalidate(self, keys: Iterable[Key] | None) -> None:
        """Forget every cached copy of ``keys`` (the store changed them); ``None``: of everything."""
        ...

    def stats(self) -> dict[str, Any]:
        """``{tier name: TierStats}`` for ``/metrics`` and benchmarks (empty when nothing is cached)."""
        ...


class NoStoredKV:
    """The source of an engine without a store: nothing is stored, every passage's KV is computed."""

    def get_many(self, keys: Sequence[Key]) -> list[KVEntry]:
        if keys:
            raise KeyError(f"no store: no stored KV for {list(keys)[:3]}")
        return []

    def prefetch(self, keys: Iterable[Key]) -> None:
        return None

    def invalidate(self, keys: Iterable[Key] | None) -> None:
        return None

    def stats(self) -> dict[str, Any]:
        return {}


class DiskSource:
    """The store's ``kv/`` folder itself: every read verified against the chunk's token ids.

    ``dequantize=False`` hands int8 entries out as stored (codes and scales, :attr:`KVEntry.scales`): only
    for a tier that dequantises them itself (the GPU tier of :mod:`fusionrag.kvcache.device_tier`)."""

    def __init__(self, kv_store: KVStore, token_ids_of: Callable[[int], Sequence[int]], *,
                 dequantize: bool = True) -> None:
        self.kv_store = kv_store
        self._token_ids_of = token_ids_of
        self.dequantize = dequantize

    def get(self, key: Key) -> KVEntry:
        chunk_id, kind = key
        return self.kv_store.load(chunk_id, kind, token_ids=self._token_ids_of(chunk_id), dequantize=self.dequantize)

    def get_many(self, keys: Sequence[Key]) -> list[KVEntry]:
        return [self.get(k) for k in keys]

    def prefetch(self, keys: Iterable[Key]) -> None:
        return None

    def invalidate(self, keys: Iterable[Key] | None) -> None:
        return None  # nothing cached: the next read sees the new file

    def stats(self) -> dict[str, Any]:
        return {}


class ColdDiskSource(DiskSource):
    """A disk source that evicts each file from the OS page cache before reading it.

    What a first read after a machine restart costs; the TTFT benchmark's "disk" tier.
    """

    def get(self, key: Key) -> KVEntry:
        drop_from_page_cache([self.kv_store.path(*key)])
        return super().get(key)


class PreloadedSource:
    """Entries read into memory beforehand (the TTFT benchmark's hot tier; tests)."""

    def __init__(self, entries: Mapping[Key, KVEntry]) -> None:
        self._entries = dict(entries)

    @classmethod
    def of(cls, source: KVSource, keys: Sequence[Key]) -> PreloadedSource:
        return cls(dict(zip(keys, source.get_many(keys), strict=True)))

    def get_many(self, keys: Sequence[Key]) -> list[KVEntry]:
        return [self._entries[k] for k in keys]

    def prefetch(self, keys: Iterable[Key]) -> None:
        return None

    def invalidate(self, keys: Iterable[Key] | None) -> None:
        for k in list(self._entries) if keys is None else keys:
            self._entries.pop(k, None)

    def stats(self) -> dict[str, Any]:
        return {}


class MemoryTier:
    """A byte-bounded, heat-managed memory tier over a slower source, with an asynchronous loader.

    The admission/eviction policy and the prefetch machinery are :class:`TieredKVCache`'s;
    this class adapts it to the source interface and passes invalidations down. ``place``
    turns an entry read from below into what this tier holds (the loader threads run it): a
    pinned host copy, or a copy on the GPU (:mod:`fusionrag.kvcache.device_tier`); ``name``
    is the tier's key in :meth:`stats` (``host``, ``device``).
    """

    def __init__(self, lower: KVSource, max_bytes: int, *, loader_threads: int = 2, name: str = "host",
                 place: Callable[[KVEntry], KVEntry] | None = None, **cache_options: Any) -> None:
        self.lower = lower
        self.name = name

        def load(key: Key) -> KVEntry:
            entry = lower.get_many([key])[0]
            return entry if place is None else place(entry)

        self.cache: TieredKVCache[Key, KVEntry] = TieredKVCache(load, max_bytes, max_workers=loader_threads,
                                                                **cache_options)

    def get_many(self, keys: Sequence[Key]) -> list[KVEntry]:
        return self.cache.get_many(keys)

    def prefetch(self, keys: Iterable[Key]) -> None:
        self.cache.prefetch(keys)

    def invalidate(self, keys: Iterable[Key] | None) -> None:
        if keys is None:
            self.cache.clear()
            self.lower.invalidate(None)
            return
        keys = list(keys)
        self.cache.invalidate(keys)
        self.lower.invalidate(keys)

    def stats(self) -> dict[str, Any]:
        return {self.name: self.cache.stats(), **self.lower.stats()}

    def close(self) -> None:
        self.cache.close()


def drop_from_page_cache(paths: Iterable[os.PathLike | str]) -> None:
    """Evict files from the OS page cache, so their next read is a cold disk read (POSIX only)."""
    if not hasattr(os, "posix_fadvise"):
        return
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
