"""Zero-copy over nixl: the engines READ the trainer's live tensors one-sided, straight into their own live
tensors where those are contiguous in the wire dtype (else through a scratch buffer and `Engine.load`). Bitwise
after every refit with the fingerprint on or off; every way a trainer tensor can change is re-shared or refused,
never read stale; an engine tensor that moved is registered again; a sender that dies mid-refit fails the engine
within the timeout. Tensors adjacent in memory on both sides (views of one flat buffer) are READ as one
descriptor per run, never across a region either side registered apart, and the engine still refuses a range
outside what the trainer registered."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time

import pytest
import torch

from refit.tools.doctor import nixl_installed

if not nixl_installed():
    pytest.skip("needs nixl: pip install '.[nixl]'", allow_module_level=True)

import warm  # noqa: E402
from locations import helper, pythonpath  # noqa: E402
from peer import make_tensors  # noqa: E402
from sessions import assert_current, session, step  # noqa: E402

from refit import HandshakeError, ModuleEngine, ModuleSource, PeerError, Receiver, RefitError, Sender, Settings  # noqa: E402
from refit.checks.fingerprints import fingerprints  # noqa: E402
from refit.transports import nixl  # noqa: E402
from refit.transports.nixl_tensors import Exposed, Remote, Sources, Targets  # noqa: E402

SPECS = [[f"w{i}", [32, 32], "float32"] for i in range(6)]
TIMEOUT_S = 20.0


@pytest.mark.parametrize("verify", ["fingerprint", None])
def test_engines_read_the_trainers_live_tensors_in_place_bitwise_at_every_version(verify: str | None) -> None:
    with session(SPECS, transport="nixl", zero_copy=True, verify=verify, receivers=2) as (sender, tensors, peers):
        registered = []
        for version in (1, 2, 3):
            stats = sender.refit(version)
            assert stats.full_bytes == 0 and stats.wire_bytes == 0  # no bucket moved
            assert stats.handshake == (version == 1)  # values changed in place: the same epoch, shared once
            for p in peers:
                report = p.report()
                assert_current(report, sender, tensors, version)
                assert [e for e in report["events"] if e.startswith("load")] == []  # every READ landed in place
                registered.append(report["nixl"]["registered"])
            step(tensors, by=version)
    assert len(set(registered)) == 1  # the engines registered their targets once, at the first refit
    assert [p.wait() for p in peers] == [0, 0]


def test_a_non_contiguous_engine_tensor_is_read_into_scratch_and_loaded_from_there() -> None:
    with session(SPECS, transport="nixl", zero_copy=True, peer_args={"strided": ["w1", "w4"]}) as (
        sender,
        tensors,
        (p,),
    ):
        for version in (1, 2):
            sender.refit(version)
            report = p.report()
            assert_current(report, sender, tensors, version)
            assert [e for e in report["events"] if e.startswith("load")] == ["load w1,w4"]
            assert report["strides"]["w1"] == [1, 32]  # still the engine's own non-contiguous tensor
            step(tensors)
    assert p.wait() == 0


@pytest.mark.slow
def test_every_way_a_trainer_tensor_changes_is_shared_again_or_refused_never_read_stale() -> None:
    with session(SPECS, transport="nixl", zero_copy=True, timeout_s=TIMEOUT_S) as (sender, tensors, (p,)):
        sender.refit(1)
        assert_current(p.report(), sender, tensors, 1)
        version = 1

        def refit(*, epoch: bool) -> None:
            nonlocal version
            version += 1
            stats = sender.refit(version)
            assert stats.handshake == epoch
            assert_current(p.report(), sender, tensors, version)

        tensors["w0"].mul_(3)  # values, in place
        refit(epoch=False)
        old = tensors["w0"]
        tensors["w0"] = old.clone() + 1  # new storage: shared again; the old memory must never be read
        old.zero_()
        refit(epoch=True)
        tensors["w1"] = tensors["w1"].detach()  # another object over the same memory and layout
        refit(epoch=False)
        tensors["w2"] = tensors["w2"].t().contiguous().t()  # strides: the same values, not contiguous
        with pytest.raises(ValueError, match="contiguous"):
            sender.refit(version + 1)
        tensors["w2"] = tensors["w2"].contiguous()
        refit(epoch=True)
        tensors["w3"] = tensors["w3"].to(torch.float16)  # dtype: a new epoch sends it as float16
        refit(epoch=True)  # the engine holds it in float32: read into scratch, loaded with the cast
        kept, tensors["w4"] = tensors["w4"], torch.randn(16, 64)  # shape: the engine refuses the manifest
        with pytest.raises(HandshakeError, match="w4"):
            sender.refit(version + 1)
        assert p.report()["event"] == "error"  # the engine said why it refused; it keeps its weights
        tensors["w4"] = kept
        refit(epoch=True)
    assert p.wait() == 0


def _receive_in_thread(engine: ModuleEngine, rendezvous: dict) -> tuple[threading.Thread, queue.Queue]:
    """A receiver in a thread: after each refit it puts the refit's stats and its READ's descriptor count."""
    out: queue.Queue = queue.Queue()

    def run() -> None:
        try:
            with Receiver(engine, rendezvous, settings=Settings(timeout_s=TIMEOUT_S)) as r:
                while (stats := r.receive()) is not None:
                    assert r.path is not None and r.path.sources is not None
                    out.put((stats, r.path.sources.descriptors))  # type: ignore[attr-defined]
        except RefitError as e:
            out.put(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def test_an_engine_tensor_that_moved_is_registered_again_and_the_old_one_left_alone() -> None:
    trainer = make_tensors(SPECS, seed=1)
    own = make_tensors(SPECS, seed=5)
    engine = ModuleEngine(own)
    settings = Settings(bucket_bytes=4096, timeout_s=TIMEOUT_S)
    with Sender(ModuleSource(trainer), transport="nixl", zero_copy=True, settings=settings) as sender:
        thread, out = _receive_in_thread(engine, sender.rendezvous())
        wire = {n: torch.float32 for n in trainer}

        def refit(version: int) -> int:
            before = nixl.counts()["registered"]
            sender.refit(version)
            assert out.get(timeout=60)[0].version == version
            assert fingerprints(own.items(), wire) == fingerprints(trainer.items(), wire)
            return nixl.counts()["registered"] - before

        assert refit(1) > 0
        step(trainer)
        assert refit(2) == 0  # nothing moved on either side: no registration
        old = own["w0"]
        own["w0"] = torch.zeros(32, 32)  # the engine replaced its tensor: registered again
        kept = old.clone()
        step(trainer)
        assert refit(3) > 0
        assert torch.equal(old, kept)  # the READ landed in the live tensor, not in the one let go
        own["w1"] = own["w1"].t().contiguous().t()  # not contiguous now: through scratch
        step(trainer)
        assert refit(4) > 0
        assert own["w1"].stride() == (1, 32)
    thread.join(60)
    assert not thread.is_alive()


def _views(flat: torch.Tensor, sizes: dict[str, int]) -> dict[str, torch.Tensor]:
    """Named views of `flat`, one after the other in the order given (a flat buffer's parameters)."""
    return dict(zip(sizes, flat.split(list(sizes.values()))))


def _refits(trainer: dict[str, torch.Tensor], own: dict[str, torch.Tensor], versions: int) -> list[int]:
    """Zero-copy refits over nixl from `trainer` into a ModuleEngine over `own`, each checked bitwise (and the
    trainer's values stepped in place between them); each refit's READ descriptor count."""
    engine = ModuleEngine(own)
    settings = Settings(bucket_bytes=4096, timeout_s=TIMEOUT_S)
    counts = []
    with Sender(ModuleSource(trainer), transport="nixl", zero_copy=True, settings=settings) as sender:
        thread, out = _receive_in_thread(engine, sender.rendezvous())
        for version in range(1, versions + 1):
            sender.refit(version)
            stats, descriptors = out.get(timeout=60)
            assert stats.version == version
            assert all(torch.equal(own[n], t) for n, t in trainer.items()), version
            counts.append(descriptors)
            step(trainer)
    thread.join(60)
    assert not thread.is_alive()
    return counts


SIZES = {"embed": 3 * 97, "q": 1021, "k": 64, "v": 7, "o": 1021, "norm": 13}
"""Element counts, most of them odd: views at every alignment."""


def test_views_of_one_flat_buffer_on_both_sides_are_read_in_one_descriptor_bitwise() -> None:
    g = torch.Generator().manual_seed(3)
    trainer = _views(torch.randn(sum(SIZES.values()), generator=g), SIZES)
    own = _views(torch.zeros(sum(SIZES.values())), SIZES)
    assert _refits(trainer, own, versions=3) == [1, 1, 1]


def test_adjacent_and_apart_tensors_mixed_land_bitwise_with_one_descriptor_per_run_adjacent_on_both_sides() -> None:
    g = torch.Generator().manual_seed(4)
    trainer = {
        **_views(torch.randn(1021 + 64 + 7 + 13, generator=g), {"q": 1021, "k": 64, "v": 7, "norm": 13}),
        "alone": torch.randn(291, generator=g),
        **_views(torch.randn(2 * 1021, generator=g), {"o": 1021, "up": 1021}),
    }
    own = {
        **_views(torch.zeros(1021 + 64 + 13 + 7), {"q": 1021, "k": 64, "norm": 13, "v": 7}),  # v, norm swapped
        "alone": torch.zeros(291),
        "o": torch.zeros(1021),  # apart here: its run with "up" breaks
        "up": torch.zeros(2 * 1021)[::2],  # not contiguous: READ into scratch, loaded from there
    }
    # q+k, v, norm, alone, o, up (scratch)
    assert _refits(trainer, own, versions=2) == [6, 6]


def test_tensors_adjacent_but_registered_apart_by_the_trainer_are_read_per_region() -> None:
    raw = bytearray(torch.randn(4 * 64, generator=torch.Generator().manual_seed(5)).numpy().tobytes())
    apart = [torch.frombuffer(raw, dtype=torch.float32, count=64, offset=256 * i) for i in range(4)]
    exposed = Exposed(apart)  # four storages back to back: four regions, no descriptor may span two
    assert len(exposed.regions) == 4
    remote = Remote(Sources.parse(exposed.info, [t.nbytes for t in apart]))
    targets = list(torch.zeros(4 * 64).split(64))
    registered = Targets(targets)
    reads = remote.reads(range(4), targets, registered)
    assert reads.descriptors == 4
    remote.read(list(range(4)), targets, "a test READ", reads).wait(30)
    assert all(torch.equal(a, b) for a, b in zip(apart, targets))


def test_a_range_outside_the_registered_views_is_refused_though_it_lies_in_their_storage() -> None:
    flat = torch.randn(400)
    views = [flat[0:100], flat[100:200], flat[300:400]]  # flat[200:300] belongs to no tensor: not registered
    exposed = Exposed(views)
    assert [n for _, n, _ in exposed.regions] == [800, 400]
    sizes = [t.nbytes for t in views]
    info = exposed.info
    gap = [flat[200:300].data_ptr(), 400, 0]
    straddling = [flat[300:400].data_ptr() + 4, 400, 0]
    for hostile in (gap, straddling):
        with pytest.raises(PeerError, match="did not register"):
            Remote(Sources.parse({**info, "tensors": [*info["tensors"][:2], hostile]}, sizes))
    remote = Remote(Sources.parse(info, sizes))
    targets = list(torch.zeros(300).split(100))
    registered = Targets(targets)
    reads = remote.reads([0, 1, 2], targets, registered)
    assert reads.descriptors == 2  # the first two views, then the third after the gap
    remote.read([0, 1, 2], targets, "a test READ", reads).wait(30)
    assert all(torch.equal(a, b) for a, b in zip(views, targets))


@pytest.mark.slow
def test_a_sender_killed_mid_refit_fails_the_engine_promptly_and_never_reports_it_current() -> None:
    args = {"specs": SPECS, "transport": "nixl", "bucket_bytes": 4096, "die_at_bucket": 10**6, "zero_copy": True}
    env = {**os.environ, "PYTHONPATH": pythonpath()}
    proc = warm.popen(
        [sys.executable, helper("sender_peer.py"), json.dumps({**args, "timeout_s": 60})],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    rendezvous = json.loads(proc.stdout.readline().removeprefix("@@sender "))
    engine = ModuleEngine(make_tensors(SPECS, seed=5))
    with Receiver(engine, rendezvous, settings=Settings(timeout_s=TIMEOUT_S)) as receiver:
        assert receiver.receive().version == 1
        assert receiver.path is not None and receiver.path.sources is not None
        remote = receiver.path.sources.remote  # type: ignore[attr-defined]
        read = remote.read

        def killing_read(*a, **k):  # noqa: ANN002, ANN003, ANN202 - as the method
            proc.kill()  # the trainer dies once refit 2 began, as its engine READs
            proc.wait(timeout=60)
            return read(*a, **k)

        remote.read = killing_read
        start = time.monotonic()
        with pytest.raises(PeerError):
            receiver.receive()
        assert time.monotonic() - start < TIMEOUT_S
    assert engine.weights.state.value != "current"
    assert engine.weights.version != 2


@pytest.mark.slow
def test_the_bench_runs_zero_copy_over_nixl_beside_the_floor_and_packed_refits(tmp_path) -> None:
    from refit.tools.cli import main

    out = tmp_path / "bench.json"
    methods = "floor,refit,zero_copy,zero_copy_fingerprint"
    args = ["bench", "--transport", "nixl", "--preset", "tiny", "--methods", methods, "--repeats", "2"]
    assert main([*args, "--json", str(out)]) == 0
    results = json.loads(out.read_text())[0]["results"]
    assert set(methods.split(",")) <= set(results)
    assert all(results[m]["gbps"] > 0 for m in methods.split(","))
