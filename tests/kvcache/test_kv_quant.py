"""int8 KV storage: the quantisation scheme, int8 entries in the store, and int8 stores end to end."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from fusionrag.errors import CacheIntegrityError
from fusionrag.kvcache.kv import KV, assemble
from fusionrag.kvcache.quant import INT8_SCHEME, dequantize_kv, quantize_kv, relative_error
from fusionrag.kvcache.store import FORMAT, FORMAT_INT8, KVStore
from fusionrag.models import load_model
from fusionrag.offline import build
from fusionrag.retrieval.embedder import HashingEmbedder

PASSAGES = [
    {"title": "Paris", "text": "Paris is the capital of France. It lies on the Seine river."},
    {"title": "Lyon", "text": "Lyon is a city in France on the Rhone and Saone rivers."},
    {"title": "Berlin", "text": "Berlin is the capital of Germany. It lies on the Spree river."},
    {"title": "Cats", "text": "Cats are small domesticated carnivorous mammals that purr."},
]


@pytest.fixture(scope="module")
def lm():
    return load_model("tiny-llama")


def _kv(n=12, seed=0, base=7, outlier=0.0):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(2, 2, n, 16, generator=g)
    keys[..., 3] *= 1 + outlier  # a key channel with a much larger range (as real post-RoPE keys have)
    return KV(keys, torch.randn(2, 2, n, 16, generator=g), base)


def test_scheme_error_and_shapes():
    kv = _kv(outlier=30.0)
    t = quantize_kv(kv.keys, kv.values)
    assert t["keys"].dtype == t["values"].dtype == torch.int8
    assert t["key_scales"].shape == (2, 2, 1, 16) and t["value_scales"].shape == (2, 2, 12, 1)
    k, v = dequantize_kv(t, torch.float32)
    assert relative_error(kv.keys, k) < 0.01 and relative_error(kv.values, v) < 0.01
    # Per-token key scales would be set by the outlier channel: per-channel ones are far more accurate.
    amax = kv.keys.abs().amax(dim=3, keepdim=True) / 127
    per_token = torch.round(kv.keys / amax) * amax
    assert relative_error(kv.keys, k) < relative_error(kv.keys, per_token) / 2


def test_int8_entry_roundtrip_is_verified(tmp_path):
    store = KVStore(tmp_path, "fp-A", "sys-1", "int8")
    kv, ids = _kv(n=256), list(range(256))
    scores = torch.arange(256, dtype=torch.float32)
    path = store.save(3, "fused", kv, ids, scores=scores, extra={"neighbours": [1]})
    header = store.header(3, "fused")
    assert header["dtype"] == "int8" and header["format"] == FORMAT_INT8 != FORMAT
    assert header["quant"] == INT8_SCHEME
    entry = store.load(3, "fused", token_ids=ids)
    assert entry.kv.keys.dtype == torch.float16 and entry.kv.base_position == 7
    assert relative_error(kv.keys, entry.kv.keys) < 0.01 and relative_error(kv.values, entry.kv.values) < 0.01
    assert torch.equal(entry.scores, scores)
    # about half of fp16's bytes (codes + one fp16 scale per token and head for the values)
    fp16 = KVStore(tmp_path / "h", "fp-A", "sys-1", "float16").save(3, "fused", kv, ids, scores=scores)
    tensors16 = 2 * kv.keys.numel() * 2
    assert path.stat().st_size - (fp16.stat().st_size - tensors16) < 0.6 * tensors16

    # The checksum covers the scales: a changed scale with the original header is refused.
    data = path.read_bytes()
    tensors = st_load(data)
    meta = store.header(3, "fused")
    tensors["value_scales"] = tensors["value_scales"] * 2
    path.write_bytes(st_save(tensors, metadata=meta))
    with pytest.raises(CacheIntegrityError, match="checksum mismatch"):
        store.load(3, "fused", token_ids=ids)
    path.write_bytes(data)
    with pytest.raises(CacheIntegrityError, match="not by the loaded model"):
        KVStore(tmp_path, "fp-B", "sys-1", "int8").load(3, "fused")


def test_fp16_store_still_loads_in_an_int8_store_and_rotation_is_fp32(tmp_path):
    """Entries are self-describing: an fp16 entry loads whatever the store writes now."""
    kv, ids = _kv(), list(range(12))
    KVStore(tmp_path, "fp-A", "sys-1", "float16").save(1, "plain", kv, ids)
    entry = KVStore(tmp_path, "fp-A", "sys-1", "int8").load(1, "plain", token_ids=ids)
    assert entry.kv.keys.dtype == torch.float16 and entry.metadata["format"] == FORMAT
    # An int8 entry assembles exactly like the fp16 tensors it dequantises to (same fp32 rotation).
    KVStore(tmp_path, "fp-A", "sys-1", "int8").save(2, "plain", kv, ids)
    q = KVStore(tmp_path, "fp-A", "sys-1", "int8").load(2, "plain", token_ids=ids).kv
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    prefix = KV(torch.zeros(2, 2, 3, 16), torch.zeros(2, 2, 3, 16), 0)
    a, _ = assemble(prefix, [q], inv_freq)
    b, _ = assemble(prefix, [KV(q.keys.clone(), q.values.clone(), q.base_position)], inv_freq)
    assert a.keys.dtype == torch.float32 and torch.equal(a.keys, b.keys)


def test_int8_store_end_to_end(tmp_path, lm):
    """ingest + fuse on an int8 store: every chunk entry int8, fused KV close to a float32 store's."""
    ref = build.create_store(tmp_path / "f32", lm, kv_dtype="float32", embedder=HashingEmbedder(64))
    q8 = build.create_store(tmp_path / "i8", lm, kv_dtype="int8", embedder=HashingEmbedder(64))
    for s in (ref, q8):
        build.add_passages(s, lm, PASSAGES)
        build.fuse(s, lm, top_n=2, progress=False)
    for cid in q8.chunk_ids():
        for kind in ("plain", "fused"):
            assert q8.kv.header(cid, kind)["dtype"] == "int8"
            err = relative_error(ref.kv.load(cid, kind).keys, q8.kv.load(cid, kind).keys)
            assert err < 0.02, (cid, kind, err)
    assert q8.kv.header(None, "system")["dtype"] == "float32"  # S stays full precision
    assert q8.settings["kv_dtype"] == "int8"
    sizes = [sum(p.stat().st_size for p in s.kv.files("plain")) for s in (q8, ref)]
    assert sizes[0] < 0.3 * sizes[1]  # against float32 (tiny entries: headers weigh more than at 256 tokens)
    ref.close()
    q8.close()
