"""The command line: one-line errors with exit code 2, output that never wraps in a pipe, JSON, help, logging."""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import subprocess
import sys

import pytest
import torch
from locations import SRC

from refit.tools.cli import build_parser, main

HAS_VLLM = importlib.util.find_spec("vllm") is not None
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")


def _run(*argv: str, code: str = "") -> subprocess.CompletedProcess:
    """`python -m refit ARGV` (or `python -c CODE`) with stdout and stderr as pipes."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [SRC, os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, *(["-c", code] if code else ["-m", "refit"]), *argv]
    return subprocess.run(cmd, capture_output=True, text=True, env=env)


def _one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    for fragment in fragments:
        assert fragment in lines[0]


MISTAKES = [
    (["plan", "--preset", "nonexistent"], ["unknown preset 'nonexistent'", "qwen2-7b", "--config"]),
    (["plan", "--config", "/missing.json"], ["/missing.json", "No such file", "config.json"]),
    (["bench", "--config", "/missing.json"], ["/missing.json", "No such file"]),
    (["plan", "--bucket-bytes", "0"], ["bucket_bytes (0) must be > 0"]),
    (["demo", "--ranks", "3"], ["--ranks applies only to --trainer fsdp", "add --trainer fsdp"]),
    (["demo", "--transport", "carrier-pigeon"], ["unknown transport 'carrier-pigeon'", "shm"]),
    (["demo", "--steps", "0"], ["steps (0) must be >= 1"]),
    (["demo", "--hidden", "100"], ["hidden (100) a multiple of 64"]),
    # Without vLLM the demo stops at the missing engine first; with it, at the combination.
    (
        ["demo", "--trainer", "fsdp", "--engine", "vllm"],
        ["--trainer fsdp runs with --engine module"]
        if HAS_VLLM
        else ["--engine vllm needs vllm, which is not installed", "pip install", "--engine module"],
    ),
    (["bench", "--receivers", "one"], ["--receivers takes comma-separated integers"]),
    (["doctor", "--transport", "carrier-pigeon"], ["unknown transport 'carrier-pigeon'"]),
    (["demo", "--transport", ","], ["--transport needs at least one of shm"]),
    (["plan", "--json", "/nonexistent/plan.json"], ["cannot write into /nonexistent", "writable folder"]),
    (["bench", "--quick", "--json", "/nonexistent/bench.json"], ["cannot write into /nonexistent"]),
]


@pytest.mark.parametrize("argv,fragments", MISTAKES, ids=[" ".join(m[0]) for m in MISTAKES])
def test_a_mistake_gets_one_line_naming_the_problem_and_the_fix(argv: list[str], fragments: list[str]) -> None:
    _one_line_error(_run(*argv), *fragments)


@no_cuda
@pytest.mark.parametrize(
    "argv", [["demo", "--transport", "nccl"], ["demo", "--transport", "shm,cuda-ipc"], ["bench", "--transport", "nccl"]]
)
def test_a_gpu_transport_without_cuda_is_a_clean_error(argv: list[str]) -> None:
    _one_line_error(_run(*argv), "needs a CUDA GPU", "use 'shm'")


def test_demo_with_vllm_missing_says_how_to_install_it() -> None:
    code = "import sys; sys.modules['vllm'] = None; from refit.tools.cli import main; sys.exit(main(sys.argv[1:]))"
    _one_line_error(
        _run("demo", "--engine", "vllm", code=code), "--engine vllm needs vllm", "pip install", "--engine module"
    )


@no_cuda
def test_the_library_refuses_a_gpu_transport_without_cuda_with_a_value_error() -> None:
    from refit import ModuleSource, Sender

    with pytest.raises(ValueError, match="needs a CUDA GPU.*use 'shm'"):
        Sender(ModuleSource(torch.nn.Linear(2, 2)), transport="nccl")


def test_plan_in_a_pipe_keeps_every_line_whole() -> None:
    result = _run("plan", "--preset", "qwen2-7b", "--bucket-bytes", str(1 << 30))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 4, lines
    assert lines[1].startswith("buckets: 16 of capacity 1024.0 MiB") and "spanning buckets: " in lines[1]
    assert lines[3].startswith("manifest digest ") and lines[3].endswith("control bytes per receiver")


def test_doctor_in_a_pipe_keeps_every_row_on_one_line() -> None:
    result = _run("doctor", "--transport", "shm")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    memory = next(line for line in lines if "memory cpu" in line)
    assert memory.split()[0] == "ok" and memory.rstrip().endswith("of free memory)")  # status to detail, one line
    container = next(line for line in lines if " container " in line)
    assert "kernel" in container and len(container.rstrip()) > 80  # longer than a terminal: not wrapped to fit


def test_plan_json_carries_the_numbers(capsys: pytest.CaptureFixture) -> None:
    assert main(["plan", "--preset", "qwen2-7b", "--bucket-bytes", str(1 << 30), "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert (r["tensors"], r["num_buckets"], r["capacity"]) == (339, 16, 1 << 30)
    assert r["sender_bytes"] == 2 << 30 and len(r["digest"]) == 32


def test_plan_json_to_a_file(tmp_path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "plan.json"
    assert main(["plan", "--preset", "tiny", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["model"] == "tiny" and capsys.readouterr().out == ""


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@pytest.mark.parametrize("command", ["demo", "bench", "plan", "doctor"])
def test_every_option_is_described_and_shows_its_default(command: str) -> None:
    sub = _subparsers(build_parser())[command]
    text = sub.format_help()
    for action in sub._actions:
        assert action.help, f"{command} {action.option_strings} has no help"
        if action.default not in (None, False, argparse.SUPPRESS) and action.option_strings:
            assert f"(default: {action.default})" in " ".join(text.split()), (command, action.dest)


def test_plan_help_lists_its_presets() -> None:
    from refit.tools.bench.presets import PRESETS

    text = " ".join(_subparsers(build_parser())["plan"].format_help().split())
    assert f"presets: {', '.join(PRESETS)}" in text


@pytest.mark.parametrize(
    "argv,level",
    [
        (["-v", "plan"], logging.INFO),
        (["plan", "-vv"], logging.DEBUG),
        (["plan", "-q"], logging.ERROR),
        (["plan"], logging.WARNING),
    ],
)
def test_verbosity_flags_set_the_refit_logger_before_or_after_the_command(
    argv: list[str], level: int, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    assert main([*argv, "--preset", "tiny"]) == 0
    assert logging.getLogger("refit").level == level
    assert (os.environ.get("VLLM_LOGGING_LEVEL") == "ERROR") == (level >= logging.WARNING)
