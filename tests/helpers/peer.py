"""A test engine process: a state-dict engine behind a Receiver, reporting JSON lines on stdout.

Run as `python tests/helpers/peer.py '<json>'`; used by the protocol tests so that every test crosses a real
process boundary without pickle.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import torch
import warm

from refit import ModuleEngine, PeerError, Receiver, RefitError, Settings
from refit.checks.fingerprints import fingerprints
from refit.dtypes import dtype_from_name

MARK = "@@peer "


def make_tensors(specs: list[list], seed: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Deterministic tensors for [name, shape, dtype] specs."""
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(shape, generator=g).to(device=device, dtype=dtype_from_name(d)) for n, shape, d in specs}


class RecordingEngine(ModuleEngine):
    """A ModuleEngine that records the order of begin/load/commit calls, and can inject one fault:
    {"kind": "die" | "slow" | "raise" | "commit" | "corrupt", "version": v, "at_load": k, "seconds": s}.
    "corrupt" changes one element of the tensor named "name" after its load, as a buggy engine would.
    With `shard` {"name", "dim", "start", "stop"} it holds only that slice of one tensor (tensor parallel).
    Without either, a one-sided READ may fill its tensors in place (`writable`): its load copies as ModuleEngine's."""

    def __init__(self, tensors: dict[str, torch.Tensor], fault: dict | None = None, shard: dict | None = None) -> None:
        self.shard = shard or {}
        if self.shard:
            full = tensors[self.shard["name"]]
            self.full_shape = list(full.shape)
            tensors = {**tensors, self.shard["name"]: self._cut(full).clone()}
        super().__init__(tensors)
        self.events: list[str] = []
        self.fault = fault or {}
        self._version = 0

    def _cut(self, t: torch.Tensor) -> torch.Tensor:
        s = self.shard
        return t.narrow(s["dim"], s["start"], s["stop"] - s["start"])

    def specs(self) -> list:
        from refit.layout.spec import TensorSpec

        specs = super().specs()
        if self.shard:  # the engine expects the global shape; it keeps only its slice
            specs = [
                TensorSpec(x.name, tuple(self.full_shape), x.dtype) if x.name == self.shard["name"] else x
                for x in specs
            ]
        return specs

    def held(self, name: str):
        got = super().held(name)
        if got is not None and self.shard and name == self.shard["name"]:
            s = self.shard
            return got[0], (s["dim"], s["start"], s["stop"])
        return got

    def writable(self, name: str) -> torch.Tensor | None:
        if self.shard or self.fault:
            return None
        got = ModuleEngine.held(self, name)
        return None if got is None else got[0]

    def begin(self, version: int) -> None:
        self.events.append(f"begin {version}")
        self._version = version
        super().begin(version)

    def load(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        self.events.append("load " + ",".join(n for n, _ in tensors))
        f = self.fault
        loads = sum(e.startswith("load") for e in self.events)
        if f and f["version"] == self._version and f.get("at_load") == loads:
            if f["kind"] == "die":
                os._exit(9)
            if f["kind"] == "slow":
                time.sleep(f["seconds"])  # the fault under test, not synchronisation
            if f["kind"] == "raise":
                raise RuntimeError("injected engine failure")
        if self.shard:
            tensors = [(n, self._cut(t) if n == self.shard["name"] else t) for n, t in tensors]
        super().load(tensors)
        if f.get("kind") == "corrupt" and f["version"] == self._version and f["name"] in dict(tensors):
            self.tensor(f["name"]).view(-1)[0] += 1
            self.fault = {}

    def commit(self, version: int) -> None:
        self.events.append(f"commit {version}")
        if self.fault.get("kind") == "commit" and self.fault["version"] == version:
            self.fault = {}
            raise RuntimeError("injected commit failure")
        super().commit(version)


def _report(engine: RecordingEngine, receiver: Receiver, **extra: object) -> dict:
    m = receiver.manifest
    wire = {n: m.entry(n).spec.dtype for n in m.names} if m else {}
    own = {n: t.dtype for n, t in engine.module.items()}
    fps = fingerprints(engine.module.items(), {**own, **wire}, held=True)
    w = engine.weights
    opened = (
        sys.modules["refit.transports.cuda_ipc"].handles_opened() if "refit.transports.cuda_ipc" in sys.modules else 0
    )
    nixl = sys.modules.get("refit.transports.nixl")
    return {
        "state": w.state.value,
        "version": w.version,
        "target": w.target,
        "fingerprints": fps,
        "events": engine.events,
        "handles_opened": opened,
        "nixl": nixl.counts() if nixl is not None else {},
        "strides": {n: list(t.stride()) for n, t in engine.module.items()},
        **extra,
    }


def _rss_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def main() -> int:
    args = json.loads(sys.argv[1])
    device = args.get("device", "cpu")
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    tensors = make_tensors(args["specs"], args.get("seed", 99), device)
    for name in args.get("strided", []):  # the same values and shape, laid out transposed: not contiguous
        tensors[name] = tensors[name].t().contiguous().t()
    engine = RecordingEngine(tensors, args.get("fault"), args.get("shard"))
    settings = Settings(bucket_bytes=args.get("bucket_bytes"), timeout_s=args.get("timeout_s", 60.0))
    rendezvous = {**args["rendezvous"], **args.get("override", {})}
    started = time.monotonic()  # after the imports: a report's "seconds" never counts the process start
    with Receiver(engine, rendezvous, settings=settings, device=torch.device(device)) as receiver:
        while True:
            try:
                stats = receiver.receive()
            except RefitError as e:
                print(
                    MARK
                    + json.dumps(
                        _report(
                            engine,
                            receiver,
                            event="error",
                            type=type(e).__name__,
                            message=str(e),
                            seconds=time.monotonic() - started,
                        )
                    ),
                    flush=True,
                )
                if isinstance(e, PeerError):
                    return 3
                continue
            if stats is None:
                return 0
            print(
                MARK
                + json.dumps(
                    _report(
                        engine,
                        receiver,
                        event="refit",
                        stats=stats.to_json(),
                        rss_kb=_rss_kb(),
                        fds=len(os.listdir("/proc/self/fd")),
                    )
                ),
                flush=True,
            )
            engine.events = []


class Peer:
    """Starts `SCRIPT` (peer.py; a subclass names its own) as a child process and reads its reports."""

    SCRIPT = __file__
    WARM = True
    """Started from the warm-start server (tests/helpers/warm.py); False: a fresh interpreter."""

    def __init__(self, args: dict) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), *sys.path])}
        start = warm.popen if self.WARM else subprocess.Popen
        self.proc = start([sys.executable, self.SCRIPT, json.dumps(args)], stdout=subprocess.PIPE, text=True, env=env)

    def report(self) -> dict:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK) :])
        raise AssertionError(f"{os.path.basename(self.SCRIPT)} exited with {self.proc.wait()} before reporting")

    def wait(self, timeout: float = 60) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise


if __name__ == "__main__":
    raise SystemExit(main())
