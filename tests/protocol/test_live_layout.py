"""A live engine tensor changed after its bytes were checked (recast, reshaped, moved to new storage, replaced):
every path that commits into the live engine either follows the change (the manifest still fits, the bytes land
in the tensor the engine holds now) or refuses it, naming the tensor, before writing a byte. In one process over
shm; after every refit and apply the engine is compared with the trainer's live tensors."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import pytest
import torch
from threaded import Peer

from refit import ModuleEngine, ModuleSource, RefitError, Sender, Settings
from refit.topology.receiver import Receiver
from refit.topology.stats import RefitStats

CHANGES = ["dtype-wider", "dtype-lossy", "shape", "storage", "identity"]
"""How the engine's "w" changes: a float64 copy (holds float32 exactly), a float16 copy (does not), another shape,
the same tensor on new storage, and a new tensor object under the same name."""


def _trainer() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(16, 40, generator=g), "b": torch.randn(500, generator=g), "s": torch.arange(9)}


def _change(live: dict[str, torch.Tensor], how: str) -> None:
    t = live["w"]
    if how == "dtype-wider":
        t.data = t.data.double()
    elif how == "dtype-lossy":
        t.data = t.data.half()
    elif how == "shape":
        t.data = torch.zeros(8, 40)
    elif how == "storage":
        t.set_(t.detach().clone().untyped_storage(), 0, t.shape, t.stride())
    elif how == "identity":
        live["w"] = t.detach().clone()


def _holds(live: dict[str, torch.Tensor], trainer: dict[str, torch.Tensor]) -> bool:
    """Bitwise, in the trainer's dtype, and exactly (a wider engine tensor holds only trainer values)."""
    for n, want in trainer.items():
        got = live[n]
        if got.shape != want.shape or not torch.equal(got.to(want.dtype).to(got.dtype), got):
            return False
        if not torch.equal(got.to(want.dtype).contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)):
            return False
    return True


@contextlib.contextmanager
def _session(verify: str | None = "fingerprint", **receiver_args: object) -> Iterator[tuple[Sender, dict, dict, Peer]]:
    trainer = _trainer()
    live = {n: torch.zeros_like(t) for n, t in trainer.items()}
    settings = Settings(bucket_bytes=4096, timeout_s=60.0)
    sender = Sender(ModuleSource(trainer), transport="shm", settings=settings, verify=verify)
    peer = Peer(Receiver(ModuleEngine(live), sender.rendezvous(), **receiver_args))
    peer.ask("connect")
    try:
        yield sender, trainer, live, peer
    finally:
        sender.close()
        peer.stop()


def _refit(sender: Sender, trainer: dict, peer: Peer, version: int) -> RefitStats | BaseException:
    with torch.no_grad():
        for t in trainer.values():
            t.add_(1)
    peer.ask("receive")
    try:
        sender.refit(version)
    except RefitError:
        pass
    return peer.outcome()  # type: ignore[return-value]


@pytest.mark.parametrize("how", CHANGES)
def test_unstaged_a_changed_engine_tensor_is_followed_or_the_refit_refused_naming_it(how: str) -> None:
    with _session() as (sender, trainer, live, peer):
        assert isinstance(_refit(sender, trainer, peer, 1), RefitStats) and _holds(live, trainer)
        _change(live, how)
        got = _refit(sender, trainer, peer, 2)
        w = peer.engine.weights
        if how in ("dtype-lossy", "shape"):
            assert isinstance(got, RefitError), got
            assert "the engine's tensors changed since the handshake of epoch 1 (w: float32 (16, 40) ->" in str(got)
            assert "nothing of refit 2 was loaded" in str(got)
            assert (w.state.value, w.version) == ("failed", 1)
            return
        assert isinstance(got, RefitStats), got
        assert (w.state.value, w.version) == ("current", 2) and _holds(live, trainer)
        assert isinstance(_refit(sender, trainer, peer, 3), RefitStats) and _holds(live, trainer)


def _apply(peer: Peer) -> bool | RefitError:
    try:
        return peer.receiver.apply_staged()
    except RefitError as e:
        return e


