"""The prompt-length limit, checked before a prefill is spent on a prompt that is too long.

Kept out of the scheduler so the rule is one function, testable with any engine: the exact count
from the request's passages, found once (by its prefetch, or here for the prefill to take), and
its question tokenized once.
"""

from __future__ import annotations

from typing import Any

from fusionrag.errors import PromptTooLongError
from fusionrag.online.request import ReuseRequest
from fusionrag.online.resolved import Resolved


def prompt_limit(engine: Any, max_prompt_tokens: int | None) -> tuple[int | None, str]:
    """The prompt-token limit a request is held to and what sets it: the server's ``max_prompt_tokens``, or
    the model's own, lower, exact-reuse limit (a sliding window, longrope's original length:
    :func:`fusionrag.models.compat.exact_context_limit`)."""
    from fusionrag.models.compat import limit_reason

    lm = getattr(engine, "lm", None)
    model_limit = getattr(lm, "exact_context_limit", None)
    if model_limit and (not max_prompt_tokens or model_limit <= max_prompt_tokens):
        return model_limit, f"{lm.name} reuses KV exactly only within {limit_reason(lm.config)}"
    return max_prompt_tokens, f"this server accepts at most {max_prompt_tokens}"


#: Tokens a prompt's own texts may exceed the limit by before matching them is skipped: matching replaces pasted text
#: by the stored ids of the same text, a few boundary tokens apart, never many fewer.
RAW_SLACK = 1.02


def surely_too_long(engine: Any, request: ReuseRequest, limit: int, why: str | None = None) -> None:
    """Raise :class:`PromptTooLongError` when the request's texts alone (its question, with anything pasted in it,
    and its passages) tokenise to more than ``limit``: found by one tokenisation, before any matching or retrieval
    is spent on it (a 0.5 MB prompt was matched for 30 s on the model thread before its 400)."""
    from fusionrag.prompt import chunk_text

    prompt = engine.prompt
    n = len(prompt.encode(request.question or ""))
    for c in request.chunks or ():
        if n > limit * RAW_SLACK:
            break
        n += len(prompt.encode(chunk_text(str(c.get("title", "")), str(c.get("text", "")))))
    if n > limit * RAW_SLACK:
        raise PromptTooLongError(f"the prompt has more than {limit} tokens ({n} in its texts alone); "
                                 f"{why or f'this server accepts at most {limit}'} (fewer or shorter documents, or "
                                 "a lower retrieval depth)")


def check_prompt_length(engine: Any, request: ReuseRequest, resolved: Resolved | None, limit: int,
                        why: str | None = None) -> Resolved:
    """Raise :class:`PromptTooLongError` when ``S`` + passages + question exceed ``limit`` tokens (``why``: what
    sets the limit, said in the error); returns the passages it counted (``resolved``, or found here when the
    prefetch found none) for the prefill."""
    if resolved is None:
        resolved = engine.resolve(request)
    n = resolved.prompt_tokens(engine, request)
    if n > limit:
        raise PromptTooLongError(f"the prompt has {n} tokens; {why or f'this server accepts at most {limit}'} "
                                 "(fewer or shorter documents, or a lower retrieval depth)")
    return resolved


def before_prefill(engine: Any, request: ReuseRequest, resolved_later: Any, max_prompt_tokens: int | None) -> Any:
    """The length checks of a request about to be prefilled: its texts alone first (before waiting on any matching),
    then the exact count; ``resolved_later()`` gives what the prefetch found (waited on only when needed)."""
    limit, why = prompt_limit(engine, max_prompt_tokens)
    if limit:
        surely_too_long(engine, request, limit, why)
    resolved = resolved_later()
    return check_prompt_length(engine, request, resolved, limit, why) if limit else resolved


def after_prefill(engine: Any, prompt_tokens: int, max_new_tokens: int, max_prompt_tokens: int | None) -> int:
    """The answer's token budget once the prompt is known (a :class:`PromptTooLongError` when the prompt is over
    its limit): decoding past a sliding window would read tokens the model no longer sees, so it stops there."""
    limit, why = prompt_limit(engine, max_prompt_tokens)
    if limit and prompt_tokens > limit:
        raise PromptTooLongError(f"the prompt has {prompt_tokens} tokens; {why} (use a lower retrieval depth)")
    model_limit = getattr(getattr(engine, "lm", None), "exact_context_limit", None)
    return min(max_new_tokens, model_limit - prompt_tokens) if model_limit else max_new_tokens


def within_limit(engine: Any, request: ReuseRequest, max_prompt_tokens: int | None) -> bool:
    """Whether the request's texts alone fit its limit (the prefetch skips matching one that does not)."""
    limit, why = prompt_limit(engine, max_prompt_tokens)
    try:
        if limit:
            surely_too_long(engine, request, limit, why)
    except PromptTooLongError:
        return False
    return True
