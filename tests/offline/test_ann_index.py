"""Neighbour search at scale: the HNSW graph above the size threshold, exact search below (retrieval/index.py)."""

from __future__ import annotations

import faiss
import numpy as np

from fusionrag.retrieval.index import VectorIndex


def _clustered(n, dim=32, centers=40, seed=0):
    """Unit vectors around a few centres (embeddings cluster by topic; uniform noise has no neighbours)."""
    rng = np.random.default_rng(seed)
    c = rng.standard_normal((centers, dim)).astype(np.float32)
    x = c[rng.integers(0, centers, n)] + 0.35 * rng.standard_normal((n, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _recall(approx_ids, exact_ids):
    return np.mean([len(set(a) & set(e)) / len(e) for a, e in zip(approx_ids, exact_ids, strict=True)])


def test_hnsw_above_threshold_exact_below(tmp_path):
    x = _clustered(3000)
    ids = (np.arange(3000) * 7 + 5).tolist()  # chunk ids are not positions
    exact = VectorIndex(32, approx_threshold=10**9)
    ann = VectorIndex(32, approx_threshold=1000)
    small = VectorIndex(32, approx_threshold=1000)
    for idx in (exact, ann):
        idx.add(ids, x)
    small.add(ids[:500], x[:500])
    q = x[:200] + 0.05 * _clustered(200, seed=1)
    _, e = exact.search(q, 10)
    _, a = ann.search(q, 10)
    assert ann.approximate and not exact.approximate and not small.approximate
    assert set(np.unique(a)) <= set(ids)
    assert _recall(a, e) >= 0.95
    # Below the threshold nothing changes: the exact scan, bit for bit.
    flat = faiss.IndexFlatIP(32)
    flat.add(x[:500])
    s_small, i_small = small.search(q, 10)
    s_flat, i_flat = flat.search(q, 10)
    assert np.array_equal(i_small, np.asarray(ids)[i_flat]) and np.array_equal(s_small, s_flat)
    # Neighbour lists through the graph: never the chunk itself, mostly the exact ones.
    nb_a = ann.neighbours_many(ids[:100], 10)
    nb_e = exact.neighbours_many(ids[:100], 10)
    assert all(c not in nb_a[c] for c in ids[:100])
    assert _recall([nb_a[c] for c in ids[:100]], [nb_e[c] for c in ids[:100]]) >= 0.9


def test_graph_follows_adds_removals_and_persists(tmp_path):
    x = _clustered(2000)
    ids = list(range(2000))
    ann = VectorIndex(32, approx_threshold=1000)
    ann.add(ids[:1500], x[:1500])
    ann.search(x[:5], 10)
    ann.add(ids[1500:], x[1500:])  # absorbed by the graph
    graph, pos_ids = ann.hnsw()
    assert graph.ntotal == 2000 and pos_ids.tolist() == ids
    assert ann.search(x[1990:1991], 1)[1][0, 0] == 1990
    ann.remove(list(range(0, 2000, 2)))  # HNSW cannot remove: rebuilt without them
    _, got = ann.search(x[:50], 10)
    assert all(i % 2 == 1 for i in got.ravel().tolist() if i >= 0)

    ann.save(tmp_path / "i.faiss")
    assert (tmp_path / "i.faiss.hnsw").is_file()
    again = VectorIndex.load(tmp_path / "i.faiss", 32, approx_threshold=500)
    assert again._hnsw is not None  # adopted, not rebuilt
    assert np.array_equal(again.search(x[:50], 10)[1], got)

    # A graph of other vectors (a crash between the two writes) is not trusted.
    other = VectorIndex(32, approx_threshold=10)
    other.add(list(range(1000)), _clustered(1000, seed=3))
    other.hnsw()
    other.save(tmp_path / "o.faiss")
    (tmp_path / "i.faiss.hnsw").write_bytes((tmp_path / "o.faiss.hnsw").read_bytes())
    assert VectorIndex.load(tmp_path / "i.faiss", 32, approx_threshold=500)._hnsw is None
