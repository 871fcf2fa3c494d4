"""The framework integrations installed without the engine: ``fusionrag-client`` in a venv without torch.

``scripts/setup.sh`` (``scripts/setup_client.sh``) makes ``.venv-client``: the ``clients/python``
distribution with its LangChain, LlamaIndex and Haystack extras, litellm and DSPy, and no torch. These tests
run code in that environment (a subprocess) against a live ``fusionrag serve`` of this one on 127.0.0.1:
``import torch`` fails there, ``from fusionrag.integrations.langchain import ...`` works as with the engine's
package, and a LangChain retriever + chat call, a LlamaIndex retriever and a Haystack pipeline get their
answers with the store's chunks reused; litellm and DSPy, unchanged, pasting stored chunks into their
prompts get them reused (``usage.fusionrag`` and the standard ``prompt_tokens_details.cached_tokens``).
Skipped, saying why, without ``.venv-client`` (failed in CI: ``FUSIONRAG_CI=1``), and when its installed
integrations are not this checkout's or litellm or DSPy are missing there (rerun the setup).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from fusionrag.serve.app import create_app
from fusionrag.serve.server_thread import ServerThread
from fusionrag.serve.settings import ServerSettings
from serve_helpers import live_small_server, store_factory, stored_passages

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
            pytest.fail("no .venv-client in CI: scripts/setup.sh --test (scripts/setup_client.sh) must make it")
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


#: litellm and DSPy, unchanged, pasting stored chunks (sys.argv[2], a JSON list) into their prompts; one JSON line.
PASTING = r"""
import json, os, sys
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # else litellm fetches it at import (no network here)
url, passages = sys.argv[1], json.loads(sys.argv[2])
question = "Who discovered polonium?"
out = {}
import litellm
messages = [{"role": "user", "content": "Documents:\n" + "\n\n".join(passages) + "\n\nQuestion: " + question}]
kw = dict(model="openai/tiny-llama", api_base=url, api_key="x", messages=messages, max_tokens=2)
plain = litellm.completion(**kw)
streamed = [c.usage for c in litellm.completion(**kw, stream=True, stream_options={"include_usage": True})
            if getattr(c, "usage", None) is not None]
out["litellm"] = {"fusionrag": plain.usage.fusionrag, "cached": plain.usage.prompt_tokens_details.cached_tokens,
                  "streamed_cached": [u.prompt_tokens_details.cached_tokens for u in streamed]}

import dspy
lm = dspy.LM("openai/tiny-llama", api_base=url, api_key="x", cache=False, max_tokens=2)
dspy.configure(lm=lm, adapter=dspy.ChatAdapter(use_json_adapter_fallback=False))
try:
    dspy.Predict("context, question -> answer")(context=passages, question=question)
except dspy.utils.exceptions.AdapterParseError:
    pass  # two tokens of a random model: no parsable answer, the request is what is checked
entry = lm.history[-1]
raw = getattr(entry["response"], "provider_data", None) or {}
out["dspy"] = {"calls": len(lm.history), "fusionrag": raw.get("usage", {}).get("fusionrag"),
               "cached": entry["usage"]["prompt_tokens_details"]["cached_tokens"]}

from haystack.components.generators.chat import OpenAIChatGenerator
from haystack.dataclasses import ChatMessage
from haystack.utils import Secret
chunks = []
gen = OpenAIChatGenerator(api_key=Secret.from_token("x"), model="tiny-llama", api_base_url=url,
                          streaming_callback=chunks.append,
                          generation_kwargs={"max_tokens": 2, "stream_options": {"include_usage": True}})
usage = gen.run([ChatMessage.from_user(messages[0]["content"])])["replies"][0].meta["usage"]
out["haystack_stream"] = {"fusionrag": usage.get("fusionrag"), "chunks": len(chunks),
                          "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens")}
print(json.dumps(out))
"""


def _reuse_server_factory(path: Path):
    """The small store (serve_helpers.PASSAGES) with ``auto`` reusing KV from any context length: its pasted
    contexts are far below the CPU break-even, under which ``auto`` runs ``full``."""

    def make():
        from fusionrag.online.engine import Engine

        engine = store_factory(path)()
        return Engine(engine.store, engine.lm, min_reuse_tokens=0)

    return make


def test_litellm_and_dspy_unchanged_reuse_the_stored_chunks_they_paste(tmp_path_factory):
    """litellm and DSPy from .venv-client, as their users write them (no extra field), paste stored chunks into
    the prompt: the server finds and reuses every one, adds none, and reports them in the standard
    ``usage.prompt_tokens_details.cached_tokens`` too (litellm's streamed usage and DSPy keep only that). A
    streaming Haystack ``OpenAIChatGenerator`` keeps both in its reply's usage."""
    python = _client_python()
    cwd = tmp_path_factory.mktemp("client-pasting")
    missing = _run(python, "import importlib.util, json; print(json.dumps("
                   "[m for m in ('litellm', 'dspy') if importlib.util.find_spec(m) is None]))", cwd=cwd)
    if missing:
        message = f".venv-client lacks {', '.join(missing)}: rerun bash scripts/setup_client.sh"
        pytest.fail(message) if os.environ.get("FUSIONRAG_CI") else pytest.skip(message)
    app = create_app(_reuse_server_factory(tmp_path_factory.mktemp("kb-pasting") / "kb"),
                     ServerSettings(default_max_tokens=8))
    app.state.scheduler.wait_ready(120)
    try:
        ids = [0, 2, 4]  # chunks long enough to be found inside other text (matching.MIN_MATCH_CHARS)
        passages = [p["text"] for p in stored_passages(app, ids)]
        with ServerThread(app) as server:
            out = _run(python, PASTING, server.base_url + "/v1", json.dumps(passages), cwd=cwd)
    finally:
        app.state.scheduler.close()
    for name in ("litellm", "dspy", "haystack_stream"):
        fr = out[name]["fusionrag"]
        assert fr is not None, f"{name}: no usage.fusionrag in the response"
        assert fr["method"] == "fusionrag", (name, fr["note"])
        assert [s["chunk_id"] for s in fr["sources"] if s["stored"]] == ids, name  # each pasted chunk found
        assert fr["reused_chunks"] == len(ids) and not any(s["score"] is not None for s in fr["sources"]), name
        assert out[name]["cached"] == fr["reused_tokens"] > 0, name
    assert len(out["litellm"]["streamed_cached"]) == 1 and out["litellm"]["streamed_cached"][0] > 0
    assert out["dspy"]["calls"] == 1  # one request: the JSON adapter's fallback is off
