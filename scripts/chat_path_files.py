"""Which of fusionrag's source files one chat request runs through, on every thread (issue 48's measure).

    .venv/bin/python scripts/chat_path_files.py [--json]

A served engine over the sample's passages (the tests' tiny model, ``tests/serve/serve_helpers.py``) answers
one warm-up chat request, then the same request again while a profiler records every Python function call of
every thread the process runs (the server's, the scheduler's model thread, the prefetch); prints how many
distinct ``fusionrag`` files were entered, and each with its number of calls.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "serve")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    from fastapi.testclient import TestClient

    import fusionrag
    from fusionrag.serve.app import create_app
    from fusionrag.serve.settings import ServerSettings
    from serve_helpers import store_factory

    package = str(Path(fusionrag.__file__).resolve().parent) + "/"
    on, calls = [False], collections.Counter()

    def profile(frame: Any, event: str, arg: Any) -> None:
        if on[0] and event == "call" and frame.f_code.co_filename.startswith(package):
            calls["fusionrag/" + frame.f_code.co_filename[len(package):]] += 1

    threading.setprofile(profile)  # every thread started from here on (the scheduler's too)
    sys.setprofile(profile)
    app = create_app(store_factory(Path(tempfile.mkdtemp()) / "kb"),
                     ServerSettings(default_max_tokens=4, max_prompt_tokens=4000))
    app.state.scheduler.wait_ready(120)
    app.state.scheduler.run_task(lambda: None).result(60)
    body = {"messages": [{"role": "user", "content": "Who found polonium?"}], "retrieval_top_k": 2}
    try:
        with TestClient(app) as client:
            client.post("/v1/chat/completions", json=body)  # warm: imports, caches, the first compile
            on[0] = True
            response = client.post("/v1/chat/completions", json=body)
            on[0] = False
            response.raise_for_status()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
        app.state.scheduler.close()
    if args.json:
        print(json.dumps({"files": len(calls), "calls": dict(sorted(calls.items()))}, indent=1))
    else:
        print(f"{len(calls)} fusionrag files entered by one chat request")
        for name, n in sorted(calls.items()):
            print(f"{n:6d}  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
