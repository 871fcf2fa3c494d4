"""``ratio="auto"`` (issue 50): each request recomputes what its question's attention says, sized by the store's
calibration; every door takes it and says the share it chose."""

from __future__ import annotations

import json
import math

import pytest
import torch

from fusionrag.cli import main
from fusionrag.models import load_model
from fusionrag.online.auto_ratio import AUTO, AutoRatio, is_auto, ratio_key
from fusionrag.online.calibration import calibrate, probe_questions, record
from fusionrag.online.engine import Engine
from fusionrag.online.policies import choose_top
from fusionrag.online.request import InvalidRequest, ReuseRequest
from fusionrag.retrieval.embedder import HashingEmbedder
from fusionrag.retrieval.knowledge import KnowledgeStore
from store_helpers import sample_store

QUESTION = "In which city was the discoverer of polonium born?"


def test_count_holds_the_mass_with_the_fewest_tokens_within_floor_and_ceiling():
    scores = torch.tensor([1.0, 6.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0])  # total 10
    assert AutoRatio(0.6, 0.0, 1.0).count(scores) == 1  # the 6 alone holds 60%
    assert AutoRatio(0.61, 0.0, 1.0).count(scores) == 2
    assert AutoRatio(1.0, 0.0, 1.0).count(scores) == 5  # every token with any attention
    assert AutoRatio(0.6, 0.3, 1.0).count(scores) == 3  # the floor
    assert AutoRatio(1.0, 0.0, 0.2).count(scores) == 2  # the ceiling
    assert AutoRatio(0.5, 0.1, 1.0).count(torch.zeros(10)) == 1  # no attention to go by: the floor
    nan = torch.tensor([float("nan"), 3.0, float("-inf"), 1.0])
    assert AutoRatio(0.75, 0.0, 1.0).count(nan) == 1
    assert AutoRatio(0.6, 0.0, 1.0).held(scores, 1) == pytest.approx(0.6)


def test_choose_top_takes_the_best_scored_and_a_number_is_unchanged():
    cand = torch.arange(10, 20)
    scores = torch.tensor([0.0, 5, 0, 0, 3, 0, 0, 1, 0, 1])
    assert choose_top(lambda: scores, cand, AUTO, AutoRatio(0.8, 0.0, 1.0)).tolist() == [11, 14]
    assert choose_top(lambda: scores, cand, 0.3).tolist() == [11, 14, 17]
    never = pytest.fail  # neither extreme scores anything
    assert choose_top(never, cand, 1.0).tolist() == cand.tolist() and choose_top(never, cand, 0.0).numel() == 0


@pytest.mark.parametrize("bad", [AutoRatio, lambda: AutoRatio(0.0), lambda: AutoRatio(0.5, 0.6, 0.5)])
def test_an_impossible_setting_is_refused(bad):
    if bad is AutoRatio:
        assert AutoRatio().mass > 0
        return
    with pytest.raises(ValueError, match="auto ratio needs"):
        bad()


def test_every_door_checks_auto_once():
    assert ReuseRequest("q", "fusionrag", "auto").validated().ratio == AUTO
    assert ReuseRequest("q", "auto", "AUTO").validated().ratio == AUTO  # method auto runs fusionrag (or full)
    assert ReuseRequest("q", "full", "auto").validated().ratio == 1.0
    assert ReuseRequest("q", "reuse", "auto").validated().ratio == 0.0
    with pytest.raises(InvalidRequest, match="give cacheblend a number") as err:
        ReuseRequest("q", "cacheblend", "auto").validated()
    assert err.value.code == "invalid_ratio"
    with pytest.raises(InvalidRequest, match='or "auto"'):
        ReuseRequest("q", "fusionrag", "most").validated()
    assert ratio_key(0.15, AutoRatio()) == "0.150000" and ratio_key(AUTO, AutoRatio(0.7)).startswith("auto:0.7:")
    assert is_auto(" Auto ") and not is_auto(0.5)


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory):
    return sample_store(tmp_path_factory.mktemp("auto") / "store")


