"""The models and shard statements of the M:N tests: an MLP sharded like tensor parallelism, and a small
MoE whose experts are split across the engine workers (expert parallelism)."""

from __future__ import annotations

import torch

from refit.layout.spec import Slice


def build(kind: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    if kind == "mlp":
        return torch.nn.Sequential(torch.nn.Embedding(300, 64), torch.nn.Linear(64, 96), torch.nn.Linear(96, 48),
                                   torch.nn.Linear(48, 301))  # fmt: skip
    experts = torch.nn.ModuleList(
        torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 16, bias=False)) for _ in range(5)
    )
    return torch.nn.ModuleDict(
        {
            "embed": torch.nn.Embedding(50, 16),
            "router": torch.nn.Linear(16, 5),
            "experts": experts,
            "head": torch.nn.Linear(16, 50, bias=False),
        }  # fmt: skip
    )


def chunk(n: int, parts: int, i: int, dim: int = 0) -> Slice:
    """torch.chunk's i-th part of n rows (uneven, possibly empty)."""
    size = -(-n // parts)
    return Slice(dim, min(i * size, n), max(0, min(size, n - i * size)))


# Tensor-parallel layout of the MLP: which dim each tensor is split along (None: held whole by every worker).
MLP_DIMS = {"0.weight": 0, "1.weight": 0, "1.bias": 0, "2.weight": 1, "2.bias": None, "3.weight": 0, "3.bias": 0}


def statement(kind: str, worker: int, workers: int) -> dict[str, Slice | None]:
    """What engine worker `worker` of `workers` keeps of each tensor it holds."""
    shapes = {n: tuple(t.shape) for n, t in build(kind).state_dict().items()}
    if kind == "mlp":
        return {n: None if d is None else chunk(shapes[n][d], workers, worker, d) for n, d in MLP_DIMS.items()}
    out: dict[str, Slice | None] = {"router.weight": None, "router.bias": None}
    out["embed.weight"] = chunk(50, workers, worker)
    out["head.weight"] = chunk(50, workers, worker)
    mine = range(chunk(5, workers, worker).start, chunk(5, workers, worker).start + chunk(5, workers, worker).length)
    for e in mine:
        for n in ("0.weight", "0.bias", "1.weight"):
            out[f"experts.{e}.{n}"] = None
    return out


def local_part(t: torch.Tensor, held: Slice | None) -> torch.Tensor:
    return t if held is None else t.narrow(held.dim, held.start, held.length)
