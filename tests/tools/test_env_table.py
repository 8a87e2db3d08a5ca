"""docs/USAGE.md's table of REFIT_* variables x commands, cell by cell: an invalid value of any variable is one
line and exit code 2 before any work, and a variable a command says it honours reaches the settings its work
runs with. Every command runs in this process with its work replaced by a recorder."""

from __future__ import annotations

import os
import re
from types import SimpleNamespace

import pytest
from locations import ROOT

from refit.settings import KNOWN, Settings, cpu_kernel_enabled
from refit.tools.cli import main

USAGE = os.path.join(ROOT, "docs", "USAGE.md")
COMMANDS = ("demo", "bench", "plan", "doctor")
ARGV = {
    "demo": ["demo", "--transport", "shm", "--steps", "1"],
    "bench": ["bench", "--quick", "--transport", "shm"],
    "plan": ["plan", "--preset", "tiny", "--json"],
    "doctor": ["doctor", "--no-probe"],
}


def _table() -> dict[str, dict[str, str]]:
    """{variable: {command: cell}} from the "Which command reads which" table."""
    with open(USAGE) as f:
        text = f.read()
    section = text[text.index("### Which command reads which") :]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    table = {}
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        for name in re.findall(r"`(\w+)`", cells[0]):
            table[name] = dict(zip(COMMANDS, cells[1:]))
    return table


TABLE = _table()
INVALID = {
    "REFIT_BUFFER_MEMORY_RATIO": "abc",
    "NRL_REFIT_BUFFER_MEMORY_RATIO": "2",
    "REFIT_BUCKET_BYTES": "abc",
    "REFIT_TIMEOUT": "-1",
    "REFIT_CONNECT_TIMEOUT": "0",
    "REFIT_CUDA_IPC": "yes",
    "REFIT_CUDA_IPC_EVENTS": "no",
    "REFIT_CPU_KERNEL": "off",
    "REFIT_COPY_PROGRAMS": "x",
    "REFIT_DIGEST_CHUNK_WORDS": "0",
    "REFIT_DIGEST_ROWS": "-8",
    "REFIT_DIGEST_COLS": "1k",
    "REFIT_DIGEST_WARPS": "many",
    "REFIT_NIXL_ERROR_MODE": "loud",
}
"""A value each variable refuses on every command (REFIT_HOST, REFIT_IFNAME: only where a Sender listens;
REFIT_TOKEN, REFIT_SITE: any value is a token, a site)."""
LISTEN_INVALID = {"REFIT_HOST": "not.a.host", "REFIT_IFNAME": "no-such-if0"}
VALID = {
    "REFIT_BUFFER_MEMORY_RATIO": "0.05",
    "NRL_REFIT_BUFFER_MEMORY_RATIO": "0.05",
    "REFIT_BUCKET_BYTES": "65536",
    "REFIT_TIMEOUT": "7",
    "REFIT_CONNECT_TIMEOUT": "9",
    "REFIT_HOST": "127.0.0.1",
    "REFIT_IFNAME": "lo",
    "REFIT_TOKEN": "sesame",
    "REFIT_SITE": "rack-1",
    "REFIT_CUDA_IPC": "0",
    "REFIT_CUDA_IPC_EVENTS": "0",
    "REFIT_CPU_KERNEL": "0",
    "REFIT_COPY_PROGRAMS": "3",
    "REFIT_DIGEST_CHUNK_WORDS": "4096",
    "REFIT_DIGEST_ROWS": "4",
    "REFIT_DIGEST_COLS": "64",
    "REFIT_DIGEST_WARPS": "4",
    "REFIT_NIXL_ERROR_MODE": "peer",
}


