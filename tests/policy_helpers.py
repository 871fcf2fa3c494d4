"""The assembled-context fixture the selection-policy tests share (product policies and studies' variants)."""

import torch

from fusionrag.execution.attention import prefill_with_context_attention
from fusionrag.execution.forward import prefill, to_dynamic_cache
from fusionrag.execution.segments import chunk_kv_plain
from fusionrag.models.rope import rotate_half
from fusionrag.online.policies import SelectionInput
from fusionrag.online.prefill import assemble_context

GEN = torch.Generator().manual_seed(7)


def selection_setup(lm, lengths=(40, 29, 35)):
    system = torch.randint(0, 250, (6,), generator=GEN).tolist()
    chunks = [torch.randint(0, 250, (n,), generator=GEN).tolist() for n in lengths]
    question = torch.randint(0, 250, (7,), generator=GEN).tolist()
    s_kv, _ = prefill(lm, torch.tensor(system))
    kvs, scores = [], []
    for c in chunks:
        kvs.append(chunk_kv_plain(lm, s_kv, c))
        # Cache-Craft scores as preprocess records them (here: context = S only, enough for shape tests)
        scores.append(prefill_with_context_attention(lm, torch.tensor(c), s_kv, context_start=0)[1])
    ctx, ids, spans = assemble_context(lm, s_kv, kvs, system, chunks)
    inp = SelectionInput(lm, ctx, ids, spans, torch.tensor(question), chunk_scores=scores)
    return system, chunks, question, inp


def eager_attentions(lm, inp):
    """Reference: the model's own eager attention weights of the question over the assembled cache, per layer."""
    model, T, q = lm.model, len(inp.context), inp.question_token_ids.numel()
    model.set_attn_implementation("eager")
    try:
        out = model(input_ids=inp.question_token_ids[None], position_ids=torch.arange(T, T + q)[None],
                    cache=to_dynamic_cache(inp.context), use_cache=True, output_attentions=True)
    finally:
        model.set_attn_implementation("sdpa")
    return out.attentions


def queries_by_hand(lm, q_proj_out: torch.Tensor, positions: torch.Tensor, layer: int = -1) -> torch.Tensor:
    """A Llama-style layer's raw ``q_proj`` output -> its queries ``[heads, n, head_dim]`` (fp32): the per-head
    norm where the layer has one (Qwen3), then the model's rotary embedding at ``positions``."""
    a = lm.adapter
    q = q_proj_out.reshape(1, -1, a.num_heads, a.head_dim)
    q_norm = getattr(a.attention(layer), "q_norm", None)
    if q_norm is not None:
        q = q_norm(q)
    q = q.transpose(1, 2)
    cos, sin = a.rotary(q, positions.reshape(1, -1).to(q.device))
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (q * cos + rotate_half(q) * sin)[0].float()
