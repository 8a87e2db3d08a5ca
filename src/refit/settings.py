"""Settings: every environment variable refit reads, read here and nowhere else."""

from __future__ import annotations

import difflib
import os
import secrets
from dataclasses import dataclass, field

DEFAULT_RATIO = 0.2
DEFAULT_TIMEOUT_S = 120.0
DEFAULT_CONNECT_TIMEOUT_S = 600.0
DEFAULT_HOST = "127.0.0.1"
DEFAULT_ALIGNMENT = 256
"""Every tensor starts at a multiple of it in a bucket (refit.layout.planner): the smallest bucket capacity."""


def _ratio() -> float:
    name = (
        "REFIT_BUFFER_MEMORY_RATIO" if os.environ.get("REFIT_BUFFER_MEMORY_RATIO") else "NRL_REFIT_BUFFER_MEMORY_RATIO"
    )
    raw = os.environ.get(name)
    if not raw:
        return DEFAULT_RATIO
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 < value <= 1:
        raise ValueError(f"{name} must be a number in (0, 1], got {raw!r}; fix it or unset it")
    return value


def _float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds > 0, got {raw!r}; fix it or unset it") from None
    if not value > 0:  # also refuses nan
        raise ValueError(f"{name} must be a number of seconds > 0, got {raw!r}; fix it or unset it")
    return value


def _bucket_bytes() -> int | None:
    raw = os.environ.get("REFIT_BUCKET_BYTES")
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(
            f"REFIT_BUCKET_BYTES must be an integer number of bytes (at least {DEFAULT_ALIGNMENT}), got {raw!r}; "
            "fix it or unset it"
        ) from None


def check_bucket_bytes(value: int | None) -> None:
    """A bucket holds at least one aligned slot: a smaller capacity would fail only once the engine joins,
    so it is refused where it is given."""
    if value is None:
        return
    if value <= 0:
        raise ValueError(f"bucket_bytes ({value}) must be > 0 (Settings.bucket_bytes or REFIT_BUCKET_BYTES)")
    if value < DEFAULT_ALIGNMENT:
        raise ValueError(
            f"bucket_bytes ({value}) is below the alignment of {DEFAULT_ALIGNMENT} bytes; give at least "
            f"{DEFAULT_ALIGNMENT} (Settings.bucket_bytes or REFIT_BUCKET_BYTES)"
        )


def given(name: str) -> bool:
    """Whether environment variable `name` is set (non-empty): a tool whose own default differs from
    Settings' (the bench's longer timeout) lets the variable win only then."""
    return bool(os.environ.get(name))


_SWITCHES = ("REFIT_CPU_KERNEL", "REFIT_CUDA_IPC", "REFIT_CUDA_IPC_EVENTS")
_COUNTS = {  # read once, at import, by the GPU kernels (refit.layout.copy_kernel, refit.checks.tensor_digest)
    "REFIT_COPY_PROGRAMS": 0,
    "REFIT_DIGEST_CHUNK_WORDS": 1,
    "REFIT_DIGEST_ROWS": 1,
    "REFIT_DIGEST_COLS": 1,
    "REFIT_DIGEST_WARPS": 1,
}
_CHOICES = {"REFIT_NIXL_ERROR_MODE": ("none", "peer")}


def check_environment() -> Settings:
    """Every REFIT_* variable checked at once, for a command to call before any work: the Settings they
    make, or ValueError naming the variable and the fix. Some are read elsewhere, at import or at first
    use, where a bad value would fail mid-run or with a traceback."""
    for name in _SWITCHES:
        raw = os.environ.get(name)
        if raw and raw not in ("0", "1"):
            raise ValueError(f"{name} must be 0 or 1, got {raw!r}; fix it or unset it")
    for name, least in _COUNTS.items():
        raw = os.environ.get(name)
        if raw and not (raw.strip().isdigit() and int(raw) >= least):
            raise ValueError(f"{name} must be an integer >= {least}, got {raw!r}; fix it or unset it")
    for name, choices in _CHOICES.items():
        raw = os.environ.get(name)
        if raw and raw not in choices:
            raise ValueError(f"{name} must be one of {', '.join(choices)}, got {raw!r}; fix it or unset it")
    return Settings()


