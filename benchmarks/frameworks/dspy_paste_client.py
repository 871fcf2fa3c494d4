"""A DSPy program that pastes its context into the prompt, unchanged, against a fusionrag server.

Run in ``.venv-client`` (DSPy, no torch) by ``pasted_ttft.py --client dspy``: ``dspy.Predict("context,
question -> answer")`` called with each question's passages as its ``context`` list (the Haystack
pipeline's BM25 top k, given in the job, so every client pastes the same ones), formatted by DSPy's own
``ChatAdapter`` template (a system message describing the fields, then ``[[ ## context ## ]]`` with the
passages as ``[1] «...»``, indented when multi-line), through ``dspy.LM("openai/<served name>",
api_base=..., cache=False, max_tokens=1)``: one call, its run time the time to first token.

One token is no parsable answer, so DSPy's ``ChatAdapter`` would retry with its ``JSONAdapter`` (a second
call, another template); ``use_json_adapter_fallback=False`` keeps it to the one call and the parse error
is caught (``parsed: false``). The ``fusionrag`` cell is the program as a DSPy user writes it (DSPy's
``engine="auto"`` sends it with its vendored ``lm15`` client); the ``full`` cell's LM adds only
``extra_body={"method": "full"}`` (the baseline: the same prompt, prefilled whole; DSPy sends a request with
``extra_body`` through litellm). The response's usage is its raw JSON (``provider_data``, lm15) or litellm's
usage, each holding ``usage.fusionrag``; DSPy's own usage keeps only the standard fields. Reads a JSON job on
stdin, writes one JSON line per run on stdout.
"""

from __future__ import annotations

import json
import sys
import time

import dspy
from dspy.utils.exceptions import AdapterParseError
from paste_common import tokenize_count


def usage_of(response) -> tuple[dict, str]:
    """The server's ``usage`` object (with ``fusionrag``) of one DSPy LM response, and which engine sent it."""
    raw = getattr(response, "provider_data", None)
    if isinstance(raw, dict) and "usage" in raw:  # lm15: the response's JSON
        return raw["usage"], "lm15"
    return response.usage.model_dump(), "litellm"  # litellm's ModelResponse: it keeps unknown usage fields


def main() -> int:
    job = json.loads(sys.stdin.read())
    model = f"openai/{job['model']}"
    lms = {"fusionrag": dspy.LM(model, api_base=job["url"], api_key="x", cache=False, max_tokens=1),
           "full": dspy.LM(model, api_base=job["url"], api_key="x", cache=False, max_tokens=1,
                           extra_body={"method": "full"})}
    dspy.configure(adapter=dspy.ChatAdapter(use_json_adapter_fallback=False))
    program = dspy.Predict("context, question -> answer")
    for rnd in range(job["rounds"] + 1):  # round 0: warm-up, not measured
        for i, (question, passages) in enumerate(zip(job["questions"], job["passages"], strict=True)):
            order = list(lms) if (rnd + i) % 2 == 0 else list(reversed(lms))
            for name in order:
                lm, calls = lms[name], len(lms[name].history)
                parsed = True
                t0 = time.perf_counter()
                with dspy.context(lm=lm):
                    try:
                        program(context=passages, question=question)
                    except AdapterParseError:
                        parsed = False
                seconds = time.perf_counter() - t0
                usage, engine = usage_of(lm.history[-1]["response"])
                print(json.dumps({"round": rnd, "question": i, "cell": name, "seconds": seconds, "usage": usage,
                                  "pasted": len(passages), "lm_calls": len(lm.history) - calls, "engine": engine,
                                  "parsed": parsed, "dspy_usage": lm.history[-1]["usage"],
                                  "tokenize_count": tokenize_count(job["url"], messages=lm.history[-1]["messages"])}),
                      flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
