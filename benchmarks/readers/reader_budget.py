"""Reader budgets: every format read at its size limit, the worst shapes included, in a fresh process each.

For each format the script writes files just under that format's size limit
(``fusionrag.retrieval.readers.max_file_bytes``) in shapes that stress its reader (plain prose, many tiny
sections, deep nesting, many pages, a compressed bomb), reads each with ``read_passages`` in a child
process and records the wall time and the child's peak RSS above its RSS after the imports. The target:
every file under 10 s and 500 MB. A file over the limit is refused before it is read (the tests check
that); this measures what the limit lets through.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/readers/reader_budget.py --out benchmarks/readers/results
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import zipfile
import zlib
from pathlib import Path

from fusionrag.files import atomic_write, atomic_write_with
from fusionrag.retrieval.formats import DOCX_MAX_XML, PDF_MAX_CONTENT
from fusionrag.retrieval.readers import max_file_bytes

BUDGET_S = 10.0
BUDGET_MB = 500.0
SENTENCE = ("the river valley holds an old stone bridge built by the town in seventeen ninety and repaired after "
            "each flood by people who lived along the water and kept its records in the parish book")
WORDS = SENTENCE.split()


def _prose(n_bytes: int, seed: int = 0) -> str:
    """Sentences of ordinary words, about ``n_bytes`` long."""
    out, size, i = [], 0, seed
    while size < n_bytes:
        words = [WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(12 + i % 9)]
        line = " ".join(words).capitalize() + ". "
        out.append(line)
        size += len(line)
        i += 1
        if i % 8 == 0:
            out.append("\n\n")
    return "".join(out)[:n_bytes]


def _fill(unit: str, limit: int) -> str:
    return unit * max(1, (limit - 200) // len(unit.encode()))


# ---------------------------------------------------------------- the shapes, each (name, suffix, bytes)


def text_files() -> list[tuple[str, str, bytes]]:
    txt, md, jsonl = max_file_bytes(".txt"), max_file_bytes(".md"), max_file_bytes(".jsonl")
    return [("txt prose", ".txt", _prose(txt - 64).encode()),
            ("txt one line, no spaces", ".txt", b"x" * (txt - 64)),
            ("md prose sections", ".md", "".join(f"# Part {i}\n{p}\n\n" for i, p in
                                                 enumerate(_prose(md - 65536).split("\n\n"))).encode()[: md - 64]),
            ("md many tiny sections", ".md", _fill("# Heading\nA short line of text.\n\n", md).encode()),
            ("jsonl prose lines", ".jsonl", "".join(json.dumps({"title": f"t{i}", "text": p}) + "\n" for i, p in
                                                    enumerate(_prose(jsonl * 15 // 16).split("\n\n"))).encode()),
            ("jsonl many tiny lines", ".jsonl", _fill(json.dumps({"title": "t", "text": "a short passage"}) + "\n",
                                                      jsonl).encode())]


def html_files() -> list[tuple[str, str, bytes]]:
    limit = max_file_bytes(".html")
    body = _prose(limit - 4096)
    wide = "".join(f"<h2>Part {i}</h2><p>{para}</p>" for i, para in enumerate(body.split("\n\n")))
    depth = (limit - 1024) // len("<div></div>")
    return [("html prose sections", ".html", f"<html><title>t</title><body>{wide}</body></html>".encode()[:limit]),
            ("html deep nesting", ".html", f"<html><body>{'<div>' * depth}deep{'</div>' * depth}</body></html>"
             .encode()),
            ("html tiny tags", ".html", ("<html><body>" + _fill("<b>a</b> ", limit - 64) + "</body></html>").encode())]


def _docx(paragraphs: str, compress: bool) -> bytes:
    w = "http://schemas.openxmlformats.org/wordprocessingml/2006/main"
    xml = f'<?xml version="1.0"?><w:document xmlns:w="{w}"><w:body>{paragraphs}</w:body></w:document>'
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED) as z:
        z.writestr("word/document.xml", xml)
    return buf.getvalue()


def docx_files() -> list[tuple[str, str, bytes]]:
    limit = max_file_bytes(".docx")
    para = "<w:p><w:r><w:t>{}</w:t></w:r></w:p>"
    heading = '<w:p><w:pPr><w:pStyle w:val="Heading1"/></w:pPr><w:r><w:t>Part</w:t></w:r></w:p>'
    prose = _prose(limit * 7 // 8).split("\n\n")  # the paragraphs' markup is the rest
    stored = _docx("".join(para.format(p) for p in prose), compress=False)
    # the most XML the reader takes (DOCX_MAX_XML), deflated: near-identical paragraphs compress ~100x
    unit = heading + para.format("a short line")
    bomb = _docx(unit * ((DOCX_MAX_XML - 4096) // len(unit)), compress=True)
    return [("docx prose (stored)", ".docx", stored), ("docx deflated sections", ".docx", bomb)]


def _pdf(pages: list[bytes], compress: bool) -> bytes:
    """A minimal valid PDF: one content stream per page with Helvetica text."""
    objs: list[bytes] = [b"<< /Type /Catalog /Pages 2 0 R >>", b"", b"<< /Type /Font /Subtype /Type1 "
                         b"/BaseFont /Helvetica >>"]
    kids = []
    for content in pages:
        data = zlib.compress(content, 6) if compress else content
        extra = b" /Filter /FlateDecode" if compress else b""
        objs.append(b"<< /Length %d%s >>\nstream\n%s\nendstream" % (len(data), extra, data))
        objs.append(b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Resources << /Font << /F1 3 0 R >> >> "
                    b"/Contents %d 0 R >>" % (len(objs)))
        kids.append(len(objs))
    objs[1] = b"<< /Type /Pages /Kids [%s] /Count %d >>" % (b" ".join(b"%d 0 R" % k for k in kids), len(kids))
    out = io.BytesIO()
    out.write(b"%PDF-1.4\n")
    offsets = []
    for i, body in enumerate(objs, 1):
        offsets.append(out.tell())
        out.write(b"%d 0 obj\n%s\nendobj\n" % (i, body))
    xref = out.tell()
    out.write(b"xref\n0 %d\n0000000000 65535 f \n" % (len(objs) + 1))
    out.write(b"".join(b"%010d 00000 n \n" % off for off in offsets))
    out.write(b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objs) + 1, xref))
    return out.getvalue()


def _page(lines: list[str]) -> bytes:
    ops = [b"BT /F1 10 Tf 40 760 Td 12 TL"]
    ops += [b"(%s) '" % line.replace("(", "").replace(")", "").encode() for line in lines]
    return b"\n".join([*ops, b"ET"])


def pdf_files() -> list[tuple[str, str, bytes]]:
    """The most text the PDF reader takes (PDF_MAX_CONTENT of page content), a file at the size limit whose
    content is over that (refused before extraction), the most pages at the size limit, an inflating page."""
    limit = max_file_bytes(".pdf")
    text = _prose(limit).replace("\n", " ")
    lines = [text[i:i + 90] for i in range(0, len(text), 90)]

    def pages(n: int, per_page: int = 60) -> list[bytes]:
        return [_page(lines[(i * per_page) % max(1, len(lines) - per_page):][:per_page]) for i in range(n)]

    def at_most(make, n: int) -> bytes:  # the largest file make(n) at the size limit
        data = make(n)
        while len(data) > limit:
            n = int(n * limit / len(data) * 0.995)
            data = make(n)
        return data

    page_size = len(_page(lines[:60]))
    at_budget = _pdf(pages((PDF_MAX_CONTENT - 65536) // page_size), compress=True)
    at_limit = at_most(lambda n: _pdf(pages(n, 300), compress=False), limit // (page_size * 5))
    empty = at_most(lambda n: _pdf([b""] * n, compress=False), limit // 200)
    big = _page(lines[: max(1, len(lines) // 4)] * 40)
    bomb = _pdf([big], compress=True)
    while len(bomb) > limit:
        big = big[: len(big) * 3 // 4]
        bomb = _pdf([big], compress=True)
    return [("pdf text pages at the content budget", ".pdf", at_budget),
            ("pdf text pages at the size limit", ".pdf", at_limit),
            ("pdf empty pages at the size limit", ".pdf", empty), ("pdf one inflating page", ".pdf", bomb)]


SHAPES = {"text": text_files, "html": html_files, "docx": docx_files, "pdf": pdf_files}

CHILD = r"""
import json, sys, time
from pathlib import Path
from fusionrag.retrieval.readers import read_passages
import bs4, pypdf  # the parsers' imports are not the reader's cost
def status_mb(field):  # VmHWM, not ru_maxrss: a child's ru_maxrss starts at its parent's RSS at the fork
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
base = status_mb("VmRSS")
problems = []
t0 = time.perf_counter()
passages = read_passages(Path(sys.argv[1]), problems)
wall = time.perf_counter() - t0
peak = status_mb("VmHWM")
print(json.dumps({"wall_s": wall, "rss_above_imports_mb": peak - base, "passages": len(passages),
                  "chars": sum(len(p.text) for p in passages), "problems": [p.message for p in problems]}))
