"""LangChain and LlamaIndex pipelines that split the user's files their own way, against a fusionrag server.

Run in ``.venv-client`` (the frameworks, no torch) by ``split_ttft.py``. Each pipeline is what a user of
the framework writes, pointed at the server, ``max_tokens=1`` so its run time is its time to first token:

- ``langchain``: ``RecursiveCharacterTextSplitter(chunk_size=500, chunk_overlap=50)`` -> the top ``k``
  splits -> ``ChatPromptTemplate`` (context pasted, ``\\n\\n``-joined) -> ``ChatOpenAI``.
- ``llamaindex``: ``SentenceSplitter(chunk_size=256)`` (LlamaIndex's defaults otherwise: 200 tokens of
  overlap, its bundled tiktoken encoding) -> the top ``k`` nodes -> ``get_response_synthesizer``
  (``compact``: LlamaIndex's own QA template) -> ``OpenAILike``.

The top splits are chosen by BM25 over the splits (the same few lines for both frameworks, so only the
split differs). The ``fusionrag`` cell is the pipeline unchanged; the ``full`` cell adds only
``extra_body={"method": "full"}`` (the same prompt prefilled whole). The usage of each reply is read
from the HTTP response (an ``httpx`` event hook on the client the framework is given). Reads a JSON job
on stdin, writes one JSON line per run on stdout.
"""

from __future__ import annotations

import json
import math
import re
import sys
import time
from collections import Counter
from collections.abc import Callable

import httpx

_WORD = re.compile(r"\w+")


class Usage:
    """The last chat completion's ``usage``, read off the HTTP response the framework received."""

    def __init__(self) -> None:
        self.last: dict | None = None

    def hook(self, response: httpx.Response) -> None:
        if response.request.url.path.endswith("/chat/completions"):
            response.read()
            self.last = response.json().get("usage")

    def client(self) -> httpx.Client:
        return httpx.Client(timeout=600, event_hooks={"response": [self.hook]})


def bm25(texts: list[str]) -> Callable[[str, int], list[int]]:
    """The indices of the ``k`` texts that best match a query (Okapi BM25, k1=1.5, b=0.75)."""
    docs = [Counter(w.lower() for w in _WORD.findall(t)) for t in texts]
    lengths = [sum(d.values()) for d in docs]
    avg = sum(lengths) / max(1, len(lengths))
    df = Counter(w for d in docs for w in d)
    n = len(docs)

    def top(query: str, k: int) -> list[int]:
        words = [w.lower() for w in _WORD.findall(query)]
        scores = []
        for d, length in zip(docs, lengths, strict=True):
            s = 0.0
            for w in words:
                if w in d:
                    idf = math.log(1 + (n - df[w] + 0.5) / (df[w] + 0.5))
                    s += idf * d[w] * 2.5 / (d[w] + 1.5 * (1 - 0.75 + 0.75 * length / avg))
            scores.append(s)
        return sorted(range(n), key=lambda i: -scores[i])[:k]

    return top


def langchain_pipeline(files: list[str], url: str, model: str, top_k: int, method: str | None, usage: Usage):
    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_openai import ChatOpenAI
    from langchain_text_splitters import RecursiveCharacterTextSplitter

    splits = RecursiveCharacterTextSplitter(chunk_size=500, chunk_overlap=50).create_documents(files)
    top = bm25([d.page_content for d in splits])
    prompt = ChatPromptTemplate.from_messages([
        ("system", "Answer the question using only the context."),
        ("human", "Context:\n{context}\n\nQuestion: {question}")])
    llm = ChatOpenAI(base_url=url, api_key="none", model=model, max_tokens=1, temperature=0,
                     http_client=usage.client(), extra_body={"method": method} if method else None)
    chain = prompt | llm | StrOutputParser()

    def run(question: str) -> list[str]:
        docs = [splits[i] for i in top(question, top_k)]
        chain.invoke({"context": "\n\n".join(d.page_content for d in docs), "question": question})
        return [d.page_content for d in docs]

    return run, len(splits)


def llamaindex_pipeline(files: list[str], url: str, model: str, top_k: int, method: str | None, usage: Usage):
    from llama_index.core import Document
    from llama_index.core.node_parser import SentenceSplitter
    from llama_index.core.response_synthesizers import get_response_synthesizer
    from llama_index.core.schema import NodeWithScore
    from llama_index.llms.openai_like import OpenAILike

    nodes = SentenceSplitter(chunk_size=256).get_nodes_from_documents([Document(text=t) for t in files])
    top = bm25([n.get_content() for n in nodes])
    llm = OpenAILike(model=model, api_base=url, api_key="none", is_chat_model=True, max_tokens=1, temperature=0,
                     context_window=32768, timeout=600, http_client=usage.client(),
                     additional_kwargs={"extra_body": {"method": method}} if method else {})
    synth = get_response_synthesizer(llm=llm, response_mode="compact")

    def run(question: str) -> list[str]:
        chosen = [nodes[i] for i in top(question, top_k)]
        synth.synthesize(question, nodes=[NodeWithScore(node=n, score=1.0) for n in chosen])
        return [n.get_content() for n in chosen]

    return run, len(nodes)


PIPELINES = {"langchain": langchain_pipeline, "llamaindex": llamaindex_pipeline}


def main() -> int:
    job = json.loads(sys.stdin.read())
    usage = Usage()
    cells = {}
    for name in ("fusionrag", "full"):
        cells[name], splits = PIPELINES[job["splitter"]](job["files"], job["url"], job["model"], job["top_k"],
                                                         None if name == "fusionrag" else "full", usage)
    warm, measured = job["questions"][0], job["questions"][1:]
    for rnd in range(job["rounds"] + 1):  # round 0: the warm-up question only (every measured prompt is new in round 1)
        for i, question in enumerate([warm] if rnd == 0 else measured):
            order = list(cells) if (rnd + i) % 2 == 0 else list(reversed(cells))
            for name in order:
                t0 = time.perf_counter()
                pasted = cells[name](question)
                seconds = time.perf_counter() - t0
                print(json.dumps({"splitter": job["splitter"], "round": rnd, "question": i, "cell": name,
                                  "seconds": seconds, "usage": usage.last, "splits": splits,
                                  "pasted_chars": sum(map(len, pasted))}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
