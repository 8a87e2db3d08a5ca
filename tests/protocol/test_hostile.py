"""Hostile peers: a client that knows the sender's port (or every port a gloo session opens: the lobby and
the group store) but not the token reads nothing secret, crashes nothing, joins nothing and changes nothing; a fake sender is refused by the receiver before anything it
names (a path, an address, a manifest) is used; shm maps only the segments it creates itself."""

from __future__ import annotations

import json
import logging
import os
import socket
import tempfile
import threading

import pytest
import torch
import warm
from peer import make_tensors

from refit import IntegrityError, ModuleEngine, ModuleSource, PeerError, Receiver, Sender, Settings
from refit.log import LOGGER_NAME
from refit.protocol import auth
from refit.protocol.lobby import WARNINGS_PER_MINUTE, Lobby, _Throttle
from refit.protocol.wire import HEADER, Channel, Header, Kind
from refit.transports.shm import ShmTransport

SPECS = [["a", [64, 16], "float32"], ["b", [10], "float32"]]


def _raw(sock: socket.socket, kind: Kind, payload: bytes) -> None:
    sock.sendall(Header(kind, nbytes=len(payload)).pack() + payload)


def _all_bytes(sock: socket.socket) -> bytes:
    """Everything the peer sends until it closes."""
    sock.settimeout(30)
    out = b""
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except ConnectionResetError:  # the peer closed with our bytes unread: it is gone all the same
        pass
    return out


def _stranger(address: tuple[str, int], first: bytes, *, prove: bool = False) -> bytes:
    """Connect, send HELLO `first`; with `prove`, answer the sender's AUTH with a made-up proof."""
    with socket.create_connection(address, timeout=30) as sock:
        _raw(sock, Kind.HELLO, first)
        if prove:
            ch = Channel(sock, peer="sender", timeout_s=30)
            header, payload = ch.recv("auth")
            assert header.kind == Kind.AUTH
            _raw(sock, Kind.AUTH, json.dumps({"proof": "00" * 32}).encode())
            return HEADER.size * b"-" + payload + _all_bytes(sock)
        return _all_bytes(sock)


def _hello(**fields: object) -> bytes:
    return json.dumps({"protocol": auth.PROTOCOL_VERSION, "nonce": auth.nonce().hex(), "capacity": 1 << 20, **fields})


def _catch(fn, errors: list[BaseException]) -> None:
    try:
        fn()
    except BaseException as e:
        errors.append(e)


def test_a_client_without_the_token_reads_nothing_secret_crashes_nothing_and_joins_nothing() -> None:
    settings = Settings(timeout_s=30)
    sender = Sender(ModuleSource(make_tensors(SPECS, seed=1)), transport="shm", settings=settings)
    address = (sender.rendezvous()["host"], sender.rendezvous()["port"])
    errors: list[BaseException] = []
    admit = threading.Thread(target=lambda: _catch(sender.connect, errors))
    admit.start()
    seen = [
        _stranger(address, _hello().encode(), prove=True),  # knows the protocol, guesses a proof
        _stranger(address, b"[" * 2000),  # a parser bomb
        _stranger(address, b"\xff\xfe{}"),  # not UTF-8
        _stranger(address, json.dumps({"token": "guess", "capacity": 1 << 20}).encode()),  # an old-style HELLO
    ]
    engine = ModuleEngine(make_tensors(SPECS, seed=2))
    receiver = Receiver(engine, sender.rendezvous())
    joined = threading.Thread(target=lambda: _catch(receiver.connect, errors))
    joined.start()
    admit.join()
    joined.join()
    assert not errors and receiver.rank == 1  # the real receiver is the first and only one admitted
    assert sender._session.lobby.refused == 4
    assert all(settings.token.encode() not in data for data in seen)
    assert b"wrong token" in seen[0] and b"protocol version mismatch" in seen[3]
    done = threading.Thread(target=receiver.receive)
    done.start()
    sender.refit(1)
    done.join()
    assert engine.weights.version == 1
    sender.close()
    receiver.close()


