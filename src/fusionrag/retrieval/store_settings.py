"""A store's settings: what a new store records, and whether a loaded model may use a store.

The settings (a table in ``store.sqlite``) bind a store to one model's weights (its fingerprint,
any compute dtype: decision 052) and one ``S`` (the system prompt's hash: every chunk's KV is
computed after it), and name the embedder its vectors came from. Reading them without opening
the store (``store info``, the model check before a model loads) is :mod:`~fusionrag.retrieval.store_info`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from fusionrag.errors import FusionRAGError, StoreMismatchError
from fusionrag.models.fingerprint import same_weights
from fusionrag.models.registry import KNOWN_NAMES, LoadedModel
from fusionrag.prompt import PromptBuilder
from fusionrag.retrieval.embedder import Embedder

STORE_FORMAT = "fusionrag-store/1"


def model_reference(model: str) -> str:
    """What a store records to reload its model: a packaged or test model's name as it is, a local
    checkpoint folder as its resolved absolute path (so the store works from any working directory)."""
    if model in KNOWN_NAMES:
        return model
    folder = Path(model).expanduser()
    return str(folder.resolve()) if folder.is_dir() else model


def new_settings(lm: LoadedModel, prompt: PromptBuilder, chunk_tokens: int, kv_dtype: str, embedder: Embedder,
                 model_source: str | None) -> dict[str, Any]:
    """What a new store records (``model_source``: what :func:`load_model` needs to reload ``lm``)."""
    return {
        "format": STORE_FORMAT,
        "model": model_reference(model_source or lm.name),
        "fingerprint": lm.fingerprint,
        "system_hash": prompt.system_hash,
        "system_tokens": len(prompt.system_token_ids),
        "system_prompt": prompt.system_prompt,
        "chunk_tokens": int(chunk_tokens),
        "kv_dtype": kv_dtype,
        "embedder": embedder.name,
        "embedding_dim": int(embedder.dim),
        "fuse": None,  # the offline stage's settings, recorded by the first fuse (offline.build)
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def check_usable(path: Path, settings: dict[str, Any], lm: LoadedModel, embedder: Embedder | None) -> PromptBuilder:
    """The store's ``S`` for ``lm`` if ``lm`` may use the store recorded in ``settings``: another store format,
    other weights, another ``S`` or another embedder is refused."""
    if settings.get("format") != STORE_FORMAT:
        raise FusionRAGError(f"{path}: unsupported store format {settings.get('format')!r}")
    if not same_weights(str(settings["fingerprint"]), lm.fingerprint):  # any compute dtype: decision 052
        raise StoreMismatchError(
            f"the knowledge base at {path} was built with model {settings['model']} ({settings['fingerprint']}); "
            f"the loaded model {lm.name} ({lm.fingerprint}) cannot reuse its caches. Use --model "
            f"{settings['model']} or build a new store."
        )
    prompt = PromptBuilder.for_store(lm.tokenizer, settings)
    if prompt.system_hash != settings["system_hash"]:
        raise StoreMismatchError(
            f"the knowledge base at {path} was built with another system prompt "
            f"({settings['system_hash']} != {prompt.system_hash}); its caches cannot be reused"
        )
    if embedder is not None and embedder.name != settings["embedder"]:
        raise FusionRAGError(
            f"the knowledge base at {path} was embedded with {settings['embedder']}, not {embedder.name}"
        )
    return prompt
