"""A model fingerprint: which weights (and dtype) produced a KV cache.

Reusing KV computed by different weights silently gives wrong answers, so every
stored cache carries this string and loaders compare it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from fusionrag.files import atomic_write, file_sha256
from fusionrag.paths import fusionrag_home


def weights_hash(model_dir: Path) -> str:
    """SHA-256 over the checkpoint's weight files, memoised by (path, size, mtime)."""
    files = sorted(
        p for p in Path(model_dir).iterdir() if p.suffix in {".safetensors", ".bin", ".gguf", ".pt"}
    )
    memo_path = fusionrag_home() / "weights-hash-memo.json"
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    h = hashlib.sha256()
    changed = False
    for p in files:
        st = p.stat()
        key = f"{p.resolve()}|{st.st_size}|{st.st_mtime_ns}"
        if key not in memo:
            memo[key] = file_sha256(p)
            changed = True
        h.update(p.name.encode())
        h.update(memo[key].encode())
    if changed:
        atomic_write(memo_path, json.dumps(memo))
    return h.hexdigest()


def make_fingerprint(architecture: str, weights_sha: str, dtype: str) -> str:
    """``arch:sha16:dtype``; short enough for a safetensors header, specific enough to tell models apart."""
    return f"{architecture}:{weights_sha[:16]}:{dtype}"
