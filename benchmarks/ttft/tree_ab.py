"""Two checkouts' TTFT on the same store and questions, interleaved: a refactor's "benchmarks unchanged", measured.

    # per round, once per tree (PYTHONPATH picks the code; `git archive REV src | tar -x -C DIR` makes one):
    OMP_NUM_THREADS=1 PYTHONPATH=DIR/src .venv/bin/python benchmarks/ttft/tree_ab.py run STORE LABEL >> runs.jsonl
    .venv/bin/python benchmarks/ttft/tree_ab.py report runs.jsonl --base before --new after --out DIR

``run`` times ``Engine.prepare`` (everything up to the first token: what ``bench`` and ``demo`` time) for four
2WikiMQA-shaped questions, Full Attention and FusionRAG 15%, top 8 retrieved chunks, one thread, whole-context
cache off; one JSON line per question and method (TTFT from the request's stage clock, the wall time, the prompt
length and the first token: both trees must agree on the last two). ``report`` pairs them by question and round:
the new tree's wall time over the base's, mean with a 95% bootstrap interval, as JSON, Markdown and a plot.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

QUESTIONS = ["Who is the director of the film that came out first?",
             "Which country is the performer of the song from?",
             "When did the spouse of the composer die?", "Where was the father of the actress born?"]
METHODS = (("full", 1.0), ("fusionrag", 0.15))


def run(store: str, label: str) -> None:
    import torch

    from fusionrag.online.engine import Engine

    torch.set_num_threads(1)
    engine = Engine.open(store, context_cache_bytes=0)
    engine.prepare(QUESTIONS[0], method="full", top_k=8)  # warm-up
    for q in QUESTIONS:
        for method, ratio in METHODS:
            t0 = time.perf_counter()
            r = engine.prepare(q, method=method, ratio=ratio, top_k=8)
            print(json.dumps({"tree": label, "q": q, "method": method, "ttft_ms": round(r.ttft_ms["total"], 1),
                              "wall_ms": round((time.perf_counter() - t0) * 1000, 1),
                              "prompt": len(r.prompt_token_ids), "first": r.first_token}), flush=True)


def report(path: str, base: str, new: str, out: str) -> None:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    by: dict[tuple, list] = defaultdict(list)
    for r in rows:
        by[(r["tree"], r["method"], r["q"])].append(r)
    result = {"rows": len(rows), "methods": {}}
    rng = random.Random(0)
    for method, _ in METHODS:
        pairs = [(b, n) for q in QUESTIONS for b, n in zip(by[(base, method, q)], by[(new, method, q)], strict=False)]
        ratios = [n["wall_ms"] / b["wall_ms"] for b, n in pairs]
        boots = sorted(statistics.mean(rng.choices(ratios, k=len(ratios))) for _ in range(2000))
        result["methods"][method] = {
            "n": len(pairs), "base_ms_median": statistics.median(b["wall_ms"] for b, _ in pairs),
            "new_ms_median": statistics.median(n["wall_ms"] for _, n in pairs),
            "new_over_base": round(statistics.mean(ratios), 3), "ci95": [round(boots[50], 3), round(boots[1949], 3)],
            "same_prompt_and_first_token": all(b["prompt"] == n["prompt"] and b["first"] == n["first"]
                                               for b, n in pairs)}
    o = Path(out)
    o.mkdir(parents=True, exist_ok=True)
    (o / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    md = [f"# {new} vs {base}: TTFT of Engine.prepare, interleaved\n",
          "| method | n | base (ms) | new (ms) | new / base [95% CI] | same prompt and first token |",
          "|---|---|---|---|---|---|"]
    for m, r in result["methods"].items():
        md.append(f"| {m} | {r['n']} | {r['base_ms_median']:.0f} | {r['new_ms_median']:.0f} | {r['new_over_base']} "
                  f"[{r['ci95'][0]}, {r['ci95'][1]}] | {r['same_prompt_and_first_token']} |")
    (o / "results.md").write_text("\n".join(md) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    names = list(result["methods"])
    vals = [result["methods"][m]["new_over_base"] for m in names]
    errs = [[v - result["methods"][m]["ci95"][0] for m, v in zip(names, vals, strict=True)],
            [result["methods"][m]["ci95"][1] - v for m, v in zip(names, vals, strict=True)]]
    ax.bar(names, vals, yerr=errs, capsize=6)
    ax.axhline(1.0, color="grey", linestyle="--")
    ax.set(ylabel=f"TTFT {new} / {base}", title="Engine.prepare, paired by question and round")
    fig.tight_layout()
    fig.savefig(o / "ratio.png", dpi=110)
    print("\n".join(md))


if __name__ == "__main__":
    if sys.argv[1] == "run":
        run(sys.argv[2], sys.argv[3])
    else:
        args = dict(zip(sys.argv[3::2], sys.argv[4::2], strict=False))
        report(sys.argv[2], args.get("--base", "before"), args.get("--new", "after"), args.get("--out", "."))
