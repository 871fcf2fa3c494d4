"""The bundled sample: a few Wikipedia-style passages and multi-hop questions."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path


def sample_path() -> Path:
    return Path(str(resources.files("fusionrag") / "data" / "sample.jsonl"))


def load_sample() -> list[dict]:
    with open(sample_path(), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
