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
    """Turns a token stream into text deltas without splitting multi-byte characters."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.emitted = ""

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for more bytes
            return ""
        delta, self.emitted = text[len(self.emitted):], text
        return delta

    def flush(self) -> str:
        """Whatever is still held back at the end of generation (even an invalid byte sequence)."""
        text = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip)
        delta, self.emitted = text[len(self.emitted):], text
        return delta
