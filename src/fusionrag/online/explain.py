"""``--explain FILE.html``: where the selection looked, as a self-contained page.

Each retrieved chunk is shown with its recomputed tokens highlighted, plus the share of
the selection that fell in each chunk. Plain HTML and inline CSS: no scripts, no
network, safe to attach to a bug report.
"""

from __future__ import annotations

import html
from pathlib import Path

import torch

from fusionrag.files import atomic_write
from fusionrag.online.auto_ratio import describe
from fusionrag.online.state import Request

_CSS = """
body{font-family:system-ui,sans-serif;max-width:60rem;margin:2rem auto;line-height:1.5;color:#222}
h1{font-size:1.3rem} .meta{color:#555;font-size:.9rem}
.chunk{border:1px solid #ddd;border-radius:6px;padding:.6rem .8rem;margin:.8rem 0}
.chunk h2{font-size:1rem;margin:.1rem 0 .4rem} .bar{height:6px;background:#eee;border-radius:3px}
.bar div{height:6px;background:#d9480f;border-radius:3px}
mark{background:#ffd8a8;padding:0;border-radius:2px} .tok{white-space:pre-wrap}
"""


def render_explain_html(answer: Request, question: str, tokenizer, token_ids: list[list[int]]) -> str:
    """HTML for one answer; ``token_ids`` are the chunks' token ids in prompt order."""
    selected = set((answer.selected if answer.selected is not None else torch.empty(0)).tolist())
    total_sel = max(1, len(selected))
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>fusionrag explain</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>{html.escape(question)}</h1>",
        f"<p><b>Answer:</b> {html.escape(answer.text)}</p>",
        f"<p class='meta'>method <b>{html.escape(answer.method)}</b> on {html.escape(answer.kv)} KV, "
        f"ratio {describe(answer.ratio, answer.auto_ratio)}: {answer.recomputed_tokens} of {answer.context_tokens} "
        f"context tokens "
        f"recomputed; TTFT {answer.ttft_ms.get('total', 0):.0f} ms</p>",
    ]
    for i, ((start, stop), ids) in enumerate(zip(answer.spans, token_ids, strict=True)):
        chosen = [start + j in selected for j in range(stop - start)]
        share = sum(chosen) / total_sel
        title = answer.passages[i].get("title", "") if i < len(answer.passages) else ""
        cid = answer.chunk_ids[i] if i < len(answer.chunk_ids) else None
        parts.append("<div class='chunk'>")
        parts.append(
            f"<h2>#{i + 1} {html.escape(title or '(untitled)')} <span class='meta'>chunk "
            f"{cid if cid is not None else 'request-supplied'} · {sum(chosen)}/{stop - start} tokens · "
            f"{share:.0%} of the selection</span></h2>"
        )
        parts.append(f"<div class='bar'><div style='width:{share * 100:.1f}%'></div></div><p class='tok'>")
        for tid, hit in zip(ids, chosen, strict=True):
            piece = html.escape(tokenizer.decode([tid]))
            parts.append(f"<mark>{piece}</mark>" if hit else piece)
        parts.append("</p></div>")
    parts.append("</body></html>")
    return "".join(parts)


def write_explain(path: str | Path, content: str) -> Path:
    """Write atomically (temp file + rename) so a crash never leaves half a page."""
    return atomic_write(path, content)
