"""What ``fusionrag doctor`` says about a model's family: how its keys rotate, where reuse stops being exact,
and how each engine serves it.

Static facts from the checkpoint's config (no weights): the family and rope type, the rotary dimensions
(partial rotary rotates only the first ones), the head layout, the exact-reuse limit
(:func:`~fusionrag.models.compat.exact_context_limit`), and, for vLLM with fusionrag's connector, how vLLM
0.32 runs the family and what to start it with. The numeric checks (ratio 1 = Full Attention, a moved key =
the key computed there) are the doctor's own, per dtype; the connector proves the rotation again when vLLM
starts (:func:`fusionrag.vllm.passes.check_rotation`).
"""

from __future__ import annotations

from typing import Any

from fusionrag.models.compat import exact_context_limit, limit_reason, rope_parameters, rope_type_of

#: How vLLM 0.32 runs each family fusionrag serves (the connector drives either kind of body).
VLLM_BODY = {"olmo2": "vLLM's Transformers backend", "gpt_neox": "vLLM's Transformers backend"}
#: What vLLM needs to be started with, or cannot do, per family (beyond ``--kv-transfer-config``).
VLLM_NOTES = {
    "stablelm": "vLLM 0.32 loads StableLM without per-head q/k layernorm: a checkpoint with qk_layernorm does "
                "not load in vLLM",
}


def family_report(config: Any) -> dict:
    """The family facts of ``config`` (see the module doc), JSON-ready."""
    model_type = getattr(config, "model_type", "?")
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    partial = float(rope_parameters(config).get("partial_rotary_factor", 1.0) or 1.0)
    limit = exact_context_limit(config)
    rope = rope_type_of(config)
    vllm = [f"served ({VLLM_BODY.get(model_type, 'natively')})"]
    if rope == "longrope" and limit:
        vllm.append(f"start vLLM with --max-model-len {limit} or less (past it vLLM rotates every position with "
                    "the long factors; the connector refuses to start)")
    if model_type in VLLM_NOTES:
        vllm.append(VLLM_NOTES[model_type])
    return {"family": model_type, "rope_type": rope, "rotary_dims": f"{int(head_dim * partial)} of {head_dim}",
            "query_heads": heads, "kv_heads": int(getattr(config, "num_key_value_heads", None) or heads)
            if model_type != "gpt_neox" else heads,
            "exact_reuse_limit": limit, "limit_reason": limit_reason(config) if limit else None,
            "vllm_connector": "; ".join(vllm)}


def table(report: dict) -> str:
    """``fusionrag doctor``'s report as one Markdown table (the family, then each check per dtype)."""
    fam = report.get("family", {})
    dtypes = [k for k in report if isinstance(report[k], dict) and "ok" in report[k]]
    lines = [f"{report['model']} on {report['device']}: family {fam.get('family')} (rope {fam.get('rope_type')}, "
             f"rotary {fam.get('rotary_dims')} dims, {fam.get('query_heads')} query / {fam.get('kv_heads')} KV heads)",
             "", "| check | " + " | ".join(dtypes) + " |", "|---|" + "---|" * len(dtypes)]
    rows = [("ratio 1 = Full Attention (max abs logit gap)", "ratio1_max_abs_logit_diff"),
            ("one reused chunk = Full Attention (max abs logit gap)", "reuse_single_chunk_max_abs_logit_diff"),
            ("chunk moved by rotation = computed there (relative key gap)", "rope_shift_rel_key_diff"),
            ("Full Attention decodes transformers' greedy tokens", "fa_matches_transformers_generate"),
            ("all checks within tolerance", "ok")]
    for label, key in rows:
        cells = [_cell(report[d].get(key)) for d in dtypes]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    limit = fam.get("exact_reuse_limit")
    said = f"{limit} tokens, {fam.get('limit_reason')}" if limit else "none"
    lines += ["", f"exact-reuse limit: {said}", f"vLLM + fusionrag's connector: {fam.get('vllm_connector')}"]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "**no**"
    if isinstance(value, float):
        return f"{value:.1e}"
    return "" if value is None else str(value)
