"""``fusionrag bench quality``: methods x ratios on real QA data, side by side, resumable.

For each data file: the knowledge base is the union of the passages of the questions in
the run (so a chunk's neighbours may come from other questions, as in the paper); each
question's own passages, in file order, are its retrieved chunks (passed explicitly, no
retrieval). Every method sees the same token ids. Per-question records are appended to
``records.jsonl`` as they finish, so an interrupted run resumes where it stopped; Full
Attention outputs (answer + first-token logits) are cached under ``cache/full`` and
reused across runs, ablations and methods.

The knowledge base can be larger than the evaluated set (``kb_limit``): building it is the
expensive offline part, so fixing it at the study's target size lets later runs evaluate
more questions without invalidating earlier records. Every record of a cell that reads the
store (fused KV, Cache-Craft's stored scores) names the store it used (``kb``); records made
with another knowledge base are moved aside to ``records.superseded.jsonl`` and recomputed,
never mixed in.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import statistics
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from fusionrag.errors import FusionRAGError
from fusionrag.eval import metrics
from fusionrag.eval.datasets import QAExample, load_questions
from fusionrag.files import atomic_write, atomic_write_with
from fusionrag.offline.preprocess import DEFAULT_NEIGHBOUR_ORDER

POLICY_METHODS = ("cacheblend", "cachecraft", "epic", "random")
DEFAULT_METHODS = ("full", "reuse", "cacheblend", "cachecraft", "epic", "query", "fusionrag")
DEFAULT_RATIOS = (0.0, 0.05, 0.1, 0.15, 0.3)


@dataclass
class QualitySpec:
    data: list[Path]
    out: Path
    model: str = "qwen2.5-0.5b"
    limit: int | None = 50
    kb_limit: int | None = None  # knowledge base = passages of the first N questions (default: limit)
    methods: Sequence[str] = DEFAULT_METHODS
    ratios: Sequence[float] = DEFAULT_RATIOS
    kv: str = "default"  # default | both: run the baseline policies on fused KV as well (Figure 16)
    top_n: Sequence[int] = (10,)
    max_new_tokens: int = 24
    max_passage_words: int | None = None
    seed: int = 0
    cache_dir: Path | None = None
    command: str | None = None
    progress: bool = True
    extra_meta: dict = field(default_factory=dict)
    embedder: object | None = None  # None: the store's default (MiniLM); tests inject a cheap one
    reuse_full_cache: bool = False  # True: a cached Full Attention result also serves the `full` cell (no TTFT)
    neighbour_order: str = DEFAULT_NEIGHBOUR_ORDER  # offline: most similar neighbour right after S (measured)
    same_document: bool = False  # offline: neighbours only from the chunk's own document group


@dataclass(frozen=True)
class Run:
    """One cell of the matrix: a selection method, the KV it reuses, a ratio, the offline top-n."""

    method: str
    kv: str
    ratio: float
    top_n: int

    @property
    def key(self) -> str:
        return f"{self.method}|{self.kv}|{self.ratio:g}|{self.top_n}"

    @property
    def reads_store(self) -> bool:
        """Whether the result depends on the knowledge base (fused KV or stored fusion scores)."""
        return reads_store(self.method, self.kv)


def reads_store(method: str, kv: str) -> bool:
    """Plain KV is a function of the chunk alone; fused KV and Cache-Craft's scores depend on its neighbours."""
    return kv == "fused" or method == "cachecraft"


