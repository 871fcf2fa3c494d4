"""The model's own attention modules, routed through transformers' attention-function registry.

We register one attention function, ``fusionrag``, with ``transformers.AttentionInterface``
and switch a loaded model to it (no fork of any model code: every supported architecture
looks its attention function up in that registry). Outside a sparse pass it is exactly
transformers' SDPA function: with no mask that is the causal kernel with shared KV heads
(Full Attention, ``S``), with a 4D mask the masked kernel (the padded decode batch).
Inside :func:`sparse_pass` it ignores the cache's past (the cache holds only the pass's
fresh KV) and calls the pass's backend with the reused past of that layer and the
positions of the queries (see :mod:`fusionrag.execution.attention_backends`). A past whose KV
carries a read rule (``KV.read_rule``, set by a method's placement) is read through that rule
instead, whatever the backend (:mod:`~fusionrag.execution.attention_backends.ruled`); inside
:func:`read_rules` the decoder's rows with such a prompt are too.

Transformers builds no mask for an attention function it has no mask function for, so a
pass with ``attention_mask=None`` reaches us with ``None`` whatever its positions are.

Inside :func:`capture` a layer's attention hands its queries (normed and rotated by the model, whatever
its family) to the caller: attention weights that sdpa never materialises are then recomputed from them.

Inside :func:`stop_at_attention` a pass ends where one layer's attention would begin: every
decoder layer writes its new keys and values to the cache before it calls the attention
function, so at that point the layer's queries have been projected and its keys are in the
cache, and nothing after (that attention, the layer's MLP, the later layers, the final norm,
the LM head) runs. The question's selection pre-pass needs exactly that much.

Inside :func:`in_place_pass` (the sparse recompute, decision 050) the pass owns a writable KV,
the request's own prompt KV: each layer first writes its new tokens' keys and values at their
slots (a stale slot's fresh copy replaces it), then each query reads the slots at or before its
position. A layer named by :func:`stop_at_attention` still writes before it stops.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch

from fusionrag.execution.attention_backends import Attend, AttendInPlace, SparseQuery, ruled
from fusionrag.kvcache.kv import KV, ReadRule

ATTN_IMPL = "fusionrag"


@dataclass(frozen=True)
class _Pass:
    past: KV
    spec: SparseQuery
    attend: Attend | None
    in_place: AttendInPlace | None = None  # set: ``past`` is the pass's own KV, written layer by layer
    slots: torch.Tensor | None = None  # an in-place pass: where each new token's KV goes in ``past``
    written: set[int] = field(default_factory=set)  # layers whose new KV is in place (an in-place pass)


def _write_in_place(active: _Pass, layer: int, key: torch.Tensor, value: torch.Tensor, n: int) -> None:
    """Put the ``n`` newest tokens' KV of ``layer`` at their slots, once per layer (a layer run again on
    fewer rows, see ``forward``'s last-row pass, finds its KV there already and keeps it)."""
    if layer in active.written:
        return
    assert active.slots is not None
    active.past.keys[layer][:, active.slots[-n:]] = key[0, :, -n:].to(active.past.keys.dtype)
    active.past.values[layer][:, active.slots[-n:]] = value[0, :, -n:].to(active.past.values.dtype)
    active.written.add(layer)


_ACTIVE: ContextVar[_Pass | None] = ContextVar("fusionrag_sparse_pass", default=None)
_STOP_AT: ContextVar[int | None] = ContextVar("fusionrag_stop_at_attention", default=None)


@dataclass(frozen=True)
class RowRules:
    """The rows of a decode batch whose prompt KV carries a read rule: each row's rule and its slots."""

    rules: tuple[ReadRule | None, ...]  # per batch row
    spans: torch.Tensor  # [B, W] bool: each row's slots read through its rule (the step's own token: False)


_ROW_RULES: ContextVar[RowRules | None] = ContextVar("fusionrag_row_rules", default=None)
#: Layers whose queries are being captured (:func:`capture`), each with the list they go to.
_CAPTURE: ContextVar[dict[int, list[torch.Tensor]] | None] = ContextVar("fusionrag_capture", default=None)


class _Stopped(Exception):
    """Raised by the attention function at the layer a :func:`stop_at_attention` names; caught there."""


