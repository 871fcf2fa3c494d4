"""Architectures whose KV cannot be re-positioned by rotation are refused clearly."""

import pytest
from transformers import AutoConfig

from fusionrag.errors import UnsupportedModelError
from fusionrag.models.compat import check_supported, exact_context_limit
from fusionrag.models.tiny import tiny_config


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "qwen3"])
def test_supported_families_pass(family):
    check_supported(tiny_config(family))
    assert exact_context_limit(tiny_config(family)) is None


def test_a_sliding_window_or_longrope_is_served_up_to_where_reuse_is_exact():
    assert exact_context_limit(tiny_config("mistral", sliding_window=512)) == 512
    qwen_windowed = tiny_config("qwen2", use_sliding_window=True, sliding_window=256, max_window_layers=0)
    assert exact_context_limit(qwen_windowed) == 256
    longrope = AutoConfig.for_model("phi3", rope_parameters={
        "rope_type": "longrope", "short_factor": [1.0] * 16, "long_factor": [2.0] * 16, "rope_theta": 10000.0,
        "original_max_position_embeddings": 2048}, original_max_position_embeddings=2048, max_position_embeddings=8192,
        hidden_size=128, num_attention_heads=4)
    check_supported(longrope)
    assert exact_context_limit(longrope) == 2048


@pytest.mark.parametrize(
    "config, reason",
    [
        (lambda: AutoConfig.for_model("gpt2", n_layer=1), "not supported"),
        (lambda: AutoConfig.for_model("bloom", n_layer=1), "ALiBi"),
        (lambda: tiny_config("llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                        "rope_theta": 10000.0}), "dynamic"),
        (lambda: AutoConfig.for_model("gemma3_text", num_hidden_layers=2), "two rope bases"),
        (lambda: AutoConfig.for_model("gemma2", num_hidden_layers=2), "soft-caps"),
    ],
)
def test_unsupported_are_refused_with_reason(config, reason):
    with pytest.raises(UnsupportedModelError, match=reason):
        check_supported(config())


def test_local_checkpoint_of_unsupported_arch_is_refused_before_loading(tmp_path, fusionrag_home):
    from fusionrag.models import load_model

    AutoConfig.for_model("gemma2", num_hidden_layers=2).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="Gemma 2"):
        load_model(str(tmp_path))


def test_unknown_model_name_is_a_clear_error(fusionrag_home):
    from fusionrag.errors import FusionRAGError
    from fusionrag.models import load_model

    with pytest.raises(FusionRAGError, match="unknown model"):
        load_model("no-such-model")
