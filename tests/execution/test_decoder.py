"""The one decode loop: rows decoding together give each row exactly what it gets alone."""

from __future__ import annotations

import torch

from fusionrag.execution.decoder import BatchDecoder
from fusionrag.execution.forward import prefill
from fusionrag.kvcache.kv import KV


def _prompt_kv(lm, n: int, seed: int) -> tuple[KV, int]:
    ids = torch.randint(0, 250, (n,), generator=torch.Generator().manual_seed(seed))
    kv, logits = prefill(lm, ids)
    return kv, int(torch.argmax(logits[-1]))


def _alone(lm, kv: KV, first: int, steps: int) -> list[torch.Tensor]:
    dec = BatchDecoder(lm)
    dec.join("x", kv)
    tok, out = first, []
    for _ in range(steps):
        logits = dec.step({"x": tok})["x"]
        out.append(logits)
        tok = int(torch.argmax(logits))
    return out


def test_rows_of_different_lengths_joining_and_leaving_match_decoding_alone(tiny_lm):
    prompts = {r: _prompt_kv(tiny_lm, n, seed) for r, (n, seed) in {"a": (7, 0), "b": (19, 1), "c": (3, 2)}.items()}
    ref = {r: _alone(tiny_lm, kv, first, 6) for r, (kv, first) in prompts.items()}
    dec = BatchDecoder(tiny_lm)
    tokens, got = {}, {r: [] for r in prompts}
    for step in range(8):
        if step == 0:
            dec.join("a", prompts["a"][0])
            tokens["a"] = prompts["a"][1]
        if step == 2:  # joins mid-decode, longer than the row already there
            dec.join("b", prompts["b"][0])
            tokens["b"] = prompts["b"][1]
            dec.join("c", prompts["c"][0])
            tokens["c"] = prompts["c"][1]
        logits = dec.step(tokens)
        for r, row_logits in logits.items():
            got[r].append(row_logits)
            tokens[r] = int(torch.argmax(row_logits))
        done = [r for r in list(tokens) if len(got[r]) == 6]
        dec.drop(done)
        for r in done:
            del tokens[r]
    assert len(dec) == 0
    for r in prompts:
        assert len(got[r]) == 6
        for mine, alone in zip(got[r], ref[r], strict=True):
            torch.testing.assert_close(mine, alone, atol=1e-4, rtol=1e-4)


def test_the_callers_kv_is_never_written(tiny_lm):
    kv, first = _prompt_kv(tiny_lm, 11, 3)
    keys, values = kv.keys.clone(), kv.values.clone()
    dec = BatchDecoder(tiny_lm)
    dec.join(0, kv)  # adopted without a copy
    other, other_first = _prompt_kv(tiny_lm, 5, 4)
    dec.join(1, other)
    tokens = {0: first, 1: other_first}
    for _ in range(3):
        tokens = {r: int(torch.argmax(lg)) for r, lg in dec.step(tokens).items()}
    assert torch.equal(kv.keys, keys) and torch.equal(kv.values, values)


def test_a_step_needs_a_token_for_every_row(tiny_lm):
    kv, first = _prompt_kv(tiny_lm, 4, 5)
    dec = BatchDecoder(tiny_lm)
    dec.join("a", kv)
    dec.join("b", kv)
    try:
        dec.step({"a": first})
    except ValueError as exc:
        assert "'b'" in str(exc)
    else:  # pragma: no cover
        raise AssertionError("a step without every row's token must fail")
