"""One refit of a Sender's session: begin, stream the buckets, verify, collect every DONE, decide.

The session (refit.topology.sender) holds what lasts: lobby, heartbeats, transport, the epoch's manifest
and send path. A Round lives for one version and reads them; the policies the Sender was built with
(membership: who takes part; commit: how the outcome is decided) answer for the modes."""

from __future__ import annotations

import contextlib
import time

from refit.errors import IntegrityError, RefitError
from refit.layout.manifest import Manifest
from refit.log import get_logger
from refit.protocol.wire import Begin, Channel, Done, Header, Kind, parse_json
from refit.stages import Handler, Stage
from refit.topology import repair
from refit.topology.seat import SenderInterface
from refit.topology.send_path import each
from refit.topology.stats import RefitStats

log = get_logger("sender")


class Round:
    def __init__(self, sender: SenderInterface, version: int, t_connect: float, *, retry: bool = False) -> None:
        self.s = sender
        self.version = version
        self.t_connect = t_connect
        self.retry = retry

    def run(self) -> RefitStats:
        s, version = self.s, self.version
        t0 = time.perf_counter()
        joiners = s.membership.gather(version, self.retry)
        if isinstance(joiners, RefitStats):  # no receiver to reach, and that may pass
            return joiners
        # before the handshake, so a forward that moves the source's tensors is seen by this refit's check
        carried, checks_s = _due(s.handlers, frozenset(ch.rank for ch in [*s.channels, *joiners]))
        handshake = s.prepare(joiners)
        m, path = s.manifest, s.path
        assert m is not None
        stats = RefitStats(
            version=version, epoch=m.epoch, handshake=handshake, num_buckets=m.num_buckets, nbytes=m.nbytes
        )
        stats.add("connect", t0 - self.t_connect)
        stats.add("handshake", time.perf_counter() - t0 - sum(checks_s.values()))
        ctrl0 = _control_bytes(s.channels)
        flags = path.flags | (Begin.TWO_PHASE if s.commit.two_phase else Begin(0))
        stages = path.stages
        base = _base(stages, version, [ch.rank for ch in s.channels])
        flags |= Begin.DELTA if base is not None else Begin(0)
        stats.delta = base is not None
        begin = Header(
            Kind.BEGIN,
            epoch=m.epoch,
            version=version,
            digest=m.digest,
            index=m.num_buckets,
            status=flags,
            base=base or 0,
        )
        for name, seconds in checks_s.items():
            stats.add(name, seconds)
        path.ready(s.device)
        lost = s.membership.lost
        try:
            each(s.channels, lambda ch: ch.send(begin), lost)
            s.mark_begun()
            checksum = s.options.verify_checksum
            errors = path.send(s.source, version, stats, s.generation, verify_checksum=checksum, on_lost=lost)
            self._commit(m, stats, errors, carried)
        except BaseException:
            for stage in stages:
                stage.failed()
            raise
        for stage in stages:
            stage.committed(version, stats.receivers)
        for handler in s.handlers:
            handler.committed(stats.receivers, handler.name in carried)
        stats.control_bytes = max(0, _control_bytes(s.channels) - ctrl0)  # a receiver dropped mid-refit takes its count
        stats.seconds["total"] = time.perf_counter() - t0
        log.info(
            "committed version %d: %d bytes in %d bucket(s), %.1f ms",
            version,
            m.nbytes,
            m.num_buckets,
            stats.seconds["total"] * 1e3,
        )
        return stats

    def _commit(self, m: Manifest, stats: RefitStats, errors: list[str], carried: dict[str, object]) -> None:
        s, version = self.s, self.version
        t = time.perf_counter()
        commit = Header(Kind.COMMIT, epoch=m.epoch, version=version, digest=m.digest)
        each(s.channels, lambda ch: ch.send(commit, carried or None), s.membership.lost)
        failures, committed, names = self._collect(stats)
        stats.add("commit", time.perf_counter() - t)
        _set_unverified_names(stats, sorted(names))
        s.membership.record(stats, committed)
        if s.commit.strict and names and not failures and not errors:
            failures.append(_strict_failure(sorted(names)))
        few = s.membership.shortfall(version, stats, committed, failures, errors)
        refused = "; ".join(r for stage in s.path.stages if (r := stage.refusal()))
        if refused:  # the receivers were told: none committed
            own = f"the trainer refused refit of version {version}; receivers report state 'failed': {refused}"
        elif failures or errors:
            own = (
                f"refit of version {version} failed; receivers keep their last committed weights and report "
                f"state 'failed': {'; '.join(failures or errors)}"
            )
        else:
            own = ""
        if s.commit.two_phase:
            own = self._decide(m, own, committed)
        if own:
            raise RefitError(s.membership.failed(own, stats))
        if few:  # committed where it reached: those receivers hold the version
            raise RefitError(s.membership.too_few(version, "committed on", len(stats.receivers), stats.departed))

    def _collect(self, stats: RefitStats) -> tuple[list[str], list[Channel], set[str]]:
        """Every receiver's DONE, whatever it says, so the next refit starts in step: (failures, the channels
        that committed, the tensors some receiver could not read back)."""
        failures: list[str] = []
        committed: list[Channel] = []
        names: set[str] = set()
        bisected: dict = {}

        def done(ch: Channel) -> None:
            header, payload = ch.expect(Kind.DONE, f"commit of version {self.version}")
            if header.status == repair.ASK:
                header, payload = repair.on_sender(self.s, ch, payload, self.version, stats)
            try:
                raw = parse_json(payload, "DONE") if payload else {}
                answer = Done.from_json(raw)
            except IntegrityError as e:
                failures.append(f"{ch.peer}: {e}")
                return
            if header.status:
                where = _diagnosed(self.s.handlers, raw, bisected)
                failures.append(f"{ch.peer}: {answer.message or 'unknown error'}{where}")
            else:
                committed.append(ch)
            stats.unverified = max(stats.unverified, answer.unverified)
            names.update(answer.unverified_names)

        each(self.s.channels, done, self.s.membership.lost)
        return failures, committed, names

    def _decide(self, m: Manifest, own: str, committed: list[Channel]) -> str:
        """Agree with the other trainer ranks (a vote), then tell the receivers that committed."""
        s, version = self.s, self.version
        verdict = s.commit.decide(own)
        told = Header(Kind.COMMIT, epoch=m.epoch, version=version, digest=m.digest, status=int(bool(verdict)))
        still = [ch for ch in committed if ch in s.channels]
        each(still, lambda ch: ch.send(told, {"message": verdict}), s.membership.lost)
        return own or (
            f"refit of version {version} failed on another trainer rank; every worker reports state 'failed': {verdict}"
            if verdict
            else ""
        )


