"""cuda-ipc transport: colocated GPU processes share device bucket buffers through CUDA IPC handles.

The sender exports each buffer's handle once per session; each receiver opens it once. Ordering is
on the device, through interprocess CUDA events the sender makes and exports with the buffers: per
slot one "packed" event and per (receiver, slot) one "loaded" event. The sender records "packed" after
packing a slot and sends the header; the receiver, on that header, makes its stream wait for it, loads,
records its "loaded" event and sends the ACK; before the sender packs into the slot again, its stream
waits for every receiver's "loaded". The header and the ACK order the record before the wait (a wait
waits for the record last made before it), so no host thread blocks per bucket and a slot is never
overwritten before every receiver's reads of it are done. Where the sender cannot make interprocess
events (or REFIT_CUDA_IPC_EVENTS=0 there), each side synchronizes its stream instead; a receiver rank
with no "loaded" event of its own (joined beyond the offer's count) waits for "packed" and synchronizes
before its ACK.
"""

from __future__ import annotations

import base64
import os

import torch

from refit.dtypes import dtype_from_name, dtype_name
from refit.errors import PeerError
from refit.settings import Settings
from refit.transports import device as devices
from refit.transports.base import DONE, Pending, Transport

_OPENED = 0


def handles_opened() -> int:
    """How many IPC handles this process has opened (for tests: once per buffer per session)."""
    return _OPENED


def blocker(device: torch.device, settings: Settings) -> str:
    """Why CUDA IPC cannot be used from this process, or '' when it can."""
    if not settings.cuda_ipc:
        return "REFIT_CUDA_IPC=0"
    if "expandable_segments:true" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").replace(" ", "").lower():
        return "PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True, whose memory has no IPC handle"
    try:
        torch.empty(256, dtype=torch.uint8, device=device).untyped_storage()._share_cuda_()
    except RuntimeError as e:  # torch's CUDA errors (no ptrace rights, a driver without IPC, ...)
        return f"exporting a CUDA IPC handle failed: {type(e).__name__}: {e}"
    return ""


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


def export(buf: torch.Tensor) -> dict:
    """JSON-able CUDA IPC description of a contiguous device tensor (its storage handle plus the view)."""
    storage = buf.untyped_storage()
    dev, handle, size, offset, ref_handle, ref_offset, event, event_sync = storage._share_cuda_()
    return {
        "device": dev,
        "uuid": devices.uuid(buf.device),
        "handle": _b64(handle),
        "size": size,
        "offset": offset,
        "ref_handle": _b64(ref_handle),
        "ref_offset": ref_offset,
        "event": _b64(event),
        "event_sync": bool(event_sync),
        "storage_offset": buf.storage_offset(),
        "shape": list(buf.shape),
        "stride": list(buf.stride()),
        "dtype": dtype_name(buf.dtype),
    }


def open_tensor(h: dict) -> torch.Tensor:
    """Open a tensor exported by `export` in another process (maps the sender's memory; no copy)."""
    global _OPENED
    d = base64.b64decode
    index = _local_index(h)
    try:
        storage = torch.UntypedStorage._new_shared_cuda(
            index,
            d(h["handle"]),
            h["size"],
            h["offset"],
            d(h["ref_handle"]),
            h["ref_offset"],
            d(h["event"]),
            h["event_sync"],
        )
    except Exception as e:  # noqa: BLE001 - the driver's errors name no single type; reported as PeerError with the fix
        raise PeerError(
            f"cannot open the sender's CUDA IPC handle on device {h['device']}: {e}. CUDA IPC needs both "
            "processes on one host, peer access between their GPUs, ptrace rights between them, and no "
            "expandable_segments in PYTORCH_CUDA_ALLOC_CONF. Set REFIT_CUDA_IPC=0 on the sender to stage "
            "through pinned host memory, or use the 'nccl' transport"
        ) from e
    _OPENED += 1
    t = torch.empty(0, dtype=dtype_from_name(h["dtype"]), device=storage.device)
    return t.set_(storage, h["storage_offset"], tuple(h["shape"]), tuple(h["stride"]))


def _local_index(h: dict) -> int:
    """The exporter's GPU as this process numbers it: by UUID, since CUDA_VISIBLE_DEVICES may differ."""
    uuid = h.get("uuid")
    if not isinstance(uuid, str):
        return int(h["device"])
    index = devices.local_index(uuid)
    if index is None:
        raise PeerError(
            f"the sender's GPU ({uuid}) is not visible in this process (CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); make it visible, or use 'nccl'"
        )
    return index


