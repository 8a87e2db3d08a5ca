"""Receivers in threads of the test process (over shm): each obeys commands sent to it, so a test decides
when each one receives a refit, leaves or dies, and waits for what it did as an event, never a sleep."""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
from collections.abc import Iterator

import torch

from refit import Engine, HandshakeError, ModuleEngine, RefitError, Sender, Settings
from refit.layout.spec import TensorSpec
from refit.sources.base import Source
from refit.topology.receiver import Receiver

WAIT_S = 120.0
"""Bound on waiting for an in-process receiver's outcome (no process starts here: only a hang hits it)."""


class RowsEngine(ModuleEngine):
    """Holds rows [start, stop) of tensor `name` (a tensor-parallel slice, named through `held`), the rest whole."""

    def __init__(self, tensors: dict[str, torch.Tensor], name: str, start: int, stop: int) -> None:
        self.name, self.start, self.stop = name, start, stop
        self.full_shape = tuple(tensors[name].shape)
        super().__init__({**tensors, name: tensors[name][start:stop].clone()})

    def specs(self) -> list[TensorSpec]:
        return [
            TensorSpec(s.name, self.full_shape, s.dtype, s.aliases) if s.name == self.name else s
            for s in super().specs()
        ]

    def held(self, name: str):  # noqa: ANN201 - as the base
        got = super().held(name)
        if got is not None and name == self.name:
            return got[0], (0, self.start, self.stop)
        return got

    def load(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        super().load([(n, t[self.start : self.stop] if n == self.name else t) for n, t in tensors])


class Peer:
    """One Receiver served by its own thread: `receive()` asks it for one refit, `outcome()` waits for it."""

    def __init__(self, receiver: Receiver) -> None:
        self.receiver = receiver
        self._commands: queue.Queue[str] = queue.Queue()
        self._outcomes: queue.Queue[object] = queue.Queue()
        self.joined = threading.Event()
        """Set once `connect` returned (the sender welcomed it)."""
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @property
    def engine(self) -> ModuleEngine:
        return self.receiver.staging.live if self.receiver.staging is not None else self.receiver.engine

    def _run(self) -> None:
        while True:
            command = self._commands.get()
            try:
                if command == "connect":
                    self.receiver.connect()
                    self.joined.set()
                elif command == "receive":
                    self._outcomes.put(self.receiver.receive())
                elif command == "leave":
                    self.receiver.leave("the test asked it to leave")
                    self._outcomes.put("left")
                elif command == "close":
                    self.receiver.close()
                    self._outcomes.put("closed")
                    return
            except Exception as e:  # noqa: BLE001 - the test reads it
                self._outcomes.put(e)

    def ask(self, command: str) -> None:
        self._commands.put(command)

    def join(self) -> None:
        """Wait until the sender welcomed it."""
        assert self.joined.wait(WAIT_S), "the receiver did not join"

    def outcome(self) -> object:
        return self._outcomes.get(timeout=WAIT_S)

    def kill(self) -> None:
        """A crash as the sender sees it: the connection ends without LEAVE (the thread is idle meanwhile)."""
        ch = self.receiver.channel
        assert ch is not None
        ch.sock.shutdown(socket.SHUT_RDWR)

    def stop(self) -> None:
        self.ask("close")
        self._thread.join(WAIT_S)


def refit_both(sender: Sender, peer: Peer, version: int) -> tuple[object, object]:
    """One refit of `version` from both ends: (what `sender.refit` returned or raised as a RefitError or
    HandshakeError, the receiver's outcome)."""
    peer.ask("receive")
    try:
        out: object = sender.refit(version)
    except (RefitError, HandshakeError) as e:
        out = e
    return out, peer.outcome()


@contextlib.contextmanager
def session(
    source: Source, engine: Engine, settings: Settings, *, staged: bool = False, **options: object
) -> Iterator[tuple[Sender, Peer]]:
    """A Sender over shm from `source` and one threaded receiver into `engine` (`staged`: staging memory in front
    of it), connecting; both closed after."""
    sender = Sender(source, transport="shm", settings=settings, **options)
    peer = Peer(Receiver(engine, sender.rendezvous(), settings=settings, staged=staged))
    peer.ask("connect")
    try:
        yield sender, peer
    finally:
        sender.close()
        peer.stop()
