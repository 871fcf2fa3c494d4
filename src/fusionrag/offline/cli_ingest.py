"""What ``fusionrag ingest`` does around :func:`fusionrag.offline.build.ingest` on the command line: the input
checked before anything heavy is imported, the one-line summary, and the undoing of a first ingest that
stored nothing (no empty store is left behind)."""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from fusionrag.errors import FusionRAGError


def check_input(args: argparse.Namespace) -> None:
    """Before anything heavy is imported or created: the --id rule, an existing store's model, and input that
    names no readable file at all (a mistyped path) -- one line at once, and no store folder left behind."""
    from fusionrag.retrieval.readers import expand_paths, max_file_bytes
    from fusionrag.retrieval.store_info import DB_NAME, check_model_matches
    from fusionrag.retrieval.stored_docs import identity_problem

    max_file_bytes(".txt")  # FUSIONRAG_MAX_FILE_MB that is not a size: one line now, not per file later
    why = identity_problem("id", args.id) if args.id is not None else None
    if why:  # the same rule the API applies
        raise FusionRAGError(f"--id: {why}")
    if args.model and (Path(args.store) / DB_NAME).is_file():
        check_model_matches(args.store, args.model)
    if args.sync:  # gone paths are what --sync removes: nothing to check here
        return
    problems: list = []
    if not expand_paths([Path(p).expanduser() for p in args.paths], problems):
        for problem in problems:
            print(f"fusionrag: skipped {problem}", file=sys.stderr)
        from fusionrag.retrieval.readers import SUPPORTED_SUFFIXES

        raise FusionRAGError("nothing to ingest (" + ("see the skipped inputs above" if problems else
                                                      f"no supported files: {', '.join(SUPPORTED_SUFFIXES)}") + ")")


def summary(report, store_dir: Path, nothing: bool) -> str:
    """One line: what the run did, how long it took, and what to run next."""
    docs = report.documents
    done = ", ".join(f"{len(docs[k])} {k}" for k in ("added", "updated", "unchanged", "removed") if docs[k])
    line = (f"ingested {report.files} file(s) into {store_dir}: {done or 'no documents'}; {report.chunks} chunk(s) "
            f"({report.new_chunks} new), plain KV for {report.plain_computed}")
    if report.fuse is not None:
        line += f", fused KV for {report.fuse.get('computed', 0)}"
    line += f", in {report.seconds:.1f} s"
    if report.failed_files:
        line += f"; {len(report.failed_files)} file(s) failed"
    if nothing:
        return line + "."
    if report.fuse is None:
        return line + f". Next: fusionrag preprocess --store {store_dir} (fused KV: FusionRAG's reuse)"
    return line + f". Ready: fusionrag ask QUESTION --store {store_dir}"


def holds_nothing(store) -> bool:
    try:
        return not store.documents.all()
    except Exception:  # a store too broken to read is not removed here: the error that broke it is reported
        return False


class Created:
    """What creating a store at ``path`` adds (the folder and the missing folders above it, or the entries added
    to a folder that was there), so that a first ingest that fails removes exactly that."""

    def __init__(self, path: Path) -> None:
        self.path = path.resolve()
        top = self.path
        while not top.parent.exists() and top.parent != top:
            top = top.parent
        self.top = None if self.path.exists() else top  # the highest folder this run will make
        self.before = {p.name for p in self.path.iterdir()} if self.top is None and self.path.is_dir() else set()

    def undo(self) -> None:
        if self.top is not None:
            shutil.rmtree(self.top, ignore_errors=True)
            return
        for entry in self.path.iterdir() if self.path.is_dir() else ():
            if entry.name not in self.before:
                shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() and not entry.is_symlink() else \
                    entry.unlink(missing_ok=True)
