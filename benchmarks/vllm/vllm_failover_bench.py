"""Two vLLM replicas behind nginx, one store, the connector on both; one replica killed mid-run.

    .venv/bin/python benchmarks/vllm/vllm_failover_bench.py --out benchmarks/vllm/results/failover \\
        [--clients 8] [--duration 150] [--kill-after 50] [--max-requests 200]

Issue 49 item 4: "a replica killed mid-load loses no request that the others can serve; no home-made
router". Two independent vLLM OpenAI servers with fusionrag's connector (one thread each, one on core 0,
one on core 1) serve one store through a shared Redis tier (a real redis-server on loopback); a stock nginx
(Debian's package; ``scripts/setup.sh`` installs it) balances them (``least_conn``) and passes a request that
fails before any byte of its answer came back (the replica's connection refused or reset) to the other
replica (``proxy_next_upstream error timeout http_502 http_503 non_idempotent``). The requests of
``vllm_serve_bench.py`` (passages shuffled, closed loop); ``--kill-after`` seconds into each run the first
replica's processes are killed (SIGKILL: a crash, no drain). Two runs on fresh servers: non-streamed chat
completions (what nginx can retry whole), then streamed ones (a stream that has begun on the killed replica
cannot move: it ends without ``[DONE]``, and counts as failed). ``--scaling`` adds one replica and two with
nobody killed (streamed): the requests/s two replicas give. Per run: requests ok / failed, the failures'
kinds, TTFT p50/p99, requests/s before and after the kill. Writes ``failover.json``, ``README.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "engines"))

from vllm_bench import connector_config  # noqa: E402
from vllm_serve_bench import closed_loop, fused_workload, requests_for, start_server, summary, wait_ready  # noqa: E402

NGINX = """worker_processes 1;
daemon off;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;
events {{ worker_connections 512; }}
http {{
  access_log off;
  client_body_temp_path {tmp}/body;
  proxy_temp_path {tmp}/proxy;
  fastcgi_temp_path {tmp}/fastcgi;
  uwsgi_temp_path {tmp}/uwsgi;
  scgi_temp_path {tmp}/scgi;
  client_max_body_size 16m;
  upstream vllm {{
    least_conn;
{upstreams}
  }}
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass http://vllm;
      proxy_http_version 1.1;
      proxy_buffering off;
      proxy_read_timeout 1800s;
      proxy_next_upstream error timeout http_502 http_503 non_idempotent;
      proxy_next_upstream_tries 2;
    }}
  }}
}}
"""


def kill_tree(pid: int) -> None:
    """SIGKILL a process and every descendant (a replica: its API server, engine core and worker)."""
    import psutil

    try:
        root = psutil.Process(pid)
        for proc in [*root.children(recursive=True), root]:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
    except psutil.NoSuchProcess:
        pass


def one_run(folder: Path, store: Path, requests: list, stream: bool, args: argparse.Namespace, out: Path,
            kill_after: float | None, n_replicas: int = 2) -> dict:
    """One run on fresh servers: ``n_replicas`` behind nginx, the first killed ``kill_after`` s in (None: none);
    the issue's row."""
    config = connector_config(store, 0.15, kv_tier=f"redis://127.0.0.1:{args.redis_port}")
    redis = subprocess.Popen(["redis-server", "--port", str(args.redis_port), "--bind", "127.0.0.1", "--save", "",
                              "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    mode = f"{'stream' if stream else 'whole'}-{n_replicas}{'-kill' if kill_after is not None else ''}"
    replicas = [start_server(folder, args.port + 1 + k, 1, out / "logs" / f"{mode}-replica{k}.log", config,
                             first_core=k, extra=[]) for k in range(n_replicas)]
    tmp = Path(tempfile.mkdtemp(prefix="fusionrag-nginx-"))
    upstreams = "\n".join(f"    server 127.0.0.1:{args.port + 1 + k} max_fails=1 fail_timeout=600s;"
                          for k in range(n_replicas))
    (tmp / "nginx.conf").write_text(NGINX.format(tmp=tmp, upstreams=upstreams, port=args.port))
    nginx = None
    try:
        for k, proc in enumerate(replicas):
            wait_ready(args.port + 1 + k, proc)
        nginx = subprocess.Popen(["nginx", "-c", str(tmp / "nginx.conf"), "-p", str(tmp)],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1)
        killed_at: list[float] = []

        async def run() -> tuple[list[dict], float]:
            async def kill() -> None:
                if kill_after is None:
                    return
                await asyncio.sleep(kill_after)
                kill_tree(replicas[0].pid)  # a crash: the server, its engine core and worker, no drain
                killed_at.append(time.perf_counter())
            killer = asyncio.create_task(kill())
            results = await closed_loop(args.port, requests, args.clients, args.duration, args.max_tokens, stream)
            killer.cancel()
            return results

        t0 = time.perf_counter()
        results, wall = asyncio.run(run())
    finally:
        for proc in (nginx, *replicas, redis):
            if proc is not None:
                kill_tree(proc.pid)
    s = summary(results, wall)
    errors: dict[str, int] = {}
    for r in results:
        if not r["ok"]:
            errors[r.get("error", "?")] = errors.get(r.get("error", "?"), 0) + 1
    row = {"engine": "vllm+fusionrag", "clients": args.clients, "replicas": n_replicas, "stream": stream,
           "max_tokens": args.max_tokens, "killed_after_s": round(killed_at[0] - t0, 1) if killed_at else None,
           "ttft_p50_s": s["ttft_p50_s"], "ttft_p99_s": s["ttft_p99_s"], "requests_per_s": s["requests_per_s"],
           "requests": s["requests"], "failed": s["failed"], "failures": errors}
    print(f"[failover] {json.dumps(row)}", file=sys.stderr, flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    from fusionrag.bench.datasets import load_questions
    from fusionrag.bench.provenance import build_meta
    from fusionrag.files import atomic_write

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="../shared/data/2wikimqa/2wikimqa_dev_bm25_hipporag.jsonl")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--duration", type=float, default=150.0)
    ap.add_argument("--kill-after", type=float, default=50.0)
    ap.add_argument("--max-requests", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--port", type=int, default=8640)
    ap.add_argument("--redis-port", type=int, default=6396)
    ap.add_argument("--scaling", action="store_true", help="also one replica and two, nobody killed (streamed)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    out = Path(args.out)
    _, store, folder = fused_workload(args.data)
    requests = requests_for(store, load_questions(args.data), args.max_requests, seed=2)
    runs = [(False, args.kill_after, 2), (True, args.kill_after, 2)]
    if args.scaling:
        runs += [(True, None, 1), (True, None, 2)]
    rows = [one_run(folder, store.path, requests, stream, args, out, kill, n) for stream, kill, n in runs]
    balancer = subprocess.run(["nginx", "-v"], capture_output=True, text=True).stderr.strip()
    meta = build_meta(command=shlex.join(["benchmarks/vllm/vllm_failover_bench.py", *sys.argv[1:]]),
                      model="qwen2.5-0.5b", data_files=[args.data],
                      extra={"clients": args.clients, "duration_s": args.duration, "kill_after_s": args.kill_after,
                             "balancer": balancer})
    atomic_write(out / "failover.json", json.dumps({"meta": meta, "rows": rows}, indent=1))
    md = ["# Two replicas behind nginx, one killed mid-run (the connector on both, one store, a shared Redis tier)", "",
          f"`{meta['command']}`: {args.clients} clients, closed loop, {args.duration:.0f} s per run, the first replica "
          f"killed (SIGKILL) {args.kill_after:.0f} s in, {args.max_tokens} tokens per answer, bf16, one thread per "
          f"replica, {balancer}, {meta['machine'].get('cpu_model')}.", "",
          "| replicas | killed | requests | ok / failed | failures | TTFT p50 s | TTFT p99 s | requests/s |",
          "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        kinds = ", ".join(f"{k}: {v}" for k, v in r["failures"].items()) or "-"
        killed = f"the first, {r['killed_after_s']:.0f} s in" if r["killed_after_s"] is not None else "none"
        md.append(f"| {r['replicas']} | {killed} | {'streamed' if r['stream'] else 'whole (non-streamed)'} | "
                  f"{r['requests'] - r['failed']} / {r['failed']} | {kinds} | {r['ttft_p50_s']:.2f} | "
                  f"{r['ttft_p99_s']:.2f} | {r['requests_per_s']:.3f} |")
    one = next((r for r in rows if r["replicas"] == 1), None)
    two = next((r for r in rows if r["replicas"] == 2 and r["killed_after_s"] is None), None)
    if one and two and one["requests_per_s"]:
        md += ["", f"Two replicas, nobody killed: **{two['requests_per_s'] / one['requests_per_s']:.2f}x** the "
                   "requests/s of one (the same requests, streamed)."]
    md += ["", "TTFT of a non-streamed request is its whole answer's latency. A request that failed was in flight on "
               "the killed replica: nginx passes a request to the other replica only while no byte of its answer has "
               "come back, which holds for a whole answer, never for a stream that has begun."]
    atomic_write(out / "README.md", "\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