def _reached(name: str, settings: Settings, env: dict[str, str]) -> bool:
    """Whether variable `name` (set to VALID[name]) took effect in the `settings` of the recorded work, or, for
    those read where the work runs (in the command's process or the children inheriting it), in `env`."""
    value = VALID[name]
    by_field = {  # the Settings field each variable sets
        "REFIT_BUFFER_MEMORY_RATIO": ("ratio", float(value) if "RATIO" in name else None),
        "NRL_REFIT_BUFFER_MEMORY_RATIO": ("ratio", float(value) if "RATIO" in name else None),
        "REFIT_BUCKET_BYTES": ("bucket_bytes", int(value) if name == "REFIT_BUCKET_BYTES" else None),
        "REFIT_TIMEOUT": ("timeout_s", 7.0),
        "REFIT_CONNECT_TIMEOUT": ("connect_timeout_s", 9.0),
        "REFIT_HOST": ("host", value),
        "REFIT_IFNAME": ("ifname", value),
        "REFIT_TOKEN": ("token", value),
        "REFIT_SITE": ("site", value),
        "REFIT_CUDA_IPC": ("cuda_ipc", False),
        "REFIT_CUDA_IPC_EVENTS": ("cuda_ipc_events", False),
    }
    if name in by_field:
        field, expected = by_field[name]
        return getattr(settings, field) == expected
    if name == "REFIT_CPU_KERNEL":
        return env.get(name) == value and not cpu_kernel_enabled()
    if name == "REFIT_NIXL_ERROR_MODE":
        from refit.transports.nixl import backend_params

        return env.get(name) == value and backend_params("UCX") == {"ucx_error_handling_mode": "peer"}
    return env.get(name) == value  # read at import by the GPU kernels, in whichever process runs them


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> list:
    """Each command's work replaced: what it would have run with is recorded as (settings, environment)."""
    from refit.tools import doctor, plan
    from refit.tools.bench import harness, report, runner
    from refit.tools.demo import engines, run

    seen: list = []
    for name in (*TABLE, "PYTHONWARNINGS", "NIXL_LOG_LEVEL", "UCX_LOG_LEVEL"):
        monkeypatch.delenv(name, raising=False)

    def demo_run(cfg, console, engine=None, trainer=None) -> bool:  # type: ignore[no-untyped-def]
        seen.append((run.session_settings(cfg), dict(os.environ)))
        return True

    def bench_run(cfg, on_method=None):  # type: ignore[no-untyped-def]
        seen.append((harness.session_settings(cfg, cfg.bucket_bytes), dict(os.environ)))
        return {}

    def plan_report(args):  # type: ignore[no-untyped-def]
        seen.append((plan.plan_settings(args), dict(os.environ)))
        return real_plan_report(args)

    def diagnose(*, transports, settings=None, probe=True):  # type: ignore[no-untyped-def]
        seen.append((settings, dict(os.environ)))
        return doctor.Report(checks=[])

    real_plan_report = plan.plan_report
    monkeypatch.setattr(run, "run", demo_run)
    monkeypatch.setattr(engines, "spawn_engine", lambda cfg: SimpleNamespace(close=lambda: 0))
    monkeypatch.setattr(runner, "run_bench", bench_run)
    monkeypatch.setattr(report, "show", lambda reports, console: None)
    monkeypatch.setattr(report, "show_scaling", lambda reports, console: None)
    monkeypatch.setattr(plan, "plan_report", plan_report)
    monkeypatch.setattr(doctor, "diagnose", diagnose)
    return seen


def _cells(kind: str) -> list:
    return [
        pytest.param(name, command, id=f"{name}-{command}")
        for name, row in TABLE.items()
        for command, cell in row.items()
        if cell.startswith(kind)
    ]


def _invalid(name: str, command: str) -> str | None:
    return INVALID.get(name) or (LISTEN_INVALID.get(name) if command in ("demo", "bench") else None)


def test_the_table_lists_every_variable_refit_reads() -> None:
    src = os.path.join(ROOT, "src")
    read = set()
    for folder, _, files in os.walk(src):
        for f in files:
            if f.endswith(".py"):
                with open(os.path.join(folder, f)) as fh:
                    read |= set(re.findall(r"\"((?:NRL_)?REFIT_[A-Z_]+)\"", fh.read()))
    assert read - {"REFIT_DIGEST_", "REFIT_TEST_"} <= set(TABLE), sorted(read - set(TABLE))
    assert set(KNOWN) == set(TABLE)  # what the CLI warns about as unknown
    assert set(TABLE) == set(VALID)
    for row in TABLE.values():
        assert all(cell.startswith(("honoured", "ignored: ")) for cell in row.values()), row


@pytest.mark.parametrize(("name", "command"), [p for p in _cells("") if _invalid(*p.values)])
def test_an_invalid_value_is_one_line_and_exit_2_before_any_work(
    name: str, command: str, recorded: list, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setenv(name, _invalid(name, command))
    assert main(ARGV[command]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and name in err, err
    assert recorded == []


@pytest.mark.parametrize(("name", "command"), _cells("honoured"))
def test_an_honoured_variable_reaches_the_commands_work(
    name: str, command: str, recorded: list, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setenv(name, VALID[name])
    assert main(ARGV[command]) == 0, capsys.readouterr().err
    assert recorded, "the command's work never ran"
    for settings, env in recorded:
        assert _reached(name, settings, env)


@pytest.mark.parametrize("command", ["demo", "bench", "plan"])
def test_the_option_overrides_the_variable(
    command: str, recorded: list, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setenv("REFIT_BUCKET_BYTES", "1048576")
    assert main([*ARGV[command], "--bucket-bytes", "65536"]) == 0, capsys.readouterr().err
    assert {s.bucket_bytes for s, _ in recorded} == {65536}
