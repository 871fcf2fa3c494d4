"""Greedy decoding of one answer (a batch of one in the shared decode loop), and text streaming."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from fusionrag.execution.decoder import BatchDecoder
from fusionrag.kvcache.kv import KV
from fusionrag.models.registry import LoadedModel


def greedy_tokens(
    lm: LoadedModel,
    kv: KV,
    last_logits: torch.Tensor,
    max_new_tokens: int = 32,
    stop_ids: list[int] | None = None,
) -> Iterator[int]:
    """Yield greedy tokens continuing the prompt whose KV is ``kv`` (never modified).

    ``last_logits`` are the logits after the prompt's last token, so the first token
    costs no forward pass (that is the TTFT point). Stops before a stop token.
    """
    stop = set(lm.stop_token_ids if stop_ids is None else stop_ids)
    token = int(torch.argmax(last_logits))
    if max_new_tokens <= 0 or token in stop:
        return
    yield token
    decoder = BatchDecoder(lm)
    decoder.join(0, kv)
    for _ in range(max_new_tokens - 1):
        token = int(torch.argmax(decoder.step({0: token})[0]))
        if token in stop:
            return
        yield token


class TextStreamer:
    """Turns a token stream into text deltas without splitting multi-byte characters, each token decoded once.

    Incremental, as vLLM's detokenizer: a token is decoded with the few tokens of the previous delta before it
    (a tokenizer's spacing depends on them: SentencePiece's leading space, byte pieces of one character), never
    with the whole answer again, so an answer of n tokens costs O(n) decoding, not O(n^2). ``text`` is the answer
    so far: the joined deltas, what the answer's ``text`` is (nothing decodes the answer a second time)."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0  # where the window of the previous delta's tokens starts
        self._read = 0  # where the tokens not turned into text yet start

    def push(self, token: int) -> str:
        """The text ``token`` completes (empty inside a multi-byte character or after a skipped special token)."""
        self.ids.append(token)
        return self._delta(final=False)

    def flush(self) -> str:
        """Whatever is still held back at the end of generation (even an invalid byte sequence)."""
        return self._delta(final=True)

    def _delta(self, final: bool) -> str:
        before = self.tokenizer.decode(self.ids[self._prefix:self._read], skip_special_tokens=self.skip)
        window = self.tokenizer.decode(self.ids[self._prefix:], skip_special_tokens=self.skip)
        if len(window) <= len(before) or (window.endswith("\ufffd") and not final):
            return ""  # nothing new yet (an incomplete UTF-8 sequence waits for its next bytes)
        delta = window[len(before):]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += delta
        return delta
