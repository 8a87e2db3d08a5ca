"""Settings are refused where they are given, not when an engine joins (issue 33, item 1)."""

from __future__ import annotations

import pytest
import torch

from refit.engines.module import ModuleEngine
from refit.settings import Settings
from refit.topology.receiver import Receiver


@pytest.mark.parametrize("value", [1, 255])
def test_a_bucket_below_the_alignment_is_refused_at_construction(value: int) -> None:
    with pytest.raises(
        ValueError,
        match=rf"bucket_bytes \({value}\) is below the alignment of 256 bytes.*"
        "REFIT_BUCKET_BYTES",
    ):
        Settings(bucket_bytes=value)


def test_the_env_variable_is_refused_at_construction(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REFIT_BUCKET_BYTES", "1")
    with pytest.raises(ValueError, match=r"bucket_bytes \(1\) is below the alignment.*REFIT_BUCKET_BYTES"):
        Settings()


def test_the_alignment_itself_is_taken() -> None:
    assert Settings(bucket_bytes=256).bucket_bytes == 256


def test_a_receiver_refuses_a_changed_setting_before_it_connects() -> None:
    settings = Settings(bucket_bytes=1 << 20)
    settings.bucket_bytes = 1  # a mutable dataclass: changed after its own check
    rendezvous = {"transport": "shm", "host": "127.0.0.1", "port": 1, "token": "x"}  # nothing listens there
    with pytest.raises(ValueError, match=r"bucket_bytes \(1\) is below the alignment of 256 bytes"):
        Receiver(ModuleEngine(torch.nn.Linear(2, 2)), rendezvous, settings=settings)
