"""``/ui`` in a real headless browser: the page asks the live server and renders the answer.

Chromium (Debian's ``chromium`` package; ``scripts/setup.sh --test`` and ``.ci/run`` install it)
loads ``/ui?q=...``, whose script posts the question to ``/v1/chat/completions``, fills in
the answer and the TTFT table, and inlines the ``/v1/explain`` page of that answer. The
rendered DOM (``--dump-dom``, after the page's network work) must contain all three; a
screenshot is taken too. Skipped, with the reason, when no Chromium is installed.
"""

from __future__ import annotations

import html
import os
import re
import shutil
import subprocess
import urllib.parse
from pathlib import Path

import pytest

from serve_helpers import live_small_server, serial

Q = "Who discovered polonium?"
#: Set to a path (e.g. benchmarks/frontdoor/results/ui.png) to keep the screenshot.
SCREENSHOT_ENV = "FUSIONRAG_UI_SCREENSHOT"


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("no Chromium: install it (apt-get install -y chromium; scripts/setup.sh does) to run the UI test")


def headless(browser: str, url: str, *extra: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
    args = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
            "--disable-extensions", "--virtual-time-budget=60000", "--window-size=1100,1100", *extra, url]
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    with live_small_server(tmp_path_factory) as (app, base):
        yield app, base


def test_ui_renders_an_answer_with_ttft_and_recomputed_tokens(live, tmp_path):
    browser = chromium()
    app, base = live
    query = urllib.parse.urlencode({"q": Q, "method": "fusionrag", "ratio": "0.3", "retrieval_top_k": "2"})
    url = f"{base}/ui?{query}"
    run = headless(browser, url, "--dump-dom", f"--user-data-dir={tmp_path / 'profile'}")
    assert run.returncode == 0, run.stderr[-2000:]
    dom = run.stdout
    ref = serial(app, Q, 32, method="fusionrag", ratio=0.3, top_k=2)
    answer = re.search(r'<div id="answer">(.*?)</div>', dom, re.DOTALL)
    assert answer is not None, dom[-3000:]
    assert html.unescape(answer.group(1)) == (ref.text or "(empty answer)")
    assert "ttft-table" in dom and "recompute" in dom  # the TTFT breakdown
    assert dom.count("<mark>") >= 1 and 'class="chunk"' in dom  # the recomputed tokens, highlighted
    assert f"{ref.recomputed_tokens} of {ref.context_tokens} context tokens recomputed" in dom

    auto = urllib.parse.urlencode({"q": Q, "method": "fusionrag", "ratio": "auto", "retrieval_top_k": "2"})
    run = headless(browser, f"{base}/ui?{auto}", "--dump-dom", f"--user-data-dir={tmp_path / 'profile-auto'}")
    ref = serial(app, Q, 32, method="fusionrag", ratio="auto", top_k=2)  # issue 50: the field takes "auto" too
    assert run.returncode == 0 and f"ratio {ref.ratio:.3f} (auto): {ref.recomputed_tokens} of" in run.stdout, \
        run.stdout[-3000:]

    shot = Path(os.environ.get(SCREENSHOT_ENV) or tmp_path / "ui.png")
    shot.parent.mkdir(parents=True, exist_ok=True)
    run = headless(browser, url, f"--screenshot={shot}", f"--user-data-dir={tmp_path / 'profile2'}")
    assert run.returncode == 0 and shot.stat().st_size > 10_000, run.stderr[-2000:]
