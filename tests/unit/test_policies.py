"""The modes as policies, each in one process: SenderOptions (typed, checked once), Commit (how a refit is
decided: single, strict, a vote), and the membership policies (Fixed, Elastic) through a Sender over shm with
receivers in threads. After every refit the engines are compared with the trainer's live tensors."""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from threaded import Peer

from refit import Commit, ModuleEngine, ModuleSource, RefitError, Sender, SenderOptions, Settings, State
from refit.topology.elastic import Elastic, Fixed
from refit.topology.ranked import RankedRefit, pick
from refit.topology.receiver import Receiver
from refit.topology.stats import RefitStats


def test_sender_options_are_checked_once_with_a_message_naming_the_fix() -> None:
    cases = {
        "num_receivers (0) must be >= 1": {"num_receivers": 0},
        "num_slots (0) must be >= 1": {"num_slots": 0},
        "verify must be one of": {"verify": "sometimes"},
        "min_receivers (-1) must be >= 0": {"min_receivers": -1},
        "is for an elastic Sender": {"min_receivers": 2},
        "cannot be combined with zero_copy": {"elastic": True, "zero_copy": True, "transport": "cuda-ipc"},
        "zero_copy needs the cuda-ipc or nixl transport": {"zero_copy": True},
    }
    for message, kw in cases.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            SenderOptions(**kw)  # type: ignore[arg-type]
    o = SenderOptions(transport="gloo", num_receivers=2)
    assert SenderOptions.of(o, {"verify": None}) == dataclasses.replace(o, verify=None)
    with pytest.raises(TypeError, match=r"unknown Sender option\(s\) \['trnsport'\]"):
        SenderOptions.of(None, {"trnsport": "shm"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.transport = "shm"  # type: ignore[misc]


def test_a_sender_takes_options_or_keywords_and_its_policies_follow_them() -> None:
    source = ModuleSource({"w": torch.zeros(4)})
    with Sender(source, SenderOptions(verify="strict"), num_receivers=2) as s:
        assert (s.options.num_receivers, s.commit, type(s.membership)) == (2, Commit(strict=True), Fixed)
    with Sender(source, elastic=True, min_receivers=0) as s:
        assert isinstance(s.membership, Elastic) and s.membership.min_receivers == 0 and not s.commit.two_phase
    with pytest.raises(ValueError, match="disagrees with verify='fingerprint'"):
        Sender(source, commit=Commit(strict=True))


def test_commit_policies_say_when_receivers_hold_their_commit_open() -> None:
    assert not Commit().two_phase and Commit().decide("x") == "x"
    assert Commit(strict=True).two_phase
    voted = Commit(vote=lambda own: own or "rank 1 failed")
    assert voted.two_phase and voted.decide("") == "rank 1 failed" and voted.decide("mine") == "mine"


@contextlib.contextmanager
def _session(commit: Commit) -> Iterator[tuple[Sender, dict[str, torch.Tensor], Peer, list[int]]]:
    g = torch.Generator().manual_seed(5)
    trainer = {"w": torch.randn(8, 16, generator=g), "b": torch.randn(40, generator=g)}
    commits: list[int] = []
    sender = Sender(ModuleSource(trainer), settings=Settings(bucket_bytes=4096, timeout_s=60.0), commit=commit)
    engine = ModuleEngine({n: torch.zeros_like(t) for n, t in trainer.items()})
    peer = Peer(Receiver(engine, sender.rendezvous(), on_commit=commits.append))
    peer.ask("connect")
    try:
        yield sender, trainer, peer, commits
    finally:
        sender.close()
        peer.stop()


def _holds(peer: Peer, trainer: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(peer.engine.tensor(n), t) for n, t in trainer.items())


@pytest.mark.parametrize("verdict", ["", "trainer rank 1: its engine worker failed"])
def test_a_vote_decides_the_commit_on_every_receiver(verdict: str) -> None:
    asked: list[str] = []

    def vote(own: str) -> str:
        asked.append(own)
        return own or verdict

    with _session(Commit(vote=vote)) as (sender, trainer, peer, commits):
        for version in (1, 2):
            with torch.no_grad():
                for t in trainer.values():
                    t.add_(1)
            peer.ask("receive")
            if verdict:
                with pytest.raises(RefitError, match="failed on another trainer rank.*its engine worker failed"):
                    sender.refit(version)
                got = peer.outcome()
                w = peer.engine.weights
                assert isinstance(got, RefitError) and (w.state, w.target) == (State.FAILED, version)
                assert commits == []
            else:
                assert isinstance(sender.refit(version), RefitStats) and isinstance(peer.outcome(), RefitStats)
                w = peer.engine.weights
                assert (w.state, w.version) == (State.CURRENT, version) and _holds(peer, trainer)
                assert commits == list(range(1, version + 1))
        assert asked == ["", ""]  # this rank's own outcome, each refit: its receiver committed


@contextlib.contextmanager
def _world_of_one() -> Iterator[dist.ProcessGroup | None]:
    """A real gloo group of one rank, in this process (RankedRefit's collectives run over it): a new group
    beside a default one an earlier in-process test left (a world of one too), else the default group."""
    if dist.is_initialized():
        assert dist.get_world_size() == 1, "this test needs a world of one rank"
        yield dist.new_group(backend="gloo")
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield None
    finally:
        dist.destroy_process_group()


def test_a_ranked_refit_builds_its_sender_with_the_vote_across_ranks_as_its_commit_policy() -> None:
    g = torch.Generator().manual_seed(7)
    trainer = {"w": torch.randn(8, 16, generator=g), "b": torch.randn(40, generator=g)}
    source = ModuleSource(trainer)
    assert not hasattr(Sender, "vote_with")  # no policy is changed on a Sender after its construction
    with _world_of_one() as group:
        with Sender(source) as built, pytest.raises(ValueError, match=r"pass the source and the Sender's options"):
            RankedRefit(built)
        ranked = RankedRefit(source, group=group, settings=Settings(bucket_bytes=4096, timeout_s=60.0), verify="strict")
        try:
            commit = ranked.sender.commit
            assert commit.strict and commit.vote == ranked._vote and commit.two_phase
            engine = ModuleEngine({n: torch.zeros_like(t) for n, t in trainer.items()})
            peer = Peer(Receiver(engine, pick(ranked.rendezvous(), torch.device("cpu"), index=0)))
            peer.ask("connect")
            try:
                for version in (1, 2):
                    with torch.no_grad():
                        trainer["w"].mul_(2)
                    peer.ask("receive")
                    assert isinstance(ranked.refit(version), RefitStats) and isinstance(peer.outcome(), RefitStats)
                    assert (engine.weights.state, engine.weights.version) == (State.CURRENT, version)
                    assert _holds(peer, trainer)
            finally:
                ranked.close()
                peer.stop()
        finally:
            ranked.close()
