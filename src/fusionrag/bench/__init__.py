"""Evaluation: datasets, answer metrics, the quality study, TTFT and serving benchmarks, reports.

The top layer (``tests/test_architecture.py``): eval calls the engine, the offline builder
and the server, and nothing calls eval. Its building blocks stay model-free where they can
(``metrics`` on answer text and logits, ``datasets`` on JSONL files, ``report``/``plots`` on
result rows) so each is tested without a model and reused by every benchmark.
"""
