"""A fusionrag store opened from inside vLLM: read-only, checked against the weights vLLM serves.

The store's caches are valid only for the weights that made them (any compute dtype:
:func:`~fusionrag.models.fingerprint.same_weights`), so the model vLLM loaded is fingerprinted the way
fusionrag fingerprints a checkpoint folder, and a store of other weights is refused in one line.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fusionrag.errors import FusionRAGError


@dataclass(frozen=True)
class ServedModel:
    """What a store checks a model against: its name, fingerprint and tokenizer (no weights needed)."""

    name: str
    fingerprint: str
    tokenizer: Any


def served_model(model_config: Any) -> ServedModel:
    """The model vLLM serves (a local Hugging Face folder), as a store sees it."""
    from transformers import AutoTokenizer

    from fusionrag.models.fingerprint import make_fingerprint, weights_hash

    folder = Path(str(model_config.model)).expanduser()
    if not folder.is_dir():
        raise FusionRAGError(f"the fusionrag connector needs a local model folder; vLLM serves {folder}")
    tokenizer = AutoTokenizer.from_pretrained(str(getattr(model_config, "tokenizer", None) or folder))
    dtype = str(getattr(model_config, "dtype", "float32")).removeprefix("torch.")
    arch = getattr(model_config.hf_config, "model_type", "unknown")
    return ServedModel(folder.name, make_fingerprint(arch, weights_hash(folder), dtype), tokenizer)


def open_store(path: str | Path, model_config: Any) -> Any:
    """The store at ``path``, read-only, for the model vLLM serves (refused if its weights differ)."""
    from fusionrag.retrieval.knowledge import KnowledgeStore

    return KnowledgeStore.open(Path(path).expanduser(), lm=served_model(model_config), read_only=True)
