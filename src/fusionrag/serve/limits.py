"""The prompt-length limit, checked before a prefill is spent on a prompt that is too long.

Kept out of the scheduler so the rule (exact for request-supplied passages, a cheap bound
then an exact count in retrieval mode) is one function, testable with any engine.
"""

from __future__ import annotations

from typing import Any

from fusionrag.errors import PromptTooLongError
from fusionrag.online.engine import DEFAULT_TOP_K
from fusionrag.online.request import ReuseRequest

#: Tokens a chunk may have beyond the store's ``chunk_tokens`` (its "[title] " prefix).
TITLE_SLACK = 8


def check_prompt_length(engine: Any, question: str, prepare_kwargs: dict[str, Any], limit: int) -> None:
    """Raise :class:`PromptTooLongError` when ``S`` + passages + question exceed ``limit`` tokens.

    With request-supplied passages the count is exact. In retrieval mode the passages are
    not known before ``prepare``: an upper bound (``top_k`` chunks of at most the store's
    ``chunk_tokens``) lets almost every request through without work; only when the bound
    is over the limit are the chunks looked up (an index search, no model) and counted.
    """
    preamble = {"preamble": prepare_kwargs["preamble"]} if prepare_kwargs.get("preamble") else {}
    chunks = prepare_kwargs.get("chunks")
    own = ReuseRequest(question, chunks=chunks, top_k=prepare_kwargs.get("top_k"),
                       retrieval=prepare_kwargs.get("retrieval"))
    if not own.retrieves:
        n = engine.prompt_tokens(question, chunks or [], **preamble)
    else:
        n = _retrieval_prompt_tokens(engine, question, int(prepare_kwargs.get("top_k") or DEFAULT_TOP_K), limit,
                                     preamble)
    if n > limit:
        raise PromptTooLongError(f"the prompt has {n} tokens; this server accepts at most {limit} "
                                 "(fewer or shorter documents, or a lower top_k)")


def _retrieval_prompt_tokens(engine: Any, question: str, top_k: int, limit: int, preamble: dict[str, str]) -> int:
    store = getattr(engine, "store", None)
    base = engine.prompt_tokens(question, [], **preamble)
    bound = (getattr(store, "settings", None) or {}).get("chunk_tokens")
    if bound is not None and base + top_k * (int(bound) + TITLE_SLACK) <= limit:
        return base
    if store is None or not store.chunk_ids():
        return base  # nothing to retrieve: prepare reports that itself
    return base + sum(len(store.chunk(cid).token_ids) for cid in store.search(question, top_k))