def plan_runs(spec: QualitySpec) -> list[Run]:
    """The matrix, without duplicates: ratio-independent methods once, ratio 0 = Full Reuse."""
    runs: list[Run] = []
    top_ns = list(spec.top_n)
    main_n = top_ns[-1] if len(top_ns) == 1 else (10 if 10 in top_ns else top_ns[0])
    ratios = [r for r in spec.ratios if 0.0 < r < 1.0]
    for m in spec.methods:
        if m == "full":
            runs.append(Run("full", "none", 1.0, 0))
        elif m == "reuse":
            runs.append(Run("reuse", "plain", 0.0, 0))
            runs.extend(Run("reuse", "fused", 0.0, n) for n in top_ns)
        elif m == "fusionrag":
            runs.extend(Run("fusionrag", "fused", r, n) for n in top_ns for r in ratios)
        elif m == "fusionrag-perchunk":  # the softmax ablation: per-chunk instead of global normalisation
            runs.extend(Run(m, "fused", r, main_n) for r in ratios)
        elif m == "query":
            runs.extend(Run("query", "plain", r, 0) for r in ratios)
        elif m in POLICY_METHODS:
            runs.extend(Run(m, "plain", r, 0 if m != "cachecraft" else main_n) for r in ratios)
            if spec.kv == "both":
                runs.extend(Run(m, "fused", r, main_n) for r in ratios)
        else:
            raise FusionRAGError(f"unknown method '{m}' for bench quality")
    seen, unique = set(), []
    for r in runs:
        if r.key not in seen:
            seen.add(r.key)
            unique.append(r)
    return unique


class FullCache:
    """Full Attention answer + first-token logits per (model, dataset, question), on disk (safetensors)."""

    def __init__(self, root: Path, model: str) -> None:
        self.root = root / "full" / model.replace("/", "_")

    def _path(self, dataset: str, qid: str, max_new_tokens: int) -> Path:
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in qid)
        return self.root / dataset / f"{safe}.t{max_new_tokens}.safetensors"

    def get(self, dataset: str, qid: str, max_new_tokens: int,
            input_sha: str | None = None) -> tuple[str, torch.Tensor, dict] | None:
        """The cached result, or None; also None when it was made for other input (same id, other file)."""
        p = self._path(dataset, qid, max_new_tokens)
        if not p.is_file():
            return None
        from safetensors import safe_open

        with safe_open(str(p), "pt") as f:
            meta = f.metadata() or {}
        info = json.loads(meta.get("info", "{}"))
        if input_sha is not None and info.get("input_sha") not in (None, input_sha):  # older entries: no hash
            return None
        return meta.get("answer", ""), load_file(str(p))["first_logits"], info

    def put(self, dataset: str, qid: str, max_new_tokens: int, answer: str, logits: torch.Tensor, info: dict) -> None:
        p = self._path(dataset, qid, max_new_tokens)
        atomic_write_with(p, lambda tmp: save_file({"first_logits": logits.float().contiguous()}, str(tmp),
                                                   metadata={"answer": answer, "info": json.dumps(info)}))


@contextlib.contextmanager
def _records_lock(path: Path):
    """Serialise appends and rewrites of ``records.jsonl`` between concurrent runs (study lanes)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: one run per folder
        yield
        return
    with open(path.with_name(path.name + ".lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _append_record(path: Path, rec: dict) -> None:
    # Opened per record (not held): another lane may have replaced the file meanwhile.
    with _records_lock(path), open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(rec) + "\n")


def supersede_other_kb_records(path: Path, spec: QualitySpec, dataset: str) -> int:
    """Move ``dataset``'s store-reading records made with another knowledge base aside; returns how many.

    They go to ``records.superseded.jsonl`` (kept, not deleted) and ``records.jsonl`` is
    rewritten atomically, so the cells are recomputed and the report never mixes knowledge bases.
    """
    with _records_lock(path):
        if not path.is_file():
            return 0
        keep, stale = [], []
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                r = json.loads(line)
            except ValueError:
                continue
            mismatch = (r.get("dataset") == dataset and reads_store(r["method"], r["kv"])
                        and r.get("kb") != store_name(spec, dataset, int(r.get("top_n", 0))))
            (stale if mismatch else keep).append(line)
        if not stale:
            return 0
        with open(path.with_name("records.superseded.jsonl"), "a", encoding="utf-8") as f:
            f.write("".join(line + "\n" for line in stale))
        atomic_write(path, "".join(line + "\n" for line in keep))
    return len(stale)


def _refuse_other_files(rec_path: Path, done: dict, dataset: str, data_file: Path, in_file: set[str]) -> None:
    """Results are grouped by dataset name: two files of one dataset must not share a records file."""
    foreign = {qid for ds, qid, _ in done if ds == dataset} - in_file
    if foreign:
        raise FusionRAGError(
            f"{rec_path} already has {len(foreign)} '{dataset}' questions that are not in {data_file}: two files "
            "would be reported as one dataset; use another --out for this file"
        )


def _records(path: Path) -> dict[tuple[str, str, str], dict]:
    done: dict[tuple[str, str, str], dict] = {}
    if path.is_file():
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    r = json.loads(line)
                except ValueError:
                    continue  # a line cut by an interruption: that cell is simply redone
                done[(r["dataset"], r["qid"], r["run"])] = r
    return done


def kb_size(spec: QualitySpec) -> int | None:
    """How many questions' passages form the knowledge base (never fewer than are evaluated)."""
    if spec.kb_limit is None:
        return spec.limit
    if spec.limit is None or spec.kb_limit < spec.limit:
        raise FusionRAGError(
            f"--kb-limit ({spec.kb_limit}) must be >= --limit ({spec.limit}): every evaluated question's "
            "passages must be in the knowledge base"
        )
    return spec.kb_limit


