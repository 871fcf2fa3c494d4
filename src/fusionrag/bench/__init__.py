"""``fusionrag bench``: quality, TTFT, serving-load and fault benchmarks on a user's own data, and reports.

The top layer (``tests/package/test_architecture.py``): bench calls the engine, the offline builder
and the server, and nothing in the package calls bench. Plots (matplotlib) and the load tests'
client (httpx) are the ``bench`` extra, imported only here. Its building blocks stay model-free where they can
(``metrics`` on answer text and logits, ``datasets`` on JSONL files, ``report``/``plots`` on
result rows) so each is tested without a model and reused by every benchmark.
"""
