"""Request bodies as pydantic models: what a client may send, in one place, with an OpenAPI schema.

Every model forbids unknown fields: a field fusionrag does not implement (``functions``,
``audio``...) is a 400 naming it, never silently ignored. Fields OpenAI clients send with their
neutral value (``n: 1``, ``store: false``,
``tools: []``, ``tool_choice: "none"``,
``parallel_tool_calls: false``; on an assistant turn ``tool_calls: []``, ``refusal``,
``function_call`` and ``audio`` null, ``annotations: []``: what the openai SDK's
``message.model_dump()`` gives) are accepted, as vLLM accepts them; any other value is a 400 naming
the field (:func:`fusionrag.serve.protocol.check_neutral`). Sampling takes vLLM's names and
meanings (``top_k``, ``min_p``, ``repetition_penalty``, ``presence_penalty``, ``frequency_penalty``,
``logit_bias``, ``min_tokens``, ``stop_token_ids``, ``include_stop_str_in_output``, ``skip_special_tokens``),
and structured outputs OpenAI's ``response_format`` or vLLM's ``structured_outputs``; the retrieval depth is
``retrieval_top_k``. The
routes read the body themselves (bounded, see :func:`fusionrag.serve.bodies.read_json`)
and validate it with these models; :func:`validation_error` turns pydantic's report into
one OpenAI-shaped error.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, RootModel, ValidationError

from fusionrag.online.methods import KVKind

NonNegFloat = Annotated[float, Field(ge=0.0)]

#: Fields OpenAI defines that fusionrag refuses, and why (the rest of the unknown ones get a generic message).
UNSUPPORTED = {
    "tools": "tool calling is not supported",
    "tool_choice": "tool calling is not supported",
    "parallel_tool_calls": "tool calling is not supported",
    "functions": "function calling is not supported",
    "function_call": "function calling is not supported",
    "audio": "audio output is not supported",
    "modalities": "only text output is supported",
    "prediction": "predicted outputs are not supported",
    "suffix": "suffix (insertion) is not supported",
    "best_of": "best_of is not supported",
    "reasoning_effort": "reasoning_effort is not supported",
    "web_search_options": "web search is not supported",
}


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class Document(_Body):
    """A passage supplied by the client: reused from the store when its content hash is there."""

    title: str | None = ""
    text: str


class TextPart(_Body):
    type: Literal["text"]
    text: str


class Passage(_Body):
    """A passage sent by the client: used instead of retrieval, its KV reused if the store holds it."""

    title: str | None = Field(None, description="the passage's title (part of its identity in the store)")
    text: str = Field(min_length=1, description="the passage's text")
    source: str | None = Field(None, description="where the text came from (a file path or URL): lets the server "
                                                 "split it the way the store's reader split that file")
    id: str | None = Field(None, description="the document's id in the store (POST /v1/documents: the same id "
                                             "again replaces the document)")


class RetrieveRequest(_Body):
    """``POST /v1/retrieve``: the store's chunks for a query, to send back as a request's ``documents``."""

    query: str = Field(min_length=1, description="the text to retrieve for (usually the question)")
    top_k: int | None = Field(None, ge=1, description="how many chunks (default: the engine's retrieval depth)")


class DocumentsWrapper(_Body):
    documents: list[Passage] = Field(min_length=1)


class DocumentsRequest(RootModel[list[Passage] | DocumentsWrapper]):
    """``POST /v1/documents``: a list of passages, or ``{"documents": [...]}`` (the schema clients and fuzzers read;
    the route validates the body itself, with the server's limits)."""


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    # what the openai SDK's message.model_dump() carries back: accepted empty only (check_neutral)
    tool_calls: list[dict[str, Any]] | None = Field(None, description="[] or null only (no tool calling)")
    refusal: str | None = Field(None, description="null only")
    function_call: dict[str, Any] | None = Field(None, description="null only (no function calling)")
    audio: dict[str, Any] | None = Field(None, description="null only (text only)")
    annotations: list[dict[str, Any]] | None = Field(None, description="[] or null only")


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = Field(False, description="as vLLM: usage in every chunk of the stream")


class _Generation(_Body):
    """What chat and text completions share: sampling, streaming and fusionrag's own fields."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, description="sampling top-k, as vLLM: keep the k most likely tokens; "
                                                       "-1 or 0: off (the retrieval depth is retrieval_top_k)")
    min_p: float | None = Field(None, ge=0.0, le=1.0, description="as vLLM: drop tokens less likely than min_p "
                                                                  "times the most likely token; 0: off")
    repetition_penalty: float | None = Field(None, gt=0.0, le=100.0, allow_inf_nan=False,
                                             description="as vLLM: > 1 penalises tokens already in the prompt "
                                                         "or the output; 1: off")
    sample_top_k: int | None = Field(None, ge=0, description="deprecated: the same as top_k (sampling); it goes "
                                                             "in the next release", json_schema_extra={
                                                                 "deprecated": True})
    seed: int | None = Field(None, ge=0, le=2**64 - 1, description="sampling seed, 0..2**64-1")
    stop: str | list[str] | None = None
    n: int | None = Field(None, ge=1)
    user: str | None = None
    metadata: dict[str, str] | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False,
                                           description="subtracted from the logit of every token the answer holds")
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False,
                                            description="subtracted once per time a token appears in the answer")
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0, allow_inf_nan=False)]] | None = Field(
        None, description="token id (a string, as OpenAI) -> bias added to its logit, -100..100")
    min_tokens: int | None = Field(None, ge=0, description="as vLLM: no end of turn (nor stop_token_ids) before "
                                                          "this many tokens")
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(None, description="as vLLM: more tokens that "
                                                                                      "end the answer")
    include_stop_str_in_output: bool | None = Field(None, description="as vLLM: keep the stop string that ended "
                                                                      "the answer")
    skip_special_tokens: bool | None = Field(None, description="as vLLM: special tokens left out of the text "
                                                               "(default true)")
    response_format: dict[str, Any] | None = Field(None, description='{"type": "text" | "json_object" | '
                                                                    '"json_schema", "json_schema": {"schema": ...}}')
    structured_outputs: dict[str, Any] | None = Field(None, description="as vLLM: one of json (a schema), regex, "
                                                                        "choice (a list), grammar (EBNF), "
                                                                        "json_object")
    prompt_logprobs: int | None = Field(None, ge=0, le=20, description="as vLLM: each prompt token's log-probability "
                                                                      "and this many alternatives (computed by a Full "
                                                                      "Attention forward of the prompt)")
    skip_reading_prefix_cache: bool | None = Field(None, description="as vLLM: read no KV an earlier request "
                                                                     "computed (context and prefix caches; the "
                                                                     "store's chunks are the method): A/B tests")
    # accepted at their neutral value only (what OpenAI clients send by default)
    store: bool | None = Field(None, description="false only: fusionrag keeps no completions")
    # fusionrag
    method: str | None = None
    ratio: float | Literal["auto"] | None = Field(None, description="share of the context to recompute, or \"auto\": "
                                                                     "as much as the question needs (usage.fusionrag."
                                                                     "ratio says the share chosen)")
    retrieval_top_k: int | None = Field(None, ge=0, description="retrieval depth: how many of the store's chunks "
                                                                "to retrieve (0: none)")
    retrieval: bool | None = Field(None, description="false: no retrieval from the server's store (the request's "
                                                     "own passages, or none)")
    kv: KVKind | None = None
    documents: list[Passage] | None = Field(None, description="[{title, text, source?}] passages used instead of "
                                                              "retrieval ([]: none)")


class ChatCompletionRequest(_Generation):
    messages: list[Message] = Field(min_length=1)
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="as vLLM: passed to the chat template "
                                                                          "(a prompt the client builds: no documents)")
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # accepted at their neutral value only: no tool calling
    tools: list[dict[str, Any]] | None = Field(None, description="[] only (tool calling is not supported)")
    tool_choice: str | dict[str, Any] | None = Field(None, description='"none" only')
    parallel_tool_calls: bool | None = Field(None, description="false only")


class CompletionRequest(_Generation):
    """A raw continuation of ``prompt`` (no template, no system prompt), as vLLM's; with passages
    (``documents``, ``<document>`` blocks) or retrieval asked for (``retrieval: true``,
    ``retrieval_top_k`` >= 1) the prompt is the question of a RAG prompt instead."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20, description="top alternatives per token (legacy API)")
    echo: bool | None = Field(None, description="the prompt before the completion in the text (and, with logprobs, "
                                                "in the log-probabilities)")


class TokenizeCompletionRequest(_Body):
    """``POST /tokenize`` of a prompt (vLLM's body): its token ids as a text completion prefills them."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = Field(True, description="the tokenizer's special tokens (a BOS where the model "
                                                       "has one), as a completion prompt gets them")
    return_token_strs: bool | None = Field(False, description="also each token's text")


class TokenizeChatRequest(_Body):
    """``POST /tokenize`` of messages (vLLM's body): the model's chat template over them, tokenized."""

    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    add_generation_prompt: bool = Field(True, description="end with the assistant's turn opening")
    add_special_tokens: bool = Field(False, description="special tokens on top of the template's")
    return_token_strs: bool | None = Field(False, description="also each token's text")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="as vLLM: passed to the chat template")


class TokenizeRequest(RootModel[TokenizeCompletionRequest | TokenizeChatRequest]):
    """``POST /tokenize``: ``{"prompt": ...}`` or ``{"messages": [...]}``, as vLLM takes them."""


class EmbeddingsRequest(_Body):
    """``POST /v1/embeddings`` (OpenAI's body): vectors of the store's embedding model, for a framework's own
    vector store or for searching it with the server's own model."""

    input: str | list[str] | list[int] | list[list[int]] = Field(description="text(s), or token ids of the "
                                                                           "embedding model's tokenizer")
    model: str | None = Field(None, description="the embedding model's name (GET /v1/models lists it) or a "
                                                "served model's name")
    encoding_format: Literal["float", "base64"] | None = "float"
    dimensions: int | None = Field(None, ge=1, description="the model's own dimension only (no truncation)")
    user: str | None = None


class DetokenizeRequest(_Body):
    """``POST /detokenize`` (vLLM's body): token ids back to text."""

    model: str | None = None
    tokens: list[int] = Field(description="token ids, each within the vocabulary")


def validation_error(exc: ValidationError) -> tuple[str, str, str | None]:
    """``(message, code, param)`` for the first problem pydantic found."""
    err = exc.errors()[0]
    loc = [str(x) for x in err.get("loc", ())]
    field = loc[0] if loc else None
    where = ".".join(loc) or "body"
    if err.get("type") == "extra_forbidden":
        why = UNSUPPORTED.get(field or "", "this field is not supported by fusionrag") if len(loc) == 1 \
            else "this field is not supported by fusionrag"
        return f"'{where}': {why}", "unsupported_parameter", field
    code = {"ratio": "invalid_ratio", "method": "unknown_method"}.get(field or "", "invalid_value")
    return f"'{where}': {err.get('msg', 'invalid')}", code, field


#: Where the request bodies' nested models live in the OpenAPI document (``#/$defs`` does not resolve there).
REF_TEMPLATE = "#/components/schemas/{model}"


def body_schema(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` for a route that reads its body itself: the model's JSON schema as the request body;
    its nested models are in ``components.schemas`` (:func:`component_schemas`), where ``$ref`` points."""
    schema = model.model_json_schema(ref_template=REF_TEMPLATE)
    schema.pop("$defs", None)
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def component_schemas(*models: type[BaseModel]) -> dict[str, Any]:
    """The nested models of these request bodies, for the OpenAPI document's ``components.schemas``."""
    out: dict[str, Any] = {}
    for model in models:
        out.update(model.model_json_schema(ref_template=REF_TEMPLATE).get("$defs", {}))
    return out
