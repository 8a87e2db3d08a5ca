"""The bench's sender side: one run measures the floor, refit and the baselines on the same link."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from dataclasses import asdict
from functools import partial

import torch

from refit.checks.copy_digest import kernel_built
from refit.dtypes import dtype_name
from refit.errors import RefitError
from refit.layout.spec import TensorSpec
from refit.sources.module import ModuleSource
from refit.tools.bench.config import EITHER_MEMORY, LOCAL, PROBES, STEPPED, BenchConfig, applicable, bench_device
from refit.tools.bench.floors import local_copy, measure_floor, probe
from refit.tools.bench.harness import Result, Workers, free_memory, pythonpath, release, time_runs
from refit.tools.bench.link import NET_ONLY, Link, rate_bits
from refit.tools.bench.quantize import measured
from refit.tools.bench.refits import per_tensor, refit_method, stepped
from refit.tools.bench.report import VERIFIED
from refit.tools.children import module_command


def measure(cfg: BenchConfig, link: Link | None, on_method: Callable[[str], None] | None) -> dict[str, Result]:
    """Every method's Result, with receivers in `link`'s namespace b when given (this process in a)."""
    spec_list, engine_specs = cfg.specs()
    device, worker_devices = _devices(cfg)
    g = torch.Generator(device=device).manual_seed(0)
    tensors = {s.name: torch.randn(s.shape, generator=g, device=device).to(s.dtype) for s in spec_list}
    source = ModuleSource(tensors)
    nbytes = sum(s.nbytes for s in engine_specs)  # the wire's bytes: what the engine holds
    results: dict[str, Result] = {}
    workers = Workers(engine_specs, worker_devices, link)
    try:
        _methods(cfg, link, on_method, (workers, source, tensors, spec_list, engine_specs), device, results, nbytes)
    finally:
        workers.close()
        del tensors, source  # this preset's weights, gone before the next preset allocates its own
        free_memory(device)
    return results


def _methods(  # type: ignore[no-untyped-def]
    cfg: BenchConfig, link: Link | None, on_method, held: tuple, device: torch.device, results: dict, nbytes: int
) -> None:
    """`measure`'s loop over the methods, into `results`. `held`: workers, source, tensors, specs, engine specs."""
    workers, source, tensors, spec_list, engine_specs = held
    for m in cfg.methods:
        if on_method:
            on_method(m)
        before = link.bytes_a_to_b() if link else 0
        into = link.bytes_into_sites() if link else []
        if m == "quantize":
            times, moved, floors = measured(tensors, engine_specs, lambda fn: time_runs(fn, device, cfg))
            release(device)
            result = Result(m, moved, times, floors=floors)
        else:
            result = _method(m, workers, source, tensors, spec_list, cfg, device, nbytes)
        if result is not None:
            result.link_bytes = link.bytes_a_to_b() - before if link else None
            if link and link.sites:
                result.site_bytes = [b - a for a, b in zip(into, link.bytes_into_sites())]
            results[m] = result


def measured_inside(cfg: BenchConfig, link: Link, on_method: Callable[[str], None] | None) -> dict[str, Result]:
    """`measure` run by a child process inside the link's namespace a (as `ip netns exec` starts it: its own
    view of the network devices in /sys, which a thread that only switched namespaces lacks)."""
    job = json.dumps(
        {
            "config": {**asdict(cfg), "methods": list(cfg.methods)},
            "tag": link.tag,
            "rate": link.rate,
            "sites": link.sites,
        }
    )
    env = {**os.environ, **{k: v for k, v in NET_ONLY.items() if k not in os.environ}, "PYTHONPATH": pythonpath()}
    argv = link.command("a", [*module_command("refit.tools.bench.inside"), job])
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    results: dict[str, Result] = {}
    for line in proc.stdout:
        if line.startswith(INSIDE_MARK):
            event = json.loads(line[len(INSIDE_MARK) :])
            if "method" in event and on_method:
                on_method(event["method"])
            for name, r in event.get("results", {}).items():
                results[name] = Result(**r)
            if "error" in event:
                raise ValueError(event["error"])
    if proc.wait() != 0:
        how = f"was killed by signal {-proc.returncode}" if proc.returncode < 0 else f"exited with {proc.returncode}"
        hint = " (9: out of memory?)" if proc.returncode == -9 else ""
        raise RefitError(f"the bench's measuring process inside the link's namespace {how}{hint}; see its output above")
    return results


