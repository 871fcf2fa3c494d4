"""``fusionrag demo``: the bundled sample answered by several methods, side by side with TTFT."""

from __future__ import annotations

import time

import torch
from rich.console import Console
from rich.table import Table

from fusionrag.engine.forward import prefill
from fusionrag.engine.generate import greedy_tokens
from fusionrag.models import load_model
from fusionrag.online.prefill import Prefilled, assemble_context, chunk_kv_plain, prefill_full, prefill_reused
from fusionrag.prompt import PromptBuilder
from fusionrag.sample import load_sample


def _answer(lm, pre: Prefilled, max_new_tokens: int) -> str:
    ids = list(greedy_tokens(lm, pre.kv, pre.last_logits, max_new_tokens))
    return lm.tokenizer.decode(ids, skip_special_tokens=True).strip()


def run_demo(model: str, max_new_tokens: int = 24, limit: int | None = None) -> None:
    console = Console()
    with console.status(f"loading {model}"):
        lm = load_model(model)
    pb = PromptBuilder(lm.tokenizer)
    examples = load_sample()[:limit]
    t0 = time.perf_counter()
    system_kv, _ = prefill(lm, torch.tensor(pb.system_ids))
    cache: dict[tuple[int, ...], object] = {}
    for ex in examples:
        for p in ex["passages"]:
            ids = tuple(pb.chunk_ids(p["title"], p["text"]))
            if ids not in cache:
                cache[ids] = chunk_kv_plain(lm, system_kv, ids)
    console.print(f"offline: {len(cache)} chunk caches computed in {time.perf_counter() - t0:.1f} s (not in TTFT)")

    table = Table(title=f"fusionrag demo on {lm.name}", show_lines=True)
    for col in ("question", "gold", "Full Attention", "TTFT", "Full Reuse", "TTFT", "speed-up"):
        table.add_column(col)
    for ex in examples:
        chunks = [pb.chunk_ids(p["title"], p["text"]) for p in ex["passages"]]
        question = pb.question_ids(ex["question"])
        t = time.perf_counter()
        full = prefill_full(lm, pb.system_ids, chunks, question)
        ttft_full = time.perf_counter() - t
        t = time.perf_counter()
        ctx, ids, spans = assemble_context(lm, system_kv, [cache[tuple(c)] for c in chunks], pb.system_ids, chunks)
        reuse = prefill_reused(lm, ctx, ids, spans, question)
        ttft_reuse = time.perf_counter() - t
        table.add_row(
            ex["question"], ex["answers"][0],
            _answer(lm, full, max_new_tokens), f"{ttft_full * 1000:.0f} ms",
            _answer(lm, reuse, max_new_tokens), f"{ttft_reuse * 1000:.0f} ms",
            f"{ttft_full / ttft_reuse:.1f}x",
        )
    console.print(table)
