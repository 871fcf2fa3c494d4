"""Serving: the OpenAI-compatible HTTP server around the engine, with continuous batching.

``app`` (routes) uses ``protocol`` (wire format), ``metrics``, ``documents`` (background
jobs) and ``batching`` (the model thread); ``launch`` builds a server from CLI options and
``server_thread`` runs one in-process. Data flows one way: ``serve`` calls the engine and
the KV-cache structures, never the reverse; the benchmarks against it live in ``eval``.
"""
