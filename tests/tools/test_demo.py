"""`refit demo` end to end: a real transformers model, trainer and engine processes, every refit checked."""

from __future__ import annotations

import json

import pytest

from refit.tools.cli import main

SMALL = "--layers 2 --hidden 128 --bucket-bytes 262144".split()
"""A 0.7M-parameter model in 256 KiB buckets: several buckets, seconds per refit on 2 cores."""


@pytest.mark.slow
def test_demo_verifies_every_refit_including_a_dtype_change(capsys: pytest.CaptureFixture) -> None:
    code = main(["demo", "--transport", "shm", "--steps", "3", "--dtype-change-at", "1", *SMALL])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "all refits verified" in out and out.count("✓") == 6
    assert "2*" in out  # the dtype change started epoch 2
    assert "The stages overlap" in out and "n/a" not in out  # the legend; a real load column
    rows = [line for line in out.splitlines() if line.startswith("│")]
    assert len(rows) == 3 and all(row.count("✓") == 2 for row in rows)  # captured output: one line per refit


@pytest.mark.slow
def test_demo_json_carries_every_refit_with_the_engines_load_time(capsys: pytest.CaptureFixture) -> None:
    code = main(["demo", "--transport", "gloo", "--steps", "2", "--dtype-change-at", "1", "--json", *SMALL])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    [result] = json.loads(captured.out)  # stdout is JSON alone; the table went to stderr
    assert result["transport"] == "gloo" and result["ok"] and "all refits verified" in captured.err
    assert [(r["version"], r["epoch"], r["handshake"]) for r in result["refits"]] == [(1, 1, True), (2, 2, True)]
    for r in result["refits"]:
        assert r["params_ok"] and r["generate_ok"] and r["seconds"]["load"] > 0 and r["seconds"]["total"] > 0


@pytest.mark.slow
def test_demo_with_an_fsdp2_trainer_over_two_ranks(capfd: pytest.CaptureFixture) -> None:
    code = main(
        [
            "demo",
            "--trainer",
            "fsdp",
            "--ranks",
            "2",
            "--transport",
            "gloo",
            "--steps",
            "2",
            "--dtype-change-at",
            "0",
            *SMALL,
        ]
    )
    captured = capfd.readouterr()
    out = captured.out
    assert code == 0, out + captured.err[-3000:]
    assert "sharded with FSDP2 over 2 ranks" in out and "all refits verified" in out and out.count("✓") == 4


@pytest.mark.slow
def test_demo_quiet_prints_errors_only(capfd: pytest.CaptureFixture) -> None:
    code = main(["demo", "-q", "--transport", "shm", "--steps", "1", "--dtype-change-at", "-1", *SMALL])
    captured = capfd.readouterr()
    assert code == 0, captured.err
    assert captured.out == "" and captured.err == "", captured.out + captured.err


def test_progress_is_off_when_stderr_is_not_a_terminal_or_quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    from refit.tools.console import progress_console

    monkeypatch.setattr("sys.stderr", io.StringIO())
    assert progress_console().quiet and progress_console(quiet=True).quiet
    tty = io.StringIO()
    tty.isatty = lambda: True  # type: ignore[method-assign]
    monkeypatch.setattr("sys.stderr", tty)
    assert not progress_console().quiet and progress_console(quiet=True).quiet
    assert progress_console().file is tty


@pytest.mark.slow
def test_an_engine_that_dies_before_it_joins_is_reported_at_once_with_its_own_error() -> None:
    import torch

    from refit import ModuleSource, Sender
    from refit.errors import RefitError
    from refit.settings import Settings
    from refit.tools.demo.run import EngineProcess

    # The engine's own settings fail when its session starts (bucket_bytes below the alignment): it dies
    # before it joins. Without the watcher the trainer would wait out the 600 s connect timeout.
    engine = EngineProcess({"model": {"layers": 1, "hidden": 128, "ffn": 384}, "bucket_bytes": 1, "timeout_s": 30})
    sender = Sender(ModuleSource(torch.nn.Linear(4, 4)), transport="shm", settings=Settings(timeout_s=30))
    try:
        engine.attach(sender, {"rendezvous": sender.rendezvous(), "prompts": [[1, 2]]})
        with pytest.raises(RefitError) as failed:
            engine.refit(1)
    finally:
        sender.close()
        engine.close()
    message = str(failed.value)
    assert message.startswith("engine process exited with code 1 before it connected: "), message
    assert "bucket_bytes (1) is below the alignment of 256 bytes" in message
    assert "within 600s" not in message and "token" not in message
