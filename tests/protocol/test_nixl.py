"""Refits over nixl between real processes: every engine bitwise equal to the trainer's live tensors after
every refit (the default fingerprint), an elastic joiner, and a receiver or a sender killed with a READ in
flight: an error within the refit's timeout, never a hang."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from refit.tools.doctor import nixl_installed

if not nixl_installed():
    pytest.skip("needs nixl: pip install '.[nixl]'", allow_module_level=True)

import warm  # noqa: E402
from elastic_peer import ElasticPeer  # noqa: E402
from locations import helper, pythonpath  # noqa: E402
from nixl_peer import DyingPeer  # noqa: E402
from peer import make_tensors  # noqa: E402
from sessions import assert_current, session, step  # noqa: E402

from refit import ModuleEngine, ModuleSource, PeerError, Receiver, Sender, Settings  # noqa: E402
from refit.transports import nixl  # noqa: E402

SPECS = [[f"w{i}", [32, 32], "float32"] for i in range(6)]  # 4 KiB each: one tensor per bucket
TIMEOUT_S = 20.0


@pytest.mark.slow
def test_two_engines_hold_the_trainers_live_tensors_after_every_refit_over_nixl() -> None:
    with session(SPECS, transport="nixl", receivers=2) as (sender, tensors, peers):
        for version in (1, 2, 3):
            stats = sender.refit(version)
            assert stats.unverified == 0  # the default fingerprint covered every tensor
            for p in peers:
                assert_current(p.report(), sender, tensors, version)
            step(tensors, by=version)
    assert [p.wait() for p in peers] == [0, 0]


@pytest.mark.slow
def test_an_elastic_joiner_over_nixl_is_one_more_remote_agent_and_gets_the_current_weights() -> None:
    tensors = make_tensors(SPECS, seed=1)
    settings = Settings(bucket_bytes=4096, timeout_s=TIMEOUT_S)
    sender = Sender(ModuleSource(tensors), transport="nixl", settings=settings, elastic=True)
    args = {"rendezvous": sender.rendezvous(), "specs": SPECS, "bucket_bytes": 4096, "timeout_s": TIMEOUT_S}
    with sender:
        a = ElasticPeer(args)
        sender.refit(1)
        assert_current(a.report(), sender, tensors, 1)
        b = ElasticPeer({**args, "seed": 7})
        b.started()
        assert sender.await_receivers(2, timeout_s=60)
        step(tensors)
        second = sender.refit(2)
        assert len(second.receivers) == 2
        assert_current(a.report(), sender, tensors, 2)
        assert_current(b.report(), sender, tensors, 2)
    assert a.wait() == 0 and b.wait() == 0


@pytest.mark.slow
def test_a_receiver_killed_with_a_read_in_flight_fails_the_refit_within_its_timeout() -> None:
    tensors = make_tensors(SPECS, seed=1)
    settings = Settings(bucket_bytes=4096, timeout_s=TIMEOUT_S)
    with Sender(ModuleSource(tensors), transport="nixl", settings=settings) as sender:
        args = {"rendezvous": sender.rendezvous(), "specs": SPECS, "bucket_bytes": 4096, "timeout_s": TIMEOUT_S}
        dying = DyingPeer({**args, "die_at_read": len(SPECS) + 3})  # refit 2's third READ
        sender.refit(1)
        assert_current(dying.report(), sender, tensors, 1)
        step(tensors)
        start = time.monotonic()
        with pytest.raises(PeerError, match=r"receiver 1 .*(closed the connection|failed)"):
            sender.refit(2)
        assert time.monotonic() - start < TIMEOUT_S
    assert dying.wait() == -signal.SIGKILL
    # The serving agent outlives its dead reader: the next session in this process refits as ever.
    with session(SPECS, transport="nixl", timeout_s=TIMEOUT_S) as (sender, tensors, (p,)):
        sender.refit(1)
        assert_current(p.report(), sender, tensors, 1)


@pytest.mark.slow
def test_a_sender_killed_with_a_read_in_flight_leaves_the_engine_failed_within_the_timeout() -> None:
    args = {"specs": SPECS, "transport": "nixl", "bucket_bytes": 4096, "die_at_bucket": 10**6, "timeout_s": 60}
    env = {**os.environ, "PYTHONPATH": pythonpath()}
    proc = warm.popen(
        [sys.executable, helper("sender_peer.py"), json.dumps(args)], stdout=subprocess.PIPE, text=True, env=env
    )
    assert proc.stdout is not None
    rendezvous = json.loads(proc.stdout.readline().removeprefix("@@sender "))
    engine = ModuleEngine(make_tensors(SPECS, seed=5))
    with Receiver(engine, rendezvous, settings=Settings(timeout_s=TIMEOUT_S)) as receiver:
        assert receiver.receive().version == 1
        transport = receiver.transport
        assert isinstance(transport, nixl.NixlTransport)
        recv, posted = transport.recv, [0]

        def killing_recv(slot: int, nbytes: int):  # noqa: ANN202 - as the method
            pending = recv(slot, nbytes)
            posted[0] += 1
            if posted[0] == 3:  # refit 2's third READ is posted: the sender dies before it is seen done
                proc.kill()
                proc.wait(timeout=60)
            return pending

        transport.recv = killing_recv  # type: ignore[method-assign]
        start = time.monotonic()
        with pytest.raises(PeerError, match=r"sender|NIXL"):
            receiver.receive()
        assert time.monotonic() - start < TIMEOUT_S
    assert engine.weights.state.value != "current"
    assert engine.weights.version != 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_vram_buffers_on_both_sides_refit_bitwise_over_nixl() -> None:
    """VRAM: the sender's buffers and the engine's on cuda:0 (two processes), NIXL's VRAM memory type."""
    specs = [[f"w{i}", [256, 256], "float32"] for i in range(6)]
    with session(specs, transport="nixl", bucket_bytes=1 << 18, device="cuda:0", peer_devices=["cuda:0"]) as (
        sender,
        tensors,
        (p,),
    ):
        for version in (1, 2):
            sender.refit(version)
            # the transport is made at the first refit's connect, so its buffers exist only after it
            assert sender.transport is not None and sender.transport.buffers[0].is_cuda
            assert_current(p.report(), sender, tensors, version)
            step(tensors)
    assert p.wait() == 0


def test_the_bench_floor_over_nixl_times_the_receivers_reads(tmp_path) -> None:
    from refit.tools.cli import main

    out = tmp_path / "bench.json"
    args = ["bench", "--transport", "nixl", "--preset", "tiny", "--methods", "floor", "--repeats", "2"]
    assert main([*args, "--json", str(out)]) == 0
    floor = json.loads(out.read_text())[0]["results"]["floor"]
    # The sender's sends move nothing on a one-sided transport: timed alone, they "ran" at 500 TB/s on an H200.
    assert 0 < floor["gbps"] < 200, floor
