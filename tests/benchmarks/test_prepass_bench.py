"""``benchmarks/ttft/prepass_bench.py``'s timing pieces on a tiny model (the real run uses Qwen2.5-0.5B)."""

from __future__ import annotations

import pytest
import torch

from bench_helpers import load_script
from policy_helpers import selection_setup


def test_prepass_pieces_time_the_same_selection_and_split_the_pass(tiny_lm):
    bench = load_script("benchmarks/ttft/prepass_bench.py")
    *_, inp = selection_setup(tiny_lm)
    last = tiny_lm.num_layers - 1
    ref = bench.timed_select(tiny_lm, inp, last, True, 0.15, lambda: None)
    stopped = bench.timed_select(tiny_lm, inp, last, False, 0.15, lambda: None)
    assert torch.equal(ref["idx"], stopped["idx"])
    assert ref["select_ms"] == pytest.approx(ref["pass_ms"] + ref["score_ms"] + ref["topk_ms"])
    whole = bench.module_breakdown(tiny_lm, inp, last, True, 0.15, lambda: None)
    cut = bench.module_breakdown(tiny_lm, inp, last, False, 0.15, lambda: None)
    assert whole["LM head"] > 0 and whole["final norm"] > 0 and "LM head" not in cut and "final norm" not in cut
    assert min(whole["MLP"], cut["MLP"], cut["attention over the context"], cut["attention projections"]) > 0


def test_in_place_bench_times_both_passes_of_the_same_recompute(tiny_lm):
    """``benchmarks/ttft/in_place_bench.py``'s pieces: the two variants agree, and the switch is undone after."""
    from fusionrag.execution import recompute

    bench = load_script("benchmarks/ttft/in_place_bench.py")
    *_, inp = selection_setup(tiny_lm)
    call = bench.recompute_call(inp, inp.candidates[::5])
    seen = []
    real = recompute.forward_in_place_pieces
    recompute.forward_in_place_pieces = lambda *a: seen.append(1) or real(*a)
    try:
        old_ms, old = bench.run_variant("past + new", call, lambda: None)
        new_ms, new = bench.run_variant("in place", call, lambda: None)
    finally:
        recompute.forward_in_place_pieces = real
    assert seen == [1]  # only the "in place" variant took the in-place pass
    assert old_ms > 0 and new_ms > 0 and recompute.in_place_available(tiny_lm)
    diff = bench.compare(new, old)
    assert diff["max_abs_logit_diff"] < 1e-5 and diff["max_abs_kv_diff"] < 1e-5 and diff["same_first_token"]
