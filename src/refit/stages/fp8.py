"""The FP8 stage: the engine holds block-FP8 weights with scales, the trainer float ones; refits quantize.

The engine states what it holds when it joins (READY, after the token is proved both ways): per tensor, the FP8
dtype, the block shape, the scale's rounding, dtype and name (`formats_to_json`). Where the trainer holds that
tensor as float32, bfloat16 or float16, the trainer's half (`Quantized`, a view of the trainer's source) sends it
as the engine holds it: the FP8 values under the tensor's own name and the scales under the scale's name, each
quantized by the reference rule (`refit.layout.fp8`) from the live tensor at every refit. On the wire they are
plain tensors: the manifest lists them in FP8 and float32 (or uint8), the engine loads them as they are, and the
fingerprint digests the bytes the rule produced against the bytes the engine holds.

`Fp8Stage` names the stage in the manifest, so an engine process that does not know it refuses the handshake;
its bucket halves pass the bytes through (the quantization happens before the pack). Delta and staged refits
see FP8 wire bytes like any other. Zero-copy does not apply: the engine's tensors cannot be views of a float
tensor the trainer holds.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Hashable, Mapping, Sequence

import torch

from refit.dtypes import dtype_from_name, dtype_name
from refit.errors import RefitError
from refit.layout import fp8
from refit.layout.fp8 import BlockFormat
from refit.layout.manifest import Manifest
from refit.layout.packing import typed_view
from refit.layout.spec import Slice, TensorSpec
from refit.log import get_logger
from refit.protocol.wire import Bucket
from refit.sources.base import Source
from refit.stages.base import Stage

log = get_logger("sender")
MAX_FORMATS = 1 << 20
"""Most formats one engine may state (its READY is read after the token is proved, but still bounded)."""
_SCALES = ("float32", "ue8m0")


class Fp8Stage(Stage):
    """Listed in the manifest of a session that quantizes; the bytes of every bucket pass through unchanged.

    The trainer's half reads the quantizer's non-finite flags once per refit, when the last bucket is packed
    (one host sync, never one per bucket): a tensor holding NaN or +-Inf sets REFUSED on that bucket, every
    receiver fails the refit without loading it (nothing commits; the next refit rewrites every tensor), and
    the trainer's refit fails naming the tensor and its block. The session goes on."""

    name = "fp8"
    flags = Bucket.REFUSED

    def __init__(self, manifest: Manifest, device: torch.device, *, trainer: bool) -> None:
        super().__init__(manifest, device, trainer=trainer)
        self._source: Quantized | None = None
        self._refusal = ""

    def configure(self, session: Mapping[str, object]) -> None:
        source, bucket_buffer = session.get("source"), session.get("bucket_buffer")
        if self.trainer and isinstance(source, Quantized):
            self._source = source
            source.defer_checks()
            if callable(bucket_buffer):
                source.quantize_into_buckets(self.manifest, bucket_buffer)

    def base(self, version: int, ranks: list[int]) -> int | None:
        self._refusal = ""  # a refit begins
        if self._source is not None:
            self._source.non_finite()  # drops flags a broken-off refit left
        return None

    def outgoing(self, b: int, buf: torch.Tensor, nbytes: int) -> tuple[int, Bucket]:
        if self._source is None or b != self.manifest.num_buckets - 1:
            return nbytes, Bucket(0)
        self._refusal = self._source.non_finite()
        if self._refusal:
            log.error("refusing this refit: %s", self._refusal)
        return nbytes, Bucket.REFUSED if self._refusal else Bucket(0)

    def refusal(self) -> str:
        return self._refusal

    def incoming(self, b: int, buf: torch.Tensor, nbytes: int, flags: Bucket) -> torch.Tensor | None:
        if Bucket.REFUSED & flags:
            raise RefitError(
                "the trainer refused this refit: a tensor it quantizes to FP8 holds NaN or an infinite value (the "
                "trainer's error names it); nothing of it commits, and the next refit rewrites every tensor"
            )
        return None

    def failed(self) -> None:
        if self._source is not None:
            self._source.non_finite()


# -- what the engine states ----------------------------------------------------------------------------------


def formats_to_json(formats: Mapping[str, BlockFormat]) -> dict[str, dict]:
    """The engine's formats as READY states them (by the names the trainer sends)."""
    return {
        name: {
            "dtype": dtype_name(f.dtype),
            "block": list(f.block),
            "scale": f.scale,
            "scale_dtype": dtype_name(f.scale_dtype),
            "suffix": f.suffix,
        }
        for name, f in formats.items()
    }


