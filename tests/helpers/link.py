"""Two hosts on one machine: two network namespaces joined by a veth pair, optionally rate-limited with tc.

`Link` makes them, runs commands in either, reads the veth's byte counters and removes everything on exit.
Every process of a test that crosses it binds its own namespace's address, so bytes between the two can
only travel over the veth (the namespaces share no loopback), and the counters show how many did.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field

A_ADDR, B_ADDR = "10.232.0.1", "10.232.0.2"


def can_make_links() -> str:
    """'' when this process may make network namespaces, else why not."""
    if os.geteuid() != 0:
        return "needs root (CAP_NET_ADMIN) to make network namespaces"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs iproute2 (ip and tc) to make network namespaces"
    return ""


def rate_bits(rate: str) -> int:
    """Bits per second of a tc rate such as "1gbit", "500mbit"."""
    units = {"gbit": 10**9, "mbit": 10**6, "kbit": 10**3, "bit": 1}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return int(float(rate[: -len(unit)]) * scale)
    raise ValueError(f"rate {rate!r}: expected a number and gbit, mbit, kbit or bit")


def _sh(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


@dataclass
class Link:
    """Namespaces `a` (the trainer's, 10.232.0.1 on veth `dev_a`) and `b` (the engine's, 10.232.0.2).
    `rate`: a token-bucket (tc tbf) rate on both directions ("1gbit", "10gbit"), or None for the veth's own
    speed."""

    rate: str | None = None
    tag: str = field(default_factory=lambda: str(os.getpid()))

    def __post_init__(self) -> None:
        self.a, self.b = f"refit-la-{self.tag}", f"refit-lb-{self.tag}"
        self.dev_a, self.dev_b = f"rla{self.tag}"[:15], f"rlb{self.tag}"[:15]

    def __enter__(self) -> Link:
        try:
            _sh("ip", "netns", "add", self.a)
            _sh("ip", "netns", "add", self.b)
            _sh("ip", "link", "add", self.dev_a, "netns", self.a, "type", "veth", "peer", "name", self.dev_b,
                "netns", self.b)  # fmt: skip
            for ns, dev, addr in ((self.a, self.dev_a, A_ADDR), (self.b, self.dev_b, B_ADDR)):
                _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                _sh("ip", "-n", ns, "link", "set", dev, "up")
                _sh("ip", "-n", ns, "link", "set", "lo", "up")
                self._shape(ns, dev)
        except BaseException:
            self.__exit__()
            raise
        return self

    def _shape(self, ns: str, dev: str) -> None:
        if self.rate is None:
            return
        burst = max(rate_bits(self.rate) // 8 // 250, 1 << 16)  # a 4 ms bucket: the rate holds above 250 Hz timers
        _sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate, "burst", str(burst),
            "latency", "50ms")  # fmt: skip

    def __exit__(self, *exc: object) -> None:
        for ns in (self.a, self.b):
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)

    def bytes_a_to_b(self) -> int:
        """Bytes the trainer's side has sent over the veth so far (its tx counter)."""
        return int(_sh("ip", "netns", "exec", self.a, "cat", f"/sys/class/net/{self.dev_a}/statistics/tx_bytes"))

    def popen(self, side: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        """Start `python argv...` in namespace `side` ("a" or "b")."""
        ns = self.a if side == "a" else self.b
        return subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, *argv], stdout=subprocess.PIPE, text=True, env=env
        )
