"""FusionRAG inside vLLM: a v1 KV connector (``pip install 'fusionrag[vllm]'``).

    vllm serve MODEL_FOLDER --kv-transfer-config '{"kv_connector": "FusionRAGConnector",
        "kv_connector_module_path": "fusionrag.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {"store": "kb/", "ratio": 0.15}}'

(on the CPU build: ``python -m vllm.entrypoints.openai.api_server --model MODEL_FOLDER ...``, its ``vllm``
command fails to find its own version), or ``fusionrag serve --engine vllm --store kb/``
(:mod:`fusionrag.vllm.launch`). See
:mod:`fusionrag.vllm.connector`. It is correct as vLLM is deployed (decision 062): with prefix caching on
(each mode in its own prefix-cache namespace: an ``off`` request always gets vLLM's exact KV), with tensor
parallelism (``--tensor-parallel-size``), and on every family fusionrag serves; a configuration it cannot
serve stops vLLM at start with one line. The response's ``kv_transfer_params["fusionrag"]`` says what a
request was served. Importing this package imports vLLM only when the connector is asked for, so the
matching, the planning and the launcher are usable (and tested) without it.
"""

from __future__ import annotations

from typing import Any

#: vLLM releases the connector is tested against (its internals, not a public API, are what it drives).
TESTED_VLLM = ("0.32",)


def check_vllm_version(version: str) -> str | None:
    """One line when ``version`` is outside the tested releases, else None."""
    if any(version == v or version.startswith(v + ".") for v in TESTED_VLLM):
        return None
    return (f"fusionrag's vLLM connector is tested with vLLM {', '.join(TESTED_VLLM)}; this is vLLM {version}: "
            "it may not work (it drives vLLM's model layers and KV-cache write directly)")


def __getattr__(name: str) -> Any:
    if name in ("FusionRAGConnector", "FusionRAGMetadata"):
        import logging

        import vllm

        warning = check_vllm_version(vllm.__version__)
        if warning:
            logging.getLogger("fusionrag.vllm").warning(warning)
        from fusionrag.vllm import connector

        return getattr(connector, name)
    raise AttributeError(name)