def store_name(spec: QualitySpec, dataset: str, top_n: int) -> str:
    """The store (= knowledge base and offline settings) a cell of ``dataset`` at ``top_n`` reads."""
    variant = f"-{spec.neighbour_order}" + ("-samedoc" if spec.same_document else "")
    return f"{spec.model}-{dataset}-n{kb_size(spec)}-top{top_n}" + variant


def _seed_from_smaller_store(path: Path) -> Path | None:
    """Copy the largest store of the same model/dataset/offline settings built on fewer questions.

    The first N questions of a file are a prefix of the first M > N, chunk ids are assigned
    by content in insertion order, and every fused entry records the neighbour ids and the
    tokens it was made with, so the copy keeps all plain KV and the fused KV of chunks whose
    neighbour lists do not change; ``preprocess`` re-fuses only the rest.
    """
    m = re.fullmatch(r"(.+)-n(\d+)(-top.+)", path.name)
    if m is None:
        return None
    prefix, n, suffix = m.group(1), int(m.group(2)), m.group(3)
    smaller = []
    for p in path.parent.glob(f"{prefix}-n*{suffix}"):
        mm = re.fullmatch(re.escape(prefix) + r"-n(\d+)" + re.escape(suffix), p.name)
        if mm and int(mm.group(1)) < n and (p / "store.sqlite").is_file():
            smaller.append((int(mm.group(1)), p))
    if not smaller:
        return None
    source = max(smaller)[1]
    tmp = path.with_name(path.name + ".seeding")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source, tmp)
    os.replace(tmp, path)
    return source


def _fill_store(spec: QualitySpec, path: Path, dataset: str, examples: list[QAExample], lm):
    """Open or create the store at ``path`` and add the run's passages; None if it holds any other chunk."""
    from fusionrag.retrieval.knowledge import KnowledgeStore

    if (path / "store.sqlite").exists():
        store = KnowledgeStore.open(path, lm=lm, embedder=spec.embedder)
    else:
        store = KnowledgeStore.create(path, lm, chunk_tokens=100_000, kv_dtype="float16", embedder=spec.embedder,
                                      model_source=spec.model)
    # The knowledge base is the union of all questions' passages; each passage's document is the
    # first question that retrieves it, so --same-document means "neighbours among co-retrieved passages".
    seen: set = set()
    ids: set[int] = set()
    for ex in examples:
        fresh = [p for p in ex.passages if p not in seen]
        seen.update(fresh)
        if fresh:
            ids.update(store.add_passages([{"title": p.title, "text": p.text} for p in fresh],
                                          doc=f"{dataset}:{ex.id}", plain_kv=False))
    if set(store.chunk_ids()) - ids:
        store.close()
        return None
    return store