def _engine(store_dir) -> Engine:
    lm = load_model("tiny-llama")
    return Engine(KnowledgeStore.open(store_dir, lm, embedder=HashingEmbedder()), lm)


def test_auto_recomputes_what_its_setting_counts_and_says_the_share(store_dir):
    engine = _engine(store_dir)
    engine.auto_ratio = AutoRatio(0.5, 0.0, 1.0)
    low = engine.answer(QUESTION, ratio="auto", top_k=3, max_new_tokens=2)
    engine.auto_ratio = AutoRatio(0.95, 0.0, 1.0)
    high = engine.answer(QUESTION, ratio="auto", top_k=3, max_new_tokens=2)
    assert 0 < low.recomputed_tokens < high.recomputed_tokens <= high.context_tokens
    assert isinstance(low.ratio, float) and 0.0 < low.ratio < high.ratio <= 1.0
    body = high.to_json()
    assert body["auto_ratio"] == {"mass": 0.95, "floor": 0.0, "ceiling": 1.0, "calibrated": False}
    fixed = engine.answer(QUESTION, ratio=0.15, top_k=3, max_new_tokens=2)
    assert fixed.ratio == 0.15 and fixed.to_json()["auto_ratio"] is None


def test_auto_at_the_whole_context_is_full_attention(store_dir):
    """Exactness: an auto setting that recomputes every candidate reproduces Full Attention (fp32, 1e-4)."""
    engine = _engine(store_dir)
    engine.auto_ratio = AutoRatio(1.0, 1.0, 1.0)
    full = engine.answer(QUESTION, method="full", top_k=3, max_new_tokens=1)
    auto = engine.answer(QUESTION, ratio="auto", top_k=3, max_new_tokens=1)
    assert auto.ratio == 1.0
    assert (auto.first_logits - full.first_logits).abs().max() < 1e-4


def test_calibration_writes_the_store_setting_every_engine_reads(store_dir):
    engine = _engine(store_dir)
    questions = probe_questions(engine.store, 3)
    assert len(questions) == 3 and all(q.startswith("What do the documents say about") for q in questions)
    result = calibrate(engine, samples=3, masses=(0.5, 0.9))
    assert result.auto.mass in (0.5, 0.9) and result.samples == 3
    assert [g["mass"] for g in result.grid] == [0.5, 0.9]
    assert all(g["kl"] >= 0 and 0 <= g["share"] <= 1 for g in result.grid)
    assert result.reached == any(g["kl"] <= result.target_kl for g in result.grid)
    other = _engine(store_dir)  # a second engine on the store (another server) before the calibration lands
    assert not other.auto_ratio.calibrated
    record(engine, result)
    assert _engine(store_dir).auto_ratio.mass == result.auto.mass
    assert other.follow_store() and other.auto_ratio.calibrated  # a running engine takes it in on its next request
    assert other.auto_ratio.calibration["samples"] == 3
    from fusionrag.retrieval.store_info import store_info

    shown = store_info(store_dir)["auto_ratio"]  # `fusionrag store info` says what auto runs with
    assert shown["mass"] == result.auto.mass and "grid" not in shown["calibration"]


def test_calibrate_command_prints_and_records(store_dir, capsys):
    assert main(["calibrate", "--store", str(store_dir), "--samples", "2", "--json", "--dry-run"]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert 0 < printed["mass"] <= 1 and math.isfinite(printed["calibration"]["fixed_kl"])


def test_auto_kv_is_kept_apart_from_a_fixed_ratios_and_another_settings():
    """vLLM's prefix cache (salted per mode) and our context cache key ``auto`` by its setting: an auto request never
    reads blocks a fixed ratio (or another calibration) computed, and the other way round."""
    from fusionrag.vllm.isolation import mode_salt

    salts = {mode_salt("fusionrag", ratio_key(AUTO, AutoRatio(m)), 3) for m in (0.6, 0.7)}
    salts |= {mode_salt("fusionrag", 0.15, 3), mode_salt("fusionrag", 0.6, 3)}
    assert len(salts) == 4
