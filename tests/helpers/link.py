"""Two hosts on one machine for tests: refit's own `Link` (refit.tools.bench.link, which `refit bench
--link-rate` uses too), plus starting a Python process in either namespace."""

from __future__ import annotations

import subprocess
import sys

from refit.tools.bench.link import A_ADDR, B_ADDR, can_make_links, rate_bits
from refit.tools.bench.link import Link as _Link

__all__ = ["A_ADDR", "B_ADDR", "Link", "can_make_links", "rate_bits"]


class Link(_Link):
    def popen(self, side: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        """Start `python argv...` in namespace `side` ("a" or "b")."""
        return subprocess.Popen(self.command(side, [sys.executable, *argv]), stdout=subprocess.PIPE, text=True, env=env)
