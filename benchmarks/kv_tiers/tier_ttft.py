"""TTFT of a warm request by KV tier: memory, Redis (shared tier), disk (warm page cache), disk (cold).

Real questions of a data file, answered by FusionRAG at 15% over a built store (e.g. a quality
study's 50-question store); each request's chunks are stored entries. Tiers, on the same engine
and the same prompts, interleaved per round (a busy machine slows all alike):

- ``memory``: entries already in RAM (what a memory-tier hit costs);
- ``redis``: a real redis-server on a unix socket, filled by a first pass (what a second server
  reading what the first one loaded costs: bytes over the socket + verification + header check);
- ``disk_warm``: the store's files, in the OS page cache after a first pass;
- ``disk_cold``: the files evicted from the page cache before each read.

    .venv/bin/python benchmarks/kv_tiers/tier_ttft.py --store STORE --data FILE --out benchmarks/kv_tiers/results
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def start_redis(folder: Path) -> tuple[subprocess.Popen, str]:
    import redis

    sock = folder / "redis.sock"
    proc = subprocess.Popen(["redis-server", "--port", "0", "--unixsocket", str(sock), "--save", "",
                             "--appendonly", "no", "--dir", str(folder)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(unix_socket_path=str(sock))
    for _ in range(100):
        try:
            client.ping()
            break
        except redis.exceptions.ConnectionError:
            time.sleep(0.05)
    return proc, f"unix://{sock}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--questions", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/kv_tiers/results")
    args = ap.parse_args()

    from fusionrag.bench.datasets import load_questions
    from fusionrag.kvcache.sources import PreloadedSource
    from fusionrag.models import load_model
    from fusionrag.online.engine import Engine
    from fusionrag.retrieval.knowledge import KnowledgeStore
    from fusionrag.retrieval.store_info import stored_model
    from fusionrag.serve.launch import kv_tier_source

    lm = load_model(stored_model(args.store))
    store = KnowledgeStore.open(args.store, lm=lm)
    examples = load_questions(Path(args.data), args.questions)
    keys = [(c, "fused") for c in store.chunk_ids() if store.has_kv(c, "fused")]
    tmp = Path(tempfile.mkdtemp(prefix="fusionrag-redis-"))
    proc, url = start_redis(tmp)
    try:
        redis_source = kv_tier_source(url, store)
        sources = {
            "memory": PreloadedSource.of(store.kv_source(), keys),
            "redis": redis_source,
            "disk_warm": store.kv_source(),
            "disk_cold": store.cold_kv_source(),
        }
        engines = {t: Engine(store, lm, kv_source=s) for t, s in sources.items()}
        samples: dict[str, list[dict]] = {t: [] for t in sources}
        for r in range(args.rounds + 1):  # round 0 warms Redis and the page cache, and is not counted
            for ex in examples:
                chunks = [{"title": p.title, "text": p.text} for p in ex.passages]
                for tier, engine in engines.items():
                    res = engine.answer(ex.question, method="fusionrag", ratio=0.15, chunks=chunks, max_new_tokens=1)
                    if r > 0:
                        samples[tier].append({"total": res.ttft_ms["total"], "load": res.ttft_ms.get("load", 0.0),
                                              "chunks": len(chunks), "fallbacks": res.fused_fallbacks})
        redis_stats = redis_source.stats()["redis"].to_dict()
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)

    rows = []
    for tier, ss in samples.items():
        rows.append({"tier": tier, "n": len(ss),
                     "ttft_ms_median": round(statistics.median(s["total"] for s in ss), 1),
                     "load_ms_median": round(statistics.median(s["load"] for s in ss), 2),
                     "chunks_per_request": round(statistics.fmean(s["chunks"] for s in ss), 2),
                     "fused_fallbacks": sum(s["fallbacks"] for s in ss)})
    result = {"command": " ".join([".venv/bin/python", *sys.argv]), "store": args.store,
              "kv_dtype": store.settings["kv_dtype"], "model": lm.name, "method": "fusionrag", "ratio": 0.15,
              "questions": len(examples), "rounds": args.rounds, "torch_threads": torch.get_num_threads(),
              "redis_stats": redis_stats, "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"results_{store.settings['kv_dtype']}"
    (out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    md = [f"# Warm-request TTFT by KV tier ({store.settings['kv_dtype']} store)", "",
          f"Command: `{result['command']}`", "",
          f"{lm.name}, FusionRAG at 15%, {len(examples)} TriviaQA questions x {args.rounds} rounds (after a "
          f"warm-up round), torch threads {result['torch_threads']}; a shared 2-core machine under other load.", "",
          "| tier | requests | TTFT median (ms) | KV load median (ms) | chunks/request |", "|---|---|---|---|---|"]
    md += [f"| {r['tier']} | {r['n']} | {r['ttft_ms_median']} | {r['load_ms_median']} | {r['chunks_per_request']} |"
           for r in rows]
    md += ["", f"Redis tier counters: {json.dumps(redis_stats)}", ""]
    (out / f"{name}.md").write_text("\n".join(md))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
