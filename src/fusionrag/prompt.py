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

SYSTEM_PROMPT = (
    "You are a helpful assistant. Answer the question using the passages below. "
    "Reply with a short answer of a few words, without explanation."
)
_CTX = "\x00CONTEXT\x00"


def chunk_text(title: str, text: str) -> str:
    """How a passage appears in the prompt (and in the knowledge base)."""
    title = (title or "").strip()
    body = (text or "").strip()
    return f"[{title}] {body}\n\n" if title else f"{body}\n\n"


def is_valid_text(text: str) -> bool:
    """Whether ``text`` encodes as UTF-8: no lone surrogates (from JSON ``\\ud800`` escapes or from
    command-line bytes that were not UTF-8), which no tokenizer can read."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


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


@dataclass(frozen=True)
class PromptBuilder:
    """Tokenises prompt segments for one tokenizer and system prompt."""

    tokenizer: Any
    system_prompt: str = SYSTEM_PROMPT

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

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))
