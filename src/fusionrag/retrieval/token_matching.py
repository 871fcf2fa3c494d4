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
question, prefilled by vLLM. Only chunks whose KV the store holds are taken, each with the entry the method
reads (:mod:`fusionrag.retrieval.kv_kinds`: one rule for both engines).
"""

from __future__ import annotations

from array import array
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from fusionrag.retrieval.kv_kinds import HasKV, served_kind
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
    """Finds ``S`` and the stored chunks in a prompt (see the module doc): the token-id half of the store's
    :class:`~fusionrag.retrieval.chunk_locator.ChunkLocator`, which keeps it current (:meth:`add`, :meth:`remove`).

    ``chunks``: ``(chunk_id, token_ids)`` to start with; ``has_kv(chunk_id, kind)``: whether the store holds that
    entry (checked when a chunk is matched, so entries written later are seen); ``kind``: what :meth:`match`
    reads unless told; ``title_ids(chunk_id)``: how many ids a chunk's ``[title]`` takes."""

    def __init__(self, system_ids: Sequence[int], chunks: Iterable[tuple[int, Sequence[int]]],
                 has_kv: HasKV, kind: str = "plain-first",
                 title_ids: Callable[[int], int] | None = None) -> None:
        self.system_ids = tuple(int(t) for t in system_ids)
        self.has_kv = has_kv
        self.kind = kind
        self.title_ids = title_ids or (lambda chunk_id: 0)
        self._ids: dict[int, array] = {}  # 4 bytes an id (a tuple of Python ints took ~36)
        #: Anchors by the hash of their ids, to the chunk holding them (a list where several do). A hash that two
        #: anchors share only adds a candidate: every candidate is compared id for id (find_regions).
        self._index: dict[int, int | list[int]] = {}
        self._tiny: dict[tuple[int, ...], list[int]] = defaultdict(list)  # whole chunks shorter than a key
        self._framing: dict[int, tuple[int, int]] = {}
        for chunk_id, ids in chunks:
            self.add(chunk_id, ids)

    def add(self, chunk_id: int, token_ids: Sequence[int], title_ids: int | None = None) -> None:
        """Index a chunk (``title_ids``: its title's id count, when the caller knows it)."""
        ids, chunk_id = tuple(int(t) for t in token_ids), int(chunk_id)
        if not ids:
            return
        self._ids[chunk_id] = array("i", ids)
        if len(ids) < KEY_TOKENS:
            self._tiny[ids].append(chunk_id)
            return
        if _short(ids):  # its text, framed otherwise, may be found in part
            titled = self.title_ids(chunk_id) if title_ids is None else title_ids
            self._framing[chunk_id] = (titled + FRAMING_SLACK[0], FRAMING_SLACK[1])
        for key in _keys(ids):
            held = self._index.get(key)
            self._index[key] = chunk_id if held is None else [held, chunk_id] if isinstance(held, int) else \
                [*held, chunk_id]

    def remove(self, chunk_id: int) -> None:
        """Forget a chunk (deleted from the store, or its id given to new text)."""
        stored = self._ids.pop(int(chunk_id), None)
        if stored is None:
            return
        ids, chunk_id = tuple(stored), int(chunk_id)
        self._framing.pop(chunk_id, None)
        if len(ids) < KEY_TOKENS:
            held = self._tiny.get(ids)
            if held is not None and chunk_id in held:
                held.remove(chunk_id)
                if not held:
                    del self._tiny[ids]
            return
        for key in _keys(ids):
            held = self._index.get(key)
            if held == chunk_id:
                del self._index[key]
            elif isinstance(held, list) and chunk_id in held:
                rest = list(held)
                rest.remove(chunk_id)
                self._index[key] = rest[0] if len(rest) == 1 else rest

    def __len__(self) -> int:
        return len(self._ids)

    def match(self, ids: Sequence[int], kind: str | None = None) -> ContextMatch:
        """``S`` (when ``ids`` start with it) and the stored chunks, whole or in part, found in the ids after it,
        each with the entry a ``kind`` request reads (:func:`~fusionrag.retrieval.kv_kinds.served_kind`;
        chunks the store holds no readable entry of are not taken)."""
        kind = self.kind if kind is None else kind
        s = len(self.system_ids) if tuple(ids[:len(self.system_ids)]) == self.system_ids else 0
        rest = tuple(int(t) for t in ids[s:])
        candidates: dict[int, None] = {}
        for i in range(len(rest) - KEY_TOKENS + 1):
            held = self._index.get(hash(rest[i:i + KEY_TOKENS]))
            if held is not None:
                candidates.update(dict.fromkeys([held] if isinstance(held, int) else held))
        for n in {len(k) for k in self._tiny}:  # whole chunks too short for a key: looked up at every position
            candidates.update(dict.fromkeys(c for i in range(len(rest)) for c in self._tiny.get(rest[i:i + n], ())))
        readable = {c: tuple(self._ids[c]) for c in candidates
                    if served_kind(self.has_kv, c, kind, True) or served_kind(self.has_kv, c, kind, False)}
        regions = find_regions(rest, list(readable.items()), min_whole=1, min_part=MIN_PART_IDS, anchor=KEY_TOKENS,
                               framing=self._framing)
        spans: list[ChunkSpan] = []
        for r in regions:
            served = served_kind(self.has_kv, r.chunk_id, kind, first=not spans)
            if served is not None:
                spans.append(ChunkSpan(r.chunk_id, served, s + r.start, s + r.end, r.at))
        return ContextMatch(s, tuple(spans))


def _short(ids: tuple[int, ...]) -> bool:
    """A chunk short enough that its text may be found framed by a client's template: keys at every anchor."""
    return len(ids) < 2 * MIN_PART_IDS


def _keys(ids: tuple[int, ...]) -> list[int]:
    """The hashes of the anchors a chunk is indexed by (every :data:`INDEX_STRIDE`-th position; every half key
    when short). A tuple of ints hashes the same in every process (no hash randomisation for ints)."""
    step = KEY_TOKENS // 2 if _short(ids) else INDEX_STRIDE
    return [hash(ids[at:at + KEY_TOKENS]) for at in range(0, max(1, len(ids) - KEY_TOKENS + 1), step)]
