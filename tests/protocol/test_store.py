"""The gloo/nccl group store (refit.protocol.store): it answers as torch's own stores do, serves only
connections that proved the token, ends a connection on a forged or replayed frame without applying it,
admits one connection per rank, and no key of a real group carries the token."""

from __future__ import annotations

import datetime
import threading

import pytest
import torch.distributed as dist
from peer import make_tensors

from refit import ModuleEngine, ModuleSource, PeerError, Receiver, Sender, Settings
from refit.protocol.store import (
    FRAME,
    MAGIC,
    REQUEST,
    Op,
    RemoteStore,
    StoreServer,
    _bytes,
    _LocalStore,
    _pack_fields,
    _Table,
)

SETTINGS = Settings(timeout_s=30, connect_timeout_s=30)


@pytest.fixture
def server():  # type: ignore[no-untyped-def]
    s = StoreServer("127.0.0.1", "the-token", num_clients=1, settings=SETTINGS)
    yield s
    s.close()


def _script(store: dist.Store) -> list[object]:
    """Every command gloo and NCCL use, and what each returns."""
    store.set_timeout(datetime.timedelta(seconds=5))
    out: list[object] = [store.num_keys()]
    store.set("a", b"\x00\xff")
    out += [store.get("a"), store.check(["a"]), store.check(["a", "b"]), store.add("n", 3), store.add("n", -1)]
    out += [store.get("n"), store.compare_set("c", "", "new"), store.compare_set("c", "old", "x"), store.get("c")]
    out += [store.compare_set("c", "new", "newer"), store.compare_set("absent", "x", "y"), store.check(["absent"])]
    store.append("c", b"+")
    store.wait(["a", "n"])
    out += [store.get("c"), store.num_keys(), store.delete_key("a"), store.delete_key("a"), store.num_keys()]
    return out


def test_the_store_answers_every_command_as_torch_hash_store_does(server: StoreServer) -> None:
    expected = _script(dist.HashStore())
    client = RemoteStore("127.0.0.1", server.port, "the-token", SETTINGS)
    try:
        assert _script(client) == expected
        assert _script(_LocalStore(_Table(), 30)) == expected  # rank 0's view, in the sender's process
    finally:
        client.close()


def test_a_get_for_a_key_never_set_fails_when_the_store_times_out(server: StoreServer) -> None:
    client = RemoteStore("127.0.0.1", server.port, "the-token", SETTINGS)
    client.set_timeout(datetime.timedelta(seconds=0.2))
    with pytest.raises(dist.DistStoreError, match="not set within"):
        client.get("never")
    with pytest.raises(dist.DistStoreError, match="not set within"):
        client.wait(["never"], datetime.timedelta(seconds=0.1))
    assert client.add("still", 1) == 1  # the connection outlives a timed-out wait
    client.close()


def test_a_client_with_the_wrong_token_is_refused_before_any_command(server: StoreServer) -> None:
    with pytest.raises(PeerError, match="did not prove it knows the token"):
        RemoteStore("127.0.0.1", server.port, "a-guess", SETTINGS)
    real = RemoteStore("127.0.0.1", server.port, "the-token", SETTINGS)  # the rank's place is still free
    real.set("k", b"v")
    assert server.store.get("k") == b"v" and server.store.num_keys() == 1
    real.close()


def _frame(op: Op, fields: list[bytes], tag: bytes) -> tuple[bytes, bytes, bytes]:
    body = _pack_fields(fields)
    return FRAME.pack(MAGIC, op, 0, 0, 0, len(body), bytes(16))[:-16], tag, body


def test_a_forged_or_replayed_frame_ends_the_connection_and_is_not_applied(server: StoreServer) -> None:
    client = RemoteStore("127.0.0.1", server.port, "the-token", SETTINGS)
    link, sock = client._link, client._link.sock
    head, _, body = _frame(Op.ADD, [b"n", _bytes(1)], b"")
    frame = head + link._tag(REQUEST, 0, head, body) + body  # what the client itself sends first
    sock.sendall(frame)
    assert link.recv()[3] == [_bytes(1)]
    sock.sendall(frame)  # the same frame again: its sequence number is spent, so its MAC no longer holds
    assert sock.recv(1) == b""  # the server hung up without answering
    assert server.store.get("n") == b"1"
    client.close()
    other = StoreServer("127.0.0.1", "the-token", num_clients=1, settings=SETTINGS)
    try:
        victim = RemoteStore("127.0.0.1", other.port, "the-token", SETTINGS)
        victim._link.sock.sendall(b"".join(_frame(Op.SET, [b"k", b"v"], bytes(16))))  # a MAC made up
        assert victim._link.sock.recv(1) == b""
        assert other.store.num_keys() == 0
        victim.close()
    finally:
        other.close()


def test_one_connection_per_rank_is_admitted_and_later_ones_are_refused_even_with_the_token(
    server: StoreServer,
) -> None:
    first = RemoteStore("127.0.0.1", server.port, "the-token", SETTINGS)
    first.set("k", b"v")
    late = RemoteStore("127.0.0.1", server.port, "the-token", SETTINGS)
    with pytest.raises(dist.DistNetworkError):  # answered with ERROR and closed, however the socket reports it
        late.get("k")
    assert first.get("k") == b"v"
    first.close()
    late.close()


def test_closing_the_server_wakes_a_client_waiting_for_a_key(server: StoreServer) -> None:
    client = RemoteStore("127.0.0.1", server.port, "the-token", SETTINGS)
    errors: list[BaseException] = []
    client.set("ready", b"1")  # admitted and served before the wait starts
    waiting = threading.Thread(target=lambda: _catch(lambda: client.get("never"), errors))
    waiting.start()
    server.close()
    waiting.join()
    assert len(errors) == 1 and isinstance(errors[0], dist.DistError)
    client.close()


def _catch(fn, errors: list[BaseException]) -> None:  # type: ignore[no-untyped-def]
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - collected for the test to check
        errors.append(e)


def test_no_key_or_value_of_a_gloo_group_carries_the_token() -> None:
    specs = [["a", [64, 16], "float32"]]
    settings = Settings(timeout_s=30)
    sender = Sender(ModuleSource(make_tensors(specs, seed=1)), transport="gloo", settings=settings)
    receiver = Receiver(ModuleEngine(make_tensors(specs, seed=2)), sender.rendezvous())
    errors: list[BaseException] = []
    joined = threading.Thread(target=lambda: _catch(receiver.connect, errors))
    joined.start()
    sender.connect()
    joined.join()
    try:
        assert not errors
        table = sender.transport._store._table._data  # type: ignore[union-attr]
        assert table and all(settings.token.encode() not in k + v for k, v in table.items())
    finally:
        sender.close()
        receiver.close()
