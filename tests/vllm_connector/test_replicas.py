"""Issue 49 item 4: one store, two vLLM replicas (vLLM's own data parallelism, no router of ours) over a shared
Redis tier. A chunk one replica read from disk is a Redis hit for the other; a passage added to the store is
served by every replica on its next request. The real pieces: ``vllm.entrypoints.openai.api_server
--data-parallel-size 2`` (two engine cores, one core each), a real redis-server on loopback, HTTP."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from vllm_helpers import closed_port, prompt_ids, tiny_store

pytest.importorskip("vllm", reason="vLLM is not installed here: the connector tests run in .venv-vllm")
pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")


def _post(port: int, body: dict) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def _redis_stats(port: int) -> dict[str, int]:
    out = subprocess.run(["redis-cli", "-p", str(port), "info", "stats"], capture_output=True, text=True,
                         timeout=10, check=True).stdout
    return {k: int(v) for k, v in (line.split(":", 1) for line in out.split() if line.startswith("keyspace_"))}


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    root = tmp_path_factory.mktemp("replicas")
    folder, lm, store = tiny_store(root)
    redis_port, port = closed_port(), closed_port()
    redis = subprocess.Popen(["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                              "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    debug = root / "debug"
    config = {"kv_connector": "FusionRAGConnector", "kv_connector_module_path": "fusionrag.vllm",
              "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
              "kv_connector_extra_config": {"store": str(store.path), "ratio": 0.15, "min_context_tokens": 16,
                                            "kv_tier": f"redis://127.0.0.1:{redis_port}", "memory_budget_mb": 0,
                                            "debug_dir": str(debug)}}
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}
    log = open(root / "vllm.log", "w")  # noqa: SIM115 (closed below)
    server = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
                               "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
                               "--max-model-len", "4096", "--enforce-eager", "--data-parallel-size", "2",
                               "--kv-transfer-config", json.dumps(config)], env=env, stdout=log,
                              stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                break
        except OSError:
            if server.poll() is not None:
                break
            time.sleep(1)
    else:
        server.kill()
    if server.poll() is not None:
        redis.kill()
        pytest.fail("vLLM with --data-parallel-size 2 did not start:\n" + (root / "vllm.log").read_text()[-3000:])
    yield {"port": port, "redis": redis_port, "store": store, "lm": lm, "debug": debug, "folder": folder}
    server.terminate()
    try:
        server.wait(60)
    except subprocess.TimeoutExpired:
        server.kill()
    redis.kill()
    log.close()


def _loads(debug: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(debug.glob("*.json"), key=lambda p: p.stat().st_mtime)]


def _until_both_replicas_loaded(r: dict, ids: list[int], most: int = 12, whole: bool = True) -> list[dict]:
    """Requests over ``ids`` (a new ratio each: its own prefix-cache namespace, so every one is loaded) until
    loads from two worker processes are recorded; the loads, in order."""
    for old in r["debug"].glob("*.json"):
        old.unlink()
    for i in range(most):
        body = {"model": str(r["folder"]), "prompt": ids, "max_tokens": 1, "temperature": 0,
                "kv_transfer_params": {"fusionrag": {"ratio": round(0.10 + 0.01 * i, 2)}}}
        served = _post(r["port"], body)["kv_transfer_params"]["fusionrag"]
        assert served["method"] == "fusionrag" and (served["stored_share"] == 1.0 or not whole), served
        loads = _loads(r["debug"])
        if len({x["worker"] for x in loads}) == 2:
            return loads
    pytest.fail(f"{most} requests never reached the second replica")


def test_a_chunk_one_replica_read_from_disk_is_a_redis_hit_for_the_other(replicas):
    store = replicas["store"]
    chunks = store.chunk_ids()[:6]
    before = _redis_stats(replicas["redis"])
    loads = _until_both_replicas_loaded(replicas, prompt_ids(store, chunks))
    after = _redis_stats(replicas["redis"])
    misses = after["keyspace_misses"] - before["keyspace_misses"]
    hits = after["keyspace_hits"] - before["keyspace_hits"]
    # Each chunk's entry was read from disk once (a miss, then written to Redis), by whichever replica loaded
    # first; every later load, the other replica's included, found all of them in Redis.
    assert misses == len(chunks), (misses, hits)
    assert hits == len(chunks) * (len(loads) - 1), (misses, hits, len(loads))


def test_a_passage_added_to_the_store_is_served_by_every_replica(replicas):
    from fusionrag.offline import build

    store, lm = replicas["store"], replicas["lm"]
    before = set(store.chunk_ids())
    build.add_passages(store, lm, [{"title": "Gallium", "text": "Gallium was discovered by Paul-Emile Lecoq de "
                                    "Boisbaudran in 1875 from its spectral lines."}], doc="new")
    build.fuse(store, lm, top_n=2, progress=False)
    new = sorted(set(store.chunk_ids()) - before)
    assert len(new) == 1
    loads = _until_both_replicas_loaded(replicas, prompt_ids(store, [*store.chunk_ids()[:3], *new]))
    by_worker = {x["worker"]: x for x in loads}
    assert len(by_worker) == 2
    for load in by_worker.values():  # each replica found the new chunk in the prompt on its next request
        assert new[0] in [c[0] for c in load["chunks"]], load["chunks"]


def test_a_deleted_document_is_served_by_no_replica(replicas):
    """After a delete, neither replica serves the removed chunk from the store: each finds the rest of the
    prompt's chunks and leaves the removed one's tokens to be computed (a gap)."""
    from fusionrag.offline import build

    store, lm = replicas["store"], replicas["lm"]
    build.add_passages(store, lm, [{"title": "Hafnium", "text": "Hafnium was found in zirconium ores by Coster and "
                                    "von Hevesy in Copenhagen in 1923, by X-ray spectroscopy."}], doc="doomed")
    build.fuse(store, lm, top_n=2, progress=False)
    gone = store.chunk_ids_of_docs(["doomed"])
    kept = [c for c in store.chunk_ids() if c not in gone][:3]
    ids = prompt_ids(store, [kept[0], *gone, *kept[1:]])  # the removed chunk between two kept ones: a gap now
    build.delete_document(store, "doomed")
    assert not set(gone) & set(store.chunk_ids())
    loads = _until_both_replicas_loaded(replicas, ids, whole=False)
    for load in {x["worker"]: x for x in loads}.values():
        served = [c[0] for c in load["chunks"]]
        assert served == kept, served