def formats_from_json(raw: object, who: str) -> dict[str, BlockFormat]:
    """Formats as a peer stated them, every field checked; ValueError names `who` and what is wrong."""
    if not isinstance(raw, dict) or len(raw) > MAX_FORMATS:
        raise ValueError(f"{who}'s FP8 formats must be an object of at most {MAX_FORMATS} names")
    out = {}
    for name, f in raw.items():
        try:
            if not isinstance(f, dict) or set(f) != {"dtype", "block", "scale", "scale_dtype", "suffix"}:
                raise ValueError("not an object of dtype, block, scale, scale_dtype and suffix")
            block = f["block"]
            if not isinstance(block, list) or len(block) != 2 or not all(type(b) is int for b in block):
                raise ValueError("block must be two ints")
            if f["scale"] not in _SCALES or not isinstance(f["suffix"], str):
                raise ValueError(f"scale must be one of {_SCALES} and suffix a string")
            out[name] = BlockFormat(
                dtype=dtype_from_name(_str(f["dtype"])),
                block=(block[0], block[1]),
                scale=f["scale"],
                scale_dtype=dtype_from_name(_str(f["scale_dtype"])),
                suffix=f["suffix"],
            )
        except (ValueError, TypeError) as e:
            raise ValueError(f"{who} states an impossible FP8 format for {name!r:.200}: {e}") from None
    return out


def _str(v: object) -> str:
    if not isinstance(v, str):
        raise ValueError(f"{v!r:.40} is not a dtype name")
    return v


def stated(statements: Sequence[bytes]) -> dict[str, BlockFormat]:
    """The formats every receiver stated with READY, which must agree (one manifest serves them all)."""
    seen: dict[str, BlockFormat] | None = None
    for rank, raw in enumerate(statements):
        mine = parse_statement(raw, f"receiver {rank}")
        if seen is not None and mine != seen:
            differ = sorted(set(mine.items()) ^ set(seen.items()), key=str)[:3]
            names = ", ".join(n for n, _ in differ)
            raise ValueError(
                f"receiver {rank} holds other FP8 formats than receiver 0 (first: {names}); one session sends "
                "one layout: give every engine the same quantization"
            )
        seen = mine
    return seen or {}


def parse_statement(raw: bytes, who: str) -> dict[str, BlockFormat]:
    """The formats in one READY statement (JSON; an empty one states none)."""
    if not raw:
        return {}
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"{who}'s READY statement is not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{who}'s READY statement must be a JSON object")
    return formats_from_json(obj.get("formats", {}), who)


def checked(
    formats: Mapping[str, BlockFormat], held: Sequence[TensorSpec], *, exact_shapes: bool = True
) -> dict[str, BlockFormat]:
    """An engine's stated `formats`, checked against what it holds (`held`): each tensor in its FP8 dtype with
    its scales beside it (their shape too, where the engine checks shapes itself). ValueError says which not."""
    specs = {n: s for s in held for n in s.names}
    for name, f in formats.items():
        q, scale = specs.get(name), specs.get(f.scale_name(name))
        if q is None or q.dtype != f.dtype:
            raise ValueError(f"the engine states {name!r} in {f.dtype} but holds {q and q.dtype}")
        want = fp8.scale_shape(q.shape, f)
        if scale is None or scale.dtype != f.scale_dtype or (exact_shapes and tuple(scale.shape) != want):
            raise ValueError(
                f"the engine states {name!r} as {f.block} blocks with {f.scale_dtype} scales in "
                f"{f.scale_name(name)!r}, which it holds as {scale and (scale.dtype, tuple(scale.shape))}, not "
                f"{f.scale_dtype} of shape {want}"
            )
    return dict(formats)


def refused_with(formats: Mapping[str, BlockFormat], zero_copy: bool) -> str:
    """Why a session of these options cannot send these formats, or ''."""
    if formats and zero_copy:
        return (
            f"the engine holds {len(formats)} tensor(s) in FP8 (first: {next(iter(formats))}), which the trainer "
            "quantizes at every refit: zero-copy cannot map a float tensor onto FP8 bytes; drop zero_copy"
        )
    return ""


# -- the trainer's half --------------------------------------------------------------------------------------


