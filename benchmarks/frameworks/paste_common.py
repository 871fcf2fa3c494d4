"""What the pasting clients share, in ``.venv-client`` (httpx only): the interleaved order of their runs and
``POST /tokenize`` of what they sent (the count the server's ``usage.prompt_tokens`` must equal when it serves
the client's prompt token for token, issue 47)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx

CELLS = {"fusionrag": None, "full": "full"}  # the call as its user writes it; + extra_body={"method": "full"}


def interleaved(job: dict) -> Iterator[tuple[int, int, str, list[str], str]]:
    """``(round, question index, question, passages, cell)`` in run order: round 0 a warm-up, the two cells'
    order alternating by round and question so neither always runs second."""
    for rnd in range(job["rounds"] + 1):
        for i, (question, passages) in enumerate(zip(job["questions"], job["passages"], strict=True)):
            order = list(CELLS) if (rnd + i) % 2 == 0 else list(reversed(CELLS))
            for name in order:
                yield rnd, i, question, passages, name


def tokenize_count(url: str, *, messages: list[dict] | None = None, prompt: str | None = None) -> int:
    """The token count of ``messages`` (through the model's chat template) or of a raw ``prompt``; ``url`` is the
    server's ``.../v1`` base."""
    body = {"prompt": prompt} if messages is None else {"messages": messages}
    out = httpx.post(url.removesuffix("/v1") + "/tokenize", json=body, timeout=60)
    out.raise_for_status()
    return int(out.json()["count"])
