"""Warm process starts for the tests: a server that has imported torch and refit once forks each helper script
a test starts, so the child begins in milliseconds instead of the seconds a fresh interpreter takes to import
torch (the main cost of the test suite on a 2-core machine).

`popen(argv, ...)` is `subprocess.Popen` for `[sys.executable, script, *args]` (or `-m module`): through the
server when the test session started one (tests/conftest.py does, and says where in REFIT_TEST_WARM), else a
plain Popen. The child runs as a fresh interpreter would run the script: its own argv, environment, working
directory and standard streams, `__main__` semantics, threads joined and exit handlers run at its end. Only
the modules the server imported are shared (already imported, unchanged: nothing of a test runs there).

The server forks from a single thread (it starts none) and reports each child's exit status to the client
that asked for it, on the connection that asked.
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
from typing import IO, Any

ENV = "REFIT_TEST_WARM"
PRELOAD = ("torch", "refit", "refit.topology.sender", "refit.topology.receiver", "refit.engines.module")


class WarmProcess:
    """The part of `subprocess.Popen` the tests use, for a child forked by the server."""

    def __init__(self, argv: list[str], conn: socket.socket, pid: int, streams: dict[str, IO | None]) -> None:
        self.args, self._conn, self.pid = argv, conn, pid
        self.stdin, self.stdout, self.stderr = streams["stdin"], streams["stdout"], streams["stderr"]
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._conn], [], [], 0)[0]:
            self._read_status()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self._conn], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            self._read_status()
        assert self.returncode is not None
        return self.returncode

    def _read_status(self) -> None:
        data = b""
        while not data.endswith(b"\n"):
            chunk = self._conn.recv(64)
            if not chunk:
                raise RuntimeError("the warm-start server went away before the child's exit status")
            data += chunk
        self.returncode = int(data)
        self._conn.close()

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[Any, Any]:  # noqa: A002
        if input is not None and self.stdin is not None:
            self.stdin.write(input)
        if self.stdin is not None:
            self.stdin.close()
        out = self.stdout.read() if self.stdout is not None else None
        err = self.stderr.read() if self.stderr is not None else None
        self.wait(timeout)
        return out, err

    def __enter__(self) -> WarmProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        for s in (self.stdin, self.stdout, self.stderr):
            if s is not None:
                s.close()
        self.wait()


def popen(
    argv: list[str],
    *,
    stdin: Any = None,
    stdout: Any = None,
    stderr: Any = None,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    text: bool = False,
) -> subprocess.Popen | WarmProcess:
    """`subprocess.Popen(argv, ...)`, forked warm when a server runs and argv is this interpreter on a script
    (or `-m module`)."""
    path = os.environ.get(ENV)
    warm = path and len(argv) >= 2 and argv[0] == sys.executable and (argv[1] == "-m" or argv[1].endswith(".py"))
    if warm:
        try:
            return _fork(path, argv, stdin, stdout, stderr, env, cwd, text)  # type: ignore[arg-type]
        except OSError:
            pass  # the server is gone: start the process the usual way
    return subprocess.Popen(argv, stdin=stdin, stdout=stdout, stderr=stderr, env=env, cwd=cwd, text=text)


def _fork(
    path: str, argv: list[str], stdin: Any, stdout: Any, stderr: Any, env: dict | None, cwd: str | None, text: bool
) -> WarmProcess:
    mine: list[int] = []  # fds the child gets, closed here once sent
    streams: dict[str, IO | None] = {"stdin": None, "stdout": None, "stderr": None}

    def end(which: str, spec: Any, fd: int) -> int:
        if spec is None:
            return os.dup(fd)
        if spec == subprocess.DEVNULL:
            return os.open(os.devnull, os.O_RDWR)
        if spec == subprocess.PIPE:
            r, w = os.pipe()
            keep, give = (w, r) if which == "stdin" else (r, w)
            streams[which] = open(keep, ("w" if which == "stdin" else "r") + ("" if text else "b"))  # noqa: SIM115
            return give
        return os.dup(spec if isinstance(spec, int) else spec.fileno())

    fds = [end("stdin", stdin, 0), end("stdout", stdout, 1)]
    fds.append(os.dup(fds[1]) if stderr == subprocess.STDOUT else end("stderr", stderr, 2))
    mine.extend(fds)
    request = {"argv": argv, "env": dict(os.environ if env is None else env), "cwd": cwd or os.getcwd()}
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
        data = json.dumps(request).encode()
        conn.sendmsg(
            [len(data).to_bytes(8, "little") + data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
        )
        line = b""
        while not line.endswith(b"\n"):
            chunk = conn.recv(1)
            if not chunk:
                raise OSError("the warm-start server closed before naming the child")
            line += chunk
    except OSError:
        conn.close()
        for s in streams.values():
            if s is not None:
                s.close()
        raise
    finally:
        for fd in mine:
            os.close(fd)
    return WarmProcess(argv, conn, int(line), streams)


def serve(path: str) -> None:
    """The server: import PRELOAD, say ready on stdout, then fork one child per request until stdin closes."""
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: dict[int, socket.socket] = {}
    print("ready", flush=True)
    while True:
        ready = select.select([listener, wake_r, sys.stdin], [], [])[0]
        if sys.stdin in ready and not sys.stdin.buffer.read1(1):  # the test session ended
            return
        if wake_r in ready:
            os.read(wake_r, 4096)
        _reap(children)
        if listener in ready:
            conn, _ = listener.accept()
            pid = _start(conn, (listener, wake_r, wake_w))
            if pid:
                children[pid] = conn


def _reap(children: dict[int, socket.socket]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if not pid:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            code = os.waitstatus_to_exitcode(status)
            with contextlib.suppress(OSError):
                conn.sendall(f"{code}\n".encode())
            conn.close()


def _start(conn: socket.socket, server_fds: tuple) -> int:
    """Read one request and fork its child; returns the child's pid (0 when the request was broken)."""
    try:
        head, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        size = int.from_bytes(head[:8], "little")
        data = head[8:]
        while len(data) < size:
            more = conn.recv(size - len(data))
            if not more:
                raise OSError("short request")
            data += more
        request = json.loads(data)
    except (OSError, ValueError):
        conn.close()
        return 0
    pid = os.fork()
    if pid == 0:
        _child(request, fds, conn, server_fds)
    for fd in fds:
        os.close(fd)
    conn.sendall(f"{pid}\n".encode())
    return pid


