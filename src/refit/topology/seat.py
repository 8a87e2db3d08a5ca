"""What a round and a membership policy read of the Sender's session (refit.topology.sender implements it):
they are given the session, never import it."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from refit.layout.manifest import Manifest
from refit.protocol.wire import Channel
from refit.settings import Settings
from refit.sources.base import Source
from refit.topology.digest_plan import DigestPlan
from refit.topology.held import Held
from refit.topology.policies import Commit
from refit.topology.send_path import Lost, SendPath
from refit.topology.stats import RefitStats


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


class Session(Protocol):
    source: Source
    settings: Settings
    device: torch.device
    capacity: int
    num_receivers: int
    num_slots: int
    transport_name: str
    zero_copy: bool
    verify_checksum: bool
    commit: Commit
    manifest: Manifest | None
    _session: Held
    _transport_cls: Any
    _path: SendPath | None
    _digests: DigestPlan | None
    _regions: dict[int, dict]
    _epoch: int
    _generation: int
    _begun: bool

    @property
    def membership(self) -> Members: ...

    @property
    def channels(self) -> list[Channel]: ...

    @property
    def uses_store(self) -> bool: ...

    def prepare(self, joiners: list[Channel]) -> bool: ...

    def _offer_manifest(self, manifest: Manifest, channels: list[Channel]) -> list[str]: ...

    def _digest_plan(self) -> DigestPlan | None: ...
