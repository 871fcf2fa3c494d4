"""Which stored chunks each question's prompt holds, in prompt order: what a study's stores are checked against.

A quality run passes each question's passages explicitly; the knowledge base holds them as
chunks (by content). The studies' stores use this to fuse only the evaluated questions' chunks;
neighbour-source studies use it as the ground truth of which chunks share a prompt.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fusionrag.bench.datasets import QAExample
from fusionrag.errors import FusionRAGError
from fusionrag.retrieval.chunking import Passage, make_chunks

if TYPE_CHECKING:  # the store pulls in faiss: `fusionrag doctor` must parse its arguments without it
    from fusionrag.retrieval.knowledge import KnowledgeStore


@dataclass
class Membership:
    """Which prompts each chunk appears in, and in what order: the ground truth the sources use."""

    prompts: list[list[int]]  # per question, its chunk ids in prompt order
    questions_of: dict[int, set[int]]  # chunk id -> indices of the questions that retrieve it

    def co_retrieved(self, cid: int) -> set[int]:
        """Every chunk that shares a prompt with ``cid`` (itself excluded)."""
        return {c for q in self.questions_of.get(cid, ()) for c in self.prompts[q]} - {cid}

    def preceding(self, cid: int) -> list[int]:
        """The chunks before ``cid`` in the first prompt that has it, in prompt order."""
        q = min(self.questions_of[cid])
        prompt = self.prompts[q]
        return prompt[: prompt.index(cid)]

    def precedes(self, n: int, cid: int) -> bool:
        """Whether ``n`` comes before ``cid`` in some prompt that has both."""
        for q in self.questions_of.get(cid, ()):
            prompt = self.prompts[q]
            if n in prompt and prompt.index(n) < prompt.index(cid):
                return True
        return False


def membership(store: KnowledgeStore, examples: Sequence[QAExample]) -> Membership:
    """Map every question's passages to the store's chunk ids (by content, as they were added)."""
    chunk_tokens = int(store.settings["chunk_tokens"])
    prompts: list[list[int]] = []
    questions_of: dict[int, set[int]] = defaultdict(set)
    for qi, ex in enumerate(examples):
        ids: list[int] = []
        for p in ex.passages:
            for chunk in make_chunks(store.prompt, [Passage(p.title, p.text)], chunk_tokens):
                cid = store.find_by_hash(chunk.content_hash)
                if cid is None:
                    raise FusionRAGError(f"passage {p.title!r} of question {ex.id} is not in the store")
                if cid not in ids:
                    ids.append(int(cid))
        prompts.append(ids)
        for cid in ids:
            questions_of[cid].add(qi)
    return Membership(prompts, dict(questions_of))
