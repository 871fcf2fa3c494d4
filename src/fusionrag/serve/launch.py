"""Building a server from command-line options: one definition for ``fusionrag serve`` and ``bench serve``.

The serving CLI runs the app with uvicorn; the load test (:mod:`fusionrag.bench`) starts the
same app in-process. Both take the same options and must build the same server, so the
options, the settings they make and the engine factory live here, below both commands.
Nothing heavy is imported until a server is built.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fusionrag.errors import FusionRAGError
from fusionrag.models.options import add_device_args, device_options
from fusionrag.online.auto_ratio import parse_ratio
from fusionrag.serve.settings import ServerSettings, load_settings, settings_help

if TYPE_CHECKING:
    from fastapi import FastAPI


def on_off(value: str) -> bool:
    """A switch's value on the command line: on/off, true/false, yes/no, 1/0."""
    v = value.strip().lower()
    if v in ("on", "true", "yes", "1"):
        return True
    if v in ("off", "false", "no", "0"):
        return False
    raise argparse.ArgumentTypeError(f"expected on or off, got {value!r}")


#: (flag, setting, type, help) of the options every server takes; the defaults are ServerSettings'.
_FLAGS = (
    ("--api-key", "api_key", str, "require 'Authorization: Bearer KEY'"),
    ("--max-queue", "max_queue", int, "requests waiting for prefill before 429"),
    ("--max-batch", "max_batch", int, "requests decoded together per step"),
    ("--max-num-batched-tokens", "max_num_batched_tokens", int,
     "tokens one step computes: decoding rows plus a piece of a prefill (0: whole prefills between steps)"),
    ("--max-body-bytes", "max_body_bytes", int, "request body limit"),
    ("--max-prompt-tokens", "max_prompt_tokens", int, "prompt token limit"),
    ("--default-retrieval", "default_retrieval", on_off,
     "on: search the store for requests that do not say; off (default): only passages the request brings or "
     "pastes (stored chunks found in the prompt reuse their KV)"),
    ("--method", "default_method", str, "default method of requests that name none"),
    ("--ratio", "default_ratio", parse_ratio, "default recompute ratio (a share, or auto: as much as each question "
                                              "needs, sized by the store's calibration)"),
    ("--memory-budget-mb", "memory_budget_mb", int,
     "in-memory KV tier (heat-based, with the asynchronous loader); 0 reads the store directly"),
    ("--device-kv-budget-mb", "device_kv_budget_mb", int,
     "chunk KV kept on the GPU above the memory tier (heat-based; copies on a side stream); 0: none"),
    ("--adhoc-cache-mb", "adhoc_cache_mb", int,
     "KV kept of request-supplied passages the store does not hold (alternative-path prefix cache)"),
    ("--context-cache-mb", "context_cache_mb", int,
     "whole contexts kept after their prefill: a new question on the same context prefills only itself"),
    ("--shutdown-timeout", "shutdown_timeout_s", float, "seconds open requests may finish after SIGTERM"),
    ("--max-new-tokens", "max_new_tokens", int, "upper bound on a request's max_tokens"),
    ("--default-max-tokens", "default_max_tokens", int, "max_tokens of requests that name none"),
    ("--min-reuse-tokens", "min_reuse_tokens", int,
     "context tokens from which method auto reuses KV (default: the measured break-even of the device)"),
)


def add_server_args(p: argparse.ArgumentParser) -> None:
    """The options of a server over a knowledge store (limits, defaults, model, memory tier).

    Every option defaults to "not given" so that ``FUSIONRAG_*`` variables and ``--config``
    apply underneath it (:func:`fusionrag.serve.settings.load_settings`); ``--help`` lists them all.
    """
    p.add_argument("--store", default=os.environ.get("FUSIONRAG_STORE"),
                   help="knowledge store folder (from 'fusionrag ingest'; or FUSIONRAG_STORE). Without one the "
                        "server answers over the passages requests bring (or none), with --model")
    p.add_argument("--model", default=os.environ.get("FUSIONRAG_MODEL"),
                   help="model (default: the one the store was built with, else the default model; or "
                        "FUSIONRAG_MODEL)")
    p.add_argument("--served-model-name", dest="served_model_name", nargs="+", default=None, metavar="NAME",
                   help="the model name(s) clients use, listed by /v1/models; other names are a 404 (default: the "
                        "model's name; or FUSIONRAG_SERVED_MODEL_NAME=a,b)")
    p.add_argument("--metrics-need-key", dest="metrics_need_key", action="store_true", default=None,
                   help="GET /metrics needs the API key too (default: open, as in vLLM)")
    p.add_argument("--config", default=os.environ.get("FUSIONRAG_CONFIG"), metavar="FILE.yaml",
                   help="server settings in YAML (keys: the setting names below; or FUSIONRAG_CONFIG)")
    p.add_argument("--kv-tier", default=None, metavar="redis://HOST:PORT",
                   help="a KV tier shared by servers, between the memory tier and the disk: redis://HOST:PORT[/DB] "
                        "or unix:///PATH.sock (needs the 'redis' extra; or FUSIONRAG_KV_TIER, or kv_tier in --config)")
    add_device_args(p)
    defaults = ServerSettings.model_fields
    for flag, name, type_, help_ in _FLAGS:
        env = "FUSIONRAG_" + name.upper()
        p.add_argument(flag, dest=name, type=type_, default=None,
                       help=f"{help_} (default {defaults[name].default!r}; or {env})")
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = settings_help()


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    """:class:`ServerSettings` from :func:`add_server_args` options plus ``host``/``port`` (flags win)."""
    flags = {name: getattr(args, name, None) for _, name, _, _ in _FLAGS}
    return load_settings(getattr(args, "config", None), host=getattr(args, "host", None),
                         port=getattr(args, "port", None), kv_tier=getattr(args, "kv_tier", None),
                         served_model_name=getattr(args, "served_model_name", None),
                         metrics_need_key=getattr(args, "metrics_need_key", None), **flags)


