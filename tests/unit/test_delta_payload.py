"""The delta payload (refit.stages.delta, docs/PROTOCOL.md "Delta refits"): exact bytes, a round trip through
the sender's and a receiver's images for odd sizes and several blocks, and hostile payloads refused before a
byte of the image is written."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from refit.errors import IntegrityError
from refit.layout.planner import plan
from refit.layout.spec import TensorSpec
from refit.stages.delta import BLOCK, REPRIME, Costs, WireImage, payload_nbytes, table_nbytes


def _images(nbytes: int) -> tuple[WireImage, WireImage]:
    """The images of one bucket of `nbytes` (a planned bucket's size is a multiple of the alignment; an odd
    one is taken by the format too, so it is tested on a layout that names only the bucket's size)."""
    m = SimpleNamespace(bucket_nbytes=(nbytes,))
    return WireImage(m, torch.device("cpu")), WireImage(m, torch.device("cpu"))  # type: ignore[arg-type]


def test_a_planned_bucket_gets_an_image_of_its_size() -> None:
    m = plan([TensorSpec("a", (3,), torch.uint8), TensorSpec("b", (300,), torch.float16)], capacity=1024, epoch=1)
    assert WireImage(m, torch.device("cpu")).nbytes == sum(m.bucket_nbytes)


def _buf(new: torch.Tensor) -> torch.Tensor:
    buf = torch.zeros(new.numel() + 64, dtype=torch.uint8)
    buf[: new.numel()] = new
    return buf


def _prime(sender: WireImage, receiver: WireImage, now: torch.Tensor) -> None:
    """A full refit: both images keep the bucket."""
    sender.absorb(0, _buf(now))
    receiver.absorb(0, _buf(now))


def _send(sender: WireImage, receiver: WireImage, new: torch.Tensor, threshold: float = 0.5) -> int | None:
    """One bucket of a delta refit, as the send and receive paths move it; the payload's size (None: full)."""
    buf = _buf(new)
    size, kept = sender.encode(0, buf, threshold=threshold)
    if size is not None:
        receiver.decode(0, buf, size)
    elif kept:
        receiver.absorb(0, buf)
    else:
        receiver.kept[0] = False
    return size


def test_the_payload_is_count_block_counts_offsets_then_units() -> None:
    sender, _ = _images(64)
    sender.absorb(0, torch.zeros(64, dtype=torch.uint8))
    buf = torch.zeros(64, dtype=torch.uint8)
    buf[2], buf[7] = 0xAB, 0xCD  # units 1 and 3 of 32
    size, _ = sender.encode(0, buf, threshold=1.0)
    assert size == payload_nbytes(64, 2) == 20
    expected = (
        (2).to_bytes(8, "little")  # count
        + (2).to_bytes(4, "little")  # block 0 holds both
        + (1).to_bytes(2, "little")
        + (3).to_bytes(2, "little")  # their offsets (16 bytes so far: no padding to 8)
        + bytes([0xAB, 0x00, 0x00, 0xCD])  # units 1 and 3, as they are now
    )
    assert bytes(buf[:size].tolist()) == expected


@pytest.mark.parametrize("nbytes", [1, 7, 2 * BLOCK * 2 + 3])
def test_a_round_trip_leaves_both_images_equal_to_the_bytes_sent(nbytes: int) -> None:
    sender, receiver = _images(nbytes)
    g = torch.Generator().manual_seed(nbytes)
    now = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    _prime(sender, receiver, now)
    for _ in range(3):
        at = torch.randperm(nbytes, generator=g)[: max(1, nbytes // 97)]
        now = now.clone()
        now[at] ^= 0x5A
        now[-1] ^= 1  # the last (possibly odd) byte changes too
        _send(sender, receiver, now)
        for image in (sender, receiver):
            assert torch.equal(image.images[0][:nbytes], now)


def test_an_unchanged_bucket_moves_its_table_alone_and_a_dense_one_goes_full_unkept_for_a_while() -> None:
    sender, receiver = _images(4 * BLOCK)
    now = torch.arange(4 * BLOCK, dtype=torch.int64).to(torch.uint8)
    _prime(sender, receiver, now)
    assert _send(sender, receiver, now) == table_nbytes(4 * BLOCK, 0)
    assert _send(sender, receiver, now + 1) is None  # the sample says dense: no whole comparison, no copy
    assert not sender.kept[0] and not receiver.kept[0]
    for _ in range(REPRIME):  # not compared while it is stale; the REPRIME-th is kept again
        assert _send(sender, receiver, now + 1) is None
    assert sender.kept[0] and receiver.kept[0]
    now[5] = 0
    assert _send(sender, receiver, now + 1) == payload_nbytes(4 * BLOCK, 1)
    assert torch.equal(receiver.images[0][: now.numel()], now + 1)


def test_a_delta_of_a_bucket_the_receiver_does_not_keep_is_refused() -> None:
    _, receiver = _images(64)
    with pytest.raises(IntegrityError, match="does not keep that bucket"):
        receiver.decode(0, torch.zeros(64, dtype=torch.uint8), 8)


def _payload(nbytes: int) -> tuple[WireImage, torch.Tensor, int]:
    sender, receiver = _images(nbytes)
    _prime(sender, receiver, torch.zeros(nbytes, dtype=torch.uint8))
    buf = torch.zeros(nbytes + 64, dtype=torch.uint8)
    buf[10], buf[300] = 1, 2
    size, _ = sender.encode(0, buf, threshold=1.0)
    assert size is not None
    return receiver, buf, size


@pytest.mark.parametrize(
    ("hack", "message"),
    [
        (lambda b, size: (b[:8].view(torch.int64).fill_(3), size), "disagree"),
        (lambda b, size: (b[:8].view(torch.int64).fill_(-1), size), "disagree"),
        (lambda b, size: (None, size + 8), "disagree"),
        (lambda b, size: (None, 4), "no delta payload"),
        (lambda b, size: (b[8:12].view(torch.int32).fill_(1), size), "do not add up"),
        (lambda b, size: (b[12:14].view(torch.int16).fill_(150), size), "not increasing"),
        (lambda b, size: (b[14:16].view(torch.int16).fill_(-1), size), "not increasing"),
    ],
)
def test_a_hostile_payload_is_refused_before_the_image_is_written(hack, message: str) -> None:  # noqa: ANN001
    receiver, buf, size = _payload(1024)
    before = receiver.images[0].clone()
    _, size = hack(buf, size)
    with pytest.raises(IntegrityError, match=message):
        receiver.decode(0, buf, size)
    assert torch.equal(receiver.images[0], before)


def test_the_costs_fit_the_scan_as_per_op_plus_per_byte_and_the_link_per_byte() -> None:
    costs = Costs()
    assert costs.link is None and costs.scan(1 << 20) is None
    for nbytes in (1 << 20, 4 << 20, 2 << 20):
        costs.scanned(nbytes, 1e-3 + nbytes * 1e-9)
        costs.moved(nbytes, nbytes * 4e-9)
    assert costs.scan(8 << 20) == pytest.approx(1e-3 + (8 << 20) * 1e-9)
    assert costs.link == pytest.approx(4e-9)
    costs.set(link=1.0, per_op=2.0, per_byte=0.0)
    costs.moved(1, 5.0)
    assert costs.link == 1.0 and costs.scan(123) == 2.0
