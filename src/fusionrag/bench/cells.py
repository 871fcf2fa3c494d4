"""One cell of a quality study: one question under one method, scored against Full Attention.

Every cell prefills the prompt with its method, then scores that prefilled KV by teacher
forcing (:mod:`~fusionrag.bench.likelihood`: gold-answer NLL; KL to Full Attention along Full
Attention's own answer) and, unless the study skips it, decodes a greedy answer for the
text metrics (gold F1, agreement with Full Attention). Full Attention itself is computed
once per question and kept twice: compactly in the committed reference
(:class:`~fusionrag.bench.full_reference.FullReference`) and with whole first-token logits in
the local cache (:class:`~fusionrag.bench.records.FullCache`, for the full-vocabulary
first-token KL the earlier studies report).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fusionrag.bench import metrics
from fusionrag.bench.datasets import QAExample
from fusionrag.bench.full_reference import FullReference, FullResult
from fusionrag.bench.kb_stores import store_name
from fusionrag.bench.likelihood import TopKReference, encode_answer, gold_nll, reference_kl
from fusionrag.bench.records import FullCache, example_sha
from fusionrag.execution.generate import greedy_tokens
from fusionrag.execution.teacher_forcing import continuation_logprobs
from fusionrag.online.auto_ratio import AutoRatio
from fusionrag.online.methods import reads_store


@dataclass
class Scored:
    """A method's prefilled prompt scored by teacher forcing, and its decoded answer (if any)."""

    text: str | None
    first_logits: torch.Tensor | None  # None: Full Attention served from the reference without the local cache
    gold_nll: float
    gold_nll_eot: float
    kl_first_c: float
    kl_answer: float
    context_tokens: int
    recomputed_tokens: int
    ttft_ms: dict
    fused_fallbacks: int
    auto_share: float | None = None  # ratio="auto": the share of the context it chose


def _decode(lm, prep, max_new_tokens: int) -> tuple[list[int], bool]:
    """Greedy answer ids from a prepared prompt (its KV is read, not consumed) and whether it ended."""
    ids = list(greedy_tokens(lm, prep.pre.kv, prep.pre.last_logits, max_new_tokens))
    return ids, len(ids) < max_new_tokens


def full_attention(engine, ex: QAExample, max_new_tokens: int) -> tuple[FullResult, Any]:
    """Full Attention on one question: its reference (answer, top-k along it, gold NLL) and its prep."""
    lm = engine.lm
    chunks = [{"title": p.title, "text": p.text} for p in ex.passages]
    prep = engine.prepare(ex.question, method="full", chunks=chunks)
    ids, ended = _decode(lm, prep, max_new_tokens)
    logprobs = continuation_logprobs(lm, prep.pre.kv, prep.pre.last_logits, ids)
    ref = TopKReference.from_logprobs(ids, ended, logprobs)
    gold = gold_nll(lm, prep.pre.kv, prep.pre.last_logits, ex.answers)
    text = lm.tokenizer.decode(ids, skip_special_tokens=True).strip()
    info = {"input_sha": example_sha(ex), "context_tokens": prep.pre.context_tokens, "ttft_ms": prep.ttft_ms,
            "gold_nll": gold.nll, "gold_nll_eot": gold.nll_eot, "gold_spelling": gold.spelling,
            # Whether the answer text, encoded as the gold answers are, gives back the model's own ids.
            "reencodes": encode_answer(lm.tokenizer, text) == ids}
    return FullResult(text, ref, info), prep


def keep_full(full_ref: FullReference, full_cache: FullCache, dataset: str, qid: str, max_new_tokens: int,
              result: FullResult, prep) -> None:
    """Write a fresh Full Attention result to the committed reference and the local full-logit cache."""
    full_ref.put(dataset, qid, max_new_tokens, result)
    full_cache.put(dataset, qid, max_new_tokens, result.text, prep.pre.last_logits,
                   {k: result.info[k] for k in ("input_sha", "context_tokens", "ttft_ms")})


def score_prepared(engine, prep, ex: QAExample, ref: TopKReference, max_new_tokens: int, decode: bool) -> Scored:
    """Teacher-forced metrics of a prepared prompt, then (optionally) its greedy answer."""
    lm = engine.lm
    gold = gold_nll(lm, prep.pre.kv, prep.pre.last_logits, ex.answers)
    kl_first_c, kl_answer = reference_kl(lm, prep.pre.kv, prep.pre.last_logits, ref)
    text = None
    if decode:
        ids, _ = _decode(lm, prep, max_new_tokens)
        text = lm.tokenizer.decode(ids, skip_special_tokens=True).strip()
    return Scored(text, prep.pre.last_logits, gold.nll, gold.nll_eot, kl_first_c, kl_answer,
                  prep.pre.context_tokens, prep.pre.recomputed, prep.ttft_ms, prep.fused_fallbacks,
                  prep.ratio if prep.auto_ratio is not None else None)


