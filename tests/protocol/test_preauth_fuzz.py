"""Everything read before a peer proves the token, fuzzed: arbitrary bytes, headers, JSON and strings (non-ASCII
proofs among them) at each step before authentication, against every listener (the lobby while a Sender
connects, an elastic Sender's lobby thread, the group store) and every dialer (a Receiver, a group store
client). A listener drops that one connection and keeps serving: after each example it still answers, and after
the run it admits a real peer, which then refits bitwise (the store: serves a real rank). A dialer facing a fake
peer raises PeerError and uses nothing it said."""

from __future__ import annotations

import base64
import json
import socket
import threading
from collections.abc import Callable

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from peer import make_tensors

from refit import ModuleEngine, ModuleSource, PeerError, Receiver, Sender, Settings
from refit.errors import IntegrityError
from refit.protocol import auth
from refit.protocol.store import RemoteStore, StoreServer
from refit.protocol.wire import HEADER, MAGIC, Channel, Kind
from refit.transports.nixl import _Remote

SPECS = [["a", [64, 16], "float32"], ["b", [10], "bfloat16"]]
WAIT_S = 60.0
"""Bound on any one read from an in-process peer (no process starts here: only a hang reaches it)."""
FAST = settings(
    derandomize=True, max_examples=25, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
SLOW = settings(
    derandomize=True, max_examples=1000, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
PROFILES = [pytest.param(FAST, id="fast"), pytest.param(SLOW, id="slow", marks=pytest.mark.slow)]


def _frame(kind: int, payload: bytes) -> bytes:
    return HEADER.pack(MAGIC, kind, 0, 0, 0, 0, 0, bytes(16), len(payload), 0, 0) + payload


def _json(obj: object) -> bytes:
    return json.dumps(obj).encode()


NON_ASCII_PROOF = _json({"protocol": auth.PROTOCOL_VERSION, "nonce": "ab" * 32, "proof": "é" * 64})
VALID_HELLO = _frame(Kind.HELLO, _json({"protocol": auth.PROTOCOL_VERSION, "nonce": "cd" * 32, "capacity": 1 << 20}))

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=8), st.text(max_size=70)
)
values = st.recursive(
    scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3), max_leaves=10
)
texts64 = st.one_of(
    st.text(min_size=64, max_size=64),
    st.text(st.characters(min_codepoint=128), min_size=64, max_size=64),
    st.sampled_from(["é" * 64, "\ud800" * 64, "\x00" * 64, "g" * 64]),
)
hex64 = st.binary(min_size=32, max_size=32).map(bytes.hex)
proofs = st.one_of(texts64, hex64, values)
nonces = st.one_of(hex64, texts64, values)
versions = st.one_of(st.just(auth.PROTOCOL_VERSION), values)
headers = st.builds(
    HEADER.pack,
    st.one_of(st.just(MAGIC), st.binary(min_size=4, max_size=4)),
    st.integers(0, 255),
    st.integers(0, 255),
    st.integers(0, 2**16 - 1),
    st.integers(0, 2**32 - 1),
    st.integers(0, 2**32 - 1),
    st.integers(0, 2**64 - 1),
    st.binary(min_size=16, max_size=16),
    st.one_of(st.integers(0, 5000), st.integers(0, 2**64 - 1)),
    st.integers(0, 2**64 - 1),
    st.integers(0, 2**64 - 1),
)


def _fields(kind: Kind) -> st.SearchStrategy[dict]:
    """The JSON object a step carries, with any of its fields of any value."""
    if kind == Kind.HELLO:
        optional = {"protocol": versions, "nonce": nonces, "capacity": st.one_of(st.just(1 << 20), values)}
        return st.fixed_dictionaries({}, optional=optional)
    return st.one_of(
        st.fixed_dictionaries({"protocol": versions, "nonce": st.one_of(hex64, nonces), "proof": proofs}),
        st.fixed_dictionaries({}, optional={"proof": proofs, "protocol": versions, "nonce": nonces}),
    )


def messages(kind: Kind) -> st.SearchStrategy[bytes]:
    """What a peer may send where `kind` is due: junk, any header, any payload under a right header, cut short."""
    payloads = st.one_of(
        st.binary(max_size=300),
        values.map(lambda v: json.dumps(v, ensure_ascii=False).encode("utf-8", "surrogatepass")),
        _fields(kind).map(_json),
    )
    whole = st.builds(_frame, st.one_of(st.just(int(kind)), st.integers(0, 255)), payloads)
    return st.one_of(
        st.binary(max_size=300),
        st.builds(bytes.__add__, headers, st.binary(max_size=300)),
        whole,
        st.builds(lambda data, cut: data[:cut], whole, st.integers(0, 400)),
    )


# (the first step, the second step or None): the second follows the lobby's AUTH to a valid HELLO.
steps = st.one_of(st.tuples(messages(Kind.HELLO), st.none()), st.tuples(st.just(VALID_HELLO), messages(Kind.AUTH)))


def _drain(sock: socket.socket) -> bytes:
    """Everything the peer sends until it closes."""
    out = b""
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except ConnectionResetError:  # it closed with our bytes unread: gone all the same
        pass
    return out


