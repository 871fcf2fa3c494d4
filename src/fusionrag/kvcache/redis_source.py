"""A KV tier shared by servers: entry bytes in Redis, between each server's memory tier and its disk.

Several ``fusionrag serve`` processes over copies of one store each keep their own
:class:`~fusionrag.kvcache.sources.MemoryTier`; what one of them loads from disk, the others
can read from Redis instead. Values are the entry files' bytes exactly as on disk (safetensors,
self-verifying: fingerprint, ``S`` hash, token hash, checksum over tensors and header, no
pickles), so a Redis value is checked by the same code as a file (:func:`~fusionrag.kvcache.store.decode_entry`):
a corrupted value, one written for another model or ``S``, or for other tokens is refused,
counted, and the entry is read from disk (and written back, repairing the shared copy).

Freshness: Redis may hold a value that was valid when written but has since been replaced on
disk (another server re-fused). By default every hit is checked against the checksum in the
disk entry's header (a read of its first few KB), so this tier never serves KV the disk no
longer holds; invalidation also deletes the keys, so the servers see a re-fuse at once.

Failure: Redis is a cache. Any Redis error (down, timeout, refused) makes this source read the
disk for ``retry_s`` seconds and then try Redis again; no request fails because Redis did.
Keys are namespaced by model fingerprint, ``S`` hash and a store id (:func:`namespace`).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from fusionrag.errors import CacheIntegrityError, FusionRAGError
from fusionrag.kvcache.sources import Key
from fusionrag.kvcache.store import KVEntry, KVStore
from fusionrag.models.fingerprint import weights_id


@dataclass
class RedisStats:
    """Counters of the shared tier (``memory_hits``: served from Redis; ``disk_hits``: read from disk)."""

    memory_hits: int = 0
    disk_hits: int = 0
    refused: int = 0  # Redis values that failed verification (corrupt, foreign model/S/tokens) or were stale
    stores: int = 0  # values written to Redis
    errors: int = 0  # Redis failures (each one degrades to disk reads for retry_s)
    bytes_from_redis: int = 0
    available: int = 1  # 0 while degraded to disk

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_tier_url(url: str) -> str:
    """``url`` if it names a Redis tier fusionrag can use (``redis://HOST:PORT[/DB]``, ``rediss://...``,
    ``unix:///PATH.sock``), else a one-line :class:`FusionRAGError` saying what is wrong: checked when the
    settings are read, before a model loads."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        port = parts.port  # a port outside 0-65535 raises here
    except ValueError as exc:
        raise FusionRAGError(f"--kv-tier {url!r}: not a valid URL ({exc})") from None
    if parts.scheme in ("redis", "rediss"):
        if not parts.hostname:
            raise FusionRAGError(f"--kv-tier {url!r}: no host (expected {parts.scheme}://HOST:PORT)")
        if port == 0:
            raise FusionRAGError(f"--kv-tier {url!r}: port 0")
        db = parts.path.strip("/")
        if db and not db.isdigit():
            raise FusionRAGError(f"--kv-tier {url!r}: the database is a number (redis://HOST:PORT/0)")
    elif parts.scheme == "unix":
        if not parts.path:
            raise FusionRAGError(f"--kv-tier {url!r}: no socket path (expected unix:///PATH.sock)")
    else:
        raise FusionRAGError(f"--kv-tier {url!r}: expected redis://HOST:PORT, rediss://HOST:PORT or "
                             "unix:///PATH.sock")
    return url


def tier_unreachable(url: str, timeout_s: float = 1.0) -> str | None:
    """Why the Redis tier at ``url`` does not answer a PING now (one line), or None when it does."""
    try:
        import redis

        client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        client.ping()
        return None
    except Exception as exc:  # redis' connection, timeout and auth errors alike
        return f"{type(exc).__name__}: {exc}"


def namespace(fingerprint: str, system_hash: str, store_id: str) -> str:
    """Key prefix: one model's weights (whatever dtype each server computes in), one ``S``, one store
    (``store_id``: e.g. the store's creation stamp and name)."""
    digest = hashlib.sha256(f"{weights_id(fingerprint)}|{system_hash}|{store_id}".encode()).hexdigest()[:16]
    return f"fusionrag:kv:{digest}"


class RedisSource:
    """:class:`~fusionrag.kvcache.sources.KVSource` over Redis, falling back to (and filling from) the store's files.

    ``kv_store`` and ``token_ids_of`` are what a :class:`~fusionrag.kvcache.sources.DiskSource` reads with:
    disk reads here keep the raw bytes, which is what goes into Redis.
    """

    def __init__(self, url: str, kv_store: KVStore, token_ids_of: Callable[[int], Sequence[int]], *, prefix: str,
                 timeout_s: float = 0.5, retry_s: float = 2.0,
                 check_disk_header: bool = True, ttl_s: int | None = None, client: Any = None,
                 dequantize: bool = True) -> None:
        try:
            import redis
        except ImportError as exc:  # an optional extra
            raise FusionRAGError("the Redis KV tier needs the 'redis' package: pip install 'fusionrag[redis]'") from exc
        self._errors = redis.exceptions.RedisError
        self.url = url
        self.kv_store = kv_store
        self.token_ids_of = token_ids_of
        self.prefix = prefix
        self.retry_s = retry_s
        self.check_disk_header = check_disk_header
        self.dequantize = dequantize  # False: int8 entries as stored, for a GPU tier above that dequantises
        self.ttl_s = ttl_s
        self.client = client or redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._stats = RedisStats()
        self._down_until = 0.0
        self._lock = threading.Lock()  # the stats and the down flag (the memory tier's loader is threaded)

    # ------------------------------------------------------------ KVSource

    def get_many(self, keys: Sequence[Key]) -> list[KVEntry]:
        keys = list(keys)
        values = self._mget(keys)
        out, fill = [], {}
        for key, data in zip(keys, values, strict=True):
            entry = self._decode(key, data) if data is not None else None
            if entry is None:
                data = self.kv_store.read_bytes(*key)
                entry = self._verify(key, data)  # raises: the disk entry itself is bad
                fill[key] = data
                self._count(disk_hits=1)
            out.append(entry)
        if fill:
            self._mset(fill)
        return out

    def prefetch(self, keys: Iterable[Key]) -> None:
        return None  # the memory tier above prefetches (through get_many)

    def invalidate(self, keys: Iterable[Key] | None) -> None:
        """Delete the shared copies: every server sees the store's change at its next read. ``None`` (another
        process changed the store, nobody said what): every copy of this store's namespace, in batches."""
        if not self._up():
            return
        try:
            if keys is None:
                batch: list = []
                for name in self.client.scan_iter(match=f"{self.prefix}:*", count=500):
                    batch.append(name)
                    if len(batch) >= 500:
                        self.client.delete(*batch)
                        batch = []
                if batch:
                    self.client.delete(*batch)
                return
            names = [self._name(k) for k in keys]
            if names:
                self.client.delete(*names)
        except self._errors:
            self._failed()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            self._stats.available = int(time.monotonic() >= self._down_until)
            return {"redis": RedisStats(**asdict(self._stats))}

    # ------------------------------------------------------------ helpers

    def _name(self, key: Key) -> str:
        return f"{self.prefix}:{int(key[0])}:{key[1]}"

    def _decode(self, key: Key, data: bytes) -> KVEntry | None:
        """A verified entry from Redis bytes, or None (refused: the caller reads the disk)."""
        try:
            entry = self._verify(key, data)
        except CacheIntegrityError:
            self._count(refused=1)
            return None
        if self.check_disk_header:
            meta = self.kv_store.header(*key)
            if meta is None or meta.get("checksum") != entry.metadata.get("checksum"):
                self._count(refused=1)  # stale: the disk entry was rewritten (or removed) since
                return None
        self._count(memory_hits=1, bytes_from_redis=len(data))
        return entry

    def _verify(self, key: Key, data: bytes) -> KVEntry:
        chunk_id, kind = key
        return self.kv_store.decode(data, chunk_id, kind, token_ids=self.token_ids_of(chunk_id),
                                    where=f"redis {self._name(key)}", dequantize=self.dequantize)

    def _mget(self, keys: list[Key]) -> list[bytes | None]:
        if not keys or not self._up():
            return [None] * len(keys)
        try:
            return list(self.client.mget([self._name(k) for k in keys]))
        except self._errors:
            self._failed()
            return [None] * len(keys)

    def _mset(self, values: dict[Key, bytes]) -> None:
        if not self._up():
            return
        try:
            pipe = self.client.pipeline(transaction=False)
            for key, data in values.items():
                pipe.set(self._name(key), data, ex=self.ttl_s)
            pipe.execute()
            self._count(stores=len(values))
        except self._errors:
            self._failed()

    def _up(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self) -> None:
        with self._lock:
            self._stats.errors += 1
            self._down_until = time.monotonic() + self.retry_s

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, d in deltas.items():
                setattr(self._stats, name, getattr(self._stats, name) + d)
