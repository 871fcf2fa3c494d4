"""A small knowledge store of the bundled sample on the tiny model, as the online and CLI tests build it."""

from pathlib import Path

from fusionrag.models import load_model
from fusionrag.offline import build
from fusionrag.retrieval.embedder import HashingEmbedder
from fusionrag.sample import load_sample


def sample_store(path: Path, passages: int | None = None, fuse: bool = True) -> Path:
    """The sample's distinct passages (the first ``passages`` of them) in a float32 store at ``path``, one chunk
    each, fused with 2 neighbours unless ``fuse`` is False (plain KV only: a store never preprocessed)."""
    lm = load_model("tiny-llama")
    store = build.create_store(path, lm, chunk_tokens=4096, kv_dtype="float32", embedder=HashingEmbedder(),
                               model_source="tiny-llama")
    distinct = list({p["title"]: p for ex in load_sample() for p in ex["passages"]}.values())
    build.add_passages(store, lm, distinct[:passages], doc="sample")
    if fuse:
        build.fuse(store, lm, top_n=2, progress=False)
    store.close()
    return path
