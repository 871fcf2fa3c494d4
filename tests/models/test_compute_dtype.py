"""``--dtype auto``: bf16 where the CPU has bf16 arithmetic, float32 elsewhere and on request."""

from __future__ import annotations

import argparse
import platform

import pytest
import torch

from fusionrag.errors import FusionRAGError
from fusionrag.models import devices


def _cpuinfo(tmp_path, flags: str):
    path = tmp_path / "cpuinfo"
    path.write_text(f"processor\t: 0\nmodel name\t: Test CPU\nflags\t\t: fpu sse2 avx2 {flags}\n\n"
                    f"processor\t: 1\nflags\t\t: fpu sse2 avx2 {flags}\n")
    return path


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="reads x86 CPU flags")
@pytest.mark.parametrize(("flags", "feature"), [("avx512f avx512_bf16", "AVX512-BF16"),
                                                ("avx512_bf16 amx_tile amx_bf16", "AMX-BF16"),
                                                ("avx512f avx512_vnni", None), ("amx_tile", None)])
def test_the_cpu_bf16_feature_comes_from_its_flags(tmp_path, flags, feature):
    assert devices.cpu_bf16_feature.__wrapped__(_cpuinfo(tmp_path, flags)) == feature


def test_an_unreadable_cpuinfo_means_no_bf16(tmp_path):
    assert devices.cpu_bf16_feature.__wrapped__(tmp_path / "missing") is None


@pytest.mark.parametrize(("feature", "expected"), [("AVX512-BF16", torch.bfloat16), (None, torch.float32)])
def test_auto_is_bf16_only_on_a_cpu_with_bf16(monkeypatch, feature, expected):
    monkeypatch.setattr(devices, "cpu_bf16_feature", lambda: feature)
    assert devices.resolve_dtype(None, "cpu") == devices.resolve_dtype("auto", "cpu") == expected
    assert devices.auto_dtype("cuda")[0] == torch.float32  # GPUs: float32 until a GPU run measures bf16
    said = devices.dtype_choice(None, "cpu")
    assert said.startswith(str(expected).removeprefix("torch.") + " (auto: ")
    assert (feature or "no AMX-BF16") in said


def test_an_asked_dtype_wins_and_a_wrong_one_is_one_line(monkeypatch):
    monkeypatch.setattr(devices, "cpu_bf16_feature", lambda: "AMX-BF16")
    assert devices.resolve_dtype("float32", "cpu") == torch.float32
    assert devices.dtype_choice("float32", "cpu") == "float32 (asked for)"
    with pytest.raises(FusionRAGError, match="auto, float32"):
        devices.resolve_dtype("fp8", "cpu")


def test_the_flag_offers_auto_and_defaults_to_it():
    p = argparse.ArgumentParser()
    devices.add_device_args(p)
    assert p.parse_args([]).dtype is None
    assert p.parse_args(["--dtype", "auto"]).dtype == "auto"
    assert p.parse_args(["--dtype", "float32"]).dtype == "float32"
