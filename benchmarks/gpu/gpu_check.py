"""The Python steps of a GPU run (``benchmarks/gpu/gpu_check.sh`` runs them after the CUDA tests), or all of
them on the CPU with tiny shapes (``--dry-run``: what the test suite runs, so a GPU loan's first call is the
measurement, not the debugging).

Steps, each writing its files to ``--out`` as it goes (a run stopped at a time limit keeps what finished):

- ``doctor``: ``run_doctor`` for every tiny model family x every sparse-pass backend (fp32: ratio 1 equals
  Full Attention within 1e-4, RoPE, fp16/int8 storage, greedy decoding), one line each in ``doctor.jsonl``;
- ``bench``: ``gpu_bench.py``: the kernels alone (per-head vs packed vs masked SDPA at 15% of 8K / 16K /
  32K, Qwen2.5-7B shape, bf16), then the TTFT table; ``gpu_bench.json`` / ``.md`` after each context;
- ``assemble``: ``assemble_bench.py``: assembly chunk by chunk vs batched (64 chunks of 512 tokens);
- ``profile``: ``gpu_profile.py``: where FusionRAG 15%'s time goes at 32K, the kernels' tile sweeps;
- ``serve``: ``gpu_serve.py``: the real ``fusionrag serve`` on a random Qwen2.5-7B-shaped checkpoint (3B where
  the budget is short) over a store of ~200 chunks, 8 concurrent clients with 16K-token RAG prompts, ``full``
  vs ``fusionrag`` 15%: TTFT p50 / p99, requests/s, tokens/s, GPU memory (``gpu_serve.json`` / ``.md`` /
  ``.png``, after each method); ``--budget-s`` bounds it (the shell script passes what is left).

``gpu_check.json`` records each step's status, seconds and notes, rewritten after every step (and merged
across invocations: the shell script runs each step in its own process, under its own time limit).

    python benchmarks/gpu/gpu_check.py --out DIR [--steps doctor,bench,assemble,profile,serve] [--dry-run]
        [--budget-s S]

``--dry-run`` runs every step on the CPU in fp32 with the tiny config; the Triton kernels run under
``TRITON_INTERPRET=1`` (set here when torch sees no GPU), so their timings exercise the code only (said in
each step's note); a host without Triton leaves them out, saying so. The serving step's dry run is a tiny
model on the CPU, 2 clients, a few requests per method.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
STEPS = ("doctor", "bench", "assemble", "profile", "serve")
DOCTOR_MODELS = ("tiny-qwen2", "tiny-llama")

#: Each step's arguments: the GPU run's, and the dry run's (tiny shapes, CPU, fp32).
FULL = {
    "bench": [],  # gpu_bench's defaults: 7B shape, bf16, 8K / 16K / 32K, every backend
    "assemble": ["--config", "qwen2.5-7b", "--dtype", "bfloat16", "--chunks", "64", "--chunk-tokens", "512"],
    "profile": [],
    "serve": [],  # gpu_serve's defaults: 7B shape (3B where the budget is short), bf16, 8 clients, 16K tokens
}
TINY = {
    "bench": ["--config", "tiny", "--device", "cpu", "--dtype", "float32", "--contexts", "96,160",
              "--chunk-tokens", "32", "--repeats", "1", "--kernel-contexts", "128,192"],
    "assemble": ["--config", "tiny", "--device", "cpu", "--dtype", "float32", "--chunks", "4",
                 "--chunk-tokens", "32", "--rounds", "1"],
    "profile": ["--config", "tiny", "--device", "cpu", "--dtype", "float32", "--context", "128",
                "--chunk-tokens", "32", "--repeats", "1", "--tiles", "16x16x4x2", "--packed-tiles", "16x16x1x1"],
    "serve": ["--dry-run"],
}


def _script(name: str):
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    return __import__(name)


def _interpreted_note(device: str) -> list[str]:
    from fusionrag.execution.attention_backends import triton_available

    if device.startswith("cuda"):
        return []
    if triton_available():
        return ["CPU dry run: the Triton kernels ran under TRITON_INTERPRET=1 (correctness only, no timing)"]
    return ["CPU dry run: Triton is not installed here, the Triton kernels were left out"]


def doctor(out: Path, device: str, models: tuple[str, ...]) -> tuple[bool, list[str]]:
    """``run_doctor`` for each model x backend, a JSON line each, appended as it finishes."""
    import torch

    from fusionrag.doctor import run_doctor
    from fusionrag.execution.attention_backends import NAMES, triton_available
    from fusionrag.models import load_model

    torch.set_grad_enabled(False)
    backends = [b for b in NAMES if triton_available() or not b.startswith("triton")]
    notes = [f"left out {b}: Triton cannot run here" for b in NAMES if b not in backends]
    ok = True
    with open(out / "doctor.jsonl", "w") as f:
        for model in models:
            for backend in backends:
                t0 = time.perf_counter()
                try:
                    r = run_doctor(load_model(model, device=device, attention=backend))
                except Exception as e:  # a failed run is a row, the next one still runs
                    r = {"model": model, "attention": backend, "ok": False, "error": f"{type(e).__name__}: {e}"}
                r["seconds"] = time.perf_counter() - t0
                ok &= bool(r["ok"])
                f.write(json.dumps(r) + "\n")
                f.flush()
                print(f"[gpu_check] doctor {model} {backend}: {'ok' if r['ok'] else 'FAILED'}", file=sys.stderr,
                      flush=True)
    return ok, notes


def run_step(step: str, out: Path, dry_run: bool, budget_s: float | None = None) -> tuple[bool, list[str]]:
    """Run one step; ``(ok, notes)``. ``budget_s`` bounds the serving step (the others have fixed sizes)."""
    import torch

    device = "cpu" if dry_run else ("cuda" if torch.cuda.is_available() else "cpu")
    notes = _interpreted_note(device) if step in ("bench", "profile") else []
    if step == "doctor":
        ok, more = doctor(out, device, DOCTOR_MODELS[-1:] if dry_run else DOCTOR_MODELS)
        return ok, notes + more
    argv = [*(TINY if dry_run else FULL)[step], "--out", str(out)]
    if step == "serve":
        rc = _script("gpu_serve").main([*argv, *(["--budget-s", str(budget_s)] if budget_s else [])])
        doc = json.loads((out / "gpu_serve.json").read_text()) if (out / "gpu_serve.json").is_file() else {}
        return rc == 0, [f"gpu_serve: {doc.get('status', 'no gpu_serve.json')}", *doc.get("notes", [])]
    if step == "bench":
        rc = _script("gpu_bench").main(argv)
    elif step == "assemble":
        rc = _script("assemble_bench").main(argv)
    else:
        rc = _script("gpu_profile").main(argv)
    return rc == 0, notes


def _record(out: Path, step: str, entry: dict) -> None:
    from fusionrag.files import atomic_write

    path = out / "gpu_check.json"
    doc = json.loads(path.read_text()) if path.is_file() else {"steps": {}}
    doc["steps"][step] = entry
    atomic_write(path, json.dumps(doc, indent=2))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated, of {', '.join(STEPS)}")
    p.add_argument("--dry-run", action="store_true", help="every step on the CPU with tiny shapes (fp32)")
    p.add_argument("--budget-s", type=float, default=None, help="seconds the serving step may take in all "
                                                               "(default: gpu_serve.py's)")
    args = p.parse_args(argv)
    steps = [s for s in args.steps.split(",") if s]
    unknown = set(steps) - set(STEPS)
    if unknown:
        p.error(f"unknown steps {sorted(unknown)} (known: {', '.join(STEPS)})")
    import torch

    if args.dry_run and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read when a kernel is first jitted
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    all_ok = True
    for step in steps:
        t0 = time.perf_counter()
        try:
            ok, notes = run_step(step, out, args.dry_run, args.budget_s)
            error = None
        except Exception as e:  # record it, run the next step
            ok, notes, error = False, [], "".join(traceback.format_exception_only(e)).strip()
            traceback.print_exc()
        entry = {"ok": ok, "seconds": round(time.perf_counter() - t0, 1), "dry_run": args.dry_run, "notes": notes}
        if error:
            entry["error"] = error
        _record(out, step, entry)
        print(f"[gpu_check] {step}: {'ok' if ok else 'FAILED'} ({entry['seconds']} s)", file=sys.stderr, flush=True)
        all_ok &= ok
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parents[1] / "src"))
    raise SystemExit(main())