def _poke(address: tuple[str, int], first: bytes, second: bytes | None) -> None:
    """A stranger: send `first`; if the listener answers with AUTH, send `second`; end our side and wait until
    the listener closes the connection (it read what it wanted, and dropped or answered it)."""
    with socket.create_connection(address, timeout=WAIT_S) as sock:
        try:
            sock.sendall(first)
            if second is not None:
                header, _ = Channel(sock, peer="listener", timeout_s=WAIT_S).recv("auth")
                if header.kind == Kind.AUTH:
                    sock.sendall(second)
            sock.shutdown(socket.SHUT_WR)
        except (OSError, PeerError, IntegrityError):  # it already dropped us
            pass
        _drain(sock)


def _still_answers(address: tuple[str, int]) -> None:
    """The listener still serves: a HELLO of another protocol version is answered at once, naming both."""
    with socket.create_connection(address, timeout=WAIT_S) as sock:
        sock.sendall(_frame(Kind.HELLO, _json({"protocol": 1})))
        assert b"protocol version mismatch" in _drain(sock)


def _fuzz_listener(address: tuple[str, int], profile: settings, alive: Callable[[], None]) -> int:
    """Run `profile`'s examples of pre-authentication steps at `address`; returns how many ran."""
    ran = []

    @profile
    @given(steps)
    @example((VALID_HELLO, _frame(Kind.AUTH, NON_ASCII_PROOF)))
    @example((_frame(Kind.HELLO, _json({"protocol": 2, "nonce": "é" * 64})), None))
    def one(step: tuple[bytes, bytes | None]) -> None:
        _poke(address, *step)
        alive()
        _still_answers(address)
        ran.append(1)

    one()
    return len(ran)


def _catch(fn: Callable[[], object], errors: list[BaseException]) -> None:
    try:
        fn()
    except BaseException as e:
        errors.append(e)


def _no_errors(errors: list[BaseException]) -> None:
    assert not errors, errors


def _same_bits(engine: ModuleEngine, tensors: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(engine.module[n].view(torch.uint8), t.view(torch.uint8)) for n, t in tensors.items())


def _sender(**options: object) -> tuple[Sender, dict[str, torch.Tensor]]:
    tensors = make_tensors(SPECS, seed=1)
    settings_ = Settings(timeout_s=WAIT_S, connect_timeout_s=10 * WAIT_S)
    return Sender(ModuleSource(tensors), transport="shm", settings=settings_, **options), tensors


def _refit(sender: Sender, receivers: list[Receiver], version: int) -> None:
    errors: list[BaseException] = []
    threads = [threading.Thread(target=lambda r=r: _catch(r.receive, errors)) for r in receivers]
    for t in threads:
        t.start()
    sender.refit(version)
    for t in threads:
        t.join()
    assert not errors, errors


@pytest.mark.parametrize("profile", PROFILES)
def test_the_lobby_drops_any_pre_auth_input_and_still_admits_the_real_receiver(profile: settings) -> None:
    sender, tensors = _sender()
    errors: list[BaseException] = []
    admit = threading.Thread(target=lambda: _catch(sender.connect, errors))
    admit.start()
    try:
        rendezvous = sender.rendezvous()
        address = (rendezvous["host"], rendezvous["port"])
        ran = _fuzz_listener(address, profile, lambda: _no_errors(errors))
        engine = ModuleEngine(make_tensors(SPECS, seed=2))
        receiver = Receiver(engine, rendezvous)
        _catch(receiver.connect, errors)
        admit.join()
        assert not errors and receiver.rank == 1
        assert sender._session.lobby.refused >= 2 * ran  # every stranger and every probe, none admitted
        _refit(sender, [receiver], 1)
        assert engine.weights.version == 1 and _same_bits(engine, tensors)
        receiver.close()
    finally:
        sender.close()


@pytest.mark.parametrize("profile", PROFILES)
def test_an_elastic_lobby_thread_drops_any_pre_auth_input_and_still_admits_a_joiner(profile: settings) -> None:
    sender, tensors = _sender(elastic=True)
    first = Receiver(ModuleEngine(make_tensors(SPECS, seed=2)), sender.rendezvous())
    errors: list[BaseException] = []
    joined = threading.Thread(target=lambda: _catch(first.connect, errors))
    joined.start()
    try:
        sender.connect()
        joined.join()
        assert not errors
        rendezvous = sender.rendezvous()
        lobby = sender._session.lobby

        def alive() -> None:
            assert not lobby.failure, lobby.failure

        _fuzz_listener((rendezvous["host"], rendezvous["port"]), profile, alive)
        joiner = Receiver(ModuleEngine(make_tensors(SPECS, seed=3)), rendezvous)
        joiner.connect()
        assert sender.await_receivers(2, timeout_s=WAIT_S)
        _refit(sender, [first, joiner], 1)
        assert all(_same_bits(r.engine, tensors) for r in (first, joiner))  # type: ignore[arg-type]
        first.close()
        joiner.close()
    finally:
        sender.close()


