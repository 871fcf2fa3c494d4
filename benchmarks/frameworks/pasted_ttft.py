"""A pipeline that pastes its context, unchanged, against a fusionrag server: chunks added, reuse, TTFT.

    .venv/bin/python benchmarks/frameworks/pasted_ttft.py --out benchmarks/frameworks/results/pasted \\
        [--client haystack|litellm|dspy|langchain-system|llamaindex|openai|litellm-text] \\
        [--model qwen2.5-0.5b] [--limit 6] [--top-k 10] [--rounds 3]

The user's files are the first ``--limit`` questions' passages of a 2WikiMQA data file, one file per
title (as ``framework_ttft.py`` makes them), ingested and preprocessed with the CLI (``--top-n 2``).
``fusionrag serve`` runs on one thread with its defaults (no server-side retrieval unless asked, method
``auto``). In ``.venv-client`` (no torch) a client pastes the top ``--top-k`` documents of a BM25 over the
files into its prompt, once as its user writes it (``fusionrag``) and once with
``extra_body={"method": "full"}`` (the baseline, the same prompt prefilled whole), interleaved,
``max_tokens=1``: the run time is its TTFT. ``--client`` (default ``haystack``) picks it:

* ``haystack`` (``haystack_paste_client.py``): BM25 -> ``ChatPromptBuilder`` -> ``OpenAIChatGenerator``;
* ``litellm`` (``litellm_paste_client.py``): the same passages in the same template's text, one user
  message, ``litellm.completion(model="openai/<served name>", api_base=...)``;
* ``dspy`` (``dspy_paste_client.py``): ``dspy.Predict("context, question -> answer")`` with the same
  passages as its ``context`` list, in DSPy's own ``ChatAdapter`` template, ``dspy.LM("openai/...")``;
* ``langchain-system``, ``llamaindex``, ``openai``, ``litellm-text`` (``template_paste_client.py``): the
  context in LangChain's system message, LlamaIndex's QA template, an OpenAI SDK user message after a
  system message, a raw ``litellm.text_completion`` prompt.

Every client also sends ``/tokenize`` what it sent: the server serves the client's prompt token for token
(issue 47), so ``usage.prompt_tokens`` must equal that count (reported).

The litellm and DSPy clients get the passages the Haystack pipeline's BM25 retrieves
(``haystack_paste_client.py --retrieve``, before the server starts): every client pastes the same ones,
in its own template, and only the LLM call is timed (Haystack's time includes its BM25, a few ms).

Reported per cell: TTFT (median over rounds per question; the ratio's bootstrap interval over questions),
chunks the server added that the pipeline did not paste (retrieved ones: a score), the share of the
context whose KV came precomputed from the store (``precomputed_tokens / context_tokens``) and the
standard ``usage.prompt_tokens_details.cached_tokens``. Writes ``pasted_ttft.json``, ``README.md`` and
``pasted_ttft.png`` in ``--out`` (one folder per client); ``--replot JSON`` rewrites them from a run's JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

DATA = "../shared/data/2wikimqa/2wikimqa_dev_bm25_hipporag.jsonl"
#: Each client: its script (run in .venv-client), the distributions whose versions the report names, and how
#: the README describes the pipeline.
CLIENTS = {
    "haystack": ("haystack_paste_client.py", ["haystack-ai"],
                 "BM25 top {k} pasted by `ChatPromptBuilder`, `OpenAIChatGenerator`"),
    "litellm": ("litellm_paste_client.py", ["litellm"],
                "BM25 top {k} (Haystack's) pasted into one user message, `litellm.completion(model=\"openai/...\")`"),
    "dspy": ("dspy_paste_client.py", ["dspy", "litellm"],
             "BM25 top {k} (Haystack's) as the `context` list of `dspy.Predict(\"context, question -> answer\")`, "
             "DSPy's `ChatAdapter` template, `dspy.LM(\"openai/...\")`"),
    "langchain-system": ("template_paste_client.py", ["langchain-core", "langchain-openai"],
                         "BM25 top {k} (Haystack's) in the *system* message of LangChain's RAG tutorial prompt "
                         "(`ChatPromptTemplate.from_messages([(\"system\", ...{{context}}), (\"human\", ...)])` "
                         "| `ChatOpenAI`)"),
    "llamaindex": ("template_paste_client.py", ["llama-index-core", "llama-index-llms-openai-like"],
                   "BM25 top {k} (Haystack's) in LlamaIndex's `CHAT_TEXT_QA_PROMPT` (its system message, the "
                   "context between rules in the user message), `OpenAILike(is_chat_model=True).chat`"),
    "openai": ("template_paste_client.py", ["openai"],
               "BM25 top {k} (Haystack's) after a system message, in the user message, the OpenAI SDK"),
    "litellm-text": ("template_paste_client.py", ["litellm"],
                     "BM25 top {k} (Haystack's) in a raw prompt (the Haystack template's text), "
                     "`litellm.text_completion` (`/v1/completions`, no chat template)"),
}
TITLES = {"haystack": "Haystack pipeline", "litellm": "litellm call", "dspy": "DSPy program",
          "langchain-system": "LangChain chain (context in the system message)",
          "llamaindex": "LlamaIndex chat (its QA template)", "openai": "OpenAI SDK call",
          "litellm-text": "litellm text completion (raw prompt)"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--client", choices=sorted(CLIENTS), default="haystack", help="the framework that pastes")
    p.add_argument("--model", default="qwen2.5-0.5b")
    p.add_argument("--data", default=DATA)
    p.add_argument("--limit", type=int, default=6, help="questions (their passages are the user's files)")
    p.add_argument("--top-k", type=int, default=10, help="documents the pipeline's BM25 pastes")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="the server's threads")
    p.add_argument("--build-threads", type=int, default=2)
    p.add_argument("--work", default="/tmp/fusionrag-pasted", help="files, store and logs")
    p.add_argument("--replot", help="a pasted_ttft.json: its report (summary, README, PNG) rewritten in --out, "
                                    "nothing run")
    return p.parse_args(argv)


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over rounds per question and cell; the full / fusionrag ratio per question with its interval."""
    from fusionrag.bench.metrics import bootstrap_ci

    measured = [r for r in rows if r["round"] > 0]
    questions = sorted({r["question"] for r in measured})
    med = {(q, c): statistics.median(r["seconds"] for r in measured if r["question"] == q and r["cell"] == c)
           for q in questions for c in ("full", "fusionrag")}
    ratios = [med[(q, "full")] / med[(q, "fusionrag")] for q in questions]
    _, lo, hi = bootstrap_ci(ratios)
    fr = [r["usage"]["fusionrag"] for r in measured if r["cell"] == "fusionrag"]
    added = [sum(1 for s in u["sources"] if s.get("score") is not None) for u in fr]
    coverage = [u["precomputed_tokens"] / u["context_tokens"] for u in fr if u["context_tokens"]]
    cached = [(r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") for r in measured
              if r["cell"] == "fusionrag"]
    extra = {}
    if all(c is not None for c in cached):  # the standard field (runs before it existed have none)
        extra = {"cached_tokens_median": statistics.median(cached),
                 "cached_equals_reused": all(c == u["reused_tokens"] for c, u in zip(cached, fr, strict=True)),
                 "full_cached_tokens_max": max((r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                                               for r in measured if r["cell"] == "full")}
    first = [r["usage"]["fusionrag"] for r in rows if r["round"] == 0 and r["cell"] == "fusionrag"]
    if first:  # the warm-up round: each context seen the first time, before the prefix cache holds its new text
        extra["precomputed_share_first_min"] = min(u["precomputed_tokens"] / u["context_tokens"] for u in first
                                                   if u["context_tokens"])
        extra["computed_chunks_first_max"] = max(u["computed_chunks"] for u in first)
    extra["question_tokens_median"] = statistics.median(
        r["usage"]["prompt_tokens"] - r["usage"]["fusionrag"]["context_tokens"] for r in measured
        if r["cell"] == "fusionrag")
    counted = [r for r in rows if "tokenize_count" in r]
    if counted:  # the client's prompt, token for token: usage.prompt_tokens against /tokenize of what it sent
        extra["prompt_tokens_equal_tokenize"] = sum(r["usage"]["prompt_tokens"] == r["tokenize_count"]
                                                    for r in counted)
        extra["prompt_tokens_checked"] = len(counted)
        extra["prompt_tokens_minus_tokenize_max"] = max(abs(r["usage"]["prompt_tokens"] - r["tokenize_count"])
                                                        for r in counted)
    if any("engine" in r for r in measured):  # DSPy: which client sent each cell, and one call per run
        extra["engines"] = {c: sorted({r["engine"] for r in measured if r["cell"] == c}) for c in ("fusionrag", "full")}
        extra["lm_calls_max"] = max(r["lm_calls"] for r in measured)
    return {**extra, "n_questions": len(questions), "rounds": max(r["round"] for r in rows),
            "ttft_full_s": statistics.median(med[(q, "full")] for q in questions),
            "ttft_fusionrag_s": statistics.median(med[(q, "fusionrag")] for q in questions),
            "ratio": {"median": statistics.median(ratios), "lo": lo, "hi": hi, "per_question": ratios},
            "chunks_added_max": max(added), "precomputed_share_min": min(coverage),
            "precomputed_share_median": statistics.median(coverage),
            "context_tokens_min": min(u["context_tokens"] for u in fr),
            "context_tokens_max": max(u["context_tokens"] for u in fr),
            "methods_run": sorted({u["method"] for u in fr}),
            "reused_chunks_median": statistics.median(u["reused_chunks"] for u in fr)}


def markdown(doc: dict) -> str:
    m, s = doc["meta"], doc["summary"]
    r = s["ratio"]
    client = m.get("client", "haystack")
    how = CLIENTS[client][2].format(k=m["top_k"])
    versions = ", ".join(f"{name} {v}" for name, v in m.get("versions", {"haystack-ai": m.get("haystack")}).items())
    lines = [
        f"# A pasting {TITLES[client]}, unchanged, against fusionrag",
        "",
        f"`{m['model']}`, server on {m['threads']} thread(s), {s['n_questions']} questions x {s['rounds']} "
        f"interleaved rounds, {how} ({versions}), on {m['machine'].get('cpu_model')}.",
        "",
        "| | value |",
        "|---|---|",
        f"| chunks the server added that the pipeline did not paste (max over requests) | {s['chunks_added_max']} |",
        f"| context whose KV came precomputed from the store (min / median) | {s['precomputed_share_min']:.0%} / "
        f"{s['precomputed_share_median']:.0%} |",
        f"| context precomputed at each context's first request (warm-up round; min), new pieces computed (max) | "
        f"{s.get('precomputed_share_first_min', float('nan')):.1%}, {s.get('computed_chunks_first_max', '?')} |",
        f"| stored chunks reused per request (median) | {s['reused_chunks_median']:.0f} |",
        f"| context tokens (min / max) | {s['context_tokens_min']} / {s.get('context_tokens_max', '?')} |",
        f"| prompt tokens after the context (question segment: template, system message, question; median) | "
        f"{s['question_tokens_median']:.0f} |",
        f"| method the server ran | {', '.join(s['methods_run'])} |",
    ]
    if "prompt_tokens_checked" in s:
        lines.append(f"| `usage.prompt_tokens` = `/tokenize` of what the client sent (requests; max difference) | "
                     f"{s['prompt_tokens_equal_tokenize']} / {s['prompt_tokens_checked']}; "
                     f"{s['prompt_tokens_minus_tokenize_max']} |")
    if "cached_tokens_median" in s:
        lines.append(f"| `usage.prompt_tokens_details.cached_tokens` (median; `method=full`: max) | "
                     f"{s['cached_tokens_median']:.0f}; {s['full_cached_tokens_max']} |")
    lines += [
        f"| TTFT, `method=full` (median) | {s['ttft_full_s']:.2f} s |",
        f"| TTFT, the pipeline unchanged (median) | {s['ttft_fusionrag_s']:.2f} s |",
        f"| full / unchanged, per question | **{r['median']:.2f}x** [{r['lo']:.2f}, {r['hi']:.2f}] "
        f"(n={s['n_questions']}) |",
        "",
        "TTFT is the pipeline's run time with `max_tokens=1` (the client's own work and HTTP included, the same "
        "in both cells). The measured rounds' precomputed share counts the text around the stored chunks (and any "
        "stored chunk not found in the prompt) from the prefix cache, filled by the warm-up round; the warm-up "
        "row is the share at first sight.",
    ]
    if m.get("notes"):
        lines += ["", *m["notes"]]
    lines += ["", f"Command: `{m['command']}`", "", f"Data: `{m['data']}`", "", "Every run: `pasted_ttft.json`.", ""]
    return "\n".join(lines)


def plot(doc: dict, path: Path) -> None:
    from fusionrag.bench.plots import figure, save_png

    s, client = doc["summary"], doc["meta"].get("client", "haystack")
    fig, axes = figure(1, 1, 6, 4)
    ax = axes[0][0]
    bars = ax.bar(["method=full", "pipeline unchanged\n(auto: FusionRAG)"], [s["ttft_full_s"], s["ttft_fusionrag_s"]],
                  color=["#999999", "#1f77b4"])
    ax.bar_label(bars, fmt="%.2f s")
    ax.set_ylabel("TTFT (s), median of questions")
    name = TITLES[client]
    ax.set_title(f"{name}\n{doc['meta']['model']}, n={s['n_questions']} questions", fontsize=10)
    save_png(fig, path)


def write_report(doc: dict, out: Path) -> None:
    from fusionrag.bench.provenance import write_report_files

    write_report_files(out, "pasted_ttft", doc, markdown(doc), lambda path: plot(doc, path))


#: What DSPy's notes say about its runs, in the README.
DSPY_NOTES = ["DSPy: `ChatAdapter(use_json_adapter_fallback=False)`, its template unchanged: one token is no "
              "parsable answer, and the fallback would send a second request in another template. The unchanged "
              "cell goes through DSPy's vendored `lm15` client, the `extra_body` one through litellm "
              "(`engine` per row in the JSON)."]


def client_env() -> dict[str, str]:
    """The client's environment: not this checkout's ``src`` (the client venv has no engine), and litellm's
    bundled model-price map (it fetches it from GitHub at import otherwise, retrying where there is no network)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    return {**env, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}


def run_client(client: Path, script: str, job: dict, *flags: str) -> str:
    done = subprocess.run([str(client), str(HERE / script), *flags], input=json.dumps(job), capture_output=True,
                          text=True, timeout=7200, check=False, env=client_env())
    if done.returncode != 0:
        raise SystemExit(f"{script} failed: {done.stderr[-3000:]}")
    return done.stdout


def versions(client: Path, names: list[str]) -> dict[str, str]:
    code = "import importlib.metadata as m, json, sys; print(json.dumps({n: m.version(n) for n in sys.argv[1:]}))"
    done = subprocess.run([str(client), "-c", code, *names], capture_output=True, text=True, env=client_env(),
                          check=True)
    return json.loads(done.stdout)


def main(argv: list[str] | None = None) -> int:
    from framework_ttft import build_store, make_files, read_questions, served

    from fusionrag.bench.provenance import machine_info

    args = parse_args(argv)
    if args.replot:
        doc = json.loads(Path(args.replot).read_text(encoding="utf-8"))
        doc["summary"] = summarise(doc["rows"])
        write_report(doc, Path(args.out))
        print(markdown(doc))
        return 0
    client = ROOT / ".venv-client" / "bin" / "python"
    if not client.is_file():
        raise SystemExit("no .venv-client: run bash scripts/setup_client.sh")
    script, packages, _ = CLIENTS[args.client]
    flags = ["--template", args.client] if script == "template_paste_client.py" else []
    work = Path(args.work)
    questions = read_questions(Path(args.data), args.limit)[: args.limit]
    files = make_files(questions, work / "files")
    build_store(work / "files", work / "store", args.model, 2, args.build_threads, 3600)
    documents = [{"title": f["title"], "text": Path(f["path"]).read_text(encoding="utf-8")} for f in files]
    job = {"model": None, "documents": documents, "top_k": args.top_k, "rounds": args.rounds,
           "questions": [q["question"] for q in questions]}
    if args.client != "haystack":  # the Haystack pipeline's BM25 passages: every client pastes the same ones
        job["passages"] = json.loads(run_client(client, "haystack_paste_client.py", job, "--retrieve"))
    with served(work / "store", args.threads, work / "serve.log", 600) as server:
        out = run_client(client, script, {**job, "url": server["url"], "model": server["model"]}, *flags)
    rows = [json.loads(line) for line in out.splitlines() if line.strip()]
    found = versions(client, packages if args.client == "haystack" else [*packages, "haystack-ai"])
    meta = {"command": "benchmarks/frameworks/pasted_ttft.py " + shlex.join(sys.argv[1:]), "client": args.client,
            "model": args.model, "threads": args.threads, "top_k": args.top_k, "data": args.data,
            "versions": found, "haystack": found.get("haystack-ai"), "machine": machine_info(),
            "server": server["command"], "notes": DSPY_NOTES if args.client == "dspy" else []}
    doc = {"meta": meta, "summary": summarise(rows), "rows": rows}
    write_report(doc, Path(args.out))
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
