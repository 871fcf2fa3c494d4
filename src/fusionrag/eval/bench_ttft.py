"""``fusionrag bench ttft``: TTFT vs context length per method, with its breakdown.

Contexts of the requested token counts are built from real passages of a data file;
the question is the file's first. Every method answers the same prompt in the same run,
and the speed-up over Full Attention is computed within the run. Two KV tiers:
``memory`` (chunk KVs already in RAM) and ``disk`` (read from the store for every
request, with the files dropped from the OS page cache first, i.e. a cold read).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from fusionrag.errors import FusionRAGError
from fusionrag.kvcache.sources import ColdDiskSource, KVSource, PreloadedSource, drop_from_page_cache
from fusionrag.kvcache.store import CHUNK_KINDS
from fusionrag.offline import build


@dataclass
class TTFTSpec:
    data: Path
    out: Path
    model: str = "qwen2.5-0.5b"
    context_tokens: Sequence[int] = (1024, 2048, 4096, 8192)
    ratios: Sequence[float] = (0.0, 0.15)
    methods: Sequence[str] = ("full", "fusionrag", "cacheblend")
    tiers: Sequence[str] = ("memory", "disk")
    repeats: int = 3
    top_n: int = 2
    loader_requests: int = 4  # queued requests for the asynchronous-loader comparison (0: skip it)
    loader_context: int = 2048
    command: str | None = None
    embedder: object | None = None  # None: the store's default (MiniLM); tests inject a cheap one


def tier_source(store, tier: str, chunk_ids: Sequence[int]) -> KVSource:
    """The KV source of one benchmark tier: ``memory`` (entries read into RAM beforehand) or ``disk``
    (each file evicted from the page cache before it is read)."""
    if tier == "memory":
        keys = [(c, k) for c in chunk_ids for k in CHUNK_KINDS if store.has_kv(c, k)]
        return PreloadedSource.of(store.kv_source(), keys)
    return ColdDiskSource(store.kv, lambda cid: store.chunk(cid).token_ids)


def drop_store_from_page_cache(store) -> None:
    """Evict every stored KV file from the OS page cache, so the next reads are cold."""
    drop_from_page_cache(Path(store.kv.root).rglob("*.safetensors"))


def loader_comparison(store, lm, question: str, requests: list[list[int]], method: str = "fusionrag",
                      ratio: float = 0.15) -> list[dict]:
    """Queued requests on a cold disk tier, without and with the asynchronous loader.

    Without: each request reads its chunk KVs when its turn comes. With: while request i
    is computed, the loader fetches request i+1's KVs into the memory tier (lookahead 1,
    as a scheduler with a queue would). Same requests, same order, page cache dropped.
    """
    from fusionrag.online.engine import Engine

    rows = []
    for mode in ("sync", "async"):
        drop_store_from_page_cache(store)
        engine = Engine(store, lm, memory_budget_bytes=(4 << 30) if mode == "async" else None)
        if mode == "async":
            engine.prefetch_chunks(requests[0])
        for i, ids in enumerate(requests):
            chunks = [{"title": store.chunk(c).title, "text": store.chunk(c).text} for c in ids]
            if mode == "async" and i + 1 < len(requests):
                engine.prefetch_chunks(requests[i + 1])
            prep = engine.prepare(question, method=method, ratio=ratio, chunks=chunks)
            rows.append({"mode": mode, "request": i, "ttft_ms": prep.ttft_ms["total"], "load_ms": prep.ttft_ms["load"],
                         "context_tokens": prep.pre.context_tokens})
    return rows


def _contexts(store, lengths: Sequence[int]) -> dict[int, list[int]]:
    """For each target length, the first chunks of the store whose tokens add up to about it."""
    ids = store.chunk_ids()
    out = {}
    for target in lengths:
        chosen, total = [], 0
        for cid in ids:
            if total >= target:
                break
            chosen.append(cid)
            total += store.chunk(cid).n_tokens
        if total < target * 0.9:
            raise FusionRAGError(f"not enough passages for a {target}-token context (have {total} tokens)")
        out[target] = chosen
    return out


def run_ttft(spec: TTFTSpec) -> list[dict]:
    from fusionrag.eval.datasets import load_questions
    from fusionrag.eval.report import write_ttft_report
    from fusionrag.models import load_model
    from fusionrag.online.engine import Engine
    from fusionrag.retrieval.knowledge import KnowledgeStore

    lm = load_model(spec.model)
    examples = load_questions(spec.data)
    question = examples[0].question
    # The store holds hundreds of MB of KV: keep it in the cache folder, not next to the report.
    from fusionrag.paths import fusionrag_home

    path = fusionrag_home() / "bench" / f"ttft-{spec.model}-{Path(spec.data).stem}"
    if (path / "store.sqlite").exists():
        store = KnowledgeStore.open(path, lm=lm, embedder=spec.embedder)
    else:
        store = build.create_store(path, lm, chunk_tokens=512, kv_dtype="float16", embedder=spec.embedder,
                                   model_source=spec.model)
    need = max(spec.context_tokens)
    passages, total = [], 0
    for ex in examples:
        for p in ex.passages:
            passages.append({"title": p.title, "text": p.text})
            total += len(p.text.split()) * 1.3
        if total > need * 1.2:
            break
    build.add_passages(store, lm, passages, doc="ttft")
    contexts = _contexts(store, spec.context_tokens)
    if spec.top_n > 0:
        used = sorted({c for ids in contexts.values() for c in ids})
        build.fuse(store, lm, top_n=spec.top_n, chunk_ids=used)
    plan = [("full", 1.0)] + [
        (m, r) for m in spec.methods if m != "full" for r in spec.ratios if not (m != "fusionrag" and r == 0.0)
    ]
    rows = []
    cells = [
        (n, tier, m, r)
        for n in spec.context_tokens
        for tier in spec.tiers
        for m, r in plan
        if not (m == "full" and tier == "disk")
    ]
    for n, tier, method, ratio in tqdm(cells, desc="bench ttft", unit="cell"):
        ids = contexts[n]
        engine = Engine(store, lm, kv_source=tier_source(store, tier, ids))
        chunks = [{"title": store.chunk(c).title, "text": store.chunk(c).text} for c in ids]
        engine.prepare(question, method=method, ratio=ratio, chunks=chunks[:1])  # warm-up (allocator, threads)
        samples = [engine.prepare(question, method=method, ratio=ratio, chunks=chunks) for _ in range(spec.repeats)]
        t = {k: statistics.median(s.ttft_ms[k] for s in samples) for k in samples[0].ttft_ms}
        pre = samples[0].pre
        rows.append(
            {
                "method": method,
                "ratio": ratio,
                "kv": samples[0].kv_kind,
                "context_tokens": pre.context_tokens + len(store.prompt.system_token_ids),
                "tier": tier,
                "ttft_ms": t["total"],
                "load_ms": t["load"],
                "select_ms": t["select"],
                "recompute_ms": t["recompute"],
                "first_token_ms": t["first_token"],
                "retrieve_ms": t["retrieve"],
                "recomputed_tokens": pre.recomputed,
                "target_tokens": n,
            }
        )
    for row in rows:
        full = next(r for r in rows if r["method"] == "full" and r["target_tokens"] == row["target_tokens"])
        row["speedup_vs_full"] = full["ttft_ms"] / row["ttft_ms"]
    loader_rows, loader_summary = [], {}
    if spec.loader_requests > 0:
        loader_rows, loader_summary = _loader_study(spec, store, lm, question, contexts)
        print(f"[bench ttft] asynchronous loader on a cold disk tier: {loader_summary}")
    write_ttft_report(rows, spec.out, command=spec.command, model=lm.name,
                      meta={"data_file": str(spec.data), "question": question, "repeats": spec.repeats,
                            "top_n": spec.top_n, "loader": loader_summary, "loader_rows": loader_rows})
    return rows


def _loader_study(spec: TTFTSpec, store, lm, question: str, contexts: dict[int, list[int]]) -> tuple[list, dict]:
    """Disjoint requests of about ``loader_context`` tokens each, run without and with the loader."""
    ids = store.chunk_ids()
    shortest = min(spec.context_tokens)
    per = max(1, len(contexts[shortest]) * spec.loader_context // shortest)
    requests = [ids[i * per:(i + 1) * per] for i in range(spec.loader_requests)]
    requests = [r for r in requests if len(r) == per]
    if spec.top_n > 0:
        build.fuse(store, lm, top_n=spec.top_n, chunk_ids=sorted({c for r in requests for c in r}), progress=False)
    rows = loader_comparison(store, lm, question, requests)
    summary: dict = {}
    for mode in ("sync", "async"):
        mine = [r for r in rows if r["mode"] == mode]
        if mine:
            summary[mode] = {"mean_ttft_ms": statistics.fmean(r["ttft_ms"] for r in mine),
                             "mean_load_ms": statistics.fmean(r["load_ms"] for r in mine), "requests": len(mine)}
    if "sync" in summary and "async" in summary:
        summary["ttft_reduction"] = 1 - summary["async"]["mean_ttft_ms"] / summary["sync"]["mean_ttft_ms"]
    return rows, summary
