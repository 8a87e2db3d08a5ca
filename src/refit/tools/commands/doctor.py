"""`refit doctor`: which transports will work on this machine, and what to change."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from refit.tools.commands.common import command_parser, emit_json, json_option
from refit.tools.console import progress_console

_MARK = {"ok": "[green]ok[/]", "warn": "[yellow]warn[/]", "fail": "[red]FAIL[/]", "info": "[dim]info[/]"}
_VERDICT = {"ok": "[green]works[/]", "warn": "[yellow]works, but[/]", "fail": "[red]will not work[/]"}


def run(args: argparse.Namespace, console: Console) -> int:
    from refit import transports
    from refit.tools.doctor import diagnose

    known = transports.names()
    asked = [t.strip() for t in (args.transport or ",".join(known)).split(",") if t.strip()]
    for name in asked:
        if name not in known:
            raise ValueError(f"unknown transport {name!r}; choose one of {', '.join(known)}")
    with progress_console(quiet=args.verbosity < 0).status(
        "checking this machine (the CUDA IPC probe starts a second process)"
    ):
        report = diagnose(transports=asked, settings=args.settings, probe=not args.no_probe)
    failed = report.failed(asked) if args.transport else []
    if args.json:
        emit_json({**report.to_json(), "asked": asked if args.transport else [], "ok": not failed}, args.json)
    checks = _doctor_table("refit doctor: this machine")
    for c in report.checks:
        label = "note" if c.status == "info" else "fix"
        checks.add_row(_MARK[c.status], escape(c.name), _with_fix(c.detail, c.fix if c.status != "ok" else "", label))
    verdicts = _doctor_table("transports")
    for v in report.verdicts:
        verdicts.add_row(_VERDICT[v.status], v.transport, _with_fix(v.reason, v.fix))
    console.print(checks)
    console.print(verdicts)
    if failed:
        console.print(f"[red]{', '.join(failed)} cannot work on this machine[/] (see 'fix:' above)")
    return 1 if failed else 0


def _doctor_table(title: str) -> Table:
    """A borderless list: status, name, detail; a fix goes on its own line under the detail."""
    table = Table(title=title, title_justify="left", title_style="bold", box=None, show_header=False)
    for _ in range(3):
        table.add_column(no_wrap=False)
    return table


def _with_fix(detail: str, fix: str, label: str = "fix") -> str:
    return escape(detail) + (f"\n[cyan]{label}:[/] {escape(fix)}" if fix else "")


def add_parser(sub, common: argparse.ArgumentParser) -> None:  # type: ignore[no-untyped-def]
    doctor = command_parser(
        sub,
        common,
        "doctor",
        help="check which transports will work on this machine, and what to change",
        description="Check CUDA, CUDA IPC (a real export/open between two processes), GPU peers "
        "and NVLink, NCCL, /dev/shm and free memory against the bucket budget, vLLM with refit's "
        "backend, Ray, and NVIDIA NIXL. Exit code 1 when an asked --transport cannot work.",
    )
    doctor.add_argument("--transport", help="comma-separated transports you mean to use (default: report all, exit 0)")
    doctor.add_argument("--no-probe", action="store_true", help="skip the CUDA IPC probe (a second process)")
    json_option(doctor)
    doctor.set_defaults(func=run)
