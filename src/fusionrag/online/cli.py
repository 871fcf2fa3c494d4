"""``fusionrag ask``: one question against a knowledge store (or the model alone).

What it is doing goes to stderr while it loads (the model, the store, the method it ran and
why); the answer alone goes to stdout, so ``ask ... > answer.txt`` keeps just the answer.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from fusionrag.models.options import add_device_args, device_options
from fusionrag.online.auto_ratio import describe, parse_ratio
from fusionrag.online.methods import KV_KINDS, method_info, methods
from fusionrag.online.request import DEFAULT_MAX_NEW_TOKENS, ReuseRequest


def _say(args: argparse.Namespace, message: str) -> None:
    if not args.quiet:
        print(f"fusionrag: {message}", file=sys.stderr, flush=True)


def _model_of(args: argparse.Namespace) -> str:
    if args.model:
        return args.model
    if args.store:
        from fusionrag.retrieval.store_info import stored_model

        return stored_model(args.store)
    from fusionrag.models.options import DEFAULT_MODEL

    return DEFAULT_MODEL


def _check_store(args: argparse.Namespace) -> None:
    """The store's state, read from its files before anything heavy is imported: a mistyped path, a model
    that cannot be the store's; said once when it was never preprocessed (no fused KV to reuse)."""
    if not args.store:
        return

    from fusionrag.retrieval.store_info import check_model_matches, preprocess_hint, require_store

    require_store(args.store)
    if args.model:
        check_model_matches(args.store, args.model)
    hint = preprocess_hint(args.store)
    if hint and not args.no_retrieval and args.method in ("auto", "fusionrag"):
        print(f"fusionrag: warning: {hint}", file=sys.stderr, flush=True)


def _cmd_ask(args: argparse.Namespace) -> int:
    # Validated before anything heavy is imported and before the model loads: an empty question, a wrong ratio,
    # a mistyped store answer at once.
    retrieval = False if args.no_retrieval else None
    req = ReuseRequest(args.question, args.method, args.ratio, args.kv, args.top_k, retrieval=retrieval).validated()
    _check_store(args)
    from fusionrag.models.devices import dtype_choice
    from fusionrag.online.engine import Engine

    start = time.perf_counter()
    where = f"over the store {args.store}" if args.store else "without a store (no retrieval)"
    _say(args, f"loading {_model_of(args)} {where} ...")
    engine = Engine.open(args.store, model=args.model, min_reuse_tokens=args.min_reuse_tokens, **device_options(args))
    dtype = dtype_choice(getattr(args, "dtype", None), engine.lm.device)
    _say(args, f"loaded {engine.lm.name} on {engine.lm.device}, computing in {dtype}, in "
               f"{time.perf_counter() - start:.1f} s; answering with method {args.method} ...")
    if args.stream and not (args.json or args.explain):
        done: list = []
        for delta in engine.stream(req, max_new_tokens=args.max_new_tokens, on_done=done.append):
            sys.stdout.write(delta)
            sys.stdout.flush()
        sys.stdout.write("\n")
        sys.stdout.flush()
        if done:  # the same lines as without --stream, after the answer
            if done[0].note:
                _say(args, done[0].note)
            _summary(args, done[0])
        return 0
    result = engine.answer(req, max_new_tokens=args.max_new_tokens)
    if args.explain:
        from fusionrag.online.explain import render_explain_html, write_explain

        write_explain(args.explain, render_explain_html(result, args.question, engine.lm.tokenizer,
                                                        result.chunk_token_ids))
    if result.note:
        _say(args, result.note)
    if args.json:
        print(json.dumps({"question": args.question, **result.to_json()}))
    else:
        print(result.text)
        _summary(args, result)
    return 0


