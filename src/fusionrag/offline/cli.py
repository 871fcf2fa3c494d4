"""``fusionrag ingest``, ``preprocess``, ``documents``, ``delete`` and ``store info|verify``.

Thin handlers over :mod:`fusionrag.offline.build`: they return
an exit code and raise :class:`FusionRAGError` for user errors (the CLI prints one line).
Reports go to stdout as JSON so that scripts can read them; skipped input goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from fusionrag.errors import FusionRAGError
from fusionrag.kvcache.storage_dtypes import DEFAULT_KV_DTYPE, STORAGE_DTYPES
from fusionrag.models.options import add_device_args, device_options
from fusionrag.offline.fuse_defaults import DEFAULT_TOP_N

_MODEL_HELP = (
    "model short name or local checkpoint (default: qwen2.5-0.5b for a new store, the store's model otherwise)"
)


def _checked_store(args: argparse.Namespace) -> Path:
    """The ``--store`` of a command on an existing store, checked (a store there; a ``--model`` that can be its
    model) before anything heavy is imported."""
    from fusionrag.retrieval.store_info import check_model_matches, require_store

    path = require_store(args.store)
    if getattr(args, "model", None):
        check_model_matches(path, args.model)
    return path


def _open(store_dir: Path, model: str | None, embedder=None, devices: dict | None = None):
    """The store and the model it was built with (``model`` overrides where the weights are read from)."""
    from fusionrag.models import load_model
    from fusionrag.retrieval.knowledge import KnowledgeStore
    from fusionrag.retrieval.store_info import stored_model

    lm = load_model(model or stored_model(store_dir), **(devices or {}))
    store = KnowledgeStore.open(store_dir, lm=lm, embedder=embedder)
    _record_model_path(store, model)
    return store, lm


def _record_model_path(store, model: str | None) -> None:
    """A store that recorded its model as a relative folder (before paths were made absolute) records
    the absolute folder it was just opened with (the same weights: the fingerprint matched)."""
    from fusionrag.models import KNOWN_NAMES
    from fusionrag.retrieval.store_settings import model_reference

    recorded = str(store.settings["model"])
    if (model and not store.read_only and recorded not in KNOWN_NAMES and not Path(recorded).is_absolute()
            and Path(model_reference(model)).is_absolute()):
        with store.writer():
            store.update_settings(model=model_reference(model))


def cmd_ingest(args: argparse.Namespace) -> int:
    from fusionrag.offline.cli_ingest import Created, check_input, holds_nothing, summary

    check_input(args)
    from fusionrag.models import DEFAULT_MODEL, load_model
    from fusionrag.offline import build
    from fusionrag.prompt import read_system_prompt
    from fusionrag.retrieval.embedder import get_embedder
    from fusionrag.retrieval.store_info import DB_NAME

    store_dir = Path(args.store)
    created = None
    if (store_dir / DB_NAME).is_file():
        store, lm = _open(store_dir, args.model, get_embedder(args.embedder) if args.embedder else None,
                          device_options(args))
        for opt, key in (("chunk_tokens", "chunk_tokens"), ("kv_dtype", "kv_dtype")):
            given = getattr(args, opt)
            if given is not None and str(given) not in (str(store.settings[key]),) and not (
                    key == "kv_dtype" and _same_dtype(given, store.settings[key])):
                raise FusionRAGError(
                    f"the store at {store_dir} uses --{opt.replace('_', '-')} {store.settings[key]}; "
                    "it cannot change after creation (use a new --store)"
                )
        if args.system_prompt is not None and read_system_prompt(args.system_prompt) != store.prompt.system_prompt:
            raise FusionRAGError(f"the store at {store_dir} was made with another --system-prompt; every cached KV "
                                 "was computed after it, so it cannot change (use a new --store)")
        _finish_interrupted(store, lm, args.quiet)
    else:
        model = args.model or DEFAULT_MODEL
        embedder = get_embedder(args.embedder) if args.embedder else None
        system_prompt = read_system_prompt(args.system_prompt)
        lm = load_model(model, **device_options(args))
        created = Created(store_dir)
        try:
            store = build.create_store(store_dir, lm, chunk_tokens=args.chunk_tokens or 256,
                                       kv_dtype=args.kv_dtype or DEFAULT_KV_DTYPE, embedder=embedder,
                                       model_source=model, system_prompt=system_prompt)
        except BaseException:
            created.undo()
            raise
    runner = None
    try:
        runner = _ray_runner(args, store)
        report = build.ingest(store, lm, [Path(p) for p in args.paths], progress=not args.quiet, runner=runner,
                              doc_id=args.id, sync=args.sync)
    finally:
        if runner is not None:
            runner.close()
        empty = created is not None and holds_nothing(store)
        store.close()
        if empty:  # a first ingest that stored nothing leaves no store behind (only what this run made)
            created.undo()
    for problem in report.problems:
        print(f"fusionrag: skipped {problem}", file=sys.stderr)
    nothing = report.chunks == 0 and not (report.documents["unchanged"] or report.documents["removed"])
    print(json.dumps(report.to_dict(), indent=2) if args.json else summary(report, store_dir, nothing))
    if nothing:
        from fusionrag.retrieval.readers import SUPPORTED_SUFFIXES

        why = ("see the skipped inputs above" if report.problems
               else f"no supported files ({', '.join(SUPPORTED_SUFFIXES)})")
        raise FusionRAGError(f"nothing was ingested ({why})" + ("; no store was created" if created else ""))
    failed = report.failed_files
    if failed and not args.skip_bad_files:
        raise FusionRAGError(f"{len(failed)} file(s) could not be ingested (named above: skipped ...); the other files "
                             "were ingested. Fix or remove them, or pass --skip-bad-files to accept that")
    return 0


def _finish_interrupted(store, lm, quiet: bool) -> None:
    """What an earlier change killed midway left undone, finished before this command's own work."""
    from fusionrag.offline import build

    done = build.finish_interrupted(store, lm, progress=not quiet)
    if done:
        print(f"fusionrag: finished what an earlier, interrupted change left undone ({json.dumps(done.counts)})",
              file=sys.stderr)


