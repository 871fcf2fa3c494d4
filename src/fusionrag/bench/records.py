"""What a quality run keeps on disk between runs: the resumable records file and the Full Attention cache.

``records.jsonl`` holds one JSON line per (dataset, question, cell); a run appends as cells
finish and skips what is already there, so an interrupted run resumes. Several runs
(study lanes) may share one folder, hence the lock around every append and rewrite.
Full Attention results are cached per question because every method is scored against them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from fusionrag.bench.datasets import QAExample
from fusionrag.bench.full_reference import question_file
from fusionrag.bench.kb_stores import StoreSettings, store_name
from fusionrag.errors import FusionRAGError
from fusionrag.files import atomic_write, atomic_write_with
from fusionrag.online.methods import reads_store


def example_sha(ex: QAExample) -> str:
    """What a Full Attention result depends on besides the model: the question and its passages."""
    h = hashlib.sha256(ex.question.encode())
    for p in ex.passages:
        h.update(b"\0" + p.title.encode() + b"\0" + p.text.encode())
    return h.hexdigest()


class FullCache:
    """Full Attention answer + first-token logits per (model, dataset, question), on disk (safetensors)."""

    def __init__(self, root: Path, model: str) -> None:
        self.root = root / "full" / model.replace("/", "_")

    def _path(self, dataset: str, qid: str, max_new_tokens: int) -> Path:
        return question_file(self.root, dataset, qid, max_new_tokens)

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
def records_lock(path: Path) -> Iterator[None]:
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


def append_record(path: Path, rec: dict) -> None:
    """Append one finished cell, so an interrupted run loses at most the cell it was computing."""
    # Opened per record (not held): another lane may have replaced the file meanwhile.
    with records_lock(path), open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(rec) + "\n")


def supersede_other_kb_records(path: Path, spec: StoreSettings, dataset: str) -> int:
    """Move ``dataset``'s store-reading records made with another knowledge base aside; returns how many.

    They go to ``records.superseded.jsonl`` (kept, not deleted) and ``records.jsonl`` is
    rewritten atomically, so the cells are recomputed and the report never mixes knowledge bases.
    """
    with records_lock(path):
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


def refuse_other_files(rec_path: Path, done: dict, dataset: str, data_file: Path, in_file: set[str]) -> None:
    """Results are grouped by dataset name: two files of one dataset must not share a records file."""
    foreign = {qid for ds, qid, _ in done if ds == dataset} - in_file
    if foreign:
        raise FusionRAGError(
            f"{rec_path} already has {len(foreign)} '{dataset}' questions that are not in {data_file}: two files "
            "would be reported as one dataset; use another --out for this file"
        )


def read_records(path: Path) -> dict[tuple[str, str, str], dict]:
    """The records by (dataset, qid, run key); a later line for the same cell wins."""
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
