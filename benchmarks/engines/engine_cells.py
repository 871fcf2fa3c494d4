"""The cells of the side-by-side benchmark: what one engine does to one prompt, timed.

Every cell answers :meth:`Cell.run` with ``(ttft_s, first_token)`` for a prompt it is handed as
``Prompt`` (the exact token ids of ``S + chunks + Q``, and the chunks for fusionrag). In-process cells
(plain transformers, fusionrag) run on this process's torch threads; the peers run in their own
virtual environments as workers (``vllm_worker.py``, ``llama_worker.py``) spoken to over the JSON-lines
protocol of ``_worker_io.py``, one worker per engine, model file and thread count, loaded once.

A *repeated context* cell (``prefix_hit``) times the second question on the context its engine has
just computed for the first one: vLLM's and llama.cpp's prefix caches, fusionrag's whole-context cache
(:mod:`fusionrag.kvcache.context_cache`). It always runs right after the cold cell of the same engine
in a round, which leaves that context in the cache.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
VENVS = HERE / ".venvs"


@dataclass
class Prompt:
    """One context length's prompt: the same ids for every engine (``ids``: question 1, ``ids2``: question 2)."""

    target: int
    ids: list[int]
    ids2: list[int]
    question: str
    question2: str
    chunks: list[dict]


@dataclass
class Cell:
    """One row of the table: ``engine``, ``method``, ``dtype``, ``ratio``, ``threads``; ``run`` times it."""

    engine: str
    method: str
    dtype: str
    threads: int
    ratio: float | None = None
    label: str = ""
    run: Any = None  # (Prompt) -> (ttft_s, first_token[, stage timings in ms])
    missing: str | None = None  # why this cell cannot run here (one line), or None

    @property
    def key(self) -> str:
        ratio = "" if self.ratio is None else f"@{self.ratio:g}"
        return f"{self.engine}:{self.label or self.method}{ratio}:{self.dtype}:t{self.threads}"


def use_threads(threads: int) -> None:
    """This process computes on ``threads`` torch threads, pinned to cores ``0..threads-1``."""
    torch.set_num_threads(threads)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, set(range(min(threads, os.cpu_count() or threads))))


def transformers_cell(lm, threads: int) -> Cell:
    """Plain ``transformers``: ``model(ids, logits_to_keep=1)`` with its own SDPA, then the argmax."""
    from fusionrag.execution.attention_hook import attention_implementation

    def run(prompt: Prompt) -> tuple[float, int]:
        use_threads(threads)
        ids = torch.tensor([prompt.ids])
        with attention_implementation(lm.model, "sdpa"):
            t0 = time.perf_counter()
            logits = lm.model(ids, logits_to_keep=1).logits
            token = int(torch.argmax(logits[0, -1]))
            return time.perf_counter() - t0, token

    return Cell("transformers", "full", _dtype(lm), threads, run=run)


def fusionrag_cells(engine, threads: int, ratio: float) -> list[Cell]:
    """fusionrag ``full``, Full Reuse, FusionRAG at ``ratio``, and the repeated context (``prefix_hit``) on
    ``engine`` (its whole-context cache on; emptied before every cold cell, so only ``prefix_hit`` hits)."""
    dtype = _dtype(engine.lm)

    def method_run(method: str, r: float):
        def run(prompt: Prompt) -> tuple[float, int]:
            use_threads(threads)
            engine.context_cache.invalidate(None)
            req = engine.prepare(prompt.question, method=method, ratio=r, chunks=prompt.chunks)
            if req.context_cache_hit or req.prompt_tokens != len(prompt.ids):
                raise RuntimeError(f"fusionrag {method} did not prefill the benchmark's prompt")
            return req.ttft_ms["total"] / 1000.0, req.first_token, _stages(req)
        return run

    def hit(prompt: Prompt) -> tuple[float, int]:
        use_threads(threads)
        req = engine.prepare(prompt.question2, method="fusionrag", ratio=ratio, chunks=prompt.chunks)
        if not req.context_cache_hit or req.prompt_tokens != len(prompt.ids2):
            raise RuntimeError("fusionrag's repeated context missed its context cache")
        return req.ttft_ms["total"] / 1000.0, req.first_token, _stages(req)

    return [Cell("fusionrag", "full", dtype, threads, run=method_run("full", 1.0)),
            Cell("fusionrag", "reuse", dtype, threads, 0.0, run=method_run("reuse", 0.0)),
            Cell("fusionrag", "fusionrag", dtype, threads, ratio, run=method_run("fusionrag", ratio)),
            Cell("fusionrag", "prefix_hit", dtype, threads, ratio, run=hit)]


def _stages(req) -> dict[str, float]:
    """The request's TTFT by stage (ms): retrieve, load (KV read and assembly), select (the pre-pass),
    recompute, first_token."""
    return {k: round(v, 2) for k, v in req.ttft_ms.items()}


