"""The Engine answer path end to end on a tiny model and a tiny store (no downloads)."""

import json

import pytest
import studies.peers.ape  # noqa: F401  (the plugin registers the study method ape)
import torch

from fusionrag.cli import main
from fusionrag.errors import FusionRAGError
from fusionrag.models import load_model
from fusionrag.offline import build
from fusionrag.online.engine import Engine
from fusionrag.retrieval.embedder import HashingEmbedder
from fusionrag.retrieval.knowledge import KnowledgeStore
from fusionrag.sample import load_sample
from store_helpers import sample_store


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory):
    return sample_store(tmp_path_factory.mktemp("kb") / "store")


@pytest.fixture(scope="module")
def engine(store_dir):
    lm = load_model("tiny-llama")
    return Engine(KnowledgeStore.open(store_dir, lm, embedder=HashingEmbedder()), lm)


QUESTION = "In which city was the discoverer of polonium born?"


@pytest.mark.parametrize("method", ["full", "reuse", "fusionrag", "cacheblend", "cachecraft", "epic", "prophetkv",
                                    "ape"])
def test_every_method_answers_with_breakdown(engine, method):
    res = engine.answer(QUESTION, method=method, ratio=0.15, top_k=3, max_new_tokens=4)
    assert len(res.chunk_ids) == 3 and all(c is not None for c in res.chunk_ids)
    assert set(res.ttft_ms) >= {"retrieve", "load", "select", "recompute", "first_token", "total"}
    expected = {"full": res.context_tokens, "reuse": 0, "ape": 0}.get(method)
    if expected is not None:
        assert res.recomputed_tokens == expected
    else:
        assert 0 < res.recomputed_tokens <= res.context_tokens
    assert res.kv == {"full": "none", "fusionrag": "plain-first"}.get(method, "plain")


def test_ratio_one_equals_full_and_fused_kv_differs_from_plain(engine):
    full = engine.answer(QUESTION, method="full", top_k=3, max_new_tokens=1)
    for method in ("fusionrag", "cacheblend"):
        one = engine.answer(QUESTION, method=method, ratio=1.0, top_k=3, max_new_tokens=1)
        assert (one.first_logits - full.first_logits).abs().max() < 1e-4
    plain = engine.answer(QUESTION, method="reuse", top_k=3, kv="plain", max_new_tokens=1)
    fused = engine.answer(QUESTION, method="reuse", top_k=3, kv="fused", max_new_tokens=1)
    assert not torch.allclose(plain.first_logits, fused.first_logits)
    assert fused.fused_fallbacks == 0


def test_plain_first_reuses_plain_kv_for_the_first_chunk_and_fused_for_the_rest(engine):
    """``plain-first``: the first chunk's plain KV is exactly Full Attention's; the others are fused."""
    kw = dict(top_k=3, max_new_tokens=1)
    mixed = engine.prepare(QUESTION, method="reuse", kv="plain-first", top_k=3)
    plain = engine.prepare(QUESTION, method="reuse", kv="plain", top_k=3)
    fused = engine.prepare(QUESTION, method="reuse", kv="fused", top_k=3)
    (a, b), rest = mixed.pre.spans[0], mixed.pre.spans[1][0]
    assert torch.equal(mixed.pre.kv.keys[:, :, a:b], plain.pre.kv.keys[:, :, a:b])
    assert torch.equal(mixed.pre.kv.keys[:, :, rest:rest + 5], fused.pre.kv.keys[:, :, rest:rest + 5])
    assert not torch.equal(mixed.pre.kv.keys[:, :, a:b], fused.pre.kv.keys[:, :, a:b])
    assert mixed.fused_fallbacks == 0
    full = engine.answer(QUESTION, method="full", **kw)
    one = engine.answer(QUESTION, method="fusionrag", ratio=1.0, kv="plain-first", **kw)
    assert (one.first_logits - full.first_logits).abs().max() < 1e-4


