"""The passage types every reader makes: :class:`Passage`, :class:`Problem`, :class:`ParsedFile`.

Kept apart from the readers (:mod:`fusionrag.retrieval.readers`) and the formats that need a
parser package (:mod:`fusionrag.retrieval.formats`) so that both use them without a cycle.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Passage:
    """A titled piece of text (before splitting), from document ``doc`` when it came from a file.

    The one passage type: readers, the evaluation sets and request-supplied documents all
    use it. Frozen and hashable, so passages shared by several questions de-duplicate.
    """

    title: str
    text: str
    doc: str = ""


@dataclass(frozen=True)
class Problem:
    """Input that was skipped, and why (``line`` is 1-based, ``None`` for the whole file).

    ``file_skipped``: nothing of the file was used (unreadable, broken, encrypted, unsupported);
    a skipped line or passage, or an empty file, is listed but is not a failed file."""

    path: str
    line: int | None
    message: str
    file_skipped: bool = False

    def __str__(self) -> str:
        where = self.path if self.line is None else f"{self.path}:{self.line}"
        return f"{where}: {self.message}"


@dataclass(frozen=True)
class ParsedFile:
    """What a reader made of one file: its title (for listings) and its passages."""

    title: str
    passages: list[Passage]


#: A reader: (path, the file's bytes, problems) -> the file's title and passages.


def sections(doc: str, first_title: str, items: Iterable[tuple[bool, str]]) -> list[Passage]:
    """Passages from ``(is_heading, line)`` items: each heading starts a section titled by it."""
    found: list[tuple[str, list[str]]] = [(first_title, [])]
    for is_heading, line in items:
        if is_heading:
            found.append((line, []))
        else:
            found[-1][1].append(line)
    return [Passage(title, "\n".join(lines), doc=doc) for title, lines in found if "\n".join(lines).strip()]


def skipped_file(path: Path, problems: list[Problem], fmt: str, why: BaseException | str) -> ParsedFile:
    """A file of format ``fmt`` that cannot be used: ``why`` is an exception (the parser's words) or a sentence."""
    if isinstance(why, BaseException):
        why = f"cannot read this {fmt} file ({' '.join(str(why).split())[:160] or type(why).__name__})"
    problems.append(Problem(str(path), None, f"{why}; skipped", file_skipped=True))
    return ParsedFile(path.stem, [])
