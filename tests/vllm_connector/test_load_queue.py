"""The connector's asynchronous load queue (decision 066) on its own: what each step runs, in which order, in
how many passes. The model's work is replaced by recorders (no vLLM needed); that the pieces compute what one
pass does is tested through vLLM in ``test_connector.py`` and ``test_tensor_parallel.py``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fusionrag.vllm import loading
from fusionrag.vllm.planning import ReqLoad


def _load(rid: str) -> ReqLoad:
    return ReqLoad(rid, [1] * 100, 0, [], 0, 90, [0, 1, 2, 3], 32, "fusionrag", 0.15, 0, asynchronous=True)


@pytest.fixture
def queue(monkeypatch):
    """A Loader whose stages are recorders: each job selects ``sizes[rid]`` slots, its selection pass costs
    ``question`` tokens; ``passes`` records each pass as ``[(rid, first slot, n), ...]``."""
    tp = SimpleNamespace(all_ok=lambda ok: ok, same=lambda x: x, rank=0)
    loader = loading.Loader(SimpleNamespace(tp=tp), SimpleNamespace(settings={}), None)
    state = {"sizes": {}, "question": 0, "fail": set(), "passes": [], "written": []}

    def assemble(job):
        if job.load.req_id in state["fail"]:
            raise OSError("unreadable")
        job.work = SimpleNamespace(rid=job.load.req_id)

    def choose(job):
        job.selected = torch.arange(state["sizes"][job.load.req_id])
        return state["question"]

    monkeypatch.setattr(loader, "_assemble", assemble)
    monkeypatch.setattr(loader, "_choose", choose)
    monkeypatch.setattr(loader, "_write", lambda job: state["written"].append(job.load.req_id))
    monkeypatch.setattr(loading, "recompute_many", lambda vm, batch: state["passes"].append(
        [(work.rid, int(sel[0]), sel.numel()) for _, sel, work in batch]))
    return loader, state


def test_loads_go_first_come_first_served_within_the_budget_each_piece_in_position_order(queue):
    loader, state = queue
    state["sizes"] = {"a": 100, "b": 30}
    for rid in "ab":
        loader.enqueue(_load(rid))
    finished = []
    for _ in range(10):
        finished += [load.req_id for load, exc in loader.advance(64) if exc is None]
        if not loader.pending():
            break
    assert finished == ["a", "b"] and state["written"] == ["a", "b"]
    assert all(sum(n for *_, n in p) <= 64 for p in state["passes"])
    a_pieces = [(first, n) for p in state["passes"] for rid, first, n in p if rid == "a"]
    assert a_pieces == [(0, 64), (64, 36)]  # in position order, each slot once
    assert state["passes"][1] == [("a", 64, 36), ("b", 0, 28)]  # a's last piece and b's first: one pass


def test_a_short_piece_waits_when_alone_and_joins_a_pass_when_not(queue):
    loader, state = queue
    state["sizes"], state["question"] = {"a": 40, "b": 100, "c": 40}, 20
    loader.enqueue(_load("a"))
    loader.advance(50)  # the selection pass (20) leaves 30 of the budget: a piece of 30 < 32 would go alone
    assert state["passes"] == []
    loader.advance(50)
    assert state["passes"] == [[("a", 0, 40)]]
    loader.enqueue(_load("b"))
    loader.advance(64)
    assert state["passes"][-1] == [("b", 0, 44)]
    state["question"] = 0
    loader.enqueue(_load("c"))
    loader.advance(64)  # b's last 56 leave 8: c's first piece is short, and joins b's pass
    assert state["passes"][-1] == [("b", 44, 56), ("c", 0, 8)]


def test_a_failed_load_falls_back_alone_and_a_cancelled_one_is_dropped(queue):
    loader, state = queue
    state["sizes"] = {"a": 10, "b": 10, "c": 10, "d": 10}
    state["fail"] = {"b"}
    for rid in "abcd":
        loader.enqueue(_load(rid))
    assert loader.cancel({"d", "unknown"}) == ["d"]
    done = {load.req_id: exc for load, exc in loader.advance(100)}
    assert set(done) == {"a", "b", "c"} and isinstance(done["b"], OSError)
    assert done["a"] is None and done["c"] is None
    assert state["passes"] == [[("a", 0, 10), ("c", 0, 10)]]  # the others' pieces in one pass
    assert not loader.pending()


def test_a_failed_load_is_reported_to_vllm_the_way_its_mode_needs():
    """A synchronous load's failure is its first external block (vLLM prefills from there); an asynchronous
    one's is a failed receive, also named finished. Each is reported once."""
    pytest.importorskip("vllm", reason="the connector class needs vLLM (run in .venv-vllm)")
    from collections import Counter

    from fusionrag.vllm.connector import FusionRAGConnector

    conn = object.__new__(FusionRAGConnector)
    conn.loader, conn.fallbacks, conn._warned = None, Counter(), set()
    conn._errors, conn._received, conn._failed_async = set(), set(), set()
    sync, later = _load("s"), _load("a")
    sync.asynchronous, sync.first = False, 40
    conn._failed(sync, OSError("unreadable"))
    conn._failed(later, OSError("unreadable"))
    assert conn.get_block_ids_with_load_errors() == {sync.block_ids[1]}
    assert conn.get_block_ids_with_load_errors() == set()
    results = conn.get_transfer_results(set())
    assert results.finished_recving == {"a"} and results.failed_recving == {"a"}
    assert conn.get_transfer_results(set()).finished_recving == set()


def test_what_the_ranks_recomputed_merges_and_is_kept_only_for_requests_not_yet_reported():
    """The workers' reports of a step (one per tensor-parallel rank) merge into one; the scheduler side keeps
    a request's until its response is made, and drops one for a request already reported (the real path,
    through vLLM, is ``test_prefix_cache.py::test_the_response_says_what_the_request_was_served``)."""
    pytest.importorskip("vllm", reason="the connector class needs vLLM (run in .venv-vllm)")
    from fusionrag.vllm.connector import FusionRAGServed
    from fusionrag.vllm.planning import Planner

    rank0 = FusionRAGServed({"a": {"chosen_share": 0.12, "recomputed_tokens": 12}})
    meta = rank0.aggregate(FusionRAGServed({"a": {"chosen_share": 0.12, "recomputed_tokens": 12},
                                            "b": {"chosen_share": 0.2, "recomputed_tokens": 30}}))
    assert meta.served == {"a": {"chosen_share": 0.12, "recomputed_tokens": 12},
                           "b": {"chosen_share": 0.2, "recomputed_tokens": 30}}
    planner = object.__new__(Planner)
    planner._plans, planner._served = {"a": None}, {}
    planner.served(meta.served)
    assert planner._served == {"a": meta.served["a"]}
