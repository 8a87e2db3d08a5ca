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
    assert "bitwise what was sent" in out and "add up to total" not in out  # the table's legend alone
    rows = [line for line in out.splitlines() if line.startswith("│")]
    assert len(rows) == 3 and all(row.count("✓") == 2 for row in rows)  # captured output: one line per refit


@pytest.mark.slow
def test_demo_lora_moves_only_the_adapter_and_verifies_every_refit(tmp_path, capsys) -> None:
    pytest.importorskip("peft")
    out_json = tmp_path / "demo.json"
    code = main(["demo", "--lora", "4", "--transport", "shm", "--steps", "2", "--json", str(out_json), *SMALL])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "all refits verified" in out and "rank-4 LoRA adapter" in out
    [header] = [line for line in out.splitlines() if line.startswith("┃")]
    assert "full MB" in header
    [result] = json.loads(out_json.read_text())
    assert len(result["refits"]) == 2
    for r in result["refits"]:
        assert r["params_ok"] and r["generate_ok"]
        assert 0 < r["nbytes"] < r["full_model_bytes"] / 10  # the adapter, not the model


@pytest.mark.slow
def test_demo_canary_runs_at_the_first_refit_and_every_nth_and_passes(tmp_path, capsys) -> None:
    out_json = tmp_path / "demo.json"
    code = main(["demo", "--canary", "2", "--transport", "shm", "--steps", "3", "--json", str(out_json), *SMALL])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "canary at version(s) 1, 3: the engine scored the probe as the trainer did" in out
    [result] = json.loads(out_json.read_text())
    assert ["canary_seconds" in r for r in result["refits"]] == [True, False, True]


def test_demo_canary_with_an_fp8_engine_is_refused_in_one_line(capsys: pytest.CaptureFixture) -> None:
    assert main(["demo", "--canary", "1", "--engine-dtype", "fp8", *SMALL]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--canary (1) runs with the plain trainer" in err[0], err


@pytest.mark.slow
@pytest.mark.parametrize(("dtype", "held"), [("fp8", "block FP8 (e4m3, 128 x 128"), ("mxfp8", "MXFP8 (e4m3, 1 x 32")])
def test_demo_with_a_quantized_engine_verifies_its_values_and_scales(dtype, held, tmp_path, capsys) -> None:
    """The engine's decoder linears hold `dtype` with scales: every refit equals the trainer's own quantization
    of its live weights, bitwise, and the engine generates as the trainer does with what it holds."""
    out_json = tmp_path / "demo.json"
    argv = ["demo", "--engine-dtype", dtype, "--transport", "shm", "--steps", "2", "--json", str(out_json), *SMALL]
    code = main(argv)
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"sent as {held}" in out and f"--engine-dtype {dtype}: MB counts" in out and "all refits verified" in out
    [result] = json.loads(out_json.read_text())
    assert [(r["params_ok"], r["generate_ok"]) for r in result["refits"]] == [(True, True)] * 2
    assert result["refits"][0]["nbytes"] < 0.75 * 2 * result["params"]  # the linears in 1 byte each, not bf16's 2


def test_the_demos_engine_dtypes_are_its_choices() -> None:
    from refit.tools.choices import DEMO_ENGINE_DTYPES
    from refit.tools.demo.fp8 import ENGINE_DTYPES

    assert DEMO_ENGINE_DTYPES == ("float", *ENGINE_DTYPES)


STAGES = ("handshake", "pack", "send", "wait", "verify", "commit", "other")
"""The trainer's columns that add up to the total, 'other' being what the named stages leave."""


@pytest.mark.slow
def test_demo_table_shows_every_trainer_stage_and_they_add_up_to_the_total(tmp_path, capsys) -> None:
    out_json = tmp_path / "demo.json"
    code = main(
        ["demo", "--wide", "--transport", "shm", "--steps", "2", "--dtype-change-at", "-1", "--json", str(out_json)]
        + SMALL
    )
    out = capsys.readouterr().out
    assert code == 0, out
    lines = out.splitlines()
    [header] = [line for line in lines if line.startswith("┃")]
    names = [c.strip() for c in header.strip("┃").split("┃")]
    assert {*STAGES, "total", "engine load", "engine verify"} <= set(names)  # commit shown, the engine's apart
    rows = [[c.strip() for c in line.strip("│").split("│")] for line in lines if line.startswith("│")]
    assert len(rows) == 2
    for row in rows:
        shown = [float(row[names.index(k)]) for k in STAGES]
        assert float(row[names.index("commit")]) > 0
        assert abs(sum(shown) - float(row[names.index("total")])) <= 0.05 * (len(shown) + 1) + 1e-9  # rounding only
    assert "add up to total" in out and "commit (from COMMIT sent until the engine's DONE" in out.replace("\n", " ")
    assert "n/a" not in out  # real engine columns
    [result] = json.loads(out_json.read_text())
    for r in result["refits"]:
        seconds = r["seconds"]
        assert sum(seconds[k] for k in STAGES) == pytest.approx(seconds["total"], abs=1e-9)
        assert seconds["commit"] > 0 and seconds["other"] >= 0
        # the engine's fingerprint check runs inside the trainer's verify and commit, so it cannot be longer
        assert r["engine_seconds"]["verify"] <= seconds["verify"] + seconds["commit"]


def test_a_refit_known_only_by_its_total_shows_no_stage_and_no_remainder() -> None:
    """M:N (MeshRefit) reports the total of pairs that ran side by side: no stage to add up, so none is made up."""
    from rich.console import Console

    from refit.tools.demo.run import Row, _row
    from refit.tools.demo.table import demo_table
    from refit.topology.stats import RefitStats

    stats = RefitStats(version=1, epoch=1, seconds={"total": 0.25})
    row = _row(stats, Row({"stats": {"seconds": {"load": 0.01}}}, True, True), loss=1.0)
    assert row["seconds"] == {"total": 0.25} and row["engine_seconds"] == {"load": 0.01}
    console = Console(width=400, record=True)
    console.print(demo_table("shm", [row], wide=True))
    [line] = [x for x in console.export_text().splitlines() if x.startswith("│")]
    cells = [c.strip() for c in line.strip("│").split("│")]
    assert cells[6:13] == ["n/a"] * 7 and cells[13] == "250.0" and cells[15:17] == ["10.0", "n/a"]


@pytest.mark.slow
def test_demo_json_carries_every_refit_with_the_engines_load_time(capsys: pytest.CaptureFixture) -> None:
    code = main(["demo", "--transport", "gloo", "--steps", "2", "--dtype-change-at", "1", "--json", *SMALL])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    [result] = json.loads(captured.out)  # stdout is JSON alone; the table went to stderr
    assert result["transport"] == "gloo" and result["ok"] and "all refits verified" in captured.err
    assert [(r["version"], r["epoch"], r["handshake"]) for r in result["refits"]] == [(1, 1, True), (2, 2, True)]
    for r in result["refits"]:
        assert r["params_ok"] and r["generate_ok"] and r["engine_seconds"]["load"] > 0 and r["seconds"]["total"] > 0


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
    # the sharded trainer sends the rotary tables the module engine holds: nothing of the engine's is kept unsent
    assert "non-persistent" not in captured.err and "WARNING" not in out + captured.err, captured.err[-2000:]


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
