"""Address: where a sender listens, and the address it tells receivers to dial (never a wildcard).

REFIT_IFNAME names a network interface: the sender listens on its IPv4 address and advertises it.
Otherwise it listens on REFIT_HOST (loopback by default); when that is a wildcard (0.0.0.0), it
advertises the address of the interface holding the default route, else the first non-loopback one.
A receiver's collective group (gloo) binds the local address that routes to the sender.
"""

from __future__ import annotations

import fcntl
import socket
import struct

from refit.settings import Settings

WILDCARDS = frozenset({"", "0.0.0.0", "::", "*"})  # noqa: S104 - the addresses refit never advertises
_SIOCGIFADDR = 0x8915


def _ipv4(ifname: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", ifname.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def interface_address(ifname: str) -> str:
    """The IPv4 address of network interface `ifname`."""
    found = _ipv4(ifname)
    if found is None:
        raise ValueError(
            f"network interface {ifname!r} (REFIT_IFNAME) does not exist or has no IPv4 address; "
            f"interfaces with one here: {sorted(interfaces())}"
        )
    return found


def interfaces() -> dict[str, str]:
    """Every network interface with an IPv4 address: name -> address."""
    found = {name: _ipv4(name) for _, name in socket.if_nameindex()}
    return {n: a for n, a in found.items() if a is not None}


def _default_route_interface() -> str | None:
    try:
        with open("/proc/net/route") as f:
            rows = [line.split() for line in f.readlines()[1:]]
    except OSError:
        return None
    return next((r[0] for r in rows if len(r) > 1 and r[1] == "00000000"), None)


def reachable_address() -> str:
    """A real address of this host for others to dial: the default route's interface, else the first
    non-loopback interface, else loopback (one host only)."""
    found = interfaces()
    name = _default_route_interface()
    if name in found:
        return found[name]
    return next((a for n, a in sorted(found.items()) if not a.startswith("127.")), "127.0.0.1")


def listen_host(settings: Settings) -> str:
    """Where the sender's sockets listen: REFIT_IFNAME's address, else REFIT_HOST."""
    return interface_address(settings.ifname) if settings.ifname else settings.host


def advertised(host: str, settings: Settings) -> str:
    """What receivers are told to dial for a socket bound to `host`: `host` itself unless it is a wildcard."""
    if host not in WILDCARDS:
        return host
    return interface_address(settings.ifname) if settings.ifname else reachable_address()


def towards(peer: str, settings: Settings) -> str:
    """The local address to bind for talking to `peer`: REFIT_IFNAME's, else the one the kernel routes
    through (found by connecting a UDP socket, which sends nothing)."""
    if settings.ifname:
        return interface_address(settings.ifname)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((peer, 9))
        except OSError:
            return peer
        return s.getsockname()[0]
