"""``fusionrag doctor``: check the exactness invariants on a real model.

1. Recomputing 100% of the chunk tokens reproduces Full Attention's logits.
2. A chunk computed at one offset and rotated equals the chunk computed at the target offset.
3. Full Reuse of a single chunk after ``S`` equals Full Attention (exact prefix).
4. The Full Attention path decodes exactly the tokens of ``transformers``' greedy ``generate``.
"""

from __future__ import annotations

import torch

from fusionrag.execution.forward import backend_name, prefill
from fusionrag.execution.generate import greedy_tokens
from fusionrag.execution.segments import chunk_kv_plain
from fusionrag.kvcache.kv import KV
from fusionrag.kvcache.quant import dequantize_kv, quantize_kv
from fusionrag.models.registry import LoadedModel
from fusionrag.online.prefill import (
    all_chunk_indices,
    assemble_context,
    prefill_full,
    prefill_reused,
)
from fusionrag.prompt import PromptBuilder
from fusionrag.sample import load_sample

LOGIT_TOL = 1e-4
# Keys are compared relative to their largest magnitude: the model itself forms angles
# in fp32 (position * inv_freq), which differs from the float64 rotation by ~pos * 1e-7 rad.
KEY_REL_TOL = 1e-4


def run_doctor(lm: LoadedModel, generate_tokens: int = 16) -> dict:
    example = load_sample()[0]
    pb = PromptBuilder(lm.tokenizer)
    chunks = [pb.chunk_token_ids(p["title"], p["text"]) for p in example["passages"]]
    question = pb.question_token_ids(example["question"])
    system_kv, _ = prefill(lm, torch.tensor(pb.system_token_ids))

    full = prefill_full(lm, pb.system_token_ids, chunks, question)
    kvs = [chunk_kv_plain(lm, system_kv, c) for c in chunks]
    ctx, ids, spans = assemble_context(lm, system_kv, kvs, pb.system_token_ids, chunks)
    everything = prefill_reused(lm, ctx, ids, spans, question, all_chunk_indices(spans))
    ratio1 = (everything.last_logits - full.last_logits).abs().max().item()

    one_ctx, one_ids, one_spans = assemble_context(lm, system_kv, kvs[:1], pb.system_token_ids, chunks[:1])
    one_reuse = prefill_reused(lm, one_ctx, one_ids, one_spans, question)
    one_full = prefill_full(lm, pb.system_token_ids, chunks[:1], question)
    single = (one_reuse.last_logits - one_full.last_logits).abs().max().item()

    last = chunks[-1]
    target = len(pb.system_token_ids) + sum(map(len, chunks[:-1]))
    at_target, _ = prefill(lm, torch.tensor(last), start=target)
    shifted = prefill(lm, torch.tensor(last), start=0)[0].moved_to(target, lm.inv_freq)
    key_diff = (shifted.keys - at_target.keys).abs().max().item()
    key_rel = key_diff / at_target.keys.abs().max().item()

    # Storage dtype: the same reuse with chunk KVs stored in fp16 (rotation still in fp32).
    kvs16 = [kv.to(torch.float16) for kv in kvs]
    ctx16, ids16, spans16 = assemble_context(lm, system_kv, kvs16, pb.system_token_ids, chunks)
    reuse32 = prefill_reused(lm, ctx, ids, spans, question)
    reuse16 = prefill_reused(lm, ctx16, ids16, spans16, question)
    fp16_diff = (reuse16.last_logits - reuse32.last_logits).abs().max().item()
    # int8 storage (codes + scales, kvcache.quant): dequantised, then the same fp32 rotation.
    kvs8 = [KV(*dequantize_kv(quantize_kv(kv.keys, kv.values)), kv.base_position) for kv in kvs]
    ctx8, ids8, spans8 = assemble_context(lm, system_kv, kvs8, pb.system_token_ids, chunks)
    int8_diff = (prefill_reused(lm, ctx8, ids8, spans8, question).last_logits - reuse32.last_logits).abs().max().item()
    reuse_gap = (reuse32.last_logits - full.last_logits).abs().max().item()

    ours = list(greedy_tokens(lm, full.kv, full.last_logits, generate_tokens, stop_ids=[]))
    prompt = torch.tensor([[*pb.system_token_ids, *(t for c in chunks for t in c), *question]], device=lm.device)
    ref = lm.model.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=generate_tokens, do_sample=False,
        eos_token_id=None, pad_token_id=lm.stop_token_ids[0] if lm.stop_token_ids else 0,
        temperature=None, top_p=None, top_k=None,
    )[0, prompt.shape[1]:].tolist()

    report = {
        "model": lm.name,
        "fingerprint": lm.fingerprint,
        "device": str(lm.device),
        "attention": backend_name(lm),  # the sparse passes' backend (auto resolved by device)
        "prompt_tokens": int(prompt.shape[1]),
        "ratio1_max_abs_logit_diff": ratio1,
        "reuse_single_chunk_max_abs_logit_diff": single,
        "rope_shift_max_abs_key_diff": key_diff,
        "rope_shift_rel_key_diff": key_rel,
        "rope_shift_delta": target,
        "fp16_storage_max_abs_logit_diff": fp16_diff,
        "int8_storage_max_abs_logit_diff": int8_diff,
        "full_reuse_max_abs_logit_diff": reuse_gap,
        "fa_matches_transformers_generate": ours == ref,
        "generated_tokens": len(ours),
        "tolerances": {"logits": LOGIT_TOL, "key_rel": KEY_REL_TOL},
    }
    exact = ratio1 < LOGIT_TOL and single < LOGIT_TOL and key_rel < KEY_REL_TOL
    report["ok"] = bool(exact and report["fa_matches_transformers_generate"])
    return report
