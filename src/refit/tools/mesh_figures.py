"""`refit plan --trainer-ranks N --engine-tp T --engine-ep E`: the bytes each GPU moves per refit on each
path (broadcast, per-rank colocated, M:N), and the time at the bandwidths docs/SCALING.md records.

The trainer is FSDP2 with `Shard(0)` over N ranks (torch.chunk rows). The engine has T x E workers:
dense tensors are tensor-parallel over T (column-parallel rows, row-parallel `o_proj`/`down_proj`
columns, vocabulary rows; norms, biases, routers and block scales of 1-D tensors whole) and repeated
in each of the E expert groups; routed experts go whole to one expert group (expert i to group
i * E // experts) and are tensor-parallel inside it. Each worker's bytes are exact (the sum of its
slices); each rank's are exact too (its rows intersected with every worker's slices), computed once
per distinct tensor shape and layout rather than per tensor.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import cache

import numpy as np

from refit.layout.spec import Slice, TensorSpec

ROW_PARALLEL = ("o_proj", "down_proj")
ROUTER = "mlp.gate.weight"
EXPERT = re.compile(r"\.experts\.(\d+)\.")

BANDWIDTHS = {
    "allgather_gbps": (296.0, "measured: NCCL all-gather on 2 H200 (per GPU received), docs/SCALING.md"),
    "broadcast_gbps": (361.0, "measured: NCCL broadcast on 2 H200, BENCHMARKS.md"),
    "nic_gbps": (50.0, "assumed: one 400 Gb/s NIC per GPU across nodes"),
}


def _layout(spec: TensorSpec, tp: int, ep: int, experts: int) -> tuple[int | None, int | None]:
    """(TP dim or None for whole, expert group or None for every group) of one checkpoint tensor."""
    name, shape = spec.name, spec.shape
    m = EXPERT.search(name)
    group = int(m.group(1)) * ep // experts if m else None
    if len(shape) < 2 or name.endswith(ROUTER):
        return None, group
    if "scale_inv" in name:  # block scales follow their weight's split
        name = name.replace("_scale_inv", "")
    return (1 if any(r in name for r in ROW_PARALLEL) else 0), group


def statements(specs: Sequence[TensorSpec], *, ranks: int, tp: int, ep: int) -> tuple[list[dict], list[dict]]:
    """(every trainer rank's holdings, every worker's slices) under the layout above, for `plan_reshard`
    (what `path_figures` counts without planning every move: tests hold the two equal)."""
    experts = 1 + max((int(m.group(1)) for s in specs if (m := EXPERT.search(s.name))), default=0)
    holders = [{s.name: _slice(0, _chunks((s.shape or (1,))[0], ranks)[r]) for s in specs} for r in range(ranks)]
    workers: list[dict] = [{} for _ in range(tp * ep)]
    for s in specs:
        dim, group = _layout(s, tp, ep, experts)
        for e in range(ep) if group is None else (group,):
            for t in range(tp):
                part = None if dim is None else _slice(dim, _chunks(s.shape[dim], tp)[t])
                workers[e * tp + t][s.name] = part
    return holders, workers


def _slice(dim: int, span: np.ndarray) -> Slice:
    return Slice(dim, int(span[0]), int(span[1] - span[0]))


def _chunks(n: int, parts: int) -> np.ndarray:
    size = -(-n // parts)
    lo = np.minimum(np.arange(parts) * size, n)
    return np.stack([lo, np.minimum(lo + size, n)], axis=1)


@cache
def _bytes(shape: tuple[int, ...], itemsize: int, dim: int | None, group: int | None, ranks: int, tp: int, ep: int):
    """(bytes per worker received [T*E], bytes per rank sent [N]) of one tensor of this shape and layout."""
    per_row = int(np.prod(shape[1:], dtype=np.int64)) * itemsize
    mine = _chunks(shape[0], ranks)  # [N, 2]: each trainer rank's rows
    held = mine[:, 1] - mine[:, 0]
    recv, sent = np.zeros(tp * ep, dtype=np.int64), np.zeros(ranks, dtype=np.int64)
    parts = _chunks(shape[dim], tp) if dim is not None else None
    for t in range(tp):
        if parts is None:  # held whole by every worker of the group
            got, width = held, per_row
        elif dim == 0:
            a, b = parts[t]
            got, width = np.maximum(np.minimum(mine[:, 1], b) - np.maximum(mine[:, 0], a), 0), per_row
        else:
            a, b = parts[t]
            got, width = held, per_row // shape[dim] * (b - a)
        for e in range(ep) if group is None else (group,):
            recv[e * tp + t] += int(got.sum()) * width
            sent += got * width
    return recv, sent


def path_figures(specs: Sequence[TensorSpec], *, ranks: int, tp: int, ep: int) -> dict:
    """Bytes per GPU and seconds per refit for broadcast, per-rank and M:N (rank r and worker r on one GPU)."""
    experts = 1 + max((int(m.group(1)) for s in specs if (m := EXPERT.search(s.name))), default=0)
    model = sum(s.nbytes for s in specs)
    recv = np.zeros(tp * ep, dtype=np.int64)
    sent = np.zeros(ranks, dtype=np.int64)
    for s in specs:
        dim, group = _layout(s, tp, ep, experts)
        r, t = _bytes(tuple(s.shape) or (1,), s.dtype.itemsize, dim, group, ranks, tp, ep)
        recv += r
        sent += t
    workers = tp * ep
    per_gpu = {
        "broadcast": model,
        "per_rank": model * (ranks - 1) // ranks,
        "m_to_n": int(max(recv.max(), sent.max())),
    }
    bw = {k: v for k, (v, _) in BANDWIDTHS.items()}
    seconds = {
        "broadcast": {"nvlink": model / (bw["broadcast_gbps"] * 1e9), "nic": model / (bw["nic_gbps"] * 1e9)},
        "per_rank": {
            k: per_gpu["per_rank"] / (bw[g] * 1e9) for k, g in (("nvlink", "allgather_gbps"), ("nic", "nic_gbps"))
        },
        "m_to_n": {
            k: per_gpu["m_to_n"] / (bw[g] * 1e9) for k, g in (("nvlink", "allgather_gbps"), ("nic", "nic_gbps"))
        },
    }
    return {
        "model_bytes": model,
        "trainer_ranks": ranks,
        "engine_workers": workers,
        "bytes_per_gpu": per_gpu,
        "worker_bytes_max": int(recv.max()),
        "worker_bytes_mean": int(recv.mean()),
        "rank_sent_bytes_max": int(sent.max()),
        "delivered_bytes": {"broadcast": model * workers, "m_to_n": int(recv.sum())},
        "seconds": seconds,
        "bandwidths": {k: {"gbps": v, "source": src} for k, (v, src) in BANDWIDTHS.items()},
    }
