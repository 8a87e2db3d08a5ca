"""LayoutGuard and the tensor guard behind it: a snapshot holds exactly while no tensor moved, reshaped,
restrided or recast, with the batched C check and with its fallback; ModuleSource's signature stays the
very same object only while its guard holds."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from refit import ModuleSource
from refit.layout import packing
from refit.layout.packing import LayoutGuard
from refit.layout.tensor_guard import tensor_guard

CHANGES: dict[str, Callable[[list[torch.Tensor]], None]] = {
    "storage": lambda ts: ts[3].set_(torch.zeros(4, 4)),
    "offset": lambda ts: ts[3].set_(torch.zeros(40).untyped_storage(), 8, (4, 4), (4, 1)),
    "restride": lambda ts: ts[3].as_strided_((4, 4), (1, 4)),
    "reshape-same-numel": lambda ts: setattr(ts[3], "data", ts[3].data.view(2, 8)),
    "resize": lambda ts: ts[3].resize_(3, 4),
    "dtype": lambda ts: setattr(ts[3], "data", ts[3].data.double()),
    "identity": lambda ts: ts.__setitem__(3, ts[3].clone()),
    "count": lambda ts: ts.append(torch.zeros(1)),
    "neg-view": lambda ts: ts.__setitem__(3, ts[3]._neg_view()),
}


def _tensors() -> list[torch.Tensor]:
    return [torch.randn(4, 4) for _ in range(6)]


@pytest.mark.parametrize("batched", [True, False])
@pytest.mark.parametrize("how", sorted(CHANGES))
def test_a_layout_guard_fails_after_each_kind_of_change(how: str, batched: bool, monkeypatch) -> None:
    if not batched:
        monkeypatch.setattr(packing, "tensor_guard", lambda ts: None)
    ts = _tensors()
    guard = LayoutGuard(ts)
    assert guard.holds(ts) and guard.holds(list(ts))
    ts[0].add_(1.0)  # values alone never matter to a layout
    assert guard.holds(ts)
    CHANGES[how](ts)
    assert not guard.holds(ts)


class _Sub(torch.Tensor):
    pass


@pytest.mark.parametrize("wrap", [torch.nn.Parameter, lambda t: t.as_subclass(_Sub)])
def test_the_batched_guard_fails_for_another_tensor_type_in_the_same_memory(wrap: Callable) -> None:
    """So `LayoutGuard.holds` needs no separate check that every tensor is still a plain one."""
    ts = _tensors()
    guard = LayoutGuard(ts)
    ts[2] = wrap(ts[2])
    assert not guard.holds(ts)


def test_the_batched_tensor_guard_is_in_use_on_this_torch() -> None:
    assert tensor_guard(_tensors()) is not None
    assert tensor_guard([]) is None


@pytest.mark.parametrize("how", sorted(CHANGES))
def test_module_source_signature_is_reused_only_while_nothing_moved(how: str) -> None:
    ts = _tensors()
    weights = {f"t{i}": t for i, t in enumerate(ts)}
    source = ModuleSource(weights)
    first = source.signature()
    assert source.signature() is first
    CHANGES[how](ts)
    weights.update({f"t{i}": t for i, t in enumerate(ts)})
    second = source.signature()
    assert second is not first and second != first
    assert source.signature() is second
