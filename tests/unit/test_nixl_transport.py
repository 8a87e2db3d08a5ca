"""The nixl transport with real NIXL agents (UCX over loopback): a bitwise READ, ranges outside the announced
buffers refused, setup info checked, and registrations balanced over many sessions."""

from __future__ import annotations

import threading

import pytest
import torch

from refit.tools.doctor import nixl_installed

if not nixl_installed():
    pytest.skip("needs nixl: pip install '.[nixl]'", allow_module_level=True)

from refit import ModuleEngine, ModuleSource, PeerError, Receiver, Sender, Settings  # noqa: E402
from refit.transports import nixl  # noqa: E402

SETTINGS = Settings(bucket_bytes=1 << 16, timeout_s=30)
DEVICE = torch.device("cpu")


def _pair(capacity: int = 1 << 20, slots: int = 2):
    sender, info = nixl.NixlTransport.offer(
        capacity=capacity, num_slots=slots, num_receivers=1, device=DEVICE, settings=SETTINGS
    )
    return sender, info, nixl.NixlTransport.join(info, rank=1, device=DEVICE, settings=SETTINGS)


def test_a_read_moves_one_mebibyte_bitwise_and_only_the_bytes_asked_for() -> None:
    sender, _, receiver = _pair()
    try:
        g = torch.Generator().manual_seed(3)
        for slot in (0, 1):
            sender.buffers[slot].copy_(torch.randint(0, 256, (1 << 20,), generator=g, dtype=torch.uint8))
        receiver.recv(1, 1 << 20).wait(30)
        assert torch.equal(receiver.buffers[1], sender.buffers[1])
        receiver.buffers[0].fill_(7)
        receiver.recv(0, 1000).wait(30)
        assert torch.equal(receiver.buffers[0][:1000], sender.buffers[0][:1000])
        assert bool((receiver.buffers[0][1000:] == 7).all())
    finally:
        receiver.close()
        sender.close()


def test_a_range_outside_what_the_sender_announced_is_refused() -> None:
    sender, _, receiver = _pair(capacity=4096)
    try:
        with pytest.raises(ValueError, match=r"4097 B from slot 0 lies outside the 4096 B the sender announced"):
            receiver.recv(0, 4097)
        with pytest.raises(ValueError, match=r"slot 2 was not announced \(the sender announced 2 slots\)"):
            receiver.recv(2, 16)
    finally:
        receiver.close()
        sender.close()


@pytest.mark.parametrize(
    "change",
    [
        {"buffers": [[1, 4096]]},
        {"buffers": [[1, 100, 0]]},
        {"mem": "FILE"},
        {"metadata": "not base64!"},
        {"agent": 5},
    ],
)
def test_malformed_setup_info_is_refused_before_any_agent_is_added(change: dict) -> None:
    sender, info, receiver = _pair(capacity=4096)
    receiver.close()
    try:
        with pytest.raises(PeerError, match=r"nixl setup"):
            nixl.NixlTransport.join({**info, **change}, rank=1, device=DEVICE, settings=SETTINGS)
    finally:
        sender.close()


@pytest.mark.slow  # twenty sessions: about 12 s on the 2-core machine
def test_one_agent_per_role_serves_twenty_sessions_and_every_registration_is_released() -> None:
    g = torch.Generator().manual_seed(0)
    live = {f"w{i}": torch.randn(64, 64, generator=g) for i in range(6)}
    before = nixl.counts()
    for session in range(20):
        held = {k: torch.zeros_like(v) for k, v in live.items()}
        sender = Sender(ModuleSource(live), transport="nixl", settings=SETTINGS)
        receiver = Receiver(ModuleEngine(held), sender.rendezvous(), settings=SETTINGS)
        thread = threading.Thread(target=lambda r=receiver: (r.connect(), r.receive()))
        thread.start()
        with sender:
            for t in live.values():
                t.add_(1.0)
            sender.refit(session + 1)
        thread.join(60)
        receiver.close()
        assert not thread.is_alive()
        assert all(torch.equal(held[k], live[k]) for k in live)
    after = nixl.counts()
    assert after["agents"] - before["agents"] <= 2  # a serving and a reading agent, made once
    assert after["registered"] - before["registered"] == 40  # each session: the sender's and the receiver's
    assert after["deregistered"] - before["deregistered"] == 40
