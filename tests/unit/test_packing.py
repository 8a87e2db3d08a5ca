"""Packing: casts in the same pass, aligned byte ranges, zero-copy views on the way out."""

from __future__ import annotations

import torch

from refit.layout.packing import Packer, Unpacker
from refit.layout.planner import plan
from refit.layout.spec import TensorSpec


def test_pack_then_unpack_gives_views_into_the_buffer_with_wire_values() -> None:
    src = {"a": torch.randn(5, 3), "b": torch.arange(7, dtype=torch.int64), "c": torch.randn(33)}
    wire = {"a": torch.bfloat16, "b": torch.int64, "c": torch.float32}
    m = plan([TensorSpec.of(n, t, wire[n]) for n, t in src.items()], capacity=512, alignment=64)
    buf = [torch.zeros(512, dtype=torch.uint8)]
    out = {}
    for b in range(m.num_buckets):
        Packer(m, buf).pack(b, 0, [src[m.entries[s.entry].name] for s in m.segments[b]])
        for name, view in Unpacker(m, buf).unpack(b, 0):
            lo, hi = buf[0].data_ptr(), buf[0].data_ptr() + 512
            assert lo <= view.data_ptr() < hi and view.data_ptr() % 64 == 0
            out[name] = view.clone()
    for n, t in src.items():
        assert out[n].dtype == wire[n] and torch.equal(out[n], t.to(wire[n]))


def test_tensor_spanning_buckets_is_staged_and_returned_once_complete() -> None:
    big = torch.randn(300)
    m = plan([TensorSpec.of("big", big)], capacity=512, alignment=64)
    bufs = [torch.zeros(512, dtype=torch.uint8) for _ in range(2)]
    packer, unpacker = Packer(m, bufs), Unpacker(m, bufs)
    seen = []
    for b in range(m.num_buckets):
        packer.pack(b, b % 2, [big] * len(m.segments[b]))
        seen.append(unpacker.unpack(b, b % 2))
    assert [len(s) for s in seen] == [0, 0, 1]
    assert torch.equal(seen[-1][0][1], big)
