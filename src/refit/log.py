"""Log: the `refit` logger, each record tagged with the process's role and rank.

The library only logs (INFO: connect, handshake, commit; DEBUG: per bucket; WARNING: fallbacks);
the CLI decides what is shown. A library user sees nothing until they configure `logging`.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

LOGGER_NAME = "refit"


def get_logger(role: str, rank: int | None = None) -> logging.LoggerAdapter:
    """A logger for one side of a session: records read "[sender]" or "[receiver 2]"."""
    tag = role if rank is None else f"{role} {rank}"
    return _Tagged(logging.getLogger(LOGGER_NAME), {"refit_tag": tag})


class _Tagged(logging.LoggerAdapter):
    def process(self, msg, kwargs):  # type: ignore[no-untyped-def]
        return f"[{self.extra['refit_tag']}] {msg}", kwargs  # type: ignore[index]


def level(verbosity: int) -> int:
    """The `refit` logger's level for a CLI verbosity: -1 (-q) ERROR, 0 WARNING, 1 (-v) INFO, 2+ (-vv) DEBUG."""
    if verbosity < 0:
        return logging.ERROR
    return (logging.WARNING, logging.INFO)[verbosity] if verbosity < 2 else logging.DEBUG


def configure(verbosity: int = 0) -> None:
    """CLI set-up: refit's records to stderr at `level(verbosity)`; quiet third-party chatter unless verbose.

    Called again (say in a child process) it only changes the level.
    """
    logger = logging.getLogger(LOGGER_NAME)
    logger.setLevel(level(verbosity))
    if not any(isinstance(h, _Stderr) for h in logger.handlers):
        handler = _Stderr()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s refit %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
    quiet_libraries(verbosity)


class _Stderr(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time of the record (a test's capture, a redirected stream)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property  # type: ignore[override]
    def stream(self):  # type: ignore[no-untyped-def]
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:  # type: ignore[no-untyped-def]
        pass


QUIET_ENV = {
    "VLLM_LOGGING_LEVEL": "ERROR",
    "TRANSFORMERS_VERBOSITY": "error",
    "TORCH_CPP_LOG_LEVEL": "ERROR",
    "PYTHONWARNINGS": "ignore::FutureWarning",
    "NIXL_LOG_LEVEL": "WARN",
    "UCX_LOG_LEVEL": "warn",
}
"""Set by the `refit` command unless -v (explicit settings win); listed in docs/USAGE.md ("Environment variables")."""


def quiet_libraries(verbosity: int) -> None:
    """vLLM, transformers, torch, NIXL and UCX print tens of lines of their own per engine start; keep only their
    errors unless -v. Each reads its variable once, at import, in every process (vLLM's workers inherit
    this environment), so this must run before they are imported."""
    if verbosity < 1:
        for name, value in QUIET_ENV.items():
            os.environ.setdefault(name, value)
        warnings.filterwarnings("ignore", category=FutureWarning)
        # Some vLLM modules warn at import, before vLLM has configured its logging from the variable above.
        logging.getLogger("vllm").setLevel(logging.ERROR)
        # NIXL sets its logger from NIXL_LOG_LEVEL when imported; this covers one imported already.
        logging.getLogger("nixl").setLevel(logging.WARNING)
