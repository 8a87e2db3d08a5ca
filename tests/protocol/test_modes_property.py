"""Refit sessions as a stateful property (hypothesis), all in one process over shm: random sequences of
refits (new versions and retries), joins, leaves, kills (between refits and mid-refit), engine tensors
recast or replaced (also while a version waits in staging), trainer tensors replaced or switched to
another dtype (a new epoch), and `apply_staged()`, with one to three receivers, staged and unstaged,
holding different rows of one tensor (tensor parallel) or everything. Beside the weights the trainer holds a
draft head and an integer routing table: the same version moves all of them, or none.

Invariant after every step, for every engine (members and departed ones alike): an engine that reads
`current` at version v holds, bitwise, the trainer's tensors of v in the wire dtype (its rows only where
it holds rows), by a cast that is exact; `on_commit` was called exactly for the versions its live engine
committed. The model also says which refits must succeed (and on whom), which must fail (none reached,
a handshake no engine can take), and what stays staged.

A second machine (`StageSessions`, at the end) draws the stages that change what an engine serves beside its
weights: LoRA adapter slots, the canary, FP8 with a non-finite value.

Each Receiver is served by its own thread, which obeys commands (connect, receive one refit, leave,
close) and reports each outcome as an event the test waits on, never a sleep. A receiver leaves only
while its thread is not inside `receive()` (as an engine's serving loop does, between its calls): a
thread blocked in `receive()` cannot be interrupted except by killing its connection, which `kill` does.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import queue
import re
import socket
import sys
import threading
import traceback

import pytest
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from refit import HandshakeError, ModuleEngine, ModuleSource, PeerError, RefitError, Sender, Settings, State
from refit.layout import fp8
from refit.layout.fp8 import BlockFormat
from refit.layout.spec import TensorSpec
from refit.stages.delta import Costs
from refit.topology.policies import Commit
from refit.topology.receiver import Receiver
from refit.topology.stats import RefitStats

F32, BF16, F16, F64 = torch.float32, torch.bfloat16, torch.float16, torch.float64
TRAINER = {
    "embed.weight": ((24, 32), F32),
    "tp.weight": ((12, 32), F32),
    "mlp.weight": ((32, 32), BF16),
    "mlp.bias": ((32,), F32),
    "norm.weight": ((40,), BF16),
    "head.weight": ((16, 64), F32),
    "span.weight": ((128, 128), BF16),
    "q8.weight": ((130, 72), F32),
    "draft.head.weight": ((16, 32), BF16),
    "router.table": ((64,), torch.int64),
}
"""About 44 KB: at least three buckets of either size below, so every refit has at least three loads; span.weight
spans buckets (32 KiB), and in a delta session its first half changes densely and the rest sparsely. Beside the
weights, the engine's other state of the same version: a draft head (`draft.`, as a ModuleEngine over a target
and its draft names it) and a routing table, an integer buffer the trainer also holds."""
DRAFT, ROUTER = "draft.head.weight", "router.table"
SPAN = "span.weight"
Q8 = "q8.weight"
"""In an FP8 session every engine holds it in block FP8 (partial edge blocks) with its scales beside it: the
trainer quantizes it at every refit (refit.stages.fp8); it spans buckets in FP8 too."""
Q8_SCALE = BlockFormat().scale_name(Q8)
DENSE_ROWS = 64
NAMES = list(TRAINER)
ENGINE_NAMES = [n for n in NAMES if n not in (Q8, ROUTER)]
"""What an engine recasts or replaces (an FP8 engine's statement of its formats holds for its session; an integer
table is never recast to a float)."""
TP = "tp.weight"
ROWS = 4
"""Region k of TP: rows [4k, 4k + 4)."""
SWITCHED = {
    n: F32 if dtype == BF16 else BF16 if dtype.is_floating_point else dtype for n, (_, dtype) in TRAINER.items()
}
"""The dtype a trainer tensor may switch to (a new epoch), and back: an engine holds bf16 as fp32, never the reverse."""
DTYPES = {"float64": F64, "float32": F32, "bfloat16": BF16, "float16": F16}
HOLDS = {(BF16, F32), (F16, F32), (BF16, F64), (F16, F64), (F32, F64)}
"""(wire, held): an engine holding the wire dtype's values exactly in a wider dtype (the model's own table)."""
MAX_MEMBERS = 3
MAX_PEERS = 8
"""Receivers started in one example at most (threads, sockets and shm mappings stay bounded)."""
TIMEOUT_S = 30.0
WAIT_S = 120.0
"""Bound on waiting for an in-process receiver's outcome that must come (nothing starts a process here)."""
BUCKETS = [4096, 16384]
"""Bucket capacities a session may draw: many small buckets, or buckets large enough that the delta's density
sample judges a bucket dense (it is then sent full and not kept, beside kept ones of the same tensor)."""
STAGING_BYTES = 6144
"""Partial staging: the tensors first in bucket order that fit in this many bytes are staged, the rest go live."""
MIN_RECEIVERS = 1
REGION = st.sampled_from([None, 0, 1, 2])
"""None: the receiver holds every tensor whole; k: rows [4k, 4k + 4) of TP, the rest whole."""
PEER = st.tuples(st.sampled_from(["unstaged", "staged", "partial"]), REGION)
"""(staging, region) of a receiver: unstaged, staged whole, or staged up to STAGING_BYTES (partial staging)."""
VERIFY = st.sampled_from([None, "fingerprint", "strict"])


