"""The knowledge-base stores a quality study reads, kept apart from the driver that fills them in.

A store is the knowledge base (the passages of the first ``kb_limit`` questions) plus its
offline settings; its name is what records carry (``kb``) to say which store they read, so
a changed knowledge base is detected and its cells recomputed rather than mixed in.
Building one is the expensive offline part: a larger store is seeded from the largest
smaller one of the same settings, and a store holding other passages is refused.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

from fusionrag.bench.datasets import QAExample
from fusionrag.bench.membership import Membership, membership
from fusionrag.errors import FusionRAGError
from fusionrag.offline import build
from fusionrag.offline.preprocess import FuseSettings, compute_neighbours, compute_plain
from fusionrag.prompt import SHORT_ANSWER_PROMPT
from fusionrag.retrieval.knowledge import KnowledgeStore


class NeighbourSource(Protocol):
    """Where a study's chunks take their offline neighbours from, instead of the corpus top-n.

    ``bench quality`` itself fuses as ``fusionrag preprocess`` does (the most similar chunks of the
    whole knowledge base); a study passes one of these as ``QualitySpec.neighbours`` to fuse with
    other lists (``studies/neighbours``). Its ``name`` goes into the store's name."""

    name: str

    def lists(self, store: KnowledgeStore, members: Membership, top_n: int,
              min_similarity: float | None) -> dict[int, list[int]] | None: ...

    def composition(self, store: KnowledgeStore, members: Membership, lists: Any) -> dict: ...


class StoreSettings(Protocol):
    """What the store functions read of a study's settings; ``bench_quality.QualitySpec`` has them all.

    A protocol rather than the spec itself, so this module does not import the driver that imports it.
    """

    model: str
    limit: int | None
    kb_limit: int | None
    fuse: FuseSettings
    embedder: object | None
    cache_dir: Path | None
    out: Path
    progress: bool
    kv_dtype: str
    neighbours: NeighbourSource | None  # None: the corpus top-n, as `fusionrag preprocess`
    max_passages: int | None


def kb_size(spec: StoreSettings) -> int | None:
    """How many questions' passages form the knowledge base (never fewer than are evaluated)."""
    if spec.kb_limit is None:
        return spec.limit
    if spec.limit is None or spec.kb_limit < spec.limit:
        raise FusionRAGError(
            f"--kb-limit ({spec.kb_limit}) must be >= --limit ({spec.limit}): every evaluated question's "
            "passages must be in the knowledge base"
        )
    return spec.kb_limit


def store_name(spec: StoreSettings, dataset: str, top_n: int) -> str:
    """The store (= knowledge base and offline settings) a cell of ``dataset`` at ``top_n`` reads."""
    variant = f"-{spec.fuse.neighbour_order}" + ("-samedoc" if spec.fuse.same_document else "")
    if spec.neighbours is not None and spec.neighbours.name != "corpus":
        variant += f"-nb{spec.neighbours.name}"
    if spec.fuse.min_similarity is not None:
        variant += f"-sim{spec.fuse.min_similarity:g}"
    if spec.max_passages is not None:  # the knowledge base itself differs: passages were cut per question
        variant += f"-p{spec.max_passages}"
    if spec.kv_dtype != "float16":  # fp16 stores keep the names they had before int8 storage existed
        variant += f"-{spec.kv_dtype}"
    return f"{spec.model}-{dataset}-n{kb_size(spec)}-top{top_n}" + variant


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


