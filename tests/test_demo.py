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
