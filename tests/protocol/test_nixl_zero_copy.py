"""Zero-copy over nixl: the engines READ the trainer's live tensors one-sided, straight into their own live
tensors where those are contiguous in the wire dtype (else through a scratch buffer and `Engine.load`). Bitwise
after every refit with the fingerprint on or off; every way a trainer tensor can change is re-shared or refused,
never read stale; an engine tensor that moved is registered again; a sender that dies mid-refit fails the engine
within the timeout."""

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
    out: queue.Queue = queue.Queue()

    def run() -> None:
        try:
            with Receiver(engine, rendezvous, settings=Settings(timeout_s=TIMEOUT_S)) as r:
                while (stats := r.receive()) is not None:
                    out.put(stats)
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
            assert out.get(timeout=60).version == version
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
