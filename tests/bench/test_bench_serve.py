"""The load test (``fusionrag bench serve``) against a real server: bounded, loopback only, well-formed reports."""

from __future__ import annotations

import json

import pytest

from fusionrag.bench.loadtest import check_loopback, closed_loop, parse_method, question_items, run_load_test
from fusionrag.errors import FusionRAGError
from serve_helpers import PASSAGES, live_server


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    with live_server(tmp_path_factory) as pair:
        yield pair


def test_load_test_reports_ttft_and_throughput(live, tmp_path):
    _, base_url = live
    report = run_load_test(base_url, ["Who discovered polonium?", {"question": "Capital of France?",
                                                                      "documents": PASSAGES[1:3]}],
                           rates=[20.0, 40.0], methods=["full", "fusionrag:0.15"], n_requests=3, duration_s=5,
                           out_dir=tmp_path, max_tokens=4, api_key="test-key", timeout_s=60, warmup=1)
    assert len(report["cells"]) == 4
    for cell in report["cells"]:
        assert cell["ok"] == cell["sent"] == 3, cell
        assert 0 < cell["ttft_ms_p50"] <= cell["ttft_ms_p95"]
        assert cell["throughput_rps"] > 0 and cell["throughput_tok_s"] > 0
    assert json.loads((tmp_path / "loadtest.json").read_text())["cells"] == report["cells"]
    assert "TTFT p50" in (tmp_path / "loadtest.md").read_text()
    assert (tmp_path / "loadtest.png").stat().st_size > 1000


def test_closed_loop_keeps_its_clients_busy_and_stops_at_its_bounds(live):
    """Each client sends its next request when its last one ended: 5 requests by 2 clients, all answered."""
    _, base_url = live
    items = [{"question": "Capital of France?", "documents": PASSAGES[1:3]}, "Who discovered polonium?"]
    cell = closed_loop(base_url, items, "fusionrag:0.15", clients=2, duration_s=30, n_requests=5, max_tokens=2,
                       api_key="test-key", timeout_s=60)
    assert cell["clients"] == 2 and cell["sent"] == cell["ok"] == 5 and not cell["errors"]
    assert 0 < cell["ttft_ms_p50"] <= cell["ttft_ms_p99"] and 0 < cell["completion_tokens"] <= 10
    assert 0 < cell["window_s"] <= cell["wall_s"] and cell["throughput_rps"] > 0 and cell["prompt_tokens_p50"] > 0
    with pytest.raises(FusionRAGError, match="loopback"):
        closed_loop("http://10.0.0.1:8000", items, "full")


def test_load_test_stays_on_loopback():
    with pytest.raises(FusionRAGError, match="loopback"):
        check_loopback("http://example.com:8000")
    check_loopback("http://127.0.0.1:8000")
    assert parse_method("cacheblend:0.15").ratio == 0.15 and parse_method("full").ratio == 1.0
    with pytest.raises(FusionRAGError):
        parse_method("nope")




def test_question_items_come_from_the_evaluation_reader(tmp_path):
    rows = [{"id": "q1", "question": "Who discovered polonium?", "answers": ["Marie Curie"], "passages": PASSAGES[:3]},
            {"id": "q2", "question": "Capital of France?", "answers": ["Paris"], "passages": []}]
    path = tmp_path / "mini.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    items = question_items(path, max_passages=2)
    assert items == [{"question": "Who discovered polonium?", "documents": PASSAGES[:2]},
                     {"question": "Capital of France?"}]
    assert question_items(path, limit=1, with_documents=False) == [{"question": "Who discovered polonium?"}]
    with pytest.raises(FusionRAGError):
        question_items(tmp_path / "missing.jsonl")
