"""Clients that build their own prompt around the pasted context, unchanged, against a fusionrag server.

Run in ``.venv-client`` (no torch) by ``pasted_ttft.py --client TEMPLATE``: each question's passages (the
Haystack pipeline's BM25 top k, given in the job, so every client pastes the same ones) go where the client's
common template puts them, ``max_tokens=1`` and greedy, so the call's run time is its time to first token:

* ``langchain-system``: LangChain's RAG tutorial, ``ChatPromptTemplate.from_messages([("system", "You are an
  assistant ... {context}"), ("human", "{input}")]) | ChatOpenAI(base_url=...)``: the context in the *system*
  message, joined as ``create_stuff_documents_chain`` joins it;
* ``llamaindex``: LlamaIndex's ``CHAT_TEXT_QA_PROMPT`` (its system message, then the context between rules
  in the user message) through ``OpenAILike(is_chat_model=True).chat``;
* ``openai``: the OpenAI SDK, a system message then the context and question in the user message;
* ``litellm-text``: ``litellm.text_completion`` of a raw prompt (the Haystack template's text): the server's
  ``/v1/completions``, no chat template.

The ``fusionrag`` cell is the call as its user writes it; the ``full`` cell adds only
``extra_body={"method": "full"}``. Each row also holds ``/tokenize`` of exactly what was sent
(``tokenize_count``): the server's ``prompt_tokens`` must equal it. Reads a JSON job on stdin, writes one
JSON line per run on stdout; ``--template`` picks the client.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable

from litellm_paste_client import prompt as raw_prompt
from paste_common import CELLS, interleaved, tokenize_count

LANGCHAIN_SYSTEM = ("You are an assistant for question-answering tasks. Use the following pieces of retrieved "
                    "context to answer the question. If you don't know the answer, say that you don't know. Use "
                    "three sentences maximum and keep the answer concise.\n\n{context}")


def extra(method: str | None) -> dict:
    return {} if method is None else {"extra_body": {"method": method}}


def langchain_system(job: dict) -> Callable:
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_openai import ChatOpenAI

    template = ChatPromptTemplate.from_messages([("system", LANGCHAIN_SYSTEM), ("human", "{input}")])
    roles = {"system": "system", "human": "user", "ai": "assistant"}

    def call(passages: list[str], question: str, method: str | None) -> tuple[dict, list[dict]]:
        llm = ChatOpenAI(base_url=job["url"], api_key="none", model=job["model"], max_tokens=1, temperature=0,
                         timeout=600, **extra(method))
        values = {"context": "\n\n".join(passages), "input": question}
        reply = (template | llm).invoke(values)
        sent = [{"role": roles[m.type], "content": m.content} for m in template.invoke(values).to_messages()]
        return reply.response_metadata["token_usage"], sent

    return call


def llamaindex(job: dict) -> Callable:
    from llama_index.core.prompts.chat_prompts import CHAT_TEXT_QA_PROMPT
    from llama_index.llms.openai_like import OpenAILike

    def call(passages: list[str], question: str, method: str | None) -> tuple[dict, list[dict]]:
        llm = OpenAILike(model=job["model"], api_base=job["url"], api_key="none", is_chat_model=True, max_tokens=1,
                         temperature=0.0, timeout=600, additional_kwargs=extra(method))
        messages = CHAT_TEXT_QA_PROMPT.format_messages(context_str="\n\n".join(passages), query_str=question)
        reply = llm.chat(messages)
        sent = [{"role": m.role.value, "content": m.content} for m in messages]
        return reply.raw.usage.model_dump(), sent

    return call


def openai_sdk(job: dict) -> Callable:
    from openai import OpenAI

    client = OpenAI(base_url=job["url"], api_key="none", timeout=600)

    def call(passages: list[str], question: str, method: str | None) -> tuple[dict, list[dict]]:
        context = "\n\n".join(passages)
        sent = [{"role": "system", "content": "You are a helpful assistant. Answer from the context."},
                {"role": "user", "content": f"Context:\n{context}\n\nQuestion: {question}"}]
        reply = client.chat.completions.create(model=job["model"], messages=sent, max_tokens=1, temperature=0,
                                               **extra(method))
        return reply.usage.model_dump(), sent

    return call


def litellm_text(job: dict) -> Callable:
    import litellm

    def call(passages: list[str], question: str, method: str | None) -> tuple[dict, str]:
        text = raw_prompt(passages, question)
        reply = litellm.text_completion(model=f"text-completion-openai/{job['model']}", api_base=job["url"],
                                        api_key="none", prompt=text, max_tokens=1, temperature=0.0, timeout=600,
                                        **extra(method))
        return reply.usage.model_dump(), text

    return call


CLIENTS = {"langchain-system": langchain_system, "llamaindex": llamaindex, "openai": openai_sdk,
           "litellm-text": litellm_text}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--template", choices=sorted(CLIENTS), required=True)
    args = ap.parse_args()
    job = json.loads(sys.stdin.read())
    call = CLIENTS[args.template](job)
    for rnd, i, question, passages, name in interleaved(job):  # round 0: warm-up, not measured
        t0 = time.perf_counter()
        usage, sent = call(passages, question, CELLS[name])
        seconds = time.perf_counter() - t0
        count = tokenize_count(job["url"], prompt=sent) if isinstance(sent, str) else \
            tokenize_count(job["url"], messages=sent)
        print(json.dumps({"round": rnd, "question": i, "cell": name, "seconds": seconds, "usage": usage,
                          "pasted": len(passages), "tokenize_count": count}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
