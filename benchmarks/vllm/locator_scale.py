"""The chunk locator at scale: memory and time of the vLLM connector's scheduler side at 10K-100K chunks.

    .venv/bin/python benchmarks/vllm/locator_scale.py --chunks 10000,100000 --out benchmarks/vllm/results/locator

The connector's planner finds a request's stored chunks in its token ids with the store's
:class:`~fusionrag.retrieval.chunk_locator.ChunkLocator` (our engine's too), inside vLLM's engine-core
loop. Measured here, per store size: the index's first build (every chunk read once), its memory (what
tracemalloc sees it hold after the build, the build's peak, and the process's RSS growth), a request's
match (8 stored chunks of 256 ids pasted with a template's separators and a question, ~2.2K ids), and
following a store change (100 chunks added) by updating the index, against building it again, and what
the connector's scheduler side spends per waiting request per step once the request was planned.

The store is synthetic: random ids from a 151,936-id vocabulary (Qwen2.5's: ids a cache of small ints
does not share), 256 per chunk, every chunk taken to have KV (only the index is measured). One process,
one thread; the machine is named.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import resource
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

VOCAB = 151_936
CHUNK_IDS = 256
PASTED = 8


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def make_store(path: Path, n: int, rng: random.Random):
    from fusionrag.models import load_model
    from fusionrag.offline import build
    from fusionrag.retrieval.chunking import Chunk
    from fusionrag.retrieval.embedder import HashingEmbedder

    lm = load_model("tiny-llama")
    store = build.create_store(path, lm, chunk_tokens=4096, embedder=HashingEmbedder(), model_source="tiny-llama")
    batch = 5000
    for start in range(0, n, batch):
        chunks = [Chunk(f"doc{i}", "", f"chunk {i}", tuple(rng.randrange(300, VOCAB) for _ in range(CHUNK_IDS)),
                        f"h{i}") for i in range(start, min(n, start + batch))]
        store.insert_chunks(chunks)
    store.has_kv = lambda chunk_id, kind: True  # synthetic: every chunk has KV (only the index is measured)
    return store, lm


def prompt_of(store, rng: random.Random) -> tuple[list[int], list[int]]:
    ids = store.chunk_ids()
    picked = rng.sample(ids, PASTED)
    out = [*store.prompt.system_token_ids]
    for cid in picked:
        out += [11, 12, 13, *store.chunk(cid).token_ids]  # a template's separator, then the chunk
    return out + [rng.randrange(300, VOCAB) for _ in range(40)], picked


def measure(n: int, rounds: int, seed: int) -> dict:
    from fusionrag.retrieval.chunk_locator import ChunkLocator
    from fusionrag.retrieval.chunking import Chunk

    rng = random.Random(seed)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        store, _ = make_store(Path(tmp) / "kb", n, rng)
        made_s = time.perf_counter() - t0
        prompts = [prompt_of(store, rng) for _ in range(rounds)]
        store.chunks.forget()
        gc.collect()
        rss0 = rss_mb()
        t0 = time.perf_counter()
        locator = ChunkLocator(store)
        assert len(locator) == n
        build_s = time.perf_counter() - t0
        store.chunks.forget()
        gc.collect()
        rss_mb_held = rss_mb() - rss0
        tracemalloc.start()  # a second build, traced (tracing slows it: the time above is the untraced one)
        traced = ChunkLocator(store)
        assert len(traced) == n
        store.chunks.forget()
        gc.collect()
        held, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        del traced
        gc.collect()
        match_ms, found = [], []
        for ids, picked in prompts:
            t0 = time.perf_counter()
            match = locator.match(ids, "plain-first")
            match_ms.append((time.perf_counter() - t0) * 1000)
            found.append([c.chunk_id for c in match.chunks] == picked)
        step_us = _step_cost(store, prompts)
        new = [Chunk(f"new{i}", "", f"new {i}", tuple(rng.randrange(300, VOCAB) for _ in range(CHUNK_IDS)), f"n{i}")
               for i in range(100)]
        with store.writer():
            store.insert_chunks(new)
        t0 = time.perf_counter()
        assert len(locator) == n + 100
        update_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        assert len(ChunkLocator(store)) == n + 100
        rebuild_s = time.perf_counter() - t0
        store.close()
    return {"chunks": n, "store_made_s": round(made_s, 1), "build_s": round(build_s, 2),
            "index_mb": round(held / 2**20, 1), "build_peak_mb": round(peak / 2**20, 1),
            "rss_growth_mb": round(rss_mb_held, 1),
            "match_ms_median": round(statistics.median(match_ms), 2), "match_ms_max": round(max(match_ms), 2),
            "found_all": f"{sum(found)}/{len(found)}", "update_100_s": round(update_s, 3),
            "rebuild_s": round(rebuild_s, 2), "step_us_per_waiting": round(step_us, 1),
            "prompt_ids": len(prompts[0][0])}


def _step_cost(store, prompts: list) -> float:
    """Microseconds the connector's scheduler side spends per waiting request per step (vLLM's
    ``get_num_new_matched_tokens``) once the request was planned on arrival: the mean of 200 calls per request."""
    from types import SimpleNamespace

    from fusionrag.vllm.planning import Planner

    options = {"method": "fusionrag", "ratio": 0.15, "min_context_tokens": 16, "max_loads_per_step": 10**9}
    planner = Planner(store, options, 16, salting=False, fallback=lambda *a: None)
    requests = [SimpleNamespace(request_id=f"r{i}", prompt_token_ids=ids, cache_salt=None, kv_transfer_params=None)
                for i, (ids, _) in enumerate(prompts)]
    for r in requests:
        planner.on_arrival(r)
    t0 = time.perf_counter()
    for _ in range(200):
        for r in requests:
            planner.matched(r, 0)
    return (time.perf_counter() - t0) / (200 * len(requests)) * 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chunks", default="10000,100000")
    p.add_argument("--rounds", type=int, default=20, help="requests matched per size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/vllm/results/locator")
    a = p.parse_args()
    rows = [measure(int(n), a.rounds, a.seed) for n in a.chunks.split(",")]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "machine": platform.processor() or
            platform.machine(), "cpu": _cpu(), "threads": os.environ.get("OMP_NUM_THREADS", "default"),
            "chunk_ids": CHUNK_IDS, "pasted_chunks": PASTED, "rounds": a.rounds}
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    cols = list(rows[0])
    md = [f"# Chunk locator at scale\n\n`{meta['command']}` on {meta['cpu']}; {CHUNK_IDS} ids per chunk, a request of "
          f"{PASTED} pasted chunks, {a.rounds} requests per size.\n", "| " + " | ".join(cols) + " |",
          "|" + "---|" * len(cols)]
    md += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    (out / "results.md").write_text("\n".join(md) + "\n")
    _plot(rows, out / "locator.png")
    print("\n".join(md))
    return 0


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = [r["chunks"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    axes[0].plot(n, [r["index_mb"] for r in rows], "o-", label="held by the index")
    axes[0].plot(n, [r["build_peak_mb"] for r in rows], "s--", label="peak while building")
    axes[0].set(title="memory (MB, tracemalloc)", xlabel="chunks", xscale="log")
    axes[0].legend()
    axes[1].plot(n, [r["match_ms_median"] for r in rows], "o-")
    axes[1].set(title="one request's match (ms, median)", xlabel="chunks", xscale="log")
    axes[2].plot(n, [r["update_100_s"] for r in rows], "o-", label="update (100 added)")
    axes[2].plot(n, [r["rebuild_s"] for r in rows], "s--", label="build again")
    axes[2].set(title="following a store change (s)", xlabel="chunks", xscale="log")
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
