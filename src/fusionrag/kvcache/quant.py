"""int8 KV storage: symmetric int8 tensors plus fp16 scales, dequantised on load.

Keys get one scale per (layer, head, channel) over the entry's tokens, values one scale per
(layer, head, token) over the channels. Why that split: post-RoPE keys have a few outlier
channels whose range is fixed by the model, so a per-token key scale is set by the outlier and
wastes the other channels' resolution (measured on real entries: 1.1% relative key error per
token, 0.25% per channel, as KIVI reports); values have no channel outliers, and a per-token
scale follows each token's magnitude (0.7%).

Dequantisation returns fp16 (the memory tier then holds what an fp16 store would), and every
re-rotation still happens afterwards in fp32 (``KV.moved_to`` / ``assemble``), so int8 storage
changes the stored numbers only, never the rotation or masking math. Scales are fp16 computed
first, and the int8 codes are rounded against the fp16 scale actually stored, so
``dequantize(quantize(x))`` is the best int8 reconstruction under the stored scale.
"""

from __future__ import annotations

import torch

#: Recorded in each int8 entry's header (``quant``): which axes the scales run over.
INT8_SCHEME = "int8-sym/key:channel/value:token/scale:fp16"
_QMAX = 127.0


def _quantize(x: torch.Tensor, reduce_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes int8, scales fp16)`` with ``x ~= codes * scales``; scales broadcast over ``reduce_dim``."""
    x = x.detach().to(torch.float32)
    absmax = x.abs().amax(dim=reduce_dim, keepdim=True)
    # fp16's smallest normal is 6.1e-5: a channel that small is stored with that step (error <= 3e-5 absolute).
    scale = (absmax / _QMAX).clamp_min(6.2e-5).to(torch.float16)
    codes = torch.round(x / scale.to(torch.float32)).clamp_(-_QMAX, _QMAX).to(torch.int8)
    return codes.contiguous(), scale.contiguous()


def quantize_kv(keys: torch.Tensor, values: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tensors an int8 entry stores for ``[L, H, T, D]`` keys and values."""
    k, ks = _quantize(keys, reduce_dim=2)  # per channel: max over tokens -> [L, H, 1, D]
    v, vs = _quantize(values, reduce_dim=3)  # per token: max over channels -> [L, H, T, 1]
    return {"keys": k, "values": v, "key_scales": ks, "value_scales": vs}


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """``codes * scales`` computed in fp32, returned in ``dtype``."""
    if codes.dtype != torch.int8:
        raise ValueError(f"int8 codes expected, got {codes.dtype}")
    return (codes.to(torch.float32) * scales.to(torch.float32)).to(dtype)


def check_int8(tensors: dict[str, torch.Tensor]) -> None:
    """Raise ``KeyError``/``ValueError`` unless ``tensors`` are an int8 entry's codes with matching scales."""
    keys, values = tensors["keys"], tensors["values"]
    ks, vs = tensors["key_scales"], tensors["value_scales"]
    if keys.dim() != 4 or ks.shape != (*keys.shape[:2], 1, keys.shape[3]):
        raise ValueError(f"key scales {tuple(ks.shape)} do not match keys {tuple(keys.shape)}")
    if vs.shape != (*values.shape[:3], 1):
        raise ValueError(f"value scales {tuple(vs.shape)} do not match values {tuple(values.shape)}")


def dequantize_kv(tensors: dict[str, torch.Tensor],
                  dtype: torch.dtype = torch.float16) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of an int8 entry's tensors (raises ``KeyError``/``ValueError`` if malformed), computed
    on whatever device the tensors are (the device KV tier dequantises on the GPU)."""
    check_int8(tensors)
    return (dequantize(tensors["keys"], tensors["key_scales"], dtype),
            dequantize(tensors["values"], tensors["value_scales"], dtype))


def relative_error(x: torch.Tensor, y: torch.Tensor) -> float:
    """``||x - y|| / ||x||`` (Frobenius), the storage error the decisions record quotes."""
    x, y = x.to(torch.float32), y.to(torch.float32)
    return float((x - y).norm() / x.norm().clamp_min(1e-30))
