"""A model fingerprint: which weights (and dtype) produced a KV cache.

Reusing KV computed by different weights silently gives wrong answers, so every
stored cache carries this string and loaders compare its weights part
(:func:`same_weights`). The compute dtype is recorded, not enforced: chunk KV is stored in
fp16 or int8 whatever the model computed in, so a store built in fp32 answers in bf16 and the
reverse (decision 052); only ``S``'s KV, kept at the building dtype, is recomputed by an engine that
computes in another dtype, so that recomputing 100% still equals Full Attention.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from fusionrag.files import atomic_write, file_sha256
from fusionrag.paths import fusionrag_home


def weights_hash(model_dir: Path) -> str:
    """SHA-256 over the checkpoint's weight files, memoised by (path, size, mtime).

    Files not memoised yet are hashed in parallel threads (hashlib releases the GIL), so the shards
    of a large checkpoint (a 7B model: 15 GB) are hashed on several cores at once."""
    files = sorted(
        p for p in Path(model_dir).iterdir() if p.suffix in {".safetensors", ".bin", ".gguf", ".pt"}
    )
    memo_path = fusionrag_home() / "weights-hash-memo.json"
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    keys = []
    for p in files:
        st = p.stat()
        keys.append(f"{p.resolve()}|{st.st_size}|{st.st_mtime_ns}")
    todo = [(p, key) for p, key in zip(files, keys, strict=True) if key not in memo]
    if todo:
        with ThreadPoolExecutor(max_workers=min(8, len(todo))) as pool:
            for (_, key), digest in zip(todo, pool.map(file_sha256, [p for p, _ in todo]), strict=True):
                memo[key] = digest
        with contextlib.suppress(OSError):  # a read-only or full $FUSIONRAG_HOME: the memo only saves time
            atomic_write(memo_path, json.dumps(memo))
    h = hashlib.sha256()
    for p, key in zip(files, keys, strict=True):
        h.update(p.name.encode())
        h.update(memo[key].encode())
    return h.hexdigest()


def make_fingerprint(architecture: str, weights_sha: str, dtype: str) -> str:
    """``arch:sha16:dtype``; short enough for a safetensors header, specific enough to tell models apart."""
    return f"{architecture}:{weights_sha[:16]}:{dtype}"


def weights_id(fingerprint: str) -> str:
    """The fingerprint without its compute dtype (``arch:sha16``): which weights made a cache.

    A fingerprint of another shape (tests use plain labels) is its own weights id."""
    return fingerprint.rsplit(":", 1)[0] if fingerprint.count(":") >= 2 else fingerprint


def fingerprint_dtype(fingerprint: str) -> str | None:
    """The compute dtype a fingerprint records (``float32``, ``bfloat16``, ...), or None."""
    return fingerprint.rsplit(":", 1)[1] if fingerprint.count(":") >= 2 else None


def same_weights(a: str, b: str) -> bool:
    """Whether caches made under fingerprint ``a`` are valid for a model with fingerprint ``b``."""
    return weights_id(a) == weights_id(b)
