"""Keeping the connector's approximate KV apart from exact KV in vLLM's prefix cache.

vLLM publishes every full block of a request under a hash chained from the request's first block, and
serves a block to any later request whose ids hash the same. The connector writes FusionRAG's context
(re-positioned chunk KV, a share of it recomputed) into those blocks, so without a separation a request
that asked for vLLM's exact prefill (``"fusionrag": "off"``), or another ratio, would be served it.

vLLM's own mechanism for separate prefix-cache namespaces is the request's ``cache_salt``: it enters the
first block's hash, so the whole chain differs. The connector sets it itself, on the scheduler side, when a
request arrives (``on_new_request``, before vLLM's prefix-cache lookup), for every request it plans to
load: the salt names the method, the ratio and the store generation (a preprocess that rewrites fused KV
changes what a ratio computes). Requests of the same mode on the same context share their blocks, as
fusionrag's own context cache does (decision 053); ``off`` requests, and requests the connector does not
load (no stored chunk in the prompt, a context too short), keep their own salt and vLLM's exact blocks. A
salt the client set (vLLM's per-tenant isolation) is kept in front of ours.

This works from every door: ``vllm serve``, ``fusionrag serve --engine vllm`` and ``LLM.generate``.
"""

from __future__ import annotations

from typing import Any

#: What every salt the connector sets starts with (the client's own salt, if any, goes before it).
SALT_PREFIX = "fusionrag"


def mode_salt(method: str, ratio: float | str, generation: int) -> str:
    """The prefix-cache namespace of one mode: requests with equal salts may share blocks (``ratio``: a share, or
    ``ratio="auto"``'s key with the settings that size it)."""
    shown = ratio if isinstance(ratio, str) else f"{float(ratio):.6g}"
    return f"{SALT_PREFIX}:{method}:{shown}:g{int(generation)}"


def salted(client_salt: str | None, salt: str) -> str:
    """The client's salt (kept: it separates tenants) followed by the connector's."""
    return f"{client_salt}|{salt}" if client_salt else salt


def can_salt(request_type: Any) -> bool:
    """Whether vLLM's request class lets a connector re-salt a request (the attributes this module uses)."""
    import inspect

    try:
        takes_salt = "cache_salt" in inspect.signature(request_type.__init__).parameters
    except (TypeError, ValueError):
        return False
    return takes_salt and callable(getattr(request_type, "update_block_hashes", None))


def salt_request(request: Any, client_salt: str | None, salt: str) -> None:
    """Give ``request`` the salt of its mode and recompute its block hashes (in place: the list object vLLM
    may already hold stays the same) so vLLM's next prefix-cache lookup and every block it publishes for it
    are in that mode's namespace."""
    wanted = salted(client_salt, salt)
    if request.cache_salt == wanted:
        return
    request.cache_salt = wanted
    request.block_hashes.clear()
    request.update_block_hashes()
