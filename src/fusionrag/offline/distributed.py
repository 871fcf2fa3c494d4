"""Preprocessing on Ray: the plain and fused stages as batches on a pool of model-holding actors.

The drivers in :mod:`fusionrag.offline.preprocess` decide what to compute (resume checks,
neighbour lists, staleness) and write every entry through the store's atomic, verified
``KVStore.save``; :class:`RayRunner` only replaces *where* the pure batch functions
(:func:`~fusionrag.offline.preprocess.plain_batch`, :func:`~fusionrag.offline.preprocess.fuse_batch`)
run. Each actor loads the model once and gets batches of chunk ids with their token ids; for
fusing it reads the neighbours' plain KV itself from the store's ``kv/`` folder (verified
against the token ids the driver sends), so the driver ships token ids, not KV. Results come
back over Ray's own transport as they complete; nothing Ray serialises reaches the disk.

Fault tolerance: actors are restartable and their calls retried (``max_restarts`` /
``max_task_retries``), so a worker that dies mid-run is replaced, reloads the model and redoes
its batch; the batch functions are pure, so a redone batch gives the same bytes. A driver that
dies resumes like the local path: entries already written are current and skipped.

Ray is an optional extra (``pip install 'fusionrag[ray]'``); nothing here imports it at module
load. Each actor runs torch with one thread by default (Ray's one CPU per actor), which is how
the serial run compares to it in ``benchmarks/ray/results``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from fusionrag.errors import FusionRAGError
from fusionrag.kvcache.kv import KV
from fusionrag.kvcache.store import KVStore
from fusionrag.offline.preprocess import FusedKV, fuse_batch, plain_batch


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise FusionRAGError("--ray needs the 'ray' package: pip install 'fusionrag[ray]'") from exc
    return ray


def initial_slots(actors: Sequence[Any], per_actor: int) -> list[Any]:
    """The order in which actors get their first batches: round-robin (a0, a1, ..., a0, a1, ...).

    Grouped by actor (a0, a0, a1, a1) a run of two batches sent both to the first actor and left
    the second idle: measured as no plain-stage speed-up with 2 workers (benchmarks/ray/results).
    """
    return [a for _ in range(per_actor) for a in actors]


class KVWorker:
    """One model per worker process; its methods are the pure batch functions (the actor's body)."""

    def __init__(self, model: str, kv_root: str, fingerprint: str, system_hash: str, threads: int = 1) -> None:
        import torch

        from fusionrag.models import load_model

        torch.set_num_threads(threads)
        self.lm = load_model(model)
        if self.lm.fingerprint != fingerprint:
            raise FusionRAGError(f"worker loaded {model} ({self.lm.fingerprint}), not the store's model {fingerprint}")
        self.kv = KVStore(Path(kv_root), fingerprint, system_hash)

    def pid(self) -> int:
        import os

        return os.getpid()

    def plain(self, system_kv: KV, batch: dict[int, list[int]]) -> dict[int, KV]:
        return plain_batch(self.lm, system_kv, batch)

    def fuse(self, system_kv: KV, batch: dict[int, list[int]], neighbours: dict[int, list[int]],
             neighbour_tokens: dict[int, list[int]], neighbour_order: str) -> dict[int, FusedKV]:
        import torch

        cache: dict[int, KV] = {}

        def load_plain(cid: int) -> KV:
            if cid not in cache:
                cache[cid] = self.kv.load(cid, "plain", token_ids=neighbour_tokens[cid]).kv.to(torch.float32)
            return cache[cid]

        return fuse_batch(self.lm, system_kv, list(batch), batch, neighbours, load_plain, neighbour_order)


class RayRunner:
    """A :class:`~fusionrag.offline.preprocess.LocalRunner` whose batches run on Ray actors.

    ``address``: ``auto`` (the cluster in ``RAY_ADDRESS`` or a running local one, else a new
    local one) or a cluster address; ``workers``: actors (default: the cluster's CPUs).
    ``on_result`` is called after each batch comes back (the fault test kills a worker there).
    """

    def __init__(self, store: Any, model: str, address: str = "auto", workers: int | None = None,
                 threads_per_worker: int = 1, init_options: Mapping[str, Any] | None = None,
                 on_result: Callable[[RayRunner], None] | None = None) -> None:
        ray = _ray()
        if not ray.is_initialized():
            opts = {"include_dashboard": False, "log_to_driver": False, **(init_options or {})}
            if address == "auto":
                try:
                    ray.init(address="auto", **opts)
                except (ConnectionError, RuntimeError):
                    ray.init(**opts)  # no running cluster: a local one
            else:
                ray.init(address=address, **opts)
        self.ray = ray
        self.store = store
        n = workers or max(1, int(ray.cluster_resources().get("CPU", 1)) // threads_per_worker)
        actor = ray.remote(num_cpus=threads_per_worker, max_restarts=-1, max_task_retries=-1)(KVWorker)
        root, fingerprint, system_hash, _dtype = store.kv.identity()
        self.actors = [actor.remote(model, root, fingerprint, system_hash, threads_per_worker) for _ in range(n)]
        self.on_result = on_result
        self.restarts_seen = 0

    def plain(self, system_kv: KV, batches: Sequence[dict[int, Sequence[int]]]) -> Iterator[tuple[dict, dict[int, KV]]]:
        sys_ref = self.ray.put(system_kv)
        yield from self._map(batches, lambda a, b: a.plain.remote(sys_ref, {c: list(t) for c, t in b.items()}))

    def fuse(self, system_kv: KV, batches: Sequence[dict[int, Sequence[int]]], neighbours: Mapping[int, Sequence[int]],
             neighbour_order: str) -> Iterator[tuple[dict, dict[int, FusedKV]]]:
        sys_ref = self.ray.put(system_kv)

        def submit(actor: Any, batch: dict) -> Any:
            nb = {c: [int(n) for n in neighbours[c]] for c in batch}
            needed = {n for ns in nb.values() for n in ns} | ({c for c in batch if not nb[c]})
            tokens = {n: list(self.store.chunk(n).token_ids) for n in needed}
            return actor.fuse.remote(sys_ref, {c: list(t) for c, t in batch.items()}, nb, tokens, neighbour_order)

        yield from self._map(batches, submit)

    def _map(self, batches: Sequence[dict], submit: Callable[[Any, dict], Any]) -> Iterator[tuple[dict, dict]]:
        """Keep every actor busy (two batches in flight each); yield results in completion order."""
        pending: dict[Any, tuple[int, dict]] = {}
        queue = list(batches)
        free = initial_slots(self.actors, per_actor=2)
        while queue or pending:
            while queue and free:
                actor = free.pop(0)
                batch = queue.pop(0)
                pending[submit(actor, batch)] = (self.actors.index(actor), batch)
            done, _ = self.ray.wait(list(pending), num_returns=1)
            i, batch = pending.pop(done[0])
            result = self.ray.get(done[0])  # retried by Ray if its actor died; raises only if it cannot be
            free.append(self.actors[i])
            yield batch, result
            if self.on_result is not None:
                self.on_result(self)

    def worker_pids(self) -> list[int]:
        return self.ray.get([a.pid.remote() for a in self.actors])

    def close(self) -> None:
        for a in self.actors:
            self.ray.kill(a)
        self.actors = []
