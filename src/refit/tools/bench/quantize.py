"""An FP8 engine in the bench: the shapes each side holds, and the trainer's quantizer alone against its floor."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable
from functools import partial

import torch

from refit.engines.module import block_formats
from refit.layout import fp8
from refit.layout.spec import TensorSpec
from refit.sources.module import ModuleSource
from refit.stages.fp8 import Quantized
from refit.tools.bench.presets import Shape

FLOAT_ENGINE, FP8_ENGINE = "float", "fp8"
ENGINE_DTYPES = (FLOAT_ENGINE, FP8_ENGINE)
FP8_METHODS = ("floor", "refit", "checksum", "fingerprint", "serial", "quantize")
"""What the bench measures with an FP8 engine: the refits (the trainer quantizes each one) and the quantizer."""
DEFAULT_BLOCK = 128
CAST_FLOOR_VALUES = 1 << 30
"""The cast floor runs over at most this many values (2 GiB of bf16): its bandwidth, not its time, is compared."""

Timed = Callable[[Callable[[], object]], list[float]]


def sides(shape: Shape, engine_dtype: str | None) -> tuple[Shape, Shape]:
    """(the trainer's shape, the engine's). None: the shape as it is on both sides (a preset's FP8 weights are
    then held in FP8 by the trainer too: nothing is quantized). `float`: no FP8 anywhere. `fp8`: the trainer
    holds every linear weight in the wire dtype, the engine in FP8 blocks (the preset's block, else 128 x 128)
    with float32 scales, so that every refit quantizes."""
    if engine_dtype is None:
        return shape, shape
    if engine_dtype not in ENGINE_DTYPES:
        raise ValueError(f"engine dtype must be one of {', '.join(ENGINE_DTYPES)}, got {engine_dtype!r}")
    trainer = dataclasses.replace(shape, fp8_block=0)
    if engine_dtype == FLOAT_ENGINE:
        return trainer, trainer
    return trainer, dataclasses.replace(shape, fp8_block=shape.fp8_block or DEFAULT_BLOCK)


def measured(
    tensors: dict[str, torch.Tensor], engine_specs: list[TensorSpec], timed: Timed
) -> tuple[list[float], int, dict[str, float]]:
    """The trainer's quantizer alone, as a refit runs it (`Quantized.tensors` over every tensor the engine holds
    in FP8, into the buffers it keeps), checked bitwise against the reference rule: (times, bytes it reads and
    writes, {"cast_floor": the time a flat cast-copy of float values into FP8 takes over as many bytes}). The
    cast floor moves at most CAST_FLOOR_VALUES values and is scaled to the quantizer's bytes by its bandwidth."""
    formats = block_formats({s.name: s for s in engine_specs}, None)
    source = Quantized(ModuleSource(tensors), formats)
    names = list(source.formats)
    if not names:
        raise ValueError("the quantize method needs an engine that holds FP8 weights: pass --engine-dtype fp8")
    times = timed(partial(source.tensors, names))
    _check(source, tensors, names)
    moved = sum(tensors[n].nbytes + fp8.wire_nbytes(tensors[n].shape, formats[n]) for n in names)
    values = min(sum(tensors[n].numel() for n in names), CAST_FLOOR_VALUES)
    device, dtype = tensors[names[0]].device, tensors[names[0]].dtype
    flat = torch.randn(values, device=device).to(dtype)
    out = torch.empty(values, dtype=formats[names[0]].dtype, device=device)
    cast = statistics.median(timed(partial(out.copy_, flat)))
    cast_bytes = flat.nbytes + out.nbytes
    del flat, out, source
    return times, moved, {"cast_floor": cast * moved / cast_bytes}


def _check(source: Quantized, tensors: dict[str, torch.Tensor], names: list[str]) -> None:
    """Every quantized tensor and its scales against the reference rule's own (the PyTorch path), bitwise."""
    scale_names = [source.formats[n].scale_name(n) for n in names]
    got = dict(zip(names + scale_names, source.tensors(names + scale_names)))
    for n, s in zip(names, scale_names):
        q, scales = fp8.quantize_reference(tensors[n], source.formats[n], name=n)
        if not (torch.equal(got[n].view(torch.uint8), q.view(torch.uint8)) and torch.equal(got[s], scales)):
            raise RuntimeError(f"the quantizer gave other bytes than the reference rule for {n}")
