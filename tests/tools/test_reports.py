"""What the tools print, from made-up figures: the demo's wire column and its one connect line, the header's
plural, the handshake report's cause first, and the bench's note when serial buckets beat pipelined ones."""

from __future__ import annotations

import io

import pytest
import torch
from rich.console import Console

from refit.checks.manifest_check import validate
from refit.layout.spec import TensorSpec
from refit.tools.bench.report import notes
from refit.tools.demo.run import DemoConfig, _plural, _show
from refit.tools.demo.table import demo_table


def _row(version: int, *, delta: bool, wire: int, connect: float = 0.0) -> dict:
    seconds = {"total": 0.01}
    return {
        "version": version, "epoch": 1, "handshake": version == 1, "loss": 1.0, "nbytes": 50_300_000,
        "wire_bytes": wire, "full_bytes": 50_300_000, "delta": delta, "num_buckets": 7, "seconds": seconds,
        "engine_seconds": {}, "connect_seconds": connect, "gbps": 5.0, "params_ok": True, "generate_ok": True,
    }  # fmt: skip


def _text(renderable) -> str:  # type: ignore[no-untyped-def]
    console = Console(file=io.StringIO(), width=400)
    console.print(renderable)
    return console.file.getvalue()


def test_the_demo_table_shows_the_wire_bytes_and_marks_delta_refits() -> None:
    rows = [_row(1, delta=False, wire=50_300_000), _row(2, delta=True, wire=4_100_000), _row(3, delta=True, wire=0)]
    lines = [line for line in _text(demo_table("shm", rows)).splitlines() if "50.3" in line]
    assert len(lines) == 3
    assert "50.3 " in lines[0] and "Δ" not in lines[0]
    assert "4.1 Δ" in lines[1] and "0.0 Δ" in lines[2]  # a delta that moved nothing reads 0, not the full size


def test_only_the_refit_that_connected_reports_its_wait() -> None:
    rows = [_row(1, delta=False, wire=1, connect=0.5), _row(2, delta=False, wire=1, connect=1e-4)]
    console = Console(file=io.StringIO(), width=400)
    _show(DemoConfig(), console, rows, {}, True)
    waits = [line for line in console.file.getvalue().splitlines() if "for the engine to connect" in line]
    assert waits == [
        "version 1 first waited 500.0 ms for the engine to connect (up to REFIT_CONNECT_TIMEOUT), before its "
        "total began"
    ]


def test_the_demo_header_counts_steps_in_english() -> None:
    assert (_plural(1, "step"), _plural(4, "step")) == ("1 step", "4 steps")


def test_the_handshake_report_lists_the_shape_cause_first_and_marks_a_harmless_dtype() -> None:
    sent = [TensorSpec("a.weight", (4, 4), torch.float32), TensorSpec("z.weight", (8, 8), torch.bfloat16)]
    held = [TensorSpec("a.weight", (4, 4), torch.bfloat16), TensorSpec("z.weight", (8, 9), torch.float32)]
    message = validate(sent, held).message()
    shape = "z.weight: engine holds [8, 9] float32, sender sends [8, 8] bfloat16 (shape; the dtype alone would load"
    dtype = "a.weight: engine holds [4, 4] bfloat16, sender sends [4, 4] float32 (dtype: the engine cannot hold it"
    assert shape in message and dtype in message and message.index(shape) < message.index(dtype)


def test_the_bench_says_why_serial_buckets_can_beat_pipelined_ones() -> None:
    def result(median: float) -> dict:
        return {"median_s": median, "min_s": median, "max_s": median, "stages": {}}

    report = {
        "config": {"bucket_bytes": 1 << 30, "transport": "shm"},
        "nbytes": 4_000_000,
        "tensors": 21,
        "results": {"refit": result(0.012), "serial": result(0.010)},
    }
    (line,) = notes(report)
    assert line.startswith("serial buckets, no overlap beats refit (pipelined buckets) (10.0 ms vs 12.0 ms)")
    assert "pays only when a refit spans several buckets" in line and "about 1 bucket(s) of 3.8 MiB" in line
    report["results"]["serial"] = result(0.02)
    assert notes(report) == []


@pytest.mark.parametrize("lora,delta", [(False, False), (True, False), (False, True)])
def test_the_demo_table_fits_80_columns_without_a_cut_cell(lora: bool, delta: bool) -> None:
    rows = []
    for v in (1, 2, 100):
        r = _row(v, delta=delta and v > 1, wire=1_234_500_000)
        r.update(nbytes=1_234_500_000, loss=10.123, epoch=12, num_buckets=150, seconds={"total": 12.3456})
        r["buckets"] = {"delta": 150} if delta else {}
        if lora:
            r["full_model_bytes"] = 1_234_500_000
        rows.append(r)
    console = Console(file=io.StringIO(), width=80)
    console.print(demo_table("shm", rows))
    text = console.file.getvalue()
    assert "…" not in text and max(map(len, text.splitlines())) <= 80, text
    assert "1234.5" in text and "12345.6" in text


def test_the_demo_prints_legends_only_for_what_was_asked_wrapped_in_a_pipe() -> None:
    rows = [_row(1, delta=False, wire=1), _row(2, delta=True, wire=1)]
    rows[1]["buckets"] = {"delta": 3, "full-dense-scan": 4}
    console = Console(file=io.StringIO(), width=1000)
    _show(DemoConfig(), console, rows, {}, True)
    plain = console.file.getvalue()
    assert "--lora" not in plain and "--delta" not in plain and "add up to total" not in plain
    assert max(map(len, plain.splitlines())) <= 80, plain
    console = Console(file=io.StringIO(), width=1000)
    _show(DemoConfig(delta=True), console, rows, {}, True)
    text = console.file.getvalue()
    assert "version 2: 3 of 7 bucket(s) as a delta; full: 4 too many values changed" in text
    assert "--delta: Δ marks" in text and "--lora" not in text


def test_a_first_build_of_the_cpu_kernels_is_announced_in_one_line_before_the_first_refit(monkeypatch) -> None:
    from refit.tools.demo import kernels

    built: list[str] = []
    monkeypatch.setattr(kernels.copy_digest, "kernel_built", lambda: built.append("copy_digest"))
    monkeypatch.setattr(kernels.tensor_guard, "prepare", lambda: built.append("layout"))
    for cached, said in ((False, 1), (True, 0)):
        monkeypatch.setattr(kernels, "cached", lambda cached=cached: cached)
        console = Console(file=io.StringIO(), width=1000)
        kernels.prebuild(console)
        lines = console.file.getvalue().splitlines()
        assert len(lines) == said and all(line.startswith("compiling refit's CPU kernels, once") for line in lines)
    assert built == ["copy_digest", "layout"] * 2
