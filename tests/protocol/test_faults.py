"""Fault injection in real processes: each fault gives one clear error, a truthful engine state, and no
silently mixed weights."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest
import torch
import warm
from locations import helper, pythonpath
from peer import Peer, make_tensors
from sessions import FailingSource, live_fingerprints, session

from refit import (
    HandshakeError,
    ModuleEngine,
    PeerError,
    Receiver,
    RefitError,
    Settings,
    State,
)
from refit.checks.fingerprints import fingerprints
from refit.protocol.wire import HEADER, Kind

SPECS = [[f"w{i}", [32, 32], "float32"] for i in range(6)]  # 4 KiB each: one tensor per bucket


def _step(tensors: dict[str, torch.Tensor]) -> None:
    for t in tensors.values():
        t.add_(0.5)


def test_receiver_killed_mid_refit_fails_the_sender_naming_it_and_the_bucket(transport: str) -> None:
    fault = {"kind": "die", "version": 2, "at_load": 3}
    with session(SPECS, transport=transport, peer_args={"fault": fault}, timeout_s=10) as (sender, tensors, (peer,)):
        sender.refit(1)
        peer.report()
        _step(tensors)
        start = time.monotonic()
        with pytest.raises(PeerError, match=r"receiver 1 .*(closed the connection|failed).*") as info:
            sender.refit(2)
        assert time.monotonic() - start < 10
        assert "refit 2, bucket" in str(info.value) or "gloo" in str(info.value)
        with pytest.raises(PeerError, match="this session broke earlier"):
            sender.refit(3)
        assert peer.wait() == 9


@pytest.mark.parametrize("transport", ["shm", pytest.param("gloo", marks=pytest.mark.slow)])
def test_sender_killed_mid_refit_leaves_the_engine_failed_not_new(transport: str) -> None:
    script = helper("sender_peer.py")
    env = {**os.environ, "PYTHONPATH": pythonpath()}
    proc = warm.popen(
        [
            sys.executable,
            script,
            json.dumps({"specs": SPECS, "transport": transport, "bucket_bytes": 4096, "die_at_bucket": 3}),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    rendezvous = json.loads(proc.stdout.readline().removeprefix("@@sender "))
    tensors = make_tensors(SPECS, seed=5)
    engine = ModuleEngine(tensors)
    with Receiver(engine, rendezvous, settings=Settings(timeout_s=10)) as receiver:
        assert receiver.receive().version == 1
        committed = fingerprints(tensors.items(), {n: torch.float32 for n in tensors})
        with pytest.raises(PeerError, match=r"sender.*(closed the connection during|\(during) refit 2, bucket"):
            receiver.receive()
    assert proc.wait(timeout=30) == 17
    w = engine.weights
    assert (w.state, w.version, w.target) == (State.FAILED, 1, 2)
    assert fingerprints(tensors.items(), {n: torch.float32 for n in tensors}) != committed  # really mixed
    with pytest.raises(RefitError, match=r"engine weights are failed \(last committed 1, target 2\)"):
        engine.ensure_current()


def test_corrupted_bucket_is_caught_by_the_checksum_and_a_retry_restores(transport: str) -> None:
    with session(SPECS, transport=transport, verify_checksum=True) as (sender, tensors, (peer,)):
        sender.refit(1)
        peer.report()
        _step(tensors)
        before_send, calls = sender.transport.before_send, [0]

        def corrupt(slot: int) -> None:  # flips one bit after the checksum, as a bad link would
            calls[0] += 1
            if calls[0] == 3:
                sender.transport.buffers[slot][100] ^= 1
            before_send(slot)

        sender.transport.before_send = corrupt
        with pytest.raises(RefitError, match=r"refit of version 2 failed.*bucket 2 is corrupted: checksum"):
            sender.refit(2)
        report = peer.report()
        assert report["type"] == "IntegrityError" and (report["state"], report["version"], report["target"]) == (
            "failed",
            1,
            2,
        )
        sender.transport.before_send = before_send
        sender.refit(2)  # same version again
        report = peer.report()
        assert (report["state"], report["version"]) == ("current", 2)
        assert report["fingerprints"] == live_fingerprints(tensors, sender.manifest)


def test_engine_error_reaches_the_sender_with_its_message(transport: str) -> None:
    fault = {"kind": "raise", "version": 1, "at_load": 2}
    with session(SPECS, transport=transport, peer_args={"fault": fault}) as (sender, _, (peer,)):
        with pytest.raises(RefitError, match="engine failed to load bucket 1: RuntimeError: injected engine failure"):
            sender.refit(1)
        assert peer.report()["state"] == "failed"
        sender.refit(1)
        assert peer.report()["state"] == "current"


def test_engine_failing_at_commit_still_answers_the_sender() -> None:
    with session(SPECS, transport="shm", peer_args={"fault": {"kind": "commit", "version": 1}}) as (sender, _, (peer,)):
        with pytest.raises(
            RefitError, match="engine failed to commit version 1: RuntimeError: injected commit failure"
        ):
            sender.refit(1)
        assert peer.report()["state"] == "failed"
        sender.refit(1)
        assert peer.report()["state"] == "current"


def test_slow_receiver_past_the_timeout_fails_the_sender_in_time() -> None:
    # The 3 s timeout bounds only in-refit waits: connecting (the peer process's start) is not under it.
    fault = {"kind": "slow", "version": 1, "at_load": 2, "seconds": 10}
    with session(SPECS, transport="shm", peer_args={"fault": fault}, timeout_s=3) as (sender, _, (peer,)):
        sender.connect()
        start = time.monotonic()
        with pytest.raises(PeerError, match=r"receiver 1 .* did not answer within 3s during refit 1, bucket 1"):
            sender.refit(1)
        assert time.monotonic() - start < 10  # failed on the timeout, before the slow receiver answered
        peer.proc.kill()  # checked: no need to wait out its sleep


@pytest.mark.parametrize("intruder_first", [True, False])
def test_wrong_token_is_refused_at_once_and_loads_nothing(intruder_first: bool) -> None:
    with session(SPECS, transport="shm") as (sender, _, (good,)):
        if not intruder_first:
            sender.connect()  # the real receiver took the only place; a later intruder is still answered
        intruder = Peer(
            {
                "rendezvous": sender.rendezvous(),
                "override": {"token": "not-the-token"},
                "specs": SPECS,
                "bucket_bytes": 4096,
                "timeout_s": 30,
            }
        )
        stats = sender.refit(1)
        report = intruder.report()
        assert report["seconds"] < 20  # refused at once, not at its own 30 s timeout (its process start not counted)
        assert report["type"] == "PeerError" and "wrong token" in report["message"]
        assert report["events"] == [] and report["version"] is None
        assert good.report()["version"] == 1 and stats.version == 1
        intruder.wait()


def test_garbage_and_oversized_headers_are_rejected_before_allocation() -> None:
    with session(SPECS, transport="shm") as (sender, _, (peer,)):
        junk = socket.create_connection((sender.rendezvous()["host"], sender.rendezvous()["port"]))
        junk.sendall(b"GET / HTTP/1.1\r\n\r\n" + bytes(64))  # not refit: dropped, the session goes on
        assert sender.refit(1).version == 1
        assert peer.report()["version"] == 1
        junk.close()
    listener = socket.create_server(("127.0.0.1", 0))
    rdv = {"host": "127.0.0.1", "port": listener.getsockname()[1], "token": "t", "transport": "shm"}
    receiver = Receiver(ModuleEngine(make_tensors(SPECS, seed=0)), rdv, settings=Settings(timeout_s=5))
    conn_holder: list[socket.socket] = []

    def hostile() -> None:
        conn, _ = listener.accept()
        conn_holder.append(conn)
        conn.sendall(HEADER.pack(b"RFT1", Kind.WELCOME, 0, 0, 0, 0, 0, bytes(16), 1 << 40, 0, 0))

    import threading

    t = threading.Thread(target=hostile)
    t.start()
    with pytest.raises(PeerError, match="WELCOME payload of 1099511627776 bytes exceeds the limit"):
        receiver.connect()
    t.join()
    conn_holder[0].close()
    listener.close()


def test_same_version_twice_commits_both_times() -> None:
    with session(SPECS, transport="shm") as (sender, tensors, (peer,)):
        sender.refit(4)
        first = peer.report()
        _step(tensors)
        sender.refit(4)
        second = peer.report()
    assert (first["state"], first["version"]) == (second["state"], second["version"]) == ("current", 4)
    assert second["fingerprints"] != first["fingerprints"]


def test_mismatch_then_fixed_source_recovers_in_the_same_session() -> None:
    with session(SPECS, transport="shm", engine_specs=SPECS[:-1]) as (sender, tensors, (peer,)):
        with pytest.raises(HandshakeError):
            sender.refit(1)
        assert peer.report()["type"] == "HandshakeError"
        del tensors["w5"]
        sender.source = type(sender.source)(tensors)
        sender.refit(1)
        assert peer.report()["state"] == "current"


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["shm", pytest.param("gloo", marks=pytest.mark.slow)])
def test_soak_200_refits_bitwise_without_growth(transport: str) -> None:
    specs = [["a", [64, 64], "float32"], ["b", [300], "bfloat16"], ["c", [5000], "float32"]]
    gen = torch.Generator().manual_seed(0)
    with session(specs, transport=transport, bucket_bytes=8192) as (sender, tensors, (peer,)):
        rss, fds = [], []
        for version in range(1, 201):
            name = ["a", "b", "c"][version % 3]
            tensors[name].add_(torch.randn(tensors[name].shape, generator=gen).to(tensors[name].dtype))
            sender.refit(version)
            report = peer.report()
            assert report["version"] == version
            assert report["fingerprints"] == live_fingerprints(tensors, sender.manifest)
            rss.append(report["rss_kb"])
            fds.append(report["fds"])
    assert fds[-1] == fds[19], "the receiver leaks file descriptors"
    assert rss[-1] - rss[19] < 8 * 1024, f"the receiver's memory grew from {rss[19]} to {rss[-1]} kB"


def test_a_trainer_failure_mid_refit_reaches_the_receivers_at_once() -> None:
    tensors = make_tensors(SPECS, seed=1)
    source = FailingSource(tensors)
    with session(SPECS, transport="shm", tensors=tensors, source=source, timeout_s=120) as (sender, _, (peer,)):
        sender.refit(1)
        peer.report()
        source.calls, source.armed = 0, True
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="optimizer state is corrupt"):
            sender.refit(2)
        report = peer.report()
        assert time.monotonic() - start < 60  # told at once, not after the 120 s timeout
        assert report["type"] == "PeerFailed" and "the trainer failed during refit 2" in report["message"]
        assert (report["state"], report["version"], report["target"]) == ("failed", 1, 2)
        with pytest.raises(PeerError, match="this session broke earlier"):
            sender.refit(3)