def _diagnosed(handlers: list[Handler], done: dict, cache: dict) -> str:
    """What the handlers say of a receiver's failing DONE: advice, so an error in it only drops the advice."""
    try:
        return "".join(h.diagnose(done, cache) for h in handlers)
    except Exception as e:  # noqa: BLE001 - the failure itself is already counted; its explanation is not needed
        log.warning("could not explain a receiver's failure: %s: %s", type(e).__name__, e)
        return ""


def _due(handlers: list[Handler], ranks: frozenset[int]) -> tuple[dict[str, object], dict[str, float]]:
    """What this refit's COMMIT carries, by handler name (refit.stages.handler), and the seconds each took."""
    carried: dict[str, object] = {}
    seconds: dict[str, float] = {}
    for handler in handlers:
        t = time.perf_counter()
        got = handler.due(ranks)
        if got is not None:
            carried[handler.name], seconds[handler.name] = got, time.perf_counter() - t
    return carried, seconds


def _base(stages: list[Stage], version: int, ranks: list[int]) -> int | None:
    """The committed version this refit is sent against: the one stage's that names one (delta), else None."""
    bases = [b for b in (stage.base(version, ranks) for stage in stages) if b is not None]
    if len(bases) > 1:
        raise ValueError(f"stages {[s.name for s in stages]} name {len(bases)} base versions; at most one may")
    return bases[0] if bases else None


def _set_unverified_names(stats: RefitStats, names: list[str]) -> None:
    """Record the tensors no receiver could read back (RefitStats may not have the field in older installs)."""
    with contextlib.suppress(AttributeError, TypeError):
        stats.unverified_names = names  # type: ignore[attr-defined]


def _strict_failure(names: list[str]) -> str:
    shown = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
    return (
        f"verify='strict': {len(names)} tensor(s) could not be read back from the engine to verify: {shown}; "
        "verify='fingerprint' accepts unverified tensors"
    )


def _control_bytes(channels: list[Channel]) -> int:
    return sum(ch.bytes_sent + ch.bytes_received for ch in channels)
