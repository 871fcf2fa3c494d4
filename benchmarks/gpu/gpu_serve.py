"""The server on a GPU: the real ``fusionrag serve`` under 8 concurrent clients with 16K-token RAG prompts.

One command, no download, loopback only, bounded in requests and in time (``--budget-s``):

1. a randomly initialised checkpoint in the Qwen2.5-7B shape (28 layers, 28 query / 4 KV heads of
   128, bf16; built on the device, saved in 2 GB shards to local disk with the Qwen2 tokenizer
   files carried in ``benchmarks/gpu/qwen2_tokenizer/``); the 3B shape (36 layers, 16 / 2 heads)
   with ``--shape 3b``, or by itself when the budget, the disk or the GPU's memory is too small
   for the 7B one. Timing does not depend on weight values;
2. a store of about ``--chunks`` chunks of ``--chunk-tokens`` tokens: ``fusionrag ingest`` of
   synthetic text files (random words the tokenizer has as single tokens) on the device
   (plain KV, int8 as by default; hashing embedder: no embedding model on the GPU image);
3. ``fusionrag serve --model CKPT --store S --device cuda --dtype bfloat16`` in a subprocess on
   127.0.0.1 and a free port; ``POST /v1/retrieve`` once per question for ``--docs`` stored chunks;
4. for each method (``full``, then ``fusionrag`` at 15%), one warm-up round, then a closed loop
   (:func:`fusionrag.bench.loadtest.closed_loop`) of ``--clients`` clients, each streaming its next
   chat completion (``documents`` = the question's chunks, so every chunk's KV is precomputed;
   ``max_tokens`` ``--max-tokens``) as soon as its last one ended, for ``--seconds`` (less where the
   budget is shorter) or ``--max-requests``: TTFT p50 / p99 (client-side: queueing included),
   requests/s and generated tokens/s (over the window in which every client was busy), the prompt
   length, the GPU memory in use (``nvidia-smi`` sampled during the method: the server's weights and
   its caching allocator's peak, a later method inheriting an earlier one's), and the server's
   ``/metrics`` deltas (recomputed share, mean decode batch, KV tier bytes);
5. the ratios fusionrag / full, against the issue's targets (p50 TTFT >= 4x lower, requests/s >= 3x).

``gpu_serve.json`` and ``gpu_serve.md`` are rewritten after every phase and method (a run stopped by
its budget or a SIGTERM keeps what finished, marked ``partial``), ``gpu_serve.png`` after each method.

    python benchmarks/gpu/gpu_serve.py --out DIR [--shape auto|7b|3b] [--budget-s 240]
    python benchmarks/gpu/gpu_serve.py --out DIR --dry-run     # CPU, tiny model, a few seconds

``--dry-run``: the same flow on the CPU in fp32 with a tiny Qwen2 config (2 layers, the real
tokenizer), small chunks, 2 clients, a few requests per method: what the test suite runs.
``--save-tokenizer`` regenerates ``qwen2_tokenizer/`` from the packaged ``qwen2.5-0.5b``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TOKENIZER_DIR = HERE / "qwen2_tokenizer"
#: ``--shape`` -> ``gpu_bench.qwen_config`` name.
SHAPES = {"7b": "qwen2.5-7b", "3b": "qwen2.5-3b", "tiny": "tiny"}
#: Qwen2's special tokens, as the carried tokenizer numbers them.
BOS_ID, EOS_ID = 151643, 151645
#: The 7B shape needs this much of the budget (checkpoint ~15 GB written and read twice, ingest, server
#: start: ~60-80 s by estimate) to leave the methods more than a few seconds each; below it, the 3B shape.
SEVEN_B_MIN_BUDGET_S = 140
#: Free disk (checkpoint + store) and free GPU memory the 7B shape needs, in GB.
SEVEN_B_DISK_GB, SEVEN_B_GPU_GB = 24, 40
TARGET_TTFT_X, TARGET_RPS_X = 4.0, 3.0
#: The tiny dry run: every size small enough for a test on two CPU cores.
DRY = {"shape": "tiny", "device": "cpu", "dtype": "float32", "chunks": 24, "chunk_tokens": 64, "docs": 4,
       "questions": 4, "clients": 2, "seconds": 3.0, "max_requests": 6, "max_tokens": 4, "budget_s": 90.0,
       "memory_budget_mb": 64, "device_kv_budget_mb": 32}


class Interrupted(Exception):
    """SIGTERM (the shell script's ``timeout``): stop, save what finished, shut the server down."""


class BudgetEnded(Exception):
    """``--budget-s`` ran out before the measurements (a phase took longer than what was left)."""


# -- the checkpoint -----------------------------------------------------------------------------


def save_tokenizer(folder: Path = TOKENIZER_DIR) -> list[Path]:
    """The packaged ``qwen2.5-0.5b``'s tokenizer files, ``tokenizer.json`` compacted (minified, merges as
    ``"a b"`` strings: 4.8 MB instead of 11 MB; the same vocabulary and encodings, checked here)."""
    from transformers import AutoTokenizer

    from fusionrag.models import load_model

    tok = load_model("qwen2.5-0.5b", device="cpu").tokenizer
    folder.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(folder)
    path = folder / "tokenizer.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    merges = data["model"]["merges"]
    if merges and not isinstance(merges[0], str) and all(" " not in a + b for a, b in merges):
        data["model"]["merges"] = [f"{a} {b}" for a, b in merges]
    path.write_text(json.dumps(data, separators=(",", ":"), ensure_ascii=False), encoding="utf-8")
    again = AutoTokenizer.from_pretrained(folder)
    sample = "Déjà vu: 3 tokenizers, one vocabulary.\n  def f(x): return x**2  # 数字"
    if again.get_vocab() != tok.get_vocab() or again(sample)["input_ids"] != tok(sample)["input_ids"]:
        raise RuntimeError("the compacted tokenizer.json encodes differently")
    return sorted(folder.iterdir())


def model_config(shape: str):
    """``gpu_bench``'s shape with Qwen2's special token ids; the tiny one with the tokenizer's vocabulary."""
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    from gpu_bench import qwen_config

    config = qwen_config(SHAPES[shape])
    if shape == "tiny":  # the real tokenizer's ids must fit: its vocabulary, tied to keep the file small
        config.vocab_size, config.tie_word_embeddings = 151936, True
    config.bos_token_id, config.eos_token_id, config.pad_token_id = BOS_ID, EOS_ID, BOS_ID
    return config


def save_checkpoint(folder: Path, shape: str, device: str, dtype: str) -> dict[str, Any]:
    """A random model of ``shape`` built on ``device`` (no detour of 7B through the CPU's init), saved with
    the tokenizer; its weights hashed (in parallel) so ``ingest`` and ``serve`` find the hash memoised."""
    import torch
    from transformers import AutoModelForCausalLM

    from fusionrag.models.compat import check_supported
    from fusionrag.models.fingerprint import weights_hash

    config = model_config(shape)
    check_supported(config)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype), attn_implementation="sdpa")
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    built = time.perf_counter() - t0
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(folder, max_shard_size="2GB")
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    for f in TOKENIZER_DIR.iterdir():
        shutil.copy2(f, folder / f.name)
    saved = time.perf_counter() - t0 - built
    t1 = time.perf_counter()
    weights_hash(folder)
    shards = sorted(folder.glob("*.safetensors"))
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    return {"shape": shape, "params": params, "bytes": sum(f.stat().st_size for f in shards), "shards": len(shards),
            "build_s": round(built, 2), "save_s": round(saved, 2), "hash_s": round(time.perf_counter() - t1, 2),
            "layers": config.num_hidden_layers, "hidden": config.hidden_size,
            "heads": f"{heads}/{kv_heads}x{config.hidden_size // heads}",
            "intermediate": config.intermediate_size, "vocab": config.vocab_size}