def _open_store(spec: QualitySpec, dataset: str, examples: list[QAExample], top_n: int, lm, fused: bool = True):
    """The run's store with plain KV for every chunk, and fused KV too when ``fused`` (the slow part).

    Cells on plain KV never read fused entries, so a run of only those skips the offline stage: on
    MuSiQue's 942-chunk knowledge base that is most of an hour of one core.
    """
    from fusionrag.offline.preprocess import run_plain

    # Stores hold gigabytes of KV: they live in the cache folder, never next to the report.
    path = (spec.cache_dir or spec.out / "cache") / "stores" / store_name(spec, dataset, top_n)
    seeded = not path.exists() and (source := _seed_from_smaller_store(path)) is not None
    if seeded:
        print(f"[bench quality] {path.name}: seeded from {source.name} (its plain KV and still-current fused KV)")
    store = _fill_store(spec, path, dataset, examples, lm)
    if store is None and seeded:  # the smaller store came from another file of the same dataset name
        print(f"[bench quality] {path.name}: the seed holds passages of other questions; building from scratch")
        shutil.rmtree(path)
        store = _fill_store(spec, path, dataset, examples, lm)
    if store is None:
        raise FusionRAGError(
            f"{path} holds chunks that are not passages of this run's questions (another data file with the "
            f"dataset name '{dataset}'?): the knowledge base would be wrong; remove it or use another --cache-dir"
        )
    run_plain(store, progress=spec.progress)  # once for the whole knowledge base, with a progress bar
    if fused and top_n > 0:
        store.preprocess(top_n=top_n, progress=spec.progress, neighbour_order=spec.neighbour_order,
                         same_document=spec.same_document)
    return store


def run_quality(spec: QualitySpec) -> list[dict]:
    """Run the matrix, append per-question records, aggregate and write the report."""
    from fusionrag.eval.report import write_quality_report
    from fusionrag.models import load_model
    from fusionrag.online.engine import Engine

    spec.out.mkdir(parents=True, exist_ok=True)
    rec_path = spec.out / "records.jsonl"
    kb_n = kb_size(spec)  # validates --kb-limit before anything is loaded
    runs = plan_runs(spec)
    lm = load_model(spec.model)
    full_cache = FullCache(spec.cache_dir or spec.out / "cache", lm.name)
    t_start = time.process_time()
    wall_start = time.perf_counter()
    done: dict[tuple[str, str, str], dict] = {}
    for data_file in spec.data:
        # The whole file is parsed (and validated) anyway; its ids also guard the records against other files.
        in_file = load_questions(data_file, None, seed=spec.seed, max_passage_words=spec.max_passage_words)
        kb_examples = in_file[:kb_n] if kb_n is not None else in_file
        examples = kb_examples[:spec.limit] if spec.limit is not None else kb_examples
        if not examples:
            raise FusionRAGError(f"{data_file}: no questions")
        dataset = examples[0].dataset
        moved = supersede_other_kb_records(rec_path, spec, dataset)
        if moved:
            print(f"[bench quality] {dataset}: {moved} records were made with another knowledge base; "
                  "moved to records.superseded.jsonl, recomputing them")
        done = _records(rec_path)  # re-read: another lane may have added records since
        _refuse_other_files(rec_path, done, dataset, data_file, {ex.id for ex in in_file})
        todo = [(ex, run) for ex in examples for run in runs if (dataset, ex.id, run.key) not in done]
        # One store per offline top-n; plain KV is the same in all of them, so plain runs use the first
        # (and build no fused KV when no cell reads it). Nothing left to compute: no store is opened at all.
        needed = {r.top_n for _, r in todo if r.reads_store}
        engines = {n: Engine(_open_store(spec, dataset, kb_examples, n, lm, fused=n in needed))
                   for n in sorted(needed or {spec.top_n[0]})} if todo else {}
        print(
            f"[bench quality] {dataset}: {len(examples)} questions x {len(runs)} runs (knowledge base: the "
            f"passages of the first {len(kb_examples)}); "
            f"{len(todo)} cells to compute ({len(examples) * len(runs) - len(todo)} already done)"
        )
        bar = tqdm(todo, desc=f"bench {dataset}", unit="cell", disable=not spec.progress)
        estimated = False
        cells_start = time.perf_counter()  # after the store is built: the estimate is for the cells only
        for ex, run in bar:
            rec = _run_cell(engines, full_cache, spec, dataset, ex, run)
            _append_record(rec_path, rec)
            done[(dataset, ex.id, run.key)] = rec
            if not estimated and bar.n >= min(len(runs), len(todo)) - 1 and bar.n > 0:
                per_cell = (time.perf_counter() - cells_start) / (bar.n + 1)
                print(f"[bench quality] estimated {per_cell * len(todo) / 60:.1f} min wall for {dataset}'s cells")
                estimated = True
    done = _records(rec_path)
    mine = [r for r in done.values() if r["dataset"] in _datasets_of(spec)]
    rows = aggregate(mine)
    cpu, wall = time.process_time() - t_start, time.perf_counter() - wall_start
    print(f"[bench quality] actual: CPU time {cpu:.0f} s, wall {wall:.0f} s")
    write_quality_report(
        rows,
        spec.out,
        comparisons=all_comparisons(mine),
        command=spec.command,
        model=lm.name,
        data_files=spec.data,
        meta={
            "runs": [r.key for r in runs],
            "limit": spec.limit,
            "kb_limit": kb_n,
            "knowledge_base_stores": knowledge_base_stores(mine),
            "max_new_tokens": spec.max_new_tokens,
            "torch_threads": torch.get_num_threads(),
            **spec.extra_meta,
        },
    )
    return rows


