"""Serving: the OpenAI-compatible HTTP server around the engine and its scheduler.

``app`` builds the server from the routers in ``routes`` over one ``state``; ``protocol`` parses
bodies into requests, ``responses`` writes answers and streams, ``api_errors`` answers every
error, ``metrics`` and ``documents`` (background jobs) sit beside them. The scheduler that admits,
prefills and decodes every request is the engine's (``fusionrag.online.scheduler``): this
package translates HTTP to requests and engine events back to HTTP/SSE. ``launch`` builds a
server from CLI options and ``server_thread`` runs one in-process. Data flows one way: ``serve``
calls the engine and the KV-cache structures, never the reverse.
"""
