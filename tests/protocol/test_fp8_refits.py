"""FP8 refits: the engine holds block-FP8 weights with their scales, the trainer float32 masters. The engine states
its formats when it joins, the trainer quantizes at every refit, and what lands equals the reference rule applied
to the trainer's live tensors, bitwise, with the fingerprint on and off, in delta and staged refits too."""

from __future__ import annotations

import json

import pytest
import torch
from threaded import Peer, refit_both, session

from refit import ModuleEngine, ModuleSource, RefitError, Sender, Settings
from refit.layout import fp8
from refit.layout.fp8 import BlockFormat
from refit.stages.fp8 import Quantized, adapt, formats_from_json, formats_to_json, mismatch, parse_statement
from refit.topology.receiver import Receiver
from refit.topology.stats import RefitStats

BF16, E4M3 = torch.bfloat16, torch.float8_e4m3fn
SETTINGS = Settings(bucket_bytes=64 << 10, timeout_s=60.0)
UE8M0 = BlockFormat(scale="ue8m0", scale_dtype=torch.uint8)


def _trainer() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {
        "embed.weight": torch.randn(200, 96, generator=g),  # kept in bf16 by the engine
        "q.weight": torch.randn(300, 260, generator=g),  # 78 KB of FP8: spans two buckets; partial edge blocks
        "o.weight": torch.randn(96, 200, generator=g) * 1e-3,
        "norm.weight": torch.randn(96, generator=g),
    }


QUANTIZED = ("q.weight", "o.weight")


def _engine(live: dict[str, torch.Tensor], fmt: BlockFormat | None = None) -> ModuleEngine:
    f = fmt or BlockFormat()
    held: dict[str, torch.Tensor] = {}
    for n, t in live.items():
        if n in QUANTIZED:
            held[n] = torch.zeros(t.shape, dtype=E4M3)
            held[f.scale_name(n)] = torch.zeros(fp8.scale_shape(t.shape, f), dtype=f.scale_dtype)
        else:
            held[n] = torch.zeros(t.shape, dtype=BF16)
    return ModuleEngine(held, fp8=fmt)


def _holds(engine: ModuleEngine, live: dict[str, torch.Tensor], fmt: BlockFormat | None = None) -> bool:
    f = fmt or BlockFormat()
    for n, t in live.items():
        if n in QUANTIZED:
            q, s = fp8.quantize(t, f, name=n)
            if not (_same(engine.tensor(n), q) and _same(engine.tensor(f.scale_name(n)), s)):
                return False
        elif not torch.equal(engine.tensor(n), t.to(BF16)):
            return False
    return True


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _session(live: dict[str, torch.Tensor], engine: ModuleEngine, **options: object):  # noqa: ANN202
    return session(ModuleSource(live, wire_dtype=BF16), engine, SETTINGS, **options)


def _refit(sender: Sender, peer: Peer, version: int) -> tuple:
    return refit_both(sender, peer, version)


def _step(live: dict[str, torch.Tensor], version: int) -> None:
    with torch.no_grad():
        for n, t in live.items():
            t.add_(torch.randn(t.shape, generator=torch.Generator().manual_seed(version)) * 1e-2)


@pytest.mark.parametrize("verify", ["fingerprint", None])
@pytest.mark.parametrize("fmt", [None, UE8M0], ids=["float32-scales", "ue8m0"])
def test_the_engine_holds_the_reference_quantization_of_the_live_tensors(
    verify: str | None, fmt: BlockFormat | None
) -> None:
    live = _trainer()
    engine = _engine(live, fmt)
    with _session(live, engine, verify=verify) as (sender, peer):
        for version in (1, 2, 3):
            if version > 1:
                _step(live, version)
            stats, got = _refit(sender, peer, version)
            assert isinstance(stats, RefitStats) and isinstance(got, RefitStats), (stats, got)
            assert _holds(engine, live, fmt), f"version {version}"
            assert engine.weights.version == version
        assert sender.manifest is not None and sender.manifest.stages == ("fp8",)
        wire = {p.spec.name: p.spec for p in sender.manifest.entries}
        assert wire["q.weight"].dtype == E4M3 and wire["embed.weight"].dtype == BF16
        assert "q.weight_scale_inv" in wire
        full = sum(t.numel() * 2 for t in live.values())
        assert stats.nbytes < 0.7 * full  # the FP8 tensors move one byte a value (plus scales), not two


