"""``fusionrag bench ttft``: TTFT vs context length per method, with its breakdown.

Contexts of the requested token counts are built from real passages of a data file;
the question is the file's first. Every method answers the same prompt in the same run,
methods interleaved (round ``r`` runs every cell once before round ``r + 1``; medians over
rounds), so a busy shared machine slows all of them alike. Two baselines, both on the
same token ids: ``transformers``, the plain library prefill (``model(ids,
logits_to_keep=1)``, its own SDPA attention, no mask), and ``full``, our Full Attention
path; every speed-up is also given against the faster of the two (``speedup_vs_baseline``),
so a slow baseline cannot inflate it. KV tiers (``--tiers``, :data:`TIERS`): ``device`` (chunk
KVs already on the model's device), ``pinned`` (in page-locked host memory, copied to the GPU by
each request; CUDA only), ``memory`` (in RAM) and ``disk`` (read from the store for every
request, with the files dropped from the OS page cache first, i.e. a cold read). On a CPU
``device`` and ``memory`` are the same place.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from fusionrag.bench.provenance import machine_probe
from fusionrag.errors import FusionRAGError
from fusionrag.kvcache.device_tier import DevicePlacement, pin_entry
from fusionrag.kvcache.sources import KVSource, PreloadedSource, drop_from_page_cache
from fusionrag.kvcache.store import CHUNK_KINDS
from fusionrag.offline import build
from fusionrag.prompt import SHORT_ANSWER_PROMPT


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
    backends: Sequence[str] = ("reference", "blocked")  # sparse-pass backends compared at the largest context
    device: str | None = None  # None: cuda when available
    dtype: str | None = None  # None: auto (bf16 on a CPU with bf16 arithmetic, else float32)
    attention: str | None = None  # sparse-pass backend (None: auto)


#: Where a benchmark's chunk KV waits for the request, nearest the model first.
TIERS = ("device", "pinned", "memory", "disk")


def check_tier(tier: str) -> None:
    """A one-line error for a tier name this machine cannot benchmark."""
    if tier not in TIERS:
        raise FusionRAGError(f"unknown KV tier {tier!r} (known: {', '.join(TIERS)})")
    if tier == "pinned" and not torch.cuda.is_available():
        raise FusionRAGError("KV tier 'pinned' needs a CUDA device (page-locked memory is for copies to a GPU)")


def tier_source(store, tier: str, chunk_ids: Sequence[int], device: torch.device | str = "cpu") -> KVSource:
    """The KV source of one benchmark tier: ``device`` (entries already on the model's device),
    ``pinned`` (in page-locked host memory, copied to the GPU by each request; CUDA only),
    ``memory`` (in ordinary host memory) or ``disk`` (each file evicted from the page cache before it is read)."""
    check_tier(tier)
    if tier == "disk":
        return store.cold_kv_source()
    keys = [(c, k) for c in chunk_ids for k in CHUNK_KINDS if store.has_kv(c, k)]
    place = {"device": DevicePlacement(device), "pinned": pin_entry}.get(tier, lambda entry: entry)
    return PreloadedSource({k: place(e) for k, e in zip(keys, store.kv_source().get_many(keys), strict=True)})


def drop_store_from_page_cache(store) -> None:
    """Evict every stored KV file from the OS page cache, so the next reads are cold."""
    drop_from_page_cache(store.kv_root.rglob("*.safetensors"))


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
    """For each target length, the first chunks of the store whose tokens add up to about it
    (a chunk that would overshoot the target by more than 10% is passed over, so that short
    targets, e.g. the break-even study's 64-512 tokens, are met with short chunks)."""
    ids = store.chunk_ids()
    out = {}
    for target in lengths:
        chosen, total = _first_chunks(store, ids, target, skip_over=True)
        if total < target * 0.9:  # too few short chunks: the first ones, whatever their size
            chosen, total = _first_chunks(store, ids, target, skip_over=False)
        if total < target * 0.9:
            raise FusionRAGError(f"not enough passages for a {target}-token context (have {total} tokens)")
        out[target] = chosen
    return out


def _first_chunks(store, ids: Sequence[int], target: int, skip_over: bool) -> tuple[list[int], int]:
    chosen, total = [], 0
    for cid in ids:
        if total >= target:
            break
        n = store.chunk(cid).n_tokens
        if skip_over and total + n > target * 1.1:
            continue
        chosen.append(cid)
        total += n
    return chosen, total


def plain_transformers_ms(lm, ids: Sequence[int]) -> float:
    """TTFT of the library's own prefill: ``model(ids, logits_to_keep=1)`` and the first token's argmax."""
    from fusionrag.execution.attention_hook import attention_implementation

    ids_t = torch.tensor([list(ids)], device=lm.device)
    with attention_implementation(lm.model, "sdpa"):
        t0 = time.perf_counter()
        logits = lm.model(ids_t, logits_to_keep=1).logits
        int(torch.argmax(logits[0, -1]))  # waits for the device, as a first token would
        return (time.perf_counter() - t0) * 1000.0


def _prompt_ids(store, question: str, chunk_ids: Sequence[int]) -> list[int]:
    """``S + chunks + Q``: the ids Full Attention prefills (the transformers baseline gets the same)."""
    ids = list(store.prompt.system_token_ids)
    for cid in chunk_ids:
        ids += list(store.chunk(cid).token_ids)
    return ids + list(store.prompt.question_token_ids(question, ""))


def _row(method: str, ratio: float, tier: str, n: int, samples: list, store, prompt_len: int) -> dict:
    """One table row: medians over the interleaved rounds."""
    if method == "transformers":
        t = statistics.median(samples)
        return {"method": method, "ratio": 1.0, "kv": "-", "context_tokens": prompt_len, "tier": "-",
                "ttft_ms": t, "load_ms": 0.0, "select_ms": 0.0, "recompute_ms": t, "first_token_ms": 0.0,
                "retrieve_ms": 0.0, "recomputed_tokens": prompt_len, "target_tokens": n, "rounds": len(samples)}
    t = {k: statistics.median(s.ttft_ms[k] for s in samples) for k in samples[0].ttft_ms}
    pre = samples[0].pre
    return {"method": method, "ratio": ratio, "kv": samples[0].kv_kind,
            "context_tokens": pre.context_tokens + len(store.prompt.system_token_ids), "tier": tier,
            "ttft_ms": t["total"], "load_ms": t["load"], "select_ms": t["select"], "recompute_ms": t["recompute"],
            "first_token_ms": t["first_token"], "retrieve_ms": t["retrieve"], "recomputed_tokens": pre.recomputed,
            "target_tokens": n, "rounds": len(samples)}


def ttft_workload(lm, data: str | Path, lengths: Sequence[int], top_n: int = 2, embedder: object | None = None,
                  model_source: str | None = None) -> tuple:
    """``(store, examples, {length: chunk ids})``: the store ``bench ttft`` builds and reuses for ``data``
    (its passages in file order, fused with ``top_n`` neighbours where the contexts need them; kept under
    ``$FUSIONRAG_HOME/bench``) and, per target length, the first chunks adding up to about it. Shared by
    every benchmark that times ``bench ttft``'s prompts (``benchmarks/ttft``, ``benchmarks/engines``)."""
    from fusionrag.bench.datasets import load_questions
    from fusionrag.paths import fusionrag_home
    from fusionrag.retrieval.knowledge import KnowledgeStore

    examples = load_questions(data)
    # The store holds hundreds of MB of KV: keep it in the cache folder, not next to the report.
    name = model_source or lm.name
    path = fusionrag_home() / "bench" / f"ttft-{name}-{Path(data).stem}"
    if (path / "store.sqlite").exists():
        store = KnowledgeStore.open(path, lm=lm, embedder=embedder)
    else:
        store = build.create_store(path, lm, system_prompt=SHORT_ANSWER_PROMPT, chunk_tokens=512, kv_dtype="float16",
                                   embedder=embedder, model_source=name)
    need = max(lengths)
    passages, total = [], 0.0
    for ex in examples:
        for p in ex.passages:
            passages.append({"title": p.title, "text": p.text})
            total += len(p.text.split()) * 1.3
        if total > need * 1.2:
            break
    build.add_passages(store, lm, passages, doc="ttft")
    contexts = _contexts(store, lengths)
    if top_n > 0:
        build.fuse(store, lm, top_n=top_n, chunk_ids=sorted({c for ids in contexts.values() for c in ids}))
    return store, examples, contexts


def run_ttft(spec: TTFTSpec) -> list[dict]:
    from fusionrag.bench.report import write_ttft_report
    from fusionrag.models import load_model
    from fusionrag.online.engine import Engine

    for tier in spec.tiers:  # a wrong tier fails now, not after the model and the store are built
        check_tier(tier)
    lm = load_model(spec.model, dtype=spec.dtype, device=spec.device, attention=spec.attention)
    probe_start = machine_probe()
    store, examples, contexts = ttft_workload(lm, spec.data, spec.context_tokens, spec.top_n, spec.embedder,
                                              spec.model)
    question = examples[0].question
    plan = [("transformers", 1.0), ("full", 1.0)] + [
        (m, r) for m in spec.methods if m not in ("full", "transformers") for r in spec.ratios
        if not (m != "fusionrag" and r == 0.0)
    ]
    rows = []
    for n in tqdm(spec.context_tokens, desc="bench ttft", unit="context"):
        ids = contexts[n]
        chunks = [{"title": store.chunk(c).title, "text": store.chunk(c).text} for c in ids]
        prompt_ids = _prompt_ids(store, question, ids)
        engines = {tier: Engine(store, lm, kv_source=tier_source(store, tier, ids, lm.device)) for tier in spec.tiers}
        cells = [(tier, m, r) for tier in spec.tiers for m, r in plan
                 if not (m in ("full", "transformers") and tier != spec.tiers[0])]
        samples: dict[tuple, list] = {c: [] for c in cells}
        for tier, method, ratio in cells:  # warm-up (allocator, threads), on a short prompt
            if method == "transformers":
                plain_transformers_ms(lm, prompt_ids[:64])
            else:
                engines[tier].prepare(question, method=method, ratio=ratio, chunks=chunks[:1])
        for _ in range(spec.repeats):  # interleaved: every cell once per round
            for cell in cells:
                tier, method, ratio = cell
                samples[cell].append(plain_transformers_ms(lm, prompt_ids) if method == "transformers" else
                                     engines[tier].prepare(question, method=method, ratio=ratio, chunks=chunks))
        rows += [_row(m, r, tier, n, samples[(tier, m, r)], store, len(prompt_ids)) for tier, m, r in cells]
    _speedups(rows)
    backend_rows = backend_study(store, lm, question, contexts[max(spec.context_tokens)], spec.repeats,
                                 spec.backends) if spec.backends else []
    loader_rows, loader_summary = [], {}
    if spec.loader_requests > 0:
        loader_rows, loader_summary = _loader_study(spec, store, lm, question, contexts)
        print(f"[bench ttft] asynchronous loader on a cold disk tier: {loader_summary}")
    meta = {"data_file": str(spec.data), "question": question, "repeats": spec.repeats, "top_n": spec.top_n,
            "machine_probe": {"start": probe_start, "end": machine_probe()},
            "loader": loader_summary, "loader_rows": loader_rows, "device": str(lm.device),
            "dtype": str(lm.dtype).removeprefix("torch."), "attention": spec.attention or "auto",
            "torch_threads": torch.get_num_threads(), "interleaved": True, "backends": backend_rows}
    write_ttft_report(rows, spec.out, command=spec.command, model=lm.name, meta=meta)
    write_speedup_summary(rows, Path(spec.out) / "speedups.md", meta, spec.command)
    return rows


def backend_study(store, lm, question: str, chunk_ids: Sequence[int], repeats: int,
                  backends: Sequence[str], ratio: float = 0.15) -> list[dict]:
    """FusionRAG at ``ratio`` with each sparse-attention backend, interleaved: the recompute pass's time
    (and the question pre-pass's, ``select``) and how far each backend's output is from the first one's."""
    import dataclasses

    from fusionrag.online.engine import Engine

    chunks = [{"title": store.chunk(c).title, "text": store.chunk(c).text} for c in chunk_ids]
    engines = {b: Engine(store, dataclasses.replace(lm, attention=b), kv_source=tier_source(store, "memory", chunk_ids))
               for b in backends}
    for e in engines.values():
        e.prepare(question, method="fusionrag", ratio=ratio, chunks=chunks[:1])
    runs: dict[str, list] = {b: [] for b in backends}
    for _ in range(repeats):
        for b, e in engines.items():
            runs[b].append(e.prepare(question, method="fusionrag", ratio=ratio, chunks=chunks))
    first = runs[backends[0]][0].pre
    rows = []
    for b in backends:
        pre = runs[b][0].pre
        rows.append({"backend": b, "ratio": ratio, "prompt_tokens": len(first.kv),
                     "recompute_ms": statistics.median(r.ttft_ms["recompute"] for r in runs[b]),
                     "select_ms": statistics.median(r.ttft_ms["select"] for r in runs[b]),
                     "recompute_samples_ms": [r.ttft_ms["recompute"] for r in runs[b]],
                     "same_selection": bool(torch.equal(pre.selected.cpu(), first.selected.cpu())),
                     "max_abs_logit_diff": float((pre.last_logits - first.last_logits).abs().max()),
                     "max_abs_kv_diff": float(max((pre.kv.keys - first.kv.keys).abs().max(),
                                                  (pre.kv.values - first.kv.values).abs().max()))})
    base = rows[0]["recompute_ms"]
    for r in rows:
        r["recompute_speedup_vs_first"] = base / r["recompute_ms"]
    return rows


def _speedups(rows: list[dict]) -> None:
    """``speedup_vs_full``, ``speedup_vs_transformers`` and ``speedup_vs_baseline`` (the faster of the two)."""
    for row in rows:
        same = [r for r in rows if r["target_tokens"] == row["target_tokens"]]
        full = next(r["ttft_ms"] for r in same if r["method"] == "full")
        plain = next(r["ttft_ms"] for r in same if r["method"] == "transformers")
        row["speedup_vs_full"] = full / row["ttft_ms"]
        row["speedup_vs_transformers"] = plain / row["ttft_ms"]
        row["speedup_vs_baseline"] = min(full, plain) / row["ttft_ms"]


def _probe_line(meta: dict) -> str:
    """The machine's arithmetic and memory rates at the run's start and end (bench.provenance.machine_probe)."""
    probe = meta.get("machine_probe")
    if not probe:
        return ""
    a, b = probe["start"], probe["end"]
    return (f" Machine at start / end: GEMM {a['gemm_gflops']} / {b['gemm_gflops']} GFLOP/s, memory copy "
            f"{a['copy_gbs']} / {b['copy_gbs']} GB/s (one core; TTFT ratios move with memory bandwidth).")


def write_speedup_summary(rows: Sequence[dict], path: Path, meta: dict, command: str | None) -> Path:
    """The headline table: every method against the faster baseline, per context length (memory tier)."""
    from fusionrag.files import atomic_write

    lines = ["# TTFT speed-ups against the faster baseline", "",
             f"Command: `{command}`  " if command else "",
             f"Device {meta['device']}, {meta['dtype']}, {meta['torch_threads']} torch thread(s); cells interleaved, "
             f"median of {meta['repeats']} rounds. Baseline = the faster of plain transformers "
             "(`model(ids, logits_to_keep=1)`) and our `full`, same token ids, same run." + _probe_line(meta), "",
             "| context tokens | method | ratio | tier | TTFT ms | vs baseline | vs transformers | vs full |",
             "|---|---|---|---|---|---|---|---|"]
    order = {"transformers": 0, "full": 1}
    for r in sorted(rows, key=lambda r: (r["target_tokens"], str(r["tier"]), order.get(r["method"], 2),
                                         r["method"], r["ratio"])):
        lines.append(f"| {r['context_tokens']:,} | {r['method']} | {r['ratio']:.0%} | {r['tier']} | "
                     f"{r['ttft_ms']:.0f} | {r['speedup_vs_baseline']:.2f}x | {r['speedup_vs_transformers']:.2f}x | "
                     f"{r['speedup_vs_full']:.2f}x |")
    if meta.get("backends"):
        lines += ["", "## The recompute pass on each sparse-attention backend (FusionRAG 15%, largest context)", "",
                  "| backend | recompute ms | vs first | select ms | same selection | max logit diff | max KV diff |",
                  "|---|---|---|---|---|---|---|"]
        for b in meta["backends"]:
            lines.append(f"| {b['backend']} | {b['recompute_ms']:.0f} | {b['recompute_speedup_vs_first']:.2f}x | "
                         f"{b['select_ms']:.0f} | {b['same_selection']} | {b['max_abs_logit_diff']:.1e} | "
                         f"{b['max_abs_kv_diff']:.1e} |")
    return atomic_write(path, "\n".join(line for line in lines if line is not None) + "\n")


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
