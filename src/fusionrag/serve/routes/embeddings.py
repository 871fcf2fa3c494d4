"""``POST /v1/embeddings``: the knowledge store's embedding model, as OpenAI's endpoint serves one.

Frameworks that keep their own vector store (LlamaIndex's ``VectorStoreIndex``, LangChain's vector stores) call
it for their documents and queries; with the store's own model their retrieval agrees with ``/v1/retrieve``'s.
Without a store the default embedder (all-MiniLM-L6-v2) answers. Inputs are bounded by the server's limits
(passages per request, characters per passage); token-id inputs are decoded with the embedding model's
tokenizer.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import numpy as np
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from fusionrag.serve.api_errors import APIError
from fusionrag.serve.bodies import read_json, validated
from fusionrag.serve.schemas import EmbeddingsRequest, body_schema
from fusionrag.serve.state import State, require_api_key

router = APIRouter(dependencies=[Depends(require_api_key)])


@router.post("/v1/embeddings", openapi_extra=body_schema(EmbeddingsRequest))
async def embeddings(request: Request, server: State) -> JSONResponse:
    s = server.settings
    body = validated(EmbeddingsRequest, await read_json(request, s.max_body_bytes))
    server.ensure_ready()
    embedder = _embedder(server)
    if body.model is not None and body.model not in (embedder.name, *server.served_names()):
        raise APIError(404, f"the model '{body.model}' does not exist on this server (embeddings: "
                            f"{embedder.name!r})", "invalid_request_error", "model_not_found", "model")
    texts = _texts(body.input, embedder)
    if not texts or len(texts) > s.max_documents or any(len(t) > s.max_document_chars or not t for t in texts):
        raise APIError(400, f"'input' takes 1 to {s.max_documents} non-empty texts of at most "
                            f"{s.max_document_chars} characters", code="invalid_value", param="input")
    dim = int(getattr(embedder, "dim", 0) or 0)
    if body.dimensions is not None and body.dimensions != dim:
        raise APIError(400, f"'dimensions': {embedder.name} gives {dim}-dimensional vectors", code="invalid_value",
                       param="dimensions")
    vectors = await asyncio.to_thread(embedder.embed, texts)
    data = [{"object": "embedding", "index": i, "embedding": _encoded(v, body.encoding_format)}
            for i, v in enumerate(vectors)]
    tokens = sum(len(t.split()) for t in texts)
    return JSONResponse({"object": "list", "data": data, "model": embedder.name,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


def _embedder(server: Any) -> Any:
    """The store's embedder (the model its index was built with), else the default one, loaded once."""
    engine = server.engine
    if engine is not None and engine.store is not None:
        return engine.store.embedder
    cached = getattr(server, "_default_embedder", None)
    if cached is None:
        from fusionrag.retrieval.embedder import get_embedder

        cached = server._default_embedder = get_embedder(None)
    return cached


def _texts(value: Any, embedder: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if value and all(isinstance(v, int) for v in value):
        value = [value]
    if value and isinstance(value[0], list):  # token ids of the embedding model's tokenizer
        tokenizer = getattr(getattr(embedder, "model", None), "tokenizer", None)
        if tokenizer is None:
            raise APIError(400, f"'input': {embedder.name} takes text, not token ids", code="invalid_value",
                           param="input")
        return [tokenizer.decode(ids, skip_special_tokens=True) for ids in value]
    return list(value)


def _encoded(vector: np.ndarray, encoding: str | None) -> Any:
    if encoding == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
    return [float(x) for x in vector]
