"""A bounded in-memory KV tier over a slower loader, with heat-based admission and prefetch.

The paper keeps chunk KV in three tiers (device, host memory, disk) and moves it by heat
(access frequency): hot chunks stay close, and an asynchronous loader fetches the KV of
queued requests while the engine computes others. This module is one tier boundary:
:class:`TieredKVCache` holds at most ``max_bytes`` of values in memory and falls back to
``load(key)`` (e.g. reading the on-disk store). Tiers stack: the ``load`` of a device tier
can be the ``get`` of a host tier whose ``load`` reads the disk.

Heat: each ``get`` adds 1 to a key's heat, which decays exponentially with half-life
``half_life`` in units of ``clock`` (wall seconds by default; tests inject a counter).
Heat is tracked for every key seen, resident or not, so a chunk that keeps being read
from disk warms up until it earns a place; past ``max_tracked`` keys the coldest
non-resident half is forgotten, so the table stays bounded.

Admission: a value read from the slower tier is admitted if it fits in free space;
otherwise the coldest residents are chosen (lowest heat, then least recently used) until
enough space would be freed, and the value is admitted only if it is strictly hotter than
every one of them, which are then evicted. Ties keep the residents, so equally cold keys
do not thrash.

Prefetch: ``prefetch(keys)`` starts loads on a thread pool. A finished prefetch goes into
free memory if it fits, otherwise it is staged until the first ``get`` of that key takes
it (and runs the admission rule with the heat of that access). Every key is loaded at
most once at a time: concurrent ``get``/``prefetch`` calls for a key in flight wait on the
same future.

Values are never copied or mutated here (chunk KV is shared between requests); evicting
only drops this cache's reference.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Hashable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


@dataclass
class TierStats:
    memory_hits: int = 0  # served from the memory tier
    inflight_hits: int = 0  # served by a prefetch (waited on while in flight, or staged when done)
    disk_hits: int = 0  # loaded synchronously from the slower tier by ``get``
    loads: int = 0  # calls to ``load`` (sync + prefetch)
    prefetches: int = 0  # loads started by ``prefetch``
    promotions: int = 0  # values admitted into memory
    rejections: int = 0  # values not admitted (too big, or not hotter than the residents they'd evict)
    evictions: int = 0
    memory_bytes: int = 0
    memory_items: int = 0
    staged_items: int = 0
    max_bytes: int = 0

    @property
    def gets(self) -> int:
        return self.memory_hits + self.inflight_hits + self.disk_hits

    @property
    def memory_hit_rate(self) -> float:
        return self.memory_hits / self.gets if self.gets else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(gets=self.gets, memory_hit_rate=self.memory_hit_rate)
        return d


@dataclass
class _Resident(Generic[V]):
    value: V
    nbytes: int


class TieredKVCache(Generic[K, V]):
    """A byte-bounded memory tier over ``load(key) -> value`` (``value.nbytes`` is read)."""

    def __init__(
        self,
        load: Callable[[K], V],
        max_bytes: int,
        *,
        half_life: float | None = 60.0,
        clock: Callable[[], float] = time.monotonic,
        max_workers: int = 2,
        max_tracked: int = 100_000,
    ) -> None:
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        if half_life is not None and half_life <= 0:
            raise ValueError("half_life must be > 0 (or None for no decay)")
        self._load = load
        self.max_bytes = max_bytes
        self.half_life = half_life
        self._clock = clock
        self._max_workers = max_workers
        self._max_tracked = max(1, max_tracked)
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._mem: dict[K, _Resident[V]] = {}
        self._mem_bytes = 0
        self._heat: dict[K, tuple[float, float]] = {}  # key -> (heat at time t, t)
        self._last: dict[K, int] = {}  # key -> access sequence number (LRU tie-break)
        self._seq = 0
        self._inflight: dict[K, Future[V]] = {}
        self._staged: dict[K, V] = {}
        self._stale_inflight: set[K] = set()  # invalidated while loading: resolve, but do not keep
        self._stats = TierStats(max_bytes=max_bytes)
        self._closed = False

    # -- public -------------------------------------------------------------------------
    def get(self, key: K) -> V:
        """The value of ``key``: from memory, from a prefetch (waiting if in flight), or loaded now."""
        with self._lock:
            self._access(key)
            res = self._mem.get(key)
            if res is not None:
                self._stats.memory_hits += 1
                return res.value
            if key in self._staged:
                self._stats.inflight_hits += 1
                value = self._staged.pop(key)
                self._admit(key, value, allow_evict=True)
                return value
            fut = self._inflight.get(key)
            if fut is not None:
                self._stats.inflight_hits += 1
                owner = False
            else:
                fut = Future()
                self._inflight[key] = fut
                self._stats.disk_hits += 1
                self._stats.loads += 1
                owner = True
        if not owner:
            value = fut.result()
            with self._lock:  # the first waiter takes the staged copy (if it was not admitted)
                staged = self._staged.pop(key, None)
                if staged is not None:
                    self._admit(key, staged, allow_evict=True)
            return value
        return self._load_and_resolve(key, fut, prefetched=False)

    def get_many(self, keys: Iterable[K]) -> list[V]:
        """Values of ``keys`` in order; all missing ones are fetched concurrently first."""
        keys = list(keys)
        self.prefetch(keys)
        return [self.get(k) for k in keys]

    def prefetch(self, keys: Iterable[K]) -> list[Future[V]]:
        """Start loading ``keys`` not already in memory, staged or in flight; returns the new futures.

        Call it for queued requests so their chunk KV arrives while the engine is busy.
        Prefetching does not add heat: only real accesses do.
        """
        started: list[tuple[K, Future[V]]] = []
        with self._lock:
            if self._closed:
                raise RuntimeError("cache is closed")
            for key in keys:
                if key in self._mem or key in self._staged or key in self._inflight:
                    continue
                fut: Future[V] = Future()
                self._inflight[key] = fut
                self._stats.loads += 1
                self._stats.prefetches += 1
                started.append((key, fut))
            if started and self._executor is None:
                self._executor = ThreadPoolExecutor(self._max_workers, thread_name_prefix="kv-prefetch")
            executor = self._executor
        for key, fut in started:
            assert executor is not None
            executor.submit(self._prefetch_one, key, fut)
        return [f for _, f in started]

    def put(self, key: K, value: V) -> bool:
        """Offer a value computed elsewhere (e.g. a new chunk) to the memory tier; True if admitted."""
        with self._lock:
            self._access(key)
            old = self._mem.pop(key, None)
            if old is not None:
                self._mem_bytes -= old.nbytes
            return self._admit(key, value, allow_evict=True)

    def invalidate(self, keys: Iterable[K]) -> None:
        """Forget ``keys``: resident and staged copies are dropped, and a load in flight is not kept.

        Called when the slower tier's value changed (a chunk re-fused or deleted): without it
        the memory tier would keep serving the old value for as long as it stays hot.
        """
        with self._lock:
            for k in keys:
                old = self._mem.pop(k, None)
                if old is not None:
                    self._mem_bytes -= old.nbytes
                self._staged.pop(k, None)
                if k in self._inflight:
                    self._stale_inflight.add(k)

    def clear(self) -> None:
        """Forget every value (the slower tier changed in ways nobody listed, e.g. another process wrote)."""
        with self._lock:
            keys = [*self._mem, *self._staged, *self._inflight]
        self.invalidate(keys)

    def contains(self, key: K) -> bool:
        """Whether ``key`` is resident in the memory tier."""
        with self._lock:
            return key in self._mem

    def heat(self, key: K) -> float:
        with self._lock:
            return self._heat_now(key, self._clock())

    def resident_keys(self) -> list[K]:
        with self._lock:
            return list(self._mem)

    def stats(self) -> TierStats:
        with self._lock:
            s = TierStats(**asdict(self._stats))
            s.memory_bytes = self._mem_bytes
            s.memory_items = len(self._mem)
            s.staged_items = len(self._staged)
            return s

    def close(self) -> None:
        """Wait for prefetches in flight and stop the loader threads."""
        with self._lock:
            self._closed = True
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)

    def __enter__(self) -> TieredKVCache[K, V]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals (call with the lock held) ----------------------------------------------
    def _prefetch_one(self, key: K, fut: Future[V]) -> None:
        with contextlib.suppress(BaseException):  # the future carries the error to whoever waits for it
            self._load_and_resolve(key, fut, prefetched=True)

    def _load_and_resolve(self, key: K, fut: Future[V], *, prefetched: bool) -> V:
        """Load ``key`` (lock not held), place it, and resolve the in-flight future others wait on.

        A demand load may evict colder entries; a prefetch may not (it is only a guess), so
        a prefetched value that does not fit is staged for its request instead.
        """
        try:
            value = self._load(key)
        except BaseException as e:
            with self._lock:
                self._inflight.pop(key, None)
                self._stale_inflight.discard(key)
            fut.set_exception(e)
            raise
        with self._lock:
            self._inflight.pop(key, None)
            if key in self._stale_inflight:
                self._stale_inflight.discard(key)
            elif not prefetched:
                self._admit(key, value, allow_evict=True)
            elif not self._admit(key, value, allow_evict=False, count_rejection=False):
                self._staged[key] = value
        fut.set_result(value)
        return value

    def _heat_now(self, key: K, now: float) -> float:
        h, t = self._heat.get(key, (0.0, now))
        if self.half_life is None or now <= t:
            return h
        return h * 0.5 ** ((now - t) / self.half_life)

    def _access(self, key: K) -> None:
        now = self._clock()
        self._heat[key] = (self._heat_now(key, now) + 1.0, now)
        self._seq += 1
        self._last[key] = self._seq
        if len(self._heat) > self._max_tracked:
            self._forget_coldest(now, keep=key)

    def _forget_coldest(self, now: float, keep: K) -> None:
        """Bound the heat table: forget the colder half of keys that are not resident or loading."""
        idle = [
            k
            for k in self._heat
            if k != keep and k not in self._mem and k not in self._inflight and k not in self._staged
        ]
        idle.sort(key=lambda k: self._heat_now(k, now))
        for k in idle[: max(1, len(idle) // 2)]:
            del self._heat[k]
            self._last.pop(k, None)

    def _admit(self, key: K, value: V, *, allow_evict: bool, count_rejection: bool = True) -> bool:
        nbytes = int(value.nbytes)  # type: ignore[attr-defined]
        if key in self._mem:
            return True
        if nbytes > self.max_bytes:
            self._stats.rejections += count_rejection
            return False
        if self._mem_bytes + nbytes > self.max_bytes:
            if not allow_evict:
                return False
            now = self._clock()
            mine = self._heat_now(key, now)
            order = sorted(self._mem, key=lambda k: (self._heat_now(k, now), self._last.get(k, 0)))
            victims: list[K] = []
            freed = 0
            for k in order:
                if self._mem_bytes - freed + nbytes <= self.max_bytes:
                    break
                if self._heat_now(k, now) >= mine:  # coldest first, so every later one is at least as hot
                    self._stats.rejections += count_rejection
                    return False
                victims.append(k)
                freed += self._mem[k].nbytes
            for k in victims:
                self._mem_bytes -= self._mem.pop(k).nbytes
                self._stats.evictions += 1
        self._mem[key] = _Resident(value, nbytes)
        self._mem_bytes += nbytes
        self._stats.promotions += 1
        return True
