"""Offline stage: plain (Full Reuse) and similarity-fused chunk KV, and the ``ingest`` / ``preprocess`` CLI."""
