"""Sessions as long as training, in real processes: idle time is not a failure, a hung or dead peer is
found by liveness checks, the rendezvous admits only real receivers, and nothing is left behind."""

from __future__ import annotations

import contextlib
import gc
import glob
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import weakref

import pytest
import torch
import warm
from locations import helper, pythonpath
from peer import make_tensors
from sessions import live_fingerprints, session

from refit import ModuleEngine, ModuleSource, PeerError, Receiver, RefitError, Sender, Settings
from refit.protocol.wire import HEADER, Channel, Header, Kind

SPECS = [["a", [64, 16], "float32"], ["b", [10], "float32"]]


def _sender_process(mode: str, timeout_s: float) -> tuple[subprocess.Popen, dict]:
    env = {**os.environ, "PYTHONPATH": pythonpath()}
    args = {"specs": SPECS, "transport": "shm", "bucket_bytes": 4096, "mode": mode, "timeout_s": timeout_s}
    proc = warm.popen(
        [sys.executable, helper("sender_peer.py"), json.dumps(args)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    return proc, json.loads(proc.stdout.readline().removeprefix("@@sender "))


@pytest.mark.slow  # real processes and a gloo group: the full suite runs it
def test_idle_time_longer_than_the_timeout_between_refits_is_not_a_failure() -> None:
    # Short in-refit timeout on both sides; the trainer then "trains" for three times as long.
    with session(SPECS, transport="shm", timeout_s=1.5) as (sender, live, (peer,)):
        sender.refit(1)
        peer.report()
        time.sleep(4.5)  # the condition under test: a training step longer than REFIT_TIMEOUT
        with torch.no_grad():
            live["a"].add_(1.0)
        stats = sender.refit(2)
        report = peer.report()
        assert report["state"] == "current" and report["version"] == 2 and stats.version == 2
        assert report["fingerprints"] == live_fingerprints(live, sender.manifest)


@pytest.mark.parametrize(
    ("mode", "needle"), [("hang", "no heartbeat from the sender"), ("exit", "closed the connection")]
)
def test_a_hung_or_dead_sender_is_found_between_refits_within_the_timeout(mode: str, needle: str) -> None:
    proc, rendezvous = _sender_process(mode, timeout_s=2.0)
    engine = ModuleEngine(make_tensors(SPECS, seed=4))
    try:
        with Receiver(engine, rendezvous, settings=Settings(timeout_s=2.0)) as receiver:
            assert receiver.receive().version == 1
            start = time.monotonic()
            with pytest.raises(PeerError, match=needle):
                receiver.receive()
            assert time.monotonic() - start < 2.0 + 8.0  # the timeout, plus slack for a loaded machine
            assert engine.weights.state.value == "current" and engine.weights.version == 1
    finally:
        proc.kill()
        proc.wait()


def _admit_in_thread(sender: Sender) -> threading.Thread:
    t = threading.Thread(target=sender.connect)
    t.start()
    return t


def test_slow_and_hostile_connections_neither_delay_nor_get_blamed_for_real_receivers() -> None:
    with session(SPECS, transport="shm") as (sender, live, (peer,)):
        sender._session.lobby.hello_timeout_s = 3600.0  # a trickler could otherwise be dropped first
        host, port = sender.rendezvous()["host"], sender.rendezvous()["port"]
        silent = socket.create_connection((host, port))
        trickle = socket.create_connection((host, port))
        trickle.sendall(Header(Kind.HELLO, nbytes=100).pack()[:10])  # and then nothing more
        huge = socket.create_connection((host, port))
        huge.sendall(Header(Kind.HELLO, nbytes=60 << 20).pack())  # claims 60 MiB of HELLO
        sender.refit(1)  # admits the real receiver while all three are still open
        assert peer.report()["fingerprints"] == live_fingerprints(live, sender.manifest)
        huge.settimeout(60)
        assert huge.recv(1) == b""  # dropped on its header alone: nothing past 4 KiB is read before a token
        assert sender._session.lobby.refused >= 1
        for s in (silent, trickle, huge):
            s.close()


def test_a_message_that_trickles_in_fails_at_its_whole_message_deadline() -> None:
    a, b = socket.socketpair()
    stop = threading.Event()

    def trickle() -> None:
        data = Header(Kind.DONE, nbytes=0).pack()
        for byte in data:
            if stop.wait(0.2):  # the fault under test: one byte every 0.2 s, each well inside the timeout
                return
            b.sendall(bytes([byte]))

    t = threading.Thread(target=trickle)
    t.start()
    try:
        ch = Channel(a, peer="slow peer", timeout_s=1.0)
        start = time.monotonic()
        with pytest.raises(PeerError, match="did not answer within 1s"):
            ch.recv("commit")
        assert time.monotonic() - start < 1.0 + 5.0 and HEADER.size * 0.2 > 5.0
    finally:
        stop.set()
        t.join()
        a.close()
        b.close()


def test_a_sender_dying_before_every_receiver_is_ready_leaves_no_shared_memory() -> None:
    before = set(glob.glob("/dev/shm/refit-*"))
    proc, rendezvous = _sender_process("die_at_setup", timeout_s=30.0)
    engine = ModuleEngine(make_tensors(SPECS, seed=4))
    with pytest.raises(PeerError):
        Receiver(engine, rendezvous, settings=Settings(timeout_s=30.0)).connect()
    assert proc.wait() == 18
    assert set(glob.glob("/dev/shm/refit-*")) == before


def test_shared_memory_names_carry_no_part_of_the_token() -> None:
    from refit.transports.shm import ShmTransport

    settings = Settings(token="f00dfeedcafe1234")
    transport, info = ShmTransport.offer(
        capacity=4096, num_slots=2, num_receivers=1, device=torch.device("cpu"), settings=settings
    )
    try:
        assert all("f00d" not in p for p in info["paths"])
    finally:
        transport.close()


def test_a_receiver_that_cannot_join_tells_the_sender_and_closes_its_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    from refit.transports.shm import ShmTransport

    def broken_join(*args, **kwargs):
        raise PeerError("no shared memory here")

    monkeypatch.setattr(ShmTransport, "join", broken_join)
    sender = Sender(ModuleSource(make_tensors(SPECS, seed=1)), transport="shm", settings=Settings(timeout_s=30))
    fds = len(os.listdir("/proc/self/fd"))
    errors: list[BaseException] = []
    receiver = Receiver(ModuleEngine(make_tensors(SPECS, seed=2)), sender.rendezvous())
    t = threading.Thread(target=lambda: _catch(receiver.connect, errors))
    t.start()
    with pytest.raises(PeerError, match="receiver 1 .* failed: receiver could not join: no shared memory here"):
        sender.connect()
    t.join()
    sender.close()
    assert isinstance(errors[0], PeerError) and receiver.channel is None
    assert len(os.listdir("/proc/self/fd")) <= fds


def _catch(fn, errors: list[BaseException]) -> None:
    try:
        fn()
    except BaseException as e:
        errors.append(e)


def test_an_unclosed_sender_is_released_when_dropped() -> None:
    sender = Sender(ModuleSource(make_tensors(SPECS, seed=1)), transport="shm", settings=Settings(timeout_s=30))
    receiver = Receiver(ModuleEngine(make_tensors(SPECS, seed=2)), sender.rendezvous())
    results: list = []
    t = threading.Thread(target=lambda: results.extend([receiver.receive(), receiver.receive()]))
    t.start()
    sender.refit(1)
    address = (sender.rendezvous()["host"], sender.rendezvous()["port"])
    ref = weakref.ref(sender)
    del sender
    gc.collect()
    t.join()
    receiver.close()
    assert ref() is None and results[0].version == 1 and results[1] is None  # the receiver was told CLOSE
    assert not [th for th in threading.enumerate() if th.name in ("refit-heartbeat", "refit-lobby")]
    with pytest.raises(OSError):
        socket.create_connection(address, timeout=5)


def test_a_per_rank_commit_stays_updating_until_the_verdict_and_fails_without_one() -> None:
    from refit import RefitError, State
    from refit.topology.policies import Commit

    engine = ModuleEngine(make_tensors(SPECS, seed=2))
    seen: list = []

    def lost_verdict(own: str) -> str:  # the other trainer rank died after DONE: no verdict ever comes
        seen.append(engine.weights.state)
        raise RuntimeError("trainer rank 1 was killed")

    source = ModuleSource(make_tensors(SPECS, seed=1))
    sender = Sender(source, transport="shm", settings=Settings(timeout_s=30), commit=Commit(vote=lost_verdict))
    receiver = Receiver(engine, sender.rendezvous())
    errors: list[BaseException] = []
    t = threading.Thread(target=lambda: _catch(receiver.receive, errors))
    t.start()
    with pytest.raises(RuntimeError, match="killed"):
        sender.refit(1)
    t.join()
    sender.close()
    receiver.close()
    assert seen == [State.UPDATING]  # DONE was sent, but not every worker committed yet
    assert isinstance(errors[0], PeerError) and engine.weights.state == State.FAILED
    with pytest.raises(RefitError):
        engine.ensure_current()


def test_a_transport_failure_at_commit_reads_as_the_peer_not_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    from refit import State
    from refit.transports.shm import ShmTransport

    def broken_flush(self) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(ShmTransport, "flush", broken_flush)
    sender = Sender(ModuleSource(make_tensors(SPECS, seed=1)), transport="shm", settings=Settings(timeout_s=30))
    engine = ModuleEngine(make_tensors(SPECS, seed=2))
    receiver = Receiver(engine, sender.rendezvous())
    errors: list[BaseException] = []
    t = threading.Thread(target=lambda: _catch(receiver.receive, errors))
    t.start()
    with pytest.raises(PeerError, match="transfer failed before commit of version 1: CUDA error"):
        sender.refit(1)
    t.join()
    sender.close()
    receiver.close()
    assert type(errors[0]) is PeerError and "engine failed" not in str(errors[0])
    assert engine.weights.state == State.FAILED


def _connect_in_threads(sender: Sender, receivers: list[Receiver]) -> None:
    errors: list[BaseException] = []
    threads = [threading.Thread(target=lambda r=r: _catch(r.connect, errors)) for r in receivers]
    for t in threads:
        t.start()
    sender.connect()
    for t in threads:
        t.join()
    assert not errors


def _receive_in_threads(receivers: list[Receiver], errors: list[BaseException]) -> list[threading.Thread]:
    threads = [threading.Thread(target=lambda r=r: _catch(r.receive, errors)) for r in receivers]
    for t in threads:
        t.start()
    return threads


def _rewrite_done(receiver: Receiver, rewrite) -> None:
    """Make this receiver's DONE carry what `rewrite` makes of its payload (a buggy or hostile receiver)."""
    ch = receiver.channel
    send = ch.send
    ch.send = lambda header, payload=None: send(header, rewrite(payload) if header.kind == Kind.DONE else payload)


@pytest.mark.parametrize("bad", [b"\xff\xfe{}", b"[" * 2000], ids=["bad-utf8", "deep"])
def test_a_malformed_done_fails_that_refit_only_and_every_other_done_is_still_read(bad: bytes) -> None:
    settings = Settings(timeout_s=30)
    sender = Sender(ModuleSource(make_tensors(SPECS, seed=1)), transport="shm", num_receivers=2, settings=settings)
    receivers = [Receiver(ModuleEngine(make_tensors(SPECS, seed=2)), sender.rendezvous()) for _ in range(2)]
    _connect_in_threads(sender, receivers)
    _rewrite_done(receivers[0], lambda payload: bad)
    errors: list[BaseException] = []
    threads = _receive_in_threads(receivers, errors)
    with pytest.raises(RefitError, match="DONE is not valid JSON"):
        sender.refit(1)
    for t in threads:
        t.join()
    receivers[0].channel.send = type(receivers[0].channel).send.__get__(receivers[0].channel)
    threads = _receive_in_threads(receivers, errors)
    assert sender.refit(2).version == 2  # the session stayed in step
    for t in threads:
        t.join()
    sender.close()
    for r in receivers:
        r.close()
    assert not errors


def test_strict_verification_fails_a_refit_with_unverified_tensors_on_every_receiver() -> None:
    from refit import RefitError, State

    sender = Sender(
        ModuleSource(make_tensors(SPECS, seed=1)), transport="shm", settings=Settings(timeout_s=30), verify="strict"
    )
    engine = ModuleEngine(make_tensors(SPECS, seed=2))
    receiver = Receiver(engine, sender.rendezvous())
    _connect_in_threads(sender, [receiver])
    _rewrite_done(receiver, lambda payload: {**(payload or {}), "unverified": 1, "unverified_names": ["b"]})
    errors: list[BaseException] = []
    (t,) = _receive_in_threads([receiver], errors)
    with pytest.raises(RefitError, match=r"1 tensor\(s\) could not be read back .*: b; verify='fingerprint' accepts"):
        sender.refit(1)
    t.join()
    sender.close()
    receiver.close()
    assert isinstance(errors[0], RefitError) and engine.weights.state == State.FAILED


@pytest.mark.parametrize("mode", ["strict", "vote"])
def test_a_two_phase_refit_that_committed_nowhere_leaves_the_version_last_committed(mode: str) -> None:
    from refit import RefitError, State
    from refit.topology.policies import Commit

    armed = [True]
    source, settings = ModuleSource(make_tensors(SPECS, seed=1)), Settings(timeout_s=30)
    if mode == "strict":
        sender = Sender(source, transport="shm", settings=settings, verify="strict")
    else:
        sender = Sender(
            source, transport="shm", settings=settings, commit=Commit(vote=lambda own: own or armed[0] * "no")
        )
    engine = ModuleEngine(make_tensors(SPECS, seed=2))
    receiver = Receiver(engine, sender.rendezvous())
    _connect_in_threads(sender, [receiver])
    unverified = {"unverified": 1, "unverified_names": ["b"]}
    _rewrite_done(
        receiver, lambda payload: {**(payload or {}), **unverified} if armed[0] and mode == "strict" else payload
    )

    def refit(version: int, fails: bool) -> tuple:
        armed[0] = fails
        errors: list[BaseException] = []
        (t,) = _receive_in_threads([receiver], errors)
        with pytest.raises(RefitError) if fails else contextlib.nullcontext():
            sender.refit(version)
        t.join()
        assert bool(errors) == fails
        w = engine.weights
        return w.state, w.version, w.target

    assert refit(1, fails=True) == (State.FAILED, None, 1)  # from an empty engine: nothing was ever committed
    assert refit(1, fails=False) == (State.CURRENT, 1, None)
    assert refit(2, fails=True) == (State.FAILED, 1, 2)
    sender.close()
    receiver.close()


def _insider(address: tuple[str, int], token: str, capacity: int, *, read_welcome: bool) -> None:
    """A client with the token that misbehaves after authenticating: a bad capacity, or leaving after WELCOME."""
    from refit.protocol import auth

    with socket.create_connection(address, timeout=30) as sock:
        ch = Channel(sock, peer="sender", timeout_s=30)
        mine = auth.nonce()
        ch.send(Header(Kind.HELLO), {"protocol": auth.PROTOCOL_VERSION, "nonce": mine.hex(), "capacity": capacity})
        theirs = bytes.fromhex(json.loads(ch.expect(Kind.AUTH, "auth")[1])["nonce"])
        ch.send(Header(Kind.AUTH), {"proof": auth.proof(token, auth.RECEIVER, mine, theirs)})
        if read_welcome:
            ch.expect(Kind.WELCOME, "welcome")


@pytest.mark.parametrize("capacity, read_welcome", [(-1, False), (1 << 20, True)], ids=["bad-hello", "left-early"])
def test_connect_after_a_failed_connect_says_to_build_a_new_sender(capacity: int, read_welcome: bool) -> None:
    settings = Settings(timeout_s=30, connect_timeout_s=30)
    sender = Sender(ModuleSource(make_tensors(SPECS, seed=1)), transport="shm", settings=settings)
    address = (sender.rendezvous()["host"], sender.rendezvous()["port"])
    t = threading.Thread(
        target=_insider, args=(address, settings.token, capacity), kwargs={"read_welcome": read_welcome}
    )
    t.start()
    with pytest.raises(PeerError):
        sender.connect()
    t.join()
    for retry in (sender.connect, lambda: sender.refit(1)):
        with pytest.raises(PeerError, match="connect failed.*build a new Sender"):
            retry()
    assert sender.channels == [] and sender.transport is None
    sender.close()


def _refit_mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if "memfd:refit-" in line or "/refit-" in line)


def test_closing_both_sides_leaves_no_mapping_of_a_refit_buffer() -> None:
    gc.collect()  # an earlier test's session garbage (its buffers' last references) would be counted, then freed here
    before = _refit_mappings()
    sender = Sender(ModuleSource(make_tensors(SPECS, seed=1)), transport="shm", settings=Settings(timeout_s=30))
    receiver = Receiver(ModuleEngine(make_tensors(SPECS, seed=2)), sender.rendezvous())
    t = threading.Thread(target=receiver.receive)
    t.start()
    sender.refit(1)
    t.join()
    assert _refit_mappings() > before
    sender.close()
    receiver.close()
    gc.collect()
    assert _refit_mappings() == before


def test_a_receiver_left_by_an_exception_tells_the_sender_why_it_closed() -> None:
    tensors = make_tensors(SPECS, seed=1)
    sender = Sender(ModuleSource(tensors), transport="shm", settings=Settings(timeout_s=30), elastic=True)
    engine = ModuleEngine(make_tensors(SPECS, seed=2))
    failures: list[BaseException] = []

    def engine_process() -> None:
        try:
            with Receiver(engine, sender.rendezvous()) as receiver:
                receiver.receive()
                raise ValueError("the engine's own loop failed")
        except ValueError as e:
            failures.append(e)

    t = threading.Thread(target=engine_process)
    t.start()
    try:
        assert sender.refit(1).receivers == [1]
        t.join()
        assert engine.weights.version == 1 and len(failures) == 1
        assert all(torch.equal(engine.module[n], t) for n, t in tensors.items())  # the trainer's live tensors
        reason = "the receiver closed after ValueError: the engine's own loop failed"
        with pytest.raises(RefitError, match=rf"reached 0 receiver\(s\).*receiver 1: {re.escape(reason)}"):
            sender.refit(2)
    finally:
        sender.close()
