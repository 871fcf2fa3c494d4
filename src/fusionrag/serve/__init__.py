"""Serving: the paper's system parts around the engine (prefix-cache simulation, server, load test).

Data flows one way: ``serve`` calls the engine and the KV-cache structures
(:mod:`fusionrag.kvcache.prefix_cache`, :mod:`fusionrag.kvcache.tiers`), never the reverse.
"""