def _values(name: str, version: int, dtype: torch.dtype, sparse: bool = False) -> torch.Tensor:
    """The trainer's values of `name` at `version`: the same for every attempt of a version. `sparse` (a delta
    session): one base tensor with a sixteenth of its values changed per version, as after an optimizer step,
    so that buckets go as deltas; otherwise every version's values are drawn anew."""
    seed = version * 7919 + NAMES.index(name) + 1
    if not sparse:
        return torch.randn(TRAINER[name][0], generator=torch.Generator().manual_seed(seed)).to(dtype)
    t = torch.randn(TRAINER[name][0], generator=torch.Generator().manual_seed(NAMES.index(name) + 1))
    g = torch.Generator().manual_seed(seed)
    flat = t.view(-1)
    if name == SPAN:  # its first half drawn anew (dense buckets), its second changed sparsely as the rest
        t[:DENSE_ROWS] = torch.randn(t[:DENSE_ROWS].shape, generator=g)
        flat = t[DENSE_ROWS:].view(-1)
    at = torch.randperm(flat.numel(), generator=g)[: max(1, flat.numel() // 16)]
    flat[at] += torch.randn(at.numel(), generator=g)
    return t.to(dtype)


def _as_held(tensors: dict[str, torch.Tensor], quantized: bool) -> dict[str, torch.Tensor]:
    """The trainer's tensors as the engines hold them: in an FP8 session Q8 as the reference rule quantizes it."""
    if not quantized:
        return tensors
    q, scales = fp8.quantize(tensors[Q8], name=Q8)
    return {**tensors, Q8: q, Q8_SCALE: scales}


def _holds(wire: torch.dtype, held: torch.dtype) -> bool:
    return wire == held or (wire, held) in HOLDS


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def _wrong(got: torch.Tensor, want: torch.Tensor) -> str:
    """'' when the engine's tensor holds `want` (wire dtype) bitwise by an exact cast, else what differs."""
    if tuple(got.shape) != tuple(want.shape):
        return f"shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    cast = got.to(want.dtype)
    if not torch.equal(_bytes(cast.to(got.dtype)), _bytes(got)):
        return f"holds {got.dtype} values that {want.dtype} (the wire dtype) does not have"
    if not torch.equal(_bytes(cast), _bytes(want)):
        n = int((cast != want).sum())
        return f"{n} of {want.numel()} values differ from the trainer's ({got.dtype} held, {want.dtype} on the wire)"
    return ""


class _Engine(ModuleEngine):
    """A state-dict engine over its own tensors (not the trainer's); records the versions it committed."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__(tensors)
        self.commits: list[int] = []

    def commit(self, version: int) -> None:
        super().commit(version)
        self.commits.append(version)

    def fail(self, version: int, reason: str) -> None:
        # a vote runs after the engine's own commit: a vetoed version is failed, and never stood committed
        super().fail(version, reason)
        if self.commits and self.commits[-1] == version and self.weights.version != version:
            self.commits.pop()


class _RowsEngine(_Engine):
    """Holds rows [start, stop) of TP (stated through `held` and the global shape in `specs`), the rest whole."""

    def __init__(self, tensors: dict[str, torch.Tensor], region: int) -> None:
        self.start, self.stop = region * ROWS, (region + 1) * ROWS
        super().__init__({**tensors, TP: tensors[TP][self.start : self.stop].clone()})

    def specs(self) -> list[TensorSpec]:
        shape = TRAINER[TP][0]
        return [TensorSpec(s.name, shape, s.dtype, s.aliases) if s.name == TP else s for s in super().specs()]

    def held(self, name: str):  # noqa: ANN201 - as the base
        got = super().held(name)
        return (got[0], (0, self.start, self.stop)) if got is not None and name == TP else got

    def load(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        super().load([(n, t[self.start : self.stop] if n == TP else t) for n, t in tensors])


class _Peer:
    """One Receiver served by its own thread, which runs the commands it is given and reports each outcome."""

    def __init__(
        self, index: int, rendezvous: dict, *, staging: str, region: int | None, settings: Settings, fp8: bool
    ) -> None:
        self.index, self.staged, self.region = index, staging != "unstaged", region
        self.staging = staging
        g = torch.Generator().manual_seed(1000 + index)
        own = {n: torch.randn(shape, generator=g).to(dtype) for n, (shape, dtype) in TRAINER.items()}
        own = _as_held(own, fp8)
        self.live: _Engine = _RowsEngine(own, region) if region is not None else _Engine(own)
        self.calls: list[int] = []
        """What on_commit was called with."""
        self.root = ""
        """The root its last committed refit proved (RefitStats.root)."""
        self.receiver = Receiver(
            self.live,
            rendezvous,
            settings=settings,
            device=torch.device("cpu"),
            staged=self.staged,
            staging_bytes=STAGING_BYTES if staging == "partial" else None,
            on_commit=self.calls.append,
        )
        self.status = "starting"
        """member | left | killed | died (mid-refit) | refused (at its join)."""
        self.joiner = False
        """In the session but not yet in a refit (its first refit validates the manifest alone)."""
        self.pending = False
        """A `receive` was asked and its outcome not yet taken."""
        self.ready: int | None = None
        """Staged: the version the model expects to wait for apply_staged()."""
        self.expected: list[int] = []
        """The versions the model expects the live engine to have committed, in order."""
        self.taint: tuple[tuple, set[str]] | None = None
        """After a recast that changed values: (the live weights state then, names); those names are not
        checked while the engine still reads that state (the engine itself changed them, not a refit)."""
        self.handshake_dtypes: dict[str, torch.dtype] | None = None
        """The live dtypes at its last handshake that passed (what its staging tensors were made in)."""
        self.arm: int | None = None
        self.loads = 0
        self.fired = False
        """kill_mid_refit: at the `arm`-th load from now, its connection is shut down (it dies mid-refit)."""
        inner = self.receiver.engine.load_digested  # the engine the protocol drives (staging, when staged)

        def load_digested(tensors: list[tuple[str, torch.Tensor]]):  # noqa: ANN202 - as the base
            if self.arm is not None:
                self.loads += 1
                if self.loads == self.arm:
                    self.arm, self.fired = None, True
                    assert self.receiver.channel is not None
                    self.receiver.channel.sock.shutdown(socket.SHUT_RDWR)
            return inner(tensors)

        self.receiver.engine.load_digested = load_digested  # type: ignore[method-assign]
        self._commands: queue.Queue[str] = queue.Queue()
        self._outcomes: queue.Queue[object] = queue.Queue()
        self._asked: list[str] = []
        self.thread = threading.Thread(target=self._serve, name=f"modes-receiver-{index}", daemon=True)
        self.thread.start()
        self.paused = threading.Event()
        """Partial staging: the engine loop entered the pause of the refit under way."""
        self._applied: queue.Queue[object] = queue.Queue()
        self._stopping = False
        self.loop = None
        if staging == "partial":
            self.loop = threading.Thread(target=self._engine_loop, name=f"modes-loop-{index}", daemon=True)
            self.loop.start()

    def __repr__(self) -> str:
        held = "whole" if self.region is None else f"rows {self.region * ROWS}-{(self.region + 1) * ROWS}"
        return f"<receiver #{self.index} ({self.staging}, {held})>"

    @property
    def rank(self) -> int:
        return self.receiver.rank

    def _serve(self) -> None:
        while True:
            command = self._commands.get()
            if command == "stop":
                return
            try:
                if command == "connect":
                    self.receiver.connect()
                    out: object = "connected"
                elif command == "receive":
                    out = self.receiver.receive()
                elif command == "leave":
                    self.receiver.leave("the test asked it to leave")
                    out = "left"
                else:
                    self.receiver.close()
                    out = "closed"
            except Exception as e:  # noqa: BLE001 - the test reads it
                out = e
            self._outcomes.put(out)

    def _engine_loop(self) -> None:
        """Partial staging's engine loop: it calls apply_staged() when the receive side asks for the pause (an
        engine calls it between every generation step; here only then, so the model knows what it applies)."""
        staging = self.receiver.staging
        assert staging is not None
        while True:
            with staging._cond:
                staging._cond.wait_for(lambda: staging._want is not None or self._stopping)
                if self._stopping:
                    return
            self.paused.set()
            try:
                out: object = self.receiver.apply_staged()
            except RefitError as e:
                out = e
            self._applied.put(out)

    def stop_loop(self) -> None:
        staging = self.receiver.staging
        if self.loop is None or staging is None:
            return
        with staging._cond:
            self._stopping = True
            staging._cond.notify_all()
        self.loop.join(WAIT_S)

    def pause_outcome(self) -> object:
        """What the engine loop's apply_staged() in the pause ended in (True: applied), or None: no pause."""
        if not self.paused.is_set():
            return None
        self.paused.clear()
        try:
            return self._applied.get(timeout=WAIT_S)
        except queue.Empty:
            raise AssertionError(f"{self!r}: the engine loop did not leave the pause; threads:\n{_stacks()}") from None

    def ask(self, command: str) -> None:
        self._asked.append(command)
        self._commands.put(command)

    def outcome(self, wait_s: float = WAIT_S) -> object:
        try:
            out = self._outcomes.get(timeout=wait_s)
        except queue.Empty:
            raise AssertionError(
                f"{self!r} did not finish {self._asked[0]!r} within {wait_s:g} s; threads:\n{_stacks()}"
            ) from None
        self._asked.pop(0)
        return out

    def do(self, command: str) -> object:
        self.ask(command)
        return self.outcome()

    def dtypes(self) -> dict[str, torch.dtype]:
        return {n: t.dtype for n, t in self.live.module.items()}  # type: ignore[union-attr]


def _sender(tensors: dict[str, torch.Tensor], mode: Mode) -> Sender:
    commit = Commit(strict=mode.verify == "strict", vote=mode.vote) if mode.vote is not None else None
    return Sender(
        ModuleSource(tensors),
        transport="shm",
        num_receivers=1,
        elastic=True,
        min_receivers=MIN_RECEIVERS,
        settings=mode.settings,
        verify=mode.verify,
        delta=mode.delta,
        delta_costs=mode.costs,
        commit=commit,
    )


class Mode:
    """One session's modes: delta or not, the verify mode, a vote across (simulated) trainer ranks or not,
    the bucket capacity. `veto`: the other rank's failure, cast in the next refit's vote."""

    def __init__(self, *, delta: str | None, verify: str | None, vote: bool, bucket_bytes: int) -> None:
        """`delta`: off (None), or on with the link's cost pinned slow (every bucket that pays goes as a delta) or
        measured in the session (loopback is fast: most buckets go full, kept, by choice)."""
        self.delta, self.verify = delta is not None, verify
        self.costs = Costs.known(link=1.0, per_op=0.0, per_byte=0.0) if delta == "slow link" else None
        self.settings = Settings(bucket_bytes=bucket_bytes, timeout_s=TIMEOUT_S)
        self.veto = False
        self.vetoed = False
        """The last refit's vote was vetoed by the other rank."""
        self.vote = self._vote if vote else None

    def _vote(self, own: str) -> str:
        self.vetoed, self.veto = self.veto, False
        return own or ("rank 1: the other trainer rank failed its refit" if self.vetoed else "")

    def __repr__(self) -> str:
        vote = "vote" if self.vote is not None else "no vote"
        return f"<delta={self.delta} verify={self.verify} {vote} buckets={self.settings.bucket_bytes}>"


def _open_fds() -> set[str]:
    """This process's open descriptors, with what each points at (a number reused for another file differs)."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            out.add(f"{fd} -> {os.readlink(f'/proc/self/fd/{fd}')}")
    return out


def _specs_of(manifest: object) -> dict[str, tuple[tuple, torch.dtype]]:
    return {e.name: (tuple(e.spec.shape), e.spec.dtype) for e in manifest.entries}  # type: ignore[attr-defined]


def _named_ranks(error: HandshakeError) -> set[int]:
    """The receivers a failed handshake names (each refused the manifest)."""
    return {int(m.group(1)) for part in str(error).split(" | ") if (m := re.match(r"receiver (\d+): ", part))}


class Sessions(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.fds = _open_fds()
        self.peers: list[_Peer] = []
        self.sender: Sender | None = None
        self.tensors: dict[str, torch.Tensor] = {}
        self.sent: dict[int, dict[str, torch.Tensor]] = {}
        """Per version: the trainer's tensors right after it changed them for that version, in the wire dtype."""
        self.next_version = 1
        self.fp8 = False
        self.failed: tuple[int, dict] | None = None
        self.empty_refits = 0
        """Refits with no receiver in the session since the last join (one is enough to see it fail)."""
        """The last refit, if it failed: (version, the trainer's dtypes then), for a retry of the same version."""

    # -- helpers -------------------------------------------------------------------------------

    def _members(self) -> list[_Peer]:
        return [p for p in self.peers if p.status == "member"]

    def _idle_members(self) -> list[_Peer]:
        return [p for p in self._members() if not p.pending]

    def _start(self, staging: str, region: int | None) -> _Peer:
        assert self.sender is not None
        rendezvous = self.sender.rendezvous()
        p = _Peer(
            len(self.peers) + 1, rendezvous, staging=staging, region=region, settings=self.mode.settings, fp8=self.fp8
        )
        self.peers.append(p)
        return p

    def _specs(self) -> dict[str, tuple[tuple, torch.dtype]]:
        specs = {n: (tuple(t.shape), t.dtype) for n, t in self.tensors.items()}
        if self.fp8:
            f = BlockFormat()
            specs[Q8] = (TRAINER[Q8][0], f.dtype)
            specs[Q8_SCALE] = (fp8.scale_shape(TRAINER[Q8][0], f), f.scale_dtype)
        return specs

    def _fits(self, p: _Peer, specs: dict) -> bool:
        """Whether `p`'s live engine can hold `specs` as sent (what its handshake must say)."""
        held = p.dtypes()
        return all(_holds(dtype, held[n]) for n, (_, dtype) in specs.items())

    def _live_weights(self, p: _Peer) -> tuple:
        w = p.live.weights
        return (w.state, w.version, w.target)

    # -- session start -------------------------------------------------------------------------

    @initialize(
        first=PEER,
        joiners=st.lists(PEER, max_size=MAX_MEMBERS - 1),
        delta=st.sampled_from([None, "slow link", "measured link"]),
        verify=VERIFY,
        vote=st.booleans(),
        bucket_bytes=st.sampled_from(BUCKETS),
        quantized=st.booleans(),
    )
    def start(
        self,
        first: tuple[str, int | None],
        joiners: list[tuple[str, int | None]],
        delta: str | None,
        verify: str | None,
        vote: bool,
        bucket_bytes: int,
        quantized: bool,
    ) -> None:
        """The trainer's session (its modes) and its first receiver (admitted by connect), then receivers
        that join. `quantized`: every engine holds Q8 in block FP8."""
        self.fp8 = quantized
        event(f"fp8={quantized}")
        self.mode = Mode(delta=delta, verify=verify, vote=vote, bucket_bytes=bucket_bytes)
        self.delta = delta is not None
        event(f"delta={delta}")
        event(f"verify={verify}")
        event(f"vote={vote}")
        self.tensors = {n: _values(n, 0, dtype, self.delta) for n, (_, dtype) in TRAINER.items()}
        self.sender = _sender(self.tensors, self.mode)
        p = self._start(*first)
        p.ask("connect")
        self.sender.connect()  # admits num_receivers=1
        assert p.outcome() == "connected"
        p.status = "member"
        for staged, region in joiners:
            self._join(staged, region)

    # -- membership ----------------------------------------------------------------------------

    def _join(self, staging: str, region: int | None) -> None:
        assert self.sender is not None
        p = self._start(staging, region)
        out = p.do("connect")
        assert out == "connected", f"{p!r} could not join: {out!r}"
        p.status, p.joiner = "member", True
        self.empty_refits = 0
        assert self.sender.await_receivers(len(self._members()), timeout_s=WAIT_S), "the joiner is not ready"

    @precondition(lambda self: len(self._members()) < MAX_MEMBERS and len(self.peers) < MAX_PEERS)
    @rule(region=REGION)
    def join_unstaged(self, region: int | None) -> None:
        self._join("unstaged", region)

    @precondition(lambda self: len(self._members()) < MAX_MEMBERS and len(self.peers) < MAX_PEERS)
    @rule(region=REGION, partial=st.booleans())
    def join_staged(self, region: int | None, partial: bool) -> None:
        self._join("partial" if partial else "staged", region)

    @precondition(lambda self: self.mode.vote is not None)
    @rule()
    def other_rank_fails(self) -> None:
        """Another trainer rank fails its part of the next refit: the vote fails it on every receiver."""
        self.mode.veto = True

    @precondition(lambda self: self._idle_members())
    @rule(data=st.data())
    def leave(self, data: st.DataObject) -> None:
        p = data.draw(st.sampled_from(self._idle_members()))
        assert p.do("leave") == "left"
        p.status = "left"

    @precondition(lambda self: self._members())
    @rule(data=st.data(), at_load=st.sampled_from([None, 1, 2, 3]))
    def kill(self, data: st.DataObject, at_load: int | None) -> None:
        """A crash without LEAVE: now (between refits), or at its `at_load`-th load of the next refit that loads
        (one armed earlier and not fired yet is killed now)."""
        p = data.draw(st.sampled_from(self._members()))
        if at_load is not None and p.arm is None:
            p.arm, p.loads = at_load, 0
            return
        assert p.receiver.channel is not None
        p.receiver.channel.sock.shutdown(socket.SHUT_RDWR)
        p.status, p.arm = "killed", None
        if p.pending:  # its thread was waiting for the next refit: it sees the end now
            out = p.outcome()
            assert isinstance(out, PeerError), f"{p!r} killed while waiting: {out!r}"
            p.pending = False

    # -- engine side ---------------------------------------------------------------------------

    @precondition(lambda self: self._members())
    @rule(
        data=st.data(),
        name=st.sampled_from(ENGINE_NAMES),
        how=st.sampled_from(["recast", "recast in place", "replace"]),
    )
    def change_engine_tensor(self, data: st.DataObject, name: str, how: str) -> None:
        """The engine recasts one live tensor (`.data =`, or a new tensor under the name), or replaces it by
        another object of the same spec and values (column-major where it has two dimensions); staged,
        possibly while a version waits in staging."""
        p = data.draw(st.sampled_from(self._members()))
        old = p.live.module[name]  # type: ignore[index]
        if how == "replace":
            p.live.module[name] = old.t().contiguous().t() if old.dim() == 2 else old.clone()  # type: ignore[index]
            return
        dtype = DTYPES[data.draw(st.sampled_from([k for k, d in DTYPES.items() if d != old.dtype]))]
        new = old.detach().to(dtype)
        if not torch.equal(_bytes(new.to(old.dtype)), _bytes(old)):  # the engine changed its own values
            now = self._live_weights(p)
            names = p.taint[1] if p.taint is not None and p.taint[0] == now else set()
            p.taint = (now, names | {name})
        if how == "recast in place":
            old.data = new
        else:
            p.live.module[name] = new  # type: ignore[index]

    @precondition(lambda self: [p for p in self.peers if p.staged])
    @rule(data=st.data())
    def apply_staged(self, data: st.DataObject) -> None:
        """The engine loop between generation steps (here, the test thread)."""
        p = data.draw(st.sampled_from([p for p in self.peers if p.staged]))
        before = p.live.weights
        try:
            applied, error = p.receiver.apply_staged(), None
        except RefitError as e:
            applied, error = False, e
        if error is not None:
            assert p.ready is not None, f"apply_staged() raised with nothing staged: {error}"
            recast = p.handshake_dtypes is not None and p.dtypes() != p.handshake_dtypes
            assert recast, f"apply_staged() of version {p.ready} refused an engine not recast since staging: {error}"
            event("apply_staged: refused")
        elif p.ready is None:
            assert not applied and p.live.weights == before, "apply_staged() with nothing staged changed the engine"
        else:
            assert applied, f"apply_staged() did not apply the staged version {p.ready}"
            p.expected.append(p.ready)
            event("apply_staged: applied" + (" after a recast" if p.dtypes() != p.handshake_dtypes else ""))
            w = p.live.weights
            assert (w.state, w.version) == (State.CURRENT, p.ready), f"after applying {p.ready}: {w}"
            p.ready = None

    # -- trainer side --------------------------------------------------------------------------

    @rule(name=st.sampled_from(NAMES), how=st.sampled_from(["replace", "switch dtype"]))
    def change_trainer_tensor(self, name: str, how: str) -> None:
        """The trainer replaces one tensor by another object of the same spec (column-major where it has two
        dimensions; the source reads it live), or switches it to another dtype (the next refit starts a new
        epoch; a second switch goes back)."""
        old = self.tensors[name]
        if how == "replace":
            self.tensors[name] = old.t().contiguous().t() if old.dim() == 2 else old.clone()
        else:
            self.tensors[name] = old.to(SWITCHED[name] if old.dtype == TRAINER[name][1] else TRAINER[name][1])

    @precondition(lambda self: self._members() or not self.empty_refits)
    @rule()
    def refit(self) -> None:
        """A refit of a new version (with no receiver in the session: once, until one joins)."""
        self._refit(self.next_version)
        self.next_version += 1

    @precondition(
        lambda self: (
            (self._members() or not self.empty_refits)
            and self.failed is not None
            and self.failed[1] == {n: t.dtype for n, t in self.tensors.items()}
        )
    )
    @rule()
    def retry_refit(self) -> None:
        """The failed refit's version again (the trainer's values of a version are the same every time)."""
        assert self.failed is not None
        self._refit(self.failed[0])

    def _refit(self, version: int) -> None:
        assert self.sender is not None
        dtypes = {n: t.dtype for n, t in self.tensors.items()}
        self.empty_refits += not self._members()
        self.mode.vetoed = False
        with torch.no_grad():
            for n, t in self.tensors.items():
                t.copy_(_values(n, version, t.dtype, self.delta))
        record = {n: t.clone(memory_format=torch.contiguous_format) for n, t in self.tensors.items()}
        record = _as_held(record, self.fp8)
        if version in self.sent:
            assert all(torch.equal(_bytes(record[n]), _bytes(self.sent[version][n])) for n in record)
        self.sent[version] = record

        members = self._members()
        specs = self._specs()
        # The sender's manifest, not the model's: a joiner that died before its first refit may be taken into
        # a handshake that then has no one left to refuse it (legal), so only the sender knows it has one.
        handshake = bool(members) and (self.sender.manifest is None or specs != _specs_of(self.sender.manifest))
        refusers = {p for p in members if not self._fits(p, specs)} if handshake else set()
        refused = {p for p in members if p.joiner and not handshake and not self._fits(p, specs)}
        for p in members:
            if not p.pending:
                p.ask("receive")
                p.pending = True
        try:
            stats, error = self.sender.refit(version), None
        except RefitError as e:
            stats, error = None, e
        assert not isinstance(error, PeerError), f"refit {version} broke the elastic session: {error}"
        self.failed = (version, dtypes) if error is not None else None
        if stats is not None and stats.delta:
            event("a delta refit" + (" that moved less than full" if stats.wire_bytes < stats.full_bytes else ""))

        if refusers:  # the handshake fails; the receivers that validated it wait on for the next one
            assert isinstance(error, HandshakeError), (
                f"refit {version}: a handshake {refusers} refuse passed: {error!r}"
            )
            assert _named_ranks(error) == {p.rank for p in refusers}, f"refit {version}: {error}"
            for p in refusers:
                out = p.outcome()
                p.pending = False
                assert isinstance(out, HandshakeError), f"{p!r} at refit {version}: {out!r}"
            for p in members:
                p.joiner = False
            event("refit: a handshake refused")
            return
        assert not isinstance(error, HandshakeError), f"refit {version}: no engine should refuse: {error}"
        for p in members:
            out = p.outcome()
            p.pending = False
            self._took(p, out, version, first=handshake or p.joiner, refused=p in refused)
            p.joiner = False
        survivors = [p for p in members if p.status == "member"]
        if error is None:
            assert stats is not None
            assert stats.receivers == sorted(p.rank for p in survivors), (
                f"refit {version} committed on {stats.receivers}, expected {survivors}"
            )
        if error is None and stats is not None and stats.roots:  # the root the trainer folded is each one's
            for p in survivors:
                assert p.root == stats.roots[p.rank], f"{p!r} proved root {p.root} of {version}, not {stats.roots}"
        if error is None and survivors:
            assert self.sender.manifest is not None
            wire = {p.name: p.spec.dtype for p in self.sender.manifest.entries}
            assert wire == {n: t.dtype for n, t in record.items()}, "the model's wire dtypes are not the manifest's"
        event(f"refit: {'failed' if error else 'committed'} on {len(survivors)} of {len(members)}")
        lossy = [p for p in survivors if not self._fits(p, specs)]
        if lossy:  # an engine recast to a dtype that cannot hold the wire's values refuses the refit (staged too)
            return
        if self.mode.vetoed:
            assert error is not None, f"refit {version}: the other rank failed, but the vote committed it"
            event("refit: vetoed by the other rank")
        elif len(survivors) < MIN_RECEIVERS:
            assert error is not None, (
                f"refit {version} reached {len(survivors)} receiver(s) (departed: {stats.departed if stats else '?'}) "
                f"and returned success; min_receivers={MIN_RECEIVERS} wants RefitError"
            )
        else:
            assert error is None, f"refit {version} to {survivors} must succeed: {error}"

    def _took(self, p: _Peer, out: object, version: int, *, first: bool, refused: bool) -> None:
        """What receiver `p`'s receive of refit `version` ended in, and what that means for the model."""
        if p.fired:
            assert isinstance(out, PeerError), f"{p!r} died mid-refit {version} but reports {out!r}"
            p.status, p.ready = "died", None
            p.pause_outcome()
            event("receiver: died mid-refit")
        elif refused:
            assert isinstance(out, HandshakeError), f"{p!r} joined unable to hold the manifest but: {out!r}"
            p.status = "refused"
            event("receiver: refused at its join")
        elif isinstance(out, RefitStats):
            assert out.version == version, f"{p!r} committed {out.version} during refit {version}"
            p.root = out.root
            if p.staging == "partial":  # the pause ends with the apply, in the engine loop
                applied = p.pause_outcome()
                assert applied is True, f"{p!r} committed {version} but its pause ended in {applied!r}"
                p.expected.append(version)
            elif p.staged:
                p.ready = version
            else:
                p.expected.append(version)
        elif isinstance(out, PeerError) or out is None:
            raise AssertionError(f"{p!r}'s session ended during refit {version}: {out!r}")
        elif isinstance(out, RefitError):
            p.ready = None  # begun and failed: nothing staged
            applied = p.pause_outcome()
            assert applied is None or isinstance(applied, RefitError), f"{p!r}: failed but applied: {applied!r}"
        else:
            raise AssertionError(f"{p!r} raised during refit {version}") from out  # type: ignore[arg-type]
        if first and not refused and not p.fired:
            p.handshake_dtypes = p.dtypes()

    # -- the invariant ---------------------------------------------------------------------------

    @invariant()
    def engines_hold_what_they_say(self) -> None:
        problems = []
        for p in self.peers:
            w = p.live.weights
            assert w.state != State.UPDATING, f"{p!r} reads {w} between refits"
            if p.calls != p.expected or p.calls != p.live.commits:
                problems.append(
                    f"{p!r}: on_commit saw {p.calls}, the live engine committed {p.live.commits}, "
                    f"the model expects {p.expected}"
                )
            if p.staged:
                assert p.receiver.staging is not None
                if p.receiver.staging.ready != p.ready:
                    problems.append(f"{p!r}: staged version {p.receiver.staging.ready}, the model expects {p.ready}")
            if w.state != State.CURRENT:
                continue
            if w.version not in self.sent:
                problems.append(f"{p!r} reads current at version {w.version}, which the trainer never sent")
                continue
            skip = p.taint[1] if p.taint is not None and p.taint[0] == self._live_weights(p) else set()
            for name, want in self.sent[w.version].items():
                if name in skip:
                    continue
                if p.region is not None and name == TP:
                    want = want[p.region * ROWS : (p.region + 1) * ROWS]
                why = _wrong(p.live.module[name], want)  # type: ignore[index]
                if why:
                    problems.append(f"{p!r} reads current at version {w.version} but {name}: {why}")
        assert not problems, "; ".join(problems)

    # -- teardown --------------------------------------------------------------------------------

    def teardown(self) -> None:
        failing = sys.exc_info()[0] is not None  # a step failed: never hide its error behind a leak found here
        if self.sender is not None:
            self.sender.close()  # a receiver waiting in receive() is told CLOSE
        for p in self.peers:
            while p._asked:
                p.outcome()
            p.do("close")
            p.ask("stop")
            p.stop_loop()
        for p in self.peers:
            p.thread.join(WAIT_S)
        if failing:
            return
        alive = [p for p in self.peers if p.thread.is_alive()]
        assert not alive, f"receiver threads still running after close: {alive}"
        left = [t.name for t in threading.enumerate() if t.name.startswith(("refit-heartbeat", "refit-lobby"))]
        assert not left, f"the sender's threads outlived close(): {left}"
        self.peers.clear()
        self.sender = None
        gc.collect()
        fds = _open_fds()
        assert fds <= self.fds, f"descriptors left open by the session: {sorted(fds - self.fds)}"


def _stacks() -> str:
    """Where every thread is now (what a stuck receiver waits on)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    return "\n".join(
        f"--- {names.get(ident, ident)}\n" + "".join(traceback.format_stack(frame))
        for ident, frame in sys._current_frames().items()
    )


def _settings(**kw: object) -> settings:
    return settings(deadline=None, suppress_health_check=[HealthCheck.too_slow], **kw)  # type: ignore[arg-type]


def _run(machine: type[RuleBasedStateMachine], examples: int, steps: int, *, fast: bool) -> None:
    """The machine with a fixed seed: the fast tier stops at its first bug, the slow tier prints each one's blob."""
    more = {"report_multiple_bugs": False} if fast else {"print_blob": True}
    settings = _settings(max_examples=examples, stateful_step_count=steps, derandomize=True, **more)
    run_state_machine_as_test(machine, settings=settings)


def test_refit_sessions_keep_every_current_engine_bitwise_the_trainers_fixed_seed() -> None:
    _run(Sessions, 20, 15, fast=True)


@pytest.mark.slow
def test_refit_sessions_keep_every_current_engine_bitwise_the_trainers() -> None:
    _run(Sessions, 40, 25, fast=False)


# -- the stages: LoRA adapter slots, the canary, FP8 with non-finite values ------------------------------------
#
# A second machine, one trainer and one engine per example, for the stages that change what an engine serves
# beside its weights: LoRA (a refit writes one of K adapter slots; requests pin the slot they started on),
# the canary (the engine scores a probe before the version commits: it passes, fails, or COMMIT carries a
# malformed number), FP8 (a non-finite value in a quantized tensor, in whichever bucket), and zero-copy over
# nixl on CPU (the engine READs the trainer's live tensors), where nixl imports. Versions are
# drawn new, repeated (after the trainer's values changed: a retry, a constant version) or older than the
# last; the fingerprint is on or off. Invariant: an engine that reads current at v serves exactly the trainer's
# state of its last committed refit of v (for LoRA: the slot a new request gets, and every pinned slot still
# what it held when its request pinned it); a refit that must fail fails alone, the session alive.


def _nixl() -> bool:
    from refit.tools.doctor import nixl_installed

    return nixl_installed()


STAGES = ["lora", "canary", "fp8"] + (["nixl"] if _nixl() else [])
"""nixl: zero-copy (the engine READs the trainer's live tensors one-sided), on CPU, where nixl imports."""
STAGE_SETTINGS = Settings(bucket_bytes=4096, timeout_s=TIMEOUT_S)
PROBE = [1, 5, 3, 9, 2, 7, 4]
KEEP = st.sampled_from([2, 3])
MALFORMED = {
    "log-probability beyond a double": lambda p: {**p, "logprobs": [-(10**400), *p["logprobs"][1:]]},
    "tolerance beyond a double": lambda p: {**p, "tolerance": 10**400},
    "positive log-probability": lambda p: {**p, "logprobs": [5.0, *p["logprobs"][1:]]},
    "a string for a number": lambda p: {**p, "logprobs": ["-1", *p["logprobs"][1:]]},
    "token id out of range": lambda p: {**p, "tokens": [-1, *p["tokens"][1:]]},
}
"""Canary payloads the trainer never makes (its own are checked): what COMMIT may carry from a broken peer."""


class _LM(torch.nn.Module):
    """A causal LM to score the canary's probe: token ids to logits."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids))


class _Tiny(torch.nn.Module):
    """The base a LoRA adapter trains over (the same on both sides: seeded)."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.fc1, self.fc2 = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fc1(x))


def _peft_model() -> torch.nn.Module:
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["fc1", "fc2"], lora_dropout=0.0)
    return peft.get_peft_model(_Tiny(), config).eval()


