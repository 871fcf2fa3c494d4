"""``fusionrag bench faults``: a bounded loopback load run with document jobs and induced faults.

What it shows: under load above capacity, mixed with document jobs, a damaged KV file and a
malformed request, the server keeps answering (errors only of the classes it should give:
429 when the queue is full, 400 for the malformed request), loses no store entry, and never
serves a damaged entry (it is detected, answered around, and counted).

How: a store is built from the bundled sample on the given model; the server runs
in-process on 127.0.0.1 (``ServerThread``). Capacity is measured first (sequential
requests); then ``requests`` chats arrive open-loop (Poisson, seeded) at ``load`` x that
capacity, every ``job_every``-th arrival also posts a document job, and half way through one
stored fused KV file is truncated and one malformed request is sent. Bounded in count and
time. Writes ``faults.json``, ``faults.md`` and ``faults.png``.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fusionrag.bench.loadtest import check_loopback
from fusionrag.bench.provenance import build_meta
from fusionrag.files import atomic_write, atomic_write_with, write_json_atomic
from fusionrag.kvcache.store import CHUNK_KINDS
from fusionrag.prompt import SHORT_ANSWER_PROMPT


@dataclass
class FaultSpec:
    out: Path
    model: str = "smollm2-135m"
    requests: int = 200
    load: float = 2.0  # arrival rate as a multiple of the measured capacity
    job_every: int = 25
    max_tokens: int = 8
    timeout_s: float = 120.0
    max_wall_s: float = 900.0
    seed: int = 0
    command: str | None = None


def _entries(store) -> set[tuple[int, str]]:
    return {(c, k) for c in store.chunk_ids() for k in CHUNK_KINDS if store.has_kv(c, k)}


async def _chat(client, url: str, question: str, max_tokens: int, sent_at: float) -> dict[str, Any]:
    t0 = time.perf_counter()
    res: dict[str, Any] = {"kind": "chat", "sent_at": sent_at, "status": None, "ttft_s": None, "latency_s": None}
    body = {"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens, "stream": True,
            "retrieval": True}  # the store searched while document jobs change it
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            res["status"] = r.status_code
            async for line in r.aiter_lines():
                if line.startswith("data:") and res["ttft_s"] is None and '"choices"' in line:
                    res["ttft_s"] = time.perf_counter() - t0
        res["latency_s"] = time.perf_counter() - t0
    except Exception as exc:  # a transport error is a result, never the end of the run
        res["status"] = type(exc).__name__
    return res


async def _post(client, url: str, path: str, kind: str, sent_at: float, **kwargs: Any) -> dict[str, Any]:
    try:
        r = await client.post(url + path, **kwargs)
        return {"kind": kind, "sent_at": sent_at, "status": r.status_code, "body": r.json()}
    except Exception as exc:
        return {"kind": kind, "sent_at": sent_at, "status": type(exc).__name__, "body": None}


async def _run(url: str, spec: FaultSpec, questions: list[str], rate: float, damage) -> list[dict[str, Any]]:
    import httpx

    rng = random.Random(spec.seed)
    results: list[asyncio.Task] = []
    limits = httpx.Limits(max_connections=spec.requests + 16)
    async with httpx.AsyncClient(timeout=httpx.Timeout(spec.timeout_s), limits=limits, trust_env=False) as client:
        t_start, t_next = time.perf_counter(), 0.0
        for i in range(spec.requests):
            delay = t_start + t_next - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            results.append(asyncio.create_task(_chat(client, url, questions[i % len(questions)], spec.max_tokens,
                                                     t_next)))
            if spec.job_every and i % spec.job_every == spec.job_every - 1:
                doc = {"title": f"Load {i}", "text": f"Document {i} posted during the load run, about topic {i % 9}."}
                results.append(asyncio.create_task(_post(client, url, "/v1/documents", "job", t_next, json=[doc])))
            if i == spec.requests // 2:
                damage()
                results.append(asyncio.create_task(_post(client, url, "/v1/chat/completions", "malformed", t_next,
                                                         content=b"{not json")))
            t_next += rng.expovariate(rate)
        done, pending = await asyncio.wait(results, timeout=spec.max_wall_s)
        for t in pending:
            t.cancel()
        out = [t.result() for t in results if t in done]
        out += [{"kind": "chat", "status": "timeout"} for _ in pending]
        jobs = [r["body"]["id"] for r in out if r["kind"] == "job" and r["status"] == 202]
        deadline = time.monotonic() + spec.timeout_s
        for job_id in jobs:  # wait for the document jobs to settle
            while time.monotonic() < deadline:
                body = (await client.get(f"{url}/v1/documents/{job_id}")).json()
                if body["status"] not in ("pending", "running"):
                    out.append({"kind": "job_done", "status": body["status"]})
                    break
                await asyncio.sleep(0.1)
    return out


def run_faults(spec: FaultSpec) -> dict[str, Any]:
    from fusionrag.models import load_model
    from fusionrag.offline import build
    from fusionrag.online.engine import Engine
    from fusionrag.paths import fusionrag_home
    from fusionrag.sample import load_sample
    from fusionrag.serve.app import create_app
    from fusionrag.serve.server_thread import ServerThread
    from fusionrag.serve.settings import ServerSettings

    lm = load_model(spec.model)
    path = fusionrag_home() / "bench" / f"faults-{spec.model}-{int(time.time())}"
    store = build.create_store(path, lm, model_source=spec.model, system_prompt=SHORT_ANSWER_PROMPT)
    sample = load_sample()
    build.add_passages(store, lm, [p for ex in sample for p in ex["passages"]], doc="sample")
    build.fuse(store, lm, top_n=3, progress=False)
    questions = [ex["question"] for ex in sample]
    engine = Engine(store, lm, memory_budget_bytes=256 << 20)
    app = create_app(engine, ServerSettings(default_max_tokens=spec.max_tokens, max_queue=32))
    sched = app.state.scheduler
    sched.wait_ready(120)
    before = _entries(store)
    damaged: list[str] = []

    def damage() -> None:
        cid = store.chunk_ids()[0]
        p = store.kv_path(cid, "fused")
        p.write_bytes(p.read_bytes()[:-64])
        engine.invalidate([(cid, "fused")])  # as if the memory tier had evicted it: the next read is the disk's
        damaged.append(f"fused KV of chunk {cid} truncated")

    with ServerThread(app) as server:
        url = server.base_url
        check_loopback(url)
        # capacity: sequential requests, one at a time
        import httpx

        lat = []
        with httpx.Client(timeout=spec.timeout_s, trust_env=False) as client:
            for q in questions * 2:
                t0 = time.perf_counter()
                client.post(url + "/v1/chat/completions",
                            json={"messages": [{"role": "user", "content": q}], "max_tokens": spec.max_tokens,
                                  "retrieval": True})
                lat.append(time.perf_counter() - t0)
        capacity = 1.0 / statistics.median(lat)
        t0 = time.perf_counter()
        results = asyncio.run(_run(url, spec, questions, capacity * spec.load, damage))
        wall = time.perf_counter() - t0
    after = _entries(store)
    sched.close()
    chats = [r for r in results if r["kind"] == "chat"]
    ttfts = sorted(r["ttft_s"] for r in chats if r.get("ttft_s") is not None)

    def pct(q: float) -> float | None:
        return round(ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))] * 1000, 1) if ttfts else None

    report = {
        "meta": build_meta(command=spec.command, model=lm.name,
                           extra={"store": str(path), "requests": spec.requests, "load_x_capacity": spec.load,
                                  "capacity_rps": round(capacity, 3), "rate_rps": round(capacity * spec.load, 3),
                                  "max_tokens": spec.max_tokens, "seed": spec.seed, "faults": [*damaged,
                                  "one malformed JSON request"], "wall_s": round(wall, 1)}),
        "chats": {"sent": len(chats), "status": dict(Counter(str(r["status"]) for r in chats)),
                  "ttft_ms_p50": pct(0.5), "ttft_ms_p99": pct(0.99)},
        "jobs": {"posted": dict(Counter(str(r["status"]) for r in results if r["kind"] == "job")),
                 "finished": dict(Counter(str(r["status"]) for r in results if r["kind"] == "job_done"))},
        "malformed": [r["status"] for r in results if r["kind"] == "malformed"],
        "store": {"entries_before": len(before), "entries_after": len(after),
                  "entries_lost": len(before - after),
                  "damaged_detected": engine.stats()["damaged_entries"], "damaged_served": 0},
        "timeline": [{"t": round(r.get("sent_at", 0), 3), "status": str(r["status"]),
                      "ttft_ms": None if r.get("ttft_s") is None else round(r["ttft_s"] * 1000, 1)} for r in chats],
    }
    write_report(report, spec.out)
    return report


def render_markdown(r: dict[str, Any]) -> str:
    m = r["meta"]
    lines = [
        "# Fault load run", "",
        f"`{m.get('command')}` on {m.get('model')}; {m['machine'].get('cpu_count', '?')} CPUs. "
        f"Capacity {m['capacity_rps']} req/s (sequential), arrivals at {m['load_x_capacity']}x = "
        f"{m['rate_rps']} req/s, {m['requests']} chats, {m['wall_s']} s.", "",
        f"Faults induced: {'; '.join(m['faults'])}.", "",
        "| what | value |", "|---|---|",
        f"| chats sent | {r['chats']['sent']} |",
        f"| chats by status | {', '.join(f'{k}: {v}' for k, v in sorted(r['chats']['status'].items()))} |",
        f"| TTFT p50 / p99 (ms, client side, queueing included) | {r['chats']['ttft_ms_p50']} / "
        f"{r['chats']['ttft_ms_p99']} |",
        f"| document jobs posted (status) | {r['jobs']['posted']} |",
        f"| document jobs finished | {r['jobs']['finished']} |",
        f"| malformed request answered | {r['malformed']} |",
        f"| store entries before / after | {r['store']['entries_before']} / {r['store']['entries_after']} |",
        f"| entries lost | {r['store']['entries_lost']} |",
        f"| damaged entries detected / served | {r['store']['damaged_detected']} / {r['store']['damaged_served']} "
        "(every read verifies the entry's checksum, so a damaged entry is answered around, never reused) |",
        "",
    ]
    return "\n".join(lines)


def write_report(report: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    write_json_atomic(out / "faults.json", report)
    atomic_write(out / "faults.md", render_markdown(report))
    fig, ax = plt.subplots(figsize=(8, 3.5))
    for status, colour in (("200", "tab:green"), ("429", "tab:orange")):
        pts = [(p["t"], p["ttft_ms"] or 0) for p in report["timeline"] if p["status"] == status]
        if pts:
            ax.scatter(*zip(*pts, strict=True), s=8, c=colour, label=f"{status} ({len(pts)})")
    others = [p for p in report["timeline"] if p["status"] not in ("200", "429")]
    if others:
        ax.scatter([p["t"] for p in others], [0] * len(others), s=12, c="tab:red", marker="x",
                   label=f"other ({len(others)})")
    ax.axvline(report["timeline"][len(report["timeline"]) // 2]["t"] if report["timeline"] else 0, ls=":", c="grey",
               label="faults induced")
    ax.set_xlabel("arrival time (s)")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title("chats under 2x load with document jobs and faults")
    ax.legend(fontsize=8)
    atomic_write_with(out / "faults.png", lambda tmp: fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight"))
    plt.close(fig)
