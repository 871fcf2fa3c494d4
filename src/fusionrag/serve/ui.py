"""``GET /ui``: one self-contained page to try the server by hand.

Ask a question, pick the method and the recompute ratio, and see the answer, the TTFT
breakdown and which context tokens were recomputed (the ``/v1/explain`` page of that
answer, inlined). It calls the same ``/v1/chat/completions`` as any client; no external
scripts or styles. ``/ui?q=...&method=...&ratio=...`` asks at once (for links and for the
browser test).
"""

from __future__ import annotations

import html

_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>fusionrag</title>
<style>
body{font-family:system-ui,sans-serif;max-width:62rem;margin:1.5rem auto;padding:0 1rem;color:#222;line-height:1.45}
h1{font-size:1.4rem;margin:.2rem 0 1rem} form{display:grid;grid-template-columns:1fr auto auto auto auto;gap:.5rem}
textarea{grid-column:1/-1;font:inherit;padding:.5rem;min-height:3.2rem}
select,input,button{font:inherit;padding:.35rem .5rem} button{background:#1c7ed6;color:#fff;border:0;border-radius:4px}
#status{color:#555;margin:.6rem 0} #answer{font-size:1.15rem;background:#f1f3f5;padding:.6rem .8rem;border-radius:6px}
table{border-collapse:collapse;margin:.6rem 0} td,th{border:1px solid #dee2e6;padding:.2rem .6rem;text-align:right}
th{background:#f8f9fa} .chunk{border:1px solid #ddd;border-radius:6px;padding:.5rem .8rem;margin:.6rem 0}
.chunk h2{font-size:.95rem;margin:.1rem 0 .3rem} .meta{color:#555;font-size:.85rem}
.bar{height:6px;background:#eee;border-radius:3px} .bar div{height:6px;background:#d9480f;border-radius:3px}
mark{background:#ffd8a8;padding:0;border-radius:2px} .tok{white-space:pre-wrap}
</style></head><body>
<h1>fusionrag</h1>
<form id="ask">
  <textarea id="q" placeholder="Ask a question about the knowledge store"></textarea>
  <label>method <select id="method">__OPTIONS__</select></label>
  <label>ratio <input id="ratio" list="ratios" size="6" value="__RATIO__"
    title="a share of the context to recompute (0 to 1), or auto: as much as the question needs"></label>
  <datalist id="ratios"><option>auto</option><option>0.05</option><option>0.15</option><option>0.3</option>
    <option>1</option></datalist>
  <label>retrieval_top_k <input id="topk" type="number" min="1" max="32" value="5"></label>
  <input id="key" type="password" placeholder="API key"__KEYSTYLE__>
  <button type="submit">Ask</button>
</form>
<div id="status">ready</div>
<div id="answer"></div>
<div id="ttft"></div>
<div id="explain"></div>
<script>
const $ = (id) => document.getElementById(id);
const esc = (s) => String(s).replace(/[&<>"]/g, (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"}[c]));
// empty: the server's default; a number as a number; anything else ("auto", a typo) as typed, for the server to
// take ("auto": it sizes each request's recompute) or refuse with its message
const ratioOf = (v) => v.trim() === "" ? undefined : Number.isFinite(Number(v)) ? Number(v) : v.trim();
async function ask(ev) {
  if (ev) ev.preventDefault();
  const headers = {"Content-Type": "application/json"};
  if ($("key").value) headers["Authorization"] = "Bearer " + $("key").value;
  const body = {messages: [{role: "user", content: $("q").value}], method: $("method").value,
                ratio: ratioOf($("ratio").value), retrieval_top_k: parseInt($("topk").value, 10), max_tokens: 32};
  $("status").textContent = "asking...";
  $("answer").textContent = ""; $("ttft").innerHTML = ""; $("explain").innerHTML = "";
  const t0 = performance.now();
  try {
    const r = await fetch("/v1/chat/completions", {method: "POST", headers, body: JSON.stringify(body)});
    const out = await r.json();
    if (!r.ok) { $("status").textContent = "error: " + out.error.message; return; }
    const fr = out.fusionrag;
    $("answer").textContent = out.choices[0].message.content || "(empty answer)";
    // auto: the share chosen (none when the whole context came from an earlier request: no selection ran)
    const ratio = fr.auto_ratio && typeof fr.ratio === "number" ? `${fr.ratio.toFixed(3)} (auto)` : fr.ratio;
    $("status").textContent = `${fr.method} on ${fr.kv} KV, ratio ${ratio}: ${fr.recomputed_tokens} of ` +
      `${fr.context_tokens} context tokens recomputed; ${Math.round(performance.now() - t0)} ms in the browser`;
    const rows = Object.entries(fr.ttft_ms).map(([k, v]) => `<tr><th>${esc(k)}</th><td>${v.toFixed(1)} ms</td></tr>`);
    rows.push(`<tr><th>queue</th><td>${fr.server.queue_ms.toFixed(1)} ms</td></tr>`);
    $("ttft").innerHTML = "<table id='ttft-table'><caption>time to first token</caption>" + rows.join("") +
      "</table>";
    const page = await fetch("/v1/explain/" + fr.request_id, {headers});
    if (page.ok) {
      const doc = new DOMParser().parseFromString(await page.text(), "text/html");
      doc.querySelectorAll(".chunk").forEach((c) => $("explain").appendChild(document.importNode(c, true)));
    }
  } catch (e) { $("status").textContent = "error: " + e; }
}
$("ask").addEventListener("submit", ask);
const params = new URLSearchParams(location.search);
if (params.get("method")) $("method").value = params.get("method");
if (params.get("ratio")) $("ratio").value = params.get("ratio");
if (params.get("retrieval_top_k")) $("topk").value = params.get("retrieval_top_k");
if (params.get("q")) { $("q").value = params.get("q"); ask(); }
</script>
</body></html>
"""


def ui_page(methods: list[str], default_method: str, default_ratio: float | str, needs_key: bool) -> str:
    """The page, with the server's methods and defaults filled in (the ratio: a number, or ``auto``)."""
    options = "".join(f"<option{' selected' if m == default_method else ''}>{html.escape(m)}</option>"
                      for m in methods)
    return (_PAGE.replace("__OPTIONS__", options).replace("__RATIO__", html.escape(str(default_ratio)))
            .replace("__KEYSTYLE__", "" if needs_key else " hidden"))
