"""Evaluation building blocks: datasets, answer metrics and reports.

Kept free of the engine on purpose (data flows engine -> eval, never back): the
metrics work on answer *text* and logits, the loader on JSONL files, the report on
plain result rows, so each can be tested without a model and reused by any bench.
"""
