"""A 2-rank FSDP2 trainer (gloo, CPU) refits into an engine process, gathering bucket by bucket."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from fsdp_trainer import build
from peer import Peer
from refit.spec import dtype_name
from refit.verify import fingerprints


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ranks(args: dict) -> list[subprocess.Popen]:
    script = os.path.join(os.path.dirname(__file__), "fsdp_trainer.py")
    port = _free_port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), *sys.path])}  # fmt: skip
        procs.append(subprocess.Popen([sys.executable, script, json.dumps(args)], env=env, text=True,
                                      stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL))  # fmt: skip
    return procs


def _line(proc: subprocess.Popen) -> dict:
    for line in proc.stdout:
        if line.startswith("@@rank0 "):
            return json.loads(line[len("@@rank0 ") :])
    raise AssertionError(f"rank 0 exited with {proc.wait()}")


@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_fsdp2_trainer_refits_bitwise_with_gathers_within_budget(transport: str) -> None:
    model = build(0)
    specs = [[n, list(t.shape), dtype_name(torch.float32)] for n, t in sorted(model.state_dict().items())]
    unsharded = fingerprints(model.state_dict().items(), {n: torch.bfloat16 for n, *_ in specs})
    ranks = _ranks({"transport": transport, "bucket_bytes": 16384, "steps": 3})
    rendezvous = _line(ranks[0])
    peer = Peer({"rendezvous": rendezvous, "specs": specs, "bucket_bytes": 16384})
    try:
        for version in (1, 2, 3):
            sent, got = _line(ranks[0]), peer.report()
            assert got["event"] == "refit" and got["version"] == version
            assert got["fingerprints"] == sent["fingerprints"]
            if version == 1:
                assert got["fingerprints"] == unsharded  # the very model before sharding, in bf16
            assert sent["stats"]["num_buckets"] > 4
            assert 0 < sent["peak"] <= sent["predicted"] < sent["model_bytes"] / 2
        assert sent["stats"]["epoch"] == 2  # the dtype change at the last step re-handshook
    finally:
        assert [p.wait(timeout=60) for p in ranks] == [0, 0]
        peer.wait()
