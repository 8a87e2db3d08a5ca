"""The canary: every N refits the engine scores a fixed probe with what it computes with and compares it with the
trainer's scores before it commits. A backend tensor derived after loading and left stale passes the fingerprint
(the bytes it was sent are right) and fails the canary, naming the first token that diverges."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from threaded import Peer, refit_both, session

from refit import (
    Canary,
    HandshakeError,
    ModuleEngine,
    ModuleSource,
    Receiver,
    RefitError,
    Sender,
    Settings,
    State,
    causal_lm,
)
from refit.checks import canary
from refit.errors import IntegrityError
from refit.topology.stats import RefitStats

SETTINGS = Settings(bucket_bytes=64 << 10, timeout_s=60.0)
PROBE = [1, 17, 250, 3, 999, 42, 7, 512]


def _lm(seed: int, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    from refit.tools.demo.model import model_config

    torch.manual_seed(seed)
    return LlamaForCausalLM(model_config(layers=2, hidden=64, ffn=128)).to(dtype).eval()


def _step(model: torch.nn.Module, version: int) -> None:
    g = torch.Generator().manual_seed(1000 + version)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


class Repacked(ModuleEngine):
    """An engine that computes its logits with a copy of lm_head derived after loading (as a backend repacks
    its linears), made again at each commit unless `stale`."""

    def __init__(self, model: torch.nn.Module, *, stale: bool = False) -> None:
        self.stale = stale
        self.packed = model.lm_head.weight.detach().clone()
        self.scored = 0
        super().__init__(model, probe=self._score)

    def commit(self, version: int) -> None:
        if not self.stale:
            self.packed = self.module.lm_head.weight.detach().clone()
        super().commit(version)

    def _score(self, tokens: torch.Tensor) -> torch.Tensor:
        self.scored += 1
        hidden = self.module.model(tokens[None]).last_hidden_state[0, :-1]
        logp = (hidden @ self.packed.T).float().log_softmax(-1)
        return logp.gather(-1, tokens[1:, None])[:, 0]


class Counted:
    """The trainer's scoring, counting its calls."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.score, self.calls = canary.causal_lm(model), 0

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.score(tokens)


@pytest.mark.parametrize("verify", ["fingerprint", None])
def test_an_engine_that_computes_with_what_it_was_sent_passes_every_canary(verify: str | None) -> None:
    trainer, engine = _lm(0), Repacked(_lm(1))
    reference = Counted(trainer)
    with session(ModuleSource(trainer), engine, SETTINGS, verify=verify, canary=Canary(PROBE, reference)) as (
        sender,
        peer,
    ):
        for version in (1, 2, 3):
            _step(trainer, version)
            stats, got = refit_both(sender, peer, version)
            assert isinstance(stats, RefitStats) and isinstance(got, RefitStats), (stats, got)
            assert "canary" in stats.seconds and "canary" in got.seconds
            assert engine.weights.version == version and engine.weights.state == State.CURRENT
        mine = canary.causal_lm(engine.module)(torch.tensor(PROBE))
        assert torch.equal(mine, reference.score(torch.tensor(PROBE)))  # same weights, same scores
    assert reference.calls == engine.scored == 3


@pytest.mark.parametrize("verify", ["fingerprint", None])
def test_a_stale_repacked_tensor_passes_the_fingerprint_and_fails_the_canary_naming_the_token(
    verify: str | None,
) -> None:
    trainer, engine = _lm(0), Repacked(_lm(1), stale=True)
    with session(
        ModuleSource(trainer), engine, SETTINGS, verify=verify, canary=Canary(PROBE, canary.causal_lm(trainer))
    ) as (
        sender,
        peer,
    ):
        _step(trainer, 1)
        stats, got = refit_both(sender, peer, 1)
    assert isinstance(stats, RefitError) and isinstance(got, RefitError), (stats, got)
    assert "canary failed at refit 1: probe token 1 (id 17)" in str(stats), stats
    assert "tolerance 0.001" in str(stats)  # float32 engine
    assert engine.weights.state == State.FAILED
    assert torch.equal(engine.module.lm_head.weight, trainer.lm_head.weight)  # the bytes it was sent are right


def test_without_a_canary_the_stale_repack_commits_silently() -> None:
    """What the canary adds: the same stale engine, fingerprint on and no canary, reports success."""
    trainer, engine = _lm(0), Repacked(_lm(1), stale=True)
    with session(ModuleSource(trainer), engine, SETTINGS) as (sender, peer):
        _step(trainer, 1)
        stats, got = refit_both(sender, peer, 1)
    assert isinstance(stats, RefitStats) and isinstance(got, RefitStats), (stats, got)
    assert engine.weights.state == State.CURRENT and engine.scored == 0


