"""The README's main job, ``fusionrag demo``, on a tiny model: warmed up, timed repeatedly, honest when noisy."""

from __future__ import annotations

from fusionrag.demo import NOISY_SPREAD, TIMINGS, run_demo, speedup_text


def test_the_demo_answers_every_method_with_repeated_timings(fusionrag_home, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # rich would wrap the title
    rows = run_demo("tiny-llama", max_new_tokens=2, limit=2, dtype="float32")
    assert [r["method"] for r in rows] == ["full", "reuse", "fusionrag"] * 2
    assert all(len(r["ttft_samples_ms"]) == TIMINGS and r["ttft_ms"] > 0 for r in rows)
    out = capsys.readouterr().out
    assert "computing in float32 (asked for)" in out and f"median of {TIMINGS}" in out


def test_a_noisy_or_slower_timing_is_called_noisy_not_a_speed_up():
    assert speedup_text("fusionrag", [100.0, 101.0, 99.0], 400.0) == ("4.0x", False)
    text, noisy = speedup_text("fusionrag", [100.0, 100.0 * NOISY_SPREAD * 1.1, 100.0], 400.0)
    assert noisy and text.startswith("noisy (100-")
    assert speedup_text("fusionrag", [500.0, 500.0, 510.0], 400.0)[1]  # slower than Full Attention: noisy
    assert speedup_text("full", [400.0, 401.0, 399.0], 400.0) == ("1.0x", False)