def _summary(args: argparse.Namespace, result) -> None:
    """What ran (the method, the TTFT breakdown) and the sources, on stderr: stdout keeps the answer alone."""
    t = result.ttft_ms
    print(
        f"[{result.method} on {result.kv} KV, ratio {describe(result.ratio, result.auto_ratio)}: "
        f"{result.recomputed_tokens}/"
        f"{result.context_tokens} context tokens recomputed; TTFT {t['total']:.0f} ms = retrieve "
        f"{t['retrieve']:.0f} + load {t['load']:.0f} + select {t['select']:.0f} + recompute "
        f"{t['recompute']:.0f} + first token {t['first_token']:.0f}]",
        file=sys.stderr,
    )
    for i, s in enumerate(result.sources, 1):
        score = "" if s["score"] is None else f", score {s['score']:.3f}"
        origin = f" ({s['source']})" if s["source"] else ""
        stored = f"chunk {s['chunk_id']}" if s["chunk_id"] is not None else "your passage"
        print(f"  [{i}] {s['title'] or '(untitled)'}{origin}: {stored}{score}", file=sys.stderr)


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from fusionrag.retrieval.store_info import require_store

    require_store(args.store)
    if args.model:
        from fusionrag.retrieval.store_info import check_model_matches

        check_model_matches(args.store, args.model)
    from fusionrag.online.calibration import calibrate, record
    from fusionrag.online.engine import Engine

    engine = Engine.open(args.store, model=args.model, **device_options(args))
    print(f"fusionrag: calibrating ratio=auto for {engine.lm.name} ({str(engine.lm.dtype).removeprefix('torch.')}) "
          f"on {args.samples} probes made from the store's chunks ...", file=sys.stderr, flush=True)
    result = calibrate(engine, samples=args.samples, seed=args.seed, target_kl=args.target_kl, progress=True,
                       top_k=args.top_k)
    if not args.dry_run:
        record(engine, result)
    print(json.dumps(result.auto.to_setting()) if args.json else
          f"{result.summary()}{' (not written: --dry-run)' if args.dry_run else ''}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser("calibrate", help="measure the store's ratio=auto setting against Full Attention on probes "
                                         "made from its own chunks, and record it in the store")
    c.add_argument("--store", required=True, help="knowledge store folder")
    c.add_argument("--model", default=None, help="model (default: the store's)")
    c.add_argument("--samples", type=int, default=16, help="probes (questions made from the store's chunks)")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--top-k", type=int, default=None,
                   help="chunks retrieved per probe (default: as a request that names none, 5); set it to the "
                        "retrieval depth your requests use")
    c.add_argument("--target-kl", type=float, default=None,
                   help="mean first-token KL to Full Attention that auto must reach (default: the fixed 0.15 "
                        "ratio's on the same probes)")
    c.add_argument("--dry-run", action="store_true", help="measure and print; write nothing")
    c.add_argument("--json", action="store_true", help="print the recorded setting as JSON")
    add_device_args(c)
    c.set_defaults(func=_cmd_calibrate)

    p = sub.add_parser("ask", help="answer a question over a knowledge store")
    p.add_argument("question")
    p.add_argument("--store", default=None, help="knowledge store folder (from 'fusionrag ingest'); without one, "
                                                 "the model answers alone")
    p.add_argument("--model", default=None, help="model (default: the one the store was built with; a different "
                                                 "model is refused before it loads)")
    p.add_argument("--method", default="auto", choices=methods(),
                   help="; ".join(f"{m}: {method_info(m).description}" for m in methods()))
    p.add_argument("--ratio", type=parse_ratio, default=0.15,
                   help="fraction of context tokens to recompute, or 'auto': as much as the question needs (the "
                        "store's calibration: fusionrag calibrate)")
    p.add_argument("--top-k", type=int, default=None, help="chunks to retrieve (default 5; 0: none)")
    p.add_argument("--no-retrieval", action="store_true", help="answer from the question alone")
    p.add_argument("--min-reuse-tokens", type=int, default=None,
                   help="context tokens from which --method auto reuses KV (default: the device's measured "
                        "break-even: 256 on CPU)")
    p.add_argument("--kv", choices=KV_KINDS, default=None,
                   help="which stored KV to reuse (default: plain-first for fusionrag, plain otherwise; "
                        "plain-first: fused, but the prompt's first chunk plain where the store holds it)")
    p.add_argument("--max-new-tokens", "--max-tokens", dest="max_new_tokens", type=int,
                   default=DEFAULT_MAX_NEW_TOKENS,
                   help=f"longest answer in tokens (default {DEFAULT_MAX_NEW_TOKENS}; it ends at the model's end "
                        "of turn first)")
    p.add_argument("--json", action="store_true", help="print one JSON object (answer, method, TTFT, sources)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    p.add_argument("--explain", metavar="FILE.html", help="write a page showing which tokens were recomputed")
    add_device_args(p)
    p.set_defaults(func=_cmd_ask)
