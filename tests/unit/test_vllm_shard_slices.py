"""Shard statements from a recording, without vLLM: which one slice of a checkpoint tensor a worker's
recorded copies read, and the same copies addressed within that slice (`integrations/vllm/shards.py`)."""

from __future__ import annotations

import pytest
import torch

from refit.integrations.vllm.recording import Strided
from refit.integrations.vllm.shards import box, localize, slice_shape, statement
from refit.layout.spec import Slice


def _view(t: torch.Tensor) -> Strided:
    """What the recording keeps for a copy that reads `t`, a view of a contiguous full tensor."""
    return Strided(tuple(t.shape), tuple(t.stride()), t.storage_offset())


FULL = torch.arange(12 * 8).view(12, 8)


@pytest.mark.parametrize(
    ("views", "expected"),
    [
        ([FULL[3:6]], Slice(0, 3, 3)),  # column-parallel: rows of its part
        ([FULL[:, 4:]], Slice(1, 4, 4)),  # row-parallel: columns of its part
        ([FULL[0:2], FULL[2:5]], Slice(0, 0, 5)),  # two copies of adjacent rows (vocab, merged runs)
        ([FULL[2:6], FULL[4:8]], Slice(0, 2, 6)),  # overlapping copies (one part loaded twice)
        ([FULL[9:12]], Slice(0, 9, 3)),  # a padded last shard reads fewer rows
        ([FULL[:, 4:].t()], Slice(1, 4, 4)),  # read transposed
        ([FULL[2:4].view(2, 2, 4)], Slice(0, 2, 2)),  # read through a reshaped view
    ],
)
def test_copies_that_read_one_slice_state_that_slice(views: list[torch.Tensor], expected: Slice) -> None:
    assert statement([_view(v) for v in views], FULL.shape) == (expected, "")


@pytest.mark.parametrize(
    ("views", "why"),
    [
        ([FULL], ""),  # replicated: norms, k/v with fewer heads than workers
        ([FULL[:6], FULL[6:]], ""),  # all of it, in parts
        ([FULL[0:2], FULL[5:7]], "gap"),
        ([FULL[0:2], FULL[:, 0:2]], "along dims"),
        ([FULL[2:4, 1:3]], "narrow along dims"),
        ([FULL[::2]], "not a box"),  # every other row
        ([FULL[2:4].reshape(-1)[3:9]], "not a box"),  # part of a row, then part of the next
        ([], ""),
    ],
)
def test_copies_that_read_no_single_slice_state_the_whole_tensor(views: list[torch.Tensor], why: str) -> None:
    part, reason = statement([_view(v) for v in views], FULL.shape)
    assert part is None and why in reason and bool(reason) == bool(why)


@pytest.mark.parametrize(
    ("shape", "part", "cut"),
    [
        ((12, 8), Slice(0, 3, 6), lambda t: [t[3:5], t[5:9], t[4:6].t()]),
        ((12, 8), Slice(1, 2, 4), lambda t: [t[:, 2:6], t[:, 2:4], t[1:7, 2:6].t()]),
        ((4, 6, 5), Slice(1, 2, 3), lambda t: [t[:, 2:5], t[1:3, 3:5, 1:4]]),
        ((4, 6, 5), Slice(2, 1, 3), lambda t: [t[:, :, 1:4], t[2, :, 2:3]]),
        ((4, 6, 5), Slice(0, 1, 2), lambda t: [t[1:3].reshape(2, 30), t[1:3].reshape(60)]),
    ],
)
def test_localized_copies_read_the_same_values_from_the_slice_alone(shape, part: Slice, cut) -> None:  # noqa: ANN001
    full = torch.arange(torch.Size(shape).numel()).view(shape)
    sliced = full.narrow(part.dim, part.start, part.length).contiguous().reshape(-1)
    assert sliced.numel() == torch.Size(slice_shape(shape, part)).numel()
    for v in cut(full):
        local = localize(_view(v), shape, part)
        assert local is not None
        assert torch.equal(local.of(sliced), v)


def test_a_view_is_not_localized_outside_its_slice_or_across_rows() -> None:
    assert localize(_view(FULL[1:4]), FULL.shape, Slice(0, 2, 4)) is None  # row 1 lies outside
    assert localize(_view(FULL[2:4].reshape(-1)), FULL.shape, Slice(0, 2, 2)) is not None
    assert localize(Strided((16,), (1,), 16), FULL.shape, Slice(0, 2, 2)) == Strided((16,), (1,), 0)
    assert localize(Strided((16,), (1,), 0), (2, 4, 8), Slice(1, 0, 2)) is None  # its steps carry across rows


def test_box_names_the_index_ranges_a_view_reads() -> None:
    assert box(_view(FULL[3:6, 2:5]), FULL.shape) == ((3, 6), (2, 5))
    assert box(_view(FULL[3:6, ::2]), FULL.shape) is None
    assert box(Strided((4, 8), (0, 1), 8), FULL.shape) == ((1, 2), (0, 8))  # one row broadcast four times
