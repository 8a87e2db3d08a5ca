"""A fleet: one trainer into replicas grouped by site over the 'relay' transport. Each site gets each bucket from
the trainer once (its relay), the rest of the site from the relay; every replica lands the trainer's tensors
bitwise, checked against the trainer's fingerprint, and a relay that dies mid-refit fails that refit only."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest
import torch
from peer import Peer, make_tensors
from sessions import assert_current, step

from refit import ModuleSource, Sender, Settings
from refit.transports.relay import Sites

SPECS = [[f"layer.{i}.weight", [128, 128], "float32"] for i in range(8)]
"""256 KiB in bf16 on the wire: 8 buckets of 32 KiB."""
BUCKET = 32 << 10


def test_sites_group_ranks_by_what_they_stated_and_a_blank_site_is_its_own() -> None:
    sites = Sites.of({1: "rack-1", 2: "", 3: "rack-1", 4: "rack-2", 5: ""})
    assert sites.members == ((1, 3), (2,), (4,), (5,))
    assert sites.relays == (1, 2, 4, 5)
    assert Sites.from_json(sites.to_json().encode(), 6) == sites


@pytest.mark.parametrize("raw", [b"[[1, 2]]", b"[[1], [1, 2]]", b"[[1, 2, 3], 4]", b"{}", b"nope"])
def test_a_malformed_relay_plan_is_refused(raw: bytes) -> None:
    with pytest.raises(Exception, match="malformed"):
        Sites.from_json(raw, 4)


def _peers(sender: Sender, sites: list[str], timeout_s: float, faults: dict[int, dict] | None = None) -> list[Peer]:
    args = {"rendezvous": sender.rendezvous(), "specs": SPECS, "bucket_bytes": BUCKET, "timeout_s": timeout_s}
    peers, old = [], os.environ.get("REFIT_SITE")
    try:
        for i, site in enumerate(sites):
            os.environ["REFIT_SITE"] = site
            fault = (faults or {}).get(i)
            peers.append(Peer({**args, **({"fault": fault} if fault else {})}))
    finally:
        os.environ.pop("REFIT_SITE") if old is None else os.environ.__setitem__("REFIT_SITE", old)
    return peers


@pytest.fixture
def tensors() -> Iterator[dict[str, torch.Tensor]]:
    yield make_tensors(SPECS, seed=1)


@pytest.mark.slow
@pytest.mark.parametrize("sites", [["a", "a", "a"], ["a", "b", "a", "b"], ["", ""]], ids=["one", "two", "own"])
def test_fan_out_by_site_lands_every_replica_bitwise_and_verified(
    tensors: dict[str, torch.Tensor], sites: list[str]
) -> None:
    settings = Settings(bucket_bytes=BUCKET, timeout_s=60)
    source = ModuleSource(tensors, wire_dtype=torch.bfloat16)
    sender = Sender(source, transport="relay", num_receivers=len(sites), settings=settings, verify="fingerprint")
    peers = _peers(sender, sites, 60)
    try:
        for version in (1, 2, 3):
            step(tensors)
            stats = sender.refit(version)
            assert stats.unverified == 0 and sorted(stats.receivers) == list(range(1, len(sites) + 1))
            for p in peers:
                assert_current(p.report(), sender, tensors, version)
        relays = sender.transport.sites.relays  # type: ignore[union-attr]
        assert len(relays) == len(set(s or str(i) for i, s in enumerate(sites)))
    finally:
        sender.close()
        assert [p.wait() for p in peers] == [0] * len(peers)


TIMEOUT_S = 20.0
"""REFIT_TIMEOUT of the kill tests: a relay's death must fail its refit well within it."""


@pytest.mark.slow
def test_a_relay_killed_mid_refit_fails_that_attempt_and_the_refit_commits_on_the_rest(
    tensors: dict[str, torch.Tensor],
) -> None:
    """An elastic fleet of one site of 3: the relay (the first to join: group rank 1) dies at its third bucket of
    refit 3. The group breaks within REFIT_TIMEOUT, the sender names the relay as departed and forms a new group
    (a new relay), and refit 3 and 4 commit on the other two, bitwise; nobody read current with mixed bytes."""
    settings = Settings(bucket_bytes=BUCKET, timeout_s=TIMEOUT_S)
    source = ModuleSource(tensors, wire_dtype=torch.bfloat16)
    sender = Sender(source, transport="relay", settings=settings, elastic=True, verify="fingerprint")
    relay = _peers(sender, ["a"], TIMEOUT_S, {0: {"kind": "die", "version": 3, "at_load": 3}})[0]
    peers = []
    try:
        step(tensors)
        sender.refit(1)
        assert_current(relay.report(), sender, tensors, 1)
        peers = _peers(sender, ["a", "a"], TIMEOUT_S)
        assert sender.await_receivers(3, timeout_s=120)
        step(tensors)
        sender.refit(2)
        assert sender.transport.sites.members == ((1, 2, 3),)  # type: ignore[union-attr]
        for p in (relay, *peers):
            assert_current(p.report(), sender, tensors, 2)
        step(tensors)
        t = time.monotonic()
        stats = sender.refit(3)
        assert time.monotonic() - t < TIMEOUT_S, "the relay's death was noticed only at the timeout"
        assert relay.wait() == 9
        assert [d["receiver"] for d in stats.departed] == [1], stats.departed
        assert sender.transport.sites.members == ((1, 2),)  # type: ignore[union-attr]
        for version in (3, 4):
            if version == 4:
                step(tensors)
                sender.refit(4)
            for p in peers:
                assert_current(p.report(), sender, tensors, version)
    finally:
        sender.close()
        assert [p.wait() for p in peers] == [0] * len(peers)
