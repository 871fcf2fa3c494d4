"""A Haystack pipeline that pastes its context into the prompt, unchanged, against a fusionrag server.

Run in ``.venv-client`` (Haystack, no torch) by ``pasted_ttft.py``: ``InMemoryBM25Retriever`` over the
user's files -> ``ChatPromptBuilder`` pasting the retrieved documents' text -> ``OpenAIChatGenerator``
pointed at the server, ``max_tokens=1`` and greedy, so the pipeline's run time is its time to first token.
The ``fusionrag`` cell is the pipeline exactly as a Haystack user writes it; the ``full`` cell adds only
``extra_body={"method": "full"}`` (the baseline: the same prompt, prefilled whole). Reads a JSON job on
stdin, writes one JSON line per run on stdout; with ``--retrieve``, only the passages BM25 retrieves per
question (one JSON list), for the other clients.
"""

from __future__ import annotations

import json
import sys
import time

from haystack import Document, Pipeline
from haystack.components.builders import ChatPromptBuilder
from haystack.components.generators.chat import OpenAIChatGenerator
from haystack.components.retrievers.in_memory import InMemoryBM25Retriever
from haystack.dataclasses import ChatMessage
from haystack.document_stores.in_memory import InMemoryDocumentStore
from haystack.utils import Secret
from paste_common import tokenize_count

TEMPLATE = """Answer the question using only the documents below.

Documents:
{% for document in documents %}
{{ document.content }}
{% endfor %}

Question: {{ question }}
Answer:"""


def pipeline(store: InMemoryDocumentStore, url: str, model: str, top_k: int, method: str | None) -> Pipeline:
    kwargs = {"max_tokens": 1, "temperature": 0.0}
    if method is not None:
        kwargs["extra_body"] = {"method": method}
    p = Pipeline()
    p.add_component("retriever", InMemoryBM25Retriever(document_store=store, top_k=top_k))
    p.add_component("prompt", ChatPromptBuilder(template=[ChatMessage.from_user(TEMPLATE)],
                                                required_variables=["documents", "question"]))
    p.add_component("llm", OpenAIChatGenerator(api_key=Secret.from_token("none"), model=model, api_base_url=url,
                                               generation_kwargs=kwargs, timeout=600))
    p.connect("retriever.documents", "prompt.documents")
    p.connect("prompt.prompt", "llm.messages")
    return p


def retrieved(store: InMemoryDocumentStore, questions: list[str], top_k: int) -> list[list[str]]:
    """The documents' text the pipeline's BM25 retriever pastes for each question (``--retrieve``: what the
    litellm and DSPy clients are given, so that every client pastes the same passages)."""
    retriever = InMemoryBM25Retriever(document_store=store, top_k=top_k)
    return [[d.content for d in retriever.run(query=q)["documents"]] for q in questions]


def main() -> int:
    job = json.loads(sys.stdin.read())
    store = InMemoryDocumentStore()
    store.write_documents([Document(content=d["text"], meta={"title": d["title"]}) for d in job["documents"]])
    if "--retrieve" in sys.argv[1:]:
        print(json.dumps(retrieved(store, job["questions"], job["top_k"])))
        return 0
    cells = {"fusionrag": pipeline(store, job["url"], job["model"], job["top_k"], None),
             "full": pipeline(store, job["url"], job["model"], job["top_k"], "full")}
    for rnd in range(job["rounds"] + 1):  # round 0: warm-up, not measured
        for i, question in enumerate(job["questions"]):
            order = list(cells) if (rnd + i) % 2 == 0 else list(reversed(cells))
            for name in order:
                t0 = time.perf_counter()
                out = cells[name].run({"retriever": {"query": question}, "prompt": {"question": question}},
                                      include_outputs_from={"retriever", "prompt"})
                seconds = time.perf_counter() - t0
                reply = out["llm"]["replies"][0]
                pasted = [d.meta.get("title", "") for d in out["retriever"]["documents"]]
                sent = [{"role": m.role.value, "content": m.text} for m in out["prompt"]["prompt"]]
                print(json.dumps({"round": rnd, "question": i, "cell": name, "seconds": seconds,
                                  "usage": reply.meta.get("usage"), "pasted_titles": pasted,
                                  "tokenize_count": tokenize_count(job["url"], messages=sent)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
