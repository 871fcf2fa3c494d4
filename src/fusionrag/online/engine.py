"""The answer path: retrieve -> load reused KV -> select -> sparse recompute -> decode.

``Engine`` is the Python API behind ``fusionrag ask``, the server and the benchmarks::

    engine = Engine.open("kb/", model="qwen2.5-0.5b")
    result = engine.answer("Who discovered polonium?", method="fusionrag", ratio=0.15)
    print(result.text, result.ttft_ms)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fusionrag.errors import FusionRAGError
from fusionrag.execution.generate import TextStreamer, greedy_tokens
from fusionrag.kvcache.kv import KV
from fusionrag.online.policies import METHODS, SelectionInput, make_policy, select
from fusionrag.online.prefill import Prefilled, assemble_context, chunk_kv_plain, prefill_full, prefill_reused
from fusionrag.prompt import passage_hash

DEFAULT_TOP_K = 5
#: Which stored KV a method reuses unless ``kv=`` says otherwise. FusionRAG is query-guided
#: selection on the fused (offline-preprocessed) caches; every baseline uses plain caches.
DEFAULT_KV = {"fusionrag": "fused"}


@dataclass
class Answer:
    text: str
    token_ids: list[int]
    method: str
    kv: str
    ratio: float
    chunk_ids: list[int | None]  # None for request-supplied passages not in the store
    context_tokens: int
    recomputed_tokens: int
    ttft_ms: dict[str, float]
    first_logits: torch.Tensor = field(repr=False)
    selected: torch.Tensor | None = field(default=None, repr=False)
    spans: list[tuple[int, int]] = field(default_factory=list, repr=False)
    passages: list[dict] = field(default_factory=list, repr=False)
    fused_fallbacks: int = 0

    def to_json(self) -> dict:
        return {
            "answer": self.text,
            "method": self.method,
            "kv": self.kv,
            "ratio": self.ratio,
            "chunk_ids": self.chunk_ids,
            "context_tokens": self.context_tokens,
            "recomputed_tokens": self.recomputed_tokens,
            "generated_tokens": len(self.token_ids),
            "ttft_ms": {k: round(v, 2) for k, v in self.ttft_ms.items()},
            "fused_fallbacks": self.fused_fallbacks,
        }


@dataclass
class Prepared:
    """Everything up to the first token; decoding continues from ``pre``."""

    pre: Prefilled
    method: str
    kv: str
    ratio: float
    chunk_ids: list[int | None]
    passages: list[dict]
    ttft_ms: dict[str, float]
    fused_fallbacks: int


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000.0


class Engine:
    """Answers questions over a knowledge store with a chosen KV-reuse method."""

    def __init__(self, store, adhoc_cache_bytes: int | None = 2 << 30, memory_budget_bytes: int | None = None,
                 loader_threads: int = 2) -> None:
        """``memory_budget_bytes`` enables the in-memory KV tier (heat-based) with an asynchronous
        loader of ``loader_threads`` threads over the on-disk store; ``None`` reads the store directly."""
        self.store = store
        self.lm = store.lm
        self.prompt = store.prompt
        self._system_kv: KV | None = None
        # KV of request-supplied passages (not in the store): a prefix cache with the alternative
        # path, so each distinct passage has one ``S + chunk`` replica whatever its position.
        from fusionrag.kvcache.prefix_cache import AlternativePathCache

        self.prefix_cache = AlternativePathCache(max_bytes=adhoc_cache_bytes)
        self._lock = threading.RLock()  # the model runs one request at a time
        self.tiers = None
        if memory_budget_bytes:
            from fusionrag.kvcache.tiers import TieredKVCache

            self.tiers = TieredKVCache(lambda key: store.load_kv(*key), memory_budget_bytes,
                                       max_workers=loader_threads)

    @classmethod
    def open(cls, store_dir: str | Path, model: str | None = None, **engine_options) -> Engine:
        from fusionrag.models import load_model
        from fusionrag.retrieval.knowledge import KnowledgeStore

        path = Path(store_dir)
        if not path.exists():
            raise FusionRAGError(
                f"no knowledge store at '{path}'; create one with 'fusionrag ingest FILES --store {path}'"
            )
        lm = load_model(model) if model else None
        return cls(KnowledgeStore.open(path, lm=lm), **engine_options)

    @property
    def system_kv(self) -> KV:
        if self._system_kv is None:
            self._system_kv = self.store.system_kv().to(torch.float32)
        return self._system_kv

    # -- public API -------------------------------------------------------------------

    def answer(
        self,
        question: str,
        method: str = "fusionrag",
        ratio: float = 0.15,
        top_k: int | None = None,
        chunks: Sequence[dict] | None = None,
        max_new_tokens: int = 32,
        kv: str | None = None,
        **policy_options,
    ) -> Answer:
        """Answer ``question``; ``chunks`` (``{title, text}`` dicts, in order) bypasses retrieval."""
        with self._lock:
            prep = self.prepare(question, method, ratio, top_k, chunks, kv, **policy_options)
            ids = list(greedy_tokens(self.lm, prep.pre.kv, prep.pre.last_logits, max_new_tokens))
        return self.result_of(prep, ids)

    def stream(self, question: str, max_new_tokens: int = 32, **kwargs) -> Iterator[str]:
        """Yield the answer as text deltas (the first one as soon as the first token exists)."""
        with self._lock:
            prep = self.prepare(question, **kwargs)
            streamer = TextStreamer(self.lm.tokenizer)
            for tok in greedy_tokens(self.lm, prep.pre.kv, prep.pre.last_logits, max_new_tokens):
                delta = streamer.push(tok)
                if delta:
                    yield delta
            tail = streamer.flush()
            if tail:
                yield tail

    def prepare(
        self,
        question: str,
        method: str = "fusionrag",
        ratio: float = 0.15,
        top_k: int | None = None,
        chunks: Sequence[dict] | None = None,
        kv: str | None = None,
        **policy_options,
    ) -> Prepared:
        """Everything up to the first answer token, with the TTFT breakdown."""
        question = (question or "").strip()
        if not question:
            raise FusionRAGError("the question is empty")
        if method not in METHODS:
            raise FusionRAGError(f"unknown method '{method}'; choose one of: {', '.join(METHODS)}")
        if not 0.0 <= float(ratio) <= 1.0:
            raise FusionRAGError(f"ratio must be within [0, 1], got {ratio}")
        kv_kind = kv or DEFAULT_KV.get(method, "plain")
        if kv_kind not in ("plain", "fused"):
            raise FusionRAGError(f"kv must be 'plain' or 'fused', got {kv_kind!r}")
        t_start = time.perf_counter()
        timings: dict[str, float] = {}

        t0 = time.perf_counter()
        chunk_ids, passages = self._retrieve(question, top_k, chunks)
        timings["retrieve"] = _ms(t0)
        token_ids = [self._token_ids(cid, p) for cid, p in zip(chunk_ids, passages, strict=True)]
        question_ids = self.prompt.question_ids(question)

        fallbacks = 0
        if method == "full":
            timings["load"] = timings["select"] = 0.0
            pre = prefill_full(self.lm, self.prompt.system_ids, token_ids, question_ids)
            timings["recompute"] = pre.timings_ms["recompute"]
            ratio = 1.0
        else:
            t0 = time.perf_counter()
            kvs, fallbacks = self._load_kvs(chunk_ids, passages, token_ids, kv_kind)
            ctx, ctx_ids, spans = assemble_context(self.lm, self.system_kv, kvs, self.prompt.system_ids, token_ids)
            timings["load"] = _ms(t0)
            t0 = time.perf_counter()
            if method == "reuse":
                idx, ratio = None, 0.0
            else:
                scores = None
                if method == "cachecraft":
                    scores = [self.store.load_scores(c) if c is not None else None for c in chunk_ids]
                inp = SelectionInput(self.lm, ctx, ctx_ids, spans, torch.tensor(question_ids),
                                     chunk_scores=scores or [])
                idx = select(make_policy(method, **policy_options), inp, float(ratio))
            timings["select"] = _ms(t0)
            pre = prefill_reused(self.lm, ctx, ctx_ids, spans, question_ids, idx)
            timings["recompute"] = pre.timings_ms["recompute"]
        t0 = time.perf_counter()
        int(torch.argmax(pre.last_logits))  # the first token itself (part of TTFT)
        timings["first_token"] = _ms(t0)
        timings["total"] = _ms(t_start)
        return Prepared(pre, method, kv_kind if method != "full" else "none", float(ratio), chunk_ids, passages,
                        timings, fallbacks)

    @property
    def lock(self) -> threading.RLock:
        """Held while the model runs; batch decoding takes it between steps."""
        return self._lock

    @property
    def adhoc_entries(self) -> int:
        """Number of cached KVs of request-supplied passages."""
        return len(self.prefix_cache)

    def result_of(self, prep: Prepared, ids: list[int]) -> Answer:
        """The :class:`Answer` for a prepared request and its generated token ids (used by batch decoding)."""
        return Answer(
            text=self.lm.tokenizer.decode(ids, skip_special_tokens=True).strip(),
            token_ids=ids,
            method=prep.method,
            kv=prep.kv,
            ratio=prep.ratio,
            chunk_ids=prep.chunk_ids,
            context_tokens=prep.pre.context_tokens,
            recomputed_tokens=prep.pre.recomputed,
            ttft_ms=prep.ttft_ms,
            first_logits=prep.pre.last_logits,
            selected=prep.pre.selected,
            spans=prep.pre.spans,
            passages=prep.passages,
            fused_fallbacks=prep.fused_fallbacks,
        )

    def _retrieve(self, question: str, top_k: int | None, chunks: Sequence[dict] | None):
        if chunks is not None:
            if not chunks:
                raise FusionRAGError("chunks= was given but is empty")
            passages = [{"title": c.get("title", ""), "text": c["text"]} for c in chunks]
            ids = [self.store.find_by_hash(passage_hash(p.get("title", ""), p["text"])) for p in passages]
            return ids, passages
        if not self.store.chunk_ids():
            raise FusionRAGError("the knowledge store is empty; add documents with 'fusionrag ingest'")
        ids = self.store.search(question, top_k or DEFAULT_TOP_K)
        passages = []
        for cid in ids:
            rec = self.store.chunk(cid)
            passages.append({"title": rec.title, "text": rec.text})
        return list(ids), passages

    def _token_ids(self, chunk_id: int | None, passage: dict) -> list[int]:
        if chunk_id is not None:
            return list(self.store.chunk(chunk_id).token_ids)
        return self.prompt.chunk_ids(passage["title"], passage["text"])

    def tier_stats(self) -> dict:
        """Hits per tier of the in-memory KV cache (empty when it is off)."""
        return {"host": self.tiers.stats()} if self.tiers is not None else {}

    def prefetch(self, chunk_ids: Sequence[int | None], kv: str = "fused") -> None:
        """Start loading these chunks' KV in the background (the asynchronous loader).

        Called for queued requests while the model computes others, so their ``load``
        step finds the KV in memory. A no-op without the memory tier.
        """
        if self.tiers is not None:
            self.tiers.prefetch([k for k in (self._stored_key(c, kv) for c in chunk_ids) if k is not None])

    def prefetch_request(self, question: str, method: str = "fusionrag", top_k: int | None = None,
                         chunks: Sequence[dict] | None = None, kv: str | None = None, **_ignored) -> None:
        """Asynchronous loader for a queued request: find its chunks now, start loading their KV.

        Runs retrieval (embedding + index search) in the caller's thread, outside the model
        lock, so the KV reads overlap with whatever the model is computing. Best effort:
        a request that cannot be resolved here is simply not prefetched.
        """
        if self.tiers is None or method == "full" or not (question or "").strip():
            return
        try:
            chunk_ids, _ = self._retrieve(question.strip(), top_k, chunks)
        except FusionRAGError:
            return
        self.prefetch(chunk_ids, kv or DEFAULT_KV.get(method, "plain"))

    def _stored_key(self, chunk_id: int | None, kind: str) -> tuple[int, str] | None:
        if chunk_id is None:
            return None
        if self.store.has_kv(chunk_id, kind):
            return (chunk_id, kind)
        return (chunk_id, "plain") if self.store.has_kv(chunk_id, "plain") else None

    def _load_kvs(self, chunk_ids, passages, token_ids, kind: str) -> tuple[list[KV], int]:
        keys = [self._stored_key(cid, kind) for cid in chunk_ids]
        stored = [k for k in keys if k is not None]
        if self.tiers is not None:
            loaded = dict(zip(stored, self.tiers.get_many(stored), strict=True))
        else:
            loaded = {k: self.store.load_kv(*k) for k in stored}
        missing = [(passage_hash(p.get("title", ""), p["text"]), ids)
                   for key, p, ids in zip(keys, passages, token_ids, strict=True) if key is None]
        adhoc = iter(self._adhoc_kvs(missing))
        kvs, fallbacks = [], 0
        for key in keys:
            kvs.append(loaded[key] if key is not None else next(adhoc))
            fallbacks += kind == "fused" and (key is None or key[1] != "fused")
        return kvs, fallbacks

    def _adhoc_kvs(self, items: list[tuple[str, list[int]]]) -> list[KV]:
        """Plain KVs of passages the store does not hold (by content hash, in order), through the
        alternative-path prefix cache."""
        if not items:
            return []
        ids_of = dict(items)
        result = self.prefix_cache.lookup(
            self.prompt.system_hash, [h for h, _ in items],
            lambda _system, _context, chunk: chunk_kv_plain(self.lm, self.system_kv, ids_of[chunk]))
        return list(result.values)