def test_plain_first_reads_the_first_chunk_fused_when_the_store_dropped_plain_kv(store_dir, tmp_path):
    """A fused-only store has no plain KV to read: the first chunk is served fused, not recomputed."""
    import shutil

    from fusionrag.offline import compact

    lm = load_model("tiny-llama")
    shutil.copytree(store_dir, tmp_path / "slim")
    slim = KnowledgeStore.open(tmp_path / "slim", lm, embedder=HashingEmbedder())
    assert compact.drop_plain(slim)
    eng = Engine(slim, lm)
    ref = Engine(KnowledgeStore.open(store_dir, lm, embedder=HashingEmbedder()), lm)
    mixed = eng.prepare(QUESTION, method="reuse", kv="plain-first", top_k=3)
    fused = ref.prepare(QUESTION, method="reuse", kv="fused", top_k=3)
    assert mixed.fused_fallbacks == 0
    assert torch.equal(mixed.pre.kv.keys, fused.pre.kv.keys)
    assert eng.kinds_for(mixed.chunk_ids, "plain-first") == ["fused"] * 3
    assert ref.kinds_for(mixed.chunk_ids, "plain-first") == ["plain", "fused", "fused"]


def test_explicit_chunks_bypass_retrieval_and_unknown_passages_are_computed(engine):
    ex = load_sample()[1]
    known = engine.answer(ex["question"], method="reuse", chunks=ex["passages"], max_new_tokens=2)
    assert all(c is not None for c in known.chunk_ids)
    novel = [{"title": "Nowhere", "text": "A passage that is not in the store."}, *ex["passages"][:1]]
    res = engine.answer(ex["question"], method="fusionrag", kv="fused", chunks=novel, max_new_tokens=2)
    assert res.chunk_ids[0] is None and res.chunk_ids[1] is not None
    assert res.fused_fallbacks == 1  # the request-supplied passage has only a plain (S + chunk) KV
    first = engine.answer(ex["question"], method="fusionrag", chunks=novel, max_new_tokens=2)
    assert first.kv == "plain-first" and first.fused_fallbacks == 0  # the first chunk is read plain anyway


def test_stream_yields_the_answer_text(engine):
    streamed = "".join(engine.stream(QUESTION, method="reuse", top_k=2, max_new_tokens=6))
    assert streamed.strip() == engine.answer(QUESTION, method="reuse", top_k=2, max_new_tokens=6).text


@pytest.mark.parametrize("kwargs, message", [
    ({"method": "magic"}, "unknown method"),
    ({"ratio": 1.5}, "ratio"),
    ({"ratio": -0.1}, "ratio"),
])
def test_bad_requests_are_clear_errors(engine, kwargs, message):
    with pytest.raises(FusionRAGError, match=message):
        engine.answer(QUESTION, **kwargs)
    with pytest.raises(FusionRAGError, match="empty"):
        engine.answer("   ")