def _dtype(lm) -> str:
    return str(lm.dtype).removeprefix("torch.")


# -- the peers, in their own environments ---------------------------------------------------


@dataclass
class Worker:
    """A peer engine's worker process (``python WORKER ARGS`` in its venv), answering JSON lines."""

    name: str
    argv: list[str]
    cores: list[int]
    log_path: Path
    proc: subprocess.Popen | None = None
    info: dict = field(default_factory=dict)

    def start(self, timeout_s: float = 900.0) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        argv = (["taskset", "-c", ",".join(map(str, self.cores))] if _has_taskset() else []) + self.argv
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                                     bufsize=1)
        reply = self._read(timeout_s)
        if not reply.get("ready"):
            raise RuntimeError(f"{self.name} did not start: {reply}")
        self.info = reply

    def ask(self, request: dict, timeout_s: float = 1800.0) -> dict:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        reply = self._read(timeout_s)
        if "error" in reply:
            raise RuntimeError(f"{self.name}: {reply['error']}")
        return reply

    def stop(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(Exception):  # a dead worker is stopped below anyway
            self.ask({"op": "quit"}, timeout_s=30)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.proc = None

    def _read(self, timeout_s: float) -> dict:
        import selectors

        assert self.proc is not None and self.proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout_s):
            self.proc.kill()
            raise RuntimeError(f"{self.name}: no answer in {timeout_s:.0f} s (log: {self.log_path})")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name} exited (code {self.proc.poll()}; log: {self.log_path})")
        return json.loads(line)


def _has_taskset() -> bool:
    from shutil import which

    return which("taskset") is not None


def peer_cells(worker: Worker, engine: str, dtype: str, threads: int, label: str = "") -> list[Cell]:
    """A peer's cold full prefill (its prefix cache emptied first) and its repeated context."""

    def cold(prompt: Prompt) -> tuple[float, int]:
        r = worker.ask({"op": "ttft", "ids": prompt.ids, "cache": "cold"})
        return r["ttft_s"], r["first_token"]

    def hit(prompt: Prompt) -> tuple[float, int]:
        r = worker.ask({"op": "ttft", "ids": prompt.ids2, "cache": "keep"})
        reused = r.get("cached_tokens", r.get("reused_tokens"))
        if reused is not None and reused < len(prompt.ids2) // 2:
            raise RuntimeError(f"{engine} reused only {reused} of {len(prompt.ids2)} tokens of a repeated context")
        return r["ttft_s"], r["first_token"]

    return [Cell(engine, "full", dtype, threads, label=label, run=cold),
            Cell(engine, "prefix_hit", dtype, threads, label=f"{label}prefix_hit" if label else "", run=hit)]


def venv_python(name: str) -> Path:
    """The interpreter of a peer's environment: vLLM's is the project's ``.venv-vllm`` (``scripts/setup.sh``
    makes it, with fusionrag installed for the connector) where it exists, else ``.venvs/vllm``."""
    project = HERE.parent.parent / ".venv-vllm" / "bin" / "python"
    if name == "vllm" and project.exists():
        return project
    return VENVS / name / "bin" / "python"


def missing_venv(name: str) -> str | None:
    """Why the peer ``name`` (``vllm``, ``llama``) cannot run here, in one line, or None."""
    python = venv_python(name)
    if not python.exists():
        return (f"{name}: no environment at {python.parent.parent} "
                f"(run: bash benchmarks/engines/setup_engines.sh {name})")
    return None


def vllm_worker(model_dir: Path, threads: int, logs: Path, dtype: str = "bfloat16") -> Worker:
    argv = [str(venv_python("vllm")), str(HERE / "vllm_worker.py"), "--model", str(model_dir),
            "--threads", str(threads), "--dtype", dtype]
    return Worker(f"vllm-t{threads}", argv, list(range(threads)), logs / f"vllm-t{threads}.log")


def llama_worker(gguf: Path, threads: int, logs: Path) -> Worker:
    argv = [str(venv_python("llama")), str(HERE / "llama_worker.py"), "--gguf", str(gguf),
            "--threads", str(threads)]
    name = f"llama-{gguf.stem}-t{threads}"
    return Worker(name, argv, list(range(threads)), logs / f"{name}.log")


def gguf_dtype(path: Path) -> str:
    """The cell's dtype name of a GGUF file, from its name (``...-q8_0.gguf`` -> ``q8_0``)."""
    stem = path.stem.lower()
    for name in ("q4_k_m", "q8_0", "bf16", "f16", "f32"):  # bf16 before f16: "-bf16" ends with "f16" too
        if stem.endswith(name):
            return name
    return "q4_k_m" if "qwen2.5-0.5b" in stem else stem


if __name__ == "__main__":  # pragma: no cover
    sys.exit("engine_cells.py is a module of engines_bench.py")