def choose_shape(requested: str, budget_s: float, workdir: Path, device: str) -> tuple[str, str | None]:
    """``requested``, or for ``auto`` the 7B shape where budget, disk and GPU memory allow it (else 3B, and why)."""
    if requested != "auto":
        return requested, None
    why = []
    if budget_s < SEVEN_B_MIN_BUDGET_S:
        why.append(f"a budget of {budget_s:.0f} s < {SEVEN_B_MIN_BUDGET_S} s")
    free_disk = shutil.disk_usage(workdir).free / 1e9
    if free_disk < SEVEN_B_DISK_GB:
        why.append(f"{free_disk:.0f} GB free on disk < {SEVEN_B_DISK_GB} GB")
    if device.startswith("cuda"):
        import torch

        free_gpu = torch.cuda.mem_get_info()[0] / 1e9
        if free_gpu < SEVEN_B_GPU_GB:
            why.append(f"{free_gpu:.0f} GB free on the GPU < {SEVEN_B_GPU_GB} GB")
    if why:
        return "3b", "the 3B shape instead of the 7B one: " + ", ".join(why)
    return "7b", None


# -- the store ----------------------------------------------------------------------------------


def word_list(tokenizer, n: int = 3000, seed: int = 0) -> list[str]:
    """Lower-case words the tokenizer holds as one token with a leading space: text of about a token a word."""
    words = sorted(t[1:] for t in tokenizer.get_vocab() if t.startswith("Ġ") and t[1:].isascii()
                   and t[1:].isalpha() and t[1:].islower() and 3 <= len(t) - 1 <= 9)
    return random.Random(seed).sample(words, min(n, len(words)))


