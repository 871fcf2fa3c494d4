"""Model adapter: loading (packaged GGUF, local checkpoints), compatibility, RoPE re-positioning."""

from fusionrag.models.registry import DEFAULT_MODEL, KNOWN_NAMES, LoadedModel, load_model, wrap_model

__all__ = ["DEFAULT_MODEL", "KNOWN_NAMES", "LoadedModel", "load_model", "wrap_model"]
