"""Which stored KV entry a chunk reads: the one rule of fusionrag's engine and the vLLM connector.

A method asks for a kind of KV: ``plain`` (each chunk computed alone after ``S``), ``fused`` (computed after
its most similar chunks, offline) or ``plain-first`` (FusionRAG: the context's first chunk plain, since
nothing precedes it, the rest fused). A store may lack the entry asked for: a store whose plain KV was
dropped (``preprocess --drop-plain``) serves a first chunk fused rather than computing it, and a chunk not
fused yet is read plain (counted as a fused fallback). A ``plain`` method never reads fused KV: its answer
must not depend on the offline stage.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

#: ``has_kv(chunk_id, kind)``: whether the store holds that entry.
HasKV = Callable[[int, str], bool]


def wanted_kind(kind: str, first: bool) -> str:
    """The entry a chunk of a ``kind`` request asks for (``first``: it is the context's first chunk)."""
    if kind == "plain-first":
        return "plain" if first else "fused"
    return kind


def served_kind(has_kv: HasKV, chunk_id: int, kind: str, first: bool) -> str | None:
    """The entry the chunk reads: the wanted one, else the other one where the rule allows (see the module
    doc), else None (the store holds neither: the chunk is computed)."""
    wanted = wanted_kind(kind, first)
    for candidate in (wanted, "plain" if wanted == "fused" else "fused"):
        if candidate == "fused" and kind == "plain":
            continue  # a plain method never reads fused KV
        if has_kv(chunk_id, candidate):
            return candidate
    return None


def requested_kinds(has_kv: HasKV, chunk_ids: Sequence[int | None], kind: str) -> list[str]:
    """The entry each chunk of a context asks for, before a missing entry falls back to plain: what a fused
    fallback is counted against. The first chunk of a ``plain-first`` context asks for fused KV when its
    plain entry was dropped (it is not a fallback to read it)."""
    out = []
    for i, chunk_id in enumerate(chunk_ids):
        wanted = wanted_kind(kind, i == 0)
        if kind == "plain-first" and i == 0 and chunk_id is not None and not has_kv(chunk_id, "plain"):
            wanted = "fused"
        out.append(wanted)
    return out
