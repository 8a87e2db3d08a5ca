"""The CUDA IPC probe: a device buffer exported here, opened, read and written in a second process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from refit.tools.diagnosis import FAIL, OK, Check

PROBE_TIMEOUT_S = 300.0
"""For the IPC probe's child: its Python, torch and CUDA start on a loaded machine, then one small copy."""


def probe_cuda_ipc(device: int = 0, timeout_s: float = PROBE_TIMEOUT_S) -> Check:
    """Export a device buffer, open it in a second process, read it there and write back: the real thing."""
    from refit.transports.cuda_ipc import export

    name = "cuda-ipc probe"
    buf = torch.arange(256, device=f"cuda:{device}").to(torch.uint8)
    torch.cuda.synchronize(device)
    try:
        handle = export(buf)
    except Exception as e:  # noqa: BLE001 - a driver or container that refuses IPC
        return Check(name=name, status=FAIL, detail=f"exporting a handle failed: {e}", fix=IPC_FIX)
    code = "from refit.tools.ipc_probe import ipc_child; ipc_child()"
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code],
            input=json.dumps(handle),
            capture_output=True,
            text=True,
            env=_child_env(),
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        return Check(
            name=name, status=FAIL, detail=f"the second process did not answer in {timeout_s:.0f}s", fix=IPC_FIX
        )
    answer = next((json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")), None)
    if not answer or "error" in answer:
        why = (answer or {}).get("error") or f"exit code {proc.returncode}: {proc.stderr.strip()[-300:]}"
        return Check(
            name=name, status=FAIL, detail=f"opening the handle in a second process failed: {why}", fix=IPC_FIX
        )
    torch.cuda.synchronize(device)
    if not bool(buf[128:].eq(7).all()):
        return Check(name=name, status=FAIL, detail="the second process's write did not arrive", fix=IPC_FIX)
    return Check(
        name=name, status=OK, detail=f"exported on cuda:{device}, opened, read and written by a second process"
    )


IPC_FIX = (
    "run trainer and engine in one container or with a shared IPC namespace (docker: --ipc=host), "
    "without expandable_segments; else cuda-ipc stages through host memory (REFIT_CUDA_IPC=0), or use nccl"
)


def _child_env() -> dict[str, str]:
    import refit

    pkg_root = os.path.dirname(os.path.dirname(refit.__file__))
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (pkg_root, os.environ.get("PYTHONPATH")) if p)}


def ipc_child() -> None:
    """The probe's second process: open the handle from stdin, check the bytes, write 7s into the upper half."""
    from refit.transports.cuda_ipc import open_tensor

    try:
        t = open_tensor(json.loads(sys.stdin.read()))
        if t[:128].sum().item() != sum(range(128)):
            raise RuntimeError("the bytes read through the handle differ from the bytes written")
        t[128:].fill_(7)
        torch.cuda.synchronize(t.device)
        print(json.dumps({"ok": True}), flush=True)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which names it
        print(json.dumps({"error": str(e)}), flush=True)
