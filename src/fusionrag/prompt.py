"""The RAG prompt, cut into the segments KV reuse works on: ``S``, chunks, ``Q``.

Every method (Full Attention included) sees exactly the same token ids:
``ids(S) + ids(chunk_1) + ... + ids(chunk_k) + ids(Q)``, each segment tokenised on
its own. ``S`` is the chat template up to the user's content (system prompt and
instructions); a chunk is ``"[title]\\n text\\n\\n"``; ``Q`` is the question, the
answer instruction and the template's tail up to the assistant's turn.
This is the one place where prompt text is defined.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from fusionrag.files import content_hash

#: The instruction of a new store when ``ingest --system-prompt`` names none: general, so summaries,
#: longer answers and agent steps are not cut down to a few words.
DEFAULT_SYSTEM_PROMPT = (
    "You are a helpful assistant. Use the passages below to answer the user's request. "
    "If they do not contain what is needed, say so."
)
#: The short-answer instruction of the QA benchmarks (the paper's setting, F1/EM on short answers),
#: and of every store made before the instruction became a store setting (they did not record one).
SHORT_ANSWER_PROMPT = (
    "You are a helpful assistant. Answer the question using the passages below. "
    "Reply with a short answer of a few words, without explanation."
)
MAX_SYSTEM_PROMPT_CHARS = 8000
_CTX = "\x00CONTEXT\x00"


def chunk_text(title: str, text: str) -> str:
    """How a passage appears in the prompt (and in the knowledge base)."""
    title = (title or "").strip()
    body = (text or "").strip()
    return f"[{title}] {body}\n\n" if title else f"{body}\n\n"


def chat_prompt_ids(tokenizer: Any, messages: list[dict], add_generation_prompt: bool = True,
                    add_special_tokens: bool = False, template_kwargs: dict | None = None) -> list[int] | None:
    """The token ids of ``messages`` (``{role, content}``) through the model's own chat template, as vLLM and
    ``/tokenize`` render them (``template_kwargs``: vLLM's ``chat_template_kwargs``, e.g. Qwen3's
    ``enable_thinking``); None when the tokenizer has no chat template."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **(template_kwargs or {}))
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def is_valid_text(text: str) -> bool:
    """Whether ``text`` encodes as UTF-8: no lone surrogates (from JSON ``\\ud800`` escapes or from
    command-line bytes that were not UTF-8), which no tokenizer can read."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def read_system_prompt(value: str | None) -> str:
    """``--system-prompt TEXT|FILE``: the text of a file when ``value`` names one, else ``value`` itself
    (None: :data:`DEFAULT_SYSTEM_PROMPT`). A prompt that is empty, not UTF-8 or too long is refused."""
    from pathlib import Path

    from fusionrag.errors import FusionRAGError

    if value is None:
        return DEFAULT_SYSTEM_PROMPT
    text = value
    path = Path(value) if len(value) < 4096 and "\n" not in value else None
    if path is not None and path.is_file():
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise FusionRAGError(f"cannot read the system prompt file {path}: {exc}") from None
    text = text.strip()
    if not text or not is_valid_text(text) or len(text) > MAX_SYSTEM_PROMPT_CHARS:
        raise FusionRAGError(f"the system prompt must be non-empty UTF-8 text of at most {MAX_SYSTEM_PROMPT_CHARS} "
                             "characters")
    return text


def passage_hash(title: str, text: str) -> str:
    """Identity of a passage (and of a stored chunk): sha256 of exactly the text the prompt will contain."""
    return content_hash(chunk_text(title, text))


def question_text(question: str, preamble: str = "") -> str:
    """The question segment's text; ``preamble`` (see :func:`conversation_preamble`) comes first."""
    return f"{preamble}Question: {question.strip()}\nAnswer:"


def conversation_preamble(system: list[str], turns: list[tuple[str, str]]) -> str:
    """A client's system messages and earlier turns as text for the question segment.

    They cannot go into ``S`` (its KV is shared by every request and every stored chunk was
    computed after it), so they follow the reused passages, just before the question.
    ``turns`` are ``(role, text)`` pairs, oldest first.
    """
    lines = [f"Instructions: {text.strip()}" for text in system if text.strip()]
    if turns:
        lines.append("Earlier conversation:")
        lines.extend(f"{'User' if role == 'user' else 'Assistant'}: {text.strip()}" for role, text in turns)
    return "".join(f"{line}\n" for line in lines)


def rag_messages(system_prompt: str, passages: list[dict], question: str) -> list[dict]:
    """The chat messages whose rendering is exactly ``S + chunks + Q``: what a client of vLLM (with
    fusionrag's connector) sends so that the stored chunks' KV is found in its prompt. ``passages``:
    ``{title, text}`` dicts, in prompt order; ``system_prompt``: the store's (``fusionrag store info``)."""
    content = "Passages:\n" + "".join(chunk_text(p.get("title", ""), p["text"]) for p in passages)
    return [{"role": "system", "content": system_prompt},
            {"role": "user", "content": content + question_text(question)}]


@dataclass(frozen=True)
class PromptBuilder:
    """Tokenises prompt segments for one tokenizer and system prompt."""

    tokenizer: Any
    system_prompt: str = DEFAULT_SYSTEM_PROMPT

    @classmethod
    def for_store(cls, tokenizer: Any, settings: dict[str, Any]) -> PromptBuilder:
        """The prompt a store's KV was computed with: its recorded instruction (older stores: the short-answer one)."""
        return cls(tokenizer, settings.get("system_prompt", SHORT_ANSWER_PROMPT))

    @cached_property
    def _template_parts(self) -> tuple[str, str]:
        messages = [
            {"role": "system", "content": self.system_prompt},
            {"role": "user", "content": _CTX},
        ]
        if getattr(self.tokenizer, "chat_template", None):
            rendered = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        else:  # base models: a plain-text layout
            rendered = f"{self.system_prompt}\n\n{_CTX}\n"
        head, tail = rendered.split(_CTX)
        return head + "Passages:\n", tail

    @cached_property
    def system_token_ids(self) -> list[int]:
        """Token ids of ``S``."""
        return self.encode(self._template_parts[0])

    @cached_property
    def system_hash(self) -> str:
        """Identifies ``S``: a chunk cache computed after another ``S`` must not be reused."""
        return hashlib.sha256(repr(self.system_token_ids).encode()).hexdigest()[:16]

    def chunk_token_ids(self, title: str, text: str) -> list[int]:
        return self.encode(chunk_text(title, text))

    def question_token_ids(self, question: str, preamble: str = "") -> list[int]:
        return self.encode(question_text(question, preamble) + self._template_parts[1])

    def raw_token_ids(self, prompt: str) -> list[int]:
        """A prompt continued as it is (a raw text completion): the tokenizer's ids with its special tokens
        (a BOS where the model has one), as vLLM and transformers tokenize a prompt; no template, no ``S``."""
        return list(self.tokenizer.encode(prompt, add_special_tokens=True))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))
