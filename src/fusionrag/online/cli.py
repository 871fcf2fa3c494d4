"""``fusionrag ask``: one question against a knowledge store."""

from __future__ import annotations

import argparse
import json
import sys

from fusionrag.models.devices import add_device_args, device_options
from fusionrag.online.methods import KV_KINDS, method_info, methods
from fusionrag.online.request import ReuseRequest


def _cmd_ask(args: argparse.Namespace) -> int:
    from fusionrag.online.engine import Engine

    # Validated before the model loads: a wrong ratio costs no model conversion.
    req = ReuseRequest(args.question, args.method, args.ratio, args.kv, args.top_k).validated()
    engine = Engine.open(args.store, model=args.model, **device_options(args))
    if args.stream and not (args.json or args.explain):
        for delta in engine.stream(args.question, max_new_tokens=args.max_new_tokens, **req.as_kwargs()):
            sys.stdout.write(delta)
            sys.stdout.flush()
        sys.stdout.write("\n")
        return 0
    result = engine.answer(args.question, max_new_tokens=args.max_new_tokens, **req.as_kwargs())
    if args.explain:
        from fusionrag.online.explain import render_explain_html, write_explain

        write_explain(args.explain, render_explain_html(result, args.question, engine.lm.tokenizer,
                                                        result.chunk_token_ids))
    if args.json:
        print(json.dumps({"question": args.question, **result.to_json()}))
    else:
        t = result.ttft_ms
        print(result.text)
        print(
            f"[{result.method} on {result.kv} KV, ratio {result.ratio:.2f}: {result.recomputed_tokens}/"
            f"{result.context_tokens} context tokens recomputed; TTFT {t['total']:.0f} ms = retrieve "
            f"{t['retrieve']:.0f} + load {t['load']:.0f} + select {t['select']:.0f} + recompute "
            f"{t['recompute']:.0f} + first token {t['first_token']:.0f}]",
            file=sys.stderr,
        )
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("ask", help="answer a question over a knowledge store")
    p.add_argument("question")
    p.add_argument("--store", required=True, help="knowledge store folder (from 'fusionrag ingest')")
    p.add_argument("--model", default=None, help="model (default: the one the store was built with)")
    p.add_argument("--method", default="fusionrag", choices=methods(),
                   help="; ".join(f"{m}: {method_info(m).description}" for m in methods()))
    p.add_argument("--ratio", type=float, default=0.15, help="fraction of context tokens to recompute")
    p.add_argument("--top-k", type=int, default=None, help="chunks to retrieve (default 5)")
    p.add_argument("--kv", choices=KV_KINDS, default=None,
                   help="which stored KV to reuse (default: plain-first for fusionrag, plain otherwise; "
                        "plain-first: fused, but the prompt's first chunk plain where the store holds it)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    p.add_argument("--explain", metavar="FILE.html", help="write a page showing which tokens were recomputed")
    add_device_args(p)
    p.set_defaults(func=_cmd_ask)
