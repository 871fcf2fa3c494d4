"""``ReuseRequest``: what a request asks of the reuse path, validated in one place.

The CLI (``ask``), the server's request bodies, the Python API and the benchmarks all build
one of these and call :meth:`ReuseRequest.validated`; none of them checks a method name, a
ratio or a KV kind on its own. An invalid field raises :class:`InvalidRequest`, a
:class:`~fusionrag.errors.FusionRAGError` that also names the field (``param``) so the
server can answer a 400 that points at it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from fusionrag.errors import FusionRAGError
from fusionrag.online.auto_ratio import AUTO, AUTO_METHODS, Ratio, is_auto
from fusionrag.online.methods import KV_KINDS, default_kv, method_info
from fusionrag.prompt import is_valid_text

DEFAULT_METHOD = "fusionrag"
DEFAULT_RATIO = 0.15
DEFAULT_TOP_K = 5
#: Answer length when the caller names none: long enough for summaries and explanations (an answer
#: ends at the model's end-of-turn token first; a server bounds it by its ``max_new_tokens``).
DEFAULT_MAX_NEW_TOKENS = 512


class InvalidRequest(FusionRAGError):
    """A request field out of its range; ``param`` names the field, ``code`` an OpenAI-style error code."""

    def __init__(self, message: str, param: str, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param = param
        self.code = self.api_code = code


@dataclass(frozen=True)
class ReuseRequest:
    """A question and how to reuse KV for it.

    ``kv=None`` means the method's default (:func:`~fusionrag.online.methods.default_kv`);
    ``chunks`` (``{title, text}`` dicts, in order; ``[]``: none) replaces retrieval; ``preamble`` (system
    messages, earlier turns) goes into the question segment, after the passages.

    Retrieval from the store runs only when the request brings no passages of its own: ``chunks``
    given (even empty), ``retrieval=False`` or ``top_k=0`` turn it off, so a framework that
    retrieved (or pasted) its own context never gets the store's chunks on top of it.

    ``raw``: the question is a prompt to continue as it is (a text completion, as vLLM's): no ``S``,
    no template, no passages, never stripped; ``prompt_ids`` are its token ids when the client sent
    ids (else the tokenizer's, with its special tokens, as vLLM and transformers tokenize a prompt).
    ``skip_cache`` (vLLM's ``skip_reading_prefix_cache``): no KV an earlier request computed is read (the
    store's chunks still are: that is the method); what a request does reuse is counted by origin either way.
    """

    question: str
    method: str = DEFAULT_METHOD
    ratio: Ratio = DEFAULT_RATIO
    kv: str | None = None
    top_k: int | None = None
    chunks: Sequence[dict] | None = None
    preamble: str = ""
    retrieval: bool | None = None
    raw: bool = False
    prompt_ids: tuple[int, ...] | None = None
    skip_cache: bool = False  # read no cache (a whole context, a passage an earlier request computed): A/B tests
    #: The door checked that every text is valid Unicode (the server's JSON body, at ``read_json``): not again.
    texts_checked: bool = field(default=False, compare=False, repr=False)
    #: Set by :meth:`validated` on what it returns: validating that again returns it as it is.
    checked: bool = field(default=False, compare=False, repr=False)

    @property
    def retrieves(self) -> bool:
        """Whether the store is searched for this request's passages."""
        return self.chunks is None and self.retrieval is not False and self.top_k != 0 and not self.raw

    def validated(self, max_top_k: int | None = None) -> ReuseRequest:
        """This request with defaults resolved (kv; ratio 1 for ``full``, 0 for ``reuse``), or InvalidRequest.
        Done once per request, at its door: a request already validated is returned unchanged."""
        if self.checked:
            return self
        out = self.fields_validated(max_top_k)
        question = (self.question or "") if self.raw else (self.question or "").strip()
        if not question:
            raise InvalidRequest("the question is empty", "question", "empty_question")
        if self.raw and (self.chunks or self.preamble or self.retrieval):
            raise InvalidRequest("a raw prompt takes no passages, preamble or retrieval", "prompt")
        for name, text in () if self.texts_checked else (("question", question), ("preamble", self.preamble or "")):
            if not is_valid_text(text):
                raise InvalidRequest(f"the {name} is not valid Unicode text (undecodable bytes or a lone surrogate)",
                                     name, "invalid_unicode")
        for i, c in enumerate(() if self.texts_checked else self.chunks or ()):
            if not all(is_valid_text(str(c.get(k, ""))) for k in ("title", "text")):
                raise InvalidRequest(f"passage {i} is not valid Unicode text", "documents", "invalid_unicode")
        return replace(out, question=question, checked=True)

    def fields_validated(self, max_top_k: int | None = None) -> ReuseRequest:
        """Every field but the question checked (a server checks the question after parsing passages)."""
        info = method_info_or_invalid(self.method)
        ratio = check_ratio(self.ratio)
        if is_auto(ratio) and not (info.recomputes_nothing or info.name in ("full", *AUTO_METHODS)):
            raise InvalidRequest(f"ratio \"auto\" sizes the recompute from the question's attention, which "
                                 f"{', '.join(AUTO_METHODS)} select by; give {info.name} a number", "ratio",
                                 "invalid_ratio")
        if info.name == "full":
            ratio = 1.0
        elif info.recomputes_nothing:
            ratio = 0.0
        kv = self.kv if self.kv is not None else info.kv
        if info.name != "full" and kv not in KV_KINDS:
            raise InvalidRequest(f"kv must be one of {', '.join(KV_KINDS)}, got {kv!r}", "kv")
        if info.name == "full":
            kv = "none"
        if self.top_k is not None:
            hi = max_top_k if max_top_k is not None else 1_000
            if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or not 0 <= self.top_k <= hi:
                raise InvalidRequest(f"'top_k' (retrieval depth) must be between 0 (no retrieval) and {hi}, "
                                     f"got {self.top_k}", "top_k")
        if self.retrieval is not None and not isinstance(self.retrieval, bool):
            raise InvalidRequest(f"'retrieval' must be true or false, got {self.retrieval!r}", "retrieval")
        return replace(self, ratio=ratio, kv=kv)


def method_info_or_invalid(method: str):
    """The registered method, or InvalidRequest naming the choices."""
    try:
        return method_info(method)
    except FusionRAGError as exc:
        raise InvalidRequest(str(exc), "method", "unknown_method") from None


def check_ratio(ratio: Any) -> Ratio:
    """A recompute ratio within [0, 1], or ``"auto"`` (each request's own: :mod:`fusionrag.online.auto_ratio`);
    the one check every door uses."""
    if is_auto(ratio):
        return AUTO
    try:
        value = float(ratio)
    except (TypeError, ValueError):
        raise InvalidRequest(f"'ratio' must be a number within [0, 1] or \"auto\", got {ratio!r}", "ratio",
                             "invalid_ratio") from None
    if isinstance(ratio, bool) or not math.isfinite(value) or not 0.0 <= value <= 1.0:
        raise InvalidRequest(f"'ratio' must be a number within [0, 1] or \"auto\", got {ratio!r}", "ratio",
                             "invalid_ratio")
    return value


def resolved_kv(method: str, kv: str | None) -> str:
    """The KV kind a request of ``method`` reads (``kv`` or the method's default)."""
    return kv if kv is not None else default_kv(method)
