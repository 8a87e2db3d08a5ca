"""A sender over a deterministic state dict, with peers in real processes: the protocol tests' session helper."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from peer import Peer, make_tensors

from refit import ModuleSource, Sender, Settings
from refit.checks.fingerprints import fingerprints


def sent_fingerprints(sender: Sender) -> dict[str, str]:
    """What the sender put on the wire for its current manifest."""
    assert sender.manifest is not None
    wire = {p.name: p.spec.dtype for p in sender.manifest.entries}
    names = list(wire)
    return fingerprints(zip(names, sender.source.tensors(names)), wire)


def live_fingerprints(live: dict[str, torch.Tensor], manifest) -> dict[str, str]:
    """Fingerprints of what the trainer holds right now (not what the source or the buffer saw), under
    every name the manifest sends, cast to its wire dtype: what every engine must hold after a refit."""
    wire = {n: manifest.entry(n).spec.dtype for n in manifest.names}
    return fingerprints(((n, live[n]) for n in manifest.names), wire)


def step(tensors: dict[str, torch.Tensor], by: float = 0.5) -> None:
    """An optimizer step, as far as a refit can tell: every tensor's values change in place."""
    for t in tensors.values():
        t.add_(by)


def assert_current(report: dict, sender: Sender, tensors: dict, version: int) -> None:
    """A peer's report after refit `version`: current, holding the trainer's live tensors bitwise."""
    assert report["event"] == "refit", report
    assert (report["state"], report["version"]) == ("current", version)
    assert report["fingerprints"] == live_fingerprints(tensors, sender.manifest)


@contextlib.contextmanager
def session(
    specs: list[list],
    *,
    transport: str,
    receivers: int = 1,
    bucket_bytes: int = 4096,
    engine_specs: list[list] | None = None,
    wire_dtype: torch.dtype | None = None,
    timeout_s: float = 60.0,
    tensors: dict[str, torch.Tensor] | None = None,
    device: str = "cpu",
    peer_devices: list[str] | None = None,
    zero_copy: bool = False,
    peer_args: dict | None = None,
    verify_checksum: bool = False,
    source=None,
    verify: str | None = "fingerprint",
) -> Iterator[tuple[Sender, dict[str, torch.Tensor], list[Peer]]]:
    """A sender over tensors made from `specs` and `receivers` peer processes expecting `engine_specs`."""
    tensors = tensors if tensors is not None else make_tensors(specs, seed=1, device=device)
    settings = Settings(bucket_bytes=bucket_bytes, timeout_s=timeout_s)
    sender = Sender(
        source or ModuleSource(tensors, wire_dtype=wire_dtype),
        transport=transport,
        num_receivers=receivers,
        settings=settings,
        device=torch.device(device),
        zero_copy=zero_copy,
        verify_checksum=verify_checksum,
        verify=verify,
    )
    args = {
        "rendezvous": sender.rendezvous(),
        "specs": engine_specs or specs,
        "bucket_bytes": bucket_bytes,
        "timeout_s": timeout_s,
    }
    devices = peer_devices or ["cpu"] * receivers
    peers = [Peer({**args, "device": d, **(peer_args or {})}) for d in devices]
    try:
        yield sender, tensors, peers
    finally:
        sender.close()
        for p in peers:
            p.wait()


class FailingSource(ModuleSource):
    """A trainer whose own code raises while the refit is under way (at the third bucket of version 2)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__(tensors)
        self.calls, self.armed = 0, False

    def tensors(self, names):
        self.calls += 1
        if self.armed and self.calls == 3:
            raise RuntimeError("optimizer state is corrupt")
        return super().tensors(names)
