"""Full Attention's results per question, small enough to commit: the study's expensive reference.

Every method is scored against Full Attention, and Full Attention is the slowest cell (a full
prefill of every prompt). Its results were lost twice with machine changes because the
cache held whole first-token logit vectors (600 KB per question). This keeps, per question:
Full Attention's greedy answer (text and token ids), its top-``k`` log-probabilities at every
answer position (:class:`~fusionrag.bench.likelihood.TopKReference`, ~17 KB) and its own
gold-answer NLL, in one safetensors file under the results folder, so a rerun on a new
machine scores every method without recomputing Full Attention.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from fusionrag.bench.likelihood import TopKReference
from fusionrag.files import atomic_write_with

log = logging.getLogger(__name__)


@dataclass
class FullResult:
    """What the study needs of Full Attention on one question."""

    text: str
    reference: TopKReference
    info: dict  # input_sha, context_tokens, gold_nll, gold_nll_eot, reencodes, ...


def question_file(root: Path, dataset: str, qid: str, max_new_tokens: int) -> Path:
    """``root/<dataset>/<question id, made file-safe>.t<max_new_tokens>.safetensors``."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in qid)
    return root / dataset / f"{safe}.t{max_new_tokens}.safetensors"


class FullReference:
    """Files ``<root>/<model>/<dataset>/<question>.t<max_new_tokens>.safetensors``."""

    def __init__(self, root: Path, model: str) -> None:
        self.root = Path(root) / model.replace("/", "_")

    def path(self, dataset: str, qid: str, max_new_tokens: int) -> Path:
        return question_file(self.root, dataset, qid, max_new_tokens)

    def get(self, dataset: str, qid: str, max_new_tokens: int, input_sha: str) -> FullResult | None:
        """The stored result, or None when absent or made for other input (same id, other passages)."""
        p = self.path(dataset, qid, max_new_tokens)
        if not p.is_file():
            return None
        with safe_open(str(p), "pt") as f:
            meta = f.metadata() or {}
        info = json.loads(meta.get("info", "{}"))
        if info.get("input_sha") != input_sha:
            return None
        t = load_file(str(p))
        if meta.get("digest") != _digest(t, meta.get("answer", ""), meta.get("info", "")):
            log.warning("%s fails its digest (damaged or edited); Full Attention is recomputed for it", p)
            return None
        ref = TopKReference(t["answer_ids"].tolist(), bool(info.get("ended")), t["top_ids"].long(),
                            t["top_logprobs"].float())
        return FullResult(meta.get("answer", ""), ref, info)

    def put(self, dataset: str, qid: str, max_new_tokens: int, result: FullResult) -> None:
        ref = result.reference
        tensors = {
            "answer_ids": torch.tensor(ref.answer_ids, dtype=torch.int64).reshape(-1),
            "top_ids": ref.top_ids.to(torch.int32).contiguous(),
            "top_logprobs": ref.top_logprobs.float().contiguous(),
        }
        info = {**result.info, "ended": ref.ended}
        p = self.path(dataset, qid, max_new_tokens)
        meta = {"answer": result.text, "info": json.dumps(info)}
        meta["digest"] = _digest(tensors, meta["answer"], meta["info"])
        atomic_write_with(p, lambda tmp: save_file(tensors, str(tmp), metadata=meta))


def _digest(tensors: dict[str, torch.Tensor], answer: str, info: str) -> str:
    """SHA-256 over the tensors and the metadata: a reference file is verified every time it is read."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.numpy().tobytes())
    h.update(answer.encode())
    h.update(info.encode())
    return h.hexdigest()
