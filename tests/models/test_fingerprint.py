"""The weights hash: the same digest whether the shards were hashed now (in parallel) or memoised."""

from __future__ import annotations

import hashlib

from fusionrag.models import fingerprint


def test_weights_hash_covers_every_shard_in_name_order_and_memoises_them(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSIONRAG_HOME", str(tmp_path / "home"))
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shards = {f"model-0000{i}-of-00003.safetensors": bytes([i]) * (1000 + i) for i in (3, 1, 2)}
    for name, data in shards.items():
        (ckpt / name).write_bytes(data)
    (ckpt / "config.json").write_text("{}")  # not a weight file
    expected = hashlib.sha256()
    for name in sorted(shards):
        expected.update(name.encode())
        expected.update(hashlib.sha256(shards[name]).hexdigest().encode())
    assert fingerprint.weights_hash(ckpt) == expected.hexdigest()

    def unexpected(path):
        raise AssertionError(f"{path} hashed again")

    monkeypatch.setattr(fingerprint, "file_sha256", unexpected)
    assert fingerprint.weights_hash(ckpt) == expected.hexdigest()  # from the memo
