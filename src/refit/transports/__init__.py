"""Transports by name, imported lazily so optional dependencies stay optional.

Six are built in. More come from `register(name, cls_or_"module:Class")` in this process, or from an
installed package's entry point in group "refit.transports" (every process sees those):

    [project.entry-points."refit.transports"]
    mine = "my_package.transport:MyTransport"
"""

from __future__ import annotations

import importlib
import threading
from importlib import metadata

import torch

from refit.log import get_logger
from refit.transports.base import Transport

ENTRY_POINT_GROUP = "refit.transports"

_BUILTIN: dict[str, str] = {
    "shm": "refit.transports.shm:ShmTransport",
    "gloo": "refit.transports.gloo:GlooTransport",
    "cuda-ipc": "refit.transports.cuda_ipc:CudaIpcTransport",
    "nccl": "refit.transports.nccl:NcclTransport",
    "nixl": "refit.transports.nixl:NixlTransport",
    "relay": "refit.transports.relay:RelayTransport",
}
_DEVICE_TYPES = ("cpu", "cuda")

_REGISTRY: dict[str, type[Transport] | str] = dict(_BUILTIN)
"""Every known transport: a class, or a "module:Class" not imported yet (replaced by its class once it is)."""
_ENTRY_POINTS: set[str] | None = None
"""The names the entry-point group added; None until the group is read."""
# Reentrant: get() under the lock reads the entry points, whose loading logs and may look names up again.
_LOCK = threading.RLock()

log = get_logger("transports")


def register(name: str, transport: type[Transport] | str, *, replace: bool = False) -> None:
    """Make `transport` (a Transport subclass, or "package.module:ClassName" imported at the first `get(name)`)
    the transport called `name`, for Sender(transport=name) and the Receivers of its rendezvous.

    Per process: a Receiver in another process resolves `name` in its own registry, so register it there too,
    or declare an entry point in group "refit.transports", which every process reads."""
    _check_name(name)
    if isinstance(transport, str):
        problem = _target_problem(transport)
    elif isinstance(transport, type):
        problem = _class_problem(transport)
    else:
        problem = f"got {type(transport).__name__} {transport!r:.80}"
    if problem:
        raise ValueError(
            f"cannot register transport {name!r}: {problem}; pass a Transport subclass or 'package.module:ClassName'"
        )
    with _LOCK:
        if name in _BUILTIN:
            # A receiver elsewhere that did not make the same replacement would silently run the real one.
            raise ValueError(
                f"transport {name!r} is built in and cannot be replaced; register yours under another name"
            )
        if name in _REGISTRY and not replace:
            raise ValueError(
                f"transport {name!r} is already registered (as {_describe(_REGISTRY[name])}); "
                "pass replace=True to replace it, or pick another name"
            )
        _REGISTRY[name] = transport
        if _ENTRY_POINTS is not None:
            _ENTRY_POINTS.discard(name)
    log.debug("registered transport %r as %s", name, _describe(transport))


def names() -> list[str]:
    """The built-in transports, then those registered and those of entry points, in the order they came."""
    with _LOCK:
        _load_entry_points()
        return list(_REGISTRY)


def get(name: str) -> type[Transport]:
    """The transport class registered as `name`, imported on first use."""
    with _LOCK:
        if name not in _REGISTRY:
            _load_entry_points()
        if name not in _REGISTRY:
            raise ValueError(f"unknown transport {name!r}; choose one of {', '.join(names())}")
        target = _REGISTRY[name]
        if isinstance(target, str):
            log.debug("transport %r is %s", name, target)
            target = _import(name, target)
            _REGISTRY[name] = target
        return target


def unavailable(name: str) -> str:
    """Why transport `name` cannot run in this process, with the fix; '' when nothing rules it out.

    A cheap check (no device is touched beyond asking whether CUDA exists); `refit doctor` goes further.
    """
    if get(name).device_type != "cuda":
        return ""
    if not torch.cuda.is_available():
        build = (
            "a CPU-only build"
            if torch.version.cuda is None
            else f"built for CUDA {torch.version.cuda}, but no GPU is visible"
        )
        return (
            f"transport {name!r} needs a CUDA GPU, and this torch {torch.__version__} is {build}; "
            "use 'shm' (same host) or 'gloo' (across hosts) on CPU, or run on a GPU machine with a CUDA build of torch"
        )
    if name == "nccl" and not torch.distributed.is_nccl_available():
        return f"transport 'nccl' needs torch built with NCCL, and this torch {torch.__version__} has none; use 'gloo'"
    return ""


