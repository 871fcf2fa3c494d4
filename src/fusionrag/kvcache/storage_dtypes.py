"""The storage dtypes a store's KV can have, without importing torch (the command line's ``--kv-dtype``)."""

from __future__ import annotations

#: Storage dtypes a store can be created with (what ``--kv-dtype`` offers).
STORAGE_DTYPES = ("float16", "float32", "int8")
#: What ``fusionrag ingest`` creates a store with: int8's fidelity loss against fp16 is not resolved
#: on 50 paired TriviaQA questions, and it halves the store (decision 015, studies/kv_int8/results/summary).
DEFAULT_KV_DTYPE = "int8"
