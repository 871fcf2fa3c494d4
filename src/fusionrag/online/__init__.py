"""Online stage: assembling reused KV, selecting tokens to recompute, answering."""
