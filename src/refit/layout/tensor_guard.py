"""Tensor guard: checks that many plain tensors kept their dtype, device, shape and strides, in one C call.

torch.compile checks its inputs with `torch._C._dynamo.guards.TensorGuards`: a snapshot of each tensor's
dispatch keys, dtype, device, requires_grad, sizes and strides, checked again by one C++ loop (under
0.1 us a tensor, against about 0.35 us for reading shapes and strides through Python). That API is
private, so it is used only after a probe shows, on this torch, that it accepts a snapshot and rejects
each kind of change; otherwise `tensor_guard` returns None and callers compare the metadata themselves.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch

from refit.log import get_logger

log = get_logger("tensor_guard")
Check = Callable[..., bool]
_PLAIN = frozenset({torch.Tensor, torch.nn.Parameter})


def plain(tensors: Sequence[torch.Tensor]) -> bool:
    """Every tensor a plain Tensor or Parameter (no subclass whose metadata lives elsewhere, e.g. DTensor)."""
    return set(map(type, tensors)) <= _PLAIN


def _build(tensors: Sequence[torch.Tensor]) -> Check:
    from torch._C._dynamo.guards import TensorGuards

    guards = TensorGuards(
        *tensors,
        dynamic_dims_sizes=[list(t.size()) for t in tensors],
        dynamic_dims_strides=[list(t.stride()) for t in tensors],
    )
    return guards.check


class _Probe(torch.Tensor):
    """A tensor subclass, for the probe's type change."""


@functools.cache
def _works() -> bool:
    """The probe: a snapshot holds for the same tensors, and fails after a reshape, a restride, a recast,
    a resize and a move to a different dtype of the same object (`.data =`), and for a tensor of another
    Python type in a tensor's place (so a check that holds also says every tensor is still plain)."""
    try:
        ts = [torch.zeros(4, 4), torch.zeros(16)]
        check = _build(ts)
        if not check(*ts):
            return False
        changes = [
            lambda: ts[0].as_strided_((4, 4), (1, 4)),
            lambda: ts[0].as_strided_((2, 8), (8, 1)),
            lambda: ts[1].resize_(8),
            lambda: setattr(ts[1], "data", torch.zeros(16, dtype=torch.float64)),
            lambda: setattr(ts[1], "data", torch.zeros(16, 1)),
        ]
        for change in changes:
            ts[0].set_(torch.zeros(4, 4))
            ts[1].data = torch.zeros(16)
            if not check(*ts):
                return False
            change()
            if check(*ts):
                return False
        ts[0].set_(torch.zeros(4, 4))
        ts[1].data = torch.zeros(16)
        return not check(torch.nn.Parameter(ts[0]), ts[1]) and not check(ts[0].as_subclass(_Probe), ts[1])
    except Exception as e:  # noqa: BLE001 - any other torch: fall back, never guess
        log.info("TensorGuards unusable here (%s: %s); layout checks read metadata through Python", type(e).__name__, e)
        return False


def tensor_guard(tensors: Sequence[torch.Tensor]) -> Check | None:
    """A check `check(*tensors) -> bool` that holds while every tensor keeps its dtype, device, shape and
    strides (not its address: check data_ptr apart), or None where that cannot be had."""
    if not tensors or not plain(tensors) or not _works():
        return None
    try:
        return _build(tensors)
    except Exception:  # noqa: BLE001 - an unusable guard means the Python fallback, never a wrong answer
        return None
