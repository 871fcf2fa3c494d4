"""Inputs shared by the evaluation tests: result rows for the report and plot tests, a tiny data file for the benches.

Not a test module (pytest collects ``test_*.py`` only); imported by name like ``conftest``.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

from fusionrag.sample import load_sample

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ROOT = Path(__file__).resolve().parents[1]


def load_script(rel: str) -> ModuleType:
    """A script of ``studies/`` or ``benchmarks/`` (``"studies/paper/summarize.py"``) as a module, registered
    under its file name, since a dataclass in it looks its module up."""
    path = ROOT / rel
    name = path.stem
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def assert_png(path: Path) -> None:
    """A real PNG was written (not an empty or half-written file)."""
    assert path.is_file()
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000


def sample_data(tmp_path: Path) -> Path:
    """The bundled sample's first three questions as a HotpotQA file (the folder names the dataset)."""
    path = tmp_path / "hotpotqa" / "mini.jsonl"
    path.parent.mkdir()
    path.write_text("".join(json.dumps(ex) + "\n" for ex in load_sample()[:3]))
    return path


def quality_rows() -> list[dict]:
    """Two datasets: Full Attention, Full Reuse and FusionRAG on plain and fused KV at three ratios."""
    rows = []
    for ds in ("musique", "2wikimqa"):
        rows.append(dict(dataset=ds, method="full", kv="plain", ratio=1.0, n=3, f1=0.4, em=0.0, contains=0.67,
                         norm_f1=1.0, agree_f1=1.0, norm_agree=1.0, kl_first=0.0, top1_agree=1.0,
                         ctx_tokens=1500.0, recomputed_tokens=1500.0, ttft_ms_median=4800.0,
                         f1_ci=[0.2, 0.6], agree_f1_ci=[1.0, 1.0]))  # fmt: skip
        rows.append(dict(dataset=ds, method="reuse", kv="plain", ratio=0.0, n=3, f1=0.3, em=0.0, contains=0.33,
                         norm_f1=0.0, agree_f1=0.5, norm_agree=0.0, kl_first=0.6, top1_agree=0.6,
                         ctx_tokens=1500.0, recomputed_tokens=0.0, ttft_ms_median=380.0,
                         f1_ci=[0.1, 0.5], agree_f1_ci=[0.3, 0.7]))  # fmt: skip
        for kv in ("plain", "fused"):
            for ratio in (0.05, 0.15, 0.3):
                agree = 0.5 + ratio + (0.1 if kv == "fused" else 0.0)
                rows.append(
                    dict(dataset=ds, method="fusionrag", kv=kv, ratio=ratio, n=3, f1=0.35, em=0.0, contains=0.5,
                         norm_f1=0.5 if ds == "musique" else None,  # undefined on one dataset
                         agree_f1=agree, norm_agree=(agree - 0.5) / 0.5, kl_first=0.3, top1_agree=0.8,
                         ctx_tokens=1500.0, recomputed_tokens=1500 * ratio, ttft_ms_median=1500.0,
                         f1_ci=[0.2, 0.5], agree_f1_ci=[agree - 0.1, min(1.0, agree + 0.1)],
                         norm_f1_ci=None)
                )  # fmt: skip
    return rows


def ttft_rows() -> list[dict]:
    """Three context lengths; Full Attention without a tier, FusionRAG at 0% and 15% on both tiers."""
    rows = []
    for ctx in (1024, 2048, 4096):
        full = ctx * 2.0
        rows.append(dict(method="full", ratio=1.0, context_tokens=ctx, tier=None, ttft_ms=full, load_ms=0.0,
                         select_ms=0.0, recompute_ms=full * 0.95, speedup_vs_full=1.0))  # fmt: skip
        for tier, load in (("memory", 5.0), ("disk", 40.0)):
            for ratio in (0.0, 0.15):
                recompute = full * ratio
                ttft = load + 10.0 + recompute + 20.0
                rows.append(dict(method="fusionrag", ratio=ratio, context_tokens=ctx, tier=tier, ttft_ms=ttft,
                                 load_ms=load, select_ms=10.0, recompute_ms=recompute,
                                 speedup_vs_full=full / ttft))  # fmt: skip
    return rows


def bench_ttft_rows() -> list[dict]:
    """Rows as ``bench ttft`` writes them, grouped by the requested size (``target_tokens``).

    Full Attention is measured once (memory tier), actual context sizes differ from the
    requested ones, and retrieval is timed separately.
    """
    rows = []
    for target in (1024, 2048):
        rows.append(dict(method="full", ratio=0.0, kv="plain", tier="memory", target_tokens=target,
                         context_tokens=target + 7, ttft_ms=900.0, retrieve_ms=2.0, load_ms=0.0, select_ms=0.0,
                         recompute_ms=850.0, first_token_ms=48.0, speedup_vs_full=1.0))  # fmt: skip
        for tier in ("memory", "disk"):
            rows.append(dict(method="fusionrag", ratio=0.15, kv="fused", tier=tier, target_tokens=target,
                             context_tokens=target + 7, ttft_ms=300.0, retrieve_ms=2.0, load_ms=20.0, select_ms=5.0,
                             recompute_ms=250.0, first_token_ms=23.0, speedup_vs_full=3.0))  # fmt: skip
    return rows


def other_file(tmp_path):
    """Another HotpotQA file (same dataset name): the sample's last two questions, renamed."""
    path = tmp_path / "other" / "hotpotqa_other.jsonl"
    path.parent.mkdir()
    rows = [{**ex, "id": f"other-{ex['id']}"} for ex in load_sample()[3:5]]
    path.write_text("".join(json.dumps(ex) + "\n" for ex in rows))
    return path
