"""cuda-ipc's slot ordering without a GPU: with interprocess events the host never synchronizes a stream per
bucket, and a slot is packed again only after the device waits for every receiver's "loaded" record of it;
without them (or for a receiver rank that has none) each side synchronizes, as before. Streams and events
are stand-ins that log what each side asks of the device."""

from __future__ import annotations

import pytest
import torch

from refit.transports import cuda_ipc
from refit.transports.cuda_ipc import CudaIpcTransport


class _Stream:
    def __init__(self, log: list) -> None:
        self.log = log

    def wait_event(self, e: _Event) -> None:
        self.log.append(("wait", e.name))

    def synchronize(self) -> None:
        self.log.append(("sync",))


class _Event:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def record(self, stream: _Stream) -> None:
        self.log.append(("record", self.name))


@pytest.fixture
def log(monkeypatch: pytest.MonkeyPatch) -> list:
    out: list = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream(out))
    return out


def _sides(log: list, receivers: int = 2) -> tuple[CudaIpcTransport, list[CudaIpcTransport]]:
    bufs = [torch.zeros(8, dtype=torch.uint8) for _ in range(2)]
    packed = [_Event(f"packed{s}", log) for s in range(2)]
    loaded = [[_Event(f"loaded{s}r{r}", log) for r in range(receivers)] for s in range(2)]
    sender = CudaIpcTransport(bufs, packed, loaded)
    mine = [CudaIpcTransport(bufs, packed, [[loaded[s][r]] for s in range(2)]) for r in range(receivers)]
    return sender, mine


def test_events_order_the_slots_on_the_device_and_the_host_never_syncs(log: list) -> None:
    sender, (r0, r1) = _sides(log)
    sender.before_pack(1)
    sender.before_send(1)
    for r in (r0, r1):
        r.recv(1, 8)
        r.release(1)
    assert log == [
        ("wait", "loaded1r0"),  # the last bucket in slot 1 was read by every receiver before the pack
        ("wait", "loaded1r1"),
        ("record", "packed1"),  # the header goes out after this record
        ("wait", "packed1"),  # the receiver's stream waits for the pack before its loads
        ("record", "loaded1r0"),  # and records its reads before its ACK
        ("wait", "packed1"),
        ("record", "loaded1r1"),
    ]
    assert ("sync",) not in log


def test_without_events_each_side_synchronizes(log: list) -> None:
    bufs = [torch.zeros(8, dtype=torch.uint8)]
    sender, receiver = CudaIpcTransport(bufs), CudaIpcTransport(bufs)
    sender.before_pack(0)
    sender.before_send(0)
    receiver.recv(0, 8)
    receiver.release(0)
    assert log == [("sync",), ("sync",)]


def test_the_senders_offer_decides_and_a_rank_without_its_own_event_syncs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Events the sender made for 2 receivers: rank 2 (joined later) has no "loaded" event, so it waits for
    "packed" and syncs before its ACK. A receiver's own REFIT_CUDA_IPC_EVENTS=0 changes nothing (the sender
    does not sync): only an offer without events means syncs."""
    opened: list = []
    monkeypatch.setattr(cuda_ipc, "open_tensor", lambda h: torch.zeros(8, dtype=torch.uint8))
    monkeypatch.setattr(cuda_ipc, "_open_events", lambda handles, device: opened.append(handles) or list(handles))

    class _Device:
        def __init__(self, device: object) -> None: ...
        def __enter__(self) -> None: ...
        def __exit__(self, *a: object) -> None: ...

    monkeypatch.setattr(torch.cuda, "device", _Device)
    from refit.settings import Settings

    info = {"handles": [{}, {}], "packed": ["p0", "p1"], "loaded": [["a0", "a1"], ["b0", "b1"]]}
    t = CudaIpcTransport.join(info, rank=1, device=torch.device("cpu"), settings=Settings())
    assert t.packed == ["p0", "p1"] and t.loaded == [["b0"], ["b1"]]
    late = CudaIpcTransport.join(info, rank=2, device=torch.device("cpu"), settings=Settings())
    assert late.packed == ["p0", "p1"] and late.loaded is None
    off = CudaIpcTransport.join(info, rank=0, device=torch.device("cpu"), settings=Settings(cuda_ipc_events=False))
    assert off.packed == ["p0", "p1"] and off.loaded == [["a0"], ["a1"]]
    plain = CudaIpcTransport.join({"handles": [{}, {}]}, rank=0, device=torch.device("cpu"), settings=Settings())
    assert plain.packed is None and plain.loaded is None
