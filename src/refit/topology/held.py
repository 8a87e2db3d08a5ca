"""What a Sender holds open: its lobby, heartbeats, channels, transport and (elastic) membership."""

from __future__ import annotations

import contextlib

from refit.errors import PeerError
from refit.protocol.lobby import Lobby
from refit.protocol.wire import Channel, Header, Kind
from refit.topology.membership import Membership
from refit.topology.pulse import Pulse
from refit.transports.base import Transport


class Held:
    """What a Sender holds open (lobby, heartbeats, channels, transport); closed by `close` or, for a
    Sender never closed, when it is garbage collected or the interpreter exits."""

    def __init__(self, lobby: Lobby) -> None:
        self.lobby = lobby
        self.pulse: Pulse | None = None
        self.channels: list[Channel] = []
        self.transport: Transport | None = None
        self.members: Membership | None = None

    def drop_peers(self) -> None:
        """After a failed connect: close every channel and the transport (the lobby stays until `close`)."""
        for ch in self.channels:
            ch.close()
        self.channels.clear()
        if self.transport is not None:
            self.transport.close()
            self.transport = None

    def tell(self, message: str) -> None:
        """Send ERROR(`message`) to every channel still open (a peer already gone is skipped)."""
        for ch in self.channels:
            with contextlib.suppress(PeerError):
                ch.send(Header(Kind.ERROR), {"message": message})

    def drop_transport(self) -> None:
        """Abort the transport, so that every peer still blocked in it fails at once, and hold none."""
        transport, self.transport = self.transport, None
        if transport is not None:
            transport.abort()

    def close(self) -> None:
        if self.pulse is not None:
            self.pulse.stop()
            self.pulse = None
        self.lobby.close()
        if self.members is not None:
            self.members.close()
        for ch in self.channels:
            with contextlib.suppress(PeerError):
                ch.send(Header(Kind.CLOSE))
            ch.close()
        self.channels.clear()
        if self.transport is not None:
            self.transport.close()
            self.transport = None
