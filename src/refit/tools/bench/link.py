"""Hosts on one machine: network namespaces joined by veth pairs, optionally rate-limited with tc.

Two hosts: the trainer's namespace `a` and the engine's `b`, joined by one veth. A fleet (`sites`=S): the
trainer's namespace and S site namespaces, each joined by its own veth to one bridge in a hub namespace, so
that what the trainer sends crosses its own veth and then the veth of each site it reaches, and replicas of one
site talk inside their namespace without crossing any.

`Link` makes them, runs processes in either, lets this process's calling thread enter one, reads the veth's
byte counters and removes everything on exit (also on an error or Ctrl-C). Every process that crosses it
binds its own namespace's address, so bytes between the two travel only over the veth (the namespaces share
no loopback), and the counters show how many did. `refit bench --link-rate` and the tests use it; it needs
root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and iproute2.

The link's floor: a raw TCP transfer of a byte count across it (`send_floor` in one namespace, `recv_floor`
in the other), the most any transport can reach on it.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field

A_ADDR, B_ADDR = "10.232.0.1", "10.232.0.2"
"""The trainer's side (namespace a) and the engine's (namespace b)."""
MAX_SITES = 64
"""Site k listens on 10.232.0.(10 + k): the sites fit the /24 beside A_ADDR and B_ADDR."""
UNITS = {"gbit": 10**9, "mbit": 10**6, "kbit": 10**3, "bit": 1}


def can_make_links() -> str:
    """'' when this process may make network namespaces, else why not."""
    if os.geteuid() != 0:
        return "needs root (CAP_NET_ADMIN) to make network namespaces"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs iproute2 (ip and tc) to make network namespaces"
    return ""


def rate_bits(rate: str) -> int:
    """Bits per second of a tc rate such as "1gbit", "500mbit" (0 for "none": the veth's own speed)."""
    text = rate.strip().lower()
    if text == "none":
        return 0
    for unit, scale in UNITS.items():
        if text.endswith(unit):
            try:
                bits = int(float(text[: -len(unit)]) * scale)
            except ValueError:
                break
            if bits >= 8000:
                return bits
            raise ValueError(f"link rate {rate!r} is below 8kbit, too slow to move a model")
    raise ValueError(f"link rate {rate!r}: expected a number and gbit, mbit, kbit or bit (e.g. 10gbit), or none")


def _sh(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


@dataclass
class Link:
    """Namespaces `a` (the trainer's, A_ADDR on veth `dev_a`) and `b` (the engine's, B_ADDR on `dev_b`); with
    `sites`, `a` and one namespace per site (`site_addr(k)` on veth `site_dev(k)`), every veth's other end on
    the hub's bridge. `rate`: a token-bucket (tc tbf) rate on both directions of every veth ("1gbit",
    "10gbit"), or None / "none" for the veth's own speed."""

    rate: str | None = None
    tag: str = field(default_factory=lambda: str(os.getpid()))
    borrowed: bool = False
    """The namespaces exist already (made by the process that started this one): used, never made or deleted."""
    sites: int = 0
    """0: two hosts (a and b). S >= 1: a fleet, S site namespaces each behind its own veth off a hub's bridge."""

    def __post_init__(self) -> None:
        if self.rate is not None and rate_bits(self.rate) == 0:
            self.rate = None
        if not 0 <= self.sites <= MAX_SITES:
            raise ValueError(f"sites must be 0 to {MAX_SITES}, got {self.sites}")
        self.a, self.b, self.hub = f"refit-la-{self.tag}", f"refit-lb-{self.tag}", f"refit-lh-{self.tag}"
        self.dev_a, self.dev_b = f"rla{self.tag}"[:15], f"rlb{self.tag}"[:15]

    def _names(self) -> list[str]:
        return [self.a, self.b] if not self.sites else [self.a, self.hub, *map(self.site_namespace, range(self.sites))]

    def __enter__(self) -> Link:
        if self.borrowed:
            return self
        try:
            for ns in self._names():
                _sh("ip", "netns", "add", ns)
                _sh("ip", "-n", ns, "link", "set", "lo", "up")
            if self.sites:
                self._make_fleet()
            else:
                self._join(self.a, self.dev_a, A_ADDR, self.b, self.dev_b, B_ADDR)
        except BaseException:
            self.__exit__()
            raise
        return self

    def _join(self, ns: str, dev: str, addr: str | None, peer_ns: str, peer: str, peer_addr: str | None) -> None:
        """A veth from `ns` to `peer_ns`, both ends up and shaped, each with its address (None: a bridge port)."""
        _sh("ip", "link", "add", dev, "netns", ns, "type", "veth", "peer", "name", peer, "netns", peer_ns)
        for side, name, address in ((ns, dev, addr), (peer_ns, peer, peer_addr)):
            if address is None:
                _sh("ip", "-n", side, "link", "set", name, "master", "rlbr")
            else:
                _sh("ip", "-n", side, "addr", "add", f"{address}/24", "dev", name)
            _sh("ip", "-n", side, "link", "set", name, "up")
            self._shape(side, name)

    def _make_fleet(self) -> None:
        _sh("ip", "-n", self.hub, "link", "add", "rlbr", "type", "bridge")
        _sh("ip", "-n", self.hub, "link", "set", "rlbr", "up")
        self._join(self.a, self.dev_a, A_ADDR, self.hub, f"rha{self.tag}"[:15], None)
        for k in range(self.sites):
            self._join(
                self.site_namespace(k), self.site_dev(k), self.site_addr(k), self.hub, f"rh{k}.{self.tag}"[:15], None
            )

    def _shape(self, ns: str, dev: str) -> None:
        if self.rate is None:
            return
        burst = max(rate_bits(self.rate) // 8 // 250, 1 << 16)  # a 4 ms bucket: the rate holds above 250 Hz timers
        _sh(
            "tc",
            "-n",
            ns,
            "qdisc",
            "add",
            "dev",
            dev,
            "root",
            "tbf",
            "rate",
            self.rate,
            "burst",
            str(burst),
            "latency",
            "50ms",
        )

    def __exit__(self, *exc: object) -> None:
        if self.borrowed:
            return
        for ns in self._names():
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)

    def namespace(self, side: str | int) -> str:
        """ "a": the trainer's; "b": the engine's (two hosts); an int: that site's (a fleet)."""
        if isinstance(side, int) and 0 <= side < self.sites:
            return self.site_namespace(side)
        if side not in ("a", "b") or (side == "b" and self.sites):
            raise ValueError(f"side must be 'a', 'b' or a site below {self.sites} for this link, got {side!r}")
        return self.a if side == "a" else self.b

    def site_namespace(self, k: int) -> str:
        return f"refit-ls{k}-{self.tag}"

    def site_dev(self, k: int) -> str:
        return f"rs{k}.{self.tag}"[:15]

    def site_addr(self, k: int) -> str:
        """Site `k`'s address: every replica of the site listens on it."""
        return f"10.232.0.{10 + k}"

    def bytes_into_sites(self) -> list[int]:
        """Bytes each site's veth has taken in so far (its rx counter inside the site)."""
        return [
            int(
                _sh(
                    "ip",
                    "netns",
                    "exec",
                    self.site_namespace(k),
                    "cat",
                    f"/sys/class/net/{self.site_dev(k)}/statistics/rx_bytes",
                )
            )
            for k in range(self.sites)
        ]

    def bytes_a_to_b(self) -> int:
        """Bytes the trainer's side has sent over the veth so far (its tx counter)."""
        return int(_sh("ip", "netns", "exec", self.a, "cat", f"/sys/class/net/{self.dev_a}/statistics/tx_bytes"))

    def command(self, side: str | int, argv: list[str]) -> list[str]:
        """`argv` run inside namespace `side` ("a", "b" or a site)."""
        return ["ip", "netns", "exec", self.namespace(side), *argv]


NET_ONLY = {"UCX_TLS": "tcp"}
"""nixl's UCX kept to TCP across a namespaced link: by default it reads through cross-memory attach or shared
memory, which reach another network namespace of the same kernel without crossing the veth."""


def send_floor(listener: socket.socket, nbytes: int, count: int, timeout_s: float) -> list[float]:
    """The link's floor, sender side: accept one peer on `listener`, send it `nbytes` `count` times, each
    timed until the peer's one-byte answer that it has them all. Seconds per send."""
    listener.settimeout(timeout_s)
    conn, _ = listener.accept()
    payload = memoryview(bytearray(os.urandom(1 << 20)) * max(1, -(-nbytes // (1 << 20))))[:nbytes]
    times = []
    with conn:
        conn.settimeout(timeout_s)
        for _ in range(count):
            t = time.perf_counter()
            conn.sendall(payload)
            if conn.recv(1) != b"k":
                raise ConnectionError("the link floor's receiver closed before it had every byte")
            times.append(time.perf_counter() - t)
    return times


def recv_floor(host: str, port: int, nbytes: int, count: int, timeout_s: float) -> None:
    """The link's floor, receiver side: connect to `host:port`, take `nbytes` `count` times, answering each."""
    buf = memoryview(bytearray(1 << 22))
    with socket.create_connection((host, port), timeout=timeout_s) as conn:
        for _ in range(count):
            left = nbytes
            while left:
                got = conn.recv_into(buf, min(left, len(buf)))
                if not got:
                    raise ConnectionError("the link floor's sender closed early")
                left -= got
            conn.sendall(b"k")
