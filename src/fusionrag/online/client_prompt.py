"""A prompt that places no passages, served as it is: its stored chunks found in its token ids, the rest computed.

A pipeline that renders its own prompt (a raw completion, or chat messages through the model's template) must
get an answer to exactly that prompt: ``prompt_tokens`` equals ``/tokenize`` of it, its own system message
stays where it put it, its context may sit in any message. The engine therefore does not rewrite such a
prompt into the store's layout; nor a question with passages pasted into it (``S`` and its question
segment, as fusionrag builds a prompt without passages). It finds the stored chunks in the prompt's token
ids with the store's chunk locator (:class:`~fusionrag.retrieval.chunk_locator.ChunkLocator`, the vLLM
connector's too), whole or in part, anywhere after the first token, and serves them from the store;
everything else is the prompt's own tokens:

- the ids before the first stored chunk are the prompt's *prefix* (its own system message, template, earlier
  turns), computed exactly, like ``S`` (:meth:`PromptPrefixes.kv`, kept for the next request with the same
  prefix);
- the ids between stored chunks are *gaps* (separators, a template's text, a passage the store does not
  hold): new pieces that every method recomputes (:attr:`~fusionrag.online.resolved.Resolved.forced`), as the
  connector recomputes its gaps;
- the ids after the last stored chunk are the question segment, computed as a question is.

The stored chunks' KV was computed after the store's ``S``, not after this prompt's prefix: re-positioned
and read in another context, like any reused chunk (FusionRAG's recompute is what brings the context back).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from fusionrag.kvcache.kv import KV
from fusionrag.online.resolved import Resolved
from fusionrag.retrieval.matching import Piece


def locate(store: Any, ids: Sequence[int], kind: str, decode: Any) -> Resolved | None:
    """The prompt ``ids`` as prefix, pieces (stored chunks and gaps) and question, or None when it holds no
    stored chunk a ``kind`` request reads (then it is computed whole, as it is). Full Attention (``kind``
    ``none``) finds them as a plain reader would: what it reports as stored, it computes."""
    ids = [int(t) for t in ids]
    match = store.locator.match(ids, "plain" if kind == "none" else kind)
    if not match.chunks:
        return None
    first = match.chunks[0].start
    pieces: list[Piece] = []
    pos = first
    for c in match.chunks:
        if c.start > pos:  # the client's own tokens between two stored chunks
            gap = tuple(ids[pos:c.start])
            pieces.append(Piece(None, "", decode(list(gap)), "", ids=gap))
        rec = store.chunk(c.chunk_id)
        whole = c.offset == 0 and c.stop - c.start == len(rec.token_ids)
        pieces.append(Piece(c.chunk_id, rec.title, rec.text, store.source_of(c.chunk_id),
                            None if whole else (c.offset, c.offset + c.stop - c.start)))
        pos = c.stop
    return Resolved(pieces, [None] * len(pieces), "", store.seen_generation, client_prefix=ids[:first],
                    client_question=ids[pos:])


class PromptPrefixes:
    """The KV of the prefixes clients' prompts start with (their system message and template), computed exactly
    once and kept (the most recent few): the next request of the same pipeline reuses it, as ``S``'s is."""

    def __init__(self, keep: int = 8) -> None:
        self._kv: OrderedDict[tuple[int, ...], KV] = OrderedDict()
        self._keep = keep
        self._lock = threading.Lock()

    def kv(self, lm: Any, ids: Sequence[int], compute: Any) -> KV:
        """The KV of ``ids`` at positions ``0..``, float32 (``compute(lm, ids)`` makes it when it is not kept)."""
        key = tuple(int(t) for t in ids)
        with self._lock:
            hit = self._kv.get(key)
            if hit is not None:
                self._kv.move_to_end(key)
                return hit
        kv = compute(lm, list(key)).to(torch.float32)
        with self._lock:
            self._kv[key] = kv
            while len(self._kv) > self._keep:
                self._kv.popitem(last=False)
        return kv


def prefix_kv(engine: Any, ids: Sequence[int]) -> KV:
    """The KV of a prompt's prefix: the store's ``S`` when it is that, else computed exactly (and kept)."""
    if list(ids) == list(engine.prompt.system_token_ids):
        return engine.system_kv
    if not ids:
        empty = torch.zeros(engine.lm.adapter.empty_kv_shape(engine.lm.num_layers), dtype=torch.float32)
        return KV(empty, empty.clone(), 0)
    from fusionrag.execution.segments import system_kv as compute

    return engine.prefixes.kv(engine.lm, ids, compute)


def with_forced(idx: torch.Tensor | None, spans: Sequence[tuple[int, int]],
                forced: Sequence[int]) -> torch.Tensor | None:
    """``idx`` (the method's selection; None: nothing) and every position of the ``forced`` pieces (a client's
    own tokens between stored chunks: computed whatever the method)."""
    if not forced:
        return idx
    extra = [torch.arange(*spans[i]) for i in forced]
    base = [] if idx is None else [idx.to(torch.long).cpu()]
    return torch.unique(torch.cat([*base, *extra]))
