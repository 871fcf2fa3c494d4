"""Every sparse-attention backend agrees with the reference (the dense visibility mask).

Random shapes (hypothesis): grouped-query heads, past slots starting at any base, stale
slots, query positions with gaps, queries that see nothing of the past. The Triton kernel
runs under its interpreter on CPU (``TRITON_INTERPRET=1``, tiny shapes); the test skips,
saying why, only where Triton is not installed.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernel is first jitted

from fusionrag.execution.attention_backends import SparseQuery, get_backend, triton_available

BACKENDS = ["reference", "blocked"] + (["triton", "triton-packed"] if triton_available() else [])


def _case(data, max_past=40, groups=(1, 2, 3)):
    hkv = data.draw(st.integers(1, 2), label="kv_heads")
    groups = data.draw(st.sampled_from(list(groups)), label="groups")
    dim = data.draw(st.sampled_from([16, 32]), label="head_dim")
    past_len = data.draw(st.integers(0, max_past), label="past_len")
    base = data.draw(st.integers(0, 5), label="past_base")
    stale_idx = sorted(data.draw(st.sets(st.integers(0, max(past_len - 1, 0)), max_size=past_len), label="stale"))
    stale_idx = [i for i in stale_idx if i < past_len]
    tail = data.draw(st.integers(1, 6), label="question")
    gap = data.draw(st.integers(0, 3), label="gap")  # question positions need not follow the past directly
    end = base + past_len + gap
    positions = [base + i for i in stale_idx] + list(range(end, end + tail))
    if data.draw(st.booleans(), label="query_before_past") and base > 0:
        positions = [0, *positions]  # a query that sees no past slot at all
    n = len(positions)
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    q = torch.randn(hkv * groups, n, dim, generator=g)
    kp, vp = (torch.randn(hkv, past_len, dim, generator=g) for _ in range(2))
    kn, vn = (torch.randn(hkv, n, dim, generator=g) for _ in range(2))
    stale = torch.zeros(past_len, dtype=torch.bool)
    stale[stale_idx] = True
    spec = lambda: SparseQuery(torch.tensor(positions), base, past_len, stale)  # noqa: E731 (fresh memo per backend)
    return (q, kp, vp, kn, vn), spec, dim ** -0.5


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_blocked_backend_equals_reference(data):
    tensors, spec, scale = _case(data)
    block = data.draw(st.sampled_from([1, 2, 5, 64]), label="block")
    ref = get_backend("reference")(*tensors, spec(), scale)
    out = get_backend("blocked")(*tensors, spec(), scale, block=block)
    assert (out - ref).abs().max().item() < 1e-5


@pytest.mark.skipif(not triton_available(), reason="Triton is not installed (pip install triton): kernel untested here")
@settings(max_examples=12, deadline=None)
@given(st.data())
def test_triton_kernel_equals_reference(data):
    tensors, spec, scale = _case(data)
    ref = get_backend("reference")(*tensors, spec(), scale)
    tiles = {"block_m": 16, "block_n": 16}  # several blocks, ragged ends
    out = get_backend("triton")(*tensors, spec(), scale, config=tiles)
    assert (out - ref).abs().max().item() < 1e-5


@pytest.mark.skipif(not triton_available(), reason="Triton is not installed (pip install triton): kernel untested here")
@settings(max_examples=12, deadline=None)
@given(st.data())
def test_packed_triton_kernel_equals_reference(data):
    """GQA groups 1 / 2 / 7 (7: Qwen2.5-7B's, not a power of two), stale slots, gaps, ragged ends: the
    fixed tile packs 16 // G queries per program (2 at G = 7, 2 padding rows), the autotuned path its own."""
    tensors, spec, scale = _case(data, groups=(1, 2, 7))
    ref = get_backend("reference")(*tensors, spec(), scale)
    tile = data.draw(st.sampled_from([None, {"block_r": 16, "block_n": 16, "num_warps": 1, "num_stages": 1}]),
                     label="tile")
    out = get_backend("triton-packed")(*tensors, spec(), scale, config=tile)
    assert (out - ref).abs().max().item() < 1e-5


@pytest.mark.skipif(not triton_available(), reason="Triton is not installed here")
def test_the_packed_kernel_equals_the_per_head_kernel_at_qwen_7b_groups():
    """28 query / 4 KV heads (G = 7) at a small length: the two kernels agree (fp32)."""
    g = torch.Generator().manual_seed(5)
    past_len, dim = 48, 32
    idx = torch.tensor([0, 5, 6, 7, 30, 47])
    positions = torch.cat([idx + 3, torch.arange(past_len + 3, past_len + 7)])  # the past starts at 3
    stale = torch.zeros(past_len, dtype=torch.bool)
    stale[idx] = True
    n = positions.numel()
    q = torch.randn(28, n, dim, generator=g)
    kp, vp = (torch.randn(4, past_len, dim, generator=g) for _ in range(2))
    kn, vn = (torch.randn(4, n, dim, generator=g) for _ in range(2))
    spec = lambda: SparseQuery(positions, 3, past_len, stale)  # noqa: E731
    per_head = get_backend("triton")(q, kp, vp, kn, vn, spec(), dim ** -0.5, config={"block_m": 16, "block_n": 16})
    packed = get_backend("triton-packed")(q, kp, vp, kn, vn, spec(), dim ** -0.5)
    assert (packed - per_head).abs().max().item() < 1e-5


@pytest.mark.skipif(not triton_available(), reason="Triton is not installed here")
def test_a_misspelt_kernel_config_key_is_refused():
    with pytest.raises(ValueError, match="unknown kernel config keys"):
        get_backend("triton")(*[torch.zeros(1, 1, 16)] * 5, None, 1.0, config={"blockm": 16})
    with pytest.raises(ValueError, match="unknown"):
        get_backend("triton-packed")(*[torch.zeros(1, 1, 16)] * 5, None, 1.0, config={"block_m": 16})
    tile = {"block_r": 4, "block_n": 16, "num_warps": 1, "num_stages": 1}
    with pytest.raises(ValueError, match="no room"):  # 4 rows cannot hold a query's 7 heads
        get_backend("triton-packed")(torch.zeros(7, 1, 16), *[torch.zeros(1, 1, 16)] * 4, None, 1.0, config=tile)


def test_the_cli_offers_every_backend():
    from fusionrag.execution.attention_backends import NAMES
    from fusionrag.models.devices import ATTENTION_CHOICES

    assert ("auto", *NAMES) == ATTENTION_CHOICES


def test_backends_are_classes_a_selector_picks_by_device_and_dtype(monkeypatch):
    import importlib

    from fusionrag.execution.attention_backends import BACKENDS, select_backend

    for backend in BACKENDS.values():  # what each declares is what its module has (needs no Triton to check)
        if not backend.needs_triton:
            assert hasattr(importlib.import_module(backend.module), "attend_in_place") == backend.supports_in_place
    cpu = torch.device("cpu")
    assert select_backend(cpu, torch.float32).name == "blocked"
    assert select_backend(cpu, torch.bfloat16, "reference").supports_in_place
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"'triton' (needs Triton and a CUDA device|runs on cuda)"):
        select_backend(cpu, torch.float32, "triton")
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        select_backend(cpu, torch.float32, "flash")
    with pytest.raises(ValueError, match="does not compute in float64"):
        select_backend(cpu, torch.float64, "blocked")


