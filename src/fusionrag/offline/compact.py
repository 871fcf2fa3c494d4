"""Keeping a store small: its KV storage dtype, and whether plain KV is kept once fused KV exists.

Two store settings, both recorded in the store and applied by every build step:

- ``kv_dtype`` (``float16``, ``float32`` or ``int8``): how chunk KV is stored. An existing
  store can be converted (:func:`convert_kv_dtype`): every chunk entry is re-encoded from what
  it holds, with no model run; ``S`` stays fp32. A converted fused entry was fused on the old
  dtype's neighbours (a native int8 build fuses on int8-dequantised neighbours), so the store
  records ``converted_from``.
- ``plain_kv`` (``keep``, the default, or ``drop``): FusionRAG and every policy on fused KV read
  only fused KV plus Cache-Craft's scores stored with it, so a serving store can drop plain KV
  once fused KV exists (:func:`drop_plain`). Fusing reads the *neighbours'* plain KV, so an
  incremental update re-creates exactly the plain KV it needs (:func:`plain_needed`) and drops it
  again afterwards. Baselines on plain KV (Full Reuse, CacheBlend on plain) need a ``keep`` store.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from fusionrag.errors import FusionRAGError

if TYPE_CHECKING:
    from fusionrag.retrieval.knowledge import KnowledgeStore

Key = tuple[int, str]
PLAIN_KV_MODES = ("keep", "drop")


def keeps_plain(store: KnowledgeStore) -> bool:
    """Whether the store keeps every chunk's plain KV (the default)."""
    return (store.settings.get("plain_kv") or "keep") == "keep"


def set_plain_kv(store: KnowledgeStore, mode: str) -> None:
    """Record ``keep`` or ``drop``; dropping is refused on a store that was never fused."""
    if mode not in PLAIN_KV_MODES:
        raise FusionRAGError(f"unknown plain-KV mode '{mode}' (one of {', '.join(PLAIN_KV_MODES)})")
    if mode == "drop" and not store.settings.get("fuse"):
        raise FusionRAGError("--drop-plain needs a fused store: run preprocess first (or together with it)")
    store.update_settings(plain_kv=mode)


def plain_needed(chunk_ids: Sequence[int], neighbours: Mapping[int, Sequence[int]]) -> list[int]:
    """The chunks whose plain KV fusing ``chunk_ids`` reads: their neighbours (themselves when top-n is 0)."""
    need: dict[int, None] = {}
    for cid in chunk_ids:
        for n in neighbours.get(int(cid)) or [int(cid)]:
            need[int(n)] = None
    return list(need)


def drop_plain(store: KnowledgeStore) -> list[Key]:
    """Remove the plain KV of every chunk that has a fused entry; returns the removed keys."""
    removed = []
    for cid in store.chunk_ids():
        if store.has_kv(cid, "fused") and store.kv.remove(cid, "plain"):
            removed.append((cid, "plain"))
    return removed


def after_fuse(store: KnowledgeStore) -> list[Key]:
    """What a build step does once fusing is done: drop plain KV again on a ``drop`` store."""
    return [] if keeps_plain(store) else drop_plain(store)


def convert_kv_dtype(store: KnowledgeStore, dtype: str) -> list[Key]:
    """Re-encode every chunk entry in ``dtype`` (no model run); returns the rewritten keys
    (:meth:`KnowledgeStore.convert_kv_dtype`: each entry verified before it is rewritten)."""
    return store.convert_kv_dtype(dtype)
