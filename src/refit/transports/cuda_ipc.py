"""cuda-ipc transport: colocated GPU processes share device bucket buffers through CUDA IPC handles.

The sender exports each buffer's handle once per session; each receiver opens it once. Ordering is
a stream sync on each side plus the bucket header and its acknowledgement: the sender's pack is
complete before the header goes out, and the receiver's reads are complete before its ACK.
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


class CudaIpcTransport(Transport):
    name = "cuda-ipc"
    device_type = "cuda"

    def __init__(self, buffers: list[torch.Tensor]) -> None:
        self.buffers = buffers

    @classmethod
    def offer(
        cls, *, capacity: int, num_slots: int, num_receivers: int, device: torch.device, settings: Settings
    ) -> tuple[Transport, dict]:
        # One allocation per buffer, so each handle maps exactly its own bytes.
        buffers = [torch.zeros(capacity, dtype=torch.uint8, device=device) for _ in range(num_slots)]
        torch.cuda.synchronize(device)
        return cls(buffers), {"handles": [export(b) for b in buffers], "capacity": capacity}

    @classmethod
    def join(cls, info: dict, *, rank: int, device: torch.device, settings: Settings) -> Transport:
        handles = info.get("handles")
        if not isinstance(handles, list) or not all(isinstance(h, dict) for h in handles):
            raise PeerError(f"cuda-ipc setup info is malformed: {info!r:.200}")
        with torch.cuda.device(device):
            return cls([open_tensor(h) for h in handles])

    def before_send(self, slot: int) -> None:
        torch.cuda.current_stream(self.buffers[slot].device).synchronize()

    def send(self, slot: int, nbytes: int) -> Pending:
        return DONE

    def recv(self, slot: int, nbytes: int) -> Pending:
        return DONE

    def release(self, slot: int) -> None:
        torch.cuda.current_stream().synchronize()

    def flush(self) -> None:
        torch.cuda.current_stream().synchronize()

    def close(self) -> None:
        self.buffers = []
