"""The delta stage's Triton kernels (refit.layout.delta_kernel) give the PyTorch path's payload bit for bit: the
same choice (delta, or full and why), the same payload bytes in the slot, the same images on both sides, and the
same refusal of a hostile payload. Natively on CUDA; on a machine without it, under Triton's interpreter in a
subprocess (TRITON_INTERPRET=1), where the kernels take CPU tensors."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from refit.errors import IntegrityError
from refit.layout import delta_kernel
from refit.stages.delta import BLOCK, SAMPLE, UNIT, WireImage

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(HERE, "..", "..", "src")
PAD = 64
"""Slot bytes after the bucket's (a slot's capacity is at least its bucket's)."""
EDGES = [
    1,
    2,
    3,
    7,
    8,
    9,
    63,
    UNIT * delta_kernel.CHUNK - 1,
    UNIT * delta_kernel.CHUNK + 1,
    UNIT * BLOCK - 1,
    UNIT * BLOCK + 3,
]
"""Bucket sizes around a unit, a word, a chunk of the compare and a block of the table."""
SAMPLED = UNIT * 64 * SAMPLE
"""The smallest bucket whose sample is compared first."""


def _image(nbytes: int, device: str, base: torch.Tensor) -> WireImage:
    image = WireImage(SimpleNamespace(bucket_nbytes=(nbytes,)), torch.device(device))  # type: ignore[arg-type]
    image.absorb(0, _slot(base))
    return image


def _slot(now: torch.Tensor) -> torch.Tensor:
    """A slot holding `now`, and after it bytes of another bucket (never part of this one's units)."""
    slot = torch.full((now.numel() + PAD,), 0xA5, dtype=torch.uint8, device=now.device)
    slot[: now.numel()] = now
    return slot


def _encoded(base: torch.Tensor, now: torch.Tensor, threshold: float, *, kernel: bool) -> tuple:
    """What the sender's encode leaves: (payload size, kept, reason, slot bytes, image bytes)."""
    sender, slot = _image(base.numel(), str(base.device), base), _slot(now)
    with mock.patch.object(delta_kernel, "scans", delta_kernel.scans if kernel else lambda *a: False):
        size, kept = sender.encode(0, slot, threshold=threshold)
    return size, kept, sender.reason, slot.cpu(), sender.images[0].cpu()


def _decoded(base: torch.Tensor, slot: torch.Tensor, size: int, *, kernel: bool) -> torch.Tensor:
    receiver = _image(base.numel(), str(base.device), base)
    with mock.patch.object(delta_kernel, "scatters", delta_kernel.scatters if kernel else lambda *a: False):
        receiver.decode(0, slot.to(base.device), size)
    return receiver.images[0].cpu()


def agree(base: torch.Tensor, now: torch.Tensor, threshold: float) -> None:
    """Kernels and PyTorch path encode `now` against `base` alike, and a receiver decodes it alike, to `now`."""
    assert delta_kernel.scans(_slot(now), _slot(base), now.numel()), "the kernels do not take this bucket"
    got, want = _encoded(base, now, threshold, kernel=True), _encoded(base, now, threshold, kernel=False)
    assert got[:3] == want[:3], (now.numel(), got[:3], want[:3])
    assert torch.equal(got[3], want[3]), f"slot bytes differ for a bucket of {now.numel()}: {got[:3]}"
    assert torch.equal(got[4], want[4]), f"sender images differ for a bucket of {now.numel()}"
    padded = torch.cat([now.cpu(), torch.zeros(now.numel() % UNIT, dtype=torch.uint8)])
    assert torch.equal(got[4], padded) or not got[1]  # a bucket no longer kept keeps its old image
    if got[0] is not None:
        image = _decoded(base, got[3], got[0], kernel=True)
        assert torch.equal(image, _decoded(base, got[3], got[0], kernel=False)) and torch.equal(image, padded)


def changed(base: torch.Tensor, how: str, seed: int) -> torch.Tensor:
    """`base` with: nothing changed, every unit, a few bytes, the first and last byte, or a random fraction."""
    g = torch.Generator().manual_seed(seed)
    now, nb = base.clone(), base.numel()
    if how == "every":
        now ^= 0x81  # both bytes of every unit (and the odd last byte)
    elif how == "few":
        now[torch.randint(0, nb, (1 + seed % 5,), generator=g).to(now.device)] ^= 0x40
    elif how == "ends":
        now[0] ^= 1
        now[-1] ^= 0x80
    elif how == "fraction":
        keep = torch.rand(nb, generator=g) < (seed % 100) / 100
        now[keep.to(now.device)] += 1
    return now


def _base(nbytes: int, seed: int, device: str) -> torch.Tensor:
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)).to(device)


HOWS = ("none", "every", "few", "ends", "fraction")


def fixed_cases(
    device: str, sizes: list[int], hows: tuple[str, ...] = HOWS, thresholds: tuple[float, ...] = (1.0, 0.25)
) -> None:
    """Each of `hows` on buckets of `sizes`, by default at a threshold that lets small buckets go as deltas and
    at the default."""
    for i, nb in enumerate(sizes):
        base = _base(nb, i, device)
        for how in hows:
            for threshold in thresholds:
                agree(base, changed(base, how, 1000 * i + 37), threshold)


