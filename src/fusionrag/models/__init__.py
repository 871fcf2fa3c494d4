"""Model adapter: loading (packaged GGUF, local checkpoints), compatibility, RoPE re-positioning.

The heavy names (torch, transformers) load on first use, so that ``fusionrag.models.options`` (the
names and flags the command line needs) imports without them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fusionrag.models.options import DEFAULT_MODEL, KNOWN_NAMES

__all__ = ["DEFAULT_MODEL", "KNOWN_NAMES", "LoadedModel", "load_model", "wrap_model"]

if TYPE_CHECKING:
    from fusionrag.models.registry import LoadedModel, load_model, wrap_model


def __getattr__(name: str) -> Any:
    if name in ("LoadedModel", "load_model", "wrap_model"):
        from fusionrag.models import registry

        return getattr(registry, name)
    raise AttributeError(f"module 'fusionrag.models' has no attribute {name!r}")
