"""Fidelity through vLLM: first-token KL to Full Attention of vLLM + FusionRAG 15% minus our engine's FusionRAG 15%.

    OMP_NUM_THREADS=1 taskset -c 1 .venv-vllm/bin/python benchmarks/vllm/vllm_fidelity.py \\
        --data ../shared/data/2wikimqa/2wikimqa_dev_bm25_hipporag.jsonl --out benchmarks/vllm/results/fidelity
    .venv/bin/python benchmarks/vllm/vllm_fidelity.py --report --out benchmarks/vllm/results/fidelity   # + the plot

The vLLM connector's fidelity target, on the paper-shaped setting of ``studies/paper`` (qwen2.5-0.5b, 10 passages per
question, knowledge base = the first 100 questions' passages, fused KV of the corpus top-10 neighbours, the
study's float16 store in ``runs/cache/stores``, built with the package's own functions when it is absent).
One dataset per run, in one process (vLLM's engine core is its spawned child), float32 throughout:

- our engine: :class:`fusionrag.online.engine.Engine` on the HF model (``load_model``, the converted folder),
  ``method="fusionrag"`` (plain-first KV), ratio 0.15, the question's passages as chunks;
- vLLM: ``LLM(folder, dtype="float32", enforce_eager=True, enable_prefix_caching=False)`` with
  ``fusionrag.vllm.FusionRAGConnector`` over the same store, ``kv_transfer_params={"fusionrag": {"ratio": 0.15}}``,
  fed exactly the engine's prompt token ids (``S`` + the stored chunks' ids + the question); the first token's
  log-probabilities over the whole vocabulary (``logprobs=-1``). The connector's ``debug_dir`` says whether
  it loaded the request (a request with no file fell back to vLLM's prefill) and which tokens it recomputed.

Both are scored as the study scores first-token KL: ``coarse_kl`` against the committed fp32 Full Attention
reference's first position (``studies/paper/results/full_reference``, top-128). Per question: both KLs, the
first tokens, whether the recomputed-token sets are identical, the largest log-probability gap between the
two; controls on the first ``--controls`` questions: vLLM's own prefill (connector off) and the engine's Full
Attention, each against the same reference (their KL is the numerical floor of the comparison).

Writes ``OUT/<dataset>.jsonl`` (one row per question) and, from every dataset's rows, ``summary.json``,
``summary.md`` and (where matplotlib is installed: the main ``.venv``; ``--report`` redraws) ``fidelity.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the studies' stores (studies/harness), run as a script from anywhere
MODEL = "qwen2.5-0.5b"
REFERENCE = ROOT / "studies" / "paper" / "results" / "full_reference"
REFERENCE_MAX_NEW_TOKENS = 16  # the study's reference files (studies/paper/run.sh: --max-new-tokens 16)
TOP_N = 10  # the offline stage's neighbours (the study's default, corpus top-10)


@dataclass
class StudyStoreSettings:
    """The paper study's store settings (``kb_stores.StoreSettings``): ``--limit 50 --kb-limit 100
    --fuse-only-evaluated``, corpus top-10 neighbours, float16 KV (``studies.quality_cli``'s default);
    ``stores`` is the studies' store variant (:class:`studies.harness.stores.StudyStores`)."""

    model: str = MODEL
    limit: int | None = 50
    kb_limit: int | None = 100
    fuse: object = None
    embedder: object | None = None
    cache_dir: Path | None = ROOT / "runs" / "cache"
    out: Path = ROOT / "runs" / "vllm_fidelity"
    progress: bool = True
    kv_dtype: str = "float16"
    stores: object | None = None
    max_passages: int | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.fuse is None:
            from fusionrag.offline.preprocess import FuseSettings

            self.fuse = FuseSettings()
        if self.stores is None:
            from studies.harness.stores import StudyStores

            self.stores = StudyStores(fuse_only_evaluated=True)


def study_store(spec: StudyStoreSettings, dataset: str, kb_examples: list, examples: list, lm) -> tuple[object, str]:
    """The study's store for this setting, opened read-only when it already holds what the questions read
    (plain KV of every prompt's first chunk, fused KV of the others), else built/completed as the study does."""
    from studies.harness.membership import membership

    from fusionrag.bench.kb_stores import open_store, store_name
    from fusionrag.retrieval.knowledge import KnowledgeStore

    path = spec.cache_dir / "stores" / store_name(spec, dataset, TOP_N)
    if (path / "store.sqlite").is_file():
        store = KnowledgeStore.open(path, lm=lm, read_only=True)
        try:
            prompts = membership(store, examples).prompts
            complete = all(store.has_kv(p[0], "plain") and all(store.has_kv(c, "fused") for c in p[1:])
                           for p in prompts)
        except Exception as exc:  # a passage missing: the store is built/completed below
            print(f"[vllm fidelity] {path.name}: {exc}", file=sys.stderr)
            complete = False
        if complete:
            return store, "reused"
        store.close()
    print(f"[vllm fidelity] {path.name}: building/completing it as the study does", file=sys.stderr, flush=True)
    open_store(spec, dataset, kb_examples, TOP_N, lm, fused=True, evaluated=examples).close()
    return KnowledgeStore.open(path, lm=lm, read_only=True), "built"


def connector_config(store: Path, debug: Path) -> dict:
    return {"kv_connector": "FusionRAGConnector", "kv_connector_module_path": "fusionrag.vllm", "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            # min_context_tokens 0: every question goes through the connector (this measures fidelity, not speed)
            "kv_connector_extra_config": {"store": str(store), "ratio": 0.15, "min_context_tokens": 0,
                                          "debug_dir": str(debug)}}


def vllm_first(llm, ids: list[int], params: dict | str, vocab: int):
    """vLLM's first-token log-probabilities over the whole vocabulary, and what the request reports."""
    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(max_tokens=1, temperature=0.0, logprobs=-1,
                        extra_args={"kv_transfer_params": {"fusionrag": params}})
    out = llm.generate(TokensPrompt(prompt_token_ids=ids), sp, use_tqdm=False)[0]
    first = torch.full((vocab,), float("-inf"), dtype=torch.float64)
    for tok, lp in out.outputs[0].logprobs[0].items():
        first[tok] = lp.logprob
    return first, int(out.outputs[0].token_ids[0]), out.num_cached_tokens


def chat_template_ids(tokenizer, system_prompt: str, passages: list[dict], question: str) -> list[int]:
    """What a chat client's request becomes in vLLM: ``rag_messages`` rendered by the template, tokenised whole."""
    from fusionrag.prompt import rag_messages

    text = tokenizer.apply_chat_template(rag_messages(system_prompt, passages, question), tokenize=False,
                                         add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


def study_records(dataset: str) -> dict[str, float]:
    """The paper study's own first-token KL of FusionRAG 15% on plain-first KV, per question (cross-check)."""
    path = ROOT / "studies" / "paper" / "results" / "records.jsonl"
    out: dict[str, float] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            r = json.loads(line)
            if r.get("dataset") == dataset and r.get("run") == "fusionrag-plainfirst|plain-first|0.15|10":
                out[r["qid"]] = r.get("kl_first_c")
    return out


def wait_for_quiet(lock: Path | None) -> None:
    """The shared machine's etiquette: no timing benchmark (its lock file) before a dataset starts."""
    waited = False
    while lock is not None and lock.exists():
        if not waited:
            print(f"[vllm fidelity] {lock} exists (a timing benchmark runs): waiting", file=sys.stderr, flush=True)
            waited = True
        time.sleep(60)


def measure(args: argparse.Namespace) -> int:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    cores = sorted(os.sched_getaffinity(0))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(map(str, cores[:args.tp])) if args.tp > 1 else "nobind")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch
    import vllm
    from vllm import LLM

    from fusionrag.bench.datasets import load_questions
    from fusionrag.bench.full_reference import FullReference
    from fusionrag.bench.likelihood import coarse_kl
    from fusionrag.bench.records import example_sha
    from fusionrag.files import atomic_write
    from fusionrag.models import load_model
    from fusionrag.models.gguf import ensure_converted
    from fusionrag.models.registry import PACKAGED
    from fusionrag.online.engine import Engine

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    out = Path(args.out)
    in_file = load_questions(args.data, None, seed=0)
    kb_examples, examples = in_file[:args.kb_limit], in_file[:args.limit]
    dataset = examples[0].dataset
    rows_path = out / f"{dataset}.jsonl"
    wait_for_quiet(Path(args.lock) if args.lock else None)
    t_start = time.perf_counter()
    lm = load_model(MODEL, dtype="float32", device="cpu")
    folder = ensure_converted(PACKAGED[MODEL])
    spec = StudyStoreSettings(limit=args.limit, kb_limit=args.kb_limit, cache_dir=Path(args.cache_dir))
    store, how = study_store(spec, dataset, kb_examples, examples, lm)
    print(f"[vllm fidelity] {dataset}: store {store.path.name} ({how}); {len(examples)} questions",
          file=sys.stderr, flush=True)
    engine = Engine(store, lm)  # no whole-context cache: every request computes its method
    reference = FullReference(Path(args.reference), lm.name)
    study = study_records(dataset)
    debug = ROOT / "runs" / "vllm_fidelity" / "debug" / dataset  # the connector's per-request JSON (not results)
    debug.mkdir(parents=True, exist_ok=True)
    for old in debug.glob("*.json"):
        old.unlink()
    vocab = int(lm.model.config.vocab_size)
    parallel = {} if args.tp == 1 else {"tensor_parallel_size": args.tp, "distributed_executor_backend": "mp"}
    llm = LLM(model=str(folder), dtype="float32", enforce_eager=True, enable_prefix_caching=args.tp > 1,
              max_model_len=args.max_model_len, max_logprobs=-1, seed=0,
              kv_transfer_config=connector_config(store.path, debug), **parallel)
    rows: list[dict] = []
    for i, ex in enumerate(examples):
        ref = reference.get(dataset, ex.id, REFERENCE_MAX_NEW_TOKENS, example_sha(ex))
        if ref is None:
            print(f"[vllm fidelity] {ex.id}: no committed reference; skipped", file=sys.stderr)
            rows.append({"dataset": dataset, "qid": ex.id, "skipped": "no Full Attention reference"})
            continue
        ref_ids, ref_lp = ref.reference.top_ids[0], ref.reference.top_logprobs[0]
        passages = [{"title": p.title, "text": p.text} for p in ex.passages]
        t0 = time.perf_counter()
        req = engine.prepare(ex.question, method="fusionrag", ratio=args.ratio, chunks=passages)
        engine_s = time.perf_counter() - t0
        s_ids = list(store.prompt.system_token_ids)
        q_ids = list(store.prompt.question_token_ids(ex.question))
        ids = s_ids + [t for c in req.chunk_token_ids for t in c] + q_ids
        chunk_ids = [None if c is None else int(c) for c in req.chunk_ids]
        assert len(ids) == req.prompt_tokens, (len(ids), req.prompt_tokens)
        engine_lp = torch.log_softmax(req.pre.last_logits.double().reshape(-1), -1)
        engine_sel = sorted(int(t) for t in req.pre.selected.tolist())
        engine_kl = coarse_kl(ref_ids, ref_lp, engine_lp)
        engine_first = int(torch.argmax(engine_lp))
        req_fallbacks = int(req.fused_fallbacks)
        del req
        for old in debug.glob("*.json"):
            old.unlink()
        t0 = time.perf_counter()
        vllm_lp, vllm_first_tok, cached = vllm_first(llm, ids, {"ratio": args.ratio}, vocab)
        vllm_s = time.perf_counter() - t0
        loaded = [json.loads(p.read_text()) for p in debug.glob("*.json")]
        vllm_kl = coarse_kl(ref_ids, ref_lp, vllm_lp)
        row = {
            "dataset": dataset, "qid": ex.id, "prompt_tokens": len(ids), "system_tokens": len(s_ids),
            "context_tokens": len(ids) - len(s_ids) - len(q_ids), "chunks": len(passages), "chunk_ids": chunk_ids,
            "engine_fused_fallbacks": req_fallbacks,
            "chat_template_ids_match": chat_template_ids(lm.tokenizer, store.prompt.system_prompt, passages,
                                                         ex.question) == ids,
            "engine_kl_first": engine_kl, "vllm_kl_first": vllm_kl, "diff": vllm_kl - engine_kl,
            "study_kl_first": study.get(ex.id),
            "ref_first_token": int(ref_ids[0]), "engine_first_token": engine_first, "vllm_first_token": vllm_first_tok,
            "same_first_token": engine_first == vllm_first_tok,
            "max_abs_logprob_diff_ref_top128": float((vllm_lp[ref_ids] - engine_lp[ref_ids]).abs().max()),
            "kl_engine_to_vllm_full_vocab": float(kl_full(engine_lp, vllm_lp)),
            "connector_loaded": len(loaded) == 1, "vllm_cached_tokens": cached,
            "engine_selected": len(engine_sel), "engine_s": round(engine_s, 3), "vllm_s": round(vllm_s, 3),
        }
        if loaded:
            got = loaded[0]
            vsel = sorted(int(t) for t in got["selected"])
            row.update({
                "connector_chunks": len(got["chunks"]), "connector_first": got["first"], "connector_end": got["end"],
                "connector_chunk_ids": [int(c[0]) for c in got["chunks"]],
                "connector_kinds": [c[1] for c in got["chunks"]],
                "vllm_selected": len(vsel), "selected_identical": vsel == engine_sel,
                "selected_overlap": len(set(vsel) & set(engine_sel)) / max(1, len(engine_sel)),
                "selected_only_engine": sorted(set(engine_sel) - set(vsel)),
                "selected_only_vllm": sorted(set(vsel) - set(engine_sel)),
            })
        if i < args.controls:  # the numerical floor: vLLM's own prefill and the engine's Full Attention
            for old in debug.glob("*.json"):
                old.unlink()
            off_lp, off_first, _ = vllm_first(llm, ids, "off", vocab)
            full = engine.prepare(ex.question, method="full", chunks=passages)
            full_lp = torch.log_softmax(full.pre.last_logits.double().reshape(-1), -1)
            row.update({"control_vllm_full_kl_first": coarse_kl(ref_ids, ref_lp, off_lp),
                        "control_engine_full_kl_first": coarse_kl(ref_ids, ref_lp, full_lp),
                        "control_vllm_full_first_token": off_first,
                        "control_full_max_abs_logprob_diff_ref_top128":
                            float((off_lp[ref_ids] - full_lp[ref_ids]).abs().max()),
                        "control_connector_loaded_when_off": any(debug.glob("*.json"))})
            del full
        rows.append(row)
        print(f"[vllm fidelity] {dataset} {i + 1}/{len(examples)} {ex.id}: KL engine {engine_kl:.4f} vLLM "
              f"{vllm_kl:.4f} (study {row['study_kl_first']}), loaded {row['connector_loaded']}, selected identical "
              f"{row.get('selected_identical')}, {len(ids)} tokens, {engine_s:.1f}+{vllm_s:.1f} s",
              file=sys.stderr, flush=True)
        atomic_write(rows_path, "".join(json.dumps(r) + "\n" for r in rows))  # kept as they finish
    meta = {"command": shlex.join([".venv-vllm/bin/python", "benchmarks/vllm/vllm_fidelity.py", *sys.argv[1:]]),
            "dataset": dataset, "data": str(args.data), "limit": args.limit, "kb_limit": args.kb_limit,
            "ratio": args.ratio, "store": store.path.name, "store_kv_dtype": store.settings.get("kv_dtype"),
            "store_source": how, "model": MODEL, "model_folder": folder.name, "dtype": "float32",
            "vllm": vllm.__version__, "torch": torch.__version__, "transformers": _version("transformers"),
            "threads": torch.get_num_threads(), "cpu_affinity": sorted(os.sched_getaffinity(0)), "tp": args.tp,
            "wall_s": round(time.perf_counter() - t_start, 1)}
    atomic_write(out / f"{dataset}.meta.json", json.dumps(meta, indent=1))
    del llm
    write_report(out)
    return 0


def kl_full(p_lp, q_lp) -> float:
    """KL(P || Q) over the whole vocabulary (float64), skipping P's zero-probability entries."""
    import torch

    mask = torch.isfinite(p_lp)
    return float((p_lp[mask].exp() * (p_lp[mask] - q_lp[mask])).sum())


def _version(name: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:
        return None


# -- the report (runs in either environment; the plot needs matplotlib) ---------------------------

def read_rows(out: Path) -> dict[str, list[dict]]:
    data: dict[str, list[dict]] = {}
    for p in sorted(out.glob("*.jsonl")):
        data[p.stem] = [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    return data


def summarize(dataset: str, rows: list[dict], meta: dict) -> dict:
    from fusionrag.bench.metrics import bootstrap_diff_ci

    rows = [r for r in rows if "skipped" not in r]
    loaded = [r for r in rows if r["connector_loaded"]]
    mean, lo, hi = bootstrap_diff_ci([r["vllm_kl_first"] for r in loaded], [r["engine_kl_first"] for r in loaded])
    controls = [r for r in rows if "control_vllm_full_kl_first" in r]
    with_study = [r for r in rows if r.get("study_kl_first") is not None]
    s = {
        "dataset": dataset, "questions": len(rows), "n": len(loaded),
        "connector_fallbacks": len(rows) - len(loaded),
        "engine_kl_first_mean": statistics.fmean(r["engine_kl_first"] for r in loaded),
        "vllm_kl_first_mean": statistics.fmean(r["vllm_kl_first"] for r in loaded),
        "diff_vllm_minus_engine": {"mean": mean, "lo": lo, "hi": hi},
        "resolved": bool(lo > 0 or hi < 0),
        "max_abs_diff": max(abs(r["diff"]) for r in loaded),
        "same_first_token_rate": statistics.fmean(r["same_first_token"] for r in loaded),
        "selected_identical": sum(bool(r.get("selected_identical")) for r in loaded),
        "selected_overlap_mean": statistics.fmean(r["selected_overlap"] for r in loaded),
        "selected_overlap_min": min(r["selected_overlap"] for r in loaded),
        "chunks_matched_all": sum(r["connector_chunk_ids"] == r["chunk_ids"] for r in loaded),
        "chat_template_ids_match": sum(r["chat_template_ids_match"] for r in rows),
        "max_abs_logprob_diff_ref_top128": {"median": statistics.median(r["max_abs_logprob_diff_ref_top128"]
                                                                        for r in loaded),
                                            "max": max(r["max_abs_logprob_diff_ref_top128"] for r in loaded)},
        "kl_engine_to_vllm_full_vocab": {"mean": statistics.fmean(r["kl_engine_to_vllm_full_vocab"] for r in loaded),
                                         "max": max(r["kl_engine_to_vllm_full_vocab"] for r in loaded)},
        "prompt_tokens": {"median": statistics.median(r["prompt_tokens"] for r in rows),
                          "max": max(r["prompt_tokens"] for r in rows)},
        "study_cross_check": None if not with_study else {
            "n": len(with_study), "study_kl_first_mean": statistics.fmean(r["study_kl_first"] for r in with_study),
            "engine_kl_first_mean": statistics.fmean(r["engine_kl_first"] for r in with_study),
            "max_abs_engine_minus_study": max(abs(r["engine_kl_first"] - r["study_kl_first"]) for r in with_study)},
        "controls": None if not controls else {
            "n": len(controls),
            "vllm_full_kl_first_mean": statistics.fmean(r["control_vllm_full_kl_first"] for r in controls),
            "engine_full_kl_first_mean": statistics.fmean(r["control_engine_full_kl_first"] for r in controls),
            "vllm_full_kl_first_max": max(r["control_vllm_full_kl_first"] for r in controls),
            "full_max_abs_logprob_diff_ref_top128": max(r["control_full_max_abs_logprob_diff_ref_top128"]
                                                        for r in controls),
            "connector_loaded_when_off": sum(r["control_connector_loaded_when_off"] for r in controls)},
        "meta": meta,
    }
    return s


def markdown(summaries: list[dict]) -> str:
    lines = ["# vLLM + FusionRAG 15% vs our engine's FusionRAG 15%: first-token KL to Full Attention", "",
             "qwen2.5-0.5b, float32, both in one process on the same prompt token ids and the same store; KL = "
             "`coarse_kl` to the committed fp32 Full Attention reference's first position (top-128), as "
             "`studies/paper` scores it. Difference = vLLM - engine, paired by question, 95% bootstrap "
             "(`bootstrap_diff_ci`, 1,000 resamples); **bold** = resolved.", "",
             "| dataset | n (loaded / questions) | engine KL | vLLM KL | vLLM - engine [95% CI] | resolved | "
             "same first token | identical selections | max abs per-question diff |",
             "|---|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        d = s["diff_vllm_minus_engine"]
        ci = f"{d['mean']:+.5f} [{d['lo']:+.5f}, {d['hi']:+.5f}]"
        lines.append(f"| {s['dataset']} | {s['n']} / {s['questions']} | {s['engine_kl_first_mean']:.4f} | "
                     f"{s['vllm_kl_first_mean']:.4f} | {'**' + ci + '**' if s['resolved'] else ci} | "
                     f"{'yes' if s['resolved'] else 'no'} | {s['same_first_token_rate']:.0%} | "
                     f"{s['selected_identical']} / {s['n']} | {s['max_abs_diff']:.5f} |")
    lines += ["", "Details per dataset:", ""]
    for s in summaries:
        m, c, x = s["meta"], s["controls"], s["study_cross_check"]
        lines.append(f"- **{s['dataset']}** (store `{m.get('store')}`, {m.get('store_kv_dtype')} KV, "
                     f"{m.get('store_source')}; prompts median {s['prompt_tokens']['median']:.0f} / max "
                     f"{s['prompt_tokens']['max']} tokens): connector fallbacks {s['connector_fallbacks']}; "
                     f"stored chunks matched in every prompt {s['chunks_matched_all']} / {s['n']}; "
                     f"selected-token overlap mean {s['selected_overlap_mean']:.4f} (min "
                     f"{s['selected_overlap_min']:.4f}); max |log p| gap over the reference's top-128, median "
                     f"{s['max_abs_logprob_diff_ref_top128']['median']:.2e} / max "
                     f"{s['max_abs_logprob_diff_ref_top128']['max']:.2e}; KL(engine || vLLM) over the whole "
                     f"vocabulary mean {s['kl_engine_to_vllm_full_vocab']['mean']:.2e} / max "
                     f"{s['kl_engine_to_vllm_full_vocab']['max']:.2e}; prompt ids = `rag_messages` through the "
                     f"chat template for {s['chat_template_ids_match']} / {s['questions']}.")
        if c:
            lines.append(f"  Controls (first {c['n']} questions): vLLM's own prefill KL "
                         f"{c['vllm_full_kl_first_mean']:.2e} "
                         f"(max {c['vllm_full_kl_first_max']:.2e}), the engine's Full Attention "
                         f"{c['engine_full_kl_first_mean']:.2e}; max |log p| gap between them "
                         f"{c['full_max_abs_logprob_diff_ref_top128']:.2e}.")
        if x:
            lines.append(f"  The study's own FusionRAG 15% (plain-first) records on the same {x['n']} questions: "
                         f"mean KL {x['study_kl_first_mean']:.4f} vs the engine here {x['engine_kl_first_mean']:.4f} "
                         f"(max abs per-question gap {x['max_abs_engine_minus_study']:.2e}).")
        lines.append(f"  Command: `{m.get('command')}` (vLLM {m.get('vllm')}, torch {m.get('torch')}, transformers "
                     f"{m.get('transformers')}, TP={m.get('tp', 1)}, {m.get('threads')} thread(s), cores "
                     f"{m.get('cpu_affinity')}, {m.get('wall_s')} s).")
    return "\n".join(lines) + "\n"


def plot(data: dict[str, list[dict]], summaries: list[dict], path: Path) -> None:
    from matplotlib.figure import Figure

    from fusionrag.files import atomic_write_with

    fig = Figure(figsize=(11, 4.6), constrained_layout=True)
    ax, bx = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.25, 1]})
    colours = ["tab:blue", "tab:orange", "tab:green", "tab:red"]
    lo_all, hi_all = math.inf, 0.0
    for k, (dataset, rows) in enumerate(data.items()):
        rows = [r for r in rows if r.get("connector_loaded")]
        x = [max(r["engine_kl_first"], 1e-6) for r in rows]
        y = [max(r["vllm_kl_first"], 1e-6) for r in rows]
        lo_all, hi_all = min(lo_all, *x, *y), max(hi_all, *x, *y)
        ax.scatter(x, y, s=18, alpha=0.75, color=colours[k % 4], label=f"{dataset} (n={len(rows)})")
    ax.plot([lo_all / 2, hi_all * 2], [lo_all / 2, hi_all * 2], color="grey", lw=0.8, ls="--", label="y = x")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("our engine's FusionRAG 15%: first-token KL to Full Attention (nats)")
    ax.set_ylabel("vLLM + FusionRAG 15% (the connector)")
    ax.set_title("per question (floored at 1e-6)")
    ax.legend(fontsize=8)
    names = [s["dataset"] for s in summaries]
    means = [s["diff_vllm_minus_engine"]["mean"] for s in summaries]
    err = [[s["diff_vllm_minus_engine"]["mean"] - s["diff_vllm_minus_engine"]["lo"] for s in summaries],
           [s["diff_vllm_minus_engine"]["hi"] - s["diff_vllm_minus_engine"]["mean"] for s in summaries]]
    bx.errorbar(range(len(names)), means, yerr=err, fmt="o", color="black", capsize=6)
    bx.axhline(0.0, color="grey", lw=0.8)
    for i, s in enumerate(summaries):
        bx.annotate(f"engine KL {s['engine_kl_first_mean']:.3f}\nvLLM KL {s['vllm_kl_first_mean']:.3f}\n"
                    f"identical selections {s['selected_identical']}/{s['n']}", (i, means[i]),
                    textcoords="offset points", xytext=(12, -18), fontsize=8)
    bx.set_xticks(range(len(names)), names)
    bx.set_xlim(-0.5, len(names) - 0.5 + 0.6)
    bx.set_ylabel("vLLM - engine, first-token KL (nats)")
    bx.set_title("paired difference, 95% bootstrap CI")
    fig.suptitle("FusionRAG 15% through vLLM's KV connector vs our engine (qwen2.5-0.5b, fp32, 1 thread)")
    atomic_write_with(path, lambda tmp: fig.savefig(tmp, format="png", dpi=120))


def write_report(out: Path) -> list[dict]:
    from fusionrag.files import atomic_write

    data = read_rows(out)
    summaries = []
    for dataset, rows in data.items():
        meta_path = out / f"{dataset}.meta.json"
        meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
        summaries.append(summarize(dataset, rows, meta))
    atomic_write(out / "summary.json", json.dumps(summaries, indent=1))
    atomic_write(out / "summary.md", markdown(summaries))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("[vllm fidelity] no matplotlib here: draw the plot with .venv/bin/python "
              f"benchmarks/vllm/vllm_fidelity.py --report --out {out}", file=sys.stderr)
    else:
        plot(data, summaries, out / "fidelity.png")
    print(markdown(summaries))
    return summaries


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", help="a QA JSONL file (the study's: studies/datasets.sh)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--limit", type=int, default=50, help="questions evaluated (the first N)")
    ap.add_argument("--kb-limit", type=int, default=100, help="knowledge base: the first N questions' passages")
    ap.add_argument("--ratio", type=float, default=0.15)
    ap.add_argument("--controls", type=int, default=10,
                    help="on the first N questions also vLLM's own prefill and the engine's Full Attention")
    ap.add_argument("--cache-dir", default=str(ROOT / "runs" / "cache"))
    ap.add_argument("--reference", default=str(REFERENCE))
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--tp", type=int, default=1, help="vLLM's tensor_parallel_size (one core per rank; prefix caching "
                                                      "on, as deployed): our engine (one rank) is the comparison")
    ap.add_argument("--lock", default="/tmp/fusionrag-bench.lock",
                    help="wait while this file exists before starting ('' to not wait)")
    ap.add_argument("--report", action="store_true", help="only rebuild summary.json/.md and the plot from the rows")
    args = ap.parse_args(argv)
    if args.report:
        write_report(Path(args.out))
        return 0
    if not args.data:
        ap.error("--data is required (or --report)")
    return measure(args)


if __name__ == "__main__":  # vLLM starts its engine core with spawn: this guard is required
    sys.exit(main())
