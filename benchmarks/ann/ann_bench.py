"""HNSW vs exact neighbour search on synthetic 384-d embeddings (benchmarks/ann/results).

Measures, at each corpus size, through fusionrag.retrieval.index.VectorIndex (the code the
store uses): the HNSW build time, single-query latency (a batch of one, as a server asks) of
the exact scan and of HNSW at several efSearch values, recall@10 of HNSW against the exact
top-10, and the offline stage's neighbour lists (top-10 of stored chunks) projected to all
chunks. Synthetic data: unit vectors around n/100 "topic" centres (real embeddings cluster;
uniform random vectors in 384-d have no meaningful neighbours and are HNSW's worst case),
queries are held-out points of the same distribution.

    .venv/bin/python benchmarks/ann/ann_bench.py --sizes 100000,1000000 --out benchmarks/ann/results
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import faiss
import numpy as np

from fusionrag.retrieval import index as index_mod
from fusionrag.retrieval.index import VectorIndex


def clustered(n: int, dim: int, rng: np.random.Generator, centres: np.ndarray, sigma: float) -> np.ndarray:
    x = centres[rng.integers(0, len(centres), n)]
    x += sigma * rng.standard_normal((n, dim), dtype=np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x


def latency_ms(fn, queries: np.ndarray, repeat: int) -> float:
    """Median milliseconds of ``fn`` on one query at a time, on one OpenMP thread (what a request costs)."""
    threads = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    try:
        return _latency_ms(fn, queries, repeat)
    finally:
        faiss.omp_set_num_threads(threads)


def _latency_ms(fn, queries: np.ndarray, repeat: int) -> float:
    times = []
    for i in range(repeat):
        q = queries[i % len(queries)][None, :]
        t0 = time.perf_counter()
        fn(q)
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def recall(approx: np.ndarray, exact: np.ndarray) -> float:
    return float(np.mean([len(set(a.tolist()) & set(e.tolist())) / len(e) for a, e in zip(approx, exact, strict=True)]))


def run_size(n: int, dim: int, n_queries: int, ef_values: list[int], seed: int) -> dict:
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((max(1, n // 100), dim), dtype=np.float32)
    x = clustered(n, dim, rng, centres, sigma=0.6)
    queries = clustered(n_queries, dim, rng, centres, sigma=0.6)
    idx = VectorIndex(dim)
    t0 = time.perf_counter()
    idx.add(list(range(n)), x)
    add_s = time.perf_counter() - t0
    sample_ids = rng.choice(n, size=min(2000, n), replace=False).tolist()
    del x

    t0 = time.perf_counter()
    _, exact_ids = idx.index.search(queries, 10)  # ground truth (batched exact scan)
    exact_batch_s = time.perf_counter() - t0
    exact_ms = latency_ms(lambda q: idx.index.search(q, 10), queries, repeat=30 if n >= 500_000 else 100)

    t0 = time.perf_counter()
    graph, ids = idx.hnsw()
    build_s = time.perf_counter() - t0
    rows = []
    for ef in ef_values:
        graph.hnsw.efSearch = ef
        _, pos = graph.search(queries, 10)
        r = recall(ids[pos], exact_ids)
        ms = latency_ms(lambda q, g=graph: g.search(q, 10), queries, repeat=1000)
        rows.append({"ef_search": ef, "recall_at_10": round(r, 4), "query_ms_median": round(ms, 3)})
        print(f"  n={n} efSearch={ef}: recall@10 {r:.4f}, {ms:.3f} ms/query", flush=True)

    # The offline stage's neighbour lists (top-10 of each stored chunk) through the store's code path.
    idx.approx_threshold = 10**12
    t0 = time.perf_counter()
    exact_nb = idx.neighbours_many(sample_ids[:200], 10)
    exact_nb_s = (time.perf_counter() - t0) / 200
    idx.approx_threshold = index_mod.APPROX_THRESHOLD
    t0 = time.perf_counter()
    approx_nb = idx.neighbours_many(sample_ids, 10)
    approx_nb_s = (time.perf_counter() - t0) / len(sample_ids)
    nb_recall = recall(np.array([approx_nb[c] for c in sample_ids[:200]]),
                       np.array([exact_nb[c] for c in sample_ids[:200]]))
    return {
        "n": n, "dim": dim, "queries": n_queries,
        "add_s": round(add_s, 2),
        "hnsw_build_s": round(build_s, 1),
        "hnsw": {"M": index_mod.HNSW_M, "ef_construction": index_mod.HNSW_EF_CONSTRUCTION,
                 "ef_search_default": index_mod.HNSW_EF_SEARCH},
        "exact_query_ms_median": round(exact_ms, 3),
        "exact_batched_ms_per_query": round(exact_batch_s * 1000 / n_queries, 3),
        "ef_sweep": rows,
        "neighbour_lists": {
            "recall_at_10_vs_exact": round(nb_recall, 4),
            "exact_s_per_chunk": round(exact_nb_s, 5), "hnsw_s_per_chunk": round(approx_nb_s, 5),
            "projected_all_chunks_exact_h": round(exact_nb_s * n / 3600, 2),
            "projected_all_chunks_hnsw_h": round(approx_nb_s * n / 3600, 3),
        },
    }


def markdown(res: dict) -> str:
    lines = ["# HNSW vs exact neighbour search (synthetic 384-d embeddings)", "",
             f"Command: `{res['command']}`", "",
             f"Machine: {res['machine']}; faiss {res['faiss']} with {res['threads']} OpenMP threads "
             "(single queries are single-threaded); 1-minute load average at start / end "
             f"{res.get('load_avg_1min', '?')} "
             "(2 cores: a load above 1 means other work shared them).", "",
             "| chunks | HNSW build | exact query | HNSW query (efSearch) | recall@10 | neighbour lists, all chunks: "
             "exact -> HNSW |", "|---|---|---|---|---|---|"]
    for r in res["sizes"]:
        default = next(x for x in r["ef_sweep"] if x["ef_search"] == r["hnsw"]["ef_search_default"])
        nb = r["neighbour_lists"]
        lines.append(f"| {r['n']:,} | {r['hnsw_build_s']:.0f} s | {r['exact_query_ms_median']:.1f} ms | "
                     f"{default['query_ms_median']:.3f} ms ({default['ef_search']}) | {default['recall_at_10']:.3f} | "
                     f"{nb['projected_all_chunks_exact_h']:.2f} h -> {nb['projected_all_chunks_hnsw_h']:.3f} h "
                     f"(recall {nb['recall_at_10_vs_exact']:.3f}) |")
    lines += ["", "efSearch sweep (recall@10 / median ms per query):", ""]
    for r in res["sizes"]:
        sweep = ", ".join(f"{x['ef_search']}: {x['recall_at_10']:.3f} / {x['query_ms_median']:.3f}"
                          for x in r["ef_sweep"])
        lines.append(f"- {r['n']:,} chunks: {sweep}")
    lines += ["", "Data: unit vectors around n/100 Gaussian topic centres (sigma 0.6 per dimension before "
              "normalisation); queries are held-out points. Real MiniLM embeddings are not available at this "
              "scale here; recall on them may differ.", ""]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="100000,1000000")
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--queries", type=int, default=1000)
    ap.add_argument("--ef", default="32,64,96,128,192")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/ann/results")
    ap.add_argument("--threads", type=int, default=None, help="OpenMP threads for the builds (default: faiss's)")
    args = ap.parse_args()
    if args.threads:
        faiss.omp_set_num_threads(args.threads)
    res = {"command": " ".join([".venv/bin/python", *sys.argv]), "machine": f"{platform.machine()}, "
           f"{os.cpu_count()} cores", "faiss": faiss.__version__, "threads": faiss.omp_get_max_threads(),
           "sizes": [], "load_avg_1min": [round(os.getloadavg()[0], 2)]}
    for n in (int(s) for s in args.sizes.split(",")):
        print(f"n={n} ...", flush=True)
        res["sizes"].append(run_size(n, args.dim, args.queries, [int(e) for e in args.ef.split(",")], args.seed))
    res["load_avg_1min"].append(round(os.getloadavg()[0], 2))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=2) + "\n")
    (out / "results.md").write_text(markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
