"""A request's passages, found once, and what is counted from them, counted once.

The scheduler's prefetch finds a queued request's passages (retrieval or matching) off the model
thread to start its KV loads early; the prefill then takes that result instead of finding them
again, and the prompt-length check counts from it too. Token ids (each passage's and the
question's) are computed by whichever of them needs them first, on the model thread, and kept.
A result found before another process changed the store is not used: the prefill finds the
passages again at the store's new generation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fusionrag.online.request import ReuseRequest
from fusionrag.retrieval.matching import Piece


@dataclass
class Resolved:
    """The passages of one request (``pieces``, in prompt order), their retrieval scores (None for
    passages the client sent), a note when there are none it might expect, and the store generation
    they were found at (None without a store)."""

    pieces: list[Piece]
    scores: list[float | None]
    note: str = ""
    generation: int | None = None
    #: A prompt the client built (:mod:`fusionrag.online.client_prompt`): its ids before the first stored chunk
    #: and after the last one, served as they are (None: fusionrag's layout, ``S`` + passages + question).
    client_prefix: list[int] | None = None
    client_question: list[int] | None = None
    _token_ids: list[list[int]] | None = field(default=None, repr=False)
    _question_ids: dict[tuple[str, str], list[int]] = field(default_factory=dict, repr=False)

    @property
    def chunk_ids(self) -> list[int | None]:
        return [p.chunk_id for p in self.pieces]

    @property
    def passages(self) -> list[dict]:
        return [p.as_passage() for p in self.pieces]

    def token_ids(self, engine: Any) -> list[list[int]]:
        """Each passage's token ids: a stored chunk's as stored (a part: its tokens of them), a client's passage
        tokenized (once)."""
        if self._token_ids is None:
            self._token_ids = [list(p.ids) if p.ids is not None else
                               engine.prompt.chunk_token_ids(p.title, p.text) if p.chunk_id is None else
                               list(engine.store.chunk(p.chunk_id).token_ids)[slice(*(p.span or (None,)))]
                               for p in self.pieces]
        return self._token_ids

    @property
    def forced(self) -> list[int]:
        """Pieces every method recomputes: a client's own tokens between stored chunks (gaps)."""
        return [i for i, p in enumerate(self.pieces) if p.ids is not None]

    @property
    def spans(self) -> list[tuple[int, int] | None]:
        """Each piece's tokens of its stored chunk when only part of it is served (None: all, or new text)."""
        return [p.span for p in self.pieces]

    def question_ids(self, engine: Any, request: ReuseRequest) -> list[int]:
        """The question segment's token ids (once per question and preamble); a raw prompt's own ids."""
        if self.client_question is not None:
            return self.client_question
        key = (request.question, request.preamble, request.raw)
        if key not in self._question_ids:
            if not request.raw:
                ids = engine.prompt.question_token_ids(request.question, request.preamble)
            elif request.prompt_ids is not None:
                ids = list(request.prompt_ids)
            else:
                ids = engine.prompt.raw_token_ids(request.question)
            self._question_ids[key] = ids
        return self._question_ids[key]

    def system_ids(self, engine: Any, request: ReuseRequest) -> list[int]:
        """``S``'s token ids: none before a raw prompt; a client's prompt's own prefix (:attr:`client_prefix`)."""
        if self.client_prefix is not None:
            return self.client_prefix
        return [] if request.raw else engine.prompt.system_token_ids

    def prompt_tokens(self, engine: Any, request: ReuseRequest) -> int:
        """Tokens of ``S`` + these passages + the question: the exact prompt length, before any prefill."""
        return (len(self.system_ids(engine, request)) + sum(map(len, self.token_ids(engine)))
                + len(self.question_ids(engine, request)))