def sentence(rng: random.Random, words: list[str], lo: int = 8, hi: int = 18, end: str = ".") -> str:
    s = " ".join(rng.choice(words) for _ in range(rng.randint(lo, hi)))
    return s[0].upper() + s[1:] + end


def write_corpus(folder: Path, tokenizer, chunks: int, chunk_tokens: int, per_file: int = 10,
                 seed: int = 0) -> list[Path]:
    """Text files of about ``per_file`` chunks each, ``chunks`` in all (the chunker decides: about as many)."""
    rng = random.Random(seed)
    words = word_list(tokenizer, seed=seed)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(math.ceil(chunks / per_file)):
        n = min(per_file, chunks - i * per_file)
        target, tokens, sentences = n * (chunk_tokens - 24), 0, []
        while tokens < target:
            s = sentence(rng, words)
            tokens += len(tokenizer(" " + s, add_special_tokens=False)["input_ids"])
            sentences.append(s)
        paths.append(folder / f"doc{i:03d}.txt")
        paths[-1].write_text("\n".join(" ".join(sentences[j:j + 6]) for j in range(0, len(sentences), 6)) + "\n")
    return paths


def questions(tokenizer, n: int, seed: int = 1) -> list[str]:
    rng, words = random.Random(seed), word_list(tokenizer, seed=0)
    return [sentence(rng, words, 10, 14, "?") for _ in range(n)]


# -- subprocesses -------------------------------------------------------------------------------


def cli_env(dry_run: bool) -> dict[str, str]:
    """The environment of ``fusionrag`` subprocesses: this checkout's ``src`` first, no hub, no thread storm."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), *filter(None, [env.get("PYTHONPATH")])])
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    if dry_run:  # a shared CPU: one thread each
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return env


def fusionrag_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "fusionrag.cli", *args]


def ingest(files_dir: Path, store: Path, ckpt: Path, args: argparse.Namespace, log: Path,
           timeout_s: float) -> dict[str, Any]:
    """``fusionrag ingest`` in a subprocess; its JSON report's counts."""
    cmd = fusionrag_cmd("ingest", str(files_dir), "--store", str(store), "--model", str(ckpt), "--device",
                        args.device, "--dtype", args.dtype, "--chunk-tokens", str(args.chunk_tokens),
                        "--embedder", "hashing-384", "--quiet", "--json")
    t0 = time.perf_counter()
    if timeout_s <= 0:
        raise BudgetEnded("before ingest")
    with open(log, "w") as err:
        try:
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=cli_env(args.dry_run),
                                  timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise BudgetEnded(f"during ingest ({timeout_s:.0f} s)") from None
    if proc.returncode != 0:
        raise RuntimeError(f"ingest failed ({proc.returncode}): {_tail(log)}")
    report = json.loads(proc.stdout[proc.stdout.index("{"):])
    return {"seconds": round(time.perf_counter() - t0, 2), "chunks": report.get("new_chunks"),
            "files": report.get("files"), "plain_kv_s": report.get("plain_seconds"),
            "command": " ".join(["fusionrag", *cmd[3:]])}


def _tail(path: Path, n: int = 1500) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """``fusionrag serve`` in a subprocess on loopback; stopped (SIGTERM, then SIGKILL) on exit."""

    def __init__(self, cmd: list[str], env: dict[str, str], log: Path, base_url: str) -> None:
        self.cmd, self.env, self.log, self.base_url = cmd, env, log, base_url
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Server:
        self._log = open(self.log, "w")  # closed in __exit__
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env)
        return self

    def wait_ready(self, timeout_s: float) -> float:
        """Seconds until ``/ready`` answered 200 (the model loaded); raises if the server exits or the time
        runs out (:class:`BudgetEnded`)."""
        import httpx

        t0 = time.perf_counter()
        if timeout_s <= 0:
            raise BudgetEnded("before the server started")
        while time.perf_counter() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}): {_tail(self.log)}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.base_url + "/ready", timeout=2.0, trust_env=False).status_code == 200:
                    return time.perf_counter() - t0
            time.sleep(0.25)
        raise BudgetEnded(f"while the server loaded its model ({timeout_s:.0f} s)")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()


