"""The records file and the Full Attention cache: what a quality run keeps on disk between runs."""

import dataclasses
import json

import torch

from bench_helpers import sample_data
from fusionrag.bench.datasets import load_questions
from fusionrag.bench.kb_stores import store_name
from fusionrag.bench.quality import QualitySpec
from fusionrag.bench.records import (
    FullCache,
    append_record,
    example_sha,
    read_records,
    supersede_other_kb_records,
)


def test_full_attention_cache_is_verified_against_the_question_and_passages(tmp_path):
    ex = load_questions(sample_data(tmp_path))[0]
    cache = FullCache(tmp_path / "cache", "m")
    cache.put("hotpotqa", ex.id, 4, "answer", torch.zeros(3), {"input_sha": example_sha(ex)})
    assert cache.get("hotpotqa", ex.id, 4, example_sha(ex))[0] == "answer"
    other = dataclasses.replace(ex, passages=ex.passages[:-1])  # same id, other input: a miss, not a wrong reference
    assert cache.get("hotpotqa", ex.id, 4, example_sha(other)) is None


def _record(dataset: str, qid: str, method: str, kv: str, top_n: int, kb: str | None) -> dict:
    return {"dataset": dataset, "qid": qid, "run": f"{method}|{kv}|0|{top_n}", "method": method, "kv": kv,
            "top_n": top_n, "kb": kb}  # fmt: skip


def test_records_skip_a_cut_line_and_only_store_reading_records_of_another_kb_are_superseded(tmp_path):
    spec = QualitySpec(data=[], out=tmp_path, model="m", limit=2)
    current = store_name(spec, "hotpotqa", 1)
    recs = [
        _record("hotpotqa", "a", "reuse", "plain", 0, None),  # plain KV: independent of the knowledge base
        _record("hotpotqa", "a", "reuse", "fused", 1, current),
        _record("hotpotqa", "b", "reuse", "fused", 1, "m-hotpotqa-n1-top1-nearest_first"),  # another store: stale
        _record("musique", "c", "reuse", "fused", 1, "old"),  # another dataset: not this call's business
    ]
    path = tmp_path / "records.jsonl"
    for r in recs:
        append_record(path, r)
    with open(path, "a", encoding="utf-8") as f:
        f.write('{"dataset": "hot')  # cut by an interruption: that cell is redone, the rest is read
    assert list(read_records(path).values()) == recs
    assert supersede_other_kb_records(path, spec, "hotpotqa") == 1
    moved = [json.loads(line) for line in (tmp_path / "records.superseded.jsonl").read_text().splitlines()]
    assert moved == [recs[2]]
    assert list(read_records(path).values()) == [recs[0], recs[1], recs[3]]
    assert supersede_other_kb_records(path, spec, "hotpotqa") == 0  # nothing left to move
