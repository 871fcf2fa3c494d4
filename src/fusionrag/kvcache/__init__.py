"""KV cache objects: segment KV, assembly, storage and tiers.

``KV`` and ``assemble`` (torch) load on first use: ``fusionrag.kvcache.storage_dtypes`` imports without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["KV", "assemble"]

if TYPE_CHECKING:
    from fusionrag.kvcache.kv import KV, assemble


def __getattr__(name: str) -> Any:
    if name in __all__:
        from fusionrag.kvcache import kv

        return getattr(kv, name)
    raise AttributeError(f"module 'fusionrag.kvcache' has no attribute {name!r}")
