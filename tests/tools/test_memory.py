"""Memory: what `forecast` predicts and `MemoryProbe` measures are the same bytes (allocated or mapped)."""

from __future__ import annotations

import mmap
import threading

import pytest
import torch

from refit import ModuleEngine, ModuleSource, Receiver, Sender, Settings
from refit.tools.bench.memory import MemoryProbe
from refit.tools.bench.worker import held


def _model(scale: int) -> dict[str, torch.Tensor]:
    return {
        "embed.weight": torch.randn(64 * scale, 64),  # spans buckets: the receiver stages it
        "layer.0.weight": torch.randn(32, 64),
        "norm.weight": torch.randn(64),
    }


@pytest.mark.parametrize("bucket_bytes", [64 << 10, 256 << 20], ids=["split", "model-sized"])
def test_predicted_and_measured_memory_agree_on_each_transport(transport: str, bucket_bytes: int) -> None:
    """Sender and receiver in one process: the probe sees both sides, so it is held against both forecasts."""
    probe = MemoryProbe(torch.device("cpu"))
    settings = Settings(bucket_bytes=bucket_bytes, timeout_s=30)
    sender = Sender(ModuleSource(_model(8)), transport=transport, settings=settings)
    receiver = Receiver(ModuleEngine({k: torch.zeros_like(v) for k, v in _model(8).items()}), sender.rendezvous())
    t = threading.Thread(target=receiver.receive)
    t.start()
    sender.refit(1)
    t.join()
    assert sender.transport is not None and sender.manifest is not None
    measured = probe.measured([*sender.transport.buffers, *held(receiver)])
    predicted = sender.predicted_memory()
    slack = 2 * sender.options.num_slots * mmap.PAGESIZE  # a shared segment is mapped in whole pages
    assert 0 <= measured - (predicted["sender"] + predicted["receiver"]) < slack
    assert (sender.manifest.max_split_nbytes > 0) == (bucket_bytes == 64 << 10)
    sender.close()
    receiver.close()