def _same_dtype(a: str, b: str) -> bool:
    from fusionrag.kvcache.store import canonical_dtype

    return canonical_dtype(a) == canonical_dtype(b)


def cmd_preprocess(args: argparse.Namespace) -> int:
    store_dir = _checked_store(args)
    from fusionrag.offline import build, compact

    store, lm = _open(store_dir, args.model, devices=device_options(args))
    runner = _ray_runner(args, store)
    try:
        with store.writer():  # one writer for the whole run (re-entrant: build.fuse takes it too)
            _finish_interrupted(store, lm, args.quiet)
            converted = compact.convert_kv_dtype(store, args.kv_dtype) if args.kv_dtype else []
            if args.plain_kv == "keep":
                compact.set_plain_kv(store, "keep")
            # Neighbour order and same-document neighbours: the store's recorded settings, else the defaults.
            settings = build.resolve_fuse_settings(store, args.top_n, min_similarity=args.min_similarity)
            report = build.fuse(store, lm, settings=settings, progress=not args.quiet, runner=runner)
            if args.plain_kv == "drop":
                compact.set_plain_kv(store, "drop")
                report.removed_keys.extend(compact.drop_plain(store))
    finally:
        if runner is not None:
            runner.close()
        store.close()
    print(json.dumps({**report.to_dict(), "kv_converted": len(converted)}, indent=2))
    return 0


def _ray_runner(args: argparse.Namespace, store):
    """A :class:`~fusionrag.offline.distributed.RayRunner` when ``--ray`` was given (else the local default)."""
    if not getattr(args, "ray", None):
        return None
    from fusionrag.offline.distributed import RayRunner

    return RayRunner(store, str(store.settings["model"]), address=args.ray, workers=args.ray_workers)


def _add_ray_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ray", default=None, metavar="auto|ADDRESS",
                   help="compute the plain and fused KV on a Ray cluster (auto: the running one, else a local one); "
                        "the entries are still written here, through the same verified store (needs the 'ray' extra)")
    p.add_argument("--ray-workers", type=int, default=None,
                   help="Ray workers, one model each (default: the cluster's CPUs)")


