"""nixl transport: receivers READ each bucket one-sided from the sender's registered buffers (NVIDIA NIXL, UCX).

The sender registers its bucket buffers once per transport (an epoch's session) and puts its agent's
metadata (only these buffers, plus how to connect) and their descriptors in `offer`'s info, which reaches
each receiver inside the authenticated WELCOME. A receiver adds the sender as a remote agent, registers its
own buffers and, for every bucket header, READs the announced range into its slot. `send` moves nothing:
the BUCKET header says a slot is packed, and the sender reuses a slot only after every receiver's ACK.

Per process, one agent per role and backend, made at first use and kept for every later session: a
serving agent (sender side) runs NIXL's progress thread, which a one-sided READ needs on the target side
(UCX answers reads through the target's worker); a reading agent runs none: its polls of the transfer
state make its progress, so an engine process pays no idle thread. Memory is registered per transport and
deregistered at its close; `counts()` says how often, for the tests.
"""

from __future__ import annotations

import base64
import binascii
import importlib
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from refit.errors import PeerError
from refit.log import get_logger
from refit.settings import Settings
from refit.transports.base import DONE, INTERRUPT_EVERY_S, Interrupted, Pending, Transport

BACKEND = "UCX"
SERVING, READING = "serving", "reading"
MAX_POLL_SLEEP_S = {"DRAM": 0.001, "VRAM": 0.00005}
"""Longest pause between two looks at a READ in flight (each look also makes the reading agent's progress):
a VRAM READ of a 1 GiB bucket on one H200 takes about 0.5 ms, which a 1 ms pause would double."""

log = get_logger("nixl")

MODULES = ("nixl_cu12", "nixl_cu13", "nixl")
"""The wheels' import names, in the order tried: nixl-cu12, nixl-cu13 (its UCX needs libcudart.so.13), nixl."""


def _nixl() -> Any:
    for name in MODULES:
        try:
            nixl = importlib.import_module(name)
        except ImportError:
            continue
        _off_stdout()
        return nixl
    raise ValueError(
        "transport 'nixl' needs NVIDIA NIXL, which is not installed; pip install -e '.[nixl]' from the refit "
        "checkout (nixl-cu12), or pip install nixl-cu13 (CUDA 13)"
    )


def _off_stdout() -> None:
    """NIXL's Python logger writes to stdout, which tools and launchers parse; its lines go to stderr instead."""
    for handler in logging.getLogger("nixl").handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
            handler.setStream(sys.stderr)


@dataclass(slots=True)
class _Counts:
    agents: int = 0
    registered: int = 0
    deregistered: int = 0


class Agent:
    """One NIXL agent of this process, shared by every transport of its role; thread-safe."""

    def __init__(self, role: str, backend: str) -> None:
        nixl = _nixl()
        sync = nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT  # mesh pairs use one agent from several threads
        config = nixl.nixl_agent_config(enable_prog_thread=role == SERVING, backends=[], sync_mode=sync)
        self.name = f"refit-{role}-{socket.gethostname()}-{os.getpid()}-{os.urandom(4).hex()}"
        try:
            self.nixl = nixl.nixl_agent(self.name, config)
            if torch.cuda.is_available():  # elsewhere UCX has no CUDA module and warns, on stdout, of the variable
                _ucx_defaults()
            if backend in self.nixl.get_plugin_list():
                self.nixl.create_backend(backend, backend_params(backend))
        except Exception as e:  # noqa: BLE001 - NIXL raises its own error types; the cause is kept
            raise PeerError(f"NIXL agent with backend {backend} could not start: {type(e).__name__}: {e}") from None
        if backend not in self.nixl.backends:
            raise PeerError(
                f"NIXL has no {backend} backend here (plugins: {', '.join(self.nixl.get_plugin_list())}); "
                "install the nixl wheel that ships it, or check NIXL_PLUGIN_DIR"
            )
        self.lock = threading.Lock()
        self._remotes: dict[str, int] = {}

    def register(self, buffers: list[torch.Tensor]) -> Any:
        with self.lock:
            handle = self.nixl.register_memory(buffers)
            _COUNTS.registered += 1
        return handle

    def deregister(self, handle: Any) -> None:
        with self.lock:
            self.nixl.deregister_memory(handle)
            _COUNTS.deregistered += 1

    def metadata(self, handle: Any) -> bytes:
        """This agent's metadata for the buffers of `handle` only (and how to connect), not for other sessions'."""
        with self.lock:
            return bytes(self.nixl.get_partial_agent_metadata(handle, inc_conn_info=True))

    def attach(self, metadata: bytes) -> str:
        """Load a remote agent's metadata (again, when it announced more buffers); its name, counted per user."""
        with self.lock:
            raw = self.nixl.add_remote_agent(metadata)
            name = raw.decode() if isinstance(raw, bytes) else str(raw)
            self._remotes[name] = self._remotes.get(name, 0) + 1
        return name

    def detach(self, name: str) -> None:
        """Forget the remote agent `name` once its last user is gone (which disconnects from it)."""
        with self.lock:
            left = self._remotes.get(name, 0) - 1
            if left > 0:
                self._remotes[name] = left
                return
            self._remotes.pop(name, None)
            try:
                self.nixl.remove_remote_agent(name)
            except Exception as e:  # noqa: BLE001 - a peer that died is already gone; nothing to undo
                log.debug("removing remote agent %s: %s", name, e)


