"""Loader for the shared RAG QA files (TriviaQA, HotpotQA, MuSiQue, 2WikiMQA).

All files share one JSONL schema (see ``../shared/data/README.md``)::

    {"id", "question", "answers": [gold, alias...], "passages": [{"title", "text"}...],
     "supporting_titles": [...]}

A question's passages, in file order, are its retrieved chunks (the paper's
LongBench setting); the union of all loaded questions' passages is the knowledge
base the offline stage preprocesses, so a chunk's neighbours may come from other
questions, as in the paper. Malformed input fails early with the file and line,
because a bench run over hundreds of questions should not die halfway through.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from fusionrag.errors import FusionRAGError
from fusionrag.retrieval.chunking import Passage

#: Dataset names recognised in file paths, checked in this order.
KNOWN_DATASETS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("2wikimqa", ("2wikimqa", "2wikimultihopqa", "wikimqa", "2wiki")),
    ("triviaqa", ("triviaqa",)),
    ("hotpotqa", ("hotpotqa", "hotpot")),
    ("musique", ("musique",)),
)


@dataclass(frozen=True)
class QAExample:
    """One question with its gold answers (``answers[0]`` is the main one) and its chunks."""

    id: str
    question: str
    answers: list[str]
    passages: list[Passage]
    dataset: str
    supporting_titles: list[str] = field(default_factory=list)


def infer_dataset_name(path: str | Path) -> str:
    """Dataset name from the file path (folder or file name), else the file's stem.

    Results are grouped per dataset, so the name must be stable for every file of
    one dataset (e.g. both HotpotQA files give ``"hotpotqa"``).
    """
    p = Path(path)
    candidates = [p.name.lower(), *(part.lower() for part in reversed(p.parent.parts))]
    for candidate in candidates:
        for name, keys in KNOWN_DATASETS:
            if any(key in candidate for key in keys):
                return name
    return p.stem


def truncate_passage_words(text: str, max_words: int | None) -> str:
    """Keep the first ``max_words`` whitespace-separated words of ``text``.

    Caps context length on a CPU budget (prefill cost grows with every token).
    Text that is short enough is returned unchanged, original spacing included,
    so truncation never alters passages it does not need to cut.
    """
    if max_words is None:
        return text
    if max_words < 0:
        raise ValueError(f"max_words must be >= 0, got {max_words}")
    words = text.split()
    if len(words) <= max_words:
        return text
    return " ".join(words[:max_words])


def _bad(path: Path, lineno: int, why: str) -> FusionRAGError:
    return FusionRAGError(f"{path}:{lineno}: {why}")


def _str_list(value: Any, key: str, path: Path, lineno: int) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _bad(path, lineno, f"'{key}' must be a list of strings")
    return list(value)


def cut_passages(passages: list[Passage], supporting_titles: list[str], n: int) -> list[Passage]:
    """At most ``n`` passages: every supporting one (gold evidence) and then the earliest others, in file order.

    Cutting MuSiQue's 20 paragraphs to the paper's 10 by position alone would drop gold evidence
    from some questions; this keeps the question answerable from its context.
    """
    if len(passages) <= n:
        return passages
    gold = set(supporting_titles)
    keep = {i for i, p in enumerate(passages) if p.title in gold}
    keep = set(sorted(keep)[:n])
    for i in range(len(passages)):
        if len(keep) >= n:
            break
        keep.add(i)
    return [p for i, p in enumerate(passages) if i in keep]


def _parse_line(line: str, path: Path, lineno: int, dataset: str, max_passage_words: int | None) -> QAExample:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise _bad(path, lineno, f"not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise _bad(path, lineno, f"expected a JSON object, got {type(obj).__name__}")
    missing = [k for k in ("id", "question", "answers", "passages") if k not in obj]
    if missing:
        raise _bad(path, lineno, f"missing field(s) {', '.join(missing)}")
    if not isinstance(obj["id"], str | int):
        raise _bad(path, lineno, "'id' must be a string")
    if not isinstance(obj["question"], str) or not obj["question"].strip():
        raise _bad(path, lineno, "'question' must be a non-empty string")
    answers = _str_list(obj["answers"], "answers", path, lineno)
    if not answers:
        raise _bad(path, lineno, "'answers' is empty: a question without a gold answer cannot be scored")
    raw_passages = obj["passages"]
    if not isinstance(raw_passages, list):
        raise _bad(path, lineno, "'passages' must be a list")
    passages = []
    for i, p in enumerate(raw_passages):
        if not isinstance(p, dict) or not isinstance(p.get("text"), str) or not isinstance(p.get("title", ""), str):
            raise _bad(path, lineno, f"passage {i} must be an object with string 'title' and 'text'")
        passages.append(Passage(title=p.get("title", ""), text=truncate_passage_words(p["text"], max_passage_words)))
    supporting = _str_list(obj.get("supporting_titles", []), "supporting_titles", path, lineno)
    return QAExample(
        id=str(obj["id"]),
        question=obj["question"],
        answers=answers,
        passages=passages,
        dataset=dataset,
        supporting_titles=supporting,
    )


def load_questions(
    path: str | Path,
    limit: int | None = None,
    seed: int = 0,
    shuffle: bool = False,
    *,
    dataset: str | None = None,
    max_passage_words: int | None = None,
    max_passages: int | None = None,
) -> list[QAExample]:
    """Read a QA JSONL file into :class:`QAExample` objects.

    The whole file is validated (every line), then optionally shuffled with
    ``seed``, then cut to the first ``limit`` questions: the same arguments always
    pick the same questions, which caching and resuming depend on. ``dataset``
    overrides the name inferred from the path; ``max_passage_words`` truncates
    every passage (see :func:`truncate_passage_words`); ``max_passages`` keeps at most that many
    passages per question (see :func:`cut_passages`).
    """
    if max_passages is not None and max_passages < 1:
        raise FusionRAGError(f"--max-passages must be >= 1, got {max_passages}")
    p = Path(path)
    if limit is not None and limit < 0:
        raise FusionRAGError(f"--limit must be >= 0, got {limit}")
    if not p.is_file():
        raise FusionRAGError(f"dataset file not found: {p}")
    name = dataset or infer_dataset_name(p)
    examples: list[QAExample] = []
    seen: dict[str, int] = {}
    try:
        with open(p, encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                ex = _parse_line(line, p, lineno, name, max_passage_words)
                if max_passages is not None:
                    ex = replace(ex, passages=cut_passages(ex.passages, ex.supporting_titles,
                                                                        max_passages))
                if ex.id in seen:
                    # Results are keyed by question id (resume, FA cache): duplicates would collide.
                    raise _bad(p, lineno, f"duplicate id {ex.id!r} (first on line {seen[ex.id]})")
                seen[ex.id] = lineno
                examples.append(ex)
    except UnicodeDecodeError as e:
        raise FusionRAGError(f"{p}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if shuffle:
        random.Random(seed).shuffle(examples)
    return examples if limit is None else examples[:limit]


def knowledge_base(examples: Iterable[QAExample]) -> list[Passage]:
    """The de-duplicated union of all passages (by title and text), in first-seen order.

    Questions of one dataset share passages; each distinct chunk is preprocessed
    once, and first-seen order keeps the knowledge base deterministic.
    """
    seen: set[Passage] = set()
    out: list[Passage] = []
    for ex in examples:
        for passage in ex.passages:
            if passage not in seen:
                seen.add(passage)
                out.append(passage)
    return out