class GpuMemory:
    """``nvidia-smi``'s memory.used (MiB) of GPU 0, sampled in a thread while a method runs (None without one)."""

    def __init__(self, interval_s: float = 0.5) -> None:
        self.exe = shutil.which("nvidia-smi")
        self.interval_s = interval_s
        self.samples: list[int] = []
        self._stop = threading.Event()

    def read(self, field: str = "memory.used") -> int | None:
        if self.exe is None:
            return None
        try:
            out = subprocess.run([self.exe, f"--query-gpu={field}", "--format=csv,noheader,nounits", "-i", "0"],
                                 capture_output=True, text=True, timeout=5)
            return int(out.stdout.strip().splitlines()[0])
        except (OSError, ValueError, IndexError, subprocess.SubprocessError):
            return None

    @contextlib.contextmanager
    def sampling(self) -> Iterator[GpuMemory]:
        self.samples, self._stop = [], threading.Event()

        def loop() -> None:
            while not self._stop.is_set():
                v = self.read()
                if v is not None:
                    self.samples.append(v)
                self._stop.wait(self.interval_s)

        t = threading.Thread(target=loop, daemon=True)
        if self.exe is not None:
            t.start()
        try:
            yield self
        finally:
            self._stop.set()
            if t.is_alive():
                t.join(10)

    @property
    def peak(self) -> int | None:
        return max(self.samples) if self.samples else None


#: ``/metrics`` series kept (Prometheus names: counters end in ``_total``).
METRICS = ("fusionrag_recomputed_tokens_total", "fusionrag_reused_tokens_total", "fusionrag_context_tokens_total",
           "fusionrag_fused_fallbacks_total", "fusionrag_decode_steps_total", "fusionrag_decode_rows_total",
           "fusionrag_prefix_cache_lookups_total", "fusionrag_kv_tier_bytes", "fusionrag_kv_tier_items",
           "fusionrag_cuda_memory_")


def scrape(base_url: str) -> dict[str, float]:
    """The kept ``/metrics`` series ({} when the scrape fails)."""
    import httpx

    try:
        return parse_metrics(httpx.get(base_url + "/metrics", timeout=10.0, trust_env=False).text)
    except httpx.HTTPError:
        return {}


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> ``{"name{labels}": value}`` for the series of :data:`METRICS`."""
    out = {}
    for line in text.splitlines():
        if line.startswith(METRICS):
            key, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                out[key] = float(value)
    return out


def metrics_delta(before: dict[str, float], after: dict[str, float], method: str) -> dict[str, Any]:
    """What one method did on the server: recomputed share, mean decode batch, fallbacks; the tier's size after."""
    def total(name: str, *label: str) -> float:
        keys = [k for k in after if k.partition("{")[0] == name and all(x in k for x in label)]
        return sum(after[k] - before.get(k, 0.0) for k in keys)

    of_method = f'method="{method}"'
    context = total("fusionrag_context_tokens_total", of_method)
    recomputed = total("fusionrag_recomputed_tokens_total", of_method)
    steps, rows = total("fusionrag_decode_steps_total"), total("fusionrag_decode_rows_total")
    return {"context_tokens": context, "recomputed_tokens": recomputed,
            "recomputed_share": round(recomputed / context, 4) if context else None,
            "mean_decode_batch": round(rows / steps, 2) if steps else None,
            "fused_fallbacks": total("fusionrag_fused_fallbacks_total"),
            "passages_computed_on_the_fly": total("fusionrag_prefix_cache_lookups_total", 'result="computed"'),
            "kv_tier": {k: v for k, v in after.items()
                        if k.partition("{")[0] in ("fusionrag_kv_tier_bytes", "fusionrag_kv_tier_items")},
            "cuda_memory": {k: v for k, v in after.items() if k.startswith("fusionrag_cuda_memory_")}}


def retrieve_items(base_url: str, qs: list[str], k: int) -> list[dict]:
    """Each question with its ``k`` stored chunks from ``POST /v1/retrieve``, sent back as ``documents``."""
    import httpx

    items = []
    with httpx.Client(base_url=base_url, timeout=60.0, trust_env=False) as client:
        for q in qs:
            r = client.post("/v1/retrieve", json={"query": q, "top_k": k})
            r.raise_for_status()
            docs = [{"title": d["title"], "text": d["text"]} for d in r.json()["data"]]
            if len(docs) < k:
                raise RuntimeError(f"/v1/retrieve gave {len(docs)} chunks, not {k}: the store is too small")
            items.append({"question": q, "documents": docs})
    return items


# -- the run ------------------------------------------------------------------------------------