def cmd_documents(args: argparse.Namespace) -> int:
    """List a store's documents (no model is loaded), each with whether all its chunks have KV."""
    from fusionrag.retrieval.store_info import document_kv, list_documents

    docs = list_documents(Path(args.store))
    kv = document_kv(Path(args.store))
    rows = []
    for d in docs:
        k = kv.get(d.id, {"chunks": 0, "with_kv": 0, "fused": 0})
        rows.append({**d.to_dict(), "chunks_with_kv": k["with_kv"], "chunks_fused": k["fused"],
                     "complete": k["with_kv"] == k["chunks"]})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    incomplete = sum(not r["complete"] for r in rows)
    table = Table(title=f"{len(docs)} document(s) in {args.store}"
                        + (f"; {incomplete} incomplete (chunks without KV: run 'fusionrag ingest' on them again)"
                           if incomplete else ""))
    for col in ("id", "source", "chunks", "KV", "title", "ingested"):
        table.add_column(col, overflow="fold", justify="right" if col == "chunks" else "left")
    for d, row in zip(docs, rows, strict=True):
        state = ("complete" + (", fused" if row["chunks_fused"] == d.chunks and d.chunks else "")
                 if row["complete"] else f"incomplete: {row['chunks_with_kv']}/{d.chunks}")
        table.add_row(d.id, "=" if d.source == d.id else (d.source or "-"), str(d.chunks), state, d.title,
                      row["ingested"] or "-")
    Console().print(table)
    return 0


def cmd_delete(args: argparse.Namespace) -> int:
    """Remove documents by id or by file path; a fused store is re-fused where neighbour lists changed."""
    store_dir = _checked_store(args)
    from fusionrag.offline import build

    store, lm = _open(store_dir, args.model, devices=device_options(args))
    try:
        _finish_interrupted(store, lm, args.quiet)
        docs = list(dict.fromkeys(d for t in args.targets for d in _document_ids(store, store_dir, t)))
        report = build.delete_documents(store, lm, docs, progress=not args.quiet)
    finally:
        store.close()
    print(json.dumps(report.to_dict(), indent=2))
    return 0


def _document_ids(store, store_dir: Path, target: str) -> list[str]:
    """The documents a target names: its id, or its file's path (resolved: relative paths work). In a store
    built before documents were recorded, a file's chunks are a ``legacy`` document named by the file's name
    (a JSONL file's questions: ``NAME#id``), so a path finds those too."""
    if store.documents.get(target) is not None:
        return [target]
    path = Path(target).expanduser().resolve()
    found = store.documents.by_source(str(path)) or store.documents.get(str(path))
    if found is not None:
        return [found.id]
    legacy = [d.id for d in store.documents.all() if d.origin == "legacy"
              and (d.id == path.name or d.id.startswith(path.name + "#"))]
    if not legacy:
        raise FusionRAGError(f"no document '{target}' in the store at {store_dir} (list them with: fusionrag "
                             f"documents --store {store_dir})")
    return legacy


def cmd_store_info(args: argparse.Namespace) -> int:
    from fusionrag.retrieval.store_info import store_info

    print(json.dumps(store_info(Path(args.store)), indent=2))
    return 0


