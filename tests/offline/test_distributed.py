"""Preprocessing on a real local Ray cluster (offline/distributed.py): same store bytes, survives a killed worker."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from fusionrag.models import load_model
from fusionrag.offline import build
from fusionrag.retrieval.embedder import HashingEmbedder

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.ray

PASSAGES = [{"title": t, "text": x} for t, x in [
    ("Paris", "Paris is the capital of France. It lies on the Seine river."),
    ("Lyon", "Lyon is a city in France on the Rhone and Saone rivers."),
    ("Berlin", "Berlin is the capital of Germany. It lies on the Spree river."),
    ("Rhine", "The Rhine river flows through Germany and the Netherlands."),
    ("Cats", "Cats are small domesticated carnivorous mammals that purr."),
    ("Dogs", "Dogs are domesticated descendants of wolves that bark."),
    ("Seine", "The Seine flows through Paris into the English Channel."),
    ("Spree", "The Spree is a river that flows through Berlin."),
]]


@pytest.fixture(scope="module")
def lm():
    return load_model("tiny-llama")


def _checksums(store):
    out = {}
    for kind in ("plain", "fused"):
        for cid in store.chunk_ids():
            out[(cid, kind)] = store.kv.header(cid, kind)["checksum"]
    return out


def _store(path, lm):
    s = build.create_store(path, lm, kv_dtype="float32", embedder=HashingEmbedder(64))
    build.add_passages(s, lm, PASSAGES, plain_kv=False)
    return s


def test_ray_store_is_identical_to_the_serial_one_and_survives_a_killed_worker(tmp_path, lm):
    from fusionrag.offline.distributed import RayRunner

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the workers' setting: the same float reductions, so the same bytes
    try:
        serial = _store(tmp_path / "serial", lm)
        build.fuse(serial, lm, top_n=3, progress=False, batch_size=1)
    finally:
        torch.set_num_threads(threads)
    ref = _checksums(serial)

    killed: list[int] = []

    def kill_one_worker(runner):
        if not killed:  # after the first fused batch lands: a worker dies with batches in flight
            pid = runner.worker_pids()[0]
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    dist = _store(tmp_path / "ray", lm)
    runner = RayRunner(dist, "tiny-llama", workers=2,
                       init_options={"num_cpus": 2, "object_store_memory": 80 << 20})
    try:
        build.compute_plain(dist, lm, build.ensure_system_kv(dist, lm), progress=False, batch_size=2, runner=runner)
        runner.on_result = kill_one_worker
        report = build.fuse(dist, lm, top_n=3, progress=False, batch_size=1, runner=runner)
        assert killed and killed[0] not in runner.worker_pids()  # the dead worker was replaced
    finally:
        runner.close()
        ray.shutdown()
    assert report.computed == len(PASSAGES)
    # Entry for entry, plain and fused: the same bytes (checksums over the stored tensors). An
    # earlier note saw this differ inside the full suite only; a full-suite run with this exact
    # assertion at its end matched 16 of 16, so identity is what is asserted.
    assert _checksums(dist) == ref

    # Resuming: an entry removed after the run is the only one recomputed (locally here).
    dist.kv.remove(dist.chunk_ids()[0], "fused")
    again = build.fuse(dist, lm, top_n=3, progress=False)
    assert again.computed == 1 and again.skipped == len(PASSAGES) - 1
    serial.close()
    dist.close()


def test_first_batches_go_round_robin_so_two_batches_use_two_workers():
    from fusionrag.offline.distributed import initial_slots

    assert initial_slots(["a", "b"], per_actor=2) == ["a", "b", "a", "b"]
    assert initial_slots(["a"], per_actor=2) == ["a", "a"]
