"""A sender whose process runs out of file descriptors while a receiver waits in its lobby's queue: the lobby
warns once, naming what ran out and the fix, rests instead of spinning a core on its readable listener, and
admits the queued receiver once descriptors are free again; the session then refits bitwise. An elastic
Sender's lobby thread waits out the same shortage; one that stops for any other cause makes the next
`await_receivers` and refit raise, naming it, rather than go on with no joiner ever admitted."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import resource
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import pytest
import torch
from peer import make_tensors

from refit import ModuleEngine, ModuleSource, Receiver, RefitError, Sender, Settings
from refit.log import LOGGER_NAME
from refit.protocol.wire import Header, Kind
from refit.topology import receiver as receiver_module

SPECS = [["a", [64, 16], "float32"], ["b", [10], "bfloat16"]]
WINDOW_S = 0.5
"""How long the starved lobby's CPU time is measured."""


class _Records(logging.Handler):
    """Keeps every refit record; `starved` is set by the first one about file descriptors."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []
        self.starved = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        if "file descriptors" in record.getMessage():
            self.starved.set()


@contextlib.contextmanager
def _no_free_descriptors() -> Iterator[None]:
    """Lower this process's open-file limit to its lowest free descriptor number, so every number under the
    limit is taken and the next socket (the lobby's accept) fails with EMFILE; restored on exit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowest_free = os.open(os.devnull, os.O_RDONLY)  # the kernel hands out the lowest free number
    os.close(lowest_free)
    # Rather than filling the table up to a limit: a descriptor closed meanwhile (a finalizer) above this
    # limit frees no number under it, so the lobby stays starved for the whole window.
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _await_lobby(address: tuple[str, int]) -> None:
    """Return once the lobby has answered a HELLO of another protocol version, so it is serving: its
    selector is open before the descriptors run out."""
    payload = json.dumps({"protocol": 1}).encode()
    with socket.create_connection(address, timeout=30) as sock:
        sock.sendall(Header(Kind.HELLO, nbytes=len(payload)).pack() + payload)
        answer = b""
        while chunk := sock.recv(4096):
            answer += chunk
    assert b"protocol version mismatch" in answer


def _catch(fn: Callable[[], object], errors: list[BaseException]) -> None:
    try:
        fn()
    except BaseException as e:
        errors.append(e)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_a_lobby_out_of_descriptors_warns_once_stays_idle_and_admits_the_queued_receiver_once_they_are_free(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tensors = make_tensors(SPECS, seed=1)
    sender = Sender(ModuleSource(tensors), transport="shm", settings=Settings(timeout_s=30))
    rendezvous = sender.rendezvous()
    address = (rendezvous["host"], rendezvous["port"])
    engine = ModuleEngine(make_tensors(SPECS, seed=2))
    receiver = Receiver(engine, rendezvous)
    records = _Records()
    logging.getLogger(LOGGER_NAME).addHandler(records)
    errors: list[BaseException] = []
    admit = threading.Thread(target=lambda: _catch(sender.connect, errors), daemon=True)
    admit.start()
    try:
        _await_lobby(address)
        before = len(records.records)
        queued = socket.socket()  # its descriptor is taken now; connecting needs none
        lobby_cpu = time.pthread_getcpuclockid(admit.ident)  # type: ignore[arg-type]
        with _no_free_descriptors():
            queued.connect(address)  # completes in the kernel's queue; the lobby's accept() now fails
            assert records.starved.wait(10), "the lobby said nothing about running out of file descriptors"
            cpu, wall = time.clock_gettime(lobby_cpu), time.monotonic()
            time.sleep(WINDOW_S)  # a measurement window, not synchronisation
            cpu, wall = time.clock_gettime(lobby_cpu) - cpu, time.monotonic() - wall
            warnings = [r.getMessage() for r in records.records[before:] if r.levelno >= logging.WARNING]
        assert cpu < 0.2 * wall, f"the starved lobby used {cpu:.3f}s of CPU in {wall:.3f}s"
        assert len(warnings) == 1 and "ulimit -n" in warnings[0], warnings
        # The receiver dials the connection that waited in the queue, so the session admits exactly that one.
        monkeypatch.setattr(receiver_module, "socket", SimpleNamespace(create_connection=lambda *a, **kw: queued))
        joined = threading.Thread(target=lambda: _catch(receiver.connect, errors))
        joined.start()
        joined.join()
        admit.join()
        assert not errors and receiver.rank == 1
        got = threading.Thread(target=lambda: _catch(receiver.receive, errors))
        got.start()
        sender.refit(1)
        got.join()
        assert not errors and engine.weights.version == 1
        assert all(_same_bits(engine.module[n], t) for n, t in tensors.items())  # the trainer's tensors, bitwise
    finally:
        logging.getLogger(LOGGER_NAME).removeHandler(records)
        sender.close()
        receiver.close()


# An elastic Sender's lobby thread (named "refit-lobby") is where admission goes on after connect.
WAIT_S = 30.0
"""Bound on a joiner's connect and on await_receivers (no process starts here: only a dead lobby reaches it)."""


def _in_lobby_thread() -> bool:
    return threading.current_thread().name == "refit-lobby"


def _failing_once(real: Callable, error: Exception) -> Callable:  # type: ignore[type-arg]
    """`real`, except that its first call from the lobby thread raises `error`."""
    left = [1]

    def call(*args: object, **kwargs: object) -> object:
        if _in_lobby_thread() and left:
            left.pop()
            raise error
        return real(*args, **kwargs)

    return call


@contextlib.contextmanager
def _elastic_session() -> Iterator[tuple[Sender, dict[str, torch.Tensor], list[Receiver]]]:
    """An elastic Sender over shm with its first receiver joined; more join through the lobby thread."""
    tensors = make_tensors(SPECS, seed=1)
    sender = Sender(ModuleSource(tensors), transport="shm", settings=Settings(timeout_s=WAIT_S), elastic=True)
    receivers = [Receiver(ModuleEngine(make_tensors(SPECS, seed=2)), sender.rendezvous())]
    errors: list[BaseException] = []
    joined = threading.Thread(target=lambda: _catch(receivers[0].connect, errors))
    joined.start()
    try:
        sender.connect()
        joined.join()
        assert not errors
        yield sender, tensors, receivers
    finally:
        sender.close()
        for r in receivers:
            r.close()


def _join_and_refit(sender: Sender, tensors: dict[str, torch.Tensor], receivers: list[Receiver]) -> None:
    """A second engine joins through the lobby thread, and a refit reaches both bitwise."""
    joiner = Receiver(
        ModuleEngine(make_tensors(SPECS, seed=3)), sender.rendezvous(), settings=Settings(connect_timeout_s=WAIT_S)
    )
    receivers.append(joiner)
    joiner.connect()
    assert sender.await_receivers(2, timeout_s=WAIT_S)
    errors: list[BaseException] = []
    threads = [threading.Thread(target=lambda r=r: _catch(r.receive, errors)) for r in receivers]
    for t in threads:
        t.start()
    sender.refit(1)
    for t in threads:
        t.join()
    assert not errors
    for r in receivers:
        assert r.engine.weights.version == 1  # type: ignore[attr-defined]
        assert all(_same_bits(r.engine.module[n], t) for n, t in tensors.items())  # type: ignore[attr-defined]


def test_an_elastic_lobby_thread_that_finds_no_descriptor_for_its_selector_waits_and_admits_joiners(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    emfile = OSError(errno.EMFILE, "Too many open files")
    monkeypatch.setattr(selectors, "DefaultSelector", _failing_once(selectors.DefaultSelector, emfile))
    caplog.set_level(logging.WARNING, logger=LOGGER_NAME)
    with _elastic_session() as (sender, tensors, receivers):
        _join_and_refit(sender, tensors, receivers)
        assert not sender._session.lobby.failure
    assert any("file descriptors" in r.getMessage() for r in caplog.records)


def test_an_elastic_lobby_thread_whose_accept_finds_no_descriptor_keeps_serving(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    emfile = OSError(errno.EMFILE, "Too many open files")
    monkeypatch.setattr(socket.socket, "accept", _failing_once(socket.socket.accept, emfile))
    caplog.set_level(logging.INFO, logger=LOGGER_NAME)
    with _elastic_session() as (sender, tensors, receivers):
        _join_and_refit(sender, tensors, receivers)
    said = [r.getMessage() for r in caplog.records]
    assert any("file descriptors" in m for m in said) and any("accepting connections again" in m for m in said)


def test_an_elastic_lobby_thread_that_dies_makes_await_receivers_and_refit_raise_naming_the_cause(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken() -> selectors.BaseSelector:
        if _in_lobby_thread():
            raise RuntimeError("the selector exploded")
        return real()

    real = selectors.DefaultSelector
    monkeypatch.setattr(selectors, "DefaultSelector", broken)
    with _elastic_session() as (sender, _, _receivers):
        with pytest.raises(RefitError, match="lobby stopped admitting engines .*the selector exploded"):
            sender.await_receivers(2, timeout_s=WAIT_S)
        with pytest.raises(RefitError, match="the selector exploded"):
            sender.refit(1)
