"""`refit demo` end to end: a real transformers model, trainer and engine processes, every refit checked."""

from __future__ import annotations

import pytest

from refit.cli import main


@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_demo_verifies_every_refit_including_a_dtype_change(transport: str, capsys: pytest.CaptureFixture) -> None:
    code = main(["demo", "--transport", transport, "--steps", "3", "--dtype-change-at", "1", "--layers", "2",
                 "--hidden", "128", "--bucket-bytes", "262144"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert "all refits verified" in out and out.count("✓") == 6
    assert "2*" in out  # the dtype change started epoch 2


def test_demo_with_an_fsdp2_trainer_over_two_ranks(capfd: pytest.CaptureFixture) -> None:
    code = main(["demo", "--trainer", "fsdp", "--ranks", "2", "--transport", "gloo", "--steps", "2", "--dtype-change-at",
                 "0", "--layers", "2", "--hidden", "128", "--bucket-bytes", "262144"])  # fmt: skip
    captured = capfd.readouterr()
    out = captured.out
    assert code == 0, out + captured.err[-3000:]
    assert "sharded with FSDP2 over 2 ranks" in out and "all refits verified" in out and out.count("✓") == 4
