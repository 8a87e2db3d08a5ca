"""A receiver that will never come (its process died) ends the sender's wait at once (issue 33, item 1)."""

from __future__ import annotations

import pytest
import torch

from refit import ModuleSource, Sender
from refit.errors import PeerError
from refit.settings import Settings


def test_a_cancelled_connect_raises_the_reason_not_the_timeout() -> None:
    sender = Sender(ModuleSource(torch.nn.Linear(2, 2)), transport="shm", settings=Settings(connect_timeout_s=600))
    try:
        sender.cancel_connect("engine process exited with code 1 before it connected")  # before: no race
        with pytest.raises(PeerError, match=r"^engine process exited with code 1 before it connected$"):
            sender.connect()
        assert not sender.connected
    finally:
        sender.close()