UCX_DEFAULTS = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "on"}
"""Set before the first agent unless the environment says otherwise. UCX turns cuda_ipc's GET off where it
sees no NVLink, which leaves a READ between two processes on one GPU to a copy through host memory: 0.8 GB/s
against 1950 GB/s on an H200 (BENCHMARKS.md, 2026-12-04)."""


def _ucx_defaults() -> None:
    for key, value in UCX_DEFAULTS.items():
        if key not in os.environ:
            os.environ[key] = value
            log.info("nixl: %s=%s (set it in the environment to choose otherwise)", key, value)


def backend_params(backend: str) -> dict[str, str]:
    """UCX without its peer-failure mode unless REFIT_NIXL_ERROR_MODE=peer (see docs/SCALING.md)."""
    if backend != "UCX":
        return {}
    mode = os.environ.get("REFIT_NIXL_ERROR_MODE", "none")
    if mode not in ("none", "peer"):
        raise ValueError(f"REFIT_NIXL_ERROR_MODE must be 'none' or 'peer', got {mode!r}")
    return {"ucx_error_handling_mode": mode}


_AGENTS: dict[tuple[str, str], Agent] = {}
_AGENTS_LOCK = threading.Lock()
_COUNTS = _Counts()


def agent(role: str, backend: str = BACKEND) -> Agent:
    """This process's agent for `role` (SERVING or READING) and `backend`, made at the first call."""
    with _AGENTS_LOCK:
        found = _AGENTS.get((role, backend))
        if found is None:
            found = _AGENTS[(role, backend)] = Agent(role, backend)
            _COUNTS.agents += 1
            log.debug("NIXL agent %s started", found.name)
        return found


def counts() -> dict[str, int]:
    """Agents made, memory registrations and deregistrations in this process so far."""
    return {"agents": _COUNTS.agents, "registered": _COUNTS.registered, "deregistered": _COUNTS.deregistered}


def _buffers(capacity: int, num_slots: int, device: torch.device) -> list[torch.Tensor]:
    # zeros: every page touched now, so no refit pays the first-use page faults (and registration pins them)
    buffers = [torch.zeros(capacity, dtype=torch.uint8, device=device) for _ in range(num_slots)]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return buffers


def _mem(device: torch.device) -> tuple[str, int]:
    """NIXL's memory type and device id for buffers on `device`."""
    if device.type == "cuda":
        return "VRAM", device.index if device.index is not None else torch.cuda.current_device()
    if device.type != "cpu":
        raise ValueError(f"transport 'nixl' keeps its buffers on cpu or cuda, not {device}")
    return "DRAM", 0