"""


def measure(path: Path) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, str(path)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--formats", default=",".join(SHAPES), help="comma-separated: " + ", ".join(SHAPES))
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in args.formats.split(","):
            for name, suffix, data in SHAPES[fmt]():
                path = Path(tmp) / f"{name.replace(' ', '_').replace(',', '')}{suffix}"
                path.write_bytes(data)
                limit = max_file_bytes(suffix)
                row = {"shape": name, "suffix": suffix, "file_mb": len(data) / 2**20, "limit_mb": limit / 2**20,
                       **measure(path)}
                row["within_budget"] = ("error" not in row and row["wall_s"] < BUDGET_S
                                        and row["rss_above_imports_mb"] < BUDGET_MB)
                rows.append(row)
                print(json.dumps(row), flush=True)
                path.unlink()
    write_report(args.out, rows)


def write_report(out: Path, rows: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    import fusionrag

    record = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "fusionrag": fusionrag.__version__,
              "machine": {"cpu": _cpu(), "python": platform.python_version(), "cores": os.cpu_count()},
              "budget": {"wall_s": BUDGET_S, "rss_above_imports_mb": BUDGET_MB},
              "date": time.strftime("%Y-%m-%d"), "rows": rows}
    atomic_write(out / "reader_budget.json", json.dumps(record, indent=1) + "\n")
    lines = ["# Reader budgets", "", f"`{record['command']}` on {record['machine']['cpu']} ({record['date']}).",
             "Each file read by `read_passages` in a fresh process (one thread); RSS is the child's peak above its "
             f"RSS after the imports. Budget: under {BUDGET_S:.0f} s and {BUDGET_MB:.0f} MB.", "",
             "![time and memory per shape](reader_budget.png)", "",
             "| shape | file | format limit | read in | RSS above imports | passages | text read | within |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['file_mb']:.1f} MiB | {r['limit_mb']:.0f} MiB | error: {r['error']} "
                         "| | | | no |")
            continue
        said = f" ({r['problems'][0]})" if r["problems"] else ""
        lines.append(f"| {r['shape']} | {r['file_mb']:.1f} MiB | {r['limit_mb']:.0f} MiB | {r['wall_s']:.2f} s | "
                     f"{r['rss_above_imports_mb']:.0f} MB | {r['passages']:,} | {r['chars'] / 2**20:.1f} M chars"
                     f"{said} | {'yes' if r['within_budget'] else 'NO'} |")
    lines += ["", "A file over its format's limit is refused from its size alone, before a byte is read; a PDF over "
              "the pages or content budget before any text is extracted. Limits: `fusionrag.retrieval.readers` "
              "(`register_reader(..., max_mb=)`), `formats.DOCX_MAX_XML`, `formats.PDF_MAX_PAGES`, "
              "`formats.PDF_MAX_CONTENT`; `FUSIONRAG_MAX_FILE_MB` raises them all."]
    atomic_write(out / "README.md", "\n".join(lines) + "\n")
    plot(rows, out / "reader_budget.png", record)


def plot(rows: list[dict], path: Path, record: dict) -> None:
    """Two panels, one bar per shape: seconds to read, MB above the imports; the budgets as lines."""
    from fusionrag.bench.plots import require_matplotlib

    require_matplotlib()
    from matplotlib.figure import Figure

    ok = [r for r in rows if "error" not in r]
    names = [f"{r['shape']} ({r['file_mb']:.1f} MiB{', refused' if not r['passages'] else ''})" for r in ok]
    fig = Figure(figsize=(12, 0.35 * len(ok) + 2.2), layout="constrained")
    ax_t, ax_m = fig.subplots(1, 2, sharey=True)
    ys = range(len(ok))
    ax_t.barh(ys, [r["wall_s"] for r in ok], color="tab:blue")
    ax_m.barh(ys, [r["rss_above_imports_mb"] for r in ok], color="tab:orange")
    for ax, budget, label in ((ax_t, BUDGET_S, "seconds to read"), (ax_m, BUDGET_MB, "peak RSS above the imports, MB")):
        ax.axvline(budget, color="red", linestyle="--", label=f"budget {budget:.0f}")
        ax.set_xlabel(label)
        ax.grid(axis="x", alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    ax_t.set_yticks(list(ys), names, fontsize=8)
    ax_t.invert_yaxis()
    fig.suptitle(f"Each format read at its size limit, worst shapes, one process each ({record['machine']['cpu']})",
                 fontsize=10)
    atomic_write_with(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110))


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


if __name__ == "__main__":
    main()
