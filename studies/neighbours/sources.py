"""Where a chunk's offline neighbours come from, and what the neighbours of a store are made of.

The offline stage can only help a chunk if the context it is fused with resembles the
context Full Attention gives it: the passages before it in its prompt. With the whole
corpus as the candidate pool most neighbours are other questions' passages, context the
prompt never contains. A study therefore builds one store per source:

| source | a chunk's neighbours |
|---|---|
| ``corpus`` | the most similar chunks of the whole knowledge base (the paper; the default) |
| ``question`` | the most similar among the passages of the questions that retrieve it |
| ``preceding`` | the passages before it in its (first) prompt, in prompt order (an upper bound) |
| ``other-questions`` | the most similar chunks of the corpus *without* those questions' passages |

With ``preceding``, Full Reuse approaches Full Attention (each chunk saw its prompt's earlier passages,
though as their plain KV).
There is an optional similarity floor (``min_similarity``) instead of a fixed top-n. Every results
file reports the composition of its store's neighbours (:func:`neighbour_composition`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from fusionrag.errors import FusionRAGError
from studies.harness.membership import Membership

if TYPE_CHECKING:  # the store pulls in faiss: `fusionrag doctor` must parse its arguments without it
    from fusionrag.retrieval.knowledge import KnowledgeStore

NEIGHBOUR_SOURCES = ("corpus", "question", "preceding", "other-questions")


def neighbour_lists(store: KnowledgeStore, members: Membership, source: str, top_n: int,
                    min_similarity: float | None = None) -> dict[int, list[int]] | None:
    """Each chunk's neighbours under ``source`` (None for ``corpus``: the store's own search does it)."""
    if source not in NEIGHBOUR_SOURCES:
        raise FusionRAGError(f"unknown neighbour source '{source}' (one of {', '.join(NEIGHBOUR_SOURCES)})")
    ids = store.chunk_ids()
    if source == "corpus":
        return None
    if source == "preceding":
        return {c: members.preceding(c)[-top_n:] if top_n > 0 else [] for c in ids}
    everything = set(ids)
    among = {c: (members.co_retrieved(c) if source == "question" else everything - members.co_retrieved(c) - {c})
             for c in ids}
    return store.neighbours(ids, top_n, among=among, min_similarity=min_similarity)


def neighbour_composition(store: KnowledgeStore, members: Membership, lists: Mapping[int, Sequence[int]]) -> dict:
    """What a store's neighbours are made of: same-question share, preceding share, mean similarity."""
    total = same = before = 0
    sims: list[float] = []
    for cid, neighbours in lists.items():
        if not neighbours:
            continue
        co = members.co_retrieved(cid)
        vec = store.vectors([cid])[0]
        sims.extend((store.vectors(list(neighbours)) @ vec).tolist())
        for n in neighbours:
            total += 1
            same += n in co
            before += members.precedes(n, cid)
    chunks = len(lists)
    return {
        "chunks": chunks,
        "neighbours_per_chunk": total / chunks if chunks else 0.0,
        "same_question_share": same / total if total else None,
        "preceding_share": before / total if total else None,
        "mean_similarity": float(np.mean(sims)) if sims else None,
    }


@dataclass(frozen=True)
class NeighbourSource:
    """A neighbour source as the studies' stores take it (``StudyStores.neighbours``, :mod:`studies.harness.stores`)."""

    name: str

    def __post_init__(self) -> None:
        if self.name not in NEIGHBOUR_SOURCES:
            raise FusionRAGError(f"unknown neighbour source '{self.name}' (one of {', '.join(NEIGHBOUR_SOURCES)})")

    def lists(self, store: KnowledgeStore, members: Membership, top_n: int,
              min_similarity: float | None) -> dict[int, list[int]] | None:
        return neighbour_lists(store, members, self.name, top_n, min_similarity)

    def composition(self, store: KnowledgeStore, members: Membership, lists: Mapping[int, Sequence[int]]) -> dict:
        return neighbour_composition(store, members, lists)
