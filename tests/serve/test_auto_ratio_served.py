"""``ratio: "auto"`` through the server (issue 50): a request body, the server default (``--ratio auto``), the
share chosen in ``usage.fusionrag``; a ratio no method can run is a 400 naming it."""

from __future__ import annotations

from fastapi.testclient import TestClient

from fusionrag.serve.app import create_app
from fusionrag.serve.settings import ServerSettings, load_settings
from serve_helpers import PASSAGES, USER, error_of, store_factory


def test_auto_in_a_body_and_as_the_default_says_the_share_it_chose(tmp_path):
    app = create_app(store_factory(tmp_path / "kb"), ServerSettings(default_max_tokens=2, default_ratio="auto",
                                                                    default_method="fusionrag"))
    with TestClient(app) as client:
        app.state.scheduler.wait_ready(120)
        for body in ({"messages": USER, "documents": PASSAGES}, {"messages": USER, "documents": PASSAGES,
                                                                  "ratio": "auto"}):
            out = client.post("/v1/chat/completions", json=body)
            assert out.status_code == 200, out.text
            usage = out.json()["usage"]["fusionrag"]
            assert isinstance(usage["ratio"], float) and 0.0 < usage["ratio"] <= 0.51  # the ceiling, rounded
            assert usage["auto_ratio"]["calibrated"] is False and usage["recomputed_tokens"] > 0
        fixed = client.post("/v1/chat/completions", json={"messages": USER, "documents": PASSAGES, "ratio": 0.3})
        assert fixed.json()["usage"]["fusionrag"]["ratio"] == 0.3
        assert fixed.json()["usage"]["fusionrag"]["auto_ratio"] is None
        error_of(client.post("/v1/chat/completions", json={"messages": USER, "ratio": "auto", "method": "epic"}),
                 400, "invalid_ratio")
        error_of(client.post("/v1/chat/completions", json={"messages": USER, "ratio": "some"}), 400, "invalid_ratio")


def test_the_server_setting_takes_auto_and_refuses_a_word_at_start():
    assert load_settings(default_ratio="auto").default_ratio == "auto"
    import pytest

    from fusionrag.errors import FusionRAGError

    with pytest.raises(FusionRAGError, match="invalid server setting default_ratio"):
        load_settings(default_ratio="most")
