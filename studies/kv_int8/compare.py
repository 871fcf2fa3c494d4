"""fp16 vs int8 KV storage: store sizes (with and without plain KV) and fidelity, paired by question.

Reads two ``bench quality`` folders that evaluated the same questions with the same cells, one
on an fp16 store and one on an int8 store (``--kv-dtype int8``), and writes
``studies/kv_int8/results/summary/results.{json,md}``: per cell the int8 minus fp16 difference of each
fidelity metric (agreement F1 with Full Attention, first-token KL, top-1 agreement) and of
answer F1, with the harness's paired bootstrap over questions (``metrics.bootstrap_diff_ci``),
and the bytes of each store by kind. The fused-only size is measured on a copy with its plain
KV dropped (``offline.compact.drop_plain``).

    .venv/bin/python studies/kv_int8/compare.py --fp16 studies/kv_int8/results/fp16 \\
        --int8 studies/kv_int8/results/int8 --fp16-store S16 --int8-store S8 --out studies/kv_int8/results/summary
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

from fusionrag.bench import metrics
from fusionrag.bench.records import read_records
from fusionrag.retrieval.store_info import store_info

METRICS = ("agree_f1", "kl_first", "top1_agree", "f1")


def sizes(store: Path) -> dict:
    """Bytes by kind, per chunk token, and the same store with its plain KV dropped (measured on a copy)."""
    info = store_info(store)
    n_tok = info["chunk_tokens_total"]
    other = info["bytes_on_disk"] - info["plain_kv_bytes"] - info["fused_kv_bytes"]
    with tempfile.TemporaryDirectory(dir=store.parent) as tmp:
        copy = Path(tmp) / store.name
        shutil.copytree(store, copy)
        for p in (copy / "kv").glob("*/*.plain.safetensors"):
            if p.with_name(p.name.replace(".plain.", ".fused.")).is_file():
                p.unlink()
        fused_only = store_info(copy)["bytes_on_disk"]
    return {
        "kv_dtype": info["settings"]["kv_dtype"], "chunks": info["chunks"], "chunk_tokens": n_tok,
        "plain_kv_bytes": info["plain_kv_bytes"], "fused_kv_bytes": info["fused_kv_bytes"],
        "other_bytes": other, "bytes_on_disk": info["bytes_on_disk"], "fused_only_bytes_on_disk": fused_only,
        "plain_bytes_per_token": round(info["plain_kv_bytes"] / n_tok, 1),
        "fused_bytes_per_token": round(info["fused_kv_bytes"] / n_tok, 1),
    }


def paired(fp16: dict, int8: dict) -> list[dict]:
    """int8 minus fp16 per cell (method, kv, ratio), over the questions both answered."""
    cells: dict[tuple, dict[str, tuple[dict, dict]]] = defaultdict(dict)
    for (ds, qid, run), r16 in fp16.items():
        r8 = int8.get((ds, qid, run))
        if r8 is not None and r16["method"] != "full":
            cells[(ds, r16["method"], r16["kv"], r16["ratio"])][qid] = (r16, r8)
    rows = []
    for (ds, method, kv, ratio), pairs in sorted(cells.items(), key=str):
        row = {"dataset": ds, "method": method, "kv": kv, "ratio": ratio, "n": len(pairs)}
        for m in METRICS:
            a = [p[1].get(m) for p in pairs.values()]
            b = [p[0].get(m) for p in pairs.values()]
            diff, lo, hi = metrics.bootstrap_diff_ci(a, b)
            row[f"{m}_fp16"] = round(sum(b) / len(b), 4)
            row[f"{m}_int8"] = round(sum(a) / len(a), 4)
            row[f"{m}_diff"], row[f"{m}_diff_ci"] = round(diff, 4), [round(lo, 4), round(hi, 4)]
            row[f"{m}_resolved"] = not (lo <= 0.0 <= hi)
        rows.append(row)
    return rows


def markdown(res: dict) -> str:
    s16, s8 = res["sizes"]["float16"], res["sizes"]["int8"]
    mb = 1 << 20
    title = res.get("title", "fp16 vs int8 KV storage")
    lines = [f"# {title}", "", "Commands:", "", *[f"    {c}" for c in res["commands"]], "",
             "## Store size (TriviaQA 50-question knowledge base, qwen2.5-0.5b)", "",
             "| store | plain KV | fused KV | plain B/token | fused B/token | on disk | fused-only on disk |",
             "|---|---|---|---|---|---|---|"]
    for s in (s16, s8):
        lines.append(f"| {s['kv_dtype']} | {s['plain_kv_bytes'] / mb:.1f} MiB | {s['fused_kv_bytes'] / mb:.1f} MiB | "
                     f"{s['plain_bytes_per_token']:,} | {s['fused_bytes_per_token']:,} | "
                     f"{s['bytes_on_disk'] / mb:.1f} MiB | {s['fused_only_bytes_on_disk'] / mb:.1f} MiB |")
    r = res["ratios"]
    lines += ["", f"- int8 vs fp16, plain KV bytes: {r['plain_kv']:.2f}x smaller; whole store: {r['store']:.2f}x.",
              "- fused-only int8 vs today's fp16 plain + fused store (on disk): "
              f"{r['fused_only_int8_vs_fp16_store']:.2f}x smaller.", "",
              "## Fidelity, int8 minus fp16, paired by question (95% bootstrap over questions)", "",
              "| cell | n | agree F1 (fp16 -> int8) | diff [CI] | first-token KL | diff [CI] | top-1 | diff [CI] | "
              "answer F1 diff [CI] |", "|---|---|---|---|---|---|---|---|---|"]
    for c in res["paired"]:
        name = f"{c['method']} on {c['kv']} KV" + (f" at {c['ratio']:.0%}" if c["ratio"] else "")

        def d(m, c=c):
            lo, hi = c[f"{m}_diff_ci"]
            return f"{c[f'{m}_diff']:+.3f} [{lo:+.3f}, {hi:+.3f}]" + (" *" if c[f"{m}_resolved"] else "")

        lines.append(f"| {name} | {c['n']} | {c['agree_f1_fp16']:.3f} -> {c['agree_f1_int8']:.3f} | {d('agree_f1')} | "
                     f"{c['kl_first_fp16']:.4f} -> {c['kl_first_int8']:.4f} | {d('kl_first')} | "
                     f"{c['top1_agree_fp16']:.3f} -> {c['top1_agree_int8']:.3f} | {d('top1_agree')} | {d('f1')} |")
    lines += ["", "`*`: the paired interval excludes 0 (a resolved difference).", ""]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fp16", required=True, help="bench quality folder of the fp16 run")
    ap.add_argument("--int8", required=True, help="bench quality folder of the int8 run")
    ap.add_argument("--fp16-store", required=True)
    ap.add_argument("--int8-store", required=True)
    ap.add_argument("--out", default="studies/kv_int8/results/summary")
    ap.add_argument("--title", default="fp16 vs int8 KV storage", help="the report's heading")
    ap.add_argument("--command", action="append", default=[], help="the commands that made the runs (for the report)")
    args = ap.parse_args()
    s16, s8 = sizes(Path(args.fp16_store)), sizes(Path(args.int8_store))
    res = {
        "title": args.title,
        "commands": [*args.command, " ".join([".venv/bin/python", *sys.argv])],
        "sizes": {"float16": s16, "int8": s8},
        "ratios": {"plain_kv": s16["plain_kv_bytes"] / s8["plain_kv_bytes"],
                   "fused_kv": s16["fused_kv_bytes"] / s8["fused_kv_bytes"],
                   "store": s16["bytes_on_disk"] / s8["bytes_on_disk"],
                   "fused_only_int8_vs_fp16_store": s16["bytes_on_disk"] / s8["fused_only_bytes_on_disk"]},
        "paired": paired(read_records(Path(args.fp16) / "records.jsonl"),
                         read_records(Path(args.int8) / "records.jsonl")),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=2) + "\n")
    (out / "results.md").write_text(markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
