"""``fusionrag serve --engine vllm --store kb/ [-- VLLM FLAGS]``: vLLM's own OpenAI server with the connector.

Resolves what vLLM needs from the store (the model folder its caches were built with: a packaged model's
converted safetensors folder, or the local checkpoint), builds the command line of vLLM's OpenAI server
(``python -m vllm.entrypoints.openai.api_server``: what ``vllm serve`` runs; the CPU build's ``vllm``
command looks its version up under the name ``vllm`` and fails) with ``--kv-transfer-config`` naming
:class:`~fusionrag.vllm.connector.FusionRAGConnector` over the store, prints it (so it can be copied into
a deployment) and replaces this process with it. vLLM flags after ``--`` are passed through. vLLM runs
from its own environment (it pins an older transformers): ``$FUSIONRAG_VLLM_PYTHON``, else this
interpreter if it has vLLM, else a ``.venv-vllm`` beside the installation. vLLM's
``--enable-prompt-tokens-details`` is on (clients read reuse in ``usage.prompt_tokens_details.cached_tokens``)
unless the flags after ``--`` say otherwise.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from fusionrag.errors import FusionRAGError


def vllm_python() -> str:
    """The Python interpreter that has vLLM, or a one-line error saying how to get one: ``$FUSIONRAG_VLLM_PYTHON``,
    else this interpreter if it has vLLM, else a ``.venv-vllm`` beside this installation (the checkout of an
    editable install, or next to this virtual environment), wherever the command is run from."""
    here = sys.executable if importlib.util.find_spec("vllm") is not None else None
    for candidate in (os.environ.get("FUSIONRAG_VLLM_PYTHON"), here, *beside_installation()):
        if candidate and Path(candidate).exists() and os.access(candidate, os.X_OK):
            return str(candidate)
    raise FusionRAGError("--engine vllm needs vLLM: set FUSIONRAG_VLLM_PYTHON to the python of an environment with "
                         f"vLLM, or make {CHECKOUT / '.venv-vllm'} (bash scripts/setup_vllm.sh; pip install "
                         "'fusionrag[vllm]' on CUDA)")


#: The checkout of an editable install (src/fusionrag/vllm/launch.py -> the repository root).
CHECKOUT = Path(__file__).resolve().parents[3]


def beside_installation() -> list[Path]:
    """Where a ``.venv-vllm`` made for this installation would be: in its checkout, or next to this venv."""
    return [root / ".venv-vllm" / "bin" / "python" for root in dict.fromkeys((CHECKOUT, Path(sys.prefix).parent))]


def model_folder(store: Path, model: str | None) -> tuple[str, Path]:
    """The store's model name and the Hugging Face folder vLLM loads (converted first for a packaged model)."""
    from fusionrag.models.gguf import ensure_converted
    from fusionrag.models.registry import PACKAGED
    from fusionrag.retrieval.store_info import check_model_matches, stored_model

    if model is not None:
        check_model_matches(store, model)
    name = model or stored_model(store)
    if name in PACKAGED:
        return name, ensure_converted(PACKAGED[name])
    folder = Path(name).expanduser()
    if not (folder / "config.json").is_file():
        raise FusionRAGError(f"the store's model {name!r} is not a local Hugging Face folder vLLM can load")
    return folder.name, folder


def vllm_command(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """vLLM's OpenAI server for ``args`` (``fusionrag serve``'s options) and the environment to run it in."""
    from fusionrag.models.devices import resolve_device, resolve_dtype
    from fusionrag.retrieval.store_info import missing_store

    if not args.store:
        raise FusionRAGError("--engine vllm serves a store: give --store (fusionrag ingest makes one)")
    store = Path(args.store).expanduser().resolve()
    if not store.exists():
        raise missing_store(store)
    name, folder = model_folder(store, args.model)
    device = resolve_device(args.device)
    dtype = str(resolve_dtype(args.dtype, device)).removeprefix("torch.")
    extra: dict[str, Any] = {"store": str(store)}
    if getattr(args, "default_ratio", None) is not None:
        extra["ratio"] = args.default_ratio
    config = {"kv_connector": "FusionRAGConnector", "kv_connector_module_path": "fusionrag.vllm",
              "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}
    served = getattr(args, "served_model_name", None) or [name]
    cmd = [vllm_python(), "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder), "--dtype", dtype,
           "--host", args.host or "127.0.0.1",
           "--port", str(args.port or 8000), "--served-model-name", *served,
           "--kv-transfer-config", json.dumps(config)]
    if getattr(args, "api_key", None):
        cmd += ["--api-key", args.api_key]
    passthrough = list(getattr(args, "vllm_args", None) or [])
    passthrough = passthrough[1:] if passthrough[:1] == ["--"] else passthrough
    if not any(a.startswith(("--enable-prompt-tokens-details", "--no-enable-prompt-tokens-details"))
               for a in passthrough):
        cmd.append("--enable-prompt-tokens-details")  # usage.prompt_tokens_details.cached_tokens: clients see reuse
    cmd += passthrough
    env = dict(os.environ)
    if device.type == "cpu":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")  # GiB of KV cache; vLLM's CPU build wants it said
    return cmd, env


def run_vllm(args: argparse.Namespace) -> int:
    """Print the command, then become it (vLLM handles its own signals and logging from here on)."""
    from fusionrag.retrieval.store_info import preprocess_hint

    cmd, env = vllm_command(args)
    hint = preprocess_hint(args.store)  # once, at start, as fusionrag's own server says it
    if hint:
        print(f"fusionrag: warning: {hint}", file=sys.stderr)
    print(f"fusionrag: {shlex.join(cmd)}", file=sys.stderr, flush=True)
    os.execvpe(cmd[0], cmd, env)
    return 0  # not reached


def extend_serve(parser: argparse.ArgumentParser) -> None:
    """``--engine`` on ``fusionrag serve``, and vLLM's own flags after ``--``."""
    parser.add_argument("--engine", choices=["fusionrag", "vllm"], default="fusionrag",
                        help="fusionrag: this package's server (default); vllm: vLLM's OpenAI server with fusionrag's "
                             "KV connector over --store (vLLM flags after --)")
    parser.add_argument("vllm_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    serve = parser.get_default("func")

    def dispatch(args: argparse.Namespace) -> int:
        if args.engine == "vllm":
            return run_vllm(args)
        if args.vllm_args:
            raise FusionRAGError(f"unexpected arguments {' '.join(args.vllm_args)!r} "
                                 "(vLLM flags go after -- with --engine vllm)")
        return serve(args)

    parser.set_defaults(func=dispatch)