def _fill_store(spec: StoreSettings, path: Path, dataset: str, examples: list[QAExample], lm):
    """Open or create the store at ``path`` and add the run's passages; None if it holds any other chunk."""
    if (path / "store.sqlite").exists():
        store = KnowledgeStore.open(path, lm=lm, embedder=spec.embedder)
    else:
        store = build.create_store(
            path, lm, system_prompt=SHORT_ANSWER_PROMPT, chunk_tokens=100_000, kv_dtype=spec.kv_dtype,
            embedder=spec.embedder, model_source=spec.model)
    if store.settings["kv_dtype"] != spec.kv_dtype:
        store.close()
        raise FusionRAGError(f"{path} stores {store.settings['kv_dtype']} KV, not {spec.kv_dtype}")
    # The knowledge base is the union of all questions' passages; each passage's document is the
    # first question that retrieves it, so --same-document means "neighbours among co-retrieved passages".
    seen: set = set()
    ids: set[int] = set()
    for ex in examples:
        fresh = [p for p in ex.passages if p not in seen]
        seen.update(fresh)
        if fresh:
            ids.update(build.add_passages(store, lm, [{"title": p.title, "text": p.text} for p in fresh],
                                          doc=f"{dataset}:{ex.id}", plain_kv=False))
    if set(store.chunk_ids()) - ids:
        store.close()
        return None
    return store


def open_store(spec: StoreSettings, dataset: str, examples: list[QAExample], top_n: int, lm, fused: bool = True,
               fuse_only: list[QAExample] | None = None):
    """The run's store with plain KV for every chunk, and fused KV too when ``fused`` (the slow part).

    Cells on plain KV never read fused entries, so a run of only those skips the offline stage: on
    MuSiQue's 942-chunk knowledge base that is most of an hour of one core. ``fuse_only`` fuses only
    these questions' chunks (neighbours still come from the whole knowledge base): a study of 30
    questions on a 100-question knowledge base pays for 300 fused chunks, not 1,000. Without
    ``fused``, a ``fuse_only`` run computes only those questions' plain KV (what its cells read; a
    later fused run completes the rest).
    """
    # Stores hold gigabytes of KV: they live in the cache folder, never next to the report.
    path = (spec.cache_dir or spec.out / "cache") / "stores" / store_name(spec, dataset, top_n)
    seeded = not path.exists() and (source := _seed_from_smaller_store(path)) is not None
    if seeded:
        print(f"[bench quality] {path.name}: seeded from {source.name} (its plain KV and still-current fused KV)")
    store = _fill_store(spec, path, dataset, examples, lm)
    if store is None and seeded:  # the smaller store came from another file of the same dataset name
        print(f"[bench quality] {path.name}: the seed holds passages of other questions; building from scratch")
        shutil.rmtree(path)
        store = _fill_store(spec, path, dataset, examples, lm)
    if store is None:
        raise FusionRAGError(
            f"{path} holds chunks that are not passages of this run's questions (another data file with the "
            f"dataset name '{dataset}'?): the knowledge base would be wrong; remove it or use another --cache-dir"
        )
    only = None if fuse_only is None else sorted({c for p in membership(store, fuse_only).prompts for c in p})
    # Plain KV, with a progress bar: for the whole knowledge base, except in a run of plain-KV cells on
    # some of its questions, which reads only their passages (half of a 100-question store's plain KV).
    fusing = fused and top_n > 0
    compute_plain(store, lm, build.ensure_system_kv(store, lm), progress=spec.progress,
                  chunk_ids=None if fusing else only)
    if fusing:
        lists = None if spec.neighbours is None else \
            spec.neighbours.lists(store, membership(store, examples), top_n, spec.fuse.min_similarity)
        build.fuse(store, lm, settings=replace(spec.fuse, top_n=top_n), progress=spec.progress,
                   neighbour_lists=lists, chunk_ids=only)
    return store


def store_composition(spec: StoreSettings, store: KnowledgeStore, examples: list[QAExample], top_n: int) -> dict:
    """What the neighbours of the store a run's fused cells read are (the source's own description, if any)."""
    source = spec.neighbours
    out = {"source": "corpus" if source is None else source.name, "min_similarity": spec.fuse.min_similarity,
           "top_n": top_n}
    if source is None:
        return out
    members = membership(store, examples)
    lists = source.lists(store, members, top_n, spec.fuse.min_similarity)
    if lists is None:
        lists = compute_neighbours(store, store.chunk_ids(), top_n, spec.fuse.same_document,
                                   spec.fuse.min_similarity)
    return {**out, **source.composition(store, members, lists)}
