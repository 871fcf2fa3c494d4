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


def check_prompt_length(engine: Any, request: ReuseRequest, resolved: Resolved | None, limit: int) -> Resolved:
    """Raise :class:`PromptTooLongError` when ``S`` + passages + question exceed ``limit`` tokens; returns the
    passages it counted (``resolved``, or found here when the prefetch found none) for the prefill."""
    if resolved is None:
        resolved = engine.resolve(request)
    n = resolved.prompt_tokens(engine, request)
    if n > limit:
        raise PromptTooLongError(f"the prompt has {n} tokens; this server accepts at most {limit} "
                                 "(fewer or shorter documents, or a lower retrieval depth)")
    return resolved