INSIDE_MARK = "@@inside "


def _method(
    m: str,
    workers: Workers,
    source: ModuleSource,
    tensors: dict[str, torch.Tensor],
    spec_list: list[TensorSpec],
    cfg: BenchConfig,
    device: torch.device,
    nbytes: int,
) -> Result | None:
    """One method's figures, or None where it does not apply to this transport or device."""
    refit_ = partial(refit_method, workers, source, cfg, device, num_slots=2, name=m)
    if m not in applicable(cfg.transport, device):
        return None
    if m == "floor":
        return measure_floor(workers, source, cfg, device, nbytes)
    if m in LOCAL:
        return local_copy(m, tensors, cfg, device, nbytes)
    if m in PROBES:
        return probe(m, tensors, cfg, device, nbytes)
    if m in ("refit", "serial"):
        return refit_(num_slots=2 if m == "refit" else 1, verify=None)
    if m == "checksum":
        return refit_(verify_checksum=True, verify=None)
    if m == "fingerprint":  # the end-to-end check of what the engine holds
        return refit_(verify="fingerprint")
    if m.startswith("zero_copy"):
        verify = "fingerprint" if m == "zero_copy_fingerprint" else None
        return refit_(zero_copy=True, verify=verify)
    if m in STEPPED:
        return stepped(workers, spec_list, cfg, device, method=m)
    return per_tensor(workers, source, spec_list, cfg, device, meta=m == "per_tensor_meta")


def _devices(cfg: BenchConfig) -> tuple[torch.device, list[str]]:
    device = bench_device(cfg.transport)
    if device.type == "cpu":
        return device, ["cpu"] * cfg.receivers
    n = torch.cuda.device_count()
    if cfg.transport == "cuda-ipc" or cfg.transport in EITHER_MEMORY:
        return device, ["cuda:0"] * cfg.receivers
    if n < 2:
        raise ValueError("the nccl bench needs at least 2 GPUs (sender on cuda:0, receivers on the others)")
    return torch.device("cuda:0"), [f"cuda:{1 + r % (n - 1)}" for r in range(cfg.receivers)]


def run_bench(cfg: BenchConfig, on_method: Callable[[str], None] | None = None) -> dict:
    """Measure every method in `cfg.methods` on one link; returns a JSON-able report. `on_method(name)` is
    called as each method starts (the CLI's progress). With `cfg.link_rate`, across a namespaced link that
    exists only while it runs: the measuring process then runs inside the trainer's namespace
    (`refit.tools.bench.inside`), so that every library in it (UCX too) sees that namespace's devices."""
    spec_list, engine_specs = cfg.specs()
    device, _ = _devices(cfg)
    nbytes = sum(s.nbytes for s in engine_specs)
    if cfg.link_rate is None:
        results = measure(cfg, None, on_method)
    else:
        with Link(rate=cfg.link_rate, sites=cfg.sites) as link:
            results = measured_inside(cfg, link, on_method)
    floor = results["floor"].median if "floor" in results else None
    summaries = {k: r.summary(floor) for k, r in results.items()}
    bits = rate_bits(cfg.link_rate) if cfg.link_rate is not None else 0
    for k, r in results.items() if bits else ():  # a delta moves less than the model's bytes: no share of the rate
        summaries[k]["link_fraction"] = None if k.startswith("step_delta") else r.nbytes * 8 / r.median / bits
    for verified, plain in VERIFIED.items():
        if verified in results and plain in results:
            summaries[verified]["ratio_to_unverified"] = results[verified].median / results[plain].median
    return {
        "config": {**asdict(cfg), "methods": list(cfg.methods)},
        "tensors": len(spec_list),
        "nbytes": nbytes,
        "dtypes": sorted({dtype_name(s.dtype) for s in spec_list}),
        "engine_dtypes": sorted({dtype_name(s.dtype) for s in engine_specs}),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "cpu_kernel": device.type == "cpu" and kernel_built(),  # the notes under the table explain figures by it
        "results": summaries,
        "link": None if cfg.link_rate is None else _link(cfg),
    }


def _link(cfg: BenchConfig) -> dict:
    assert cfg.link_rate is not None
    return {"rate": cfg.link_rate, "rate_bits": rate_bits(cfg.link_rate), **({"sites": cfg.sites} if cfg.sites else {})}
