"""One refit on the engine side: begin, take the buckets, verify, the vote, commit (or fail).

The session (refit.topology.receiver) holds what lasts: the connection, heartbeats, the handshake's manifest
and receive path, membership. A ReceiveRound lives for one version, mirrors the Sender's Round
(refit.topology.round), and calls the epoch's stages at the same fixed points: when the refit begins, per
bucket (in the receive path), and when it commits or fails."""

from __future__ import annotations

import contextlib
import time
from typing import Protocol

from refit import stages
from refit.checks.manifest_check import validate
from refit.engines.base import Engine
from refit.engines.staging import Split
from refit.errors import HandshakeError, IntegrityError, PeerError, RefitError
from refit.layout.manifest import Manifest
from refit.layout.spec import TensorSpec, changes
from refit.log import get_logger
from refit.protocol.wire import Begin, Channel, Header, Kind, PeerFailed, parse_json
from refit.topology import repair
from refit.topology.landing import Live
from refit.topology.receive_path import ReceivePath
from refit.topology.stats import RefitStats
from refit.transports.base import Transport

log = get_logger("receiver")


class Session(Protocol):
    """What a round reads of the engine side's session (refit.topology.receiver.Receiver), and may change: the
    layout the manifest was validated against and the staging split follow the engine's tensors."""

    engine: Engine
    channel: Channel | None
    transport: Transport | None
    manifest: Manifest | None
    path: ReceivePath | None
    landing: Live
    staging_split: Split | None
    layout: list[TensorSpec] | None
    rank: int
    regroups: bool

    def after_broken_group(self, version: int, error: PeerError) -> RefitStats | None:
        """Elastic gloo/nccl: the refit again, in the group the sender forms anew."""
        ...


