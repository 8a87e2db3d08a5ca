"""StateLayout: reads a module's state dict live without walking the module tree on every refit.

Walking `state_dict()` costs microseconds per tensor. The layout remembers, once, which module
container holds each name (its `_parameters` or `_buffers` dict and key) and reads those slots each
refit, so a parameter or buffer replaced in its module is seen at once. The slots are trusted only
while a cheap check passes: every submodule is still where it was, and no container gained or lost
an entry. Otherwise the layout is rebuilt from a full `state_dict()`.
"""

from __future__ import annotations

import torch
from torch import nn

Slot = tuple[str, dict, str]


class StateLayout:
    """The live `state_dict(keep_vars=True)` of a module, read through remembered slots."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self._build()

    def _build(self) -> None:
        state = self.module.state_dict(keep_vars=True)
        owners: dict[str, tuple[dict, str]] = {}
        edges: list[tuple[dict, str, nn.Module]] = []
        sizes: list[tuple[object, int]] = []
        for prefix, mod in self.module.named_modules(remove_duplicate=False):
            edges.extend((mod._modules, name, child) for name, child in mod._modules.items())
            sizes.extend(
                (c, len(c)) for c in (mod._modules, mod._parameters, mod._buffers, mod._non_persistent_buffers_set)
            )
            for container in (mod._parameters, mod._buffers):
                for key, value in container.items():
                    name = f"{prefix}.{key}" if prefix else key
                    if value is not None and state.get(name) is value:
                        owners[name] = (container, key)
        self._edges, self._sizes = edges, sizes
        # Names a state-dict hook or a custom _save_to_state_dict produced have no slot: read them the slow way.
        self._slots: list[Slot] | None = None
        if owners.keys() == state.keys():
            self._slots = [(name, *owners[name]) for name in state]
        self._state = state

    def _valid(self) -> bool:
        return all(c.get(name) is child for c, name, child in self._edges) and all(len(c) == n for c, n in self._sizes)  # type: ignore[arg-type]

    def read(self) -> dict[str, torch.Tensor]:
        """What `module.state_dict(keep_vars=True)` returns now."""
        if not self._valid():
            self._build()
            return dict(self._state)
        if self._slots is None:
            return dict(self.module.state_dict(keep_vars=True))
        try:
            out = {name: container[key] for name, container, key in self._slots}
        except KeyError:
            out = {}
        if len(out) != len(self._slots) or any(v is None for v in out.values()):
            self._build()
            return dict(self._state)
        return out


def non_persistent_buffers(module: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """(name, owning module, key) of every non-persistent buffer: state a module computes or keeps for itself,
    which its state dict leaves out. Read each live as `owner._buffers[key]`."""
    out = []
    for prefix, mod in module.named_modules():
        for key in sorted(mod._non_persistent_buffers_set):
            if mod._buffers.get(key) is not None:
                out.append((f"{prefix}.{key}" if prefix else key, mod, key))
    return out


def with_buffers(out: dict[str, torch.Tensor], buffers: list[tuple[str, nn.Module, str]]) -> dict[str, torch.Tensor]:
    """`out` with the live value of each of `buffers` (from `non_persistent_buffers`) that the module holds now."""
    for name, owner, key in buffers:
        t = owner._buffers.get(key)
        if t is not None:
            out[name] = t
    return out
