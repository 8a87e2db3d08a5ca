"""Offers: a Sender's manifests offered to its receivers, and what each answered (its REPORT, and the regions
it holds, which the fingerprint plan follows)."""

from __future__ import annotations

from collections.abc import Callable

from refit.checks.manifest_check import Report
from refit.layout.manifest import Manifest
from refit.log import get_logger
from refit.protocol import auth
from refit.protocol.auth import manifest_binding
from refit.protocol.wire import Channel, Header, Kind, Offer, parse_json
from refit.topology.digest_plan import DigestPlan, parse_regions
from refit.topology.send_path import Lost, each

log = get_logger("sender")


class Offers:
    """The manifests a session offers and its receivers' answers, by receiver rank."""

    def __init__(self, *, fingerprint: bool) -> None:
        """`fingerprint`: the session verifies, so MANIFEST asks for (and REPORT carries) the regions held."""
        self.fingerprint = fingerprint
        self.regions: dict[int, dict] = {}
        """Per receiver rank: the regions (shards) it named when it answered the current manifest."""

    def offer(self, manifest: Manifest, channels: list[Channel], lost: Lost | None) -> list[str]:
        """Send `manifest` to `channels` and read each REPORT (keeping its regions); returns their refusals, each
        as 'receiver R: why'. A channel lost meanwhile goes to `lost` (None: the loss raises)."""
        payload, (flags, regions) = manifest.to_json(), _offered(self.fingerprint)

        def offer(ch: Channel) -> None:  # each receiver's copy is bound to its session: digest is a MAC under its key
            binding = auth.tag(ch.key, b"MANIFEST", manifest_binding(manifest.epoch, manifest.digest))
            ch.send(Header(Kind.MANIFEST, epoch=manifest.epoch, digest=binding, status=flags), payload)

        failures: list[str] = []

        def report(ch: Channel) -> None:
            obj = parse_json(ch.expect(Kind.REPORT, "handshake")[1], "REPORT")
            report = Report.from_json(obj)
            self.regions[ch.rank] = regions(obj.get("regions"), manifest)
            if not report.ok:
                failures.append(f"receiver {ch.rank}: {report.message()}")
            elif report.unsynced:
                log.warning("receiver %d: %s", ch.rank, report.unsynced_message())

        each(channels, offer, lost)
        each(channels, report, lost)
        return failures

    def answered(self, rank: int) -> bool:
        """Whether receiver `rank` answered the current manifest (one lost before it did has not)."""
        return rank in self.regions

    def plan(self, manifest: Manifest | None, channels: list[Channel]) -> DigestPlan | None:
        """The fingerprint plan for `manifest` and `channels` (None when the session does not verify)."""
        if not self.fingerprint or manifest is None:
            return None
        return DigestPlan(manifest, {ch.rank: self.regions.get(ch.rank, {}) for ch in channels})

    def forget(self, rank: int) -> None:
        self.regions.pop(rank, None)


def described(manifest: Manifest) -> str:
    """A manifest in one line, for the logs."""
    m = manifest
    return (
        f"epoch {m.epoch}, digest {m.digest.hex()[:12]}, {len(m.entries)} tensors, "
        f"{m.num_buckets} bucket(s) of {m.capacity} bytes"
    )


def _offered(fingerprint: bool) -> tuple[Offer, Callable[[object, Manifest], dict]]:
    """MANIFEST's flags, and how each REPORT's regions (shards it holds) are read: only for the fingerprint."""
    return (Offer.FINGERPRINT, parse_regions) if fingerprint else (Offer(0), _no_regions)


def _no_regions(obj: object, manifest: Manifest) -> dict:
    return {}
