"""The split benchmark's report (``benchmarks/frameworks/split_ttft.py``) and ``auto``'s share benchmark
(``benchmarks/reuse/auto_share.py``) on synthetic runs: the warm-up round left out, the first request apart,
medians per question, the shares of the context; real PNGs."""

from __future__ import annotations

from bench_helpers import assert_png, load_script


def _usage(precomputed: int, reused: int, context: int, stored: int, pieces: int) -> dict:
    sources = [{"chunk_id": i, "score": None, "stored": i < stored} for i in range(pieces)]
    return {"fusionrag": {"sources": sources, "precomputed_tokens": precomputed, "reused_tokens": reused,
                          "context_tokens": context, "method": "fusionrag"}}


def test_split_report_pairs_each_question_and_reports_the_first_request_apart(tmp_path):
    split = load_script("benchmarks/frameworks/split_ttft.py")
    rows = []
    for splitter in ("langchain", "llamaindex"):
        for rnd in range(3):
            for q, (full, fast) in enumerate([(8.0, 2.0), (9.0, 3.0)]):
                first = 2.0 if rnd == 1 else 1.0  # the first request of each prompt is slower
                for cell, seconds in (("full", full), ("fusionrag", fast * first)):
                    rows.append({"splitter": splitter, "round": rnd, "question": q, "cell": cell, "seconds": seconds,
                                 "splits": 90, "usage": _usage(960, 800, 1000, 15, 16)})
    s = split.summarise(rows)
    lc = s["langchain"]
    assert lc["n_questions"] == 2 and lc["rounds"] == 2 and lc["splits"] == 90
    assert lc["first_request_ratio"]["per_question"] == [2.0, 1.5] and lc["ratio"]["per_question"] == [8 / 3, 2.0]
    assert lc["precomputed_share_min"] == 0.96 and lc["reused_share_median"] == 0.8
    assert lc["stored_pieces_median"] == 15 and lc["pieces_median"] == 16 and lc["chunks_added_max"] == 0
    meta = {"command": "split_ttft.py --out x", "model": "qwen2.5-0.5b", "threads": 1, "data": "d.jsonl",
            "files": 7, "chunks": 79, "top_k": {"langchain": 12, "llamaindex": 5}, "versions": "x 1",
            "machine": {"cpu_model": "test CPU"}}
    split.write_report({"meta": meta, "summary": s, "rows": rows}, tmp_path)
    text = (tmp_path / "README.md").read_text()
    assert "**96%** / 96%" in text and "**1.75x**" in text and "90 / 12" in text
    assert_png(tmp_path / "split_ttft.png")


def test_auto_share_report_gives_the_ratio_per_share(tmp_path):
    auto = load_script("benchmarks/reuse/auto_share.py")
    rows = [{"round": r, "share": share, "context": k, "method": m, "context_tokens": 1200,
             "ready_share": share,
             "seconds": (8.0 if m == "full" else 8.0 / (1 + 4 * share)) * (1 + 0.01 * k)}
            for r in range(3) for share in (0.0, 0.5, 1.0) for k in range(3) for m in ("full", "fusionrag")]
    s = auto.summarise(rows)
    assert [round(x["ratio"], 6) for x in s] == [1.0, 3.0, 5.0] and all(x["n"] == 3 for x in s)
    meta = {"command": "auto_share.py", "model": "qwen2.5-0.5b", "dtype": "bfloat16", "tokens": 1200, "rounds": 3,
            "store": "kb", "auto_min_ready": 0.25, "machine": {"cpu_model": "test CPU"}}
    from fusionrag.bench.provenance import write_report_files

    doc = {"meta": meta, "summary": s, "rows": rows}
    write_report_files(tmp_path, "auto_share", doc, auto.markdown(doc), lambda p: auto.plot(doc, p))
    assert "**3.00x**" in (tmp_path / "README.md").read_text()
    assert_png(tmp_path / "auto_share.png")