def default_device(name: str) -> torch.device:
    """Where a transport's buffers live by default; ValueError naming the fix where that is impossible."""
    if get(name).device_type == "cuda":
        reason = unavailable(name)
        if reason:
            raise ValueError(reason)
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _check_name(name: object) -> None:
    # The CLI takes comma-separated lists of names, each stripped of spaces.
    if not isinstance(name, str) or not name or name != name.strip() or "," in name:
        raise ValueError(f"a transport name is a non-empty string without commas or surrounding spaces, not {name!r}")


def _target_problem(target: str) -> str:
    """What is wrong with a "package.module:ClassName" string; '' when nothing is."""
    module, sep, attr = target.partition(":")
    if target.count(":") != 1 or not all(p.isidentifier() for p in (*module.split("."), *attr.split("."))):
        return f"{target!r} is not of the form 'package.module:ClassName' (exactly one ':')"
    return ""


def _class_problem(cls: type) -> str:
    """What keeps `cls` from serving as a transport; '' when nothing does."""
    if not issubclass(cls, Transport):
        return f"{cls.__module__}.{cls.__qualname__} is not a subclass of refit.transports.base.Transport"
    if getattr(cls, "device_type", None) not in _DEVICE_TYPES:
        return f"{cls.__qualname__}.device_type must be 'cpu' or 'cuda', not {getattr(cls, 'device_type', None)!r}"
    if not isinstance(getattr(cls, "name", None), str):
        return f"{cls.__qualname__}.name must be a string (its name in logs)"
    return ""


def _import(name: str, target: str) -> type[Transport]:
    """The class `target` ("module:Class") names, or a ValueError naming transport `name` and what to fix."""
    module, _, attr = target.partition(":")
    try:
        obj: object = importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - a third-party module may fail however it likes; the cause is kept
        raise ValueError(
            f"transport {name!r} is {target!r}, but importing module {module!r} failed: {type(e).__name__}: {e}; "
            "install what it needs or fix the registration"
        ) from e
    try:
        for part in attr.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        raise ValueError(
            f"transport {name!r} is {target!r}, but module {module!r} has no {attr!r}; fix the registration"
        ) from None
    problem = _class_problem(obj) if isinstance(obj, type) else f"{target} is a {type(obj).__name__}, not a class"
    if problem:
        raise ValueError(f"transport {name!r} is {target!r}, but {problem}; point it at a Transport subclass")
    return obj  # type: ignore[return-value]


def _load_entry_points() -> None:
    """Add the transports of entry-point group "refit.transports", once; a bad or shadowing one is logged and
    ignored, so that one broken package cannot take the built-in transports down with it."""
    global _ENTRY_POINTS
    if _ENTRY_POINTS is not None:
        return
    added: set[str] = set()
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = getattr(getattr(ep, "dist", None), "name", None)
        where = f"entry point {ep.name} = {ep.value!r} (group {ENTRY_POINT_GROUP!r}{f', from {dist}' if dist else ''})"
        target = f"{ep.module}:{ep.attr}" if ep.attr else ep.value
        if ep.name in _BUILTIN:
            log.warning("ignoring %s: %r is a built-in transport, which an entry point cannot replace", where, ep.name)
        elif ep.name in _REGISTRY:
            log.warning("ignoring %s: transport %r is already %s", where, ep.name, _describe(_REGISTRY[ep.name]))
        else:
            try:
                _check_name(ep.name)
            except ValueError as e:
                log.warning("ignoring %s: %s", where, e)
                continue
            problem = _target_problem(target)
            if problem:
                log.warning("ignoring %s: %s", where, problem)
                continue
            _REGISTRY[ep.name] = target
            added.add(ep.name)
    _ENTRY_POINTS = added
    if added:
        log.debug("transports from entry points: %s", ", ".join(sorted(added)))


def _forget_entry_points() -> None:
    """Drop what the entry points added and read the group again at the next lookup (for tests)."""
    global _ENTRY_POINTS
    with _LOCK:
        for name in _ENTRY_POINTS or ():
            _REGISTRY.pop(name, None)
        _ENTRY_POINTS = None


def _describe(target: type | str) -> str:
    return repr(target) if isinstance(target, str) else f"{target.__module__}:{target.__qualname__}"