def _fill(tensors: dict[str, torch.Tensor], seed: int) -> None:
    """The trainer's step: new values in every tensor, in place (the source reads them live)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n in sorted(tensors):
            t = tensors[n]
            t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    """The names whose bytes differ (or that are missing)."""
    return [n for n, w in want.items() if n not in got or not torch.equal(_bytes(got[n].detach()), _bytes(w))]


class StageSessions(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.stack = contextlib.ExitStack()
        self.served: dict[int, dict[str, torch.Tensor]] = {}
        """Per version: the trainer's state at its last committed refit of that version, as the engine holds it."""
        self.pins: list[tuple[contextlib.AbstractContextManager, str, dict[str, torch.Tensor]]] = []
        self.attempts = 0
        self.top = 0
        self.last: int | None = None
        self.stale = False
        """canary: the engine computes with something else than what it loaded (its probe scores differ)."""

    @initialize(kind=st.sampled_from(STAGES), verify=st.sampled_from([None, "fingerprint"]), keep=KEEP)
    def start(self, kind: str, verify: str | None, keep: int) -> None:
        self.kind = kind
        event(f"stage={kind} verify={verify}")
        options: dict[str, object] = {"verify": verify}
        if kind == "lora":
            from refit.stages.lora import AdapterTensors, LoraEngine, LoraSource

            trainer = _peft_model()
            self.tensors = dict(AdapterTensors(trainer, "default"))
            source: object = LoraSource(trainer)
            self.engine: object = LoraEngine(_peft_model(), keep=keep)
        elif kind == "canary":
            from refit import Canary, causal_lm

            trainer, held = _LM(), _LM()
            self.tensors = dict(trainer.named_parameters())
            source = ModuleSource(trainer)
            score = causal_lm(held)
            self.engine = ModuleEngine(held, probe=lambda ids: score(ids) * (2.0 if self.stale else 1.0))
            options["canary"] = Canary(PROBE, causal_lm(trainer), every=1)
        else:
            g = torch.Generator().manual_seed(3)
            self.tensors = {"a.weight": torch.randn(32, 40, generator=g), Q8: torch.randn(TRAINER[Q8][0], generator=g)}
            if kind == "nixl":
                self.tensors = {**self.tensors, "b.weight": torch.randn(48, 16, generator=g).to(BF16)}
                options.update(transport="nixl", zero_copy=True)
            source = ModuleSource(self.tensors)
            held = {n: torch.zeros_like(t) for n, t in self.tensors.items()}
            self.engine = ModuleEngine(_as_held(held, kind == "fp8"))
        from threaded import Peer

        self.sender = Sender(source, settings=STAGE_SETTINGS, **{"transport": "shm", **options})  # type: ignore[arg-type]
        self.peer = Peer(Receiver(self.engine, self.sender.rendezvous(), settings=STAGE_SETTINGS))  # type: ignore[arg-type]
        self.stack.callback(self.peer.stop)
        self.stack.callback(self.sender.close)  # first: a receiver waiting in receive() is told CLOSE
        self.peer.ask("connect")

    # -- what the engine serves

    def _served_now(self) -> dict[str, torch.Tensor]:
        """What a new request computes with: the adapter slot it gets (LoRA), else the engine's tensors."""
        if self.kind == "lora":
            from refit.stages.lora import AdapterTensors

            with self.engine.adapter() as name:  # type: ignore[attr-defined]
                return {n: t.detach().clone() for n, t in AdapterTensors(self.engine.model, name).items()}  # type: ignore[attr-defined]
        module = self.engine.module  # type: ignore[attr-defined]
        items = module.named_parameters() if isinstance(module, torch.nn.Module) else module.items()
        return {n: t.detach().clone() for n, t in items}

    def _record(self) -> dict[str, torch.Tensor]:
        record = {n: t.detach().clone() for n, t in self.tensors.items()}
        return _as_held(record, True) if self.kind == "fp8" else record

    def _free_slots(self) -> int:
        """LoRA: slots a refit may write (neither the one new requests get nor one a request pinned)."""
        current = None
        if self.engine.weights.version is not None:  # type: ignore[attr-defined]  # failed too: its slot stays
            with self.engine.adapter() as current:  # type: ignore[attr-defined]
                pass
        busy = {current, *(name for _, name, _ in self.pins)}
        return sum(s.name not in busy for s in self.engine.slots)  # type: ignore[attr-defined]

    # -- refits

    @rule()
    def refit_new(self) -> None:
        self._refit(self.top + 1)

    @precondition(lambda self: self.last is not None)
    @rule()
    def refit_again(self) -> None:
        """The last version again, after the trainer's values changed (a retry, a constant version)."""
        assert self.last is not None
        self._refit(self.last)

    @precondition(lambda self: self.top > 1)
    @rule(data=st.data())
    def refit_older(self, data: st.DataObject) -> None:
        self._refit(data.draw(st.integers(1, self.top - 1), label="older version"))

    @precondition(lambda self: self.kind == "canary")
    @rule(stale=st.booleans())
    def engine_computes(self, stale: bool) -> None:
        """The engine computes with what it loaded, or with something else (a derived tensor left stale)."""
        self.stale = stale

    @precondition(lambda self: self.kind == "canary")
    @rule(how=st.sampled_from(sorted(MALFORMED)))
    def refit_with_a_malformed_canary(self, how: str) -> None:
        """COMMIT carries a canary number the engine must refuse: the refit fails, the session goes on."""
        handler = next(h for h in self.sender.handlers if h.name == "canary")  # what COMMIT carries for it
        real = handler.due

        def broken(ranks: frozenset[int]) -> object | None:
            got = real(ranks)
            return None if got is None else MALFORMED[how](got)

        handler.due = broken  # type: ignore[method-assign]
        try:
            self._refit(self.top + 1, fails=f"a malformed canary ({how})")
        finally:
            del handler.due

    @precondition(lambda self: self.kind == "fp8")
    @rule(data=st.data(), name=st.sampled_from(["a.weight", Q8]), value=st.sampled_from([math.nan, math.inf]))
    def refit_with_a_non_finite_value(self, data: st.DataObject, name: str, value: float) -> None:
        """A non-finite value anywhere in one tensor: an FP8-quantized one fails the refit (nothing moved, the
        session alive); a tensor sent as it is moves it bit for bit."""
        at = data.draw(st.integers(0, self.tensors[name].numel() - 1), label="position")
        self._refit(
            self.top + 1, poison=(name, at, value), fails="a non-finite value to quantize" if name == Q8 else ""
        )

    def _refit(self, version: int, *, poison: tuple | None = None, fails: str = "") -> None:
        self.attempts += 1
        _fill(self.tensors, 1000 * version + self.attempts)
        if poison is not None:
            name, at, value = poison
            with torch.no_grad():
                self.tensors[name].view(-1)[at] = value
        record = self._record() if not fails else None
        if self.kind == "lora" and self._free_slots() == 0:
            fails = "every adapter slot in use"
        if self.kind == "canary" and self.stale and not fails:
            fails = "the engine computes something else (the canary)"
        before = self.engine.weights  # type: ignore[attr-defined]
        from threaded import refit_both

        sent, got = refit_both(self.sender, self.peer, version)
        event(f"{self.kind}: " + (f"fails ({fails})" if fails else "commits"))
        assert not isinstance(sent, PeerError) and not isinstance(got, PeerError), (
            f"refit {version} ({fails or 'must commit'}) ended the session: {sent!r} / {got!r}"
        )
        if not fails:
            assert isinstance(sent, RefitStats) and isinstance(got, RefitStats), f"refit {version}: {sent!r} / {got!r}"
            assert record is not None
            self.served[version] = record
        else:
            assert isinstance(sent, RefitError) and isinstance(got, RefitError), (
                f"refit {version} with {fails} must fail on both sides: {sent!r} / {got!r}"
            )
            if self.kind == "lora" and before.state == State.CURRENT:  # refused before any byte: nothing changed
                w = self.engine.weights  # type: ignore[attr-defined]
                assert (w.state, w.version) == (State.CURRENT, before.version), f"refused, the engine reads {w}"
        self.top, self.last = max(self.top, version), version

    # -- requests pinning adapter slots

    @precondition(
        lambda self: self.kind == "lora" and self.engine.weights.state == State.CURRENT and len(self.pins) < 3
    )
    @rule()
    def pin(self) -> None:
        """A request starts on the version new requests get now, and keeps it until it finishes."""
        from refit.stages.lora import AdapterTensors

        request = self.engine.adapter()  # type: ignore[attr-defined]
        name = request.__enter__()
        held = {n: t.detach().clone() for n, t in AdapterTensors(self.engine.model, name).items()}  # type: ignore[attr-defined]
        self.pins.append((request, name, held))

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        request, _, _ = self.pins.pop(data.draw(st.integers(0, len(self.pins) - 1), label="request"))
        request.__exit__(None, None, None)

    # -- the invariant

    @invariant()
    def a_current_engine_serves_the_trainers_state_of_its_version(self) -> None:
        if not hasattr(self, "engine"):
            return
        w = self.engine.weights  # type: ignore[attr-defined]
        assert w.state != State.UPDATING, f"the engine reads {w} between refits"
        if w.state == State.CURRENT and w.version in self.served:
            wrong = _same(self._served_now(), self.served[w.version])
            assert not wrong, f"the engine reads current at {w.version} but serves other bytes for {wrong}"
        if self.kind == "lora":
            from refit.stages.lora import AdapterTensors

            for _, name, held in self.pins:
                live = dict(AdapterTensors(self.engine.model, name))  # type: ignore[attr-defined]
                assert not _same(live, held), f"a refit wrote adapter slot {name!r} while a request used it"

    def teardown(self) -> None:
        while self.pins:
            self.pins.pop()[0].__exit__(None, None, None)
        self.stack.close()


def test_stage_sessions_serve_the_trainers_state_at_every_current_version_fixed_seed() -> None:
    _run(StageSessions, 5, 8, fast=True)


@pytest.mark.slow
def test_stage_sessions_serve_the_trainers_state_at_every_current_version() -> None:
    _run(StageSessions, 40, 20, fast=False)
