"""Stored chunks whose text starts somewhere in a client's text: an exact lookup, beside the embedding search.

The matcher finds candidate chunks for a pasted prompt by embedding it window by window
(:func:`fusionrag.retrieval.matching._candidates`). A short chunk (a one-line file, "X may refer to:")
inside an 800-character window of other text is rarely among the window's nearest chunks, so a
pipeline whose template moves the windows (DSPy's ``[N] «««`` markers) lost it. Here every chunk is
indexed by the first :data:`~fusionrag.retrieval.overlaps.ANCHOR_CHARS` characters of its normalised
text, and the client's text is looked up at each word start: a chunk pasted whole is a candidate
whatever the template or the embedding says. The index is one entry per chunk, built on first use and
again when the store's generation changes.
"""

from __future__ import annotations

import threading
from weakref import WeakKeyDictionary

from fusionrag.retrieval.overlaps import ANCHOR_CHARS, normalise, word_starts

_LOCK = threading.Lock()
_INDEXES: WeakKeyDictionary = WeakKeyDictionary()  # store -> (generation, {start: [chunk ids]})


def starts(store, min_chars: int) -> dict[str, list[int]]:
    """Each stored chunk by its normalised text's first ``ANCHOR_CHARS`` characters (all of it when shorter,
    and at least ``min_chars``), for the store's current generation."""
    generation = store.seen_generation
    with _LOCK:
        cached = _INDEXES.get(store)
        if cached is not None and cached[0] == generation:
            return cached[1]
    index: dict[str, list[int]] = {}
    for cid in store.chunk_ids():
        body = normalise(store.chunk(cid).text)
        if len(body) >= min_chars:
            index.setdefault(body[:ANCHOR_CHARS], []).append(cid)
    with _LOCK:
        _INDEXES[store] = (generation, index)
    return index


def starting_in(store, norm: str, min_chars: int) -> list[int]:
    """Chunks whose normalised text's start occurs at a word start of ``norm`` (a normalised text), in text order."""
    index = starts(store, min_chars)
    lengths = sorted({len(k) for k in index}, reverse=True)
    found: dict[int, None] = {}
    for i in word_starts(norm):
        for n in lengths:
            for cid in index.get(norm[i:i + n], ()):
                found[cid] = None
    return list(found)
