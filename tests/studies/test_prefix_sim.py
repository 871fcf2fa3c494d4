"""The prefix-cache simulation: small runs, well-formed numbers, alternative path stores less."""

from __future__ import annotations

import json

import pytest
from studies.prefix_cache.simulate import PAPER, SimParams, main, make_queries, run_simulation

SMALL = {"num_queries": 100, "kb_size": 300, "shared_pool_size": 150, "seed": 3}


@pytest.fixture(scope="module")
def small():
    return run_simulation(**SMALL)


def test_small_run_is_well_formed(small):
    plain, alt, cmp_, stream = small["plain"], small["alt"], small["comparison"], small["stream"]
    assert small["paper"] == PAPER
    assert stream["chunk_lookups"] == 1000
    assert stream["lookups_by_category"] == {"kb": 600, "shared": 300, "unique": 100}
    for st in (plain, alt):
        assert st["lookups"] == 1000 and st["requests"] == 100
        assert st["hits"] + st["recomputations"] == st["lookups"]
        assert 0 <= st["hit_rate"] <= 1
        assert st["preload_bytes"] == alt["preload_bytes"] > 0
    # the alternative path: every KB chunk hits, each shared chunk is computed once, unique ones always
    assert alt["recomputations_by_category"] == {"kb": 0, "shared": stream["distinct_shared_seen"], "unique": 100}
    assert alt["redundant_recomputations"] == 0
    assert alt["entries"] == 300 + stream["distinct_shared_seen"] + 100
    # the baseline recomputes KB chunks that are not first, and shared chunks again in new orders
    assert plain["recomputations_by_category"]["kb"] > 0 and plain["redundant_recomputations"] > 0
    assert alt["bytes_stored"] < plain["bytes_stored"]
    assert alt["recomputations"] < plain["recomputations"]
    assert alt["hit_rate"] > plain["hit_rate"]
    assert alt["plain_prefix_bytes"] == plain["bytes_stored"]  # the shadow matches the real baseline
    assert 0 < cmp_["storage_reduction_pct"] < 100
    assert cmp_["redundant_recompute_reduction_pct"] == 100.0
    assert cmp_["hit_rate_pct"] == pytest.approx(100 * alt["hit_rate"])
    json.dumps(small)  # serialisable as is


def test_seeded_and_deterministic(small):
    assert run_simulation(**SMALL) == small
    assert run_simulation(**{**SMALL, "seed": 4})["comparison"] != small["comparison"]


def test_query_stream_shape():
    p = SimParams(num_queries=20, top_k=7, kb_size=50, shared_pool_size=20, seed=1)
    queries, category, kb = make_queries(p)
    assert len(queries) == 20 and len(kb) == 50
    for q in queries:
        assert len(q) == 7 and len(set(q)) == 7
        counts = [sum(category[c] == k for c in q) for k in ("kb", "shared", "unique")]
        assert counts[0] in (4, 5) and counts[1] in (2, 3) and counts[2] in (0, 1)
    assert len({tuple(q) for q in queries}) == 20


def test_no_preload_and_budget_still_consistent():
    r = run_simulation(**{**SMALL, "preload_kb": False, "max_bytes": 200 * 512 * 12288})
    for st in (r["plain"], r["alt"]):
        assert st["preload_bytes"] == 0
        assert st["bytes_stored"] <= 200 * 512 * 12288
        assert st["hits"] + st["recomputations"] == st["lookups"]
    assert r["alt"]["hit_rate"] > r["plain"]["hit_rate"]


def test_bad_parameters_are_refused():
    with pytest.raises(ValueError):
        SimParams(frac_kb=0.5, frac_shared=0.3, frac_unique=0.1)
    with pytest.raises(ValueError):
        SimParams(kb_size=3)


def test_main_writes_json_markdown_and_plot(tmp_path):
    out = tmp_path / "sim"
    main(["--out", str(out), "--num-queries", "30", "--kb-size", "100", "--shared-pool-size", "60", "--no-sweep"])
    data = json.loads((out / "results.json").read_text())
    assert data["params"]["num_queries"] == 30 and data["sweep_shared_pool_size"] == []
    md = (out / "results.md").read_text()
    assert "paper" in md and "71%" in md and "77.9%" in md
    assert (out / "prefix_cache_sim.png").stat().st_size > 1000