def _meta(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import transformers

    gpu = torch.cuda.get_device_name(0) if args.device.startswith("cuda") and torch.cuda.is_available() else None
    return {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "dry_run": args.dry_run,
            "device": args.device, "gpu": gpu, "dtype": args.dtype, "attention": args.attention,
            "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "requested_shape": args.shape, "chunk_tokens": args.chunk_tokens,
            "docs_per_request": args.docs, "questions": args.questions, "clients": args.clients,
            "seconds_per_method": args.seconds, "max_requests_per_method": args.max_requests,
            "max_tokens": args.max_tokens, "budget_s": args.budget_s, "memory_budget_mb": args.memory_budget_mb,
            "device_kv_budget_mb": args.device_kv_budget_mb,
            "weights": "random (timing does not depend on weight values)",
            "ttft": "client-side: request sent to the first streamed chunk (queueing included)"}


def ratios(cells: list[dict]) -> dict[str, Any]:
    """fusionrag against full on the same server: p50 TTFT lower by, requests/s and tokens/s higher by."""
    by = {c["method"]: c for c in cells if c.get("ok")}
    full, fr = by.get("full"), by.get("fusionrag")
    if not full or not fr:
        return {}

    def x(a: float | None, b: float | None) -> float | None:
        return round(a / b, 2) if a and b else None

    out = {"ttft_p50_speedup": x(full["ttft_ms_p50"], fr["ttft_ms_p50"]),
           "ttft_p99_speedup": x(full["ttft_ms_p99"], fr["ttft_ms_p99"]),
           "requests_per_s_x": x(fr["throughput_rps"], full["throughput_rps"]),
           "tokens_per_s_x": x(fr["throughput_tok_s"], full["throughput_tok_s"])}
    out["targets"] = {
        f"p50 TTFT >= {TARGET_TTFT_X:g}x lower": None if out["ttft_p50_speedup"] is None
        else out["ttft_p50_speedup"] >= TARGET_TTFT_X,
        f"requests/s >= {TARGET_RPS_X:g}x": None if out["requests_per_s_x"] is None
        else out["requests_per_s_x"] >= TARGET_RPS_X}
    return out


def measure_method(base_url: str, items: list[dict], spec: str, args: argparse.Namespace, deadline: float,
                   methods_left: int, gpu: GpuMemory) -> dict[str, Any]:
    """A warm-up round, then the closed loop for this method's share of what is left (``skipped``, saying why,
    when that share is shorter than the two rounds it must leave: this method's drain, the next one's warm-up)."""
    from fusionrag.bench.loadtest import closed_loop

    timeout = max(10.0, deadline - time.monotonic())
    t0 = time.monotonic()
    warm = closed_loop(base_url, items, spec, clients=args.clients, duration_s=None, n_requests=args.clients,
                       max_tokens=args.max_tokens, timeout_s=timeout)
    round_s = time.monotonic() - t0  # one round at full load: what the drain of the measured loop takes
    share = (deadline - time.monotonic()) / methods_left
    duration = min(args.seconds, share - 2 * round_s)  # this method's drain, the next one's warm-up
    if duration <= 0:
        return {"method": spec.partition(":")[0], "skipped": f"no budget left ({share:.1f} s share, a round takes "
                f"{round_s:.1f} s)", "warmup": _brief(warm)}
    before = scrape(base_url)
    with gpu.sampling():
        cell = closed_loop(base_url, items, spec, clients=args.clients, duration_s=duration,
                           n_requests=args.max_requests, max_tokens=args.max_tokens,
                           timeout_s=max(10.0, deadline - time.monotonic()))
    cell.update(duration_s=round(duration, 2), warmup=_brief(warm), gpu_memory_peak_mib=gpu.peak,
                server=metrics_delta(before, scrape(base_url), cell["method"]))
    return cell


def _brief(cell: dict) -> dict:
    return {k: cell[k] for k in ("sent", "ok", "wall_s", "ttft_ms_p50", "first_error") if k in cell}


def run(args: argparse.Namespace, save: Callable[[dict], None] = lambda doc: None) -> dict:
    """Every phase in turn, ``save(doc)`` after each; a budget or SIGTERM stop leaves ``status`` partial."""
    t_start = time.monotonic()
    deadline = t_start + args.budget_s - args.reserve_s
    doc: dict[str, Any] = {"meta": _meta(args), "phases": {}, "methods": [], "ratios": {}, "notes": [],
                           "status": "running"}
    out = Path(args.out)
    made_workdir = args.workdir is None
    work = Path(args.workdir or tempfile.mkdtemp(prefix="fusionrag-gpu-serve-"))
    work.mkdir(parents=True, exist_ok=True)
    gpu = GpuMemory()

    def left() -> float:
        return deadline - time.monotonic()

    def phase(name: str, value: dict) -> None:
        doc["phases"][name] = value
        save(doc)

    try:
        shape, why = choose_shape(args.shape, args.budget_s, work, args.device)
        if why:
            doc["notes"].append(why)
        doc["meta"]["shape"] = shape
        ckpt, corpus, store = work / f"random-{SHAPES[shape]}", work / "corpus", work / "store"
        for old in (ckpt, corpus, store):  # a reused --workdir: start clean
            shutil.rmtree(old, ignore_errors=True)
        phase("checkpoint", save_checkpoint(ckpt, shape, args.device, args.dtype))
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(ckpt)
        t0 = time.perf_counter()
        files = write_corpus(corpus, tok, args.chunks, args.chunk_tokens, per_file=args.per_file)
        phase("corpus", {"files": len(files), "seconds": round(time.perf_counter() - t0, 2)})
        phase("ingest", ingest(corpus, store, ckpt, args, out / "gpu_serve_ingest.log", left()))
        port = free_port()
        base_url = f"http://127.0.0.1:{port}"
        max_prompt = max(8192, args.docs * args.chunk_tokens + 2048)
        cmd = fusionrag_cmd("serve", "--store", str(store), "--model", str(ckpt), "--device", args.device,
                            "--dtype", args.dtype, "--attention", args.attention, "--host", "127.0.0.1",
                            "--port", str(port), "--max-prompt-tokens", str(max_prompt),
                            "--max-batch", str(max(8, args.clients)), "--memory-budget-mb",
                            str(args.memory_budget_mb), "--device-kv-budget-mb", str(args.device_kv_budget_mb),
                            "--default-max-tokens", str(args.max_tokens),
                            # the loop repeats contexts: without this a whole-context cache hit would stand in
                            # for the method measured (full would not be full)
                            "--context-cache-mb", "0",
                            "--shutdown-timeout", "5", "--log-level", "warning")
        doc["meta"]["server_command"] = " ".join(["fusionrag", *cmd[3:]])
        doc["gpu_memory"] = {"total_mib": gpu.read("memory.total"), "before_server_mib": gpu.read()}
        with Server(cmd, cli_env(args.dry_run), out / "gpu_serve_server.log", base_url) as server:
            phase("server_start", {"seconds": round(server.wait_ready(left()), 2)})
            doc["gpu_memory"]["after_load_mib"] = gpu.read()
            t0 = time.perf_counter()
            items = retrieve_items(base_url, questions(tok, args.questions), args.docs)
            phase("retrieve", {"questions": len(items), "docs_per_request": args.docs,
                               "seconds": round(time.perf_counter() - t0, 2)})
            specs = [m.strip() for m in args.methods.split(",") if m.strip()]
            for i, spec in enumerate(specs):
                cell = measure_method(base_url, items, spec, args, deadline, len(specs) - i, gpu)
                doc["methods"].append(cell)
                doc["ratios"] = ratios(doc["methods"])
                save(doc)
                _plot(doc, out / "gpu_serve.png")
        doc["notes"].append("the store holds plain KV only (ingest, no preprocess): fusionrag read plain KV for "
                            "every chunk (the fused_fallbacks count); fused KV has the same shape and cost")
        computed = sum(c.get("server", {}).get("passages_computed_on_the_fly") or 0 for c in doc["methods"])
        if computed:
            doc["notes"].append(f"{computed:.0f} passages were not found in the store and computed on the fly")
        skipped = [c["method"] for c in doc["methods"] if c.get("skipped")]
        doc["status"] = f"partial: no budget left for {', '.join(skipped)}" if skipped else "complete"
    except Interrupted as exc:
        doc["status"] = f"partial: interrupted ({exc}) after {time.monotonic() - t_start:.0f} s"
    except BudgetEnded as exc:
        doc["status"] = f"partial: the budget ({args.budget_s:.0f} s) ended {exc}"
    except Exception as exc:
        doc["status"] = f"failed: {type(exc).__name__}: {exc}"[:2000]
        raise
    finally:
        doc["seconds"] = round(time.monotonic() - t_start, 1)
        if made_workdir and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        save(doc)
    return doc


# -- the report ---------------------------------------------------------------------------------


def _fmt(v: Any, spec: str = ",.0f") -> str:
    return "-" if v is None else format(v, spec)


def markdown(doc: dict) -> str:
    m, ph = doc["meta"], doc["phases"]
    ck = ph.get("checkpoint", {})
    dry = " (CPU dry run: exercises the code, measures nothing)" if m["dry_run"] else ""
    lines = ["# The server on a GPU: closed loop, RAG prompts through the OpenAI API", "",
             f"`{m['command']}`  ",
             f"{m['gpu'] or m['device']}{dry}; "
             f"{m.get('shape', m['requested_shape'])} shape ({ck.get('layers', '?')} layers, {ck.get('heads', '?')} "
             f"heads, {_fmt(ck.get('params'))} parameters), {m['dtype']}, random weights, attention {m['attention']}; "
             f"torch {m['torch']}, transformers {m['transformers']}. Status: **{doc['status']}**.", "",
             f"{m['clients']} concurrent clients (closed loop), {m['docs_per_request']} stored chunks of <= "
             f"{m['chunk_tokens']} tokens a request as `documents`, `max_tokens` {m['max_tokens']}, streamed; "
             f"TTFT client-side (queueing included); requests/s and tokens/s over the window in which every "
             "client was busy.", "",
             "| method | ok / sent | prompt tokens | TTFT p50 ms | TTFT p99 ms | requests/s | generated tokens/s "
             "| recomputed | decode batch | GPU memory peak MiB | window s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in doc["methods"]:
        if c.get("skipped"):
            lines.append(f"| {c['method']} | skipped: {c['skipped']} | | | | | | | | | |")
            continue
        srv = c.get("server", {})
        share = srv.get("recomputed_share")
        lines.append(f"| {c['label']} | {c['ok']} / {c['sent']} | {_fmt(c.get('prompt_tokens_p50'))} | "
                     f"{_fmt(c['ttft_ms_p50'], ',.1f')} | {_fmt(c['ttft_ms_p99'], ',.1f')} | "
                     f"{_fmt(c['throughput_rps'], '.2f')} | {_fmt(c['throughput_tok_s'], ',.1f')} | "
                     f"{'-' if share is None else f'{share:.0%}'} | {_fmt(srv.get('mean_decode_batch'), '.1f')} | "
                     f"{_fmt(c.get('gpu_memory_peak_mib'))} | {_fmt(c.get('window_s'), '.1f')} |")
    r = doc.get("ratios") or {}
    if r:
        lines += ["", f"FusionRAG 15% against full on the same server: p50 TTFT speed-up (full / fusionrag) **"
                      f"{_fmt(r['ttft_p50_speedup'], '.2f')}x** (p99 {_fmt(r['ttft_p99_speedup'], '.2f')}x), "
                      f"requests/s **{_fmt(r['requests_per_s_x'], '.2f')}x**, generated tokens/s "
                      f"{_fmt(r['tokens_per_s_x'], '.2f')}x.",
                  "Targets: " + "; ".join(
                      f"{k}: {'-' if v is None else 'met' if v else 'missed'}" for k, v in r["targets"].items())]
    gm = doc.get("gpu_memory") or {}
    if gm.get("total_mib"):
        lines += ["", f"GPU memory (nvidia-smi, MiB): {_fmt(gm.get('total_mib'))} total, "
                      f"{_fmt(gm.get('before_server_mib'))} before the server, {_fmt(gm.get('after_load_mib'))} with "
                      "its model loaded; the peaks above are its caching allocator's, a later method inheriting an "
                      "earlier one's. Chunk KV sits in a GPU tier (`--device-kv-budget-mb`) over a page-locked "
                      "host tier (`--memory-budget-mb`)."]
    measured = [c for c in doc["methods"] if c.get("server")]
    if measured and measured[-1]["server"].get("kv_tier"):
        lines += ["", "KV tiers after the last method (`/metrics`): " + ", ".join(
            f"{k} = {v:,.0f}" for k, v in measured[-1]["server"]["kv_tier"].items())]
    lines += ["", "## Phases", "", "| phase | seconds | detail |", "|---|---|---|"]
    for name, p in ph.items():
        detail = ", ".join(f"{k} {v}" for k, v in p.items() if k not in ("seconds", "command"))
        secs = p.get("seconds", round(p.get("build_s", 0) + p.get("save_s", 0) + p.get("hash_s", 0), 2))
        lines.append(f"| {name} | {secs} | {detail} |")
    if "seconds" in doc:
        lines.append(f"| all | {doc['seconds']} | budget {m['budget_s']:.0f} s |")
    if m.get("server_command"):
        lines += ["", f"Server: `{m['server_command']}`"]
    if doc["notes"]:
        lines += ["", *(f"Note: {n}" for n in doc["notes"])]
    return "\n".join(lines) + "\n"


def _plot(doc: dict, path: Path) -> None:
    """TTFT p50 / p99 and requests/s per method, the ratios in the title (skipped without matplotlib)."""
    cells = [c for c in doc["methods"] if not c.get("skipped") and c.get("ok")]
    try:
        import matplotlib
    except ImportError:
        return
    if not cells:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fusionrag.files import atomic_write_with

    labels = [c["label"] for c in cells]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(12, 4.2))
    xs = range(len(cells))
    for off, key, name in ((-0.2, "ttft_ms_p50", "p50"), (0.2, "ttft_ms_p99", "p99")):
        bars = ax1.bar([x + off for x in xs], [c[key] or 0 for c in cells], width=0.38, label=name)
        ax1.bar_label(bars, fmt="%.0f", fontsize=8)
    ax1.set_title("TTFT (ms, client-side)", fontsize=10)
    ax1.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncols=2, frameon=False)
    for ax, key, title in ((ax2, "throughput_rps", "requests / s"), (ax3, "throughput_tok_s", "generated tokens / s")):
        bars = ax.bar(list(xs), [c[key] or 0 for c in cells], width=0.5, color="tab:green")
        ax.bar_label(bars, fmt="%.2f" if key == "throughput_rps" else "%.0f", fontsize=8)
        ax.set_title(title, fontsize=10)
    for ax in (ax1, ax2, ax3):
        ax.set_xticks(list(xs), labels, fontsize=9)
        ax.margins(y=0.15)
    m, r = doc["meta"], doc.get("ratios") or {}
    title = (f"fusionrag serve, {m.get('shape', '?')} shape on {m['gpu'] or m['device']}"
             f"{' (CPU dry run)' if m['dry_run'] else ''}: {m['clients']} clients, "
             f"{m['docs_per_request']} chunks a request")
    if r.get("ttft_p50_speedup"):
        title += (f"\nfusionrag vs full on the same server: p50 TTFT speed-up {r['ttft_p50_speedup']:.2f}x, "
                  f"requests/s {r['requests_per_s_x']:.2f}x")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    atomic_write_with(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110))
    plt.close(fig)


