"""The KV files of a :class:`~fusionrag.retrieval.knowledge.KnowledgeStore`: ``kv/``, one entry per (chunk, kind).

Wraps the store's :class:`~fusionrag.kvcache.store.KVStore` (one verified safetensors file per
entry, plus ``S``'s KV) and binds it to the store's chunks, so that every read is verified against
the chunk's tokens: offline building, verification, compaction and the serving tiers get the
operations they need (read and write an entry, ask whether one is current, re-encode entries in
another dtype, build KV sources) without the store's database or index.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from fusionrag.errors import CacheIntegrityError, FusionRAGError
from fusionrag.kvcache.kv import KV
from fusionrag.kvcache.sources import ColdDiskSource, DiskSource
from fusionrag.kvcache.store import CHUNK_KINDS, KVEntry, KVStore, tokens_hash
from fusionrag.models.fingerprint import fingerprint_dtype, same_weights
from fusionrag.prompt import PromptBuilder


class StoredKV:
    """Entry-level access to a store's KV files (module docstring).

    ``token_ids_of(chunk_id)``: the chunk's tokens (what each read is verified against); ``store_id``:
    what tells this store's entries apart in a tier shared by servers of several stores."""

    def __init__(self, root: Path, fingerprint: str, prompt: PromptBuilder, dtype: str,
                 token_ids_of: Callable[[int], Sequence[int]], store_id: str) -> None:
        self._kv = KVStore(root, fingerprint, prompt.system_hash, dtype)
        self._prompt = prompt
        self._token_ids = token_ids_of
        self._store_id = store_id

    # -- reading ---------------------------------------------------------------------------

    def load_system(self, dtype: str | None = None) -> KV | None:
        """The stored KV of ``S`` (verified), or None if it has not been computed yet, or (``dtype``
        given) was computed in a dtype less precise than float32 and other than ``dtype``: ``S``
        prefixes every prompt, so an engine computing in float32 recomputes a bf16-built ``S`` (ratio 1
        stays Full Attention within 1e-4), while a bf16 engine keeps a float32-built one (closer to
        the float32 reference than its own: decision 052). Something other than a regular file at its path (a
        link, FIFO or device) is never read and never taken for "not computed": :class:`CacheIntegrityError`."""
        if not self.present(None, "system"):
            return None
        if dtype is not None:
            header = self._kv.header(None, "system") or {}
            if fingerprint_dtype(str(header.get("fingerprint", ""))) not in (None, "float32", dtype):
                return None
        return self._kv.load(None, "system", token_ids=self._prompt.system_token_ids).kv

    def has(self, chunk_id: int, kind: str) -> bool:
        """Whether an entry exists (not verified; every read through :meth:`source` verifies)."""
        return self._kv.exists(chunk_id, kind)

    def present(self, chunk_id: int | None, kind: str) -> bool:
        """Whether anything is at an entry's path, a regular file or not (a symlink, even a dangling one, too):
        a path that is taken but :meth:`has` says no entry is a fault to name, not an entry to compute."""
        return os.path.lexists(self._kv.path(chunk_id, kind))

    def header(self, chunk_id: int | None, kind: str) -> dict[str, Any] | None:
        """An entry's header metadata (checksum, dtype, tokens hash, extra), or None; not verified."""
        return self._kv.header(chunk_id, kind)

    def path(self, chunk_id: int | None, kind: str) -> Path:
        """Where an entry's file is (whether or not it exists)."""
        return self._kv.path(chunk_id, kind)

    def files(self, kind: str) -> list[Path]:
        """The entry files of one kind (``plain``, ``fused``) on disk."""
        return list(self._kv.entries(kind))

    def orphans(self, chunk_ids: Iterable[int]) -> list[Path]:
        """Entry files of chunks not among ``chunk_ids`` (left by a removal killed midway)."""
        return self._kv.orphans(set(chunk_ids))

    @property
    def root(self) -> Path:
        """The folder of the KV files."""
        return Path(self._kv.root)

    @property
    def dtype(self) -> str:
        """The dtype new entries are stored in."""
        return self._kv.dtype

    def identity(self) -> tuple[str, str, str, str]:
        """``(root, fingerprint, system hash, dtype)``: what a worker in another process needs to write
        entries this store accepts (:mod:`fusionrag.offline.distributed`)."""
        return str(self._kv.root), self._kv.fingerprint, self._kv.system_hash, self._kv.dtype

    def source(self) -> DiskSource:
        """The KV files as a :class:`~fusionrag.kvcache.sources.KVSource` (verified reads)."""
        return DiskSource(self._kv, self._token_ids)

    def cold_source(self) -> ColdDiskSource:
        """The same, dropping each file from the page cache before reading it (cold-disk benchmarks)."""
        return ColdDiskSource(self._kv, self._token_ids)

    def shared_source(self, url: str) -> Any:
        """A KV tier shared by servers over these files (``redis://HOST:PORT[/DB]``, ``rediss://``,
        ``unix:///PATH.sock``): entries verified like the files, Redis down = disk reads. Namespaced by the
        model's weights, ``S`` and the store, so servers of other stores never read each other's entries."""
        from fusionrag.kvcache.redis_source import RedisSource, namespace

        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise FusionRAGError(f"--kv-tier {url!r}: expected redis://HOST:PORT or unix:///PATH")
        prefix = namespace(self._kv.fingerprint, self._prompt.system_hash, self._store_id)
        return RedisSource(url, self._kv, self._token_ids, prefix=prefix)

    def load_entry(self, chunk_id: int, kind: str = "fused") -> KVEntry:
        """KV, scores and header metadata of one entry, verified against the chunk's tokens."""
        return self._kv.load(chunk_id, kind, token_ids=self._token_ids(chunk_id))

    def load(self, chunk_id: int, kind: str = "fused") -> KV:
        """A verified chunk cache at its stored base position ``len(S)``, in the storage dtype."""
        return self.load_entry(chunk_id, kind).kv

    def is_current(self, chunk_id: int, kind: str, key: dict[str, Any], verify: bool = True) -> tuple[bool, bool]:
        """``(exists, current)`` for one of the chunk's entries.

        Current means: made by this model's weights (any compute dtype) after this ``S`` for the chunk's
        tokens, in the store's dtype, with the settings in ``key`` (fused: neighbours and order), *and*
        (``verify``) it passes full verification: a truncated or bit-flipped file whose header still
        looks right is rebuilt, never skipped forever. An entry left by another store (same id, other
        tokens) is not current.
        """
        meta = self._kv.header(chunk_id, kind)
        if meta is None:
            return self._kv.path(chunk_id, kind).exists(), False
        try:
            extra = json.loads(meta.get("extra", "{}"))
        except ValueError:
            return True, False
        current = (
            same_weights(str(meta.get("fingerprint")), self._kv.fingerprint)
            and meta.get("system_hash") == self._kv.system_hash
            and meta.get("dtype") == self._kv.dtype
            and meta.get("tokens_sha256") == tokens_hash(self._token_ids(chunk_id))
            and {k: extra.get(k) for k in key} == key
        )
        if current and verify:
            try:
                self.load_entry(chunk_id, kind)
            except CacheIntegrityError:
                return True, False
        return True, current

    # -- writing ---------------------------------------------------------------------------

    def save_system(self, kv: KV) -> None:
        """Store ``S``'s KV in fp32: it prefixes every prompt, so it is kept at full precision."""
        self._kv.save(None, "system", kv, self._prompt.system_token_ids, dtype="float32")

    def save(self, chunk_id: int, kind: str, kv: KV, token_ids: Any, scores: torch.Tensor | None = None,
             extra: dict[str, Any] | None = None) -> None:
        """Write one entry atomically (verified on every later read)."""
        self._kv.save(chunk_id, kind, kv, token_ids, scores=scores, extra=extra)

    def remove(self, chunk_id: int, kind: str) -> bool:
        """Delete one entry; whether there was one."""
        return self._kv.remove(chunk_id, kind)

    def remove_chunks(self, chunk_ids: Iterable[int]) -> None:
        """Delete every entry of these (removed) chunks."""
        for cid in chunk_ids:
            for kind in CHUNK_KINDS:
                self._kv.path(cid, kind).unlink(missing_ok=True)

    def remove_temp_files(self) -> None:
        """Delete temp files an interrupted write left behind."""
        self._kv.remove_temp_files()

    def convert(self, dtype: str, chunk_ids: Iterable[int]) -> list[tuple[int, str]]:
        """Store new entries in ``dtype`` (canonical) and re-encode the chunks' entries in it (no model run);
        returns the rewritten keys.

        Each entry is read and verified first, so a conversion never launders a corrupted file.
        Interrupted, it leaves a mix of verified entries of both dtypes (every entry says its own
        format); running it again finishes the job.
        """
        self._kv.dtype = dtype
        changed = []
        for cid in chunk_ids:
            for kind in CHUNK_KINDS:
                meta = self._kv.header(cid, kind)
                if meta is None or meta.get("dtype") == dtype:
                    continue
                entry = self.load_entry(cid, kind)
                self._kv.save(cid, kind, entry.kv, self._token_ids(cid), scores=entry.scores, extra=entry.extra)
                changed.append((cid, kind))
        return changed
