"""Where a store's chunks are in a prompt's token ids: the one chunk locator of both engines (the vLLM
connector's scheduler side, :mod:`fusionrag.vllm.planning`, and fusionrag's engine for a prompt a client built).

A prompt fusionrag built (:class:`~fusionrag.prompt.PromptBuilder`) is ``S``, chunks tokenised as the
store tokenised them, then the question; a prompt a client pasted its passages into has its own template
around them. :class:`ChunkMatcher` takes ``S`` when the ids start with it, then finds the stored chunks in
the ids that follow, whole or in part, with the engine's matcher on token ids
(:func:`fusionrag.retrieval.overlaps.find_regions`: anchors of :data:`KEY_TOKENS` ids, extended both ways,
longest first): candidates come from an index of every chunk's ids at every :data:`INDEX_STRIDE`-th
position (every 4th for a short chunk). Whole chunks of any length are found where they occur; a part is
served from :data:`MIN_PART_IDS` ids, or at any length when it is a short chunk's whole text framed by the
client's template instead of the store's (its ``[title]`` and closing blank line rendered otherwise).
The ids between them (a template's text, separators, a cut word) are the *gaps*: the worker
recomputes them with the selected tokens. The context ends after the last stored chunk; the rest is the
question, prefilled by vLLM. Only chunks whose KV the store holds are taken (the kind the method reads:
``plain-first`` reads the first chunk's plain KV and the others' fused KV, falling back to plain as the
engine does).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from fusionrag.retrieval.overlaps import find_regions

#: Ids an anchor compares (long enough to be nearly unique, short enough for short chunks).
KEY_TOKENS = 8
#: A chunk is indexed by its ids at every this-many positions: a part of it holding one such anchor is found.
INDEX_STRIDE = 16
#: A part of a chunk is served from KV only with at least this many ids: a few shared words (the question
#: naming what a passage names) are not a passage, whatever the tokenizer (a byte-level one makes a word 8 ids).
#: A short chunk's whole text (all its ids but its framing, :data:`FRAMING_SLACK`) is served at any length.
MIN_PART_IDS = 32
#: Ids of a chunk's framing a client's template may render otherwise, beyond the title's own: the id where the
#: title's bracket meets the text, and the closing blank line (which may merge with what follows it).
FRAMING_SLACK = (2, 3)


@dataclass(frozen=True)
class ChunkSpan:
    """One stored chunk found in the prompt: its id, the KV kind to read, its token positions, and where they
    start in the chunk's ids (``offset``: 0 for a whole chunk)."""

    chunk_id: int
    kind: str
    start: int
    stop: int
    offset: int = 0


@dataclass(frozen=True)
class ContextMatch:
    """``S`` (``system_len`` ids; 0 when the prompt does not start with it) and the stored chunks after it, in
    prompt order; ``end``: the position after the last."""

    system_len: int
    chunks: tuple[ChunkSpan, ...]

    @property
    def end(self) -> int:
        return self.chunks[-1].stop if self.chunks else self.system_len

    @property
    def context_tokens(self) -> int:
        return self.end - self.system_len

    @property
    def stored_tokens(self) -> int:
        """Context positions served from stored KV (the rest are gaps)."""
        return sum(c.stop - c.start for c in self.chunks)

    def gaps(self) -> list[int]:
        """Context positions no stored chunk covers: computed by the worker, with the selected tokens."""
        out, pos = [], self.system_len
        for c in self.chunks:
            out.extend(range(pos, c.start))
            pos = c.stop
        return out