def auto_setting(ratio: float | str, current: AutoRatio) -> AutoRatio | None:
    """What a run's ``ratio`` sizes ratio="auto" with (None: a number): the store's setting, or ``auto:MASS``'s."""
    if not isinstance(ratio, str):
        return None
    _, _, mass = ratio.partition(":")
    return current.with_mass(float(mass)) if mass else current


def _prepare(engine, question: str, run, chunks: list[dict], kv: str | None):
    """A run's prefill; an ``auto`` run with its setting (``auto:MASS``: that mass) in place of the store's."""
    auto = auto_setting(run.ratio, engine.auto_ratio)
    if auto is None:
        return engine.prepare(question, method=run.method, ratio=run.ratio, chunks=chunks, kv=kv)
    kept, engine.auto_ratio = engine.auto_ratio, auto
    try:
        return engine.prepare(question, method=run.method, ratio="auto", chunks=chunks, kv=kv)
    finally:
        engine.auto_ratio = kept


def run_cell(engines, full_ref: FullReference, full_cache: FullCache, spec, dataset: str, ex: QAExample,
             run) -> dict:
    """One question in one cell (``run``: a ``bench_quality.Run``), as the record the study appends."""
    engine = engines.get(run.top_n) or next(iter(engines.values()))
    input_sha = example_sha(ex)
    full = full_ref.get(dataset, ex.id, spec.max_new_tokens, input_sha)
    fresh_full = None
    # The committed reference alone is enough: without the local cache only the full-vocabulary
    # first-token KL is missing (kl_first_c, from the reference, is always there).
    reference_cell = run.method == "full" and run.dtype == "float32"  # Full Attention in another dtype is a method
    if full is None or (reference_cell and not spec.reuse_full_cache):
        full, fresh_full = full_attention(engine, ex, spec.max_new_tokens)
        keep_full(full_ref, full_cache, dataset, ex.id, spec.max_new_tokens, full, fresh_full)
        full_logits: torch.Tensor | None = fresh_full.pre.last_logits.float()
    else:
        cached = full_cache.get(dataset, ex.id, spec.max_new_tokens, input_sha)
        full_logits = cached[1] if cached is not None else None
    ttft_from_cache = False
    if reference_cell and fresh_full is None:
        # Served from the reference: answer, gold NLL and (by definition) zero KL; its TTFT was measured
        # by an earlier run under possibly other conditions, so it is left out, not mixed in.
        ttft_from_cache = True
        res = Scored(full.text, full_logits, full.info["gold_nll"], full.info["gold_nll_eot"], 0.0, 0.0,
                     int(full.info.get("context_tokens", 0)), int(full.info.get("context_tokens", 0)), {}, 0)
    else:
        if reference_cell:
            prep = fresh_full
        else:
            chunks = [{"title": p.title, "text": p.text} for p in ex.passages]
            kv = None if run.method == "full" else run.kv
            prep = _prepare(engine, ex.question, run, chunks, kv)
        res = score_prepared(engine, prep, ex, full.reference, spec.max_new_tokens,
                             decode=spec.decode and not reference_cell)
        if reference_cell:
            res.text = full.text
    scores = metrics.answer_scores(res.text, ex.answers) if res.text is not None else {}
    return {
        "dataset": dataset,
        "qid": ex.id,
        "run": run.key,
        "method": run.method,
        "kv": run.kv,
        "ratio": run.ratio,
        "top_n": run.top_n,
        "answer": res.text,
        "full_answer": full.text,
        **scores,
        "agree_f1": metrics.agreement_f1(res.text, full.text) if res.text is not None else None,
        "kl_first": None if full_logits is None or res.first_logits is None
        else float(metrics.kl_first_token(full_logits, res.first_logits)),
        "top1_agree": 1.0 if res.first_logits is None
        else float(int(full.reference.top_ids[0, 0]) == int(torch.argmax(res.first_logits))),
        "kl_first_c": res.kl_first_c,
        "kl_answer": res.kl_answer,
        "gold_nll": res.gold_nll,
        "gold_nll_eot": res.gold_nll_eot,
        "ctx_tokens": res.context_tokens,
        "recomputed_tokens": res.recomputed_tokens,
        "auto_share": res.auto_share,
        "ttft_ms": None if ttft_from_cache else res.ttft_ms.get("total"),
        "ttft_breakdown_ms": {} if ttft_from_cache else res.ttft_ms,
        "full_from_cache": ttft_from_cache,
        "fused_fallbacks": res.fused_fallbacks,
        "kb": store_name(spec, dataset, run.top_n) if reads_store(run.method, run.kv) else None,
        "kv_dtype": spec.kv_dtype if run.kv != "none" else None,
    }
