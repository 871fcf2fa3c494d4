"""On-disk KV entries: integrity, atomic writes, dtypes (kvcache/store.py)."""

from __future__ import annotations

import os

import pytest
import torch

from fusionrag.errors import CacheIntegrityError, FusionRAGError
from fusionrag.kvcache.kv import KV
from fusionrag.kvcache.store import KVStore


def _kv(n=5, seed=0, base=7):
    g = torch.Generator().manual_seed(seed)
    return KV(torch.randn(2, 2, n, 16, generator=g), torch.randn(2, 2, n, 16, generator=g), base)


# ---------------------------------------------------------------- KVStore


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_entry_roundtrip_with_metadata(tmp_path, dtype):
    store = KVStore(tmp_path, "fp-A", "sys-1", dtype)
    kv, ids = _kv(), [1, 2, 3, 4, 5]
    scores = torch.arange(5, dtype=torch.float32)
    store.save(3, "fused", kv, ids, scores=scores, extra={"neighbours": [1, 2]})
    entry = store.load(3, "fused", token_ids=ids)
    tol = 0 if dtype == "float32" else 2e-3
    assert entry.kv.keys.dtype == getattr(torch, dtype) and entry.kv.base_position == 7
    torch.testing.assert_close(entry.kv.keys.float(), kv.keys, atol=tol, rtol=tol)
    torch.testing.assert_close(entry.kv.values.float(), kv.values, atol=tol, rtol=tol)
    assert torch.equal(entry.scores, scores) and entry.extra == {"neighbours": [1, 2]}
    header = store.header(3, "fused")
    assert header["fingerprint"] == "fp-A" and header["system_hash"] == "sys-1" and header["dtype"] == dtype
    assert header["base_position"] == "7" and header["n_tokens"] == "5" and len(header["checksum"]) == 64


def test_truncated_or_corrupted_entries_are_refused(tmp_path):
    store = KVStore(tmp_path, "fp-A", "sys-1")
    path = store.save(1, "plain", _kv(), [1, 2, 3, 4, 5])
    data = path.read_bytes()

    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CacheIntegrityError, match="truncated or corrupted"):
        store.load(1, "plain")
    path.write_bytes(data[:5])
    with pytest.raises(CacheIntegrityError, match="truncated or corrupted"):
        store.load(1, "plain")

    flipped = bytearray(data)
    flipped[-3] ^= 0x40  # one bit in the tensor data
    path.write_bytes(bytes(flipped))
    with pytest.raises(CacheIntegrityError, match="checksum mismatch"):
        store.load(1, "plain")

    path.write_bytes(data.replace(b'"base_position":"7"', b'"base_position":"9"'))  # header edited
    with pytest.raises(CacheIntegrityError, match="checksum mismatch"):
        store.load(1, "plain")

    path.write_bytes(data)
    store.load(1, "plain")  # intact again
    with pytest.raises(CacheIntegrityError, match="not by the loaded model"):
        KVStore(tmp_path, "fp-B", "sys-1").load(1, "plain")
    with pytest.raises(CacheIntegrityError, match="another system prompt"):
        KVStore(tmp_path, "fp-A", "sys-2").load(1, "plain")
    with pytest.raises(CacheIntegrityError, match="other tokens"):
        store.load(1, "plain", token_ids=[9, 9, 9, 9, 9])
    with pytest.raises(CacheIntegrityError, match="missing"):
        store.load(2, "plain")


def test_interrupted_write_leaves_old_entry_or_none(tmp_path, monkeypatch):
    store = KVStore(tmp_path, "fp-A", "sys-1")
    store.save(1, "plain", _kv(seed=1), [1, 2, 3, 4, 5])

    def crash(*_a, **_k):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        store.save(1, "plain", _kv(seed=2), [1, 2, 3, 4, 5])
    with pytest.raises(KeyboardInterrupt):
        store.save(2, "plain", _kv(seed=2), [1, 2, 3, 4, 5])
    monkeypatch.undo()
    assert torch.equal(store.load(1, "plain").kv.keys, _kv(seed=1).keys.half())  # the old entry, intact
    assert not store.exists(2, "plain")
    assert not list(tmp_path.rglob("*.tmp"))


def test_fp16_overflow_is_refused(tmp_path):
    kv = _kv()
    big = KV(kv.keys * 1e6, kv.values, kv.base_position)
    with pytest.raises(FusionRAGError, match="float32"):
        KVStore(tmp_path, "fp", "s", "float16").save(1, "plain", big, [1, 2, 3, 4, 5])
    with pytest.raises(FusionRAGError, match="unsupported KV storage dtype"):
        KVStore(tmp_path, "fp", "s", "int4")
