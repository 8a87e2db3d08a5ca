"""NIXL alone, no refit: one process serves a registered buffer, this one READs it; GB/s and a bitwise check.

For telling NIXL/UCX's own link speed from refit's. The serving process is started here and writes its agent
metadata to a file; this process waits for the file, reads `--mib` MiB `--repeats` times and prints one line.
UCX's environment (UCX_TLS, UCX_PROTO_INFO, ...) reaches both processes.

    PYTHONPATH=src python benchmarks/nixl_probe.py --device cuda:0 --mib 1024
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from refit.transports.nixl import _nixl, backend_params


def _agent(name: str, serving: bool):  # noqa: ANN202 - NIXL's own type
    nixl = _nixl()
    config = nixl.nixl_agent_config(enable_prog_thread=serving, backends=[])
    agent = nixl.nixl_agent(name, config)
    agent.create_backend("UCX", backend_params("UCX"))
    return agent


def serve(args: argparse.Namespace) -> None:
    agent = _agent("probe-serving", True)
    buf = torch.randint(0, 256, (args.mib << 20,), dtype=torch.uint8, device=args.device)
    agent.register_memory([buf])
    dev = buf.device.index or 0 if buf.is_cuda else 0
    info = {
        "addr": buf.data_ptr(),
        "dev": dev,
        "sum": int(buf.sum(dtype=torch.int64)),
        "mem": "VRAM" if buf.is_cuda else "DRAM",
    }
    meta = agent.get_agent_metadata()
    Path(args.dir, "meta.bin").write_bytes(meta)
    Path(args.dir, "info.json.tmp").write_text(json.dumps(info))
    os.replace(Path(args.dir, "info.json.tmp"), Path(args.dir, "info.json"))
    while not Path(args.dir, "done").exists():
        time.sleep(0.05)


def read(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as d:
        log = open(Path(d, "serve.log"), "w")
        cmd = [sys.executable, __file__, "--role", "serve", "--dir", d, "--device", args.device, "--mib", str(args.mib)]
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            while not Path(d, "info.json").exists():
                if proc.poll() is not None:
                    raise SystemExit(f"server exited {proc.returncode}: {Path(d, 'serve.log').read_text()[-2000:]}")
                time.sleep(0.05)
            info = json.loads(Path(d, "info.json").read_text())
            _timed_reads(args, info, Path(d, "meta.bin").read_bytes())
        finally:
            Path(d, "done").touch()
            proc.wait()
            sys.stderr.write(Path(d, "serve.log").read_text()[-args.server_log :] if args.server_log else "")


def _timed_reads(args: argparse.Namespace, info: dict, meta: bytes) -> None:
    agent = _agent("probe-reading", False)
    n = args.mib << 20
    local = torch.zeros(n, dtype=torch.uint8, device=args.device)
    agent.register_memory([local])
    remote = agent.add_remote_agent(meta)
    times = []
    for _ in range(args.repeats + 1):
        local.zero_()
        if local.is_cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        handle = agent.initialize_xfer(
            "READ",
            agent.get_xfer_descs(local),
            agent.get_xfer_descs([(info["addr"], n, info["dev"])], info["mem"]),
            remote,
        )
        state = agent.transfer(handle)
        while state == "PROC":
            state = agent.check_xfer_state(handle)
        times.append(time.perf_counter() - t)
        handle.release()
        if state != "DONE":
            raise SystemExit(f"READ ended {state}")
    ok = int(local.sum(dtype=torch.int64)) == info["sum"]
    med = sorted(times[1:])[len(times[1:]) // 2]
    env = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith(("UCX_", "REFIT_NIXL")))
    print(
        f"nixl READ {args.mib} MiB {info['mem']}: median {med * 1e3:.1f} ms, {n / med / 1e9:.2f} GB/s, bitwise {ok}; {env}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--role", choices=("read", "serve"), default="read")
    p.add_argument("--dir", default="")
    p.add_argument("--device", default="cpu")
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--server-log", type=int, default=0, help="print the last N characters of the server's log")
    args = p.parse_args()
    serve(args) if args.role == "serve" else read(args)


if __name__ == "__main__":
    main()
