"""The Redis KV tier shared by servers (kvcache/redis_source.py), against a real redis-server on a unix socket."""

from __future__ import annotations

import shutil
import subprocess
import time

import pytest

from fusionrag.kvcache.sources import MemoryTier
from fusionrag.kvcache.store import KVStore
from fusionrag.models import load_model
from fusionrag.offline import build
from fusionrag.retrieval.embedder import HashingEmbedder
from fusionrag.retrieval.knowledge import KnowledgeStore

redis = pytest.importorskip("redis")
pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")

PASSAGES = [
    {"title": "Paris", "text": "Paris is the capital of France. It lies on the Seine river."},
    {"title": "Lyon", "text": "Lyon is a city in France on the Rhone and Saone rivers."},
    {"title": "Berlin", "text": "Berlin is the capital of Germany. It lies on the Spree river."},
    {"title": "Cats", "text": "Cats are small domesticated carnivorous mammals that purr."},
]
QUESTION = "What is the capital of France?"


class RedisServer:
    """A throwaway redis-server on a unix socket (no TCP port, no persistence)."""

    def __init__(self, folder) -> None:
        self.socket = folder / "redis.sock"
        self.proc = subprocess.Popen(
            ["redis-server", "--port", "0", "--unixsocket", str(self.socket), "--save", "", "--appendonly", "no",
             "--dir", str(folder)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"unix://{self.socket}"
        client = redis.Redis(unix_socket_path=str(self.socket))
        for _ in range(100):
            try:
                client.ping()
                return
            except redis.exceptions.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def server(tmp_path):
    s = RedisServer(tmp_path)
    yield s
    s.kill()


@pytest.fixture(scope="module")
def lm():
    return load_model("tiny-llama")


@pytest.fixture
def store_dir(tmp_path, lm):
    s = build.create_store(tmp_path / "kb", lm, kv_dtype="int8", embedder=HashingEmbedder(64))
    build.add_passages(s, lm, PASSAGES)
    build.fuse(s, lm, top_n=2, progress=False)
    s.close()
    return tmp_path / "kb"


def _engine(store_dir, lm, url, memory=True):
    from fusionrag.online.engine import Engine
    from fusionrag.serve.launch import kv_tier_source

    store = KnowledgeStore.open(store_dir, lm=lm)
    source = kv_tier_source(url, store)
    return Engine(store, lm, kv_source=MemoryTier(source, 64 << 20) if memory else source), source


def test_second_server_reads_what_the_first_loaded(server, store_dir, lm):
    a, ra = _engine(store_dir, lm, server.url)
    b, rb = _engine(store_dir, lm, server.url)
    first = a.answer(QUESTION, method="fusionrag", ratio=0.15, max_new_tokens=4)
    sa = ra.stats()["redis"]
    assert sa.disk_hits > 0 and sa.memory_hits == 0 and sa.stores == sa.disk_hits
    second = b.answer(QUESTION, method="fusionrag", ratio=0.15, max_new_tokens=4)
    sb = rb.stats()["redis"]
    assert sb.memory_hits == sa.disk_hits and sb.disk_hits == 0 and sb.refused == 0
    assert second.text == first.text and (second.first_logits - first.first_logits).abs().max() == 0
    assert b.stats()["tiers"]["redis"].memory_hits == sb.memory_hits  # what /metrics reads


def test_int8_values_from_redis_stay_int8_below_a_device_tier(server, store_dir, lm):
    """A device tier over the shared tier: the host tier holds Redis's int8 entries as stored, the device
    tier dequantises them, and the answers equal a server's without tiers."""
    import torch

    from fusionrag.kvcache.device_tier import kv_tiers
    from fusionrag.online.engine import Engine
    from fusionrag.serve.launch import kv_tier_source

    ref, _ = _engine(store_dir, lm, server.url, memory=False)
    first = ref.answer(QUESTION, method="fusionrag", ratio=0.15, max_new_tokens=4)  # fills Redis
    store = KnowledgeStore.open(store_dir, lm=lm)
    source = kv_tier_source(server.url, store)
    tiers = kv_tiers(source, "cpu", host_bytes=64 << 20, device_bytes=64 << 20)
    engine = Engine(store, lm, kv_source=tiers)
    second = engine.answer(QUESTION, method="fusionrag", ratio=0.15, max_new_tokens=4)
    assert second.text == first.text and torch.equal(second.first_logits, first.first_logits)
    host = tiers.lower.cache
    assert host.resident_keys() and all(host.get(k).kv.keys.dtype == torch.int8 for k in host.resident_keys())
    assert source.dequantize and tiers.lower.lower.stats()["redis"].memory_hits > 0  # read from Redis, as stored


def test_corrupt_foreign_and_stale_values_are_refused_and_reread_from_disk(server, store_dir, lm):
    a, ra = _engine(store_dir, lm, server.url, memory=False)
    ref = a.answer(QUESTION, method="fusionrag", kv="fused", ratio=0.15, max_new_tokens=4)
    client = redis.Redis(unix_socket_path=str(server.socket))
    names = sorted(n.decode() for n in client.keys("fusionrag:kv:*"))
    assert names
    key = names[0]
    cid, kind = int(key.split(":")[-2]), key.split(":")[-1]
    good = client.get(key)

    flipped = bytearray(good)
    flipped[-10] ^= 0x01
    client.set(key, bytes(flipped))  # corrupted
    entry = ra.get_many([(cid, kind)])[0]
    assert ra.stats()["redis"].refused == 1 and client.get(key) == good  # re-read from disk, shared copy repaired
    assert entry.metadata["checksum"] == a.store.kv.header(cid, kind)["checksum"]

    foreign = KVStore(store_dir / "other", "another-model", a.store.prompt.system_hash, "int8")
    path = foreign.save(cid, kind, entry.kv, a.store.chunk(cid).token_ids, scores=entry.scores, extra=entry.extra)
    client.set(key, path.read_bytes())  # a well-formed entry of another model
    ra.get_many([(cid, kind)])
    assert ra.stats()["redis"].refused == 2 and client.get(key) == good

    # Stale: the disk entry was rewritten since the shared copy was made (another server re-fused).
    old = good
    a.store.kv.save(cid, kind, entry.kv, a.store.chunk(cid).token_ids, scores=entry.scores * 0.5, extra=entry.extra)
    client.set(key, old)
    fresh = ra.get_many([(cid, kind)])[0]
    assert ra.stats()["redis"].refused == 3 and fresh.metadata["checksum"] == a.store.kv.header(cid, kind)["checksum"]
    assert a.answer(QUESTION, method="fusionrag", kv="fused", ratio=0.15, max_new_tokens=4).text == ref.text


def test_killing_redis_mid_run_degrades_to_disk_with_no_failed_request(server, store_dir, lm):
    a, ra = _engine(store_dir, lm, server.url, memory=False)
    questions = [QUESTION, "Where is Lyon?", "What do cats do?", "Which river is in Berlin?"]
    answers = [a.answer(q, method="fusionrag", ratio=0.15, max_new_tokens=3).text for q in questions]
    warm = ra.stats()["redis"]
    assert warm.memory_hits > 0 and warm.errors == 0
    ra.retry_s = 600.0  # stay degraded for the rest of the test (the default retries after 2 s)
    again = []
    for i, q in enumerate(questions):
        if i == 2:
            server.kill()  # mid-run: two requests served through Redis, two after it died
        again.append(a.answer(q, method="fusionrag", ratio=0.15, max_new_tokens=3).text)
    down = ra.stats()["redis"]
    assert again == answers  # every request answered, from disk
    assert down.errors >= 1 and down.available == 0 and down.disk_hits > warm.disk_hits
    assert a.stats()["tiers"]["redis"].available == 0


def test_a_server_config_file_selects_the_redis_tier(server, store_dir, lm, tmp_path):
    """``kv_tier`` in ``--config server.yaml`` (no flag) builds the server's engine over Redis."""
    import argparse

    from fusionrag.serve.launch import add_server_args, engine_factory, settings_from_args

    cfg = tmp_path / "server.yaml"
    cfg.write_text(f"kv_tier: {server.url}\nmemory_budget_mb: 16\n")
    p = argparse.ArgumentParser()
    add_server_args(p)
    settings = settings_from_args(p.parse_args(["--store", str(store_dir), "--config", str(cfg)]))
    assert settings.kv_tier == server.url
    engine = engine_factory(str(store_dir), "tiny-llama", settings.memory_budget_mb, settings.kv_tier)()
    engine.answer(QUESTION, method="fusionrag", ratio=0.15, max_new_tokens=2)
    assert engine.stats()["tiers"]["redis"].stores > 0  # what it loaded from disk went into Redis
    flag = settings_from_args(p.parse_args(["--store", str(store_dir), "--config", str(cfg), "--kv-tier",
                                            "redis://127.0.0.1:1"]))
    assert flag.kv_tier == "redis://127.0.0.1:1"  # the flag over the file


def test_a_store_changed_by_another_process_empties_the_shared_namespace_and_answers(server, store_dir, lm):
    """Issue 47 bug 9: the first request after a CLI change to the store took the Redis tier's ``invalidate(None)``
    (nobody said what changed) and failed with a TypeError. Now every copy in this store's namespace is deleted,
    so no server reads a copy of what the change rewrote, and the request is answered."""
    engine, source = _engine(store_dir, lm, server.url)
    engine.answer(QUESTION, method="fusionrag", ratio=0.15, max_new_tokens=2)
    client = redis.Redis(unix_socket_path=str(server.socket))
    assert list(client.scan_iter(match=f"{source.prefix}:*"))
    client.set("another-store:1:plain", b"kept")
    other = KnowledgeStore.open(store_dir, lm=lm)  # "another process": the CLI adding a document
    build.add_passages(other, lm, [{"title": "Rome", "text": "Rome is the capital of Italy, on the Tiber."}])
    other.close()
    answer = engine.answer(QUESTION, method="fusionrag", ratio=0.15, max_new_tokens=2)
    assert answer.text is not None
    assert client.get("another-store:1:plain") == b"kept"
    assert all(int(name.split(b":")[-2]) in engine.store.chunk_ids() for name in
               client.scan_iter(match=f"{source.prefix}:*"))  # what is there was read after the change
