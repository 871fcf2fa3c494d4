"""End-to-end check of the engine workers on a real ~4K-token RAG prompt (run with the project's .venv).

    .venv/bin/python benchmarks/engines/smoke_workers.py --engine vllm --core 1
    .venv/bin/python benchmarks/engines/smoke_workers.py --engine llama --gguf FILE  (default: the bf16 GGUF)

Builds two prompts with the qwen2.5-0.5b tokenizer and chat template: passages of the 2WikiMQA file
(about --tokens tokens) and question 1, then the same passages and question 2, so the two share
everything up to the question. Starts the worker under `taskset -c CORE` with --threads 1 and asks:
A cold, B keep (reuses A's context), B cold (the same ids without reuse: its first token must
match the keep one). --reference adds transformers' fp32 greedy first token for A and B.
Prints one JSON line per reply and a summary; this is a check, not the benchmark (the driver is
engines_bench.py).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_DATA = HERE.parents[2] / "shared" / "data" / "2wikimqa" / "2wikimqa_dev_bm25_hipporag.jsonl"
SYSTEM = "Answer the question using the passages. Reply with a short answer only."


def build_prompts(tokenizer, data: Path, target: int) -> tuple[list[int], list[int]]:
    rows = [json.loads(line) for line in data.open() if line.strip()]
    passages, total = [], 0
    for row in rows:
        for p in row["passages"]:
            text = f"Passage: {p['title']}\n{p['text']}\n"
            n = len(tokenizer(text, add_special_tokens=False)["input_ids"])
            if total + n > target:
                break
            passages.append(text)
            total += n
        else:
            continue
        break
    context = "\n".join(passages)

    def ids(question: str) -> list[int]:
        messages = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"{context}\nQuestion: {question}"}]
        out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        out = out["input_ids"] if hasattr(out, "keys") else out
        return [int(i) for i in out]

    return ids(rows[0]["question"]), ids(rows[1]["question"])


class Worker:
    def __init__(self, cmd: list[str], log_path: Path):
        self.log = log_path.open("w")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True, bufsize=1)
        self.ready = self.read()

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker exited (rc={self.proc.wait()}); see {self.log.name}")
        return json.loads(line)  # every stdout line must be protocol JSON

    def ask(self, req: dict) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        try:
            self.ask({"op": "quit"})
        finally:
            self.proc.wait(timeout=120)
            self.log.close()


def reference_first_tokens(folder: Path, prompts: list[list[int]]) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    out = []
    with torch.inference_mode():
        for ids in prompts:
            logits = model(torch.tensor([ids]), logits_to_keep=1).logits
            out.append(int(torch.argmax(logits[0, -1])))
    return out


def main(argv=None) -> int:
    from transformers import AutoTokenizer

    from fusionrag.models.gguf import converted_dir
    from fusionrag.models.registry import PACKAGED
    from fusionrag.paths import fusionrag_home

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", choices=["vllm", "llama"], required=True)
    p.add_argument("--model", type=Path, default=None, help="safetensors folder (default: fusionrag's qwen2.5-0.5b)")
    p.add_argument("--gguf", type=Path, default=None, help="GGUF for llama (default: the bf16 conversion)")
    p.add_argument("--dtype", default="bfloat16", help="vLLM dtype")
    p.add_argument("--core", default="1", help="taskset -c value")
    p.add_argument("--tokens", type=int, default=4096, help="context tokens (passages)")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA)
    p.add_argument("--worker-arg", action="append", default=[], help="extra worker argument (repeatable)")
    p.add_argument("--reference", action="store_true", help="also transformers fp32 first tokens")
    args = p.parse_args(argv)

    folder = args.model or converted_dir(PACKAGED["qwen2.5-0.5b"])
    tokenizer = AutoTokenizer.from_pretrained(folder)
    a, b = build_prompts(tokenizer, args.data, args.tokens)
    shared = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    print(json.dumps({"prompt_a": len(a), "prompt_b": len(b), "shared_prefix": shared}), flush=True)

    venv = HERE / ".venvs" / args.engine / "bin" / "python"
    if args.engine == "vllm":
        cmd = [str(venv), str(HERE / "vllm_worker.py"), "--model", str(folder), "--threads", "1", "--dtype", args.dtype]
    else:
        gguf = args.gguf or fusionrag_home() / "engines" / "qwen2.5-0.5b-bf16.gguf"
        cmd = [str(venv), str(HERE / "llama_worker.py"), "--gguf", str(gguf), "--threads", "1"]
    cmd = ["taskset", "-c", args.core, *cmd, *args.worker_arg]
    log_path = HERE / ".venvs" / "logs" / f"smoke-{args.engine}.stderr"
    t0 = time.perf_counter()
    w = Worker(cmd, log_path)
    print(json.dumps({"ready_after_s": round(time.perf_counter() - t0, 1), **w.ready}), flush=True)
    replies = {}
    try:
        for name, ids, cache in (("A cold", a, "cold"), ("B keep", b, "keep"), ("B cold", b, "cold")):
            r = w.ask({"op": "ttft", "ids": ids, "cache": cache})
            replies[name] = r
            print(json.dumps({"request": name, **r}), flush=True)
    finally:
        w.close()
    summary = {f"{k} ttft_s": round(v["ttft_s"], 3) for k, v in replies.items() if "ttft_s" in v}
    summary.update({f"{k} first_token": v.get("first_token") for k, v in replies.items()})
    if args.reference:
        ra, rb = reference_first_tokens(folder, [a, b])
        summary.update({"reference fp32 A": ra, "reference fp32 B": rb})
    print(json.dumps(summary), flush=True)
    ok = all("ttft_s" in v for v in replies.values()) and \
        replies["B keep"]["first_token"] == replies["B cold"]["first_token"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
