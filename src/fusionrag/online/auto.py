"""What ``method="auto"`` runs for one request: FusionRAG where reusing KV pays, Full Attention where it does not.

Reuse pays when enough of the context has KV ready before the request computes any: stored chunks
(or parts of them) and new passages an earlier request left in the prefix cache. The rest is computed
piece by piece before the selection and recompute passes, so a context that is mostly new text is
faster prefilled whole (``benchmarks/reuse/results/auto_share``), and so is a short one
(``benchmarks/ttft/results/break_even``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fusionrag.models.registry import LoadedModel
from fusionrag.prompt import passage_hash

#: Context tokens with KV ready from which ``method="auto"`` reuses KV, per device type.
#: CPU: parity at ~100 tokens for smollm2-135m and qwen2.5-0.5b, 1.13x / 1.37x faster at ~175
#: (benchmarks/ttft/results/break_even); 256 leaves room for KV read from disk. CUDA: an estimate
#: until a GPU run measures it (a GPU prefill of a short context takes milliseconds, so the pre-pass
#: and KV movement weigh more there).
BREAK_EVEN_TOKENS = {"cpu": 256, "cuda": 1024}
#: ``auto`` reuses KV only when at least this share of the context has it ready. qwen2.5-0.5b, ~1.3K tokens, one
#: CPU thread: FusionRAG 15% over full is 1.13x [0.93, 1.25] with none ready, 2.34x [2.09, 2.39] with 27%
#: (``benchmarks/reuse/results/auto_share``).
AUTO_MIN_READY = 0.25


def break_even_tokens(lm: LoadedModel) -> int:
    """The context length from which reuse is faster than a full prefill on ``lm``'s device."""
    return BREAK_EVEN_TOKENS.get(str(lm.device).split(":")[0], BREAK_EVEN_TOKENS["cuda"])


def choose(method: str, context_tokens: int, ready_tokens: int | None, min_reuse_tokens: int) -> tuple[str, str]:
    """The method a request runs and, when that is not the one it named, why.

    Without passages there is nothing to reuse: Full Attention of ``S`` + the question, whatever the
    method. ``auto`` reuses KV (``fusionrag``) when ``min_reuse_tokens`` tokens of context or more have KV
    ready (``ready_tokens``; None: all of the context) and they are at least :data:`AUTO_MIN_READY` of it;
    otherwise it runs ``full``."""
    if context_tokens == 0:
        return "full", "" if method == "full" else "no passages: nothing to reuse (full prefill of the question)"
    if method != "auto":
        return method, ""
    ready = context_tokens if ready_tokens is None else ready_tokens
    if ready < min_reuse_tokens:
        return "full", (f"auto: {ready} of {context_tokens} context tokens have KV ready < {min_reuse_tokens}, "
                        "where a full prefill is faster than reuse")
    if ready < AUTO_MIN_READY * context_tokens:
        return "full", (f"auto: {ready} of {context_tokens} context tokens have KV ready (under "
                        f"{AUTO_MIN_READY:.0%}), where a full prefill is faster than reuse")
    return "fusionrag", (f"auto: {ready} of {context_tokens} context tokens have KV ready "
                         f"(>= {min_reuse_tokens}): fusionrag")


def ready_tokens(prefix_cache: Any, system_hash: str, pieces: Sequence[Any],
                 token_ids: Sequence[Sequence[int]]) -> int:
    """Context tokens whose KV is ready before a request computes any: stored pieces' (``chunk_id`` set), and
    new pieces' that ``prefix_cache`` holds (an earlier request computed them)."""
    held = prefix_cache.peek(system_hash, [passage_hash(p.title, p.text) for p in pieces if p.chunk_id is None])
    new = iter(h is not None for h in held)
    return sum(len(ids) for p, ids in zip(pieces, token_ids, strict=True) if p.chunk_id is not None or next(new))