def _datasets_of(spec: QualitySpec) -> set[str]:
    from fusionrag.eval.datasets import infer_dataset_name

    return {infer_dataset_name(p) for p in spec.data}


@dataclass
class _CachedFull:
    """A Full Attention result read back from :class:`FullCache` (no TTFT: it was not measured now)."""

    text: str
    first_logits: torch.Tensor
    context_tokens: int
    fused_fallbacks: int = 0
    ttft_ms: dict = field(default_factory=dict)

    @property
    def recomputed_tokens(self) -> int:
        return self.context_tokens  # Full Attention computes every context token


def example_sha(ex: QAExample) -> str:
    """What a Full Attention result depends on besides the model: the question and its passages."""
    h = hashlib.sha256(ex.question.encode())
    for p in ex.passages:
        h.update(b"\0" + p.title.encode() + b"\0" + p.text.encode())
    return h.hexdigest()


def _run_cell(engines, full_cache: FullCache, spec: QualitySpec, dataset: str, ex: QAExample, run: Run) -> dict:
    chunks = [{"title": p.title, "text": p.text} for p in ex.passages]
    engine = engines.get(run.top_n) or next(iter(engines.values()))
    input_sha = example_sha(ex)
    cached = full_cache.get(dataset, ex.id, spec.max_new_tokens, input_sha)
    res = None
    if cached is None or (run.method == "full" and not spec.reuse_full_cache):
        full = engine.answer(ex.question, method="full", chunks=chunks, max_new_tokens=spec.max_new_tokens)
        info = {"ttft_ms": full.ttft_ms, "context_tokens": full.context_tokens, "input_sha": input_sha}
        full_cache.put(dataset, ex.id, spec.max_new_tokens, full.text, full.first_logits, info)
        cached = (full.text, full.first_logits, info)
        if run.method == "full":
            res = full
    full_text, full_logits, full_info = cached
    ttft_from_cache = run.method == "full" and res is None
    if ttft_from_cache:
        # Served from the cache (answer and logits are deterministic): its TTFT was measured by an
        # earlier run under possibly other conditions (threads, load), so it is left out, not mixed in.
        res = _CachedFull(full_text, full_logits, int(full_info.get("context_tokens", 0)))
    if run.method != "full":
        method, options = run.method, {}
        if method == "fusionrag-perchunk":
            method, options = "fusionrag", {"softmax": "per_chunk"}
        res = engine.answer(ex.question, method=method, ratio=run.ratio, chunks=chunks, kv=run.kv,
                            max_new_tokens=spec.max_new_tokens, **options)
    scores = metrics.answer_scores(res.text, ex.answers)
    return {
        "dataset": dataset,
        "qid": ex.id,
        "run": run.key,
        "method": run.method,
        "kv": run.kv,
        "ratio": run.ratio,
        "top_n": run.top_n,
        "answer": res.text,
        "full_answer": full_text,
        **scores,
        "agree_f1": metrics.agreement_f1(res.text, full_text),
        "kl_first": float(metrics.kl_first_token(full_logits, res.first_logits)),
        "top1_agree": float(metrics.top1_agree(full_logits, res.first_logits)),
        "ctx_tokens": res.context_tokens,
        "recomputed_tokens": res.recomputed_tokens,
        "ttft_ms": None if ttft_from_cache else res.ttft_ms.get("total"),
        "ttft_breakdown_ms": {} if ttft_from_cache else res.ttft_ms,
        "full_from_cache": ttft_from_cache,
        "fused_fallbacks": res.fused_fallbacks,
        "kb": store_name(spec, dataset, run.top_n) if run.reads_store else None,
    }


