"""Checks, one module each, named for what it checks: tensor_digest (the fingerprint digest of tensors),
copy_digest and copy_digest_cuda (a copy and its digest in one pass), bucket_checksum (per-bucket checksums),
manifest_check (a manifest against an engine's tensors) and fingerprints (bitwise fingerprints of weights)."""
