"""The fingerprint digest: equal to its definition on every path (CPU rows, small batches, the Triton
kernel, CUDA), and changed by any change or move of a word."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from refit.checks.digest import ROW_WORDS, M, Pending


def _reference(t: torch.Tensor) -> str:
    """The definition, in plain Python integers."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().clone()
    n = raw.numel()
    words = torch.cat([raw, raw.new_zeros(-n % 8)]).view(torch.int64).tolist()
    value = (M * sum(i * w for i, w in enumerate(words)) + sum(words) + n) % (1 << 64)
    return f"{value:016x}"


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    big = torch.randn(ROW_WORDS * 2 + 37, generator=g, dtype=torch.float64)  # whole rows and a remainder
    return [
        torch.randn(64, 48, generator=g),
        torch.randn(3, generator=g).to(torch.bfloat16),  # 6 bytes: one partial word
        big,
        torch.zeros(0),
        torch.randn(7001, generator=g).to(torch.bfloat16)[1:],  # starts 2 bytes into its storage
        torch.randn(5, 7, generator=g).t(),  # not contiguous
        torch.randint(-(2**62), 2**62, (40,), generator=g),  # sums that wrap
    ]


def _hexes(tensors: list[torch.Tensor]) -> list[str]:
    pending = Pending()
    pending.add(tensors)
    return pending.hexes()


def test_every_path_equals_the_definition() -> None:
    tensors = _tensors()
    assert _hexes(tensors) == [_reference(t) for t in tensors]
    assert _hexes(tensors[2:3]) == [_reference(tensors[2])]  # alone: the row path; above: the same value


def test_a_changed_moved_or_transposed_word_changes_the_digest() -> None:
    base = torch.randn(96, 64, generator=torch.Generator().manual_seed(1))
    swapped = base.clone().view(-1)
    swapped[[10, 500]] = swapped[[500, 10]]
    nudged = base.clone()
    nudged[3, 3] = torch.nextafter(nudged[3, 3], torch.tensor(1e9))
    shifted = torch.roll(base.view(-1), 2).view(96, 64)
    variants = [base, base.t().contiguous(), swapped.view(96, 64), nudged, shifted, base[:, :63]]
    assert len(set(_hexes(variants))) == len(variants)


_KERNEL = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
import test_digest as t
from refit.checks import digest
assert digest.available(torch.device("cpu")), "Triton's interpreter is not active"
tensors = [x for x in t._tensors() if x.numel() < 100_000]  # the interpreter runs each program in Python
print("OK" if t._hexes(tensors) == [t._reference(x) for x in tensors] else "MISMATCH")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a CUDA machine the gpu test runs the compiled kernel")
def test_the_triton_kernel_equals_the_definition_under_the_interpreter() -> None:
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run(
        [sys.executable, "-c", _KERNEL, os.path.dirname(__file__)], env=env, capture_output=True, text=True
    )
    assert r.returncode == 0 and r.stdout.strip() == "OK", r.stderr[-2000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_digests_equal_the_cpu_ones_bit_for_bit() -> None:
    """Mixed (regular tensors through the address table, the others as copied bytes), then regular ones alone."""
    tensors = _tensors() + [torch.randn(3 << 20).to(torch.bfloat16)]
    assert _hexes([t.cuda() for t in tensors]) == _hexes(tensors)
    regular = [t.cuda() for t in tensors if t.is_contiguous() and t.nbytes % 8 == 0]
    assert len(regular) >= 4 and all(t.data_ptr() % 8 == 0 for t in regular)
    assert _hexes(regular) == [_reference(t) for t in regular]


def test_many_small_whole_word_tensors_take_the_flat_path_and_equal_the_definition() -> None:
    """Whole-word tensors of mixed dtypes and layouts, flattened per dtype in one C call each."""
    g = torch.Generator().manual_seed(1)
    base = torch.randn(9, 16, generator=g)
    tensors = [
        *(torch.randn(4 * k + 4, generator=g).to(torch.bfloat16) for k in range(50)),
        base.t(),  # not contiguous: its logical order, not its storage order
        base[2:5],  # a storage offset
        torch.tensor(7, dtype=torch.int64),  # 0-dim
        torch.zeros(0, 3),
        torch.randint(-(2**62), 2**62, (16,), generator=g),
        torch.randn(8, generator=g).to(torch.float16).expand(2, 8),
    ]
    assert _hexes(tensors) == [_reference(t) for t in tensors]
    from refit.checks import digest

    assert digest._digests_flat(tensors, torch.device("cpu")) is not None  # the path under test
