"""The framework integrations installed without the engine: ``fusionrag-client`` in a venv without torch.

``scripts/setup.sh`` (``scripts/setup_client.sh``) makes ``.venv-client``: the ``clients/python``
distribution with its LangChain, LlamaIndex and Haystack extras, and no torch. This test runs code in
that environment (a subprocess) against a live ``fusionrag serve`` of this one on 127.0.0.1: ``import
torch`` fails there, ``from fusionrag.integrations.langchain import ...`` works as with the engine's
package, and a LangChain retriever + chat call, a LlamaIndex retriever and a Haystack pipeline get their
answers with the store's chunks reused. Skipped, saying why, without ``.venv-client`` (failed in CI:
``FUSIONRAG_CI=1``), and when its installed integrations are not this checkout's (rerun the setup).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from serve_helpers import live_small_server

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PYTHON = ROOT / ".venv-client" / "bin" / "python"
SOURCE = ROOT / "src" / "fusionrag" / "integrations"

#: Run in .venv-client first: what is installed there, as one JSON line.
PROBE = r"""
import importlib.metadata as md, importlib.util, json, pathlib
out = {"torch": importlib.util.find_spec("torch") is not None,
       "engine": importlib.util.find_spec("fusionrag.online") is not None,
       "heavy": [d.metadata["Name"] for d in md.distributions()
                 if d.metadata["Name"].lower() in ("torch", "transformers", "faiss-cpu", "sentence-transformers")]}
try:
    import torch  # noqa: F401
except ImportError:
    out["import_torch"] = "ImportError"
import fusionrag.integrations as integrations
out["files"] = {p.name: p.read_text() for p in pathlib.Path(integrations.__file__).parent.glob("*.py")}
print(json.dumps(out))
"""

#: Then what a user of the client package does against the server at sys.argv[1], as one JSON line.
CLIENT = r"""
import json, sys
url = sys.argv[1]
out = {}
from fusionrag.integrations.langchain import FusionRAGRetriever, chat_model, rag_chain, sources
retriever = FusionRAGRetriever(base_url=url, top_k=2)
docs = retriever.invoke("Who discovered polonium?")
msg = rag_chain(retriever, chat_model(url, model="tiny-llama", method="fusionrag", max_tokens=4, max_retries=0)).invoke(
    "Who discovered polonium?")
usage = msg.response_metadata["token_usage"]["fusionrag"]
out["langchain"] = {"docs": len(docs), "reused": usage["reused_chunks"], "chunks": usage["chunks"],
                    "sources": len(sources(msg)), "answer": isinstance(msg.content, str)}

from fusionrag.integrations.llamaindex import FusionRAGRetriever as LlamaRetriever
out["llamaindex"] = {"nodes": len(LlamaRetriever(url, top_k=2).retrieve("Who discovered polonium?"))}

from haystack import Pipeline
from fusionrag.integrations.haystack import FusionRAGGenerator, FusionRAGRetriever as HaystackRetriever
pipe = Pipeline()
pipe.add_component("retriever", HaystackRetriever(url, top_k=2))
pipe.add_component("llm", FusionRAGGenerator(url, model="tiny-llama", method="fusionrag", max_tokens=4))
pipe.connect("retriever.documents", "llm.documents")
q = "Who discovered polonium?"
res = pipe.run({"retriever": {"query": q}, "llm": {"query": q}})
fr = res["llm"]["meta"][0]["usage"]["fusionrag"]
out["haystack"] = {"reused": fr["reused_chunks"], "chunks": fr["chunks"],
                   "answer": isinstance(res["llm"]["replies"][0], str)}
print(json.dumps(out))
"""


def _client_python() -> Path:
    if not PYTHON.exists():
        if os.environ.get("FUSIONRAG_CI"):
            pytest.fail("no .venv-client in CI: scripts/setup.sh (scripts/setup_client.sh) must make it")
        pytest.skip("no .venv-client here (bash scripts/setup_client.sh makes it)")
    return PYTHON


def _run(python: Path, code: str, *argv: str, cwd: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    done = subprocess.run([str(python), "-c", code, *argv], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, f"in .venv-client:\n{done.stderr[-3000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_integrations_work_from_the_client_package_without_torch(tmp_path_factory):
    python = _client_python()
    cwd = tmp_path_factory.mktemp("client")  # not the checkout: nothing of src/ on the path
    out = _run(python, PROBE, cwd=cwd)
    assert out["torch"] is False and out["import_torch"] == "ImportError" and out["heavy"] == []
    assert out["engine"] is False  # the integrations only: fusionrag is a namespace holding just them there
    if out["files"] != {p.name: p.read_text() for p in SOURCE.glob("*.py")}:
        message = ".venv-client holds other integrations than this checkout's: rerun bash scripts/setup_client.sh"
        pytest.fail(message) if os.environ.get("FUSIONRAG_CI") else pytest.skip(message)
    with live_small_server(tmp_path_factory) as (_app, base):
        out = _run(python, CLIENT, base + "/v1", cwd=cwd)
    assert out["langchain"] == {"docs": 2, "reused": 2, "chunks": 2, "sources": 2, "answer": True}
    assert out["llamaindex"] == {"nodes": 2}
    assert out["haystack"] == {"reused": 2, "chunks": 2, "answer": True}