class Quantized(Source):
    """The trainer's source as the engine holds it: each tensor the engine states in FP8 (and the trainer holds
    in float) becomes its FP8 values plus its scales, quantized by the reference rule from the live tensor
    whenever a bucket asks for either. Into buffers kept for the epoch, so the pack's copy plans stay valid."""

    stable_tensors = True

    def __init__(self, source: Source, formats: Mapping[str, BlockFormat]) -> None:
        """`formats`: what the engines state; only tensors the trainer holds in float are quantized (one it
        holds in FP8 already goes as it is, beside its own scales)."""
        self.source = source
        specs = source.specs()
        held = {n for s in specs for n in s.names}
        self.formats = {s.name: formats[s.name] for s in specs if _quantizes(s, formats)}
        self._scale_of = {f.scale_name(n): n for n, f in self.formats.items()}
        clash = sorted(held & set(self._scale_of))
        if clash:
            raise ValueError(
                f"the trainer holds {clash[0]!r} itself, which the engine names as the FP8 scales of "
                f"{self._scale_of[clash[0]]!r}: send that tensor already quantized, or drop {clash[0]!r}"
            )
        self._buffers: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._placed: dict[tuple[str, ...], tuple[int, dict[str, tuple[int, int]]]] = {}
        """Per bucket's names: its index and, per weight quantized straight into it, where its q and scales lie."""
        self._bucket_buffer: Callable[[int], torch.Tensor | None] | None = None
        self._deferred: fp8.Flagged | None = None
        """The flags of what `tensors` quantized since `non_finite` last read them (None: checked at once)."""
        self.stable_tensors = source.stable_tensors

    @property
    def lookup_only(self) -> bool:
        return False  # every bucket's tensors are quantized anew: a plan must never replay without `tensors`

    def specs(self) -> list[TensorSpec]:
        out = []
        for spec in self.source.specs():
            f = self.formats.get(spec.name)
            if f is None:
                out.append(spec)
                continue
            if spec.aliases:
                raise ValueError(f"{spec.name!r} is tied to {list(spec.aliases)}: refit does not quantize tied tensors")
            if not spec.shape:
                raise ValueError(f"{spec.name!r} is a 0-d tensor: block FP8 needs at least one dimension")
            out.append(TensorSpec(spec.name, spec.shape, f.dtype))
            out.append(TensorSpec(f.scale_name(spec.name), fp8.scale_shape(spec.shape, f), f.scale_dtype))
        return out

    def tensors(self, names: Sequence[str]) -> list[torch.Tensor]:
        # One call with the source's own names in bucket order (a scale stands for its weight): a gathering
        # source serves only contiguous runs of its names.
        wanted = list(dict.fromkeys(self._scale_of.get(n, n) for n in names))
        found = dict(zip(wanted, self.source.tensors(wanted)))
        b, places = self._placed.get(tuple(names), (-1, {}))
        buf = self._bucket_buffer(b) if places and self._bucket_buffer is not None else None
        jobs = []
        for n in wanted:
            f = self.formats.get(n)
            if f is None:
                continue
            fp8.check_source(found[n])
            at = places.get(n) if buf is not None and buf.device == found[n].device else None
            q, scales = self._buffer(n, found[n]) if at is None else _in_bucket(buf, at, f, found[n].shape)
            jobs.append(fp8.Job(found[n].detach(), f, q, scales, n))
            found[n], found[f.scale_name(n)] = q, scales
        with torch.no_grad():
            if self._deferred is None:
                fp8.quantize_many(jobs)  # one host sync, raising for a non-finite block
            else:
                self._deferred.extend(fp8.quantize_deferred(jobs))  # read once, at the refit's last bucket
        return [found[n] for n in names]

    def quantize_into_buckets(self, manifest: Manifest, bucket_buffer: Callable[[int], torch.Tensor | None]) -> None:
        """From now on a tensor that lies whole in one bucket of `manifest` with its scales is quantized straight
        into that bucket's buffer (`bucket_buffer(b)`, where the Sender packs it), so the pack copies nothing of
        it; a tensor split across buckets, or whose scales lie in another, goes through a buffer kept for the
        epoch."""
        self._placed, self._bucket_buffer = _placements(manifest, self.formats), bucket_buffer

    def defer_checks(self) -> None:
        """From now on `tensors` never syncs with the device nor raises for a non-finite block: it keeps the
        flags, which `non_finite` reads (the FP8 stage, once per refit)."""
        if self._deferred is None:
            self._deferred = []

    def non_finite(self) -> str:
        """Why what `tensors` quantized since the last call must not be sent (the first tensor holding NaN or
        +-Inf, and its block), or ''; forgets those flags."""
        if not self._deferred:
            return ""
        flagged, self._deferred = self._deferred, []
        return fp8.non_finite(flagged)

    def _buffer(self, name: str, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        f, shape = self.formats[name], tuple(w.shape)
        held = self._buffers.get(name)
        if held is None or tuple(held[0].shape) != shape or held[0].device != w.device:
            q = torch.empty(shape, dtype=f.dtype, device=w.device)
            scales = torch.empty(fp8.scale_shape(shape, f), dtype=f.scale_dtype, device=w.device)
            held = self._buffers[name] = (q, scales)
        return held

    def signature(self) -> Hashable:
        return self.source.signature()

    def prepare_refit(self) -> None:
        self.source.prepare_refit()

    def holdings(self) -> dict[str, Slice | None]:
        raise ValueError("M:N refits do not quantize to FP8 yet: give the engine workers float weights")

    def held_bytes(self) -> int:
        """The quantized copies kept for the epoch: one FP8 byte per value of each tensor quantized outside its
        bucket, plus its scales (what `nbytes` measures once every bucket has asked for them)."""
        placed = {n for _, places in self._placed.values() for n in places}
        specs = self.source.specs()
        return sum(
            fp8.wire_nbytes(s.shape, f) for s in specs if (f := self.formats.get(s.name)) and s.name not in placed
        )

    def held_tensors(self) -> list[torch.Tensor]:
        return [t for pair in self._buffers.values() for t in pair]

    @property
    def nbytes(self) -> int:
        """The trainer-side memory of the quantized copies (one FP8 byte per value, plus the scales)."""
        return sum(fp8.wire_nbytes(q.shape, self.formats[n]) for n, (q, _) in self._buffers.items())


def _placements(
    manifest: Manifest, formats: Mapping[str, BlockFormat]
) -> dict[tuple[str, ...], tuple[int, dict[str, tuple[int, int]]]]:
    """Per bucket (by its names, as the pack asks for them): its index and, for each weight of `formats` that
    lies whole in it beside its whole scales, the byte offsets of both. Names shared by two buckets (the middle
    of a split tensor) place nothing."""
    out: dict[tuple[str, ...], tuple[int, dict[str, tuple[int, int]]]] = {}
    seen: set[tuple[str, ...]] = set()
    for b, segs in enumerate(manifest.segments):
        names = tuple(manifest.entries[seg.entry].name for seg in segs)
        whole = {
            manifest.entries[seg.entry].name: seg.at
            for seg in segs
            if seg.lo == 0 and seg.hi == manifest.entries[seg.entry].spec.nbytes
        }
        places = {
            n: (whole[n], whole[f.scale_name(n)]) for n, f in formats.items() if n in whole and f.scale_name(n) in whole
        }
        if names in seen:
            out.pop(names, None)
        elif places:
            out[names] = (b, places)
        seen.add(names)
    return out


def _in_bucket(
    buf: torch.Tensor, at: tuple[int, int], f: BlockFormat, shape: torch.Size
) -> tuple[torch.Tensor, torch.Tensor]:
    """The q and scales of a tensor of `shape` as views of the bucket buffer `buf`, from byte offsets `at`."""
    sshape = fp8.scale_shape(shape, f)
    q = typed_view(buf, at[0], math.prod(shape) * f.dtype.itemsize, f.dtype).view(shape)
    scales = typed_view(buf, at[1], math.prod(sshape) * f.scale_dtype.itemsize, f.scale_dtype).view(sshape)
    return q, scales


def adapt(source: Source, formats: Mapping[str, BlockFormat], *, zero_copy: bool) -> tuple[Source, tuple[str, ...]]:
    """The source a session sends from, and the stage names it adds: `Quantized` where the receivers state FP8
    `formats` for tensors the trainer holds in float, else `source` unchanged. ValueError says why not."""
    needed = {s.name: formats[s.name] for s in source.specs() if _quantizes(s, formats)}
    if not needed:  # the trainer holds those tensors in FP8 already (with their scales): they go as they are
        return source, ()
    why = refused_with(needed, zero_copy)
    if why:
        raise ValueError(why)
    return Quantized(source, formats), (Fp8Stage.name,)


def _quantizes(spec: TensorSpec, formats: Mapping[str, BlockFormat]) -> bool:
    return spec.name in formats and spec.dtype in fp8.SOURCE_DTYPES


def mismatch(raw: bytes, formats: Mapping[str, BlockFormat], rank: int) -> str:
    """Why an engine joining later (its READY `raw`) does not fit a session whose engines stated `formats`,
    or ''."""
    try:
        mine = parse_statement(raw, f"receiver {rank}")
    except ValueError as e:
        return str(e)
    if mine == dict(formats):
        return ""
    return "it holds other FP8 formats than the session's engines: give every engine the same quantization"