def hostile_cases(device: str) -> None:
    """A malformed payload is refused by the kernels as by the PyTorch path, with the same words, and the
    image is left untouched."""
    hacks = [
        (lambda s: s[8:12].view(torch.int32).fill_(1), "do not add up"),
        (lambda s: s[8:12].view(torch.int32).fill_(-2), "do not add up"),
        (lambda s: s[12:14].view(torch.int16).fill_(150), "not increasing"),
        (lambda s: s[14:16].view(torch.int16).fill_(-1), "not increasing"),
        (lambda s: s[14:16].view(torch.int16).fill_(600), "not increasing"),  # past the bucket's 512 units
    ]
    base = torch.zeros(1024, dtype=torch.uint8, device=device)
    now = base.clone()
    now[10], now[300] = 1, 2
    size, *_, slot, _ = _encoded(base, now, 1.0, kernel=True)
    for hack, message in hacks:
        for kernel in (True, False):
            bad = slot.clone()
            hack(bad)
            receiver = _image(1024, device, base)
            with mock.patch.object(delta_kernel, "scatters", delta_kernel.scatters if kernel else lambda *a: False):
                with pytest.raises(IntegrityError, match=message):
                    receiver.decode(0, bad.to(device), size)
            assert torch.equal(receiver.images[0], base), (message, kernel)


@st.composite
def _buckets(draw: st.DrawFn, largest: int) -> tuple[int, str, int, float]:
    nb = draw(st.one_of(st.sampled_from([n for n in EDGES if n <= largest]), st.integers(1, largest)))
    how = draw(st.sampled_from(["none", "every", "few", "ends", "fraction"]))
    return nb, how, draw(st.integers(0, 1 << 20)), draw(st.sampled_from([1.0, 0.25, 0.05]))


def drawn_cases(device: str, *, examples: int, largest: int) -> None:
    """`agree` over hypothesis-drawn buckets."""

    @settings(max_examples=examples, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(case=_buckets(largest))
    def run(case: tuple[int, str, int, float]) -> None:
        nb, how, seed, threshold = case
        base = _base(nb, seed, device)
        agree(base, changed(base, how, seed), threshold)

    run()


def _interpreted(*calls: str) -> None:
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the kernels are checked on the device")
    path = os.pathsep.join(filter(None, [SRC, HERE, os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    script = "import test_delta_kernel as t\n" + "".join(f"t.{c}\n" for c in calls) + "print('ok')"
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), (r.stdout[-2000:], r.stderr[-6000:])


def test_the_kernels_take_only_what_they_can_launch() -> None:
    buf = torch.zeros(64, dtype=torch.uint8)
    assert not delta_kernel.scans(buf, buf.clone(), 64)  # CPU, no interpreter: the PyTorch path
    if not torch.cuda.is_available() or delta_kernel.triton is None:
        return
    buf = buf.cuda()
    assert delta_kernel.scans(buf, buf.clone(), 64)
    assert not delta_kernel.scans(buf[:63], buf.clone(), 63)  # the odd last byte's unit is not in the slot
    assert not delta_kernel.scans(buf[1:], buf[1:].clone(), 8)  # not 2-byte aligned
    assert not delta_kernel.scans(buf, buf.cpu(), 64)
    assert not delta_kernel.scans(buf.view(torch.int16), buf.clone().view(torch.int16), 64)


def test_the_kernels_under_the_interpreter_give_the_payload_of_the_pytorch_path() -> None:
    """Each kind of change (none, every unit, a few, the first and last byte, a fraction) on odd sizes and a
    sampled bucket; a few and the ends on a bucket over two chunks; the hostile payloads."""
    _interpreted(
        f"fixed_cases('cpu', [1, 7, 1001, {SAMPLED + 1}])",
        f"fixed_cases('cpu', [{2 * delta_kernel.CHUNK * UNIT + 3}], ('few', 'ends'), (1.0,))",
        "hostile_cases('cpu')",
    )


@pytest.mark.slow
def test_the_kernels_under_the_interpreter_give_the_payload_of_the_pytorch_path_for_drawn_buckets() -> None:
    _interpreted(f"fixed_cases('cpu', {EDGES})", f"drawn_cases('cpu', examples=60, largest={3 * UNIT * BLOCK + 5})")


def _cuda() -> None:
    if not torch.cuda.is_available() or delta_kernel.triton is None:
        pytest.skip("needs CUDA with Triton")


@pytest.mark.gpu
def test_the_kernels_give_the_payload_of_the_pytorch_path_on_cuda() -> None:
    _cuda()
    fixed_cases("cuda", [*EDGES, SAMPLED - 1, SAMPLED + 1, 3 * UNIT * BLOCK + 5, 50 << 20])
    hostile_cases("cuda")


@pytest.mark.gpu
def test_the_kernels_give_the_payload_of_the_pytorch_path_on_cuda_for_drawn_buckets() -> None:
    _cuda()
    drawn_cases("cuda", examples=300, largest=8 * UNIT * BLOCK + 5)