@pytest.mark.parametrize("profile", PROFILES)
def test_the_group_store_drops_any_pre_auth_input_and_still_serves_the_real_rank(profile: settings) -> None:
    token, settings_ = "the-store-token", Settings(timeout_s=WAIT_S, connect_timeout_s=10 * WAIT_S)
    server = StoreServer("127.0.0.1", token, num_clients=1, settings=settings_)
    try:
        ran = _fuzz_listener(("127.0.0.1", server.port), profile, lambda: None)
        client = RemoteStore("127.0.0.1", server.port, token, settings_)
        client.set("key", b"value")
        assert client.get("key") == b"value" and server.store.get("key") == b"value"
        assert server.refused >= 2 * ran
        client.close()
    finally:
        server.close()


class _FakeListener:
    """Took the address a dialer was given: reads its HELLO, answers with the example's bytes, closes."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = self.sock.getsockname()[:2]

    def answer_once(self, reply: bytes) -> threading.Thread:
        def serve() -> None:
            conn, _ = self.sock.accept()
            with conn:
                conn.settimeout(WAIT_S)
                Channel(conn, peer="dialer", timeout_s=WAIT_S).recv("hello")
                try:
                    conn.sendall(reply)
                except OSError:
                    pass

        t = threading.Thread(target=serve)
        t.start()
        return t


# What a fake listener answers a HELLO with: any message where AUTH is due, or AUTH with any proof then junk.
replies = st.one_of(
    messages(Kind.AUTH),
    st.builds(lambda a, b: a + b, _fields(Kind.AUTH).map(lambda f: _frame(Kind.AUTH, _json(f))), messages(Kind.AUTH)),
)


def _fuzz_dialer(dial: Callable[[tuple[str, int]], object], profile: settings) -> None:
    fake = _FakeListener()

    @profile
    @given(replies)
    @example(_frame(Kind.AUTH, NON_ASCII_PROOF))
    @example(
        _frame(Kind.AUTH, b'{"protocol": 2, "nonce": "' + b"ab" * 32 + b'", "proof": "\\ud800' + b"a" * 63 + b'"}')
    )
    def one(reply: bytes) -> None:
        served = fake.answer_once(reply)
        try:
            with pytest.raises(PeerError):
                dial(fake.address)
        finally:
            served.join()

    try:
        one()
    finally:
        fake.sock.close()


@pytest.mark.parametrize("profile", PROFILES)
def test_a_receiver_dialing_a_fake_sender_raises_peer_error_and_still_joins_the_real_one(profile: settings) -> None:
    engine = ModuleEngine(make_tensors(SPECS, seed=2))
    receiver = Receiver(engine, {"host": "127.0.0.1", "port": 1, "token": "t", "transport": "shm"})

    def dial(address: tuple[str, int]) -> None:
        receiver.rendezvous = {"host": address[0], "port": address[1], "token": "the-real-token", "transport": "shm"}
        receiver.connect()

    _fuzz_dialer(dial, profile)
    assert receiver.channel is None
    sender, tensors = _sender()
    try:
        receiver.rendezvous = sender.rendezvous()
        errors: list[BaseException] = []
        joined = threading.Thread(target=lambda: _catch(receiver.connect, errors))
        joined.start()
        sender.connect()
        joined.join()
        assert not errors
        _refit(sender, [receiver], 1)
        assert engine.weights.version == 1 and _same_bits(engine, tensors)
        receiver.close()
    finally:
        sender.close()


@pytest.mark.parametrize("profile", PROFILES)
def test_a_group_store_client_dialing_a_fake_store_raises_peer_error(profile: settings) -> None:
    settings_ = Settings(timeout_s=WAIT_S)
    _fuzz_dialer(lambda address: RemoteStore(*address, "the-real-token", settings_), profile)


@FAST
@given(st.one_of(proofs, st.binary(max_size=70)))
@example("é" * 64)
@example("\ud800" * 64)
def test_verifying_any_claimed_proof_is_false_and_never_raises(claimed: object) -> None:
    mine, theirs = auth.nonce(), auth.nonce()
    assert auth.verify("token", auth.SENDER, mine, theirs, claimed) is False


@FAST
@given(
    st.fixed_dictionaries(
        {},
        optional={
            "agent": values,
            "metadata": st.one_of(st.binary(max_size=30).map(lambda b: base64.b64encode(b).decode()), values),
            "mem": st.one_of(st.sampled_from(["DRAM", "VRAM"]), values),
            "capacity": st.one_of(st.integers(-1, 2**65), values),
            "buffers": st.one_of(st.lists(st.lists(st.integers(-1, 2**65), max_size=4), max_size=4), values),
        },
    )
)
def test_nixls_setup_parser_takes_any_info_as_a_remote_or_a_peer_error(info: dict) -> None:
    """nixl's setup arrives inside WELCOME, after authentication and under its MAC; its parser is held to the
    same rule all the same."""
    try:
        remote = _Remote.parse(info)
    except PeerError:
        return
    assert remote.buffers and all(length == remote.capacity for _, length, _ in remote.buffers)
