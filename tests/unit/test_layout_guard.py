"""LayoutGuard and the tensor guards behind it: a snapshot holds exactly while no tensor moved, reshaped,
restrided or recast, with the compiled check, with TensorGuards and with the Python fallback; ModuleSource's
signature stays the very same object (its tensors not even re-read) only while nothing it read moved."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from refit import ModuleSource
from refit.layout import packing
from refit.layout.packing import LayoutGuard
from refit.layout.tensor_guard import layout_snapshot, tensor_guard
from refit.sources import module

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


CHECKS = ["compiled", "tensor-guards", "python"]


def _use(check: str, monkeypatch) -> None:
    """Take LayoutGuard (and ModuleSource) down to `check`: the compiled helper, TensorGuards, or Python."""
    if check != "compiled":
        monkeypatch.setattr(packing, "layout_snapshot", lambda ts, identity=True: None)
        monkeypatch.setattr(module, "layout_snapshot", lambda ts, identity=True: None)
    if check == "python":
        monkeypatch.setattr(packing, "tensor_guard", lambda ts: None)


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("how", sorted(CHANGES))
def test_a_layout_guard_fails_after_each_kind_of_change(how: str, check: str, monkeypatch) -> None:
    _use(check, monkeypatch)
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


def test_the_compiled_layout_check_is_in_use_on_this_machine() -> None:
    assert layout_snapshot(_tensors()) is not None
    assert layout_snapshot([]) is None and layout_snapshot([_tensors()[0].as_subclass(_Sub)]) is None


def test_the_compiled_check_fails_when_a_freed_storage_is_replaced_at_the_same_address() -> None:
    """Offload and reload can hand a tensor new memory at its old address: the storage it had died, so the
    snapshot fails (its storages are held weakly), though address, layout and object are all the same."""
    memory = bytearray(1 << 20)
    ts = [torch.frombuffer(memory, dtype=torch.float32)]
    guard, same, address = LayoutGuard(ts), layout_snapshot(ts), ts[0].data_ptr()
    assert same is not None and guard.holds(ts) and same(ts)
    ts[0].data = torch.empty(0)  # the storage dies ...
    ts[0].data = torch.frombuffer(memory, dtype=torch.float32)  # ... and a new one takes its very address
    assert ts[0].data_ptr() == address
    assert not guard.holds(ts) and not same(ts)


def test_a_layout_guard_holds_for_a_fresh_view_of_the_same_memory_and_the_identity_check_does_not() -> None:
    """LayoutGuard's callers may hand it new view objects each time (an engine's `.data`): only memory and layout
    count there; the source's cache needs the very objects it keeps."""
    ts = _tensors()
    views = [t.detach() for t in ts]
    assert LayoutGuard(ts).holds(views)
    same = layout_snapshot(ts)
    assert same is not None and same(ts) and same(tuple(ts)) and not same(views)


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("how", sorted(CHANGES))
def test_module_source_signature_is_reused_only_while_nothing_moved(how: str, check: str, monkeypatch) -> None:
    _use(check, monkeypatch)
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


MAPPING_CHANGES: dict[str, Callable[[dict[str, torch.Tensor]], None]] = {
    "same-memory-object": lambda w: w.__setitem__("t3", w["t3"].detach()),
    "parameter": lambda w: w.__setitem__("t3", torch.nn.Parameter(w["t3"].detach())),
    "data-assigned": lambda w: setattr(w["t3"], "data", torch.randn(4, 4)),
    "renamed": lambda w: w.__setitem__("u", w.pop("t3")),
    "reordered": lambda w: w.__setitem__("t3", w.pop("t3")),
    "removed": lambda w: w.pop("t3"),
}


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("how", sorted(MAPPING_CHANGES))
def test_module_source_reads_its_mapping_again_after_each_change_and_sends_what_it_holds_now(
    how: str, check: str, monkeypatch
) -> None:
    """The compiled check does not re-read a plain dict while it holds: it must fail for every change of what the
    dict holds, even a new object over the same memory, so that `tensors()` always returns the dict's own."""
    _use(check, monkeypatch)
    weights = {f"t{i}": t for i, t in enumerate(_tensors())}
    source = ModuleSource(weights)
    first = source.signature()
    weights["t0"].mul_(2.0)  # values alone: the same signature, not re-read
    assert source.signature() is first
    MAPPING_CHANGES[how](weights)
    second = source.signature()
    # the fallbacks re-read every time, so may keep the signature where only the object (not its memory) changed
    assert second is not first or (check != "compiled" and how in ("same-memory-object", "parameter"))
    names = list(weights)
    assert all(a is b for a, b in zip(source.tensors(names), weights.values()))
    assert source.signature() is source.signature()


@pytest.mark.parametrize("check", CHECKS)
def test_a_module_sources_signature_follows_a_replaced_parameter_and_a_data_assignment(check: str, monkeypatch) -> None:
    _use(check, monkeypatch)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    source = ModuleSource(net)
    first = source.signature()
    with torch.no_grad():
        net[0].weight.add_(1.0)
    assert source.signature() is first
    net[0].weight = torch.nn.Parameter(net[0].weight.detach().clone())
    second = source.signature()
    assert second is not first and source.tensors(["0.weight"])[0] is net[0].weight
    net[1].bias.data = torch.zeros(2, dtype=torch.float64)
    third = source.signature()
    assert third is not second and source.tensors(["1.bias"])[0].dtype == torch.float64
    assert source.signature() is third