def test_the_canary_runs_at_the_first_refit_and_every_nth_after() -> None:
    trainer, engine = _lm(0), Repacked(_lm(1))
    reference = Counted(trainer)
    with session(ModuleSource(trainer), engine, SETTINGS, canary=Canary(PROBE, reference, every=3)) as (sender, peer):
        ran = []
        for version in range(1, 8):
            _step(trainer, version)
            stats, got = refit_both(sender, peer, version)
            assert isinstance(stats, RefitStats) and isinstance(got, RefitStats), (stats, got)
            ran.append("canary" in got.seconds)
    assert ran == [True, False, False, True, False, False, True]
    assert reference.calls == engine.scored == 3


def test_a_bf16_engine_passes_within_its_dtype_tolerance_and_a_tighter_one_fails() -> None:
    trainer = _lm(0)
    source = ModuleSource(trainer, wire_dtype=torch.bfloat16)
    engine = ModuleEngine(_lm(1, torch.bfloat16))
    ids = torch.tensor(PROBE)
    with session(source, engine, SETTINGS, canary=Canary(PROBE, canary.causal_lm(trainer))) as (sender, peer):
        _step(trainer, 1)
        stats, got = refit_both(sender, peer, 1)
        assert isinstance(stats, RefitStats) and isinstance(got, RefitStats), (stats, got)
        gap = (canary.causal_lm(engine.module)(ids) - canary.causal_lm(trainer)(ids)).abs().max().item()
        assert 0 < gap < canary.TOLERANCES[torch.bfloat16], gap  # bf16 rounding moves it, within the tolerance
        sender.canary = Canary(PROBE, canary.causal_lm(trainer), tolerance=gap / 2)
        _step(trainer, 2)
        stats, got = refit_both(sender, peer, 2)
    assert isinstance(stats, RefitError) and "canary failed at refit 2" in str(stats), stats


def test_an_engine_that_cannot_score_is_refused_at_the_handshake_naming_the_fixes() -> None:
    trainer = _lm(0)
    held = {k: v.clone() for k, v in _lm(1).state_dict().items()}
    sender = Sender(
        ModuleSource(trainer), transport="shm", settings=SETTINGS, canary=Canary(PROBE, canary.causal_lm(trainer))
    )
    peer = Peer(Receiver(ModuleEngine(held), sender.rendezvous(), settings=SETTINGS))
    peer.ask("connect")
    try:
        with pytest.raises(
            HandshakeError, match=r"receiver 0 cannot score a probe.*ModuleEngine\(module, probe=\.\.\.\)"
        ):
            sender.connect()
    finally:
        sender.close()
        peer.stop()


def test_a_staged_receiver_is_refused_a_canary() -> None:
    trainer = _lm(0)
    with pytest.raises(HandshakeError, match="a staged receiver scores only after apply_staged"):
        with session(ModuleSource(trainer), ModuleEngine(_lm(1)), SETTINGS, staged=True,
                     canary=Canary(PROBE, canary.causal_lm(trainer))) as (sender, _):  # fmt: skip
            sender.connect()


def test_a_trainer_scoring_that_raises_fails_before_begin_and_the_session_goes_on() -> None:
    trainer, engine = _lm(0), Repacked(_lm(1))
    score = canary.causal_lm(trainer)
    broken = {"now": True}

    def flaky(tokens: torch.Tensor) -> torch.Tensor:
        return score(tokens)[:-1] if broken.pop("now", False) else score(tokens)

    with session(ModuleSource(trainer), engine, SETTINGS, canary=Canary(PROBE, flaky)) as (sender, peer):
        peer.ask("receive")
        with pytest.raises(ValueError, match="the trainer's canary reference must be 7 floats"):
            sender.refit(1)
        assert engine.weights.version is None  # nothing began
        _step(trainer, 2)
        stats = sender.refit(2)
        got = peer.outcome()
    assert isinstance(got, RefitStats) and got.version == 2 and "canary" in stats.seconds


@pytest.mark.parametrize(
    "bad",
    [
        [],
        "x",
        {"tokens": [1, 2], "logprobs": [-1.0]},
        {"tokens": [1], "logprobs": [], "tolerance": None},
        {"tokens": [1, 2], "logprobs": [0.5], "tolerance": None},
        {"tokens": [1, 2], "logprobs": [-1.0, -2.0], "tolerance": None},
        {"tokens": [1, -2], "logprobs": [-1.0], "tolerance": None},
        {"tokens": [1, True], "logprobs": [-1.0], "tolerance": None},
        {"tokens": [1, 2], "logprobs": [-1.0], "tolerance": 0},
        {"tokens": [1, 2], "logprobs": ["-1"], "tolerance": None},
        {"tokens": list(range(canary.MAX_PROBE_TOKENS + 1)), "logprobs": [-1.0] * 512, "tolerance": None},
        {"tokens": [1, 2], "logprobs": [-1.0], "tolerance": None, "more": 1},
    ],
)
def test_a_malformed_canary_in_commit_is_refused_by_name(bad: object) -> None:
    with pytest.raises(IntegrityError, match="canary"):
        canary.parse(bad)


