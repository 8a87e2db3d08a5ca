"""Two hosts, or a fleet of sites, on one machine for tests: refit's own `Link` (refit.tools.bench.link, which
`refit bench --link-rate` uses too), plus starting a Python process in any of its namespaces."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from locations import pythonpath

from refit.tools.bench.link import A_ADDR, B_ADDR, can_make_links, rate_bits
from refit.tools.bench.link import Link as _Link

__all__ = ["A_ADDR", "B_ADDR", "Link", "can_make_links", "env", "first_json", "rate_bits", "refits"]


class Link(_Link):
    def popen(self, side: str | int, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        """Start `python argv...` in namespace `side` ("a", "b", or a site of a fleet: `Link(sites=S)`)."""
        return subprocess.Popen(self.command(side, [sys.executable, *argv]), stdout=subprocess.PIPE, text=True, env=env)


def env(**extra: str) -> dict[str, str]:
    """The environment of a process started in a namespace: this one's, the helpers on its path, and `extra`."""
    return {**os.environ, "PYTHONPATH": pythonpath(), **extra}


def first_json(proc: subprocess.Popen, mark: str) -> dict:
    """The JSON of the next line `proc` prints that starts with `mark`."""
    assert proc.stdout is not None
    for text in proc.stdout:
        if text.startswith(mark):
            return json.loads(text[len(mark) :])
    raise AssertionError(f"process exited with {proc.wait()} before a {mark.strip()} line")


def refits(sender: subprocess.Popen, worker: subprocess.Popen, steps: int, mark: str) -> list[dict]:
    """The sender's report of each of `steps` refits, once the worker (its reports start with `mark`) says it
    committed that version holding what the sender sent, bitwise."""
    sent = []
    for version in range(1, steps + 1):
        report, got = first_json(sender, "@@sender "), first_json(worker, mark)
        assert got["event"] == "refit" and got["version"] == version, got
        assert got["fingerprints"] == report["fingerprints"], f"refit {version} did not land bitwise"
        sent.append(report)
    return sent