def aggregate(records: Iterable[dict]) -> list[dict]:
    """Per (dataset, method, kv, ratio, top_n): means with bootstrap CIs and normalised scores."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        groups[(r["dataset"], r["method"], r["kv"], r["ratio"], r.get("top_n", 0))].append(r)
    rows = []
    for (dataset, method, kv, ratio, top_n), recs in sorted(groups.items(), key=lambda kv_: str(kv_[0])):
        row = {"dataset": dataset, "method": method, "kv": kv, "ratio": ratio, "top_n": top_n, "n": len(recs)}
        for m in ("f1", "em", "contains", "agree_f1", "kl_first", "top1_agree"):
            mean, lo, hi = metrics.bootstrap_ci([r.get(m) for r in recs])
            row[m], row[f"{m}_ci"] = mean, [lo, hi]
        row["ctx_tokens"] = statistics.fmean(r["ctx_tokens"] for r in recs)
        row["recomputed_tokens"] = statistics.fmean(r["recomputed_tokens"] for r in recs)
        ttfts = [r["ttft_ms"] for r in recs if r.get("ttft_ms") is not None]
        row["ttft_ms_median"] = statistics.median(ttfts) if ttfts else None
        row["ttft_n"] = len(ttfts)
        for part in ("retrieve", "load", "select", "recompute", "first_token"):
            vals = [r["ttft_breakdown_ms"][part] for r in recs if part in r.get("ttft_breakdown_ms", {})]
            row[f"{part}_ms_median"] = statistics.median(vals) if vals else None
        rows.append(row)
    # normalisation against Full Attention and plain Full Reuse of the same dataset
    by = {(r["dataset"], r["method"], r["kv"]): r for r in rows if r["method"] in ("full", "reuse")}
    for row in rows:
        full, reuse = by.get((row["dataset"], "full", "none")), by.get((row["dataset"], "reuse", "plain"))
        row["norm_f1"] = metrics.normalised_score(row["f1"], reuse and reuse["f1"], full and full["f1"])
        row["norm_agree"] = metrics.normalised_agreement(row["agree_f1"], reuse and reuse["agree_f1"])
    return rows


#: Fidelity metrics compared question by question between FusionRAG and each baseline.
COMPARE_METRICS = ("agree_f1", "kl_first", "top1_agree")


def paired_comparisons(records: Iterable[dict], method: str = "fusionrag", kv: str = "fused") -> list[dict]:
    """``method`` on ``kv`` minus each baseline, paired by question, with bootstrap CIs.

    The per-method intervals of :func:`aggregate` are wide because questions differ a lot
    in difficulty; every method answers the same questions, so resampling *questions* and
    looking at the difference removes that shared variance (``metrics.bootstrap_diff_ci``).
    Baselines: every other method at the same ratio and Full Reuse (ratio 0, plain and fused);
    only questions both sides answered are paired. Full Attention is the reference, not a baseline.
    """
    cells: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for r in records:
        cells[(r["dataset"], r["method"], r["kv"], r["ratio"], r.get("top_n", 0))][r["qid"]] = r
    out = []
    ordered = sorted(cells.items(), key=lambda kv_: str(kv_[0]))
    for (ds, m, k, ratio, top_n), mine in ordered:
        if (m, k) != (method, kv):
            continue
        for (ds2, m2, k2, ratio2, top_n2), theirs in ordered:
            if ds2 != ds or m2 == "full" or (m2, k2) == (method, kv) or (m2 != "reuse" and ratio2 != ratio):
                continue
            if k2 == kv == "fused" and top_n2 != top_n:  # top-n sweep: compare within one offline setting
                continue
            qids = sorted(set(mine) & set(theirs))
            if not qids:
                continue
            row = {"dataset": ds, "method": m, "kv": k, "ratio": ratio, "top_n": top_n, "baseline": m2,
                   "baseline_kv": k2, "baseline_ratio": ratio2, "baseline_top_n": top_n2, "n": len(qids)}
            for metric in COMPARE_METRICS:
                diff, lo, hi = metrics.bootstrap_diff_ci([mine[q].get(metric) for q in qids],
                                                         [theirs[q].get(metric) for q in qids])
                row[f"{metric}_diff"], row[f"{metric}_diff_ci"] = diff, [lo, hi]
            out.append(row)
    return out


def all_comparisons(records: Sequence[dict]) -> list[dict]:
    """FusionRAG against every baseline, then the offline stage alone (Full Reuse on fused vs plain KV)."""
    return paired_comparisons(records) + paired_comparisons(records, method="reuse", kv="fused")


def knowledge_base_stores(records: Sequence[dict]) -> dict[str, list[str]]:
    """Per dataset, the stores (knowledge base + offline settings) its store-reading records used."""
    stores: dict[str, set[str]] = defaultdict(set)
    for r in records:
        if r.get("kb"):
            stores[r["dataset"]].add(r["kb"])
    return {d: sorted(v) for d, v in sorted(stores.items())}


def report_from_records(out: Path, command: str | None = None, data_files: Sequence[Path] = (),
                        model: str | None = None) -> list[dict]:
    """Re-aggregate every record in ``out/records.jsonl`` (all datasets, all runs) into the report.

    Lets several ``bench quality`` invocations (e.g. different ``--limit`` per dataset)
    share one folder and one final report, without recomputing anything.
    """
    from fusionrag.eval.report import read_results, write_quality_report

    records = list(_records(out / "records.jsonl").values())
    if not records:
        raise FusionRAGError(f"no records in {out / 'records.jsonl'}; run 'fusionrag bench quality' first")
    rows = aggregate(records)
    previous = read_results(out / "results.json")[0] if (out / "results.json").is_file() else {}
    datasets = sorted({r["dataset"] for r in records})
    counts = {d: len({r["qid"] for r in records if r["dataset"] == d}) for d in datasets}
    stores = knowledge_base_stores(records)
    write_quality_report(rows, out, comparisons=all_comparisons(records), command=command,
                         model=model or previous.get("model"),
                         data_files=list(data_files) or [f["path"] for f in previous.get("data_files", [])],
                         meta={"questions_per_dataset": counts, "knowledge_base_stores": stores,
                               "aggregated_from": "records.jsonl"})
    return rows
