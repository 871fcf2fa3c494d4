"""KV cache objects: segment KV, assembly, storage and tiers."""

from fusionrag.kvcache.kv import KV, assemble

__all__ = ["KV", "assemble"]
