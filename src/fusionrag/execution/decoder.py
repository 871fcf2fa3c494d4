"""The one decode loop: rows (requests) decode together, one forward per step for all of them.

Decoding a token is a forward of one token per request, dominated by reading the weights
(and on CPU by per-call overhead): B rows in one forward cost little more than one. The
engine decodes a single answer as a batch of one; the server's scheduler keeps many rows.

Layout: every row's KV is one row of a padded batch cache ``[B, H, W, D]`` per layer; pad
slots are hidden by an additive float mask (:func:`~fusionrag.execution.forward.additive_mask`,
``finfo.min``, never a boolean mask) and each row decodes at its own position id, so
padding changes nothing a row sees. Rows join and leave between steps: joining pads to the
widest row, leaving drops the row and compacts the padding once it is over half the cache.

A row whose prompt KV carries a read rule (:class:`~fusionrag.kvcache.kv.ReadRule`, set by a
method's placement) keeps which of its slots the rule covers; a step with such rows reads them
through their rules (:func:`~fusionrag.execution.attention_hook.read_rules`), the other rows as ever.

Copies: a row joining an empty decoder is adopted without a copy (views of its KV; the
forward's cache appends into new tensors, so the caller's KV is never written); joining a
non-empty batch copies it once into the padded layout.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping

import torch
from transformers import DynamicCache

from fusionrag.execution import attention_hook
from fusionrag.execution.forward import additive_mask
from fusionrag.kvcache.kv import KV, ReadRule
from fusionrag.models.registry import LoadedModel


class BatchDecoder:
    """Rows of decoding state over one model: ``join``, ``step``, ``drop``."""

    def __init__(self, lm: LoadedModel) -> None:
        self.lm = lm
        self.compactions = 0  # batch caches re-packed because padding outgrew the KV
        self._reset()

    def _reset(self) -> None:
        self._rows: list[Hashable] = []
        self._next_pos: list[int] = []
        self._keys: list[torch.Tensor] = []  # per layer [B, H, W, D]
        self._values: list[torch.Tensor] = []
        self._valid: torch.Tensor | None = None  # [B, W] bool: which slots of each row hold its KV
        self._rules: list[ReadRule | None] = []  # per row: its prompt's read rule, if any
        self._spans: torch.Tensor | None = None  # [B, W] bool: each row's slots read through its rule

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def rows(self) -> list[Hashable]:
        return list(self._rows)

    def join(self, row: Hashable, kv: KV) -> None:
        """Add a row whose prompt KV is ``kv`` (positions ``base .. base+len-1``); it decodes from ``base+len``."""
        if row in self._rows:
            raise ValueError(f"row {row!r} is already decoding")
        n_layers = kv.num_layers
        span = torch.zeros(len(kv), dtype=torch.bool, device=kv.keys.device)
        if kv.read_rule is not None:
            span[kv.read_rule.start: kv.read_rule.stop] = True
        if self._valid is None:  # adopt without a copy
            self._keys = [kv.keys[i].unsqueeze(0) for i in range(n_layers)]
            self._values = [kv.values[i].unsqueeze(0) for i in range(n_layers)]
            self._valid = torch.ones(1, len(kv), dtype=torch.bool, device=kv.keys.device)
            self._spans = span[None]
        else:
            b_old, heads, w_old, dim = self._keys[0].shape
            dtype, device = self._keys[0].dtype, self._keys[0].device
            width = max(w_old, len(kv))
            keys, values = [], []
            for layer in range(n_layers):
                k = self._keys[layer].new_zeros(b_old + 1, heads, width, dim)
                v = self._values[layer].new_zeros(b_old + 1, heads, width, dim)
                k[:b_old, :, :w_old] = self._keys[layer]
                v[:b_old, :, :w_old] = self._values[layer]
                k[b_old, :, : len(kv)] = kv.keys[layer].to(device=device, dtype=dtype)
                v[b_old, :, : len(kv)] = kv.values[layer].to(device=device, dtype=dtype)
                keys.append(k)
                values.append(v)
            valid = torch.zeros(b_old + 1, width, dtype=torch.bool, device=device)
            valid[:b_old, :w_old] = self._valid
            valid[b_old, : len(kv)] = True
            spans = torch.zeros_like(valid)
            assert self._spans is not None
            spans[:b_old, :w_old] = self._spans
            spans[b_old, : len(kv)] = span.to(device)
            self._keys, self._values, self._valid, self._spans = keys, values, valid, spans
        self._rules.append(kv.read_rule)
        self._rows.append(row)
        self._next_pos.append(kv.base_position + len(kv))

    def step(self, tokens: Mapping[Hashable, int]) -> dict[Hashable, torch.Tensor]:
        """Feed each row its last token (every row must have one); returns each row's next-token logits (fp32)."""
        if not self._rows:
            return {}
        missing = [r for r in self._rows if r not in tokens]
        if missing:
            raise ValueError(f"no token for rows {missing!r}")
        assert self._valid is not None
        device = self._valid.device
        batch = len(self._rows)
        input_ids = torch.tensor([[int(tokens[r])] for r in self._rows], dtype=torch.long, device=device)
        positions = torch.tensor([[p] for p in self._next_pos], dtype=torch.long, device=device)
        valid = torch.cat([self._valid, torch.ones(batch, 1, dtype=torch.bool, device=device)], dim=1)
        cache = DynamicCache(ddp_cache_data=list(zip(self._keys, self._values, strict=True)))
        assert self._spans is not None
        spans = torch.cat([self._spans, torch.zeros(batch, 1, dtype=torch.bool, device=device)], dim=1)
        rows = attention_hook.RowRules(tuple(self._rules), spans) if any(self._rules) else None
        with attention_hook.read_rules(rows):
            out = self.lm.model(input_ids=input_ids, position_ids=positions,
                                attention_mask=additive_mask(valid[:, None, :], self.lm.model.dtype),
                                **{attention_hook.cache_keyword(self.lm.model.forward): cache},
                                use_cache=True, logits_to_keep=1)
        self._keys = [layer.keys for layer in cache.layers]
        self._values = [layer.values for layer in cache.layers]
        self._valid, self._spans = valid, spans
        self._next_pos = [p + 1 for p in self._next_pos]
        logits = out.logits[:, -1].float()
        return {r: logits[b] for b, r in enumerate(self._rows)}

    def drop(self, rows: Iterable[Hashable]) -> None:
        """Remove rows; drop slots no row uses; compact once padding is over half the cache.

        Slot order inside a row does not matter (keys carry their RoPE positions and the
        mask says what is visible), so compaction may move a row's slots to the left.
        """
        gone = set(rows)
        keep = [b for b, r in enumerate(self._rows) if r not in gone]
        if len(keep) == len(self._rows):
            return
        if not keep:
            self._reset()
            return
        assert self._valid is not None
        idx = torch.tensor(keep, device=self._valid.device)
        assert self._spans is not None
        self._rows = [self._rows[b] for b in keep]
        self._next_pos = [self._next_pos[b] for b in keep]
        self._rules = [self._rules[b] for b in keep]
        keys = [k.index_select(0, idx) for k in self._keys]
        values = [v.index_select(0, idx) for v in self._values]
        valid = self._valid.index_select(0, idx)
        spans = self._spans.index_select(0, idx)
        used = valid.any(dim=0)
        if not bool(used.all()):  # e.g. the tail of a longer row that just left
            cols = used.nonzero().squeeze(1)
            keys = [k.index_select(2, cols) for k in keys]
            values = [v.index_select(2, cols) for v in values]
            valid = valid.index_select(1, cols)
            spans = spans.index_select(1, cols)
        counts = valid.sum(dim=1)
        if int(counts.sum()) * 2 < valid.numel():
            width = int(counts.max())
            packed_k, packed_v = [], []
            packed_s = torch.zeros(len(keep), width, dtype=torch.bool, device=spans.device)
            for b in range(len(keep)):
                packed_s[b, : int(counts[b])] = spans[b][valid[b]]
            spans = packed_s
            for k, v in zip(keys, values, strict=True):
                nk = k.new_zeros(k.shape[0], k.shape[1], width, k.shape[3])
                nv = v.new_zeros(nk.shape)
                for b in range(len(keep)):
                    n = int(counts[b])
                    nk[b, :, :n] = k[b][:, valid[b]]
                    nv[b, :, :n] = v[b][:, valid[b]]
                packed_k.append(nk)
                packed_v.append(nv)
            keys, values = packed_k, packed_v
            valid = torch.arange(width, device=counts.device)[None, :] < counts[:, None]
            self.compactions += 1
        self._keys, self._values, self._valid, self._spans = keys, values, valid, spans

    def clear(self) -> None:
        """Drop every row (e.g. after a failed step)."""
        self._reset()
