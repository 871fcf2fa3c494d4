"""Ingest's documents: each file is one, keyed by its resolved absolute path (or an id the user gives).

- **Identity**: a file's document is the one recorded with its resolved path as source (or the
  id given with ``--id``); a new file's id is that path. A JSONL file is one document too: its
  lines' ``doc``/``id`` fields keep grouping passages for same-document neighbours, while the file
  is what is replaced, synced and deleted.
- **Unchanged files are skipped** by the sha256 of their bytes, before any parsing.
- **Legacy names**: a store made before documents were recorded referenced chunks by the
  reader's group name (``a.txt``, ``c.jsonl#q1``); ingesting the file those names came from
  replaces them, so an edited file never leaves its old version behind.
- **Sync** (``ingest --sync``): documents whose file is gone are removed, but only those whose
  source lies under one of the given paths, so syncing one folder never touches another's.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from fusionrag.files import content_hash
from fusionrag.retrieval.chunking import Chunk, Problem, make_chunks
from fusionrag.retrieval.knowledge import KnowledgeStore
from fusionrag.retrieval.readers import load_bytes, parse_file
from fusionrag.retrieval.stored_docs import DocumentRecord, lies_under


@dataclass
class FileDocument:
    """A file read for ingest: its document's new record and chunks."""

    record: DocumentRecord
    chunks: list[Chunk]
    passages: int
    groups: set[str]  # the reader's group names (a legacy store referenced chunks by them)
    existed: bool


def read_document(store: KnowledgeStore, path: Path, doc_id: str | None, problems: list[Problem],
                  outcomes: dict[str, list[str]]) -> FileDocument | None:
    """The file as a document to (re)place, or None: unchanged (listed in ``outcomes``) or nothing usable."""
    source = str(path.resolve())
    existing = store.documents.get(doc_id) if doc_id is not None else store.documents.by_source(source)
    did = doc_id if doc_id is not None else existing.id if existing is not None else source
    data = load_bytes(path, problems)
    if data is None:
        return None
    digest = content_hash(data)
    if existing is not None and existing.content_hash == digest and existing.source == source and existing.chunks:
        outcomes["unchanged"].append(did)
        return None
    parsed = parse_file(path, data, problems)
    chunks = make_chunks(store.prompt, parsed.passages, int(store.settings["chunk_tokens"]), problems)
    if not chunks:  # nothing usable (the reason is in problems): an existing version stays as it was
        return None
    st = path.stat()
    record = DocumentRecord(did, "file", source, digest, st.st_mtime, st.st_size, parsed.title)
    return FileDocument(record, chunks, len(parsed.passages), {p.doc for p in parsed.passages}, existing is not None)


def replaced_legacy(store: KnowledgeStore, plans: Sequence[FileDocument]) -> list[str]:
    """Legacy documents (named by the reader's group, from before documents were recorded) that these files'
    new documents replace."""
    groups = {g for plan in plans for g in plan.groups} - {plan.record.id for plan in plans}
    if not groups:
        return []
    return [d.id for d in store.documents.all() if d.origin == "legacy" and d.id in groups]


def synced_away(store: KnowledgeStore, given: Sequence[Path], problems: list[Problem]) -> list[str]:
    """Ingested documents under the given paths whose files are gone; a missing given path under which
    no document lies is a problem (as without ``--sync``)."""
    roots = [str(p.resolve()) for p in given]
    docs = [d for d in store.documents.all() if d.origin == "file"]
    for p, root in zip(given, roots, strict=True):
        if not p.exists() and not any(lies_under(d.source, root) for d in docs):
            problems.append(Problem(str(p), None, "no such file or folder", file_skipped=True))
    return [d.id for d in docs if any(lies_under(d.source, r) for r in roots)
            and d.source is not None and not os.path.exists(d.source)]
