"""Mutual authentication over the shared token: a challenge-response in which the token never crosses the wire.

Each side sends a random nonce; each proves it knows the token with
HMAC-SHA256(token, role || receiver nonce || sender nonce || protocol version). The receiver checks the
sender's proof before it reads anything else from the sender (no path, address or manifest); the sender
checks the receiver's proof before it admits it. Both then hold a session key, HMAC-SHA256(token,
"session" || both nonces || version), under which the sender MACs what it tells the receiver to map or
dial (WELCOME) and the digest of every manifest, so a relay of the handshake cannot substitute its own.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

PROTOCOL_VERSION = 3
"""The control protocol's version, in HELLO and AUTH: both sides must speak the same one (1: the token
in HELLO, no version field; 2: mutual challenge-response, MACed WELCOME and manifest; 3: stages listed in
the manifest, the delta base in its own header field)."""
NONCE_BYTES = 32
SENDER, RECEIVER, SESSION = b"refit-sender", b"refit-receiver", b"refit-session"


def nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def _mac(token: str, role: bytes, receiver_nonce: bytes, sender_nonce: bytes) -> bytes:
    msg = b"|".join([role, receiver_nonce, sender_nonce, str(PROTOCOL_VERSION).encode()])
    return hmac.new(token.encode(), msg, hashlib.sha256).digest()


def proof(token: str, role: bytes, receiver_nonce: bytes, sender_nonce: bytes) -> str:
    """The proof `role` (SENDER or RECEIVER) sends, hex."""
    return _mac(token, role, receiver_nonce, sender_nonce).hex()


def verify(token: str, role: bytes, receiver_nonce: bytes, sender_nonce: bytes, claimed: object) -> bool:
    """Whether `claimed` is `role`'s proof for these nonces (constant time); False for any other value, never raises."""
    # compare_digest raises TypeError on non-ASCII text, which any stranger can send before it is authenticated.
    if not isinstance(claimed, str) or len(claimed) != 64 or not claimed.isascii():
        return False
    return hmac.compare_digest(proof(token, role, receiver_nonce, sender_nonce), claimed)


def session_key(token: str, receiver_nonce: bytes, sender_nonce: bytes) -> bytes:
    return _mac(token, SESSION, receiver_nonce, sender_nonce)


def tag(key: bytes, what: bytes, data: bytes) -> bytes:
    """16-byte MAC of `data` under the session key, for the header's digest field; `what` names the message."""
    return hmac.new(key, what + b"|" + data, hashlib.sha256).digest()[:16]


def check_tag(key: bytes, what: bytes, data: bytes, claimed: bytes) -> bool:
    return hmac.compare_digest(tag(key, what, data), claimed)


def parse_nonce(value: object) -> bytes | None:
    """A peer's nonce from its hex form, or None when it is not one."""
    if not isinstance(value, str) or len(value) != 2 * NONCE_BYTES:
        return None
    try:
        return bytes.fromhex(value)
    except ValueError:
        return None


def manifest_binding(epoch: int, digest: bytes) -> bytes:
    """What MANIFEST's MAC covers: its epoch and digest."""
    return b"%d|" % epoch + digest
