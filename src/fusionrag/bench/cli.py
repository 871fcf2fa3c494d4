"""``fusionrag bench quality|report|ttft|serve``: the evaluation harness on the command line."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from fusionrag.kvcache.storage_dtypes import DEFAULT_KV_DTYPE, STORAGE_DTYPES
from fusionrag.models.options import DEFAULT_MODEL, add_device_args


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _ratios(text: str) -> list[float | str]:
    """``0,0.15,auto``: numbers, and ``auto`` (the store's calibrated ratio="auto") or ``auto:MASS`` (that mass)."""
    return [x.strip() if x.strip().startswith("auto") else float(x) for x in text.split(",") if x.strip()]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _command() -> str:
    return shlex.join(["fusionrag", *sys.argv[1:]])


def quality_spec(args: argparse.Namespace, **overrides):
    """The ``QualitySpec`` of parsed ``bench quality`` arguments (the studies' driver adds its own fields)."""
    from fusionrag.bench.quality import QualitySpec
    from fusionrag.offline.preprocess import FuseSettings

    fields = dict(
        data=[Path(p) for p in args.data],
        out=Path(args.out),
        model=args.model,
        limit=args.limit,
        methods=args.methods,
        ratios=args.ratios,
        top_n=args.top_n,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        cache_dir=Path(args.cache_dir) if args.cache_dir else None,
        fuse=FuseSettings(min_similarity=args.min_similarity),
        kv_dtype=args.kv_dtype,
        max_passages=args.max_passages,
        decode=not args.no_decode,
        command=_command(),
    )
    fields.update(overrides)
    fuse = fields["fuse"]
    fields["extra_meta"] = {"neighbour_order": fuse.neighbour_order, "same_document": fuse.same_document,
                            "kv_dtype": fields["kv_dtype"], **fields.get("extra_meta", {})}
    return QualitySpec(**fields)


def _cmd_quality(args: argparse.Namespace) -> int:
    from fusionrag.bench.quality import plan_runs, run_quality

    spec = quality_spec(args)
    plan_runs(spec)  # a wrong method or ratio is refused before the model loads
    run_quality(spec)
    print(f"[bench quality] wrote {spec.out}/results.json, results.md and plots")
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from fusionrag.bench.quality import report_from_records

    rows = report_from_records(Path(args.out), command=_command(), data_files=[Path(p) for p in args.data],
                               model=args.model)
    print(f"[bench report] {len(rows)} rows -> {args.out}/results.json, results.md and plots")
    return 0


def _cmd_ttft(args: argparse.Namespace) -> int:
    from fusionrag.bench.ttft import TTFTSpec, run_ttft

    spec = TTFTSpec(
        data=Path(args.data),
        out=Path(args.out),
        model=args.model,
        context_tokens=args.context_tokens,
        ratios=args.ratios,
        methods=args.methods,
        tiers=args.tiers,
        repeats=args.repeats,
        top_n=args.top_n,
        loader_requests=args.loader_requests,
        command=_command(),
        device=args.device,
        dtype=args.dtype,
        attention=args.attention,
    )
    run_ttft(spec)
    print(f"[bench ttft] wrote {spec.out}/ttft.json, ttft.md and ttft.png")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    import json

    from fusionrag.bench.loadtest import ingest_documents, question_items, run_load_test
    from fusionrag.errors import FusionRAGError

    questions = question_items(args.data, limit=args.limit, with_documents=args.mode == "documents",
                               max_passages=args.max_passages)
    if args.mode == "retrieval":
        for q in questions:
            q.pop("documents", None)
    rates = [float(r) for r in args.rates.split(",") if r.strip()]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    meta = {"data": str(args.data), "mode": args.mode, "store": args.store, "model": args.model}

    def run(base_url: str) -> dict:
        if args.ingest:
            docs = question_items(args.data, limit=args.limit, with_documents=True, max_passages=args.max_passages)
            ids = ingest_documents(base_url, docs, api_key=args.api_key)
            meta["ingested_chunks"] = len(set(ids))
        return run_load_test(base_url, questions, rates=rates, methods=methods, duration_s=args.duration,
                             n_requests=args.n_requests, out_dir=args.out, max_tokens=args.max_tokens,
                             top_k=args.top_k, api_key=args.api_key, timeout_s=args.timeout, meta=meta)

    if args.url:
        report = run(args.url)
    elif args.store:
        from fusionrag.serve.launch import build_app
        from fusionrag.serve.server_thread import ServerThread

        args.host, args.port = "127.0.0.1", 0
        app, _ = build_app(args)
        with ServerThread(app) as server:
            report = run(server.base_url)
    else:
        raise FusionRAGError("give --url of a running server or --store to start one in-process")
    for c in report["cells"]:
        print(json.dumps({k: c[k] for k in ("label", "rate", "sent", "ok", "ttft_ms_p50", "ttft_ms_p95",
                                             "throughput_rps", "throughput_tok_s")}))
    if args.out:
        print(f"fusionrag: wrote {args.out}/loadtest.json, loadtest.md, loadtest.png", file=sys.stderr)
    return 0


def _add_serve(bsub: argparse._SubParsersAction) -> None:
    from fusionrag.online.methods import methods
    from fusionrag.serve.launch import add_server_args

    p = bsub.add_parser("serve", help="load test: TTFT p50/p95 and throughput vs request rate per method")
    add_server_args(p)
    p.add_argument("--url", default=None, help="a running server on loopback (else --store starts one in-process)")
    p.add_argument("--data", required=True, help="questions JSONL (../shared/data/...)")
    p.add_argument("--limit", type=int, default=50, help="questions to use (default 50)")
    p.add_argument("--mode", choices=["documents", "retrieval"], default="documents",
                   help="send each question's passages as request documents, or retrieve from the store")
    p.add_argument("--max-passages", type=int, default=None, help="passages per question (default all)")
    p.add_argument("--ingest", action="store_true", help="add the questions' passages to the store first")
    p.add_argument("--rates", default="0.5,1,2,4", help="request rates in req/s, comma-separated")
    p.add_argument("--methods", default="full,cacheblend:0.15,fusionrag:0.15",
                   help=f"method[:ratio], comma-separated ({', '.join(methods())})")
    p.add_argument("--n-requests", type=int, default=None, help="requests per (method, rate) cell")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per cell (default 30)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for a cell's requests")
    p.add_argument("--out", default="benchmarks/serve/results", help="output folder (JSON, Markdown, PNG)")
    p.set_defaults(func=_needs_extra(_cmd_serve), log_level="warning")


def _cmd_faults(args: argparse.Namespace) -> int:
    from fusionrag.bench.faults import FaultSpec, run_faults

    report = run_faults(FaultSpec(out=Path(args.out), model=args.model, requests=args.requests, load=args.load,
                                  job_every=args.job_every, max_tokens=args.max_tokens, seed=args.seed,
                                  command=_command()))
    print(json.dumps({k: report[k] for k in ("chats", "jobs", "malformed", "store")}, indent=2))
    return 0


def _add_faults(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser("faults", help="loopback load above capacity with document jobs and induced faults")
    p.add_argument("--model", default="smollm2-135m", help="model for the store and the server")
    p.add_argument("--requests", type=int, default=200, help="chats to send (default 200)")
    p.add_argument("--load", type=float, default=2.0, help="arrival rate as a multiple of measured capacity")
    p.add_argument("--job-every", type=int, default=25, help="post a document job every N chats (0: none)")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/faults/results", help="output folder (JSON, Markdown, PNG)")
    p.set_defaults(func=_needs_extra(_cmd_faults))


def add_quality_args(q: argparse.ArgumentParser) -> None:
    """``bench quality``'s options (shared with the studies' driver, ``python -m studies.quality_cli``, which
    adds the knowledge-base, offline-ablation and reference options only the studies use)."""
    from fusionrag.online.methods import KV_KINDS, methods

    q.add_argument("--data", nargs="+", required=True, help="JSONL files in the ../shared/data schema")
    q.add_argument("--limit", type=int, default=50, help="first N questions of each file")
    q.add_argument("--methods", type=_names, default="full,reuse,cacheblend,cachecraft,epic,fusionrag:plain,fusionrag",
                   help=f"comma-separated METHOD or METHOD:KV ({', '.join(methods())}; KV one of "
                        f"{', '.join(KV_KINDS)}); each runs on the KV it reuses in 'ask' and 'serve' unless :KV says "
                        "otherwise (fusionrag: plain-first). Default includes fusionrag:plain, the same selection "
                        "without the offline stage")
    q.add_argument("--ratios", type=_ratios, default="0,0.05,0.1,0.15,0.3",
                   help="recompute ratios; 'auto' runs ratio=auto with the store's calibration and 'auto:MASS' with "
                        "that attention mass (fusionrag only)")
    q.add_argument("--top-n", type=_ints, default="10", help="offline neighbours; a list runs one store each")
    q.add_argument("--model", default=DEFAULT_MODEL)
    q.add_argument("--max-new-tokens", type=int, default=24)
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--cache-dir", default=None, help="Full Attention cache and stores (default OUT/cache)")
    q.add_argument("--kv-dtype", choices=list(STORAGE_DTYPES), default=DEFAULT_KV_DTYPE,
                   help=f"storage dtype of the run's stores (default {DEFAULT_KV_DTYPE}, as 'fusionrag ingest')")
    q.add_argument("--min-similarity", type=float, default=None, metavar="COS",
                   help="offline: keep only neighbours at least this similar (up to --top-n)")
    q.add_argument("--max-passages", type=int, default=None,
                   help="passages per question: the supporting ones, then the earliest others (MuSiQue 20 -> 10)")
    q.add_argument("--no-decode", action="store_true",
                   help="teacher-forced metrics only (gold NLL, KL to Full Attention): no greedy answer, no F1")
    q.add_argument("--out", required=True)


def _needs_extra(func):
    """Run a bench command only with the ``bench`` extra installed (else one line saying how)."""
    def run(args: argparse.Namespace) -> int:
        from fusionrag.bench.plots import require_matplotlib

        require_matplotlib()
        return func(args)
    return run


def register(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmarks: quality, ttft, serve, faults (the 'bench' extra)")
    bsub = bench.add_subparsers(dest="bench_command", required=True)

    q = bsub.add_parser("quality", help="methods x ratios on QA data: F1/EM, gold NLL, fidelity to Full Attention")
    add_quality_args(q)
    q.set_defaults(func=_needs_extra(_cmd_quality))

    r = bsub.add_parser("report", help="re-aggregate OUT/records.jsonl of earlier quality runs into one report")
    r.add_argument("--out", required=True)
    r.add_argument("--data", nargs="*", default=[], help="the data files the records came from (provenance)")
    r.add_argument("--model", default=None, help="model name for the report (default: from results.json)")
    r.set_defaults(func=_needs_extra(_cmd_report))

    t = bsub.add_parser("ttft", help="TTFT vs context length with breakdown, memory vs cold disk")
    t.add_argument("--data", required=True, help="a JSONL file whose passages build the contexts")
    t.add_argument("--model", default=DEFAULT_MODEL)
    t.add_argument("--context-tokens", type=_ints, default="1024,2048,4096,8192")
    t.add_argument("--ratios", type=_floats, default="0,0.15")
    t.add_argument("--methods", type=_names, default="full,fusionrag,cacheblend")
    t.add_argument("--tiers", type=_names, default="memory,disk",
                   help="where chunk KV waits: device (on the model's device), pinned (page-locked host memory, CUDA), "
                        "memory, disk (cold reads)")
    t.add_argument("--repeats", type=int, default=3)
    t.add_argument("--top-n", type=int, default=2, help="offline neighbours for the fused KV used here")
    t.add_argument("--loader-requests", type=int, default=4,
                   help="queued requests for the asynchronous-loader comparison on a cold disk tier (0: skip)")
    t.add_argument("--out", required=True)
    add_device_args(t)
    t.set_defaults(func=_needs_extra(_cmd_ttft))

    _add_serve(bsub)
    _add_faults(bsub)
