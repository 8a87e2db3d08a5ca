"""Budget: the bucket capacity is the smallest of the explicit bytes or memory share and the model's need."""

from __future__ import annotations

import pytest
import torch

from refit.layout.budget import bucket_capacity, needed_bytes
from refit.layout.planner import plan
from refit.layout.spec import TensorSpec

SPECS = [
    TensorSpec("a", (10,), torch.float32),
    TensorSpec("b", (300,), torch.bfloat16),
    TensorSpec("c", (1,), torch.int8),
]


def test_needed_bytes_is_one_bucket_holding_every_aligned_tensor() -> None:
    need = needed_bytes(SPECS)
    assert need == 256 + 768 + 256
    m = plan(SPECS, capacity=need)
    assert m.num_buckets == 1 and m.bucket_nbytes == (need,)


@pytest.mark.parametrize(
    "bucket_bytes, free, expected",
    [(None, 100 << 30, 1280), (1 << 30, 0, 1280), (512, 0, 512), (None, 10 << 10, 1024)],
    ids=["ratio-above-model", "bytes-above-model", "bytes-below-model", "ratio-below-model"],
)
def test_capacity_is_capped_at_what_the_model_needs(bucket_bytes: int | None, free: int, expected: int) -> None:
    cap = bucket_capacity(bucket_bytes=bucket_bytes, ratio=0.2, free=free, needed=needed_bytes(SPECS))
    assert cap == expected


def test_an_empty_model_still_gets_one_aligned_bucket() -> None:
    assert bucket_capacity(bucket_bytes=None, ratio=0.2, free=1 << 30, needed=0) == 256