@pytest.mark.parametrize("how", CHANGES)
def test_staged_a_version_is_applied_only_into_the_layout_it_was_verified_for(how: str) -> None:
    commits: list[int] = []
    with _session(staged=True, on_commit=commits.append) as (sender, trainer, live, peer):
        assert isinstance(_refit(sender, trainer, peer, 1), RefitStats) and _apply(peer) is True
        assert _holds(live, trainer)
        assert isinstance(_refit(sender, trainer, peer, 2), RefitStats)  # staged, verified, not yet live
        _change(live, how)  # the engine loop changes the live model meanwhile
        got = _apply(peer)
        w = peer.engine.weights
        if how in ("storage", "identity"):  # the same layout: the bytes land in the tensor held now
            assert got is True and (w.state.value, w.version) == ("current", 2) and _holds(live, trainer)
            assert commits == [1, 2]
            return
        assert isinstance(got, RefitError), got
        assert "staged version 2 was not applied: the live engine's tensors changed since it was staged (w:" in str(got)
        assert (w.state.value, w.version, w.staged) == ("current", 1, 2) and commits == [1]
        nxt = _refit(sender, trainer, peer, 3)  # validates the new layout: stages for it, or refuses naming w
        if how == "dtype-wider":
            assert isinstance(nxt, RefitStats) and _apply(peer) is True
            assert (peer.engine.weights.version, commits) == (3, [1, 3]) and _holds(live, trainer)
        else:
            assert isinstance(nxt, RefitError) and "no longer fit the trainer's manifest" in str(nxt)
            assert _apply(peer) is False and peer.engine.weights.version == 1 and commits == [1]


def test_partial_staging_follows_a_recast_engine_and_refuses_a_reshaped_one() -> None:
    with _session(staged=True, staging_bytes=0) as (sender, trainer, live, peer):
        for version, how in ((1, None), (2, "dtype-wider"), (3, "shape")):
            if how is not None:
                _change(live, how)
            loop = threading.Thread(target=_loop, args=(peer, version))
            loop.start()
            got = _refit(sender, trainer, peer, version)
            loop.join()
            w = peer.engine.weights
            if how == "shape":
                assert isinstance(got, RefitError) and "no longer fit" in str(got)
                assert (w.state.value, w.version) == ("current", 2)  # refused before the live engine was begun
            else:
                assert isinstance(got, RefitStats) and (w.state.value, w.version) == ("current", version)
                assert _holds(live, trainer)


@pytest.mark.parametrize("verify", [None, "fingerprint"])
def test_partial_staging_a_recast_that_moves_a_tensor_out_of_staging_loads_it_live(verify: str | None) -> None:
    """Every tensor fits the staging bound as float32; "w" recast to float64 no longer does, so the refit that
    follows the recast loads part of the model live. The old staging copies of the names that moved must not
    be applied over their live load (with verify=None nothing else would notice)."""
    limit = sum(t.numel() * t.element_size() for t in _trainer().values())
    with _session(verify, staged=True, staging_bytes=limit) as (sender, trainer, live, peer):
        for version, how in ((1, None), (2, "dtype-wider"), (3, None)):
            if how is not None:
                _change(live, how)
            loop = threading.Thread(target=_loop, args=(peer, version))
            loop.start()
            got = _refit(sender, trainer, peer, version)
            loop.join()
            w = peer.engine.weights
            assert isinstance(got, RefitStats), got
            assert (w.state.value, w.version) == ("current", version) and _holds(live, trainer)
            staging = peer.receiver.staging
            assert staging is not None and bool(staging.direct) == (version > 1)
            assert (got.direct_bytes > 0) == (version > 1) and got.staged_bytes <= limit


def _loop(peer: Peer, version: int) -> None:
    """An engine loop calling apply_staged() between steps until `version` is live (or its refit failed)."""
    receiver = peer.receiver
    while True:
        with contextlib.suppress(RefitError):
            receiver.apply_staged()
        w = peer.engine.weights
        staging = receiver.staging
        ended = staging is not None and staging._ended[0] >= version
        if w.version == version or (ended and staging.ready is None):  # applied, or failed: nothing to apply
            return
