"""The pasting-pipeline benchmark's report (``benchmarks/frameworks/pasted_ttft.py``) on synthetic runs: the
warm-up round left out, medians per question, the ratio, chunks added and the precomputed share; a real PNG."""

from __future__ import annotations

from bench_helpers import assert_png, load_script


def _usage(added: int, precomputed: int, context: int) -> dict:
    sources = [{"chunk_id": i, "score": 0.5 if i < added else None} for i in range(10)]
    return {"prompt_tokens": context + 50, "prompt_tokens_details": {"cached_tokens": precomputed},
            "fusionrag": {"sources": sources, "precomputed_tokens": precomputed, "context_tokens": context,
                          "method": "fusionrag", "reused_chunks": 10 - added, "reused_tokens": precomputed,
                          "computed_chunks": added}}


def test_pasted_report_leaves_out_the_warm_up_and_pairs_each_question(tmp_path):
    pasted = load_script("benchmarks/frameworks/pasted_ttft.py")
    rows = []
    for rnd in range(3):
        for q, (full, fast) in enumerate([(8.0, 2.0), (9.0, 3.0)]):
            slow = 10.0 if rnd == 0 else 1.0  # the warm-up round: not measured
            rows.append({"round": rnd, "question": q, "cell": "full", "seconds": full * slow, "usage": _usage(0, 0, 1)})
            rows.append({"round": rnd, "question": q, "cell": "fusionrag", "seconds": fast,
                         "usage": _usage(1 if rnd == 0 else 0, 950, 1000)})
    s = pasted.summarise(rows)
    assert s["n_questions"] == 2 and s["rounds"] == 2 and s["chunks_added_max"] == 0
    assert s["ratio"]["per_question"] == [4.0, 3.0] and s["ttft_full_s"] == 8.5
    assert s["precomputed_share_min"] == 0.95 and s["question_tokens_median"] == 50
    assert s["cached_tokens_median"] == 950 and s["cached_equals_reused"] and s["full_cached_tokens_max"] == 0
    assert s["computed_chunks_first_max"] == 1  # the warm-up round's, reported apart
    meta = {"command": "pasted_ttft.py --out x", "model": "qwen2.5-0.5b", "threads": 1, "top_k": 10,
            "data": "d.jsonl", "haystack": "3.4.1", "machine": {"cpu_model": "test CPU"}}
    pasted.write_report({"meta": meta, "summary": s, "rows": rows}, tmp_path)
    text = (tmp_path / "README.md").read_text()
    assert "| chunks the server added that the pipeline did not paste (max over requests) | 0 |" in text
    assert "**3.50x**" in text
    assert_png(tmp_path / "pasted_ttft.png")