def cmd_store_verify(args: argparse.Namespace) -> int:
    """Check every file of the store; with --repair, remove or recompute what is broken. Exit 1 if not ok."""
    store_dir = _checked_store(args)
    from rich.console import Console
    from rich.table import Table

    from fusionrag.offline.verify import verify_store

    store, lm = _open(store_dir, args.model)
    try:
        report = verify_store(store, lm, repair=args.repair, progress=not args.quiet)
    finally:
        store.close()
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        table = Table(title=f"store verify {args.store}: {report.chunks} chunks, {report.entries_checked} KV entries "
                            f"checked, {'ok' if report.ok else 'PROBLEMS'}")
        for col in ("kind", "what", "problem", "repair"):
            table.add_column(col, overflow="fold")
        for p in report.problems:
            table.add_row(p.kind, p.what, p.why, p.repaired or ("-" if args.repair else "run with --repair"))
        Console().print(table)
    return 0 if report.ok else 1


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``ingest``, ``preprocess`` and ``store info`` to the ``fusionrag`` sub-commands."""
    p = sub.add_parser("ingest", help="add or update documents (.txt .md .jsonl .pdf .html .htm .docx) in a knowledge "
                                      "base: chunks, vectors, plain KV; unchanged files are skipped")
    p.add_argument("paths", nargs="+", metavar="PATH", help="files or folders to ingest")
    p.add_argument("--store", required=True, help="knowledge-base folder (created if missing)")
    p.add_argument("--id", default=None, metavar="ID",
                   help="the document's id (one file only; default: the file's resolved absolute path). The same id "
                        "again replaces the document")
    p.add_argument("--sync", action="store_true",
                   help="also remove the documents whose files are gone, among those under the given paths")
    p.add_argument("--skip-bad-files", action="store_true",
                   help="exit 0 when some files could not be read (they are still listed); default: exit 2 after "
                        "ingesting the good ones")
    p.add_argument("--model", default=None, help=_MODEL_HELP)
    p.add_argument("--chunk-tokens", type=int, default=None, help="max tokens per chunk, title included (default 256)")
    p.add_argument("--system-prompt", default=None, metavar="TEXT|FILE",
                   help="the instruction before the passages, for a new store (recorded; every cached KV is computed "
                        "after it). Default: a general one; the QA benchmarks use a short-answer one")
    p.add_argument("--kv-dtype", choices=list(STORAGE_DTYPES), default=None,
                   help=f"KV storage dtype of a new store (default {DEFAULT_KV_DTYPE}: int8 codes + fp16 scales, "
                        "half of float16, no resolved fidelity loss measured; rotation is always fp32)")
    p.add_argument("--embedder", default=None,
                   help="embedding model for a new store: all-MiniLM-L6-v2 (default) or hashing-<dim> (tests)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--json", action="store_true", help="print the full report as JSON (default: a one-line summary)")
    add_device_args(p)
    _add_ray_args(p)
    p.set_defaults(func=cmd_ingest)

    p = sub.add_parser("preprocess", help="fuse each chunk's KV with its top-n most similar chunks (resumable)")
    p.add_argument("--store", required=True, help="knowledge-base folder")
    p.add_argument("--top-n", type=int, default=None,
                   help=f"neighbours per chunk (0 = plain KV; default: the store's setting, else {DEFAULT_TOP_N})")
    p.add_argument("--min-similarity", type=float, default=None, metavar="COS",
                   help="keep only neighbours at least this similar (cosine of the embeddings): up to --top-n, "
                        "fewer where the corpus has nothing close (default: the store's setting, else plain top-n)")
    p.add_argument("--kv-dtype", choices=list(STORAGE_DTYPES), default=None,
                   help="convert the store's KV to this storage dtype first (re-encoded, no model run)")
    plain = p.add_mutually_exclusive_group()
    plain.add_argument("--drop-plain", dest="plain_kv", action="store_const", const="drop",
                       help="after fusing, keep only fused KV (what FusionRAG and policies on fused KV read); "
                            "incremental updates re-create the neighbours' plain KV they need")
    plain.add_argument("--keep-plain", dest="plain_kv", action="store_const", const="keep",
                       help="keep (re-create) every chunk's plain KV again")
    p.add_argument("--model", default=None, help="load the store's model from here (must be the same weights)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    add_device_args(p)
    _add_ray_args(p)
    p.set_defaults(func=cmd_preprocess, plain_kv=None)

    p = sub.add_parser("documents", help="list a knowledge base's documents (id, source, chunks, whether all their "
                                         "chunks have KV, title, ingested)")
    p.add_argument("--store", required=True, help="knowledge-base folder")
    p.add_argument("--json", action="store_true", help="print them as JSON")
    p.set_defaults(func=cmd_documents)

    p = sub.add_parser("delete", help="remove documents (by id or file path) and the chunks only they used; "
                                      "a fused store is re-fused where neighbour lists changed")
    p.add_argument("targets", nargs="+", metavar="PATH|ID", help="document ids or their files' paths")
    p.add_argument("--store", required=True, help="knowledge-base folder")
    p.add_argument("--model", default=None, help="load the store's model from here (must be the same weights)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    add_device_args(p)
    p.set_defaults(func=cmd_delete)

    p = sub.add_parser("store", help="knowledge-base maintenance")
    store_sub = p.add_subparsers(dest="store_command", required=True)
    q = store_sub.add_parser("info", help="print a store's model, counts, sizes and settings as JSON")
    q.add_argument("--store", required=True, help="knowledge-base folder")
    q.set_defaults(func=cmd_store_info)
    q = store_sub.add_parser("verify", help="check every store file (metadata, index, KV entries, orphans); "
                                            "--repair removes or recomputes what is broken")
    q.add_argument("--store", required=True, help="knowledge-base folder")
    q.add_argument("--repair", action="store_true", help="remove bad entries and orphans, rebuild the index, "
                                                         "recompute missing KV")
    q.add_argument("--model", default=None, help="load the store's model from here (must be the same weights)")
    q.add_argument("--json", action="store_true", help="print the report as JSON")
    q.add_argument("--quiet", action="store_true", help="no progress bars")
    q.set_defaults(func=cmd_store_verify)
