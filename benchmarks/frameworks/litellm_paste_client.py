"""A litellm call that pastes its context into the prompt, unchanged, against a fusionrag server.

Run in ``.venv-client`` (litellm, no torch) by ``pasted_ttft.py --client litellm``: each question's passages
(the Haystack pipeline's BM25 top k, given in the job, so every client pastes the same ones) are pasted into
one user message, the Haystack template's text, and sent with ``litellm.completion(model="openai/<served
name>", api_base=...)``, ``max_tokens=1`` and greedy, so the call's run time is its time to first token. The
``fusionrag`` cell is the call as a litellm user writes it; the ``full`` cell adds only
``extra_body={"method": "full"}`` (the baseline: the same prompt, prefilled whole). Not streamed: litellm
keeps the unknown ``usage.fusionrag`` of a plain response (its streamed usage keeps only the standard
fields, ``prompt_tokens_details.cached_tokens`` included). Reads a JSON job on stdin, writes one JSON line
per run on stdout.
"""

from __future__ import annotations

import json
import sys
import time

import litellm
from paste_common import CELLS, interleaved, tokenize_count


def prompt(passages: list[str], question: str) -> str:
    """The Haystack template (``haystack_paste_client.TEMPLATE``, as Jinja renders it) as a plain f-string."""
    documents = "".join(f"\n{p}\n" for p in passages)
    return (f"Answer the question using only the documents below.\n\nDocuments:\n{documents}\n\n"
            f"Question: {question}\nAnswer:")


def ask(job: dict, passages: list[str], question: str, method: str | None):
    extra = {} if method is None else {"extra_body": {"method": method}}
    return litellm.completion(model=f"openai/{job['model']}", api_base=job["url"], api_key="none",
                              messages=[{"role": "user", "content": prompt(passages, question)}],
                              max_tokens=1, temperature=0.0, timeout=600, **extra)


def main() -> int:
    job = json.loads(sys.stdin.read())
    for rnd, i, question, passages, name in interleaved(job):  # round 0: warm-up, not measured
        t0 = time.perf_counter()
        resp = ask(job, passages, question, CELLS[name])
        seconds = time.perf_counter() - t0
        usage = resp.usage.model_dump()
        count = tokenize_count(job["url"], messages=[{"role": "user", "content": prompt(passages, question)}])
        print(json.dumps({"round": rnd, "question": i, "cell": name, "seconds": seconds, "usage": usage,
                          "pasted": len(passages), "tokenize_count": count}), flush=True)
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
