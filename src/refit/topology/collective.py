"""The trainer ranks' few agreements (JSON all-gathers, a failure vote), over the trainer's own group.
No pickle crosses the process boundary: JSON bytes in uint8 tensors."""

from __future__ import annotations

import json

import torch
import torch.distributed as dist


class Collective:
    """One trainer group's agreements; with no process group (one rank), each is the rank's own value."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.world = dist.get_world_size(group) if self.distributed else 1
        on_gpu = self.distributed and dist.get_backend(group) == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")

    def all_gather_json(self, obj: object) -> list:
        """JSON from every rank, in rank order."""
        if not self.distributed:
            return [json.loads(json.dumps(obj))]
        data = json.dumps(obj).encode()
        n = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        sizes = [torch.zeros_like(n) for _ in range(self.world)]
        dist.all_gather(sizes, n, group=self.group)
        width = max(int(s.item()) for s in sizes)
        buf = torch.zeros(width, dtype=torch.uint8)
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        buf = buf.to(self.device)
        outs = [torch.empty_like(buf) for _ in range(self.world)]
        dist.all_gather(outs, buf, group=self.group)
        return [json.loads(bytes(o[: int(s.item())].cpu().tolist())) for o, s in zip(outs, sizes)]

    def reduce(self, values: list[int], op: dist.ReduceOp.RedOpType) -> list[int]:
        if not self.distributed:
            return list(values)
        t = torch.tensor(values, dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=op, group=self.group)
        return [int(v) for v in t.tolist()]

    def vote(self, own: str) -> str:
        """'' when no rank failed, else every failing rank's reason."""
        if not self.reduce([int(bool(own))], dist.ReduceOp.MAX)[0]:
            return ""
        reasons = self.all_gather_json(own)
        return "; ".join(f"trainer rank {r}: {m}" for r, m in enumerate(reasons) if m)