class ReceiveRound:
    def __init__(self, session: Session, begin: Header) -> None:
        self.s = session
        self.begin = begin
        self.version = begin.version
        self.two_phase = bool(Begin.TWO_PHASE & begin.status)
        """A vote across trainer ranks, or strict: the engine's commit is held open until the verdict."""
        self.carried: dict[str, object] = {}
        """What COMMIT carried for the handlers' checks before commit, by handler name (refit.stages.handler)."""
        self.checks_s: dict[str, float] = {}
        self.explained: dict = {}
        """After a check vetoed the version: what its handler adds to DONE to say where (refit.stages.handler)."""
        self.malformed: RefitError | None = None
        self.failed = False
        """The engine was told this refit failed (told once)."""
        """COMMIT's fields could not be read: the refit fails, whatever a repair mends."""
        """After a check vetoed the version: what its handler adds to DONE to say where (refit.stages.handler)."""

    def run(self) -> RefitStats | None:
        s, version, begin = self.s, self.version, self.begin
        m, ch, path = s.manifest, s.channel, s.path
        assert ch is not None and path is not None
        if m is None or begin.epoch != m.epoch or begin.digest != m.digest:
            msg = "refit started for a manifest this receiver has not validated (epoch or digest differs)"
            ch.send(Header(Kind.ERROR), {"message": msg})
            raise IntegrityError(msg)
        t0 = time.perf_counter()
        stats = RefitStats(version=version, epoch=m.epoch, num_buckets=m.num_buckets, nbytes=m.nbytes)
        stats.full_bytes, stats.delta = sum(m.bucket_nbytes), bool(Begin.DELTA & begin.status)
        ctrl0 = ch.bytes_sent + ch.bytes_received
        s.engine.begin(version)
        try:
            failure, done = self._take(stats)
        except RefitError as e:
            self._fail(str(e))
            # a broken group is formed again; the sender's ERROR (PeerFailed) says it gave up: no REGROUP follows
            if isinstance(e, PeerError) and not isinstance(e, PeerFailed) and s.regroups:
                return s.after_broken_group(version, e)
            raise
        except Exception as e:  # a bug here still leaves the engine failed and tells the sender at once
            self._stopped(e)
            raise
        t = time.perf_counter()
        self._flush()
        try:
            failure = repair.on_receiver(s, failure, stats, version)  # a few wrong tensors fetched again
            self._commit(failure or self.malformed, done)
        except RefitError as e:
            if not self.failed:  # `_commit` and `_await_verdict` fail the engine themselves
                self._fail(str(e))
            raise
        except Exception as e:  # as above: a repair's or a check's error fails the engine and tells the sender
            self._stopped(e)
            raise
        for name, seconds in self.checks_s.items():
            stats.add(name, seconds)
        log.info("committed version %d (%d bytes, %d bucket(s))", version, m.nbytes, m.num_buckets)
        stats.add("commit", time.perf_counter() - t)
        stats.control_bytes = ch.bytes_sent + ch.bytes_received - ctrl0
        stats.seconds["total"] = time.perf_counter() - t0
        return stats

    def _take(self, stats: RefitStats) -> tuple[RefitError | None, dict]:
        """The buckets (loaded unless the refit was refused first), the fingerprint check, then the COMMIT."""
        s, version, begin = self.s, self.version, self.begin
        ch, path = s.channel, s.path
        assert ch is not None and path is not None
        done: dict = {}
        base = begin.base if Begin.DELTA & begin.status else None
        refused = self._relayout()
        for stage in path.stages:  # each stage checks the base (every one: it also marks its state as rewritten)
            got = stage.accept(version, base)
            refused = refused or got
        if base is not None and not path.stages:
            refused = refused or IntegrityError(
                f"refused a delta refit of version {version}: this receiver keeps no delta image this epoch"
            )
        _count_staged(stats, s.staging_split)
        failure = path.take(begin, stats, refused)
        header, payload = ch.recv(f"commit of version {version}")
        if header.kind == Kind.VERIFY:
            failure = failure or path.check_fingerprints(payload, stats, done)
            header, payload = ch.recv(f"commit of version {version}")
        else:
            failure = failure or path.unverified(version)
        if header.kind != Kind.COMMIT:
            raise PeerError(f"{ch.peer} sent {header.kind.name} during commit of version {version}, expected COMMIT")
        try:
            self.carried = _carried(payload)
        except RefitError as e:  # kept apart: a repair of the fingerprint's failure must not hide it
            self.malformed = e
        except Exception as e:  # noqa: BLE001 - whatever a malformed field raises, the refit fails, named
            self.malformed = IntegrityError(f"COMMIT is malformed: {type(e).__name__}: {str(e)[:200]}")
        return failure, done

    def _stopped(self, e: Exception) -> None:
        """An unexpected error stopped this refit: the engine reads failed and the sender hears it at once."""
        s, ch = self.s, self.s.channel
        msg = f"receiver {s.rank}: refit of version {self.version} stopped: {type(e).__name__}: {e}"
        self._fail(msg)
        if ch is not None:
            with contextlib.suppress(PeerError):
                ch.send(Header(Kind.ERROR), {"message": msg})

    def _commit(self, failure: RefitError | None, done: dict) -> None:
        """Commit the engine and answer DONE; two-phase, hold the version open until the verdict."""
        s, version, ch = self.s, self.version, self.s.channel
        assert ch is not None
        failure = failure or self._finalize() or self._vetoed()
        if failure is not None:
            self._fail(str(failure))
            log.error("refit of version %d failed: %s", version, failure)
            ch.send(
                Header(Kind.DONE, status=1, version=version),
                {"message": f"receiver {s.rank}: {failure}", **self.explained},
            )
            raise failure
        if self.two_phase:
            ch.send(Header(Kind.DONE, version=version), done or None)
            self._await_verdict()
        else:
            if self.carried:
                s.engine.versions.commit(version)  # held 'updating' through the checks (`_finalize`); before DONE
            ch.send(Header(Kind.DONE, version=version), done or None)
        assert s.path is not None
        for stage in s.path.stages:
            stage.committed(version, [s.rank])

    def _fail(self, reason: str) -> None:
        self.failed = True
        self.s.engine.fail(self.version, reason)
        if self.s.path is not None:
            for stage in self.s.path.stages:
                stage.failed()

    def _relayout(self) -> RefitError | None:
        """The engine's tensors changed since this epoch's manifest was validated (recast, reshaped): validate
        it again here. A layout it still fits goes on (staging follows it); one it no longer fits refuses the
        refit before any byte is loaded, naming the tensor."""
        s, version, m = self.s, self.version, self.s.manifest
        assert m is not None
        try:
            now = s.engine.layout()
            if now is s.layout or now == s.layout:
                return None
            now = s.engine.specs()  # staging re-reads the live engine's dtypes here
            report = validate(
                [p.spec for p in m.entries], now, exact_shapes=s.engine.exact_shapes, optional=s.engine.optional_names
            )
        except RefitError as e:  # the engine refuses this refit itself (its message says why)
            return e
        except Exception as e:  # noqa: BLE001 - any engine error fails the refit, reported to the sender
            return RefitError(f"engine failed to state its tensors for refit {version}: {type(e).__name__}: {e}")
        changed = changes(s.layout, now)
        if not report.ok:
            s.layout = None  # validated again at every refit, until a layout fits
            return HandshakeError(
                f"the engine's tensors changed since the handshake of epoch {m.epoch} ({changed}) and no longer fit "
                f"the trainer's manifest: {report.message()}; nothing of refit {version} was loaded. Put them back, "
                "or change the trainer's tensors (wire dtype or shape) so that the next refit starts a new epoch"
            )
        log.info(
            "refit %d: the engine's tensors changed since the handshake (%s); the manifest still fits", version, changed
        )
        s.layout = now
        s.landing.relaid(m)
        return None

    def _vetoed(self) -> RefitError | None:
        """After the engine's own commit (its post-processing ran): each check COMMIT carried may fail it."""
        m = self.s.manifest
        assert m is not None
        for name, parsed in self.carried.items():
            t, handler = time.perf_counter(), stages.handler_class(name)
            failure = handler.veto(parsed, self.s.engine, m, self.version) if handler else None
            if failure is not None and handler is not None:
                self.explained = handler.explain(parsed, self.s.engine, m)
            self.checks_s[name] = time.perf_counter() - t
            if failure is not None:
                return failure
        return None

    def _await_verdict(self) -> None:
        """The engine stays 'updating' until every worker committed; any error or silence here fails it."""
        s, version = self.s, self.version
        assert s.channel is not None
        try:
            header, payload = s.channel.expect(Kind.COMMIT, f"every worker's commit of version {version}")
            if header.status:
                reason = str(parse_json(payload, "COMMIT").get("message", "")) or "another worker failed"
                raise RefitError(
                    f"version {version} loaded here but failed on another worker or the sender's check: {reason}"
                )
        except BaseException as e:
            self._fail(f"not every worker committed version {version}: {e}")
            raise
        s.engine.versions.commit(version)  # the state only: the engine's own commit ran

    def _flush(self) -> None:
        """Wait for every transfer; a transport failure is the peer's (PeerError), never the engine's."""
        s, version = self.s, self.version
        assert s.transport is not None and s.channel is not None
        try:
            s.transport.flush()
        except Exception as e:  # noqa: BLE001 - CUDA/NCCL raise RuntimeError subclasses; all end the session
            msg = f"receiver {s.rank}: {s.transport.name} transfer failed before commit of version {version}: {e}"
            self._fail(msg)
            with contextlib.suppress(PeerError):
                s.channel.send(Header(Kind.ERROR), {"message": msg})
            raise PeerError(msg) from None

    def _finalize(self) -> RefitError | None:
        """Commit the engine; one that fails here still answers the sender. In a two-phase refit, or with checks
        COMMIT carried, the engine's commit leaves it 'updating' (the state only) until the verdict or checks."""
        engine, version = self.s.engine, self.version
        try:
            if self.two_phase or self.carried:  # never reads current before the verdict or the checks
                engine.versions.hold(version)
            engine.commit(version)
        except Exception as e:  # noqa: BLE001 - any engine error fails the commit, reported to the sender
            return RefitError(f"engine failed to commit version {version}: {type(e).__name__}: {e}")
        return None


def _carried(payload: bytes) -> dict[str, object]:
    """What COMMIT carries for the handlers' checks, each parsed by its handler; a field no registered handler
    reads is a broken protocol."""
    if not payload:
        return {}
    obj = parse_json(payload, "COMMIT")
    unknown = sorted(n for n in obj if stages.handler_class(n) is None)
    if unknown:
        raise IntegrityError(f"COMMIT carries unknown fields {unknown[:5]}; no handler registered here reads them")
    parsed = {name: handler.parse(value) for name, value in obj.items() if (handler := stages.handler_class(name))}
    return {name: value for name, value in parsed.items() if value is not None}


def _count_staged(stats: RefitStats, split: Split | None) -> None:
    """A staged landing's bytes as split for this refit (a followed relayout splits again)."""
    if split is not None:
        stats.staged_bytes = split.staged_nbytes
        stats.direct_bytes = split.direct_wire_nbytes
