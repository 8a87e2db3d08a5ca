"""Bucket capacity over real processes: sized to the model at connect, and a model that grows later
takes more buckets of that size, still bitwise exact."""

from __future__ import annotations

import pytest
import torch
from sessions import live_fingerprints, session

from refit.layout.budget import needed_bytes

SPECS = [
    ["embed.weight", [40, 16], "float32"],
    ["layer.0.bias", [7], "float32"],
    ["layer.0.weight", [16, 16], "float32"],
    ["layer.1.weight", [48, 48], "float32"],
]


@pytest.mark.slow
def test_buffers_are_sized_to_the_model_not_to_the_budget(transport: str) -> None:
    with session(SPECS, transport=transport, bucket_bytes=64 << 20, wire_dtype=torch.bfloat16) as (
        sender,
        tensors,
        (peer,),
    ):
        stats = sender.refit(1)
        assert peer.report()["fingerprints"] == live_fingerprints(tensors, sender.manifest)
        assert sender.manifest is not None and sender.transport is not None
        total = sum(sender.manifest.bucket_nbytes)
        assert sender.capacity == total == needed_bytes(sender.source.specs())
        assert stats.num_buckets == 1
        buffers = sum(b.numel() for b in sender.transport.buffers)
        assert buffers <= 2 * total  # not 2 x 64 MiB


def test_a_model_that_grows_after_the_first_refit_takes_more_buckets_and_stays_exact(transport: str) -> None:
    with session(SPECS, transport=transport, bucket_bytes=64 << 20, wire_dtype=torch.bfloat16) as (
        sender,
        tensors,
        (peer,),
    ):
        first = sender.refit(1)
        peer.report()
        capacity = sender.capacity
        for name in ("embed.weight", "layer.1.weight"):  # the demo's switch to fp32, on the largest tensors
            sender.source.set_wire_dtype(name, torch.float32)
        for t in tensors.values():
            t.mul_(1.01).add_(0.001)
        second = sender.refit(2)
        report = peer.report()
        assert sender.manifest is not None
        assert report["fingerprints"] == live_fingerprints(tensors, sender.manifest)
        assert (report["state"], report["version"]) == ("current", 2)
        assert second.handshake and second.epoch == first.epoch + 1
        assert sender.capacity == capacity == sender.manifest.capacity
        assert first.num_buckets == 1 < second.num_buckets
        assert sender.manifest.max_split_nbytes > 0  # a grown tensor runs on into the next bucket
        for t in tensors.values():
            t.add_(0.5)
        third = sender.refit(3)
        assert peer.report()["fingerprints"] == live_fingerprints(tensors, sender.manifest)
        assert not third.handshake
