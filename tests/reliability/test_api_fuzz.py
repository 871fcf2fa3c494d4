"""A real fuzzer against the live server: schemathesis generates request bodies from the server's own OpenAPI
schema (chat completions, text completions, documents) and sends them to 127.0.0.1. Bounded: a fixed number
of examples per route and a deadline; the server must answer every one below 500 and stay healthy, its memory
bounded. Skipped, saying so, where schemathesis is not installed."""

from __future__ import annotations

import resource
import time

import pytest

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is not installed (the 'dev' extra)")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fusionrag.serve.app import create_app  # noqa: E402
from fusionrag.serve.server_thread import ServerThread  # noqa: E402
from fusionrag.serve.settings import ServerSettings  # noqa: E402
from serve_helpers import store_factory  # noqa: E402

pytestmark = pytest.mark.slow
ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/documents"]
EXAMPLES = 700  # per route: 3 routes -> at least 2,000 requests
SENT: dict[str, list] = {"status": [], "start": []}


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    limits = ServerSettings(default_max_tokens=2, max_new_tokens=4, max_documents=8, max_document_chars=400,
                            max_prompt_tokens=2048, max_job_chunks=16, max_job_tokens=4096, request_timeout_s=30)
    app = create_app(store_factory(tmp_path_factory.mktemp("fuzz") / "kb", fuse=False), limits)
    app.state.scheduler.wait_ready(120)
    with ServerThread(app) as server:
        yield server


@pytest.fixture(scope="module")
def api_schema(live):
    """The live server's own OpenAPI schema, read over HTTP as any client would."""
    return schemathesis.openapi.from_url(f"{live.base_url}/openapi.json")


@pytest.mark.parametrize("route", ROUTES)
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(data=st.data())
def test_no_generated_request_is_a_server_error(live, api_schema, route, data):
    """Bodies generated from the schema (valid ones and, by schemathesis' negative mode, invalid ones)."""
    case = data.draw(api_schema[route]["POST"].as_strategy())
    if not SENT["start"]:
        SENT["start"].append(time.monotonic())
    response = case.call(base_url=live.base_url, timeout=30)
    SENT["status"].append(response.status_code)
    assert response.status_code < 500, f"POST {route}: {response.status_code} {response.text[:300]}"


def test_the_fuzzed_server_is_healthy_and_bounded(live):
    import httpx

    n = len(SENT["status"])
    if n == 0:
        pytest.skip("the fuzzing test did not run (deselected)")
    seconds = time.monotonic() - SENT["start"][0]
    print(f"fuzz: {n} requests in {seconds:.0f} s; 5xx: {sum(s >= 500 for s in SENT['status'])}; "
          f"by status: {sorted({s: SENT['status'].count(s) for s in set(SENT['status'])}.items())}")
    assert n >= 2000 and all(s < 500 for s in SENT["status"])
    assert httpx.get(f"{live.base_url}/health", timeout=10).status_code == 200
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss < 6 * 1024 * 1024  # KiB: under 6 GiB peak
