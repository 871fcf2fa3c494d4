"""A framework's own split of an ingested file, against a live loopback server: LangChain's
``RecursiveCharacterTextSplitter`` pieces pasted into a prompt, and LlamaIndex's ``SentenceSplitter`` nodes
sent as documents, are served from the parts of stored chunks they hold (>= 90% of the context's tokens
precomputed; no chunk added), though the store never saw these splits (decision 061)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fusionrag.serve.app import create_app
from fusionrag.serve.server_thread import ServerThread
from fusionrag.serve.settings import ServerSettings

SENTENCES = [
    "The old town of Velmora sits on both banks of the river Ostra, which floods every spring.",
    "Its cathedral was finished in 1412 after ninety years of building and two fires.",
    "The market square holds a clock tower whose bells were cast from melted cannons.",
    "Velmora's university, founded in 1520, is known for its early school of cartography.",
    "A narrow-gauge railway links the town with the salt mines in the hills to the north.",
    "Every August the town hosts a festival of lanterns floated down the Ostra at night.",
    "The harbour of Kessa, downstream, was dredged in 1903 to admit steamships of deep draught.",
    "Its lighthouse, painted in red and white bands, is visible for twenty miles at sea.",
    "Fishermen of Kessa still mend their nets on the quay in the old manner, by hand.",
    "A ferry crosses the estuary twice a day, weather permitting, to the island of Morrow.",
    "Morrow has a ruined abbey whose library was carried to Velmora in the year 1537.",
    "The abbey's last abbot, Brother Anselm, wrote a chronicle of the floods of the Ostra.",
]
TEXT = "\n\n".join(" ".join(SENTENCES[i:i + 2]) for i in range(0, len(SENTENCES), 2)) + "\n"
Q = "Which river runs through Velmora?"
MODEL = "tiny-llama"
pytestmark = pytest.mark.slow  # a live server and two framework pipelines (~15 s): not in the fast lane


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    root = tmp_path_factory.mktemp("splits")
    (root / "docs").mkdir()
    (root / "docs" / "velmora.txt").write_text(TEXT, encoding="utf-8")

    def make():
        from fusionrag.models import load_model
        from fusionrag.offline import build
        from fusionrag.online.engine import Engine
        from fusionrag.retrieval.embedder import HashingEmbedder

        lm = load_model(MODEL)  # tiny-llama's tokens are characters: 256-token chunks hold ~250 characters
        store = build.create_store(root / "kb", lm, chunk_tokens=256, embedder=HashingEmbedder(), model_source=MODEL)
        build.ingest(store, lm, [root / "docs" / "velmora.txt"], progress=False)
        return Engine(store, lm)

    app = create_app(make, ServerSettings(default_max_tokens=2, served_model_name=[MODEL]))
    app.state.scheduler.wait_ready(120)
    try:
        with ServerThread(app) as server:
            yield server.base_url + "/v1", root / "docs" / "velmora.txt"
    finally:
        app.state.scheduler.close()


def _precomputed_share(usage: dict) -> float:
    return usage["precomputed_tokens"] / usage["context_tokens"]


def test_langchain_splits_pasted_into_a_prompt_are_served_from_stored_kv(live):
    pytest.importorskip("langchain_text_splitters", reason="langchain-text-splitters is not installed")
    pytest.importorskip("langchain_openai", reason="langchain-openai is not installed")
    from langchain_text_splitters import RecursiveCharacterTextSplitter

    from fusionrag.integrations.langchain import chat_model

    url, path = live
    splits = RecursiveCharacterTextSplitter(chunk_size=120, chunk_overlap=20).split_text(path.read_text())
    assert len(splits) >= 8
    pasted = "\n\n".join(splits[1:7])
    reply = chat_model(url, model=MODEL, max_tokens=2, max_retries=0).invoke(
        f"Use the context.\n\nContext:\n{pasted}\n\nQuestion: {Q}")
    usage = reply.response_metadata["token_usage"]["fusionrag"]
    assert _precomputed_share(usage) >= 0.9, usage
    assert all(s.get("score") is None for s in usage["sources"])  # nothing retrieved: no chunk added
    parts = [s["part"] for s in usage["sources"] if s["part"] is not None]
    assert parts and all(0 <= a < b for a, b in parts)  # which tokens of a stored chunk each part used
    assert usage["method"] == "fusionrag"


def test_llamaindex_sentence_splitter_nodes_sent_as_documents_are_served_from_stored_kv(live):
    pytest.importorskip("llama_index.llms.openai_like", reason="llama-index-llms-openai-like is not installed")
    from llama_index.core import Document
    from llama_index.core.node_parser import SentenceSplitter
    from llama_index.core.retrievers import BaseRetriever
    from llama_index.core.schema import NodeWithScore

    from fusionrag.integrations.llamaindex import FusionRAGQueryEngine, llm

    url, path = live
    nodes = SentenceSplitter(chunk_size=48, chunk_overlap=8).get_nodes_from_documents(
        [Document(text=Path(path).read_text())])
    assert len(nodes) >= 4

    class Own(BaseRetriever):
        def _retrieve(self, query_bundle):
            return [NodeWithScore(node=n, score=1.0) for n in nodes[:4]]

    engine = FusionRAGQueryEngine(retriever=Own(), llm=llm(url, model=MODEL, max_tokens=2))
    usage = engine.query(Q).metadata["fusionrag"]
    assert _precomputed_share(usage) >= 0.9, usage
    assert usage["reused_chunks"] >= 4
