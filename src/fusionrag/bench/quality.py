"""``fusionrag bench quality``: methods x ratios on real QA data, side by side, resumable.

For each data file: the knowledge base is the union of the passages of the questions in
the run (so a chunk's neighbours may come from other questions, as in the paper); each
question's own passages, in file order, are its retrieved chunks (passed explicitly, no
retrieval). Every method sees the same token ids. Per-question records are appended to
``records.jsonl`` as they finish, so an interrupted run resumes where it stopped; Full
Attention outputs (answer + first-token logits) are cached under ``cache/full`` and
reused across runs, ablations and methods.

A study can make the knowledge base larger than the evaluated set (``kb_limit``, set by
``python -m studies.quality_cli --kb-limit``): building it is the expensive offline part, so fixing
it at the study's target size lets later runs evaluate more questions without invalidating
earlier records. Every record of a cell that reads the
store (fused KV, Cache-Craft's stored scores) names the store it used (``kb``); records made
with another knowledge base are moved aside to ``records.superseded.jsonl`` and recomputed,
never mixed in.

This module is the driver (the matrix of cells and running them); what it keeps on disk is in
:mod:`~fusionrag.bench.records`, the stores it reads in :mod:`~fusionrag.bench.kb_stores`, and the
statistics of the report in :mod:`~fusionrag.bench.aggregate`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from fusionrag.bench.aggregate import aggregate, all_comparisons, knowledge_base_stores
from fusionrag.bench.cells import run_cell
from fusionrag.bench.datasets import load_questions
from fusionrag.bench.full_reference import FullReference
from fusionrag.bench.kb_stores import StoreVariant, kb_size, open_store, store_composition, store_name
from fusionrag.bench.records import (
    FullCache,
    append_record,
    read_records,
    refuse_other_files,
    supersede_other_kb_records,
)
from fusionrag.errors import FusionRAGError
from fusionrag.kvcache.store import DEFAULT_KV_DTYPE
from fusionrag.offline.preprocess import FuseSettings
from fusionrag.online.auto_ratio import AUTO, AUTO_METHODS
from fusionrag.online.methods import KV_KINDS, method_info, reads_store
from fusionrag.online.request import check_ratio

#: ``fusionrag:plain`` is the same selection without the offline stage (what it adds is the difference).
DEFAULT_METHODS = ("full", "reuse", "cacheblend", "cachecraft", "epic", "fusionrag:plain", "fusionrag")
DEFAULT_RATIOS = (0.0, 0.05, 0.1, 0.15, 0.3)


@dataclass
class QualitySpec:
    """One ``bench quality`` invocation: the data, the matrix of cells and the offline settings."""

    data: list[Path]
    out: Path
    model: str = "qwen2.5-0.5b"
    limit: int | None = 50
    kb_limit: int | None = None  # knowledge base = passages of the first N questions (default: limit)
    methods: Sequence[str] = DEFAULT_METHODS
    ratios: Sequence[float | str] = DEFAULT_RATIOS  # numbers, "auto", "auto:MASS"
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
    #: The offline stage's settings, whole, as `fusionrag preprocess` takes them (its top_n is replaced by
    #: each value of ``top_n``, which may list several for the ablation).
    fuse: FuseSettings = field(default_factory=FuseSettings)
    kv_dtype: str = DEFAULT_KV_DTYPE  # as `fusionrag ingest` stores KV; non-fp16 stores are named so
    stores: StoreVariant | None = None  # a study's stores (studies/harness); None: as `fusionrag preprocess` builds
    max_passages: int | None = None  # passages per question (supporting ones kept); None: as in the file
    decode: bool = True  # False: teacher-forced metrics only (no greedy answer, no F1/agreement)
    full_reference: Path | None = None  # committed Full Attention reference (default: OUT/full_reference)
    #: Compute dtype of the methods' cells. The stores and Full Attention stay float32 whatever it is (the KL is
    #: always to the float32 reference); another dtype's records are named apart (``fusionrag@bf16``).
    dtype: str = "float32"


#: How a record names a method computed in another dtype than float32 (``fusionrag@bf16``).
DTYPE_TAGS = {"float32": "", "bfloat16": "@bf16", "float16": "@fp16"}


def dtype_tag(dtype: str) -> str:
    """The suffix of a method's record name in compute dtype ``dtype`` ("" for float32, the reference)."""
    if dtype not in DTYPE_TAGS:
        raise FusionRAGError(f"unknown compute dtype {dtype!r} (choose {', '.join(DTYPE_TAGS)})")
    return DTYPE_TAGS[dtype]


