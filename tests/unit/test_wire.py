"""Wire format: exact header bytes, and malformed or oversized messages rejected before allocation."""

from __future__ import annotations

import socket
import struct

import pytest

from refit.errors import IntegrityError, PeerError
from refit.protocol.wire import HEADER, MAX_JSON_BYTES, Channel, Header, Kind


def test_header_has_the_documented_bytes() -> None:
    h = Header(Kind.BUCKET, status=1, slot=1, epoch=2, index=3, version=4, digest=bytes(range(16)), nbytes=5,
               checksum=6)  # fmt: skip
    data = h.pack()
    assert len(data) == 64 and data[:4] == b"RFT1" and data[4] == 7 and data[56:] == bytes(8)
    assert struct.unpack_from("<BHIIQ", data, 5) == (1, 1, 2, 3, 4)
    assert data[24:40] == bytes(range(16)) and struct.unpack_from("<QQ", data, 40) == (5, 6)
    assert Header.unpack(data) == h


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        (b"XXXX" + bytes(60), "does not start with"),
        (HEADER.pack(b"RFT1", 99, 0, 0, 0, 0, 0, bytes(16), 0, 0, 0), "unknown kind 99"),
        (HEADER.pack(b"RFT1", Kind.MANIFEST, 0, 0, 0, 0, 0, bytes(16), MAX_JSON_BYTES + 1, 0, 0), "exceeds the limit"),
    ],
)
def test_bad_headers_are_rejected(data: bytes, needle: str) -> None:
    with pytest.raises(IntegrityError, match=needle):
        Header.unpack(data)


def test_channel_rejects_oversized_payload_and_truncated_header() -> None:
    a, b = socket.socketpair()
    rx = Channel(b, peer="peer", timeout_s=2)
    a.sendall(HEADER.pack(b"RFT1", Kind.MANIFEST, 0, 0, 0, 0, 0, bytes(16), 1 << 40, 0, 0))
    with pytest.raises(IntegrityError, match="exceeds the limit"):
        rx.recv("handshake")
    a.sendall(b"RFT1" + bytes(10))
    a.close()
    with pytest.raises(PeerError, match="closed the connection during handshake"):
        rx.recv("handshake")


def test_channel_times_out_naming_the_peer_and_stage() -> None:
    a, b = socket.socketpair()
    rx = Channel(b, peer="sender (x)", timeout_s=0.2)
    with pytest.raises(PeerError, match=r"sender \(x\) did not answer within 0.2s during bucket 3"):
        rx.recv("bucket 3")
    a.close()


def test_leave_has_kind_17_and_its_reason_reaches_the_reader_bounded() -> None:
    from refit.protocol.wire import MAX_REASON_CHARS, Left

    a, b = socket.socketpair()
    tx, rx = Channel(a, peer="receiver 3", timeout_s=2), Channel(b, peer="receiver 3", timeout_s=2)
    tx.send(Header(Kind.LEAVE), {"reason": "drained"})
    data = b.recv(64, socket.MSG_PEEK)
    assert data[:5] == b"RFT1\x11" and struct.unpack_from("<Q", data, 40) == (len(b'{"reason":"drained"}'),)
    with pytest.raises(Left, match="receiver 3 left the session: drained") as info:
        rx.recv("the wait between refits")
    assert isinstance(info.value, PeerError) and info.value.reason == "drained"
    tx.send(Header(Kind.LEAVE), {"reason": "x" * 10_000})
    with pytest.raises(Left) as info:
        rx.recv("the wait between refits")
    assert info.value.reason == "x" * MAX_REASON_CHARS
    tx.send(Header(Kind.LEAVE), b"not json")
    with pytest.raises(Left, match=r"\(unreadable reason\)"):
        rx.recv("the wait between refits")
    a.close()
    b.close()