_NAMED = "REFIT_BUFFER_MEMORY_RATIO NRL_REFIT_BUFFER_MEMORY_RATIO REFIT_BUCKET_BYTES REFIT_TIMEOUT"
_NAMED += " REFIT_CONNECT_TIMEOUT REFIT_HOST REFIT_IFNAME REFIT_TOKEN REFIT_SITE"
KNOWN = (*_NAMED.split(), *_SWITCHES, *_COUNTS, *_CHOICES)
"""Every environment variable refit reads (docs/USAGE.md, "Environment variables")."""


def unknown_variables(environ: dict[str, str] | None = None) -> list[str]:
    """One message per REFIT_* variable that refit does not read (a misspelling is silently ignored
    otherwise), naming the nearest real one where there is one. REFIT_TEST_* belong to refit's test suite."""
    env = os.environ if environ is None else environ
    messages = []
    for name in sorted(n for n in env if n.startswith("REFIT_") and n not in KNOWN and not n.startswith("REFIT_TEST_")):
        near = difflib.get_close_matches(name, KNOWN, n=1, cutoff=0.6)
        hint = f"; did you mean {near[0]}?" if near else "; see docs/USAGE.md for the variables it reads"
        messages.append(f"{name} is set but refit reads no such variable{hint}")
    return messages


def cpu_kernel_enabled() -> bool:
    """False when REFIT_CPU_KERNEL=0: the fused copy-and-digest runs in PyTorch, never compiling its C kernel."""
    return os.environ.get("REFIT_CPU_KERNEL", "1") != "0"


@dataclass(kw_only=True, slots=True)
class Settings:
    """Session settings; defaults come from the environment (see the table in docs/USAGE.md)."""

    ratio: float = field(default_factory=_ratio)
    """Fraction of free memory the bucket buffers of one side may take (REFIT_BUFFER_MEMORY_RATIO)."""
    bucket_bytes: int | None = field(default_factory=_bucket_bytes)
    """Explicit bucket capacity in bytes; overrides `ratio` (REFIT_BUCKET_BYTES)."""
    timeout_s: float = field(default_factory=lambda: _float("REFIT_TIMEOUT", DEFAULT_TIMEOUT_S))
    """Limit on every wait inside a refit (handshake, each bucket, commit), and how long a receiver waits
    between refits without a heartbeat before it calls the sender dead (REFIT_TIMEOUT)."""
    connect_timeout_s: float = field(default_factory=lambda: _float("REFIT_CONNECT_TIMEOUT", DEFAULT_CONNECT_TIMEOUT_S))
    """How long the rendezvous waits for every receiver to connect: it spans the engine processes'
    start-up, which can take minutes (REFIT_CONNECT_TIMEOUT)."""
    host: str = field(default_factory=lambda: os.environ.get("REFIT_HOST", DEFAULT_HOST))
    """Address the sender listens on; loopback unless told otherwise (REFIT_HOST)."""
    ifname: str | None = field(default_factory=lambda: os.environ.get("REFIT_IFNAME") or None)
    """Network interface to listen on and advertise, and for collective groups to bind (REFIT_IFNAME)."""
    token: str = field(default_factory=lambda: os.environ.get("REFIT_TOKEN") or secrets.token_hex(16))
    """Shared secret every connection must present (REFIT_TOKEN; generated per session if unset)."""
    cuda_ipc: bool = field(default_factory=lambda: os.environ.get("REFIT_CUDA_IPC", "1") != "0")
    """False (REFIT_CUDA_IPC=0) makes 'cuda-ipc' stage through pinned host shared memory instead."""
    cuda_ipc_events: bool = field(default_factory=lambda: os.environ.get("REFIT_CUDA_IPC_EVENTS", "1") != "0")
    """'cuda-ipc' orders its slots with interprocess CUDA events (no host stream sync per bucket); False
    (REFIT_CUDA_IPC_EVENTS=0, on the sender) synchronizes each side's stream per bucket instead."""
    site: str = field(default_factory=lambda: os.environ.get("REFIT_SITE", ""))
    """Where a receiver sits (the replicas behind one link); '' is a site of its own (REFIT_SITE, 'relay')."""

    def __post_init__(self) -> None:
        if not 0 < self.ratio <= 1:
            raise ValueError(f"ratio ({self.ratio}) must be in (0, 1]")
        check_bucket_bytes(self.bucket_bytes)
        if self.timeout_s <= 0 or self.connect_timeout_s <= 0:
            raise ValueError(
                f"timeout_s ({self.timeout_s}) and connect_timeout_s ({self.connect_timeout_s}) must be > 0"
            )
        if not self.token:
            raise ValueError("token must be non-empty")
