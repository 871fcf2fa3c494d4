"""Structured outputs: a request's answer held to a JSON schema, any JSON object, a regular expression, one of
given choices, or an EBNF grammar, with xgrammar (the grammar library vLLM uses by default).

Why a grammar library and not a prompt: a grammar masks, at every step, the tokens that cannot continue a
valid answer, so the answer is valid by construction, whatever the model or the method that prefilled its
prompt (FusionRAG's reused context or Full Attention: the mask acts on the next-token logits only, after
the prompt is computed). A grammar is compiled once per tokenizer and spec (:class:`Grammars`, cached) and
walked per request (:class:`Constraint`): ``mask`` before a token is chosen, ``accept`` after; when the
grammar is complete only the end of turn is allowed, so the answer ends there.

One guard on top of xgrammar 0.2.8: a JSON-schema string with ``maxLength`` compiles to a character class that
lets control characters (bytes below 0x20) through, which JSON forbids raw; for ``json_schema`` constraints,
tokens holding such a byte are masked too (a schema constraint emits no whitespace of its own, so nothing
valid is lost).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from fusionrag.errors import FusionRAGError

#: What a request may constrain its answer to.
KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class GrammarSpec:
    """A request's constraint: ``kind`` (one of :data:`KINDS`) and its text (a schema as JSON, a regex, the
    choices as a JSON list, an EBNF grammar; empty for ``json_object``)."""

    kind: str
    text: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown structured output {self.kind!r} (one of {', '.join(KINDS)})")


class Grammars:
    """Compiled grammars for one tokenizer (xgrammar's ``GrammarCompiler``), the most recent kept."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: list[int], keep: int = 64) -> None:
        try:
            import xgrammar as xgr
        except ImportError as exc:  # a core dependency; said plainly if an environment lacks it
            raise FusionRAGError("structured outputs need the 'xgrammar' package (pip install xgrammar)") from exc
        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_ids)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1)
        self.vocab_size = vocab_size
        control = torch.zeros(vocab_size, dtype=torch.bool)
        for i, token in enumerate(self.info.decoded_vocab[:vocab_size]):
            control[i] = any(b < 0x20 for b in token)
        self.control = control  # tokens that carry a control byte (forbidden raw in a JSON string)
        self._cache: OrderedDict[GrammarSpec, Any] = OrderedDict()
        self._keep = keep
        self._lock = threading.Lock()

    def compiled(self, spec: GrammarSpec) -> Any:
        """The compiled grammar of ``spec``; a spec xgrammar cannot compile is a ValueError saying why."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
        try:
            grammar = self._compile(spec)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ValueError(f"the {spec.kind} cannot be used as a constraint: {str(exc).splitlines()[0]}") from None
        with self._lock:
            self._cache[spec] = grammar
            while len(self._cache) > self._keep:
                self._cache.popitem(last=False)
        return grammar

    def _compile(self, spec: GrammarSpec) -> Any:
        c = self.compiler
        if spec.kind == "json_object":
            return c.compile_builtin_json_grammar()
        if spec.kind == "json_schema":
            return c.compile_json_schema(spec.text, any_whitespace=False)
        if spec.kind == "regex":
            return c.compile_regex(spec.text)
        if spec.kind == "choice":
            choices = json.loads(spec.text)
            alternatives = " | ".join(json.dumps(str(x)) for x in choices)
            return c.compile_grammar(f"root ::= {alternatives}")
        return c.compile_grammar(spec.text)

    def constraint(self, spec: GrammarSpec) -> Constraint:
        forbidden = self.control if spec.kind == "json_schema" else None
        return Constraint(self.xgr, self.compiled(spec), self.vocab_size, forbidden)


class Constraint:
    """One request's walk through its grammar (``forbidden``: tokens masked on top of it, see the module doc)."""

    def __init__(self, xgr: Any, grammar: Any, vocab_size: int, forbidden: torch.Tensor | None = None) -> None:
        self.xgr = xgr
        self.matcher = xgr.GrammarMatcher(grammar)
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self.forbidden = forbidden

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` (``[vocab]``, fp32, CPU) with every token that cannot continue a valid answer at -inf."""
        self.matcher.fill_next_token_bitmask(self.bitmask)
        masked = logits.clone().unsqueeze(0)
        self.xgr.apply_token_bitmask_inplace(masked, self.bitmask)
        if self.forbidden is not None:
            n = min(self.forbidden.numel(), masked.shape[1])
            masked[0, :n] = masked[0, :n].masked_fill(self.forbidden[:n], float("-inf"))
        return masked[0]

    def accept(self, token: int) -> None:
        if not self.matcher.accept_token(int(token)):
            raise RuntimeError(f"token {token} does not continue the grammar")

    @property
    def done(self) -> bool:
        """The answer is complete (only the end of turn could follow)."""
        return bool(self.matcher.is_terminated())


def spec_of(response_format: dict | None, structured: dict | None) -> GrammarSpec | None:
    """The constraint a request asks for: OpenAI's ``response_format`` (``json_object``, ``json_schema``) or
    vLLM's ``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar``); None for plain text. A malformed
    one is a ValueError naming what is wrong."""
    if structured:
        given = [k for k in ("json", "regex", "choice", "grammar", "json_object") if structured.get(k) is not None]
        if len(given) != 1:
            raise ValueError("structured_outputs takes exactly one of json, regex, choice, grammar, json_object")
        key, value = given[0], structured[given[0]]
        if key == "json":
            return GrammarSpec("json_schema", value if isinstance(value, str) else json.dumps(value))
        if key == "json_object":
            return GrammarSpec("json_object")
        if key == "choice":
            if not isinstance(value, list) or not value or not all(isinstance(x, str) for x in value):
                raise ValueError("structured_outputs.choice takes a non-empty list of strings")
            return GrammarSpec("choice", json.dumps(value))
        if not isinstance(value, str) or not value:
            raise ValueError(f"structured_outputs.{key} takes a non-empty string")
        return GrammarSpec(key, value)
    if not response_format or response_format.get("type") in (None, "text"):
        return None
    kind = response_format.get("type")
    if kind == "json_object":
        return GrammarSpec("json_object")
    if kind == "json_schema":
        schema = (response_format.get("json_schema") or {}).get("schema")
        if not isinstance(schema, dict):
            raise ValueError("response_format.json_schema.schema must be a JSON schema object")
        return GrammarSpec("json_schema", json.dumps(schema))
    raise ValueError(f"response_format type {kind!r} is not supported (text, json_object, json_schema)")