class ChunkMatcher:
    """Finds ``S`` and the stored chunks in a prompt (see the module doc).

    ``chunks``: ``(chunk_id, token_ids)`` of every stored chunk; ``has_kv(chunk_id, kind)``: whether the
    store holds that entry (checked when a chunk is matched, so entries written later are seen)."""

    def __init__(self, system_ids: Sequence[int], chunks: Iterable[tuple[int, Sequence[int]]],
                 has_kv: Callable[[int, str], bool], kind: str = "plain-first",
                 title_ids: Callable[[int], int] | None = None) -> None:
        self.system_ids = tuple(int(t) for t in system_ids)
        self.has_kv = has_kv
        self.kind = kind
        self.title_ids = title_ids or (lambda chunk_id: 0)
        self._ids: dict[int, tuple[int, ...]] = {}
        self._index: dict[tuple[int, ...], list[int]] = defaultdict(list)
        self._tiny: dict[tuple[int, ...], list[int]] = defaultdict(list)  # whole chunks shorter than a key
        self._framing: dict[int, tuple[int, int]] = {}
        for chunk_id, ids in chunks:
            self.add(chunk_id, ids)

    @classmethod
    def from_store(cls, store: Any, kind: str = "plain-first") -> ChunkMatcher:
        """Every chunk of a :class:`~fusionrag.retrieval.knowledge.KnowledgeStore` and its ``S``."""
        def title_ids(chunk_id: int) -> int:
            title = (store.chunk(chunk_id).title or "").strip()
            return len(store.prompt.encode(f"[{title}]")) if title else 0

        return cls(store.prompt.system_token_ids, ((c, store.chunk(c).token_ids) for c in store.chunk_ids()),
                   store.has_kv, kind, title_ids)

    def add(self, chunk_id: int, token_ids: Sequence[int]) -> None:
        ids, chunk_id = tuple(int(t) for t in token_ids), int(chunk_id)
        if not ids:
            return
        self._ids[chunk_id] = ids
        if len(ids) < KEY_TOKENS:
            self._tiny[ids].append(chunk_id)
            return
        short = len(ids) < 2 * MIN_PART_IDS  # its text, framed otherwise, may be found in part: keys at every anchor
        if short:
            self._framing[chunk_id] = (self.title_ids(chunk_id) + FRAMING_SLACK[0], FRAMING_SLACK[1])
        for at in range(0, max(1, len(ids) - KEY_TOKENS + 1), KEY_TOKENS // 2 if short else INDEX_STRIDE):
            self._index[ids[at:at + KEY_TOKENS]].append(chunk_id)

    def __len__(self) -> int:
        return len(self._ids)

    def match(self, ids: Sequence[int]) -> ContextMatch:
        """``S`` (when ``ids`` start with it) and the stored chunks, whole or in part, found in the ids after it."""
        s = len(self.system_ids) if tuple(ids[:len(self.system_ids)]) == self.system_ids else 0
        rest = tuple(int(t) for t in ids[s:])
        candidates = dict.fromkeys(c for i in range(len(rest)) for c in self._index.get(rest[i:i + KEY_TOKENS], ()))
        for n in {len(k) for k in self._tiny}:  # whole chunks too short for a key: looked up at every position
            candidates.update(dict.fromkeys(c for i in range(len(rest)) for c in self._tiny.get(rest[i:i + n], ())))
        with_kv = {c: self._ids[c] for c in candidates if self._kind_of(c, first=False) or self._kind_of(c, True)}
        regions = find_regions(rest, list(with_kv.items()), min_whole=1, min_part=MIN_PART_IDS, anchor=KEY_TOKENS,
                               framing=self._framing)
        spans: list[ChunkSpan] = []
        for r in regions:
            kind = self._kind_of(r.chunk_id, first=not spans)
            if kind is not None:
                spans.append(ChunkSpan(r.chunk_id, kind, s + r.start, s + r.end, r.at))
        return ContextMatch(s, tuple(spans))

    def _kind_of(self, chunk_id: int, first: bool) -> str | None:
        """The entry this chunk reads (the engine's rule: ``plain-first`` falls back to plain, fused to
        plain), or None when the store holds neither."""
        wanted = ("plain" if first else "fused") if self.kind == "plain-first" else self.kind
        for kind in dict.fromkeys((wanted, "fused" if wanted == "plain" else "plain")):
            if kind == "fused" and wanted == "plain" and self.kind != "plain-first":
                continue  # a plain method never reads fused KV
            if self.has_kv(chunk_id, kind):
                return kind
        return None
