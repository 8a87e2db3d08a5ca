"""What every bench method runs on: its result, the receiver processes, timing, a session, memory handed back."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

import torch

import refit
from refit.dtypes import dtype_name
from refit.layout.spec import TensorSpec
from refit.settings import Settings
from refit.sources.module import ModuleSource
from refit.tools.bench.config import BenchConfig
from refit.tools.bench.link import A_ADDR, B_ADDR, Link
from refit.tools.bench.worker import MARK
from refit.tools.children import module_command
from refit.topology.sender import Sender


@dataclass(slots=True)
class Result:
    method: str
    nbytes: int
    times: list[float]
    stages: dict[str, float] = field(default_factory=dict)
    memory: dict[str, int | None] = field(default_factory=dict)
    floors: dict[str, float] = field(default_factory=dict)
    """Probes only: median seconds of a flat copy and a flat read of the same bytes on the same device."""
    wire_bytes: int | None = None
    """Bytes the method put on the data plane over all its transfers, warmup included (where it knows)."""
    link_bytes: int | None = None
    """Across a namespaced link: bytes the sender's veth sent while the method ran (headers and control too)."""
    site_bytes: list[int] | None = None
    """In a fleet: bytes each site's veth took in while the method ran."""
    delta_refits: int | None = None
    """Stepped refits: how many of the timed ones went as a delta."""

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    def summary(self, floor: float | None) -> dict:
        med = self.median
        return {
            **asdict(self),
            "median_s": med,
            "min_s": min(self.times),
            "max_s": max(self.times),
            "gbps": self.nbytes / med / 1e9,
            "ratio_to_floor": med / floor if floor else None,
            **{f"ratio_to_{k}": med / v for k, v in self.floors.items()},
        }


def _placed(command: list[str], link: Link | None, r: int, n: int) -> tuple[list[str], dict[str, str]]:
    """Worker `r` of `n`: its command and environment. Across two hosts, in namespace b; in a fleet of S sites,
    in site r * S // n (n / S replicas each, contiguous), listening on the site's address and stating it."""
    if link is None:
        return command, {}
    if not link.sites:
        return link.command("b", command), {"REFIT_HOST": B_ADDR}
    k = r * link.sites // n
    return link.command(k, command), {"REFIT_HOST": link.site_addr(k), "REFIT_SITE": f"site-{k}"}


class Workers:
    """Receiver processes, one per engine rank, fed jobs as JSON lines."""

    def __init__(self, spec_list: list[TensorSpec], devices: list[str], link: Link | None = None) -> None:
        """With `link`: each in the link's namespace b, listening on its address there."""
        env = {**os.environ, "PYTHONPATH": pythonpath()}
        command = module_command("refit.tools.bench.worker")
        payload = [[s.name, list(s.shape), dtype_name(s.dtype)] for s in spec_list]
        self.procs = [
            subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**env, **extra})
            for argv, extra in (_placed(command, link, r, len(devices)) for r in range(len(devices)))
        ]
        for p, d in zip(self.procs, devices):
            assert p.stdin is not None
            p.stdin.write(json.dumps({"specs": payload, "device": d}) + "\n")
            p.stdin.flush()
        for p in self.procs:
            self._read(p)

    def _read(self, p: subprocess.Popen) -> dict:
        assert p.stdout is not None
        for line in p.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK) :])
        raise RuntimeError(f"bench worker exited with {p.wait()}")

    def submit(self, job: dict, *, first_only: bool = False) -> None:
        for p in self.procs[:1] if first_only else self.procs:
            assert p.stdin is not None
            p.stdin.write(json.dumps(job) + "\n")
            p.stdin.flush()

    def replies(self, *, first_only: bool = False) -> list[dict]:
        return [self._read(p) for p in (self.procs[:1] if first_only else self.procs)]

    def close(self) -> None:
        for p in self.procs:
            assert p.stdin is not None
            p.stdin.close()
            p.wait(timeout=120)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_runs(fn: Callable[[], object], device: torch.device, cfg: BenchConfig) -> list[float]:
    times = []
    for i in range(cfg.warmup + cfg.repeats):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        if i >= cfg.warmup:
            times.append(time.perf_counter() - t)
    return times


def session_settings(cfg: BenchConfig, bucket_bytes: int) -> Settings:
    """The Settings of the bench's Senders: its bucket and timeout, across a link its namespace's address; the
    rest from the environment."""
    if cfg.link_rate is not None:
        return Settings(bucket_bytes=bucket_bytes, timeout_s=cfg.timeout_s, host=A_ADDR)
    return Settings(bucket_bytes=bucket_bytes, timeout_s=cfg.timeout_s)


@contextlib.contextmanager
def session(
    workers: Workers,
    source: ModuleSource,
    cfg: BenchConfig,
    device: torch.device,
    *,
    mode: str,
    bucket_bytes: int,
    num_slots: int,
    zero_copy: bool = False,
    verify_checksum: bool = False,
    verify: str | None = None,
    delta: bool = False,
    **job: object,
) -> Iterator[Sender]:
    settings = session_settings(cfg, bucket_bytes)
    sender = Sender(
        source,
        transport=cfg.transport,
        num_receivers=cfg.receivers,
        settings=settings,
        device=device,
        num_slots=num_slots,
        zero_copy=zero_copy,
        verify_checksum=verify_checksum,
        verify=verify,
        delta=delta,
    )
    workers.submit(
        {
            "mode": mode,
            "rendezvous": sender.rendezvous(),
            "bucket_bytes": bucket_bytes,
            "timeout_s": cfg.timeout_s,
            **job,
        }
    )
    try:
        sender.connect()
        yield sender
    finally:
        sender.close()


def free_memory(device: torch.device) -> None:
    """What a preset allocated, handed back once its references are dropped: cycles collected, and on CUDA the
    allocator's cached blocks returned, so that the next preset (and the receiver processes) can have them."""
    gc.collect()
    release(device)


def release(device: torch.device) -> None:
    """Hand cached blocks back, so the receiver processes on this device can have them."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def pythonpath() -> str:
    return os.pathsep.join(
        filter(None, [os.path.dirname(os.path.dirname(refit.__file__)), os.environ.get("PYTHONPATH")])
    )