def test_positions_must_ascend():
    with pytest.raises(ValueError, match="ascending"):
        SparseQuery(torch.tensor([3, 2]), 0, 2)


def test_every_backend_hides_stale_slots():
    """A stale slot's reused KV must not leak: poisoning it changes nothing (it can fail: unhidden it would)."""
    past_len, dim = 8, 16
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 3, dim, generator=g)
    kp, vp = torch.randn(1, past_len, dim, generator=g), torch.randn(1, past_len, dim, generator=g)
    kn, vn = torch.randn(1, 3, dim, generator=g), torch.randn(1, 3, dim, generator=g)
    stale = torch.zeros(past_len, dtype=torch.bool)
    stale[4] = True
    for name in BACKENDS:
        spec = lambda: SparseQuery(torch.tensor([4, 8, 9]), 0, past_len, stale)  # noqa: E731
        clean = get_backend(name)(q, kp, vp, kn, vn, spec(), 0.25)
        vp2 = vp.clone()
        vp2[:, 4] = 1e3
        poisoned = get_backend(name)(q, kp, vp2, kn, vn, spec(), 0.25)
        assert torch.equal(clean, poisoned), name
        unhidden = get_backend(name)(q, kp, vp2, kn, vn, SparseQuery(torch.tensor([4, 8, 9]), 0, past_len), 0.25)
        assert (unhidden - clean).abs().max() > 1.0, name


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_backends_stay_within_rounding_of_reference(dtype):
    """bf16/fp16 compute (the GPU setting): within a few units of the last place of the reference."""
    past_len, dim, n_q = 50, 16, 5
    g = torch.Generator().manual_seed(11)
    idx = torch.tensor([2, 9, 10, 33, 49])
    positions = torch.cat([idx, torch.arange(past_len, past_len + n_q)])
    stale = torch.zeros(past_len, dtype=torch.bool)
    stale[idx] = True
    n = positions.numel()
    q = torch.randn(4, n, dim, generator=g).to(dtype)
    kp, vp = (torch.randn(2, past_len, dim, generator=g).to(dtype) for _ in range(2))
    kn, vn = (torch.randn(2, n, dim, generator=g).to(dtype) for _ in range(2))
    ref = get_backend("reference")(q, kp, vp, kn, vn, SparseQuery(positions, 0, past_len, stale), 0.25).float()
    for name in BACKENDS[1:]:
        out = get_backend(name)(q, kp, vp, kn, vn, SparseQuery(positions, 0, past_len, stale), 0.25)
        assert out.dtype == dtype
        assert (out.float() - ref).abs().max().item() < 3e-2, name
