"""The load plan's recording and replay machinery, without vLLM: a tensor-parallel loader written in plain
torch (fused q/k/v rows, a row-parallel column slice, experts stacked from one fused gate/up tensor) is
recorded once on meta tensors, then replayed as batched copies from bf16 bucket views into float32
live tensors, on CPU and (marked gpu) on CUDA. The replay must equal running the loader itself.
"""

from __future__ import annotations

import pytest
import torch

from refit.integrations.vllm.recording import record
from refit.layout.packing import CopyPlan

H, I, E, TP, RANK = 16, 8, 4, 2, 1  # noqa: E741  (hidden, intermediate, experts: the config names)
SHAPES = {"q": (H, H), "k": (H // 2, H), "v": (H // 2, H), "o": (H, H), "gate_up": (E, 2 * I, H), "norm": (H,)}


class _Layer(torch.nn.Module):
    def __init__(self, device: str) -> None:
        super().__init__()
        zeros = {"qkv": (2 * H // TP, H), "o": (H, H // TP), "w13": (E, 2 * I // TP, H), "norm": (H,)}
        for name, shape in zeros.items():
            self.register_parameter(name, torch.nn.Parameter(torch.zeros(shape, device=device), requires_grad=False))


def _loader(layer: _Layer):  # type: ignore[no-untyped-def]
    """What a vLLM model's load_weights does for rank RANK of TP (narrow, fuse, stack, cast by copy_)."""

    def load(name: str, w: torch.Tensor) -> None:
        if name in ("q", "k", "v"):
            rows = w.shape[0] // TP
            offset = {"q": 0, "k": H // TP, "v": H // TP + H // 2 // TP}[name]
            layer.qkv.data.narrow(0, offset, rows).copy_(w.narrow(0, RANK * rows, rows))
        elif name == "o":
            layer.o.data.copy_(w.narrow(1, RANK * (H // TP), H // TP))
        elif name == "gate_up":
            for shard, part in enumerate(w.chunk(2, dim=1)):
                for e, expert in enumerate(part.unbind()):
                    n = I // TP
                    layer.w13.data[e].narrow(0, shard * n, n).copy_(expert.narrow(0, RANK * n, n))
        else:
            layer.norm.data.copy_(w)

    return load


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_recorded_copies_replay_the_loader_bitwise(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    live = _Layer(device)
    templates = {n: torch.empty(p.shape, device="meta") for n, p in live.named_parameters()}
    rec = record(live, {"layer": (live, templates)}, SHAPES, load=_loader(live))
    assert not rec.bad and not rec.rejected and all(p.device.type == device for p in live.parameters())
    assert len(rec.placements) == 6  # q, k, v, o, norm and one folded copy per gate/up half
    torch.manual_seed(0)
    wire = {n: torch.randn(s, device=device).to(torch.bfloat16) for n, s in SHAPES.items()}
    bucket = torch.cat([t.reshape(-1) for t in wire.values()])  # one received bucket, views into it
    views, at = {}, 0
    for n, t in wire.items():
        views[n] = bucket[at : at + t.numel()].view(t.shape)
        at += t.numel()
    targets = dict(live.named_parameters())
    plan = CopyPlan(
        [p.dst.of(targets[p.param]) for p in rec.placements], [p.src.of(views[p.name]) for p in rec.placements]
    )
    plan.run()
    reference = _Layer(device)
    load = _loader(reference)
    for n, t in wire.items():
        load(n, t)
    for n, p in reference.named_parameters():
        assert torch.equal(targets[n], p), n


@pytest.mark.parametrize("how", ["in place on its input", "into a new tensor"])
def test_a_loader_that_changes_values_is_never_replayed(how: str) -> None:
    live = _Layer("cpu")
    templates = {n: torch.empty(p.shape, device="meta") for n, p in live.named_parameters()}

    def load(name: str, w: torch.Tensor) -> None:
        live.norm.data.copy_(w.mul_(2) if how == "in place on its input" else w * 2)

    rec = record(live, {"layer": (live, templates)}, {"norm": (H,)}, load=load)
    assert not rec.placements and "transforms the values of norm" in rec.bad["layer"]