@settings(max_examples=200, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=4),
                    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.sampled_from(["tokens", "logprobs", "tolerance", "x"]), c, max_size=4),
                    max_leaves=12))  # fmt: skip
def test_any_json_commit_canary_parses_or_is_refused_as_integrity(payload: object) -> None:
    try:
        probe = canary.parse(json.loads(json.dumps(payload)) if payload == payload else None)
    except IntegrityError:
        return
    assert probe is None or (len(probe.logprobs) == len(probe.tokens) - 1 and all(v <= 0 for v in probe.logprobs))


def test_a_canary_is_checked_when_made() -> None:
    score = canary.causal_lm(_lm(0))
    for kwargs in (
        {"tokens": [1]},
        {"tokens": [1, -1]},
        {"every": 0},
        {"tolerance": -1.0},
        {"tolerance": float("nan")},
    ):
        with pytest.raises(ValueError, match="canary"):
            Canary(**{"tokens": PROBE, "reference": score, **kwargs})


def test_a_refit_that_failed_its_canary_is_retried_with_it_and_the_engine_reports_its_last_version() -> None:
    trainer, engine = _lm(0), Repacked(_lm(1))
    with session(ModuleSource(trainer), engine, SETTINGS, canary=Canary(PROBE, causal_lm(trainer), every=2)) as (
        sender,
        peer,
    ):
        for version in (1, 2):
            _step(trainer, version)
            stats, got = refit_both(sender, peer, version)
            assert isinstance(got, RefitStats) and ("canary" in got.seconds) == (version == 1), got
        engine.stale = True
        _step(trainer, 3)
        stats, got = refit_both(sender, peer, 3)
        assert isinstance(stats, RefitError) and "canary failed at refit 3" in str(stats), stats
        w = engine.weights
        assert (w.state, w.version, w.target) == (State.FAILED, 2, 3)  # never reported as holding 3
        engine.stale = False
        stats, got = refit_both(sender, peer, 3)  # the retry carries the probe it was due
        assert isinstance(got, RefitStats) and "canary" in got.seconds, got
        assert engine.weights.version == 3 and engine.weights.state == State.CURRENT


def test_the_trainers_scoring_runs_in_eval_mode_and_leaves_the_training_mode_alone() -> None:
    from transformers import LlamaForCausalLM

    from refit.tools.demo.model import model_config

    config = model_config(layers=2, hidden=64, ffn=128)
    config.attention_dropout = 0.5
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).train()
    score = causal_lm(model)
    ids = torch.tensor(PROBE)
    assert torch.equal(score(ids), score(ids))  # no dropout: the same scores twice
    assert model.training and all(m.training for m in model.modules())


def test_a_probe_token_beyond_the_vocabulary_is_refused_before_the_forward() -> None:
    model = _lm(0)
    with pytest.raises(ValueError, match=r"probe token id 5000 is beyond the model's vocabulary of 1024"):
        causal_lm(model)(torch.tensor([1, 5000]))
    probe = canary.Probe((1, 5000), (-1.0,), None)
    failure = canary.check(causal_lm(model), probe, [torch.float32], 4)
    assert failure is not None and "beyond the model's vocabulary" in str(failure)


class LazyCache(torch.nn.Module):
    """A tiny causal LM that builds a table in its first forward and keeps it (as a rotary cache does)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = torch.nn.Embedding(32, 8), torch.nn.Linear(8, 32)
        self.table: torch.Tensor | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.table is None:
            self.table = torch.linspace(0, 1, 8) * 2
        return self.head(self.embed(ids) * self.table)


def test_the_trainers_scoring_leaves_a_lazily_built_cache_usable_for_training() -> None:
    model = LazyCache()
    causal_lm(model)(torch.tensor([1, 5, 7]))
    loss = model(torch.tensor([[1, 2, 3]])).logsumexp(-1).sum()
    loss.backward()  # a cache made under inference_mode could not be saved for backward
    assert model.head.weight.grad is not None


def test_done_follows_the_commit_so_the_engine_reads_current_when_refit_returns() -> None:
    trainer, engine = LazyCache(), ModuleEngine(LazyCache())
    with session(ModuleSource(trainer), engine, SETTINGS, canary=Canary([1, 5, 7, 3], causal_lm(trainer))) as (
        sender,
        peer,
    ):
        for version in range(1, 21):
            peer.ask("receive")
            sender.refit(version)
            seen = (engine.weights.state, engine.weights.version)  # before the engine's thread goes on
            assert isinstance(peer.outcome(), RefitStats)
            assert seen == (State.CURRENT, version), (version, seen)
