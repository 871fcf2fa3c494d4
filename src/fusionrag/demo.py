"""``fusionrag demo``: the whole pipeline on the bundled sample.

Ingest the sample passages into a knowledge store (plain chunk KV), run the offline
similarity-guided preprocessing (fused KV), then answer each sample question with Full
Attention, Full Reuse and FusionRAG at 15% recompute, printing the answers, their TTFTs
and the speed-up over Full Attention, all measured in this run.

The timings are meant to be true on any machine: every method is warmed up first,
each TTFT shown is the median of :data:`TIMINGS` prefills, the table says the compute dtype
(and how ``auto`` chose it), and where a method's own timings spread by more than
:data:`NOISY_SPREAD` (another process is using the CPU) the row says the timing is noisy instead
of showing a speed-up that a quiet machine would not.
"""

from __future__ import annotations

import os
import statistics
import time

from rich.console import Console
from rich.table import Table

from fusionrag.models import load_model
from fusionrag.paths import fusionrag_home
from fusionrag.prompt import SHORT_ANSWER_PROMPT
from fusionrag.sample import load_sample

METHODS = (("full", 1.0, "Full Attention"), ("reuse", 0.0, "Full Reuse"), ("fusionrag", 0.15, "FusionRAG 15%"))
#: Prefills timed per method and question (the answer's own, then repeats); the median is shown.
TIMINGS = 3
#: A method's slowest / fastest timing above this: the machine is busy, the row says "noisy".
NOISY_SPREAD = 1.3


def speedup_text(method: str, samples: list[float], full_ttft: float) -> tuple[str, bool]:
    """The speed-up column of one method (its TTFT samples, Full Attention's median) and whether it is noisy:
    timings spread by more than :data:`NOISY_SPREAD`, or a reuse method slower than a full prefill (which
    only a busy machine shows at the demo's context lengths)."""
    speedup = full_ttft / statistics.median(samples)
    if max(samples) / min(samples) > NOISY_SPREAD or (method != "full" and speedup < 1.0):
        return f"noisy ({min(samples):.0f}-{max(samples):.0f} ms)", True
    return f"{speedup:.1f}x", False


def run_demo(model: str, max_new_tokens: int = 24, limit: int | None = None, top_k: int = 4,
             top_n: int = 3, device: str | None = None, dtype: str | None = None,
             attention: str | None = None) -> list[dict]:
    from fusionrag.models.devices import dtype_choice
    from fusionrag.models.fingerprint import weights_id
    from fusionrag.offline import build
    from fusionrag.online.engine import Engine
    from fusionrag.retrieval.knowledge import KnowledgeStore

    console = Console()
    with console.status(f"loading {model}"):
        lm = load_model(model, device=device, dtype=dtype, attention=attention)
    examples = load_sample()[:limit]
    path = fusionrag_home() / "demo" / weights_id(lm.fingerprint).replace(":", "_")  # any compute dtype
    t0 = time.perf_counter()
    if (path / "store.sqlite").exists():
        store = KnowledgeStore.open(path, lm=lm)
    else:
        # short factual answers, so the methods' answers fit the table side by side
        store = build.create_store(path, lm, model_source=model, system_prompt=SHORT_ANSWER_PROMPT)
    passages = {(p["title"], p["text"]): p for ex in examples for p in ex["passages"]}
    build.add_passages(store, lm, list(passages.values()), doc="sample")
    build.fuse(store, lm, top_n=top_n, progress=True)
    console.print(f"offline: {len(passages)} passages ingested and preprocessed (top-{top_n} neighbours) in "
                  f"{time.perf_counter() - t0:.1f} s; store at {path}")

    engine = Engine(store, lm)  # no whole-context cache: each method computes its own prompt
    for method, ratio, _ in METHODS:  # warm-up: allocators, kernels, thread pools, the KV read once
        engine.prepare(examples[0]["question"], method=method, ratio=ratio, top_k=top_k)
    computing = dtype_choice(dtype, lm.device)
    table = Table(title=f"fusionrag demo on {lm.name} (top-{top_k} retrieval), computing in {computing}; "
                        f"TTFT: median of {TIMINGS} prefills", show_lines=False)
    for col, style in (("question / method", None), ("answer", "bold"), ("TTFT", None), ("speed-up", None)):
        table.add_column(col, style=style, overflow="fold")
    results, noisy = [], 0
    for ex in examples:
        table.add_row(f"[cyan]{ex['question']}[/] (gold: {ex['answers'][0]})", "", "", "")
        full_ttft = None
        for method, ratio, label in METHODS:
            ans = engine.answer(ex["question"], method=method, ratio=ratio, top_k=top_k,
                                max_new_tokens=max_new_tokens)
            samples = [ans.ttft_ms["total"]] + [engine.prepare(ex["question"], method=method, ratio=ratio,
                                                               top_k=top_k).ttft_ms["total"]
                                                for _ in range(TIMINGS - 1)]
            ttft = statistics.median(samples)
            full_ttft = full_ttft or ttft
            shown, shaky = speedup_text(method, samples, full_ttft)
            noisy += shaky
            table.add_row(f"  {label}", ans.text, f"{ttft:.0f} ms", shown)
            results.append({"question": ex["question"], "method": method, "answer": ans.text, "ttft_ms": ttft,
                            "ttft_samples_ms": samples, "noisy": shaky})
        table.add_section()
    console.print(table)
    if noisy:
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        console.print(f"[yellow]{noisy} timing(s) marked noisy: their prefills varied by more than "
                      f"{NOISY_SPREAD:.1f}x (load average {load:.1f} on {os.cpu_count()} cores): another process is "
                      "using the CPU. Speed-ups are only meaningful on a quiet machine.[/]")
    return results