class NixlTransport(Transport):
    """Sender: registered buffers that receivers READ. Receiver: its own registered buffers it READs into."""

    name = "nixl"
    device_type = "cpu"
    """DRAM by default; pass device=cuda to Sender and Receiver for VRAM (same code, NIXL's VRAM type)."""

    def __init__(self, agent: Agent, buffers: list[torch.Tensor], handle: Any, remote: _Remote | None) -> None:
        self.buffers = buffers
        self._agent = agent
        self._handle = handle
        self._remote = remote
        self._mem = _mem(buffers[0].device)[0] if buffers else "DRAM"
        self._inflight: list[_Read] = []

    @classmethod
    def offer(
        cls, *, capacity: int, num_slots: int, num_receivers: int, device: torch.device, settings: Settings
    ) -> tuple[Transport, dict]:
        mem, dev = _mem(device)
        serving = agent(SERVING)
        buffers = _buffers(capacity, num_slots, device)
        handle = serving.register(buffers)
        try:
            metadata = serving.metadata(handle)
        except BaseException:
            serving.deregister(handle)
            raise
        info = {
            "capacity": capacity,
            "agent": serving.name,
            "metadata": base64.b64encode(metadata).decode(),
            "mem": mem,
            "buffers": [[b.data_ptr(), capacity, dev] for b in buffers],
        }
        return cls(serving, buffers, handle, None), info

    @classmethod
    def join(cls, info: dict, *, rank: int, device: torch.device, settings: Settings) -> Transport:
        remote = _Remote.parse(info)
        reading = agent(READING)
        buffers = _buffers(remote.capacity, len(remote.buffers), device)
        handle = reading.register(buffers)
        try:
            name = reading.attach(remote.metadata)
        except Exception as e:  # noqa: BLE001 - NIXL's own error types; reported as the peer's with the cause
            reading.deregister(handle)
            raise PeerError(f"cannot add the sender's NIXL agent {remote.agent}: {type(e).__name__}: {e}") from None
        if name != remote.agent:
            reading.detach(name)
            reading.deregister(handle)
            raise PeerError(f"the sender's NIXL metadata names agent {name!r}, its setup {remote.agent!r}")
        return cls(reading, buffers, handle, remote)

    def before_send(self, slot: int) -> None:
        if self.buffers[slot].is_cuda:  # packing ran on a stream: the bytes must be there before a peer reads
            torch.cuda.current_stream(self.buffers[slot].device).synchronize()

    def send(self, slot: int, nbytes: int) -> Pending:
        return DONE  # the receivers read; their ACKs (awaited before the slot is packed again) say they did

    def recv(self, slot: int, nbytes: int) -> Pending:
        remote = self._remote
        if remote is None:
            raise RuntimeError("recv on the sending side of a nixl transport")
        addr, length, dev = remote.range(slot, nbytes)
        if nbytes == 0:
            return DONE
        local = self.buffers[slot][:nbytes]
        nixl = self._agent.nixl
        try:
            with self._agent.lock:
                handle = nixl.initialize_xfer(
                    "READ",
                    nixl.get_xfer_descs(local),
                    nixl.get_xfer_descs([(addr, nbytes, dev)], remote.mem),
                    remote.agent,
                )
                state = nixl.transfer(handle)
        except Exception as e:  # noqa: BLE001 - NIXL's own error types (a disconnected peer among them)
            raise PeerError(f"NIXL READ of slot {slot} ({nbytes} B) from {remote.agent} failed: {e}") from None
        what = f"NIXL READ of slot {slot} ({nbytes} B) from {remote.agent}"
        read = _Read(self._agent, handle, state, what, MAX_POLL_SLEEP_S[self._mem])
        self._inflight = [r for r in self._inflight if not r.finished]
        self._inflight.append(read)
        return read

    def release(self, slot: int) -> None:
        if self.buffers[slot].is_cuda:
            torch.cuda.current_stream(self.buffers[slot].device).synchronize()

    def flush(self) -> None:
        if self.buffers and self.buffers[0].is_cuda:
            torch.cuda.current_stream(self.buffers[0].device).synchronize()

    def close(self) -> None:
        for read in self._inflight:
            read.drop()
        self._inflight = []
        if self._remote is not None:
            self._agent.detach(self._remote.agent)
            self._remote = None
        if self._handle is not None:
            handle, self._handle = self._handle, None
            try:
                self._agent.deregister(handle)
            except Exception as e:  # noqa: BLE001 - at teardown: logged, the rest still released
                log.warning("deregistering the nixl buffers failed: %s", e)
        self.buffers = []