def test_a_peer_whose_handshake_was_under_way_when_the_last_receiver_was_admitted_still_gets_its_answer() -> None:
    """A wrong-token peer that connected first, but sends its HELLO only once the sender has its receiver,
    is answered 'wrong token' by the lobby's late serving: its handshake is kept from `admit` to it."""
    sender = Sender(ModuleSource(make_tensors(SPECS, seed=1)), transport="shm", settings=Settings(timeout_s=30))
    address = (sender.rendezvous()["host"], sender.rendezvous()["port"])
    with socket.create_connection(address, timeout=30) as early:  # queued before the real receiver connects
        engine = ModuleEngine(make_tensors(SPECS, seed=2))
        receiver = Receiver(engine, sender.rendezvous())
        errors: list[BaseException] = []
        joined = threading.Thread(target=lambda: _catch(receiver.connect, errors))
        joined.start()
        sender.connect()  # accepts `early` first (its handshake pending), admits the receiver, returns
        joined.join()
        assert not errors and receiver.rank == 1
        _raw(early, Kind.HELLO, _hello().encode())
        ch = Channel(early, peer="sender", timeout_s=30)
        header, _ = ch.recv("auth")
        assert header.kind == Kind.AUTH
        _raw(early, Kind.AUTH, json.dumps({"proof": "00" * 32}).encode())
        assert b"wrong token" in _all_bytes(early)
    done = threading.Thread(target=receiver.receive)
    done.start()
    sender.refit(1)
    done.join()
    assert engine.weights.version == 1 and sender._session.lobby.refused == 1
    sender.close()
    receiver.close()


def test_a_protocol_version_mismatch_fails_at_connect_naming_both_versions() -> None:
    sender = Sender(ModuleSource(make_tensors(SPECS, seed=1)), transport="shm", settings=Settings(timeout_s=30))
    address = (sender.rendezvous()["host"], sender.rendezvous()["port"])
    admit = threading.Thread(target=lambda: _catch(sender.connect, []))
    admit.start()
    answer = _stranger(address, _hello(protocol=1).encode())
    assert b"the receiver speaks 1, this sender speaks %d" % auth.PROTOCOL_VERSION in answer
    sender.close()
    admit.join()