def auto_run_ratio(text: str) -> str:
    """A bench ratio ``auto`` (ratio="auto" with the store's calibration) or ``auto:MASS`` (with that attention
    mass), checked; anything else is a one-line error."""
    _, _, mass = text.partition(":")
    try:
        if text.split(":")[0] != AUTO or (mass and not 0.0 < float(mass) <= 1.0):
            raise ValueError
    except ValueError:
        raise FusionRAGError(f"ratio {text!r}: a number, 'auto' or 'auto:MASS' (0 < MASS <= 1)") from None
    return f"{AUTO}:{float(mass):g}" if mass else AUTO


def autos_for(method: str, autos: Sequence[str]) -> list[str]:
    """The auto ratios ``method`` runs: all for the methods ratio="auto" can size, none for the others."""
    return list(autos) if method in AUTO_METHODS else []


@dataclass(frozen=True)
class Run:
    """One cell of the matrix: a selection method, the KV it reuses, a ratio, the offline top-n, the compute dtype."""

    method: str
    kv: str
    ratio: float | str  # a number, or "auto" / "auto:MASS" (ratio="auto")
    top_n: int
    dtype: str = "float32"

    @property
    def label(self) -> str:
        """The method as records name it: ``fusionrag``, or ``fusionrag@bf16`` computed in bfloat16."""
        return self.method + dtype_tag(self.dtype)

    @property
    def key(self) -> str:
        ratio = self.ratio if isinstance(self.ratio, str) else f"{self.ratio:g}"
        return f"{self.label}|{self.kv}|{ratio}|{self.top_n}"

    @property
    def reads_store(self) -> bool:
        """Whether the result depends on the knowledge base (fused KV or stored fusion scores)."""
        return reads_store(self.method, self.kv)


def parse_method(text: str) -> tuple[str, str | None]:
    """``"fusionrag"`` or ``"cacheblend:fused"``: a registered method and, optionally, the KV it reuses."""
    name, _, kv = text.partition(":")
    info = method_info(name.strip())
    kv = kv.strip() or None
    if kv is not None and kv not in KV_KINDS:
        raise FusionRAGError(f"'{text}': the KV after ':' must be one of {', '.join(KV_KINDS)}")
    if kv is not None and info.name == "full":
        raise FusionRAGError("'full' reuses no KV; give it without ':KV'")
    return info.name, kv


