"""One forward pass of new tokens on top of reused KV, at explicit positions, without a mask.

Two kinds of pass, neither with a dense mask:
- no past (Full Attention, ``S``): the model's own causal SDPA kernel, KV heads shared;
- a past (a chunk after ``S`` or after its neighbours, the question pre-pass, the sparse
  recompute): a *sparse pass* (:mod:`fusionrag.execution.attention_hook`). The cache given
  to the model starts empty and receives only the new tokens' KV (the request's own
  buffer); each layer's attention reads the reused past of that layer, never written,
  through the chosen backend, which applies the rule "every position at or before one's
  own, stale slots hidden" (:func:`~fusionrag.execution.masks.visibility`).

Why no implicit masks: with reused and sparsely recomputed KV, "causal" is not "earlier in
the cache", and transformers' mask helpers infer packed sequences from gaps in
``position_ids``. Our attention function gets no mask from transformers and applies the
rule itself. The ``reference`` backend is the old path (a dense additive float mask,
``finfo.min``) and is used for every pass, past or not, when asked for.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from transformers import DynamicCache

from fusionrag.execution import attention_hook
from fusionrag.execution.attention_backends import AttentionBackend, SparseQuery, select_backend
from fusionrag.execution.masks import additive_mask, visibility  # noqa: F401  (re-exported)
from fusionrag.kvcache.kv import KV
from fusionrag.models.registry import LoadedModel

T = TypeVar("T")


def to_dynamic_cache(kv: KV | None) -> DynamicCache:
    """A transformers cache holding a *copy* of ``kv`` (for tests that run the model's own eager path)."""
    if kv is None or len(kv) == 0:
        return DynamicCache()
    data = [(kv.keys[i].unsqueeze(0), kv.values[i].unsqueeze(0)) for i in range(kv.num_layers)]
    return DynamicCache(ddp_cache_data=data)


def cache_tail(cache: DynamicCache, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The last ``n`` tokens' keys and values of every layer, stacked ``[L, H, n, D]``."""
    keys = torch.stack([layer.keys[0, :, -n:] for layer in cache.layers])
    values = torch.stack([layer.values[0, :, -n:] for layer in cache.layers])
    return keys, values


def backend_of(lm: LoadedModel) -> AttentionBackend:
    """The sparse-pass backend of ``lm``: its ``attention`` setting, ``auto`` resolved by device; one that
    cannot run on ``lm``'s device or dtype is a ValueError naming why. Resolved once and held by the loaded
    model (again only if its device, dtype or setting changes), not selected on every pass."""
    key = (lm.device, lm.dtype, lm.attention)
    held = lm.__dict__.get("_attention_backend")
    if held is None or held[0] != key:
        held = lm.__dict__["_attention_backend"] = (key, select_backend(*key))
    return held[1]


def backend_name(lm: LoadedModel) -> str:
    return backend_of(lm).name


@dataclass
class ForwardResult:
    logits: torch.Tensor  # [n_kept, vocab] for the kept positions (fp32)
    keys: torch.Tensor  # [L, H, n, D] fresh KV of the new tokens, in input order (the pass's own buffer)
    values: torch.Tensor


def _pass_inputs(lm: LoadedModel, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Token ids and positions as flat long tensors on the model's device, one position per token."""
    input_ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(-1).to(lm.device)
    positions = torch.as_tensor(positions, dtype=torch.long).reshape(-1).to(lm.device)
    if input_ids.numel() != positions.numel():
        raise ValueError(f"{input_ids.numel()} tokens at {positions.numel()} positions")
    return input_ids, positions


def _run(lm: LoadedModel, input_ids: torch.Tensor, positions: torch.Tensor, past: KV | None,
         past_hidden: torch.Tensor | None, logits_to_keep: int,
         n_layers: int | None, stop_at: int | None = None) -> tuple[torch.Tensor, DynamicCache]:
    device = lm.device
    attention_hook.install(lm.model)
    input_ids, positions = _pass_inputs(lm, input_ids, positions)
    backend = backend_of(lm)
    past_len = 0 if past is None else len(past)
    cache = DynamicCache()
    if past_len == 0 and backend.name != "reference":
        if positions.numel() > 1 and not bool((positions[1:] > positions[:-1]).all()):
            raise ValueError("positions of a pass must be strictly ascending")
        return _call(lm, input_ids, positions, cache, logits_to_keep, n_layers, stop_at), cache
    base = 0 if past is None else past.base_position
    stale = None if past_hidden is None else past_hidden.to(device=device, dtype=torch.bool)
    spec = SparseQuery(positions, base, past_len, stale, read_rule=None if past is None else past.read_rule)
    if past is None:  # the reference path without a past: an empty one
        empty = torch.zeros(lm.adapter.empty_kv_shape(lm.num_layers), dtype=lm.dtype, device=device)
        past = KV(empty, empty, 0)
    past_dev = past.to(lm.dtype, device)
    with attention_hook.sparse_pass(past_dev, spec, backend.attend):
        return _call(lm, input_ids, positions, cache, logits_to_keep, n_layers, stop_at), cache


def _call(lm: LoadedModel, input_ids: torch.Tensor, positions: torch.Tensor, cache: DynamicCache,
          logits_to_keep: int, n_layers: int | None, stop_at: int | None = None) -> torch.Tensor:
    """The whole model (logits kept); with ``n_layers``, only its first layers (no logits: the model's own
    forward ended where layer ``n_layers``'s attention begins, so any family's embedding scale, norms and
    residual rules are its own); with ``stop_at``, the model's own forward ended where that layer's attention
    begins (no logits)."""
    if n_layers is not None and n_layers < lm.num_layers:
        stop_at = n_layers
    if stop_at is not None:
        with attention_hook.stop_at_attention(stop_at):
            lm.model(input_ids=input_ids[None], position_ids=positions[None], attention_mask=None,
                     use_cache=True, logits_to_keep=logits_to_keep,
                     **{attention_hook.cache_keyword(lm.model.forward): cache})
        return torch.empty(0)
    out = lm.model(input_ids=input_ids[None], position_ids=positions[None], attention_mask=None,
                   use_cache=True, logits_to_keep=logits_to_keep,
                   **{attention_hook.cache_keyword(lm.model.forward): cache})
    return out.logits[0].float()


def forward(
    lm: LoadedModel,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    past: KV | None = None,
    past_hidden: torch.Tensor | None = None,
    logits_to_keep: int = 1,
) -> ForwardResult:
    """Run ``input_ids`` at ``positions`` (strictly ascending) on top of ``past`` (never modified).

    ``past`` holds positions ``past.base_position ..``; ``past_hidden`` marks its stale slots.
    """
    logits, cache = _run(lm, input_ids, positions, past, past_hidden, logits_to_keep, None)
    keys, values = cache_tail(cache, int(torch.as_tensor(input_ids).numel()))
    return ForwardResult(logits, keys, values)


def in_place_available(lm: LoadedModel) -> bool:
    """Whether ``lm``'s sparse-pass backend can run :func:`forward_in_place`."""
    return backend_of(lm).supports_in_place


def forward_in_place(lm: LoadedModel, input_ids: torch.Tensor, positions: torch.Tensor, work: KV,
                     keep_logits: bool = True) -> torch.Tensor | None:
    """Run ``input_ids`` at ``positions`` over ``work``, writing their fresh KV into it; the last row's logits.

    ``work`` is the request's own KV (slot ``t`` at position ``work.base_position + t``), holding
    the reused KV and room for every position of the pass: each layer writes its new tokens'
    KV at their slots (over a stale slot's old copy) before its attention, and each query reads
    every slot at or before its position. That is the sparse pass's visibility rule; what it
    saves is the past + new concatenation, the stale columns and the final copy into the prompt
    KV (decision 050). The slots of ``positions`` inside the reused part are the stale ones. Only
    the last row's logits are needed, so the last layer runs its attention and MLP for that row
    alone (:func:`_last_layer_on_last_row`). Without ``keep_logits`` (a piece of a pass cut in pieces, whose
    logits nobody reads) the pass ends once the last layer has written its KV: no attention, MLP or head there.
    """
    backend = backend_of(lm)
    attend = backend.attend_in_place
    if attend is None:
        raise ValueError(f"attention backend {backend.name!r} has no in-place pass")
    input_ids, positions = _pass_inputs(lm, input_ids, positions)
    if int(positions[0]) < work.base_position or int(positions[-1]) >= work.base_position + len(work):
        raise ValueError("an in-place pass writes inside its KV: positions outside it")
    spec = SparseQuery(positions, work.base_position, len(work))
    attention_hook.install(lm.model)
    cache = DynamicCache()
    if not keep_logits:
        with attention_hook.in_place_pass(work, spec, attend):
            _call(lm, input_ids, positions, cache, 1, None, stop_at=lm.num_layers - 1)
        return None
    with attention_hook.in_place_pass(work, spec, attend), _last_layer_on_last_row(lm):
        logits = _call(lm, input_ids, positions, cache, 1, None)
    return logits[-1]


def run_pieces(pieces: Generator[None, None, T]) -> T:
    """Run every piece of a pass cut in pieces (each ``next()`` runs one), back to back; the pass's result."""
    while True:
        try:
            next(pieces)
        except StopIteration as done:
            return done.value


def forward_in_place_pieces(lm: LoadedModel, input_ids: torch.Tensor, positions: torch.Tensor, work: KV,
                            piece_tokens: int | None = None) -> Generator[None, None, torch.Tensor]:
    """:func:`forward_in_place` cut into passes of at most ``piece_tokens`` tokens, in order (``None``: one pass).

    Why it equals the whole pass: positions ascend, so every position a piece reads before its own
    was written by this piece or an earlier one (every layer's KV, in place), and later ones are
    never read (causal). Each piece but the last stops once the last layer has written its KV. A
    scheduler runs decode steps between pieces, so a long prefill does not stall every stream; the
    work slots a piece has not reached yet must hold finite values (zeros), as some backends read
    a slot before masking it."""
    input_ids, positions = _pass_inputs(lm, input_ids, positions)
    n = input_ids.numel()
    step = n if not piece_tokens or piece_tokens >= n else int(piece_tokens)
    last = ((n - 1) // step) * step
    for a in range(0, last, step):
        forward_in_place(lm, input_ids[a:a + step], positions[a:a + step], work, keep_logits=False)
        yield
    logits = forward_in_place(lm, input_ids[last:], positions[last:], work)
    assert logits is not None
    return logits


@contextmanager
def _last_layer_on_last_row(lm: LoadedModel) -> Iterator[None]:
    """Inside: the last decoder layer computes every row's KV, then its attention and MLP for the last row only.

    The other rows' last-layer outputs feed nothing (no later layer, and only the last row's
    logits are kept), so their query projection, attention, output projection and MLP are
    skipped (~1/L of the pass). The layer runs first, on every row, until its attention (which
    writes the rows' KV in place, ``attention_hook.stop_at_attention``), then again on the last
    row, whose KV is already in place. Both runs are the model's own module, so any family's
    norms, projections and RoPE are its own. Only for an in-place pass."""
    index = lm.num_layers - 1
    layer = lm.adapter.layers[index]

    def last_row(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        hidden = args[0] if args else kwargs["hidden_states"]
        if hidden.shape[1] == 1:
            return None
        with attention_hook.stop_at_attention(index):
            module.forward(*args, **kwargs)  # not __call__: this hook must not fire again
        rows = {"position_ids", "cache_position"}
        kw = {k: (v[..., -1:] if k in rows and isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
        if kw.get("position_embeddings") is not None:
            kw["position_embeddings"] = tuple(t[:, -1:] for t in kw["position_embeddings"])
        if args:
            return (hidden[:, -1:], *args[1:]), kw
        kw["hidden_states"] = hidden[:, -1:]
        return args, kw

    handle = layer.register_forward_pre_hook(last_row, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def prefill(lm: LoadedModel, input_ids: torch.Tensor, past: KV | None = None, start: int | None = None,
            logits_to_keep: int = 1) -> tuple[KV, torch.Tensor]:
    """KV of a contiguous segment computed on top of ``past`` (consecutive positions).

    The segment starts right after ``past`` unless ``start`` says otherwise. Returns the
    segment's own KV (not including ``past``) and the kept logits.
    """
    after_past = 0 if past is None else past.base_position + len(past)
    base = after_past if start is None else start
    n = int(torch.as_tensor(input_ids).numel())
    res = forward(lm, input_ids, torch.arange(base, base + n), past, logits_to_keep=logits_to_keep)
    return KV(res.keys, res.values, base), res.logits


def forward_first_layers(
    lm: LoadedModel, input_ids: torch.Tensor, positions: torch.Tensor, past: KV | None, n_layers: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh KV of the first ``n_layers`` layers only (CacheBlend's cheap probe).

    The model's own forward, ended where layer ``n_layers``'s attention begins, causal over ``past`` + the
    new tokens. Returns ``[n_layers, H, n, D]``.
    """
    _, cache = _run(lm, input_ids, positions, past, None, 1, n_layers)
    keys, values = cache_tail(cache, int(torch.as_tensor(input_ids).numel()))
    return keys[:n_layers], values[:n_layers]


def forward_to_attention(lm: LoadedModel, input_ids: torch.Tensor, positions: torch.Tensor, past: KV | None,
                         layer: int = -1) -> torch.Tensor:
    """:func:`forward`'s pass, ended where layer ``layer``'s attention would begin; that layer's new keys.

    Up to that point it is the same computation as :func:`forward` (the model's own forward,
    the same modules, inputs and backend), so a hook on that layer's query projection sees what
    it sees in a whole pass and the keys are bit for bit the whole pass's. What a whole pass
    would add is skipped: that layer's attention and MLP, the later layers, the final norm and
    the LM head. For the last layer of Qwen2.5-0.5B and a 29-token question that is ~50 ms of a
    ~500 ms pass on one CPU thread (LM head 36 ms, one MLP 11 ms; decision 048). Returns
    ``[kv_heads, n, D]`` (post-RoPE, the compute dtype, on the model's device).
    """
    index = range(lm.num_layers)[layer]  # the layer_idx its attention module carries
    _, cache = _run(lm, input_ids, positions, past, None, 1, None, stop_at=index)
    n = int(torch.as_tensor(input_ids).numel())
    return cache.layers[index].keys[0, :, -n:]