def test_ask_cli_json_and_explain(store_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("fusionrag.retrieval.embedder.get_embedder", lambda name=None: HashingEmbedder())
    page = tmp_path / "why.html"
    rc = main(["ask", QUESTION, "--store", str(store_dir), "--json", "--max-new-tokens", "3", "--top-k", "2",
               "--explain", str(page), "--method", "fusionrag"])
    assert rc == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["method"] == "fusionrag" and out["recomputed_tokens"] > 0 and "total" in out["ttft_ms"]
    assert [s["chunk_id"] for s in out["sources"]] == out["chunk_ids"] and len(out["sources"]) == 2
    assert all(s["title"] and s["source"] and isinstance(s["score"], float) for s in out["sources"])
    assert "loading tiny-llama over the store" in captured.err and "answering with method fusionrag" in captured.err
    html = page.read_text()
    assert "<mark>" in html and "of the selection" in html


def test_ask_by_default_says_what_it_chose_and_cites_its_sources(store_dir, capsys, monkeypatch):
    monkeypatch.setattr("fusionrag.retrieval.embedder.get_embedder", lambda name=None: HashingEmbedder())
    assert main(["ask", QUESTION, "--store", str(store_dir), "--max-tokens", "2", "--top-k", "2"]) == 0
    err = capsys.readouterr().err
    assert "auto: " in err and "[1] " in err and "[2] " in err and "score " in err  # a short context: full, said
    assert main(["ask", QUESTION, "--store", str(store_dir), "--max-tokens", "2", "--no-retrieval", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["chunk_ids"] == [] and out["method"] == "full" and "no passages" in out["note"]


@pytest.mark.parametrize("argv, message", [
    (["--method", "magic"], "invalid choice"),
    (["--ratio", "2"], "must be a number within [0, 1]"),
])
def test_ask_cli_errors_exit_nonzero_without_traceback(store_dir, capsys, argv, message):
    with pytest.raises(SystemExit) if "magic" in argv else _noop():
        rc = main(["ask", QUESTION, "--store", str(store_dir), *argv])
        assert rc == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_ask_on_missing_or_empty_store(tmp_path, capsys):
    assert main(["ask", "q?", "--store", str(tmp_path / "none")]) == 2
    assert "no knowledge store" in capsys.readouterr().err


class _noop:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_memory_tier_and_prefetch_give_identical_answers(store_dir):
    lm = load_model("tiny-llama")
    store = KnowledgeStore.open(store_dir, lm, embedder=HashingEmbedder())
    plain_engine = Engine(store, lm)
    tiered = Engine(store, lm, memory_budget_bytes=64 << 20)
    ref = plain_engine.answer(QUESTION, method="fusionrag", top_k=3, max_new_tokens=3)
    tiered.prefetch_chunks(ref.chunk_ids, kv="plain-first")  # what fusionrag reads by default
    first = tiered.answer(QUESTION, method="fusionrag", top_k=3, max_new_tokens=3)
    again = tiered.answer(QUESTION, method="fusionrag", top_k=3, max_new_tokens=3)
    assert first.token_ids == again.token_ids == ref.token_ids
    assert torch.equal(first.first_logits, ref.first_logits)
    stats = tiered.stats()["tiers"]["host"]
    assert stats.loads == 3  # each chunk read from disk once (by the prefetch), then served from memory
    assert stats.memory_hits + stats.inflight_hits >= 3


def test_device_tier_over_the_memory_tier_gives_identical_answers(store_dir):
    lm = load_model("tiny-llama")
    store = KnowledgeStore.open(store_dir, lm, embedder=HashingEmbedder())
    ref = Engine(store, lm).answer(QUESTION, method="fusionrag", top_k=3, max_new_tokens=3)
    tiered = Engine(store, lm, memory_budget_bytes=64 << 20, device_budget_bytes=32 << 20)
    for _ in range(2):
        got = tiered.answer(QUESTION, method="fusionrag", top_k=3, max_new_tokens=3)
        assert got.token_ids == ref.token_ids and torch.equal(got.first_logits, ref.first_logits)
    tiers = tiered.stats()["tiers"]
    assert tiers["device"].loads == 3 and tiers["device"].gets == 6  # each chunk copied up once
    assert tiers["device"].memory_hits >= 3  # at least the second answer from the device tier
    assert tiers["host"].loads == 3


def test_server_flag_puts_a_device_tier_over_the_memory_tier(store_dir):
    from fusionrag.serve.launch import engine_factory
    from fusionrag.serve.settings import load_settings

    settings = load_settings(None, memory_budget_mb=16, device_kv_budget_mb=8)
    engine = engine_factory(str(store_dir), "tiny-llama", settings.memory_budget_mb,
                            device_kv_budget_mb=settings.device_kv_budget_mb)()
    assert engine.kv_source.name == "device" and engine.kv_source.cache.max_bytes == 8 << 20
    assert set(engine.stats()["tiers"]) == {"device", "host"}


def test_memory_tier_never_serves_kv_that_a_re_fuse_replaced(tmp_path):
    """Regression: the memory tier kept returning a chunk's old fused KV after add + re-fuse changed it."""
    lm = load_model("tiny-llama")
    store = build.create_store(tmp_path / "kb", lm, chunk_tokens=4096, kv_dtype="float32",
                               embedder=HashingEmbedder())
    passages = [p for ex in load_sample() for p in ex["passages"]][:6]
    ids = build.add_passages(store, lm, passages, doc="first")
    build.fuse(store, lm, top_n=2, progress=False)
    engine = Engine(store, lm, memory_budget_bytes=64 << 20)
    keys = [(c, "fused") for c in dict.fromkeys(ids)]
    before = engine.kv_source.get_many(keys)  # now resident in the memory tier
    assert engine.stats()["tiers"]["host"].memory_items == len(keys)

    build.add_passages(store, lm, [{"title": p["title"], "text": p["text"] + " Again."} for p in passages], doc="more")
    report = build.fuse(store, lm, progress=False)
    changed = [k for k in report.changed_keys if k in keys]
    assert changed, "the added near-duplicates must change some neighbour lists"
    engine.invalidate(report.changed_keys)
    after = dict(zip(keys, engine.kv_source.get_many(keys), strict=True))
    for key, old in zip(keys, before, strict=True):
        on_disk = store.load_entry(*key).kv
        assert torch.equal(after[key].kv.keys, on_disk.keys)  # what the engine reuses is what the store holds
        assert torch.equal(old.kv.keys, on_disk.keys) == (key not in changed)


def test_stage_timings_come_from_the_engines_synchronised_clock(engine):
    """Every stage of the TTFT breakdown is read through the engine's clock (device-synchronised):
    with a fake clock each stage gets exactly the work charged to it, and they sum to the total."""
    from fusionrag.models.clock import StageClock

    ticks = iter(range(0, 10_000, 5))
    syncs = []
    old = engine.clock
    engine.clock = lambda: StageClock(now=lambda: next(ticks) / 1000.0, sync=lambda: syncs.append(1))
    try:
        res = engine.answer(QUESTION, method="fusionrag", ratio=0.15, top_k=2, max_new_tokens=2)
    finally:
        engine.clock = old
    t = res.ttft_ms
    assert [round(t[k], 9) for k in ("retrieve", "load", "select", "recompute", "first_token")] == [5.0] * 5
    assert abs(t["total"] - 30.0) < 1e-9 and len(syncs) == 8  # the prefill's clock: 6, the first pick's: 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here: stage timings on CUDA need a GPU")
def test_stage_timings_on_cuda_sum_to_the_total_and_to_the_wall_clock(store_dir):
    """On CUDA every stage is charged its own kernels, so the stages sum to the total
    and the total is what a wall clock around the (synchronised) call reads, within 2%."""
    import time

    from fusionrag.models.clock import device_sync

    lm = load_model("tiny-llama", device="cuda")
    engine = Engine(KnowledgeStore.open(store_dir, lm, embedder=HashingEmbedder()), lm)
    sync = device_sync(lm.device)
    engine.prepare(QUESTION, method="fusionrag", ratio=0.15, top_k=3)  # warm-up: kernels, allocator
    for _ in range(3):
        sync()
        t0 = time.perf_counter()
        req = engine.prepare(QUESTION, method="fusionrag", ratio=0.15, top_k=3)
        sync()
        wall = (time.perf_counter() - t0) * 1000.0
        t = req.ttft_ms
        parts = sum(t[k] for k in ("retrieve", "load", "select", "recompute", "first_token"))
        assert abs(parts - t["total"]) <= 0.02 * t["total"], t
        assert t["total"] <= wall and wall - t["total"] <= 0.02 * wall + 1.0, (wall, t)


def test_prepare_is_a_scheduled_request_of_one_token(engine):
    """Issue 48: ``prepare`` runs the request through the scheduler (the path users run) for one token: the first
    token is the greedy pick of the prefill's logits, the request ends finished and keeps its prompt KV."""
    from fusionrag.execution.generate import greedy_tokens
    from fusionrag.online.request import ReuseRequest
    from fusionrag.online.state import Request, Status

    req = engine.prepare(ReuseRequest(QUESTION, "fusionrag", 0.15, top_k=2))
    assert isinstance(req, Request) and req.kv == "plain-first"
    assert req.status in (Status.FINISHED_LENGTH, Status.FINISHED_STOPPED)
    assert req.first_token == int(req.pre.last_logits.argmax()) and req.token_ids in ([req.first_token], [])
    ids = list(greedy_tokens(engine.lm, req.pre.kv, req.pre.last_logits, 3))
    answer = engine.answer(ReuseRequest(QUESTION, "fusionrag", 0.15, top_k=2), max_new_tokens=3)
    assert answer.token_ids == ids[:len(answer.token_ids)] and answer.text == engine.lm.tokenizer.decode(
        answer.token_ids, skip_special_tokens=True).strip()
    assert len(answer.pre.kv) == 0  # the decoder took the KV: the finished request no longer holds it