@pytest.mark.parametrize("verify", ["fingerprint", None])
def test_fp8_with_delta_and_staged_refits_stays_exact(verify: str | None) -> None:
    live = _trainer()
    engine = _engine(live)
    sender = Sender(ModuleSource(live, wire_dtype=BF16), transport="shm", settings=SETTINGS, verify=verify, delta=True)
    receiver = Receiver(engine, sender.rendezvous(), settings=SETTINGS, staged=True)
    peer = Peer(receiver)
    peer.ask("connect")
    try:
        for version in (1, 2, 3, 4):
            if version in (2, 4):
                with torch.no_grad():
                    live["q.weight"][7, :3] += 0.5  # sparse: some buckets go as deltas of FP8 bytes
            elif version == 3:
                _step(live, version)
            stats, got = _refit(sender, peer, version)
            assert isinstance(stats, RefitStats) and isinstance(got, RefitStats), (stats, got)
            assert receiver.staging is not None and receiver.staging.apply() == version
            assert _holds(peer.engine, live), f"version {version}"
        assert sender.manifest is not None and sender.manifest.stages == ("fp8", "delta")
    finally:
        sender.close()
        peer.stop()


def test_the_fingerprint_names_a_quantized_tensor_the_engine_changed_behind_refits_back() -> None:
    live = _trainer()
    engine = _engine(live)
    with _session(live, engine, verify="fingerprint") as (sender, peer):
        stats, _ = _refit(sender, peer, 1)
        assert isinstance(stats, RefitStats)
        wrong = fp8.quantize(live["q.weight"] * 2, name="q")  # what a wrong scale would have landed
        real_load, real_digested = engine.load, engine.load_digested

        def swap(tensors: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
            return [(n, wrong[1] if n == "q.weight_scale_inv" else t) for n, t in tensors]

        engine.load = lambda tensors: real_load(swap(tensors))  # type: ignore[method-assign]
        engine.load_digested = lambda tensors: real_digested(swap(tensors))  # type: ignore[method-assign]
        stats, got = _refit(sender, peer, 2)
        assert isinstance(stats, RefitError) and "q.weight_scale_inv" in str(stats)
        assert isinstance(got, RefitError) and engine.weights.version == 1


def test_zero_copy_is_refused_with_the_reason() -> None:
    live = _trainer()
    source = ModuleSource(live, wire_dtype=BF16)
    with pytest.raises(ValueError, match="zero-copy cannot map a float tensor onto FP8"):
        adapt(source, {"q.weight": BlockFormat()}, zero_copy=True)
    assert adapt(source, {}, zero_copy=True) == (source, ())
    held_fp8 = ModuleSource({"q.weight": torch.zeros(4, 4, dtype=E4M3)})  # the trainer quantizes itself
    assert adapt(held_fp8, {"q.weight": BlockFormat()}, zero_copy=False) == (held_fp8, ())
    assert adapt(held_fp8, {"q.weight": BlockFormat()}, zero_copy=True) == (held_fp8, ())  # nothing to quantize


def test_a_non_finite_weight_in_a_later_bucket_fails_the_refit_not_the_session() -> None:
    live = _trainer()
    engine = _engine(live)
    with _session(live, engine) as (sender, peer):
        assert isinstance(_refit(sender, peer, 1)[0], RefitStats)
        m = sender.manifest
        assert m is not None
        spans = [b for b, segs in enumerate(m.segments) for seg in segs if m.entries[seg.entry].name == "q.weight"]
        assert spans[-1] > 0  # q.weight's last rows go in a later bucket than the first tensors
        _step(live, 2)
        with torch.no_grad():
            live["q.weight"][299, 259] = float("nan")
        peer.ask("receive")
        with pytest.raises(RefitError, match=r"refused refit of version 2.*q\.weight: block \(2, 2\) holds NaN"):
            sender.refit(2)
        assert isinstance(peer.outcome(), RefitError)
        assert engine.weights.version == 1 and engine.weights.state == "failed"
        # The session goes on: the next refit rewrites every tensor, and the engine holds the live weights.
        _step(live, 3)
        live["q.weight"][299, 259] = 0.5
        stats, got = _refit(sender, peer, 3)
        assert isinstance(stats, RefitStats) and isinstance(got, RefitStats)
        assert engine.weights.version == 3 and _holds(engine, live)


def test_an_engine_whose_scales_do_not_fit_its_stated_format_fails_before_joining() -> None:
    live = _trainer()
    engine = _engine(live, BlockFormat(block=(64, 64)))  # holds 128-blocks' scales, says 64
    held = engine.module
    held["q.weight_scale_inv"] = torch.zeros(3, 3)  # type: ignore[index]
    engine = ModuleEngine(held, fp8=BlockFormat(block=(64, 64)))
    sender = Sender(ModuleSource(live, wire_dtype=BF16), transport="shm", settings=SETTINGS)
    try:
        with pytest.raises(ValueError, match=r"q\.weight_scale_inv"):
            Receiver(engine, sender.rendezvous(), settings=SETTINGS).connect()
    finally:
        sender.close()


def test_module_engine_finds_its_formats_from_the_scales_beside_each_tensor() -> None:
    live = _trainer()
    engine = _engine(live)
    assert engine.formats() == {"q.weight": BlockFormat(), "o.weight": BlockFormat()}
    alone = ModuleEngine({"w": torch.zeros(4, 4, dtype=E4M3)})  # no scales: not a format refit produces
    assert alone.formats() == {}


def test_formats_round_trip_and_malformed_statements_are_refused() -> None:
    formats = {"a": BlockFormat(), "b": UE8M0, "c": BlockFormat(dtype=torch.float8_e5m2, block=(1, 64))}
    assert formats_from_json(formats_to_json(formats), "x") == formats
    for bad in (
        [],
        {"a": 1},
        {"a": {"dtype": "float8_e4m3fn"}},
        {"a": {**formats_to_json(formats)["a"], "block": [128]}},
        {"a": {**formats_to_json(formats)["a"], "block": [0, 128]}},
        {"a": {**formats_to_json(formats)["a"], "dtype": "bfloat16"}},
        {"a": {**formats_to_json(formats)["a"], "scale": "e8m0"}},
        {"a": {**formats_to_json(formats)["a"], "scale_dtype": 7}},
        {"a": {**formats_to_json(formats)["a"], "suffix": ""}},
    ):
        with pytest.raises(ValueError, match="receiver 3"):
            formats_from_json(bad, "receiver 3")
    with pytest.raises(ValueError, match="not JSON"):
        parse_statement(b"{", "receiver 1")
    assert mismatch(b"", {}, 1) == ""
    assert "other FP8 formats" in mismatch(b"", formats, 1)


def test_quantized_source_serves_scales_in_any_bucket_order_from_the_live_tensor() -> None:
    live = _trainer()
    src = Quantized(ModuleSource(live, wire_dtype=BF16), {"q.weight": BlockFormat(), "gone": BlockFormat()})
    assert set(src.formats) == {"q.weight"}
    (scales,) = src.tensors(["q.weight_scale_inv"])  # the scales first, alone: quantized from the live tensor
    q_ref, s_ref = fp8.quantize(live["q.weight"])
    assert _same(scales, s_ref)
    with torch.no_grad():
        live["q.weight"].mul_(3)
    q, norm = src.tensors(["q.weight", "norm.weight"])
    assert _same(q, fp8.quantize(live["q.weight"])[0]) and norm is live["norm.weight"]
    clash = {**live, "q.weight_scale_inv": torch.ones(3, 3)}
    with pytest.raises(ValueError, match="holds 'q.weight_scale_inv' itself"):
        Quantized(ModuleSource(clash), {"q.weight": BlockFormat()})


def test_an_m_to_n_worker_stating_fp8_formats_is_refused_naming_the_fix() -> None:
    from refit.topology.mesh import _parse_statement

    raw = json.dumps({"shards": {}, "formats": formats_to_json({"q.weight": BlockFormat()})}).encode()
    with pytest.raises(ValueError, match=r"engine worker 1 holds tensors in block FP8 \('q.weight'.*do not quantize"):
        _parse_statement(raw, 1)


@pytest.mark.parametrize("verify", ["fingerprint", None])
def test_a_whole_tensor_is_quantized_straight_into_its_bucket(verify: str | None) -> None:
    live = _trainer()
    engine = _engine(live)
    with _session(live, engine, verify=verify) as (sender, peer):
        for version in (1, 2, 3):
            _step(live, version)
            assert isinstance(_refit(sender, peer, version)[0], RefitStats)
            assert _holds(engine, live)
        source = sender.source
        assert isinstance(source, Quantized)
        # o.weight lies whole in one bucket with its scales: no buffer of its own; q.weight spans buckets: one.
        assert set(source._buffers) == {"q.weight"}
