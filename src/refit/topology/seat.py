"""The seams between a Sender's session and the parts it delegates to: `SenderInterface`, what a round and a
membership policy may call on the session (refit.topology.sender implements it), and `Members`, what a round
calls on the membership policy. They are given the session, never import it, and never touch its private state."""

from __future__ import annotations

import threading
from typing import Protocol

import torch

from refit.layout.manifest import Manifest
from refit.protocol.wire import Channel
from refit.settings import Settings
from refit.sources.base import Source
from refit.stages.handler import Handler
from refit.topology.membership import Membership
from refit.topology.options import SenderOptions
from refit.topology.policies import Commit
from refit.topology.send_path import Lost, SendPath
from refit.topology.stats import RefitStats
from refit.transports.base import Transport


class Members(Protocol):
    """A membership policy (refit.topology.elastic: Fixed or Elastic), as a round uses it."""

    @property
    def lost(self) -> Lost | None: ...

    def gather(self, version: int, retry: bool) -> list[Channel] | RefitStats: ...

    def admit(self, joiners: list[Channel]) -> None: ...

    def record(self, stats: RefitStats, committed: list[Channel]) -> None: ...

    def shortfall(
        self, version: int, stats: RefitStats, committed: list[Channel], failures: list[str], errors: list[str]
    ) -> bool: ...

    def too_few(self, version: int, did: str, count: int, departed: list[dict]) -> str: ...

    def failed(self, message: str, stats: RefitStats) -> str: ...


class SenderInterface(Protocol):
    """The Sender's session as its round and membership policy see it (each method is documented on Sender)."""

    source: Source
    settings: Settings
    device: torch.device
    options: SenderOptions
    capacity: int
    transport_name: str
    commit: Commit
    handlers: list[Handler]

    @property
    def manifest(self) -> Manifest | None: ...

    @property
    def membership(self) -> Members: ...

    @property
    def channels(self) -> list[Channel]: ...

    @property
    def uses_store(self) -> bool: ...

    @property
    def transport(self) -> Transport | None: ...

    @property
    def members(self) -> Membership | None: ...

    @property
    def epoch(self) -> int: ...

    @property
    def generation(self) -> int: ...

    @property
    def path(self) -> SendPath: ...

    @property
    def channel_lock(self) -> threading.Lock: ...

    def refuse_joiners(self) -> None: ...

    def serve_joiners(self, members: Membership) -> None: ...

    def prepare(self, joiners: list[Channel]) -> bool: ...

    def mark_begun(self) -> None: ...

    def offer_manifest(self, manifest: Manifest, channels: list[Channel]) -> list[str]: ...

    def answered(self, ch: Channel) -> bool: ...

    def refresh_digests(self) -> None: ...

    def forget(self, ch: Channel) -> None: ...

    def offer_transport(self, num_receivers: int) -> tuple[Transport, dict]: ...

    def drop_transport(self) -> None: ...

    def end_epoch(self) -> None: ...