def plan_runs(spec: QualitySpec) -> list[Run]:
    """The matrix, without duplicates: ratio-independent methods once, ratio 0 = Full Reuse.

    Each method runs on the KV it reuses in ``ask`` and ``serve`` (``fusionrag``: plain-first) unless
    spelled ``method:kv``; ``reuse`` runs on plain and on fused KV (what the offline stage alone gives).
    Outside float32 ``full`` is a cell like the others (``full@bf16``: the exact prefill a user runs in that
    dtype), scored against the float32 reference and never written into it."""
    runs: list[Run] = []
    dtype_tag(spec.dtype)
    top_ns = list(spec.top_n)
    main_n = top_ns[-1] if len(top_ns) == 1 else (10 if 10 in top_ns else top_ns[0])
    autos = [auto_run_ratio(r) for r in spec.ratios if isinstance(r, str)]
    for r in spec.ratios:
        if not isinstance(r, str):
            check_ratio(r)
    ratios: list[float | str] = [r for r in spec.ratios if not isinstance(r, str) and 0.0 < r < 1.0]
    for text in spec.methods:
        m, kv = parse_method(text)
        if m == "full":
            runs.append(Run("full", "none", 1.0, 0))
        elif m == "reuse":
            kinds = [kv] if kv else ["plain", "fused"]
            runs.extend(Run("reuse", k, 0.0, 0) for k in kinds if k == "plain")
            runs.extend(Run("reuse", k, 0.0, n) for k in kinds if k != "plain" for n in top_ns)
        elif method_info(m).placement is not None:  # a placement: no recompute, one cell per KV kind at ratio 0
            kind = kv or method_info(m).kv
            runs.append(Run(m, kind, 0.0, main_n if reads_store(m, kind) else 0))
        else:
            kind = kv or method_info(m).kv
            if reads_store(m, kind):
                # The top-n ablation varies the offline stage of FusionRAG's own cells; others read the main store.
                ns = top_ns if m == "fusionrag" else [main_n]
                runs.extend(Run(m, kind, r, n) for n in ns for r in [*ratios, *autos_for(m, autos)])
            else:
                runs.extend(Run(m, kind, r, 0) for r in [*ratios, *autos_for(m, autos)])
    runs = [replace(r, dtype=spec.dtype) for r in runs]
    seen, unique = set(), []
    for r in runs:
        if r.key not in seen:
            seen.add(r.key)
            unique.append(r)
    return unique


def run_quality(spec: QualitySpec) -> list[dict]:
    """Run the matrix, append per-question records, aggregate and write the report."""
    from fusionrag.bench.report import write_quality_report
    from fusionrag.models import load_model
    from fusionrag.online.engine import Engine

    spec.out.mkdir(parents=True, exist_ok=True)
    rec_path = spec.out / "records.jsonl"
    kb_n = kb_size(spec)  # validates --kb-limit before anything is loaded
    runs = plan_runs(spec)
    lm = load_model(spec.model)  # float32: builds the stores and Full Attention
    # The methods' cells compute in spec.dtype on the same (float32-built) stores.
    online_lm = lm if spec.dtype == "float32" else load_model(spec.model, dtype=spec.dtype, device=lm.device)
    full_cache = FullCache(spec.cache_dir or spec.out / "cache", lm.name)
    full_ref = FullReference(spec.full_reference or spec.out / "full_reference", lm.name)
    compositions = _previous_compositions(spec.out)  # other runs into this folder read other stores
    t_start = time.process_time()
    wall_start = time.perf_counter()
    done: dict[tuple[str, str, str], dict] = {}
    for data_file in spec.data:
        # The whole file is parsed (and validated) anyway; its ids also guard the records against other files.
        in_file = load_questions(data_file, None, seed=spec.seed, max_passage_words=spec.max_passage_words,
                                 max_passages=spec.max_passages)
        kb_examples = in_file[:kb_n] if kb_n is not None else in_file
        examples = kb_examples[:spec.limit] if spec.limit is not None else kb_examples
        if not examples:
            raise FusionRAGError(f"{data_file}: no questions")
        dataset = examples[0].dataset
        moved = supersede_other_kb_records(rec_path, spec, dataset)
        if moved:
            print(f"[bench quality] {dataset}: {moved} records were made with another knowledge base; "
                  "moved to records.superseded.jsonl, recomputing them")
        done = read_records(rec_path)  # re-read: another lane may have added records since
        refuse_other_files(rec_path, done, dataset, data_file, {ex.id for ex in in_file})
        todo = [(ex, run) for ex in examples for run in runs if (dataset, ex.id, run.key) not in done]
        # One store per offline top-n; plain KV is the same in all of them, so plain runs use the first
        # (and build no fused KV when no cell reads it). Nothing left to compute: no store is opened at all.
        needed = {r.top_n for _, r in todo if r.reads_store}
        engines = {n: Engine(open_store(spec, dataset, kb_examples, n, lm, fused=n in needed, evaluated=examples), lm)
                   for n in sorted(needed or {spec.top_n[0]})} if todo else {}
        online = engines if online_lm is lm else {n: Engine(e.store, online_lm) for n, e in engines.items()}
        for n in needed:
            compositions[store_name(spec, dataset, n)] = store_composition(spec, engines[n].store, kb_examples, n)
        print(
            f"[bench quality] {dataset}: {len(examples)} questions x {len(runs)} runs (knowledge base: the "
            f"passages of the first {len(kb_examples)}); "
            f"{len(todo)} cells to compute ({len(examples) * len(runs) - len(todo)} already done)"
        )
        bar = tqdm(todo, desc=f"bench {dataset}", unit="cell", disable=not spec.progress)
        estimated = False
        cells_start = time.perf_counter()  # after the store is built: the estimate is for the cells only
        for ex, run in bar:
            if online_lm is not lm:  # a missing reference is computed in float32, never in the cells' dtype
                _ensure_full_reference(engines, full_ref, full_cache, spec, dataset, ex)
            rec = run_cell(online, full_ref, full_cache, spec, dataset, ex, run)
            rec.update(method=run.label, run=run.key, dtype=spec.dtype)
            append_record(rec_path, rec)
            done[(dataset, ex.id, run.key)] = rec
            if not estimated and bar.n >= min(len(runs), len(todo)) - 1 and bar.n > 0:
                per_cell = (time.perf_counter() - cells_start) / (bar.n + 1)
                print(f"[bench quality] estimated {per_cell * len(todo) / 60:.1f} min wall for {dataset}'s cells")
                estimated = True
    done = read_records(rec_path)
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
            "neighbour_composition": compositions,
            "min_similarity": spec.fuse.min_similarity,
            "max_passages": spec.max_passages,
            "decode": spec.decode,
            "max_new_tokens": spec.max_new_tokens,
            "torch_threads": torch.get_num_threads(),
            "dtype": spec.dtype,
            **spec.extra_meta,
        },
    )
    return rows