def _child(request: dict, fds: list[int], conn: socket.socket, server_fds: tuple) -> None:
    """In the forked child: become the script's process, run it as `__main__`, exit as an interpreter would."""
    import runpy
    import threading
    import traceback

    code, interrupted = 1, False
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        conn.close()
        server_fds[0].close()
        for fd in server_fds[1:]:
            os.close(fd)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))  # as a fresh interpreter: block-buffered to a pipe
        sys.stdin = open(0, closefd=False)  # noqa: SIM115
        sys.stdout = open(1, "w", buffering=1 if unbuffered else -1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        argv = request["argv"][1:]
        extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        base = [p for p in sys.path if p != os.path.dirname(os.path.abspath(__file__))]
        import random

        random.seed()
        try:
            if argv[0] == "-m":
                sys.argv = [argv[1], *argv[2:]]
                sys.path[:] = [os.getcwd(), *extra, *base]
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            else:
                sys.argv = list(argv)
                sys.path[:] = [os.path.dirname(os.path.abspath(argv[0])), *extra, *base]
                runpy.run_path(argv[0], run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if e.code is not None and not isinstance(e.code, int):
                print(e.code, file=sys.stderr)
        except KeyboardInterrupt:
            traceback.print_exc()
            interrupted = True
        except BaseException:  # noqa: BLE001 - as the interpreter does: the traceback on stderr, status 1
            traceback.print_exc()
            code = 1
        threading._shutdown()  # type: ignore[attr-defined]
        import atexit

        atexit._run_exitfuncs()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        if interrupted:  # as the interpreter ends on an uncaught KeyboardInterrupt: killed by SIGINT
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(code)


if __name__ == "__main__":
    serve(sys.argv[1])
