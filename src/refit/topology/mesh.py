"""M:N refit: every engine worker receives only its own slice of each tensor, straight from the trainer
ranks that hold it; no rank gathers the model.

Trainer side, on every rank (each call is collective over the trainer's group):

    mesh = MeshRefit(FsdpSource(model), num_workers=2, transport="gloo")
    info = mesh.rendezvous()        # the same dict on every rank: hand it to every worker
    mesh.refit(version)

Engine side, worker w: `MeshReceiver(engine, info, worker=w).receive()`, where the engine states its
slices (`Engine.shards`; ModuleEngine(shards=...), VllmEngine from its parallel layers).

Every (rank, worker) pair is a Sender/Receiver session of its own over the chosen transport, so each
pair has the protocol's guarantees: authentication, a handshake per epoch, bucket headers, the
fingerprint, the commit. A worker states its slices with READY; each rank intersects every worker's
statement with every rank's holdings (`refit.layout.reshard`, the same plan on every rank, checked by
digest) and sends each worker the boxes it needs, from the rank's live local shards. The commit is
two-phase over every pair: a worker commits a version once all its pairs did and every rank agreed.

A worker's shard has no other holder, so a departed worker fails the refit on every rank. With
`elastic=True` the session goes on: each refit first waits for a worker on every pair, and a replacement
under the same worker index, stating the same shards, takes the departed one's place.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from refit.checks.manifest_check import waived
from refit.engines.base import Engine
from refit.engines.pieces import PieceEngine, ShardTarget
from refit.engines.staging import Staging
from refit.errors import PeerError, RefitError
from refit.layout.reshard import (
    Holding,
    ReshardPlan,
    parse_piece,
    plan_reshard,
    statement_from_json,
    statement_to_json,
)
from refit.layout.spec import TensorSpec
from refit.log import get_logger
from refit.protocol.wire import parse_json
from refit.settings import Settings
from refit.sources.base import Source
from refit.sources.pieces import PieceSource
from refit.topology.collective import Collective
from refit.topology.landing import Live, Staged
from refit.topology.options import SenderOptions
from refit.topology.policies import Commit
from refit.topology.ranked import departed
from refit.topology.receiver import Receiver
from refit.topology.sender import Sender
from refit.topology.stats import RefitStats

log = get_logger("mesh")


def shared_budget(settings: Settings, pairs: int) -> Settings:
    """One process's buffer budget split over its pairs (the memory ratio holds per process, not per pair)."""
    bucket = None if settings.bucket_bytes is None else max(1 << 12, settings.bucket_bytes // pairs)
    return replace(settings, ratio=settings.ratio / pairs, bucket_bytes=bucket)


class MeshRefit:
    """One trainer rank's side of an M:N refit: a Sender per engine worker. Call every method on every rank."""

    def __init__(
        self,
        source: Source,
        options: SenderOptions | None = None,
        *,
        num_workers: int,
        group: dist.ProcessGroup | None = None,
        settings: Settings | None = None,
        device: torch.device | None = None,
        **overrides: Any,
    ) -> None:
        """`options` (SenderOptions, or any of them as keyword arguments: transport, verify, elastic, ...) are each
        pair's Sender's. `elastic`: a departed worker still fails the refit it departs in (on every rank), but the
        session goes on: each refit waits (up to the connect timeout) for a replacement under the same worker index,
        which must state the same shards, and takes it in. Without it (the default) the session is over."""
        if num_workers < 1:
            raise ValueError(f"num_workers ({num_workers}) must be >= 1")
        o = SenderOptions.of(options, overrides)
        if o.num_receivers != 1:
            raise ValueError(f"num_receivers ({o.num_receivers}) is 1 per pair in M:N: pass num_workers instead")
        self.source = source
        self.collective = Collective(group)
        self.rank, self.world = self.collective.rank, self.collective.world
        self.settings = settings or Settings()
        self.elastic = elastic = o.elastic
        pair = shared_budget(self.settings, num_workers)
        pair_options = replace(o, min_receivers=0)  # a pair that reached no worker fails here, naming it (_pair_refit)
        self._ballot = _Ballot(num_workers)
        strict = o.verify == "strict"
        self.senders = [
            Sender(
                source,
                pair_options,
                settings=pair,
                device=device,
                commit=Commit(strict=strict, vote=partial(self._cast, w)),
                vet=self._vet_for(w) if elastic else None,
            )
            for w in range(num_workers)
        ]
        self.plan: ReshardPlan | None = None
        self._planned: tuple = ()
        self._needs: list[dict[str, Holding]] = []
        self._ignore: list[list[str]] = []
        self._ties: list[dict[str, list[str]]] = []
        self._connected = False
        self._broken = ""
        self.epoch = 0
        self.model_bytes = 0
        self._info: dict | None = None
        self._signature: object = None
        """Plans made so far: one more whenever a spec changed (a pair's own epoch moves only with its pieces)."""
        self._pool = ThreadPoolExecutor(num_workers, thread_name_prefix="refit-mesh")
        self.log = get_logger("mesh", self.rank)

    @property
    def num_workers(self) -> int:
        return len(self.senders)

    @property
    def num_receivers(self) -> int:
        """Engine workers fed in all, as drivers such as VllmRefit check."""
        return len(self.senders)

    def rendezvous(self) -> dict:
        """What every worker needs to reach every rank: the same dict on every rank (collective the first
        time; later calls, on any rank, return it again)."""
        if self._info is None:
            pairs = self.collective.all_gather_json([s.rendezvous() for s in self.senders])
            mesh = {"ranks": self.world, "workers": self.num_workers, "pairs": pairs}
            self._info = {"mesh": mesh, "transport": self.senders[0].transport_name}
        return self._info

    def connect(self) -> None:
        """Accept every worker, read their statements and plan the moves (collective)."""
        if self._broken:
            raise PeerError(f"this M:N session broke earlier ({self._broken}); close() it and build a new MeshRefit")
        if self._connected:
            return
        error = ""
        try:
            for f in [self._pool.submit(s.connect) for s in self.senders]:
                f.result()
            self._needs, self._ignore, self._ties = zip(*map(_statement, self.senders, range(self.num_workers)))
        except (RefitError, ValueError) as e:
            error = f"{type(e).__name__}: {e}"
        try:
            self._replan(error)
        except BaseException as e:  # every rank raised here together (the vote): none may go on half-connected
            self._broken = f"connect failed: {type(e).__name__}: {e}"
            raise
        self._connected = True

    def _replan(self, error: str = "") -> None:
        """Plan (again) when the specs moved: the same plan on every rank, or every rank raises."""
        self.source.prepare_refit()
        signature = self.source.signature()  # re-reads the live tensors, once for every pair
        for s in self.senders:
            if isinstance(s.source, PieceSource):
                s.source.base_signature = signature
        if not error and self.plan is not None and signature == self._signature:
            return
        specs = sorted(self.source.specs(), key=lambda s: s.name)
        key = tuple((s.name, s.shape, s.dtype, s.aliases) for s in specs)
        self._signature = signature
        if error == "" and key == self._planned and self.plan is not None:
            return
        holdings = self.collective.all_gather_json(statement_to_json(self.source.holdings()) if not error else None)
        failed = self.collective.vote(error)
        if failed:
            raise RefitError(f"M:N connect failed: {failed}")
        ranks = [statement_from_json(h, f"trainer rank {r}") for r, h in enumerate(holdings)]
        needs, names = zip(*(_by_primary(specs, n, t, w) for w, (n, t) in enumerate(zip(self._needs, self._ties))))
        _check_needed(specs, needs, self._ignore)
        plan = plan_reshard(specs, ranks, needs)
        digest = int.from_bytes(plan.digest[:7], "big")
        low, high = self.collective.reduce([digest, -digest], dist.ReduceOp.MIN)
        if low != -high:
            raise RefitError("the trainer ranks planned different M:N moves (their specs or holdings differ)")
        wire = {s.name: s.dtype for s in specs}
        for w, sender in enumerate(self.senders):
            sender.source = PieceSource(self.source, plan.pair(self.rank, w), wire, plan.digest, names[w])
            sender.source.base_signature = signature
        self.model_bytes = sum(s.nbytes for s in specs)
        self.plan, self._planned = plan, key
        self.epoch += 1
        self.log.info(
            "M:N plan: %d moves, %s bytes per worker, %s per rank",
            len(plan.moves),
            plan.worker_bytes(),
            plan.rank_bytes(),
        )

    def refit(self, version: int) -> RefitStats:
        """Refit every worker to `version`; returns this rank's stats once every worker committed."""
        if self._broken:
            raise PeerError(f"this M:N session broke earlier ({self._broken}); close() it and build a new MeshRefit")
        self.connect()
        self._replan()
        if self.elastic:
            self._await_workers(version)
        ballot = self._ballot = _Ballot(self.num_workers)
        futures = [self._pool.submit(self._pair_refit, w, version) for w in range(self.num_workers)]
        for f in futures:
            f.add_done_callback(lambda _: _notify(ballot.cond))
        with ballot.cond:
            ballot.cond.wait_for(lambda: all(v is not None or f.done() for v, f in zip(ballot.votes, futures)))
        own = "; ".join(v or _failure(f) for v, f in zip(ballot.votes, futures) if (v or _failure(f)))
        try:
            ballot.verdict = self.collective.vote(own)
        except BaseException as e:  # the trainer group itself failed: fail every pair rather than hang them
            ballot.verdict = f"the trainer ranks could not agree on version {version}: {type(e).__name__}: {e}"
            self._broken = ballot.verdict
            raise
        finally:
            ballot.decided.set()
        return self._stats(version, futures)

    def _await_workers(self, version: int) -> None:
        """Elastic, before any pair begins: wait (up to the connect timeout) until every pair has its worker, a
        replacement taking the place of one that departed, so that no worker waits for its verdict while a
        process starts. When one is still missing, every rank fails the refit before it begins (the workers keep
        their weights and state)."""
        timeout = self.settings.connect_timeout_s
        waits = [self._pool.submit(s.await_receivers, 1, timeout_s=timeout) for s in self.senders]
        missing = []
        for w, f in enumerate(waits):
            try:
                here = f.result()
            except RefitError:
                here = True  # a broken pair: its refit says so, in the vote
            if not here:
                missing.append(f"engine worker {w} departed and no replacement connected within {timeout:g} s")
        verdict = self.collective.vote("; ".join(missing))
        if verdict:
            raise PeerError(
                f"M:N refit of version {version} did not begin: {verdict}; its shard has no other holder, so no "
                "worker takes it (they keep their weights and state); start a replacement under the same worker "
                "index (REFIT_CONNECT_TIMEOUT bounds each refit's wait for it)"
            )

    def _pair_refit(self, w: int, version: int) -> RefitStats:
        """Pair `w`'s refit; elastic, one that reached no worker (it left, or was refused, since
        `_await_workers`) fails."""
        sender = self.senders[w]
        stats = sender.refit(version)
        if self.elastic and not stats.receivers:  # no worker took part, so no vote was cast: its shard went nowhere
            left = "; ".join(f"receiver {d['receiver']}: {d['reason']}" for d in stats.departed)
            why = f" (departed or refused: {left})" if left else ""
            raise PeerError(f"no engine worker {w} is connected to trainer rank {self.rank}{why}")
        return stats

    def _cast(self, w: int, own: str) -> str:
        """Pair `w`'s Sender votes (its Commit policy): its outcome in, this rank's verdict across ranks out."""
        return self._ballot.cast(w, own)

    def _vet_for(self, w: int) -> Callable[[bytes], str]:
        """Elastic: a replacement for worker `w` must state what the worker it replaces stated (the plan's input)."""

        def vet(raw: bytes) -> str:
            try:
                stated = _parse_statement(raw, w)
            except (RefitError, ValueError) as e:
                return str(e)
            if self._needs and stated != (self._needs[w], self._ignore[w], self._ties[w]):
                return (
                    f"engine worker {w}'s replacement states other shards, waivers or ties than the worker it "
                    "replaces; start it with the same shard statement (or build a new MeshRefit for a new layout)"
                )
            return ""

        return vet

    def _stats(self, version: int, futures: Sequence[Future]) -> RefitStats:
        errors = [(w, f.exception()) for w, f in enumerate(futures) if f.exception() is not None]
        if errors:
            w, e = next(((w, e) for w, e in errors if isinstance(e, PeerError)), errors[0])
            raise departed(e, f"engine worker {w} (fed by trainer rank {self.rank})", elastic=self.elastic)
        pairs = [f.result() for f in futures]
        assert self.plan is not None
        stats = RefitStats(version=version, epoch=self.epoch, handshake=any(p.handshake for p in pairs))
        stats.nbytes = sum(p.nbytes for p in pairs)
        stats.num_buckets = sum(p.num_buckets for p in pairs)
        stats.model_bytes = self.model_bytes
        stats.worker_bytes = [p.nbytes for p in pairs]
        names = sorted({parse_piece(n)[0] for p in pairs for n in p.unverified_names})
        stats.unverified, stats.unverified_names = len(names), names
        stats.control_bytes = sum(p.control_bytes for p in pairs)
        stats.wire_bytes, stats.full_bytes = sum(p.wire_bytes for p in pairs), sum(p.full_bytes for p in pairs)
        stats.delta = bool(pairs) and all(p.delta for p in pairs)
        stats.seconds["total"] = max(p.total_s for p in pairs)
        return stats

    def close(self) -> None:
        for s in self.senders:
            s.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> MeshRefit:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Ballot:
    """One refit's votes from a rank's pairs: each pair's Sender casts its outcome, then waits for the verdict."""

    def __init__(self, pairs: int) -> None:
        self.cond = threading.Condition()
        self.decided = threading.Event()
        self.votes: list[str | None] = [None] * pairs
        self.verdict = ""

    def cast(self, w: int, own: str) -> str:
        with self.cond:
            self.votes[w] = own
            self.cond.notify_all()
        self.decided.wait()
        return self.verdict


def _notify(cond: threading.Condition) -> None:
    with cond:
        cond.notify_all()


def _failure(f: Future) -> str:
    if not f.done() or f.exception() is None:
        return ""
    e = f.exception()
    return f"{type(e).__name__}: {e}"


def _statement(sender: Sender, w: int) -> tuple[dict[str, Holding], list[str], dict[str, list[str]]]:
    """(slices, waived names, ties) as worker `w` stated them with READY."""
    return _parse_statement(sender.statements[0] if sender.statements else b"", w)


def _parse_statement(raw: bytes, w: int) -> tuple[dict[str, Holding], list[str], dict[str, list[str]]]:
    if not raw:
        raise ValueError(f"engine worker {w} stated no shards: on the engine side use MeshReceiver, not Receiver")
    obj = parse_json(raw, "READY")
    if formats := obj.get("formats"):
        first = next(iter(formats), None) if isinstance(formats, (dict, list)) else formats
        raise ValueError(
            f"engine worker {w} holds tensors in block FP8 ({first!r:.120} first): M:N refits "
            "do not quantize to FP8; load the engine workers with float weights, or use one Receiver per engine"
        )
    ignore, ties = obj.get("ignore", []), obj.get("ties", {})
    if not (isinstance(ignore, list) and all(isinstance(i, str) for i in ignore)):
        raise ValueError(f"engine worker {w}'s READY has a malformed ignore list")
    if not (
        isinstance(ties, dict)
        and all(isinstance(v, list) and all(isinstance(a, str) for a in v) for v in ties.values())
    ):
        raise ValueError(f"engine worker {w}'s READY has malformed ties")
    return statement_from_json(obj.get("shards"), f"engine worker {w}"), ignore, ties


def _by_primary(
    specs: Sequence[TensorSpec], needs: dict[str, Holding], ties: dict[str, list[str]], w: int
) -> tuple[dict[str, Holding], dict[str, list[str]]]:
    """A worker's needs keyed by the trainer's primary names, and the worker's names for each. Names the
    engine ties (one storage) must be one tensor on the trainer too, or the last write would win."""
    primary = {n: s.name for s in specs for n in s.names}
    for name, aliases in ties.items():
        sources = {primary.get(n, n) for n in (name, *aliases)}
        if len(sources) > 1:
            raise ValueError(
                f"engine worker {w} ties {[name, *aliases]} (one storage) but the trainer sends them as separate "
                f"tensors {sorted(sources)}; tie them in the trainer's model too, or untie them in the engine"
            )
    out: dict[str, Holding] = {}
    names: dict[str, list[str]] = {}
    for name, held in needs.items():
        p = primary.get(name, name)
        if p in out and out[p] != held:
            raise ValueError(f"engine worker {w} states {name!r} and its trainer alias {p!r} with different slices")
        out[p] = held
        names.setdefault(p, []).append(name)
    return out, names


def _check_needed(specs: Sequence[TensorSpec], needs: Sequence[dict[str, Holding]], ignore: Sequence[list]) -> None:
    """Every tensor the trainer sends is loaded by some worker, unless every worker waived it."""
    wanted = {n for need in needs for n in need}
    unloaded = [s.name for s in specs if s.name not in wanted and not all(waived(s.name, i) for i in ignore)]
    if unloaded:
        shown = ", ".join(unloaded[:10]) + (f" and {len(unloaded) - 10} more" if len(unloaded) > 10 else "")
        raise ValueError(
            f"no engine worker loads {len(unloaded)} tensor(s) the trainer sends: {shown}; "
            "state them in the engines' shards or pass ignore=[...] to the engine"
        )


class MeshReceiver:
    """One engine worker's side of an M:N refit: a Receiver per trainer rank, over one engine."""

    def __init__(
        self,
        engine: Engine,
        rendezvous: dict,
        *,
        worker: int,
        settings: Settings | None = None,
        device: torch.device | None = None,
        staged: bool = False,
        on_commit: Callable[[int], None] | None = None,
    ) -> None:
        """`staged` and `on_commit` as for `Receiver`: with `staged`, every pair writes into staging memory and
        `apply_staged()` moves a version into the live engine once every pair and the ranks' verdict committed it."""
        mesh = rendezvous.get("mesh") if isinstance(rendezvous, dict) else None
        if not isinstance(mesh, dict) or not isinstance(mesh.get("pairs"), list):
            raise ValueError("rendezvous is not an M:N one (MeshRefit.rendezvous())")
        pairs, workers = mesh["pairs"], mesh.get("workers")
        if not (isinstance(workers, int) and 0 <= worker < workers):
            raise ValueError(f"worker {worker} is out of range for {workers} engine workers")
        self.worker = worker
        self.landing = (
            Staged(Staging(engine, device=device or _cpu()), on_commit) if staged else Live(engine, on_commit)
        )
        self.engine = self.landing.engine  # what the pairs drive; staged, the live engine is self.staging.live
        self.rank = worker
        self._warned = False
        self.settings = settings or Settings()
        pair = shared_budget(self.settings, len(pairs))
        self.target = ShardTarget(self.engine, len(pairs), timeout_s=self.settings.timeout_s, device=device or _cpu())
        self.receivers = []
        for r, row in enumerate(pairs):
            rx = Receiver(PieceEngine(self.target, r), row[worker], settings=pair, device=device)
            rx.statement = self.target.to_json()
            rx.warn_unverified = False  # said once per worker below, not once per pair
            self.receivers.append(rx)
        self._pool = ThreadPoolExecutor(len(pairs), thread_name_prefix="refit-mesh-rx")

    def connect(self) -> None:
        for f in [self._pool.submit(r.connect) for r in self.receivers]:
            f.result()

    def receive(self) -> RefitStats | None:
        """One refit from every rank (its stats), or None when the trainer closed the session."""
        self.target.reset()
        futures = [self._pool.submit(self._one, r) for r in self.receivers]
        results, errors = [], []
        for f in futures:
            try:
                results.append(f.result())
            except Exception as e:  # noqa: BLE001 - every pair is waited for; the first error is raised
                errors.append(e)
        version = self.target.version
        if errors:
            if version is not None and self.engine.weights.state.value == "updating":
                self.engine.fail(version, str(errors[0]))
            raise next((e for e in errors if isinstance(e, PeerError)), errors[0])
        if all(r is None for r in results):
            return None
        if any(r is None for r in results):
            raise PeerError("some trainer ranks closed the session while others refit")
        assert version is not None
        self.engine.versions.commit(version)  # state only: the engine's own commit ran before the pairs' DONE
        self.landing.committed(version)
        stats = RefitStats(version=version, epoch=results[0].epoch, handshake=any(r.handshake for r in results))
        stats.nbytes = sum(r.nbytes for r in results)
        stats.wire_bytes, stats.full_bytes = sum(r.wire_bytes for r in results), sum(r.full_bytes for r in results)
        stats.worker_bytes = [stats.nbytes]
        stats.seconds["total"] = max(r.total_s for r in results)
        unread = sorted({parse_piece(n)[0] for r in results for n in r.unverified_names})
        stats.unverified, stats.unverified_names = len(unread), unread
        if unread and (stats.handshake or not self._warned):
            self._warned = True
            log.warning(
                "fingerprint check: worker %d loads %d tensor(s) it cannot read back as sent, so they are not "
                "verified (verify='strict' fails such refits): %s",
                self.worker,
                len(unread),
                ", ".join(unread[:20]) + (f", ... and {len(unread) - 20} more" if len(unread) > 20 else ""),
            )
        return stats

    def apply_staged(self) -> bool:
        """As `Receiver.apply_staged`: load the version every pair staged and the ranks agreed on, if any."""
        return self.landing.apply()

    @property
    def staging(self) -> Staging | None:
        return self.landing.staging

    def _one(self, rx: Receiver) -> RefitStats | None:
        peer = f"{rx.rendezvous.get('host')}:{rx.rendezvous.get('port')}"
        try:
            got = rx.receive()
        except BaseException as e:
            self.target.abort(f"the pair with the trainer rank at {peer} failed: {e}")
            raise
        if got is None:  # that rank closed: the others' pieces alone cannot make a version
            self.target.abort(f"the trainer rank at {peer} closed its session")
        return got

    def serve(self) -> int:
        n = 0
        while self.receive() is not None:
            n += 1
        return n

    def close(self) -> None:
        for r in self.receivers:
            r.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> MeshReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _cpu() -> torch.device:
    return torch.device("cpu")