def _ensure_full_reference(engines, full_ref: FullReference, full_cache: FullCache, spec: QualitySpec,
                           dataset: str, ex) -> None:
    """Compute ``ex``'s Full Attention reference with a float32 engine if the reference lacks it."""
    from fusionrag.bench.cells import full_attention, keep_full
    from fusionrag.bench.records import example_sha

    if full_ref.get(dataset, ex.id, spec.max_new_tokens, example_sha(ex)) is None:
        full, prep = full_attention(next(iter(engines.values())), ex, spec.max_new_tokens)
        keep_full(full_ref, full_cache, dataset, ex.id, spec.max_new_tokens, full, prep)


def _previous_compositions(out: Path) -> dict[str, dict]:
    """The neighbour compositions an earlier run into ``out`` recorded (one folder, several runs)."""
    from fusionrag.bench.provenance import read_results

    if not (out / "results.json").is_file():
        return {}
    return dict(read_results(out / "results.json")[0].get("neighbour_composition") or {})


def _datasets_of(spec: QualitySpec) -> set[str]:
    from fusionrag.bench.datasets import infer_dataset_name

    return {infer_dataset_name(p) for p in spec.data}


def report_from_records(out: Path, command: str | None = None, data_files: Sequence[Path] = (),
                        model: str | None = None) -> list[dict]:
    """Re-aggregate every record in ``out/records.jsonl`` (all datasets, all runs) into the report.

    Lets several ``bench quality`` invocations (e.g. different ``--limit`` per dataset)
    share one folder and one final report, without recomputing anything.
    """
    from fusionrag.bench.provenance import read_results
    from fusionrag.bench.report import write_quality_report

    records = list(read_records(out / "records.jsonl").values())
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
                               "neighbour_composition": _previous_compositions(out),
                               "aggregated_from": "records.jsonl"})
    return rows