@dataclass(frozen=True, slots=True)
class _Remote:
    """What the sender announced: its agent, and one (address, length, device) per slot."""

    agent: str
    metadata: bytes
    mem: str
    capacity: int
    buffers: list[tuple[int, int, int]]

    @classmethod
    def parse(cls, info: dict) -> _Remote:
        agent, meta, mem, capacity, bufs = (info.get(k) for k in ("agent", "metadata", "mem", "capacity", "buffers"))
        ok = (
            isinstance(agent, str)
            and isinstance(meta, str)
            and mem in ("DRAM", "VRAM")
            and _count(capacity)
            and isinstance(bufs, list)
            and 0 < len(bufs) <= 64
            and all(isinstance(b, list) and len(b) == 3 and all(map(_count, b)) for b in bufs)
        )
        if not ok:
            raise PeerError(f"nixl setup info is malformed: {info!r:.200}")
        if any(b[1] != capacity for b in bufs):
            raise PeerError(f"nixl setup announces buffers of other sizes than its capacity {capacity}")
        try:
            metadata = base64.b64decode(meta, validate=True)
        except (binascii.Error, ValueError):
            raise PeerError("nixl setup info carries metadata that is not base64") from None
        return cls(agent, metadata, mem, capacity, [(b[0], b[1], b[2]) for b in bufs])

    def range(self, slot: int, nbytes: int) -> tuple[int, int, int]:
        """Slot `slot`'s announced (address, length, device), once [0, nbytes) lies within it."""
        if not 0 <= slot < len(self.buffers):
            raise ValueError(f"nixl: slot {slot} was not announced (the sender announced {len(self.buffers)} slots)")
        addr, length, dev = self.buffers[slot]
        if not 0 <= nbytes <= length:
            raise ValueError(
                f"nixl: a READ of {nbytes} B from slot {slot} lies outside the {length} B the sender announced; "
                "the manifest and the transport setup disagree"
            )
        return addr, length, dev


def _count(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 64


class _Read(Pending):
    """A READ in flight, polled (each poll makes the reading agent's progress) until done, failed or timed out."""

    def __init__(self, agent: Agent, handle: Any, state: str, what: str, max_pause_s: float) -> None:
        self._agent, self._handle, self._state, self._what = agent, handle, state, what
        self._max_pause_s = max_pause_s
        self.finished = False

    def wait(self, timeout_s: float, interrupted: Callable[[], bool] | None = None) -> None:
        deadline = time.monotonic() + timeout_s
        asked = time.monotonic()
        pause = 1e-5
        try:
            while True:
                if self._state == "DONE":
                    return
                if self._state != "PROC":
                    raise PeerError(f"{self._what} failed (NIXL state {self._state}); did the sender exit?")
                now = time.monotonic()
                if now >= deadline:
                    raise PeerError(f"{self._what} did not finish in {timeout_s:g} s; is REFIT_TIMEOUT too short?")
                if interrupted is not None and now - asked >= INTERRUPT_EVERY_S:
                    asked = now
                    if interrupted():
                        raise Interrupted(f"{self._what} was interrupted")
                time.sleep(pause)
                pause = min(2 * pause, self._max_pause_s)
                self._state = self._poll()
        finally:
            self.drop()

    def _poll(self) -> str:
        try:
            with self._agent.lock:
                return str(self._agent.nixl.check_xfer_state(self._handle))
        except Exception as e:  # noqa: BLE001 - NIXL's own error types (a disconnected peer among them)
            return f"ERR ({type(e).__name__}: {e})"

    def drop(self) -> None:
        """Release the transfer handle (NIXL cancels a READ still in flight); safe to call twice."""
        if self.finished:
            return
        self.finished = True
        try:
            with self._agent.lock:
                self._handle.release()
        except Exception as e:  # noqa: BLE001 - a READ NIXL cannot cancel; its handle leaks, nothing else
            log.debug("releasing %s: %s", self._what, e)
