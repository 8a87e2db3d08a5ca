"""Checks: one module per check (the digest kernels, per-bucket checksums, manifest validation
against an engine, bitwise fingerprints)."""
