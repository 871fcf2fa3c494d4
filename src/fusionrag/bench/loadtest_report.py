"""The load test's report: ``loadtest.json``, ``loadtest.md`` and ``loadtest.png`` (kept apart from
the load generator, :mod:`fusionrag.bench.loadtest`, so each module has one job)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fusionrag.files import atomic_write, atomic_write_with, write_json_atomic


def render_markdown(report: dict[str, Any]) -> str:
    lines = [
        "# Load test: TTFT and throughput vs request rate",
        "",
        f"Server {report['base_url']}; {report['questions']} questions"
        f"{' with their passages as request documents' if report['with_documents'] else ''}; "
        f"Poisson arrivals; max_tokens {report['max_tokens']}; bounded by "
        f"{report['n_requests'] or '-'} requests / {report['duration_s'] or '-'} s per cell. "
        "TTFT is client-side (request sent to first streamed chunk).",
        "",
    ]
    if report.get("meta"):
        lines += [f"Setup: {json.dumps(report['meta'])}", ""]
    lines += [
        "| method | rate (req/s) | sent | ok | errors | TTFT p50 (ms) | TTFT p95 (ms) | latency p50 (ms) "
        "| throughput (req/s) | throughput (tok/s) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in report["cells"]:
        errors = ", ".join(f"{k}: {v}" for k, v in c["errors"].items()) or "0"
        lines.append(f"| {c['label']} | {c['rate']:g} | {c['sent']} | {c['ok']} | {errors} | {c['ttft_ms_p50']} | "
                     f"{c['ttft_ms_p95']} | {c['latency_ms_p50']} | {c['throughput_rps']} | {c['throughput_tok_s']} |")
    return "\n".join(lines) + "\n"


def plot_report(report: dict[str, Any], path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    labels = list(dict.fromkeys(c["label"] for c in report["cells"]))
    for label in labels:
        cells = [c for c in report["cells"] if c["label"] == label and c["ttft_ms_p50"] is not None]
        if not cells:
            continue
        rates = [c["rate"] for c in cells]
        (line,) = ax1.plot(rates, [c["ttft_ms_p50"] for c in cells], marker="o", label=f"{label} p50")
        ax1.plot(rates, [c["ttft_ms_p95"] for c in cells], marker="x", linestyle="--", color=line.get_color(),
                 label=f"{label} p95")
        ax2.plot(rates, [c["throughput_tok_s"] for c in cells], marker="o", color=line.get_color(), label=label)
    ax1.set_xlabel("request rate (req/s)")
    ax1.set_ylabel("TTFT (ms)")
    ax1.set_title("Time to first token")
    ax1.legend(fontsize=7)
    ax2.set_xlabel("request rate (req/s)")
    ax2.set_ylabel("generated tokens / s")
    ax2.set_title("Throughput")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    atomic_write_with(path, lambda tmp: fig.savefig(tmp, format="png", dpi=120))
    plt.close(fig)


def write_report(report: dict[str, Any], out_dir: str | Path) -> dict[str, Path]:
    """``loadtest.json``, ``loadtest.md`` and ``loadtest.png`` under ``out_dir``, each written atomically."""
    out = Path(out_dir)
    paths = {"json": out / "loadtest.json", "md": out / "loadtest.md", "png": out / "loadtest.png"}
    write_json_atomic(paths["json"], report)
    atomic_write(paths["md"], render_markdown(report))
    plot_report(report, paths["png"])
    return paths