def _fake_sender(reply) -> tuple[tuple[str, int], threading.Thread]:  # type: ignore[no-untyped-def]
    """A process that took the advertised address: reads HELLO, then sends what `reply` makes of it."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        sock, _ = listener.accept()
        with sock:
            ch = Channel(sock, peer="receiver", timeout_s=30)
            _, payload = ch.recv("hello")
            for kind, msg in reply(json.loads(payload)):
                data = json.dumps(msg).encode()
                sock.sendall(Header(kind, nbytes=len(data)).pack() + data)
            _all_bytes(sock)
        listener.close()

    t = threading.Thread(target=serve)
    t.start()
    return listener.getsockname()[:2], t


WELCOME = {"rank": 1, "capacity": 4096, "transport": "shm", "info": {"paths": ["/proc/self/fd/0"], "capacity": 4096}}


@pytest.mark.parametrize(
    "reply, needle",
    [
        (
            lambda hello: [
                (Kind.AUTH, {"protocol": auth.PROTOCOL_VERSION, "nonce": auth.nonce().hex(), "proof": "ab" * 32}),
                (Kind.WELCOME, WELCOME),
            ],
            "did not prove it knows the token",
        ),
        (lambda hello: [(Kind.WELCOME, WELCOME)], "sent WELCOME during authentication, expected AUTH"),
        (
            lambda hello: [(Kind.AUTH, {"protocol": 99, "nonce": auth.nonce().hex(), "proof": "ab" * 32})],
            f"the sender speaks 99, this receiver speaks {auth.PROTOCOL_VERSION}",
        ),
    ],
    ids=["wrong-proof", "no-proof", "other-version"],
)
def test_a_fake_sender_is_refused_before_it_names_any_path_or_address(
    reply, needle: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    joins: list = []
    monkeypatch.setattr(ShmTransport, "join", classmethod(lambda cls, info, **kw: joins.append(info)))
    (host, port), t = _fake_sender(reply)
    receiver = Receiver(
        ModuleEngine(make_tensors(SPECS, seed=2)),
        {"host": host, "port": port, "token": "the-real-token", "transport": "shm"},
        settings=Settings(timeout_s=30),
    )
    with pytest.raises((IntegrityError, PeerError), match=needle):
        receiver.connect()
    t.join()
    assert joins == [] and receiver.channel is None


def test_a_manifest_not_bound_to_the_session_is_refused() -> None:
    sender = Sender(ModuleSource(make_tensors(SPECS, seed=1)), transport="shm", settings=Settings(timeout_s=30))
    engine = ModuleEngine(make_tensors(SPECS, seed=2))
    receiver = Receiver(engine, sender.rendezvous())
    errors: list[BaseException] = []
    joined = threading.Thread(target=lambda: _catch(receiver.connect, errors))
    joined.start()
    sender.connect()
    joined.join()
    sender.channels[0].key = bytes(32)  # a relay that does not hold the session key
    got = threading.Thread(target=lambda: _catch(receiver.receive, errors))
    got.start()
    with pytest.raises(PeerError, match="manifest is not bound to this session"):
        sender.refit(1)
    got.join()
    sender.close()
    receiver.close()
    assert isinstance(errors[0], IntegrityError) and engine.weights.version is None


def _sized_file(path: str, size: int) -> str:
    with open(path, "wb") as f:
        f.truncate(size)
    return path


def test_shm_maps_only_the_segments_it_creates() -> None:
    settings = Settings()
    own, info = ShmTransport.offer(capacity=4096, num_slots=1, num_receivers=1, device=None, settings=settings)
    try:
        joined = ShmTransport.join(info, rank=1, device=None, settings=settings)
        joined.close()
        with tempfile.TemporaryDirectory() as d, open(_sized_file(os.path.join(d, "plain"), 4096)) as f:
            other = _sized_file(os.path.join(d, "refit-1-ab-0"), 4096)
            for path in [
                other,  # the right name in another directory
                os.path.join("/dev/shm", os.path.relpath(other, "/dev/shm")),  # '..' out of the shm directory
                f"/proc/self/fd/{f.fileno()}",  # any readable file through /proc
            ]:
                with pytest.raises(PeerError, match="not a buffer this transport creates"):
                    ShmTransport.join({"paths": [path], "capacity": 4096}, rank=1, device=None, settings=settings)
    finally:
        own.close()


def _store_client(host: str, port: int) -> list[str]:
    """A torch TCPStore client on `port`: what each of its calls returned (an error is fine, data is not)."""
    import datetime

    import torch.distributed as dist

    try:
        store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=10))
    except Exception as e:  # noqa: BLE001 - refused is the expected outcome, whatever torch calls it
        return [f"refused: {type(e).__name__}"]
    got = []
    for name, args in [
        ("list_keys", ()),
        ("get", ("x",)),
        ("set", ("x", "y")),
        ("delete_key", ("x",)),
        ("add", ("x", 1)),
    ]:
        try:
            got.append(f"{name} served: {getattr(store, name)(*args)!r}")
        except Exception as e:  # noqa: BLE001 - as above
            got.append(f"{name} refused: {type(e).__name__}")
    return got


def _junk(address: tuple[str, int], data: bytes) -> bytes:
    with socket.create_connection(address, timeout=30) as sock:
        sock.sendall(data)
        return _all_bytes(sock)


def _attack(results: dict[str, object], name: str, fn, port: int) -> None:  # type: ignore[no-untyped-def]
    try:
        results[name] = fn(port)
    except Exception as e:  # noqa: BLE001 - a stranger's failure is an outcome to check, not the test's
        results[name] = f"failed: {e!r}"


@pytest.mark.slow  # real processes and a gloo group: the full suite runs it
def test_no_port_a_gloo_session_opens_serves_a_stranger_and_the_session_still_refits_bitwise() -> None:
    import subprocess
    import sys

    from locations import helper, pythonpath
    from peer import Peer

    args = {"specs": SPECS, "transport": "gloo", "timeout_s": 60}
    env = {**os.environ, "PYTHONPATH": pythonpath()}
    proc = warm.popen(
        [sys.executable, helper("listening_sender.py"), json.dumps(args)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None

    def said() -> dict:
        line = proc.stdout.readline()
        assert line.startswith("@@sender "), f"sender said {line!r} (exit {proc.poll()})"
        return json.loads(line[len("@@sender ") :])

    try:
        rendezvous = said()
        peer = Peer({"rendezvous": rendezvous, "specs": SPECS, "bucket_bytes": 4096, "timeout_s": 60})
        ports = said()["refit"]
        assert rendezvous["port"] in ports and len(ports) == 2  # the lobby and the group's store
        host, token = rendezvous["host"], rendezvous["token"]
        results: dict[str, object] = {}
        attacks = {f"{kind} {port}": (fn, port) for port in ports for kind, fn in [
            ("store", lambda p: _store_client(host, p)),
            ("junk", lambda p: _junk((host, p), b"\xff" * 100 + b"GET / HTTP/1.0\r\n\r\n")),
            ("silent", lambda p: _junk((host, p), b"")),
            ("guess", lambda p: _stranger((host, p), _hello().encode(), prove=True)),
        ]}  # fmt: skip
        threads = [threading.Thread(target=_attack, args=(results, k, f, p)) for k, (f, p) in attacks.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert set(results) == set(attacks)
        for name, seen in results.items():
            assert token not in str(seen) and (not isinstance(seen, bytes) or token.encode() not in seen), name
            if name.startswith("store"):
                assert not any("served" in r for r in seen), (name, seen)  # type: ignore[union-attr]
        for version in (1, 2):
            proc.stdin.write(f"refit {version}\n")
            proc.stdin.flush()
            live, got = said(), peer.report()
            assert got["event"] == "refit" and got["version"] == version, got
            assert got["fingerprints"] == live["fingerprints"]  # bitwise: what the engine holds is the trainer's
        proc.stdin.write("close\n")
        proc.stdin.flush()
        assert peer.wait() == 0
    finally:
        proc.stdin.close()
        assert proc.wait(timeout=120) == 0


def _wrong_proof(address: tuple[str, int]) -> str:
    """Connect and answer the lobby's AUTH with a made-up proof; returns this end's address as the lobby sees it."""
    with socket.create_connection(address, timeout=30) as sock:
        host, port = sock.getsockname()[:2]
        _raw(sock, Kind.HELLO, _hello().encode())
        header, _ = Channel(sock, peer="sender", timeout_s=30).recv("auth")
        assert header.kind == Kind.AUTH
        _raw(sock, Kind.AUTH, json.dumps({"proof": "00" * 32}).encode())
        assert b"wrong token" in _all_bytes(sock)  # closed once refused, after its warning
    return f"{host}:{port}"


def test_a_refused_connection_is_warned_at_once_naming_its_address_and_why_and_a_flood_is_rate_limited(
    caplog: pytest.LogCaptureFixture,
) -> None:
    lobby = Lobby("127.0.0.1", 0, "the-real-token")
    lobby._throttle = _Throttle(window_s=3600)  # the whole flood falls in one window, however slow the machine
    caplog.set_level(logging.WARNING, logger=LOGGER_NAME)
    errors: list[BaseException] = []
    admitting = threading.Thread(target=lambda: _catch(lambda: lobby.admit(1, 600), errors))
    admitting.start()
    try:
        peer = _wrong_proof(lobby.address())
        said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(said) == 1 and f"refused a connection from {peer}: its proof of the token is wrong" in said[0]
        assert "check REFIT_TOKEN on both sides" in said[0]
        for _ in range(3 * WARNINGS_PER_MINUTE):
            _wrong_proof(lobby.address())
        said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(said) == WARNINGS_PER_MINUTE and lobby.refused == 1 + 3 * WARNINGS_PER_MINUTE
    finally:
        lobby.cancel("the test is over")
        admitting.join()
        lobby.close()
    assert [str(e) for e in errors] == ["the test is over"]


def test_a_held_back_warning_is_counted_in_the_next_one_said() -> None:
    throttle = _Throttle(burst=1, window_s=0.0)  # a new window at every call: each is let through
    assert throttle.allow() == 0
    throttle = _Throttle(burst=1, window_s=3600)
    assert [throttle.allow() for _ in range(3)] == [0, None, None]
    throttle._start -= 3600  # the window passed
    assert throttle.allow() == 2


def test_a_sender_that_skips_its_digests_in_a_fingerprint_epoch_gets_a_refused_refit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The manifest promised VERIFY (fingerprint on): a COMMIT without it is refused, nothing unverified is
    committed, and the session goes on (the next honest refit commits)."""
    from threaded import refit_both, session

    from refit import RefitError, State
    from refit.topology.send_path import SendPath
    from refit.topology.stats import RefitStats

    tensors = make_tensors(SPECS, seed=1)
    engine = ModuleEngine(
        torch.nn.ParameterDict({n: torch.nn.Parameter(torch.zeros_like(t)) for n, t in tensors.items()})
    )
    with session(ModuleSource(tensors), engine, Settings(timeout_s=60), verify="fingerprint") as (sender, peer):
        stats, got = refit_both(sender, peer, 1)
        assert isinstance(got, RefitStats), got
        real = SendPath._send_digests
        monkeypatch.setattr(SendPath, "_send_digests", lambda *args, **kwargs: None)
        stats, got = refit_both(sender, peer, 2)
        assert isinstance(stats, RefitError) and "without the digests (VERIFY)" in str(stats), stats
        assert isinstance(got, IntegrityError), got
        assert (engine.weights.state, engine.weights.version) == (State.FAILED, 1)
        monkeypatch.setattr(SendPath, "_send_digests", real)
        stats, got = refit_both(sender, peer, 2)
        assert isinstance(got, RefitStats), got
        assert (engine.weights.state, engine.weights.version) == (State.CURRENT, 2)