def _events(count: int, device: torch.device) -> list[torch.cuda.Event]:
    """`count` interprocess events on `device`, each recorded once (on an idle stream), so that a wait on one
    before its first real record returns at once."""
    with torch.cuda.device(device):
        out = [torch.cuda.Event(interprocess=True) for _ in range(count)]
        for e in out:
            e.record()
        return out


def _open_events(handles: object, device: torch.device) -> list[torch.cuda.Event] | None:
    """The events exported by `offer`, opened here; None where they cannot be."""
    if not isinstance(handles, list) or not all(isinstance(h, str) for h in handles):
        return None
    try:
        return [torch.cuda.Event.from_ipc_handle(device, base64.b64decode(h)) for h in handles]
    except Exception:  # noqa: BLE001 - the driver's errors name no single type; the caller decides
        return None


class CudaIpcTransport(Transport):
    name = "cuda-ipc"
    device_type = "cuda"

    def __init__(
        self,
        buffers: list[torch.Tensor],
        packed: list[torch.cuda.Event] | None = None,
        loaded: list[list[torch.cuda.Event]] | None = None,
    ) -> None:
        """`packed[slot]`: recorded by the sender after a pack. `loaded[slot]`: the receivers' "reads done"
        events of that slot (the sender's view: every receiver's; a receiver's view: its own, one)."""
        self.buffers = buffers
        self.packed = packed
        self.loaded = loaded

    @classmethod
    def offer(
        cls, *, capacity: int, num_slots: int, num_receivers: int, device: torch.device, settings: Settings
    ) -> tuple[Transport, dict]:
        # One allocation per buffer, so each handle maps exactly its own bytes.
        buffers = [torch.zeros(capacity, dtype=torch.uint8, device=device) for _ in range(num_slots)]
        info: dict = {"handles": [export(b) for b in buffers], "capacity": capacity}
        packed: list[torch.cuda.Event] | None = None
        loaded: list[list[torch.cuda.Event]] | None = None
        if settings.cuda_ipc_events:
            try:
                packed = _events(num_slots, device)
                by_rank = [_events(num_slots, device) for _ in range(num_receivers)]
                loaded = [[by_rank[r][s] for r in range(num_receivers)] for s in range(num_slots)]
                info["packed"] = [_b64(e.ipc_handle()) for e in packed]
                info["loaded"] = [[_b64(e.ipc_handle()) for e in row] for row in by_rank]
            except Exception:  # noqa: BLE001 - no interprocess events here: stream syncs order the slots
                packed, loaded = None, None
                info.pop("packed", None)
                info.pop("loaded", None)
        torch.cuda.synchronize(device)
        return cls(buffers, packed, loaded), info

    @classmethod
    def join(cls, info: dict, *, rank: int, device: torch.device, settings: Settings) -> Transport:
        handles = info.get("handles")
        if not isinstance(handles, list) or not all(isinstance(h, dict) for h in handles):
            raise PeerError(f"cuda-ipc setup info is malformed: {info!r:.200}")
        with torch.cuda.device(device):
            buffers = [open_tensor(h) for h in handles]
        packed = None
        if info.get("packed") is not None:  # the sender orders with events (its settings decide): so must this side
            packed = _open_events(info["packed"], device)
            if packed is None or len(packed) != len(buffers):
                raise PeerError("cannot open the sender's interprocess CUDA events; set REFIT_CUDA_IPC_EVENTS=0 on it")
        mine = info.get("loaded")
        loaded = None
        if packed is not None and isinstance(mine, list) and 0 <= rank < len(mine):
            own = _open_events(mine[rank], device)
            loaded = [[e] for e in own] if own is not None and len(own) == len(buffers) else None
        return cls(buffers, packed, loaded)

    def before_pack(self, slot: int) -> None:
        if self.loaded is not None:  # every receiver's reads of this slot's last bucket come first
            stream = torch.cuda.current_stream(self.buffers[slot].device)
            for e in self.loaded[slot]:
                stream.wait_event(e)

    def before_send(self, slot: int) -> None:
        stream = torch.cuda.current_stream(self.buffers[slot].device)
        if self.packed is None:
            stream.synchronize()
        else:
            self.packed[slot].record(stream)

    def send(self, slot: int, nbytes: int) -> Pending:
        return DONE

    def recv(self, slot: int, nbytes: int) -> Pending:
        if self.packed is not None:  # the header came after the sender recorded this slot's pack
            torch.cuda.current_stream(self.buffers[slot].device).wait_event(self.packed[slot])
        return DONE

    def release(self, slot: int) -> None:
        stream = torch.cuda.current_stream(self.buffers[slot].device)
        if self.loaded is None:
            stream.synchronize()
        else:
            self.loaded[slot][0].record(stream)

    def flush(self) -> None:
        torch.cuda.current_stream().synchronize()

    def close(self) -> None:
        self.buffers = []
