"""Sub-commands contributed by the layers (knowledge base, online, evaluation, serving)."""

from __future__ import annotations

import argparse
import importlib

# Each module exposes ``register(subparsers)``; imported lazily-cheap (no torch at import).
_COMMAND_MODULES = ["fusionrag.offline.cli", "fusionrag.online.cli", "fusionrag.bench.cli", "fusionrag.serve.cli"]


def register_commands(sub: argparse._SubParsersAction) -> None:
    for name in _COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    # `serve --engine vllm`: vLLM's server with the connector (fusionrag.vllm sits beside serve, not under it)
    from fusionrag.vllm.launch import extend_serve

    extend_serve(sub.choices["serve"])
