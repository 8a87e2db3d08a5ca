"""Protocol: the wire format (header, framing, control channel) and the sender's lobby; docs/PROTOCOL.md is its spec."""
