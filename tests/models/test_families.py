"""Every family fusionrag serves is exact in its engine, or refused with a reason.

Tiny random checkpoints (``tests/family_helpers.py``): Llama with plain, Llama-3 and linear rope, Qwen2 with
YaRN, Qwen3, Qwen3-MoE, Mistral with a sliding window, Phi-3 (fused qkv) with full, partial and longrope
rotary, Granite (multipliers), OLMo 2 (norms after the projection), StableLM and GPT-NeoX (partial rotary).
fp32: recomputing 100% equals Full Attention within 1e-4, a chunk moved by rotation equals it computed there,
Full Attention decodes ``transformers``' own greedy tokens (``fusionrag doctor``'s checks), and the
selection's scores are the model's own last-layer attention.
"""

from __future__ import annotations

import pytest
import torch

from family_helpers import FAMILIES, REFUSED, family_model
from fusionrag.doctor import run_doctor
from fusionrag.errors import UnsupportedModelError
from fusionrag.models import wrap_model
from fusionrag.models.compat import check_supported
from fusionrag.models.tiny import byte_tokenizer
from fusionrag.online.policies import question_attention
from policy_helpers import eager_attentions, selection_setup


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_lm(request):
    return wrap_model(family_model(request.param), byte_tokenizer(), name=request.param)


def test_ratio_one_is_full_attention_and_rotation_is_exact(family_lm):
    report = run_doctor(family_lm, generate_tokens=8)
    assert report["ratio1_max_abs_logit_diff"] < 1e-4, report
    assert report["reuse_single_chunk_max_abs_logit_diff"] < 1e-4, report
    assert report["rope_shift_rel_key_diff"] < 1e-4, report
    assert report["fa_matches_transformers_generate"] and report["ok"], report


def test_selection_scores_are_the_models_own_last_layer_attention(family_lm):
    """Captured queries are the family's own (fused projections, norms before or after, partial rotary)."""
    _, _, _, inp = selection_setup(family_lm)
    T = len(inp.context)
    att = eager_attentions(family_lm, inp)[-1][0]  # [heads, q, T + q]
    assert torch.allclose(question_attention(inp), att.sum(dim=(0, 1))[:T][inp.candidates], atol=1e-5)


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_families_that_cannot_be_served_are_refused_with_the_reason(case):
    config, reason = REFUSED[case]
    with pytest.raises(UnsupportedModelError, match=reason):
        check_supported(config())


def test_a_windowed_model_answers_within_its_window_and_refuses_a_longer_prompt_in_one_line(tmp_path):
    """Mistral with a 600-token window: a prompt within it is answered (its answer stops at the window);
    a longer one is a clear ``context_length_exceeded`` naming the window, before any prefill."""
    from fusionrag.errors import PromptTooLongError
    from fusionrag.offline import build
    from fusionrag.online.engine import Engine
    from fusionrag.retrieval.embedder import HashingEmbedder
    from fusionrag.sample import load_sample

    model = family_model("mistral-window")
    model.config.sliding_window = 600
    lm = wrap_model(model, byte_tokenizer(), name="tiny-mistral-600")
    assert lm.exact_context_limit == 600
    store = build.create_store(tmp_path / "kb", lm, chunk_tokens=4096, kv_dtype="float32",
                               embedder=HashingEmbedder(), model_source="tiny-mistral-600")
    example = load_sample()[0]
    build.add_passages(store, lm, example["passages"], doc="sample")
    engine = Engine(store, lm)
    short = engine.answer(example["question"], chunks=example["passages"][:1], max_new_tokens=4)
    assert short.prompt_tokens <= 600 and len(short.token_ids) >= 1
    near = [{"title": "t", "text": "x " * (290 - short.prompt_tokens // 2)}]
    capped = engine.answer(example["question"], chunks=near, max_new_tokens=64)
    assert capped.prompt_tokens + len(capped.token_ids) <= 600 and capped.finish_reason == "length"
    with pytest.raises(PromptTooLongError, match="window of 600 tokens"):
        engine.answer(example["question"], chunks=example["passages"], max_new_tokens=4)


def test_doctor_reports_a_checkpoints_family_in_one_table(tmp_path, fusionrag_home):
    """``fusionrag doctor --model PATH --table`` on a local checkpoint: the family's rotation and limits, each
    check per dtype, and how vLLM's connector serves it."""
    from fusionrag.cli import main

    folder = tmp_path / "tiny-phi3-longrope"
    family_model("phi3-longrope").save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["doctor", "--model", str(folder), "--dtype", "float32", "--table"])
    text = out.getvalue()
    assert code == 0 and "family phi3 (rope longrope, rotary 32 of 32 dims, 4 query / 2 KV heads)" in text
    assert "| all checks within tolerance | yes |" in text and "exact-reuse limit: 2048 tokens" in text
    assert "--max-model-len 2048" in text
