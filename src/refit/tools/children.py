"""Child processes of the tools (the demo's engine and trainer ranks, the bench's workers)."""

from __future__ import annotations

import sys

# SIGINT's default action ends the process at once and silently, even inside torch's imports or a C call;
# Python's own handler would print a KeyboardInterrupt traceback per child instead.
_BOOT = (
    "import runpy, signal, sys\n"
    "if signal.getsignal(signal.SIGINT) is signal.default_int_handler:\n"  # not where SIGINT is ignored (nohup)
    "    signal.signal(signal.SIGINT, signal.SIG_DFL)\n"
    "runpy.run_module(sys.argv.pop(1), run_name='__main__', alter_sys=True)"
)


def module_command(module: str, *args: str) -> list[str]:
    """`python -m module args`, except that Ctrl-C (which the terminal sends to the whole process group)
    ends the child without a word: the parent alone says 'interrupted'."""
    return [sys.executable, "-c", _BOOT, module, *args]