def kv_tier_source(url: str, store: Any) -> Any:
    """The shared tier named by ``--kv-tier`` over ``store``'s files (:meth:`KnowledgeStore.shared_kv_source`)."""
    return store.shared_kv_source(url)


def engine_factory(store: str | None, model: str | None, memory_budget_mb: int = 0,
                   kv_tier: str | None = None, devices: dict | None = None,
                   adhoc_cache_mb: int = 2048, min_reuse_tokens: int | None = None,
                   device_kv_budget_mb: int = 0, context_cache_mb: int = 1024) -> Callable[[], Any]:
    """Builds the engine on the model thread (the store's SQLite connection belongs to its creating thread).

    ``store`` None: the model alone (plain generation, or over the passages requests bring)."""
    if store is not None:
        from fusionrag.retrieval.store_info import require_store

        require_store(store)  # a mistyped path is one line before anything heavy is imported
    if store is None and kv_tier:
        raise FusionRAGError("--kv-tier shares a store's KV between servers: it needs --store")
    if kv_tier:  # said now, before minutes of model loading; the server still starts (disk reads until it answers)
        from fusionrag.kvcache.redis_source import tier_unreachable

        why = tier_unreachable(kv_tier)
        if why:
            print(f"fusionrag: warning: the KV tier {kv_tier.rpartition('@')[2]} does not answer ({why}); reading the "
                  "store's files until it does", file=sys.stderr)
    if store is not None and model is not None:
        from fusionrag.retrieval.store_info import check_model_matches

        check_model_matches(store, model)  # before the model thread spends minutes loading it

    def factory():
        from fusionrag.online.engine import Engine

        budget = memory_budget_mb << 20 or None
        on_device = device_kv_budget_mb << 20 or None
        adhoc, contexts = adhoc_cache_mb << 20, context_cache_mb << 20
        engine = Engine.open(store, model=model, memory_budget_bytes=None if kv_tier else budget,
                             device_budget_bytes=None if kv_tier else on_device, adhoc_cache_bytes=adhoc,
                             min_reuse_tokens=min_reuse_tokens, context_cache_bytes=contexts, **(devices or {}))
        if kv_tier:  # rebuilt over the shared tier (the engine's own disk source is what it falls back to)
            engine = Engine(engine.store, engine.lm, kv_source=kv_tier_source(kv_tier, engine.store),
                            memory_budget_bytes=budget, device_budget_bytes=on_device, adhoc_cache_bytes=adhoc,
                            min_reuse_tokens=min_reuse_tokens, context_cache_bytes=contexts)
        return engine

    return factory


def fit_prompt_limit(settings: ServerSettings, scheduler: Any, lm: Any) -> None:
    """A prompt limit the model cannot take is refused at start (one line) when it was asked for, and lowered
    to the model's context when it is only the default (a 9,017-token prompt was served on an 8,192-token
    model without a word)."""
    context = getattr(lm.config, "max_position_embeddings", None)
    if not context or settings.max_prompt_tokens <= int(context):
        return
    if "max_prompt_tokens" in settings.model_fields_set:
        raise FusionRAGError(f"--max-prompt-tokens {settings.max_prompt_tokens} is beyond {lm.name}'s context of "
                             f"{int(context)} tokens: give {int(context)} or less")
    settings.max_prompt_tokens = scheduler.max_prompt_tokens = int(context)


def build_app(args: argparse.Namespace) -> tuple[FastAPI, ServerSettings]:
    """The app for ``args`` with its model loaded, so a bad store or model fails here, before binding."""
    settings = settings_from_args(args)
    factory = engine_factory(args.store, args.model, settings.memory_budget_mb, settings.kv_tier,
                             device_options(args), settings.adhoc_cache_mb, settings.min_reuse_tokens,
                             settings.device_kv_budget_mb, settings.context_cache_mb)  # checks first: light
    from fusionrag.models.devices import dtype_choice
    from fusionrag.serve.app import create_app

    app = create_app(factory, settings)
    what = f"for {args.store}" if args.store else "(no store: answering over the passages requests bring)"
    print(f"fusionrag: loading {args.model or 'the model'} {what} ...", file=sys.stderr)
    app.state.scheduler.wait_ready()  # a bad store or model fails here, as one line, before binding
    lm = app.state.scheduler.engine.lm
    fit_prompt_limit(settings, app.state.scheduler, lm)
    print(f"fusionrag: {lm.name} on {lm.device}, computing in {dtype_choice(args.dtype, lm.device)}", file=sys.stderr)
    return app, settings
