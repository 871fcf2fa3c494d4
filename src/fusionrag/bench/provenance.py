"""What every results file records about how it was made, and writing it safely.

A result is only trustworthy if it can be traced and regenerated: every JSON file carries a
``meta`` block (command, model, data files with their SHA-256, machine, library versions, time)
and is written atomically (temp file + ``os.replace``, through :mod:`fusionrag.files`), so an
interrupted run never leaves a truncated report that a later run would read back.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import shlex
import sys
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from fusionrag.files import atomic_write, file_sha256
from fusionrag.files import write_json_atomic as _write_json

# --------------------------------------------------------------------------- JSON


def to_jsonable(obj: Any) -> Any:
    """Convert results to plain JSON: numpy/torch scalars to numbers, NaN/inf to ``null``.

    ``json`` would otherwise write ``NaN``, which is not JSON and breaks strict
    readers; an undefined metric is ``null``.
    """
    if obj is None or isinstance(obj, bool | str | int):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, np.generic):
        return to_jsonable(obj.item())
    if isinstance(obj, np.ndarray):
        return to_jsonable(obj.tolist())
    if isinstance(obj, Path):
        return str(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return to_jsonable(dataclasses.asdict(obj))
    if isinstance(obj, Mapping):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, Iterable):
        return [to_jsonable(v) for v in obj]
    item = getattr(obj, "item", None)  # torch scalars, without importing torch here
    if callable(item):
        return to_jsonable(item())
    raise TypeError(f"cannot write {type(obj).__name__} to JSON")


def write_json_atomic(path: str | Path, obj: Any) -> Path:
    """Write ``obj`` as indented JSON via a temp file and ``os.replace`` (never half-written)."""

    return _write_json(path, to_jsonable(obj))


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Write ``text`` via a temp file and ``os.replace``."""
    return atomic_write(path, text)


def write_report_files(out: str | Path, stem: str, doc: Any, markdown: str, plot: Any) -> Path:
    """A benchmark's report in ``out``: ``STEM.json`` (every sample, the command, model, data, machine),
    ``README.md`` and ``STEM.png`` (``plot(path)``), each written atomically."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / f"{stem}.json", doc)
    write_text_atomic(out / "README.md", markdown)
    plot(out / f"{stem}.png")
    return out


def read_results(path: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Read a file written by :func:`write_quality_report` / :func:`write_ttft_report`: ``(meta, rows)``."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data.get("meta", {}), data.get("rows", [])


# --------------------------------------------------------------------------- provenance


def _version(package: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def cpu_model() -> str | None:
    """The CPU's model name (Linux ``/proc/cpuinfo``), or None."""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def machine_info() -> dict[str, Any]:
    """Where the numbers were measured: timings are meaningless without the machine."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "cpu_model": cpu_model(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "numpy": np.__version__,
        "fusionrag": _version("fusionrag"),
        "transformers": _version("transformers"),
    }
    if hasattr(os, "sched_getaffinity"):
        info["cpus_usable"] = len(os.sched_getaffinity(0))
    try:
        import torch

        from fusionrag.models.devices import cpu_bf16_feature

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        info["cpu_bf16"] = cpu_bf16_feature()
        info["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:  # pragma: no cover - torch is a dependency
        info["torch"] = None
    return info


def machine_probe(seconds: float = 0.25) -> dict[str, float]:
    """How fast this machine computes and moves memory *now*, on this process's torch threads (CPU).

    A shared VM's memory bandwidth can change by 2x between runs while its arithmetic rate does not,
    and the two shift TTFT ratios differently (a short question pass is memory-bound, a long prefill
    compute-bound). Benchmarks record this at their start and end so runs can be compared.
    ``gemm_gflops``: fp32 ``[512, 896] x [896, 2048]``; ``gemm_gflops_bfloat16``: the same GEMM in bf16
    (a CPU with AMX or AVX512-BF16 runs it 2-4x faster. fp16 is left out: without AMX-FP16 it
    is emulated, 0.6 GFLOP/s on an AVX512-BF16 EPYC); ``copy_gbs``: bytes read + written copying 64 MiB."""
    import time

    import torch

    def rate(fn, work: float) -> float:
        fn()  # warm-up
        n, t0 = 0, time.perf_counter()
        while n < 3 or time.perf_counter() - t0 < seconds / 2:
            fn()
            n += 1
        return work * n / (time.perf_counter() - t0)

    a, b = torch.randn(512, 896), torch.randn(896, 2048)
    x = torch.ones(16 << 20)
    y = torch.empty_like(x)
    flops = 2 * 512 * 896 * 2048
    out = {"gemm_gflops": round(rate(lambda: a @ b, flops) / 1e9, 1)}
    a16, b16 = a.to(torch.bfloat16), b.to(torch.bfloat16)
    out["gemm_gflops_bfloat16"] = round(rate(lambda: a16 @ b16, flops) / 1e9, 1)
    out["copy_gbs"] = round(rate(lambda: y.copy_(x), 2 * x.numel() * 4) / 1e9, 2)
    return out


def build_meta(
    command: str | Sequence[str] | None = None,
    model: str | None = None,
    data_files: str | Path | Iterable[str | Path] = (),
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``meta`` block: command (default: this process's argv), model, data files, machine, time."""
    if command is None:
        command = shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]])
    elif not isinstance(command, str):
        command = shlex.join(command)
    if isinstance(data_files, str | Path):  # one file given on its own, not a list
        data_files = [data_files]
    files = []
    for f in data_files:
        p = Path(f)
        files.append({"path": str(p), "sha256": file_sha256(p) if p.is_file() else None})
    meta: dict[str, Any] = {
        "command": command,
        "model": model,
        "data_files": files,
        "machine": machine_info(),
        "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    if extra:
        meta.update(extra)
    return meta


# --------------------------------------------------------------------------- Markdown