def fusionrag_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                        **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The registered attention function (signature of transformers' attention interface)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    captures = _CAPTURE.get()
    if captures is not None and module.layer_idx in captures:
        captures[module.layer_idx].append(query[0].float())  # [heads, n, d]: normed and rotated by the model
    active = _ACTIVE.get()
    if active is not None and active.in_place is not None:
        _write_in_place(active, module.layer_idx, key, value, query.shape[2])
    if _STOP_AT.get() == module.layer_idx:
        raise _Stopped
    if active is None:
        out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                        **kwargs)
        rows = _ROW_RULES.get()
        if rows is not None:  # rows whose prompt carries a read rule read through it
            scale = scaling if scaling is not None else query.shape[-1] ** -0.5
            for b, rule in enumerate(rows.rules):
                if rule is not None:
                    allowed = torch.ones(query.shape[2], key.shape[2], dtype=torch.bool, device=query.device) \
                        if attention_mask is None else attention_mask[b, 0] > torch.finfo(attention_mask.dtype).min / 2
                    out[b] = rule.attend(query[b], key[b], value[b], allowed, rows.spans[b], scale).transpose(0, 1)
        return out, None
    if query.shape[0] != 1:
        raise RuntimeError("a sparse pass takes one row (the backend applies the visibility rule)")
    # A pass never hands the model a mask; should a transformers version build one anyway
    # (e.g. from ``position_ids``), it is not ours to honour: the backend applies the rule.
    layer = module.layer_idx
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if active.in_place is not None:
        n = query.shape[2]  # the pass's last n positions (all of them, or the last row's, see forward)
        out = active.in_place(query[0], active.past.keys[layer], active.past.values[layer],
                              active.spec.positions[-n:], active.past.base_position, scale, active.spec.memo)
        return out.transpose(0, 1)[None], None
    attend = ruled.attend if active.spec.read_rule is not None else active.attend
    assert attend is not None
    out = attend(query[0], active.past.keys[layer], active.past.values[layer], key[0], value[0], active.spec, scale)
    return out.transpose(0, 1)[None], None  # [1, n, Hq, D], as transformers' functions return


def install(model: Any) -> None:
    """Register the function (idempotent) and make ``model``'s attention modules use it."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPL, fusionrag_attention)
    if model.config._attn_implementation != ATTN_IMPL:
        model.config._attn_implementation = ATTN_IMPL


@contextmanager
def attention_implementation(model: Any, name: str) -> Iterator[None]:
    """Temporarily run ``model`` with transformers' own ``name`` (e.g. ``sdpa``: the plain baseline)."""
    before = model.config._attn_implementation
    model.config._attn_implementation = name
    try:
        yield
    finally:
        model.config._attn_implementation = before


@contextmanager
def sparse_pass(past: KV, spec: SparseQuery, attend: Attend) -> Iterator[None]:
    """Inside: every attention call of this thread is the sparse pass over ``past``."""
    token = _ACTIVE.set(_Pass(past, spec, attend))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


@contextmanager
def in_place_pass(work: KV, spec: SparseQuery, attend: AttendInPlace) -> Iterator[None]:
    """Inside: every attention call of this thread writes its new KV into ``work`` (at slots
    ``spec.positions - work.base_position``) and reads ``work`` through ``attend`` (see the module doc)."""
    token = _ACTIVE.set(_Pass(work, spec, None, attend, spec.positions - work.base_position))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


@contextmanager
def read_rules(rows: RowRules | None) -> Iterator[None]:
    """Inside: the decoder's forward reads each ruled row's slots through its rule (``KV.read_rule``)."""
    token = _ROW_RULES.set(rows)
    try:
        yield
    finally:
        _ROW_RULES.reset(token)


@contextmanager
def capture(layer: int) -> Iterator[list[torch.Tensor]]:
    """Inside: every call of layer ``layer``'s attention (>= 0) appends its queries, ``[heads, n, head_dim]``
    fp32, exactly as the layer made them (any family's projection, norms and rotary embedding), to the list
    yielded. Captures of several layers nest."""
    before = _CAPTURE.get()
    captured: list[torch.Tensor] = []
    token = _CAPTURE.set({**(before or {}), layer: captured})
    try:
        yield captured
    finally:
        _CAPTURE.reset(token)


@contextmanager
def stop_at_attention(layer: int) -> Iterator[None]:
    """Inside: a forward of this thread ends (quietly) when layer ``layer`` (>= 0) calls its attention.

    The forward's cache then holds the new KV of layers ``0..layer``; hooks on that layer's
    projections have fired. A forward that never reaches the layer is an error."""
    token = _STOP_AT.set(layer)
    try:
        yield
    except _Stopped:
        return
    finally:
        _STOP_AT.reset(token)
    raise RuntimeError(f"the pass never reached layer {layer}'s attention")


def cache_keyword(fn: Any) -> str:
    """``cache`` (transformers >= 5.2x) or ``past_key_values`` (older 5.x), whichever ``fn`` takes."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"
