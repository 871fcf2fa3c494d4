"""The studies' knowledge-base stores, through ``bench quality``'s store hook (``kb_stores.StoreVariant``).

``fusionrag bench quality`` builds a store as ``fusionrag preprocess`` would. The studies build
paper-shaped ones (``python -m studies.quality_cli``):

- neighbours from another source than the corpus top-n (``--neighbours``, :mod:`studies.neighbours.sources`);
  its name goes into the store's name (``-nb<source>``) and its composition into the report;
- fused (and, for plain-KV cells, plain) KV only for the evaluated questions' chunks of a larger
  knowledge base (``--fuse-only-evaluated`` with ``--kb-limit`` above ``--limit``);
- a new store seeded from the largest smaller one of the same settings, so raising ``--kb-limit``
  recomputes only what changed.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from fusionrag.bench.datasets import QAExample
from fusionrag.offline.preprocess import FuseSettings
from studies.harness.membership import Membership, membership

if TYPE_CHECKING:  # the store pulls in faiss
    from fusionrag.retrieval.knowledge import KnowledgeStore


class NeighbourSource(Protocol):
    """Where a study's chunks take their offline neighbours from (``studies/neighbours``); its ``name``
    goes into the store's name."""

    name: str

    def lists(self, store: KnowledgeStore, members: Membership, top_n: int,
              min_similarity: float | None) -> dict[int, list[int]] | None: ...

    def composition(self, store: KnowledgeStore, members: Membership, lists: Any) -> dict: ...


@dataclass(frozen=True)
class StudyStores:
    """A study's stores: ``neighbours`` (None: the corpus top-n), ``fuse_only_evaluated``, and seeding."""

    neighbours: NeighbourSource | None = None
    fuse_only_evaluated: bool = False

    @property
    def suffix(self) -> str:
        return "" if self.neighbours is None or self.neighbours.name == "corpus" else f"-nb{self.neighbours.name}"

    def seed(self, path: Path) -> Path | None:
        return _seed_from_smaller_store(path)

    def fuse_chunks(self, store: KnowledgeStore, evaluated: list[QAExample]) -> list[int] | None:
        if not self.fuse_only_evaluated:
            return None
        return sorted({c for p in membership(store, evaluated).prompts for c in p})

    def neighbour_lists(self, store: KnowledgeStore, examples: list[QAExample],
                        fuse: FuseSettings) -> dict[int, list[int]] | None:
        if self.neighbours is None:
            return None
        return self.neighbours.lists(store, membership(store, examples), fuse.top_n, fuse.min_similarity)

    def composition(self, store: KnowledgeStore, examples: list[QAExample], fuse: FuseSettings) -> dict:
        from fusionrag.offline.preprocess import compute_neighbours

        source = self.neighbours
        if source is None:
            return {}
        members = membership(store, examples)
        lists = source.lists(store, members, fuse.top_n, fuse.min_similarity)
        if lists is None:
            lists = compute_neighbours(store, store.chunk_ids(), fuse.top_n, fuse.same_document, fuse.min_similarity)
        return {"source": source.name, **source.composition(store, members, lists)}


def _seed_from_smaller_store(path: Path) -> Path | None:
    """Copy the largest store of the same model/dataset/offline settings built on fewer questions,
    else a store of the same knowledge base under other offline settings.

    The first N questions of a file are a prefix of the first M > N, chunk ids are assigned
    by content in insertion order, and every fused entry records the neighbour ids and the
    tokens it was made with, so the copy keeps all plain KV and the fused KV of chunks whose
    neighbour lists do not change; ``preprocess`` re-fuses only the rest.
    """
    m = re.fullmatch(r"(.+)-n(\d+)(-top.+)", path.name)
    if m is None:
        return None
    prefix, n, suffix = m.group(1), int(m.group(2)), m.group(3)
    smaller = []
    for p in path.parent.glob(f"{prefix}-n*{suffix}"):
        mm = re.fullmatch(re.escape(prefix) + r"-n(\d+)" + re.escape(suffix), p.name)
        if mm and int(mm.group(1)) < n and (p / "store.sqlite").is_file():
            smaller.append((int(mm.group(1)), p))
    if not smaller:
        # The same knowledge base under other offline settings (another neighbour source, a similarity
        # floor): its plain KV is the same, and fused entries made with other neighbours are re-fused.
        same_kb = [p for p in path.parent.glob(f"{prefix}-n{n}-top*")
                   if p != path and (p / "store.sqlite").is_file() and _same_kb_suffix(p.name, path.name)]
        if not same_kb:
            return None
        smaller = [(0, min(same_kb, key=lambda p: (len(p.name), p.name)))]  # the plainest settings
    source = max(smaller)[1]
    tmp = path.with_name(path.name + ".seeding")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source, tmp)
    os.replace(tmp, path)
    return source


def _same_kb_suffix(a: str, b: str) -> bool:
    """Whether two store names describe the same knowledge base (passage cut and KV dtype), whatever
    their neighbour settings."""
    def kb_part(name: str) -> tuple:
        return (re.search(r"-p\d+", name) or [None])[0], (re.search(r"-(int8|float32)$", name) or [None])[0]

    return kb_part(a) == kb_part(b)


