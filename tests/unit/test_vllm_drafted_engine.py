"""DraftedEngine without vLLM: the target's names and the draft's (`draft.<name>`) in one manifest, one refit
loads and verifies both under one version, and a commit that fails in either model fails the version for
both. `drafted` names a trainer's target and draft that way."""

from __future__ import annotations

import threading

import pytest
import torch

from refit import ModuleSource, Receiver, Sender, Settings
from refit.engines.module import ModuleEngine
from refit.errors import RefitError
from refit.integrations.vllm.draft import DraftedEngine, drafted


class _Part(ModuleEngine):
    """Stands for one model's VllmEngine: a ModuleEngine with its load seconds, whose commit can fail."""

    def __init__(self, module: torch.nn.Module, *, fail_commit: bool = False) -> None:
        super().__init__(module)
        self.seconds = {"copy": 0.0, "post": 0.0}
        self.fail_commit = fail_commit

    def commit(self, version: int) -> None:
        if self.fail_commit:
            raise RuntimeError("post-processing failed")
        super().commit(version)


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))


def _refit(source: torch.nn.Module, engine: DraftedEngine) -> list:
    sender = Sender(ModuleSource(source), transport="shm", settings=Settings(timeout_s=60.0))
    got: list = []

    def serve() -> None:
        r = Receiver(engine, sender.rendezvous(), settings=Settings(timeout_s=60.0))
        try:
            got.append(r.receive())
        except Exception as e:  # noqa: BLE001 - handed to the test's thread
            got.append(e)
        finally:
            r.close()

    t = threading.Thread(target=serve)
    t.start()
    try:
        got.append(sender.refit(1))
    except RefitError as e:
        got.append(e)
    finally:
        sender.close()
        t.join()
    return got


def test_drafted_names_the_targets_tensors_as_they_are_and_the_drafts_under_draft() -> None:
    target, draft = _model(0), _model(1)
    names = dict(drafted(target, draft).named_parameters())
    assert names["0.weight"] is target[0].weight and names["draft.1.bias"] is draft[1].bias
    assert len(names) == 8


def test_one_refit_loads_target_and_draft_as_one_version() -> None:
    target, draft = _model(0), _model(1)
    engine = DraftedEngine(_Part(_model(2)))  # type: ignore[arg-type]
    engine.attach(_Part(_model(3)))  # type: ignore[arg-type]
    got = _refit(drafted(target, draft), engine)
    assert not [g for g in got if isinstance(g, Exception)], got
    assert got[-1].unverified == 0  # the fingerprint read both models back
    assert engine.weights.version == engine.target.weights.version == engine.draft.weights.version == 1  # type: ignore[union-attr]
    assert torch.equal(engine.draft.tensor("1.bias"), draft[1].bias)  # type: ignore[union-attr]
    assert torch.equal(engine.target.tensor("0.weight"), target[0].weight)  # type: ignore[attr-defined]


def test_a_draft_that_fails_to_commit_fails_the_version_of_both() -> None:
    engine = DraftedEngine(_Part(_model(2)))  # type: ignore[arg-type]
    engine.attach(_Part(_model(3), fail_commit=True))  # type: ignore[arg-type]
    got = _refit(drafted(_model(0), _model(1)), engine)
    assert any("post-processing failed" in str(g) for g in got if isinstance(g, Exception)), got
    assert engine.weights.state.name == "FAILED" and engine.target.weights.state.name == "FAILED"
    with pytest.raises(RefitError):
        engine.ensure_current()


def test_draft_tensors_without_a_draft_model_fail_the_handshake() -> None:
    engine = DraftedEngine(_Part(_model(2)))  # type: ignore[arg-type]
    got = _refit(drafted(_model(0), _model(1)), engine)
    assert any("draft.0.weight" in str(g) for g in got if isinstance(g, Exception)), got
    assert engine.weights.version is None


class _Rooted(torch.nn.Module):
    """A target with tensors of its own at the root: a parameter, a persistent buffer and a non-persistent one."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.body = torch.nn.Linear(4, 4)
        self.gain = torch.nn.Parameter(torch.randn(4, generator=g))
        self.register_buffer("table", torch.randint(0, 1 << 30, (6,), generator=g))
        self.register_buffer("cache", torch.randn(3, generator=g), persistent=False)


def test_drafted_carries_the_targets_root_buffers_bitwise_and_reads_them_live() -> None:
    target, draft = _Rooted(0), _model(1)
    both = drafted(target, draft)
    assert set(both.state_dict()) == {*target.state_dict(), *(f"draft.{n}" for n in draft.state_dict())}
    assert "cache" not in both.state_dict()  # a non-persistent buffer stays so
    target.table = torch.randint(0, 1 << 30, (6,), generator=torch.Generator().manual_seed(9))  # reassigned
    engine = DraftedEngine(_Part(_Rooted(2)))  # type: ignore[arg-type]
    engine.attach(_Part(_model(3)))  # type: ignore[arg-type]
    got = _refit(both, engine)
    assert not [g for g in got if isinstance(g, Exception)], got
    for name in ("table", "gain", "body.weight"):
        want = target.state_dict()[name]
        assert torch.equal(engine.target.tensor(name).view(torch.uint8), want.detach().view(torch.uint8)), name  # type: ignore[attr-defined]