def _save(out: Path, doc: dict) -> None:
    from fusionrag.files import atomic_write

    atomic_write(out / "gpu_serve.json", json.dumps(doc, indent=2))
    atomic_write(out / "gpu_serve.md", markdown(doc))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", help="folder for gpu_serve.json / .md / .png and the subprocesses' logs")
    p.add_argument("--dry-run", action="store_true", help="CPU, fp32, tiny model and sizes: the whole flow in seconds")
    p.add_argument("--shape", choices=["auto", "7b", "3b", "tiny"], default=None,
                   help="model shape (default auto: 7B where budget, disk and GPU memory allow, else 3B)")
    p.add_argument("--device", default=None, help="default cuda (cpu for --dry-run)")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None, help="default bfloat16")
    p.add_argument("--attention", default="auto", help="the server's sparse-pass backend (default auto: triton on "
                                                       "CUDA)")
    p.add_argument("--chunks", type=int, default=None, help="chunks in the store (about; default 200)")
    p.add_argument("--chunk-tokens", type=int, default=None, help="tokens a chunk (default 512)")
    p.add_argument("--per-file", type=int, default=10, help="chunks per synthetic text file")
    p.add_argument("--docs", type=int, default=None, help="stored chunks a request (default 32: ~16K tokens)")
    p.add_argument("--questions", type=int, default=None, help="distinct questions, each with its chunks "
                                                               "(default 16)")
    p.add_argument("--methods", default="full,fusionrag:0.15", help="method[:ratio], comma-separated, in order")
    p.add_argument("--clients", type=int, default=None, help="concurrent clients (default 8)")
    p.add_argument("--seconds", type=float, default=None, help="closed loop per method at most (default 60; "
                                                               "less where the budget is shorter)")
    p.add_argument("--max-requests", type=int, default=None, help="requests per method at most (default 600)")
    p.add_argument("--max-tokens", type=int, default=None, help="generated tokens a request (default 32)")
    p.add_argument("--memory-budget-mb", type=int, default=None, help="the server's KV memory tier (default 8192: "
                                                                      "every chunk's KV)")
    p.add_argument("--device-kv-budget-mb", type=int, default=None, help="the server's KV tier on the GPU, above "
                   "the memory tier (default 16384: every chunk's plain and fused KV in the 7B shape; 0: none)")
    p.add_argument("--budget-s", type=float, default=None, help="seconds for everything (default 240: a minute "
                                                               "per method after ~100 s of set-up)")
    p.add_argument("--reserve-s", type=float, default=None, help="of the budget, kept for stopping the server "
                                                                 "and saving (default 15; 3 for --dry-run)")
    p.add_argument("--workdir", default=None, help="checkpoint, corpus and store here (default: a temporary "
                                                   "folder, removed after)")
    p.add_argument("--keep", action="store_true", help="keep the temporary folder")
    p.add_argument("--save-tokenizer", action="store_true", help=f"regenerate {TOKENIZER_DIR.name}/ and exit")
    args = p.parse_args(argv)
    full = {"shape": "auto", "device": "cuda", "dtype": "bfloat16", "chunks": 200, "chunk_tokens": 512, "docs": 32,
            "questions": 16, "clients": 8, "seconds": 60.0, "max_requests": 600, "max_tokens": 32,
            "budget_s": 240.0, "memory_budget_mb": 8192, "device_kv_budget_mb": 16384}
    for key, value in (DRY if args.dry_run else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.reserve_s is None:
        args.reserve_s = 3.0 if args.dry_run else 15.0
    if not args.save_tokenizer and not args.out:
        p.error("--out is required")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.save_tokenizer:
        for f in save_tokenizer():
            print(f"{f.relative_to(ROOT)}: {f.stat().st_size:,} bytes")
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def on_term(signum: int, _frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one stop: the cleanup is not interrupted again
        raise Interrupted(f"signal {signum}")

    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, on_term) if main_thread else None
    try:
        doc = run(args, save=lambda d: _save(out, d))
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
    print(markdown(doc))
    return 0 if doc["status"] == "complete" else 1


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "src"))
    raise SystemExit(main())
