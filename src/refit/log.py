"""Log: the `refit` logger, each record tagged with the process's role and rank.

The library only logs (INFO: connect, handshake, commit; DEBUG: per bucket; WARNING: fallbacks);
the CLI decides what is shown. A library user sees nothing until they configure `logging`.
"""

from __future__ import annotations

import logging

LOGGER_NAME = "refit"


def get_logger(role: str, rank: int | None = None) -> logging.LoggerAdapter:
    """A logger for one side of a session: records read "[sender]" or "[receiver 2]"."""
    tag = role if rank is None else f"{role} {rank}"
    return _Tagged(logging.getLogger(LOGGER_NAME), {"refit_tag": tag})


class _Tagged(logging.LoggerAdapter):
    def process(self, msg, kwargs):  # type: ignore[no-untyped-def]
        return f"[{self.extra['refit_tag']}] {msg}", kwargs  # type: ignore[index]


def configure(verbosity: int = 0) -> None:
    """CLI set-up: WARNING by default, INFO with -v, DEBUG with -vv, ERROR with -q."""
    level = {-1: logging.ERROR, 0: logging.WARNING, 1: logging.INFO}.get(verbosity, logging.DEBUG)
    logger = logging.getLogger(LOGGER_NAME)
    logger.setLevel(level)
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s refit %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
