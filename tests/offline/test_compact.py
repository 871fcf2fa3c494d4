"""Fused-only stores and KV dtype conversion (offline/compact.py)."""

from __future__ import annotations

import pytest

from fusionrag.errors import FusionRAGError
from fusionrag.models import load_model
from fusionrag.offline import build, compact
from fusionrag.retrieval.embedder import HashingEmbedder

PASSAGES = [
    {"title": "Paris", "text": "Paris is the capital of France. It lies on the Seine river."},
    {"title": "Lyon", "text": "Lyon is a city in France on the Rhone and Saone rivers."},
    {"title": "Berlin", "text": "Berlin is the capital of Germany. It lies on the Spree river."},
    {"title": "Cats", "text": "Cats are small domesticated carnivorous mammals that purr."},
]
MORE = [
    {"title": "Marseille", "text": "Marseille is a port city in France on the Mediterranean sea."},
    {"title": "Dogs", "text": "Dogs are domesticated descendants of wolves that bark."},
]


@pytest.fixture(scope="module")
def lm():
    return load_model("tiny-llama")


def _store(path, lm, dtype="float32"):
    s = build.create_store(path, lm, kv_dtype=dtype, embedder=HashingEmbedder(64))
    build.add_passages(s, lm, PASSAGES)
    build.fuse(s, lm, top_n=2, progress=False)
    return s


def _checksums(store, kind):
    return {c: (store.kv.header(c, kind) or {}).get("checksum") for c in store.chunk_ids()}


def test_fused_only_store_matches_a_full_store_through_incremental_updates(tmp_path, lm):
    full, slim = _store(tmp_path / "full", lm), _store(tmp_path / "slim", lm)
    with pytest.raises(FusionRAGError, match="fused store"):
        compact.set_plain_kv(build.create_store(tmp_path / "new", lm, embedder=HashingEmbedder(64)), "drop")
    compact.set_plain_kv(slim, "drop")
    removed = compact.drop_plain(slim)
    assert sorted(removed) == [(c, "plain") for c in sorted(slim.chunk_ids())]
    assert not slim.kv.files("plain") and len(slim.kv.files("fused")) == len(PASSAGES)

    # Serving on fused KV needs nothing else: same answer, same first-token logits.
    from fusionrag.online.engine import Engine

    a = Engine(full, lm).answer("What is the capital of France?", method="fusionrag", kv="fused", ratio=0.15,
                           max_new_tokens=4)
    b = Engine(slim, lm).answer("What is the capital of France?", method="fusionrag", kv="fused", ratio=0.15,
                           max_new_tokens=4)
    assert a.text == b.text and (a.first_logits - b.first_logits).abs().max() == 0

    # An incremental update re-creates the neighbours' plain KV it reads, fuses, and drops it again:
    # the fused entries are bit-identical to the ones a store that kept its plain KV makes.
    for s in (full, slim):
        build.add_passages(s, lm, MORE)
        report = build.fuse(s, lm, progress=False)
    assert report.new == len(MORE) and set(report.changed_keys) >= {(c, "plain") for c in slim.chunk_ids()
                                                                    if (c, "plain") in report.removed_keys}
    assert report.removed_keys and not slim.kv.files("plain")
    assert _checksums(slim, "fused") == _checksums(full, "fused")
    assert len(full.kv.files("plain")) == len(PASSAGES) + len(MORE)

    compact.set_plain_kv(slim, "keep")  # back to keeping plain KV: the next fuse re-creates all of it
    build.fuse(slim, lm, progress=False)
    assert _checksums(slim, "plain") == _checksums(full, "plain")
    full.close()
    slim.close()


def test_convert_to_int8_rewrites_every_chunk_entry_and_stays_current(tmp_path, lm):
    s = _store(tmp_path / "kb", lm, dtype="float16")
    before = {c: s.kv.load(c, "fused") for c in s.chunk_ids()}
    changed = compact.convert_kv_dtype(s, "int8")
    assert sorted(changed) == sorted((c, k) for c in s.chunk_ids() for k in ("plain", "fused"))
    assert s.settings["kv_dtype"] == "int8" and s.settings["converted_from"] == "float16"
    for c in s.chunk_ids():
        assert s.kv.header(c, "fused")["dtype"] == "int8"
        assert s.load_entry(c, "fused").scores is not None
        err = (s.kv.load(c, "fused").keys.float() - before[c].keys.float()).norm() / before[c].keys.float().norm()
        assert err < 0.02
    assert build.fuse(s, lm, progress=False).computed == 0  # converted entries are current: nothing re-fused
    assert compact.convert_kv_dtype(s, "int8") == []
    s.close()
