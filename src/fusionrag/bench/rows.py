"""The result rows shared by the Markdown tables (:mod:`.report`) and the plots (:mod:`.plots`).

Quality rows (one per dataset x method x KV kind x ratio) have the keys::

    dataset, method, kv ("plain"/"fused"), ratio, n, f1, em, contains, norm_f1,
    agree_f1, norm_agree, kl_first, top1_agree, ctx_tokens, recomputed_tokens,
    ttft_ms_median, and optional CIs as ``<metric>_ci = [lo, hi]``.

TTFT rows (one per method x ratio x context length x tier) have the keys::

    method, ratio, context_tokens, tier ("memory"/"disk"), ttft_ms, load_ms,
    select_ms, recompute_ms, speedup_vs_full, and optionally kv, first_token_ms.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

#: Stacked TTFT components, bottom to top: (row key, legend label, colour).
TTFT_PARTS: tuple[tuple[str, str, str], ...] = (
    ("retrieve_ms", "retrieve", "#8172b3"),
    ("load_ms", "load KV", "#4c72b0"),
    ("select_ms", "select tokens", "#dd8452"),
    ("recompute_ms", "recompute", "#c44e52"),
    ("first_token_ms", "first token", "#55a868"),
)


def is_number(v: Any) -> bool:
    """A finite number (not a bool): what a table cell or a plotted point can show."""
    return isinstance(v, int | float | np.number) and not isinstance(v, bool) and math.isfinite(float(v))


def dataset_names(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The rows' datasets in first-seen order: one table (or subplot column) each."""
    return list(dict.fromkeys(str(r.get("dataset", "all")) for r in rows))


def series_label(method: str, kv: Any, ratio: Any = None) -> str:
    """How a (method, KV kind, ratio) series is named, alike in tables and plot legends."""
    label = str(method)
    if kv == "fused":
        label += " (fused KV)"
    if ratio is not None and method != "full":  # Full Attention has no recompute ratio to show
        label += f" {float(ratio) * 100:g}%"
    return label


def with_first_token(row: Mapping[str, Any]) -> dict[str, Any]:
    """Fill ``first_token_ms`` as what TTFT leaves after the other parts, if not measured."""
    out = dict(row)
    if not is_number(out.get("first_token_ms")) and is_number(out.get("ttft_ms")):
        parts = sum(float(out[k]) for k, _, _ in TTFT_PARTS if k != "first_token_ms" and is_number(out.get(k)))
        out["first_token_ms"] = max(0.0, float(out["ttft_ms"]) - parts)
    return out
