"""The fault load run end to end on a tiny model and a few requests (the real run is a benchmark)."""

from __future__ import annotations

import json

import pytest

from fusionrag.bench.faults import FaultSpec, run_faults


@pytest.mark.slow  # seconds of real subprocesses
def test_fault_run_loses_nothing_and_reports_every_class(tmp_path, fusionrag_home):
    report = run_faults(FaultSpec(out=tmp_path / "out", model="tiny-llama", requests=12, load=2.0, job_every=4,
                                  max_tokens=2, timeout_s=60, max_wall_s=120))
    assert report["chats"]["sent"] == 12
    assert set(report["chats"]["status"]) <= {"200", "429"} and report["chats"]["status"].get("200", 0) > 0
    assert report["malformed"] == [400]
    assert report["jobs"]["finished"] == {"ready": 3}
    assert report["store"]["entries_lost"] == 0 and report["store"]["damaged_detected"] <= 1
    assert report["store"]["entries_after"] > report["store"]["entries_before"]  # the jobs' chunks were added
    saved = json.loads((tmp_path / "out" / "faults.json").read_text())
    assert saved["store"] == report["store"] and (tmp_path / "out" / "faults.png").stat().st_size > 1000
    assert "entries lost | 0" in (tmp_path / "out" / "faults.md").read_text()
