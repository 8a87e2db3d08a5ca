"""`refit demo --trainer fsdp|megatron`: the demo's trainer sharded over several processes (gloo, CPU):
FSDP2 over `ranks` processes, or a megatron-core GPTModel over tp x pp (refit.tools.demo.megatron).

Rank 0 runs the usual demo loop (Sender, engine process, checks); the other ranks train in lockstep
and take part in each bucket's gathers. Ranks are separate processes started with JSON arguments.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import asdict

import torch
import torch.distributed as dist

import refit
from refit.sources.fsdp import FsdpSource, full_tensor
from refit.tools.children import module_command
from refit.tools.demo.model import train_step
from refit.tools.demo.run import KEEP_FP32, DemoConfig, demo_model, run, session_settings
from refit.topology.mesh import MeshRefit
from refit.topology.stats import RefitStats


class FsdpTrainer:
    """The demo model, each decoder layer and the root sharded with fully_shard over all ranks."""

    def __init__(self, model: torch.nn.Module, ids: torch.Tensor, *, non_persistent: bool = False) -> None:
        """`non_persistent`: also send the model's rotary tables, which a module engine holds as buffers."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.model, self.ids = model, ids
        self.opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        self.source = FsdpSource(model, wire_dtype=torch.bfloat16, non_persistent=non_persistent)

    def step(self) -> float:
        return train_step(self.model, self.opt, self.ids)

    def refit(self, engine, version: int) -> RefitStats:
        if isinstance(engine.sender, MeshRefit):  # M:N: every rank sends its own shards, nothing gathered
            return engine.refit(version)
        with self.source.leading():
            return engine.refit(version)

    def full_weights(self) -> dict[str, torch.Tensor]:
        """Every rank must call this (it gathers); used for the checks, not for the refit."""
        with torch.no_grad():
            return {n: full_tensor(t) for n, t in self.model.state_dict(keep_vars=True).items()}


def _follow(cfg: DemoConfig, trainer) -> None:  # type: ignore[no-untyped-def]
    mesh = None
    if cfg.mesh:  # built as rank 0 builds its own; each call below is collective in the same order
        settings = session_settings(cfg)
        mesh = MeshRefit(
            trainer.source, num_workers=cfg.engine_tp, transport=cfg.transport, settings=settings, verify="fingerprint"
        )
    for step in range(1, cfg.steps + 1):
        trainer.step()
        if step == cfg.dtype_change_at + 1:
            trainer.source.set_wire_dtype(KEEP_FP32, torch.float32)
        if mesh is not None:
            mesh.rendezvous()  # rank 0's driver asks for it before its first refit (later calls: cached)
            mesh.refit(step)
        else:
            trainer.source.follow()
        trainer.full_weights()
    if mesh is not None:
        mesh.close()


def rank_main(cfg: DemoConfig) -> int:
    from rich.console import Console

    dist.init_process_group("gloo")
    # No barrier after an exception: the peers may be blocked in a gather this rank will never join;
    # its exit closes the group's sockets, so they fail instead of waiting for it forever.
    _, model, _, ids, _ = demo_model(cfg)
    if cfg.trainer == "megatron":
        from refit.tools.demo.megatron import MegatronTrainer

        trainer = MegatronTrainer(model, ids, tp=cfg.tp, pp=cfg.pp)
    else:
        trainer = FsdpTrainer(model, ids, non_persistent=cfg.engine == "module")
    if dist.get_rank() == 0:
        code = 0 if run(cfg, Console(width=None if sys.stdout.isatty() else 120), trainer) else 1
    else:
        _follow(cfg, trainer)
        code = 0
    _leave()
    return code


def _leave() -> None:
    """Leave the trainer group together: rank 0 hosts its store, so no rank may find it gone mid-teardown."""
    try:
        dist.barrier()
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001, S110 - a peer already gone at exit is not a failure of the refits
        pass


def launch(cfg: DemoConfig) -> bool:
    """Start the trainer processes (`cfg.ranks`, or tp x pp for megatron); rank 0 prints the demo. True when
    every rank succeeded."""
    world = cfg.tp * cfg.pp if cfg.trainer == "megatron" else cfg.ranks
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pkg_root = os.path.dirname(os.path.dirname(refit.__file__))
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "PYTHONPATH": os.pathsep.join(filter(None, [pkg_root, os.environ.get("PYTHONPATH")])),
        }
        out = None if rank == 0 else subprocess.DEVNULL
        procs.append(
            subprocess.Popen(module_command("refit.tools.demo.sharded", json.dumps(asdict(cfg))), env=env, stdout=out)
        )
    return [p.wait() for p in procs] == [0] * world


if __name__ == "__main__":
    code = rank_main(DemoConfig(**json.loads(sys.argv[1])))
    # Skip interpreter finalization: gloo's C++ worker threads can still hold tensors with Python
    # references then, and destroying them without the interpreter aborts the process (SIGABRT).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
