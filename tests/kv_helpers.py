"""Small stored-KV fixtures the source and tier tests share: random entries in a float32 store on disk."""

import torch

from fusionrag.kvcache.kv import KV
from fusionrag.kvcache.sources import DiskSource
from fusionrag.kvcache.store import KVStore


def random_kv(n: int, seed: int) -> KV:
    g = torch.Generator().manual_seed(seed)
    return KV(torch.randn(2, 2, n, 8, generator=g), torch.randn(2, 2, n, 8, generator=g), 4)


def disk_source(tmp_path, tokens: dict[int, list[int]]) -> DiskSource:
    """A store holding fused KV (with Cache-Craft-style scores 0..n-1) for each chunk of ``tokens``."""
    store = KVStore(tmp_path, "fp", "sys", "float32")
    for cid, ids in tokens.items():
        store.save(cid, "fused", random_kv(len(ids), cid), ids, scores=torch.arange(len(ids), dtype=torch.float32))
    return DiskSource(store, tokens.__getitem__)
