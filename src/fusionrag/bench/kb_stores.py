"""The knowledge-base stores a quality run reads, kept apart from the driver that fills them in.

A store is the knowledge base (the passages of the first ``kb_limit`` questions) plus its
offline settings; its name is what records carry (``kb``) to say which store they read, so
a changed knowledge base is detected and its cells recomputed rather than mixed in. A store
holding other passages is refused. ``bench quality`` builds it as ``fusionrag preprocess``
would (the corpus top-n); a study builds its own kinds through a :class:`StoreVariant`
(``studies/harness/stores.py``: other neighbour sources, fusing only the evaluated questions'
chunks, seeding from a smaller store).
"""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path
from typing import Protocol

from fusionrag.bench.datasets import QAExample
from fusionrag.errors import FusionRAGError
from fusionrag.offline import build
from fusionrag.offline.preprocess import FuseSettings, compute_plain
from fusionrag.prompt import SHORT_ANSWER_PROMPT
from fusionrag.retrieval.knowledge import KnowledgeStore


class StoreVariant(Protocol):
    """How a study builds its stores other than ``fusionrag preprocess`` would (``QualitySpec.stores``)."""

    #: Added to the store's name after its neighbour settings ("" when the neighbours are the corpus top-n).
    suffix: str

    def seed(self, path: Path) -> Path | None:
        """Put a copy of another store at ``path`` to start from (the source), or None."""

    def fuse_chunks(self, store: KnowledgeStore, evaluated: list[QAExample]) -> list[int] | None:
        """The only chunks to compute KV for (None: every chunk of the knowledge base)."""

    def neighbour_lists(self, store: KnowledgeStore, examples: list[QAExample],
                        fuse: FuseSettings) -> dict[int, list[int]] | None:
        """Each chunk's neighbours (None: the corpus top-n, as ``fusionrag preprocess``)."""

    def composition(self, store: KnowledgeStore, examples: list[QAExample], fuse: FuseSettings) -> dict:
        """What the neighbours of the store are made of, for the report ({}: nothing to add)."""


class StoreSettings(Protocol):
    """What the store functions read of a run's settings; ``quality.QualitySpec`` has them all.

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
    stores: StoreVariant | None  # None: built as `fusionrag preprocess` would
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
    if spec.stores is not None:
        variant += spec.stores.suffix
    if spec.fuse.min_similarity is not None:
        variant += f"-sim{spec.fuse.min_similarity:g}"
    if spec.max_passages is not None:  # the knowledge base itself differs: passages were cut per question
        variant += f"-p{spec.max_passages}"
    if spec.kv_dtype != "float16":  # fp16 stores keep the names they had before int8 storage existed
        variant += f"-{spec.kv_dtype}"
    return f"{spec.model}-{dataset}-n{kb_size(spec)}-top{top_n}" + variant


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
               evaluated: list[QAExample] | None = None):
    """The run's store with plain KV for every chunk, and fused KV too when ``fused`` (the slow part).

    Cells on plain KV never read fused entries, so a run of only those skips the offline stage: on
    MuSiQue's 942-chunk knowledge base that is most of an hour of one core. A study's variant may
    restrict the KV computed to the ``evaluated`` questions' chunks (neighbours still come from the
    whole knowledge base); without ``fused`` that is only those chunks' plain KV (what the cells
    read; a later fused run completes the rest).
    """
    # Stores hold gigabytes of KV: they live in the cache folder, never next to the report.
    path = (spec.cache_dir or spec.out / "cache") / "stores" / store_name(spec, dataset, top_n)
    variant = spec.stores
    seeded = variant is not None and not path.exists() and (source := variant.seed(path)) is not None
    if seeded:
        print(f"[bench quality] {path.name}: seeded from {source.name} (its plain KV and still-current fused KV)")
    store = _fill_store(spec, path, dataset, examples, lm)
    if store is None and seeded:  # the seed came from another file of the same dataset name
        print(f"[bench quality] {path.name}: the seed holds passages of other questions; building from scratch")
        shutil.rmtree(path)
        store = _fill_store(spec, path, dataset, examples, lm)
    if store is None:
        raise FusionRAGError(
            f"{path} holds chunks that are not passages of this run's questions (another data file with the "
            f"dataset name '{dataset}'?): the knowledge base would be wrong; remove it or use another --cache-dir"
        )
    only = None if variant is None or evaluated is None else variant.fuse_chunks(store, evaluated)
    # Plain KV, with a progress bar: for the whole knowledge base, except in a run of plain-KV cells on
    # some of its questions, which reads only their passages (half of a 100-question store's plain KV).
    fusing = fused and top_n > 0
    compute_plain(store, lm, build.ensure_system_kv(store, lm), progress=spec.progress,
                  chunk_ids=None if fusing else only)
    if fusing:
        settings = replace(spec.fuse, top_n=top_n)
        lists = None if variant is None else variant.neighbour_lists(store, examples, settings)
        build.fuse(store, lm, settings=settings, progress=spec.progress, neighbour_lists=lists, chunk_ids=only)
    return store


def store_composition(spec: StoreSettings, store: KnowledgeStore, examples: list[QAExample], top_n: int) -> dict:
    """What the neighbours of the store a run's fused cells read are (the variant's own description, if any)."""
    out = {"source": "corpus", "min_similarity": spec.fuse.min_similarity, "top_n": top_n}
    if spec.stores is None:
        return out
    return {**out, **spec.stores.composition(store, examples, replace(spec.fuse, top_n=top_n))}
