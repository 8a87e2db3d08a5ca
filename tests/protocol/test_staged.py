"""Staged refits over real processes: the engine stays on N while N+1 arrives into staging memory, and
holds N+1 bitwise (against the trainer's live tensors) once `apply_staged()` ran; a failed or replaced
staged version is never applied; `on_commit` sees every version the live engine commits."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import torch
import warm
from peer import make_tensors
from staged_peer import StagedPeer
from trainer_ranks import line, start

from refit import ModuleEngine, ModuleSource, RefitError, Sender, Settings, State
from refit.checks.fingerprints import fingerprints
from refit.engines.staging import Staging
from refit.layout.planner import plan
from refit.topology.receiver import Receiver

SPECS = [
    ["embed.weight", [40, 16], "float32"],
    ["layer.0.bias", [7], "float32"],
    ["layer.0.weight", [16, 16], "bfloat16"],
    ["layer.1.weight", [48, 48], "float32"],
    ["steps", [3], "int64"],
]


def _step(tensors: dict[str, torch.Tensor], k: int) -> None:
    for t in tensors.values():
        t.add_(k) if t.dtype == torch.int64 else t.mul_(1.01).add_(0.001 * k)


@contextlib.contextmanager
def staged_session(
    transport: str, actions: list[str], **peer_args: object
) -> Iterator[tuple[Sender, dict[str, torch.Tensor], StagedPeer]]:
    """A sender over SPECS (seed 1) and one staged engine process that starts from the same tensors as
    the trainer's version 0 (`assume_current(0)`) and runs `actions`."""
    tensors = make_tensors(SPECS, seed=1)
    sender = Sender(
        ModuleSource(tensors),
        transport=transport,
        settings=Settings(bucket_bytes=4096, timeout_s=60.0),
        verify="fingerprint",
    )
    args = {"rendezvous": sender.rendezvous(), "specs": SPECS, "seed": 1, "assume": 0, "bucket_bytes": 4096}
    peer = StagedPeer({**args, "actions": actions, **peer_args})
    try:
        yield sender, tensors, peer
    finally:
        sender.close()
        assert peer.wait() == 0


def _live(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """What the trainer holds right now (every tensor is sent in its own dtype here)."""
    return fingerprints(tensors.items(), {n: t.dtype for n, t in tensors.items()})


def test_a_staged_refit_keeps_n_current_until_apply_staged_then_holds_n_plus_1_bitwise(transport: str) -> None:
    actions = ["receive", "apply", "apply", "receive", "apply"]
    with staged_session(transport, actions) as (sender, tensors, peer):
        before = _live(tensors)
        for version in (1, 2):
            _step(tensors, version)
            stats = sender.refit(version)
            assert stats.unverified == 0
            got = peer.report()  # received: live is still N, N+1 waits in staging, verified
            assert got["event"] == "refit" and got["unverified"] == 0, got
            assert (got["state"], got["version"], got["staged"]) == ("current", version - 1, version)
            assert got["fingerprints"] == before  # the live engine was not touched
            assert got["staging"] == _live(tensors)
            assert got["commits"] == list(range(1, version))
            got = peer.report()
            assert got["applied"] is True
            assert (got["state"], got["version"], got["staged"]) == ("current", version, None)
            assert got["fingerprints"] == _live(tensors)  # the trainer's live tensors, bitwise
            assert got["commits"] == list(range(1, version + 1))
            if version == 1:  # nothing staged: a no-op
                got = peer.report()
                assert got["applied"] is False and got["version"] == 1 and got["commits"] == [1]
                assert got["fingerprints"] == _live(tensors)
            before = _live(tensors)


@pytest.mark.slow
def test_a_refit_arriving_before_the_apply_replaces_the_staged_version() -> None:
    with staged_session("shm", ["receive", "receive", "apply", "apply"]) as (sender, tensors, peer):
        _step(tensors, 1)
        sender.refit(1)
        v1 = _live(tensors)
        assert peer.report()["staged"] == 1
        _step(tensors, 2)
        sender.refit(2)
        got = peer.report()
        assert (got["version"], got["staged"]) == (0, 2) and got["staging"] == _live(tensors) != v1
        got = peer.report()
        assert got["applied"] is True and (got["version"], got["staged"]) == (2, None)
        assert got["fingerprints"] == _live(tensors)
        assert got["commits"] == [2]  # version 1 never reached the live engine
        assert peer.report()["applied"] is False


def test_a_staged_copy_failing_the_fingerprint_is_never_applied_and_the_retry_is() -> None:
    fault = {"version": 1, "name": "layer.1.weight"}
    with staged_session("shm", ["receive", "apply", "receive", "apply"], corrupt_staging=fault) as (
        sender,
        tensors,
        peer,
    ):
        v0 = _live(tensors)
        _step(tensors, 1)
        with pytest.raises(RefitError, match="fingerprint check failed.*layer.1.weight"):
            sender.refit(1)
        got = peer.report()
        assert got["event"] == "error" and got["type"] == "IntegrityError", got
        assert (got["state"], got["version"], got["staged"]) == ("current", 0, None)
        got = peer.report()
        assert got["applied"] is False and got["version"] == 0 and got["commits"] == []
        assert got["fingerprints"] == v0
        sender.refit(1)  # the retry of the same version (the fault fired once)
        assert peer.report()["staged"] == 1
        got = peer.report()
        assert got["applied"] is True and got["version"] == 1 and got["fingerprints"] == _live(tensors)


@pytest.mark.slow
def test_refits_staged_while_the_engine_loop_applies_them_leave_it_on_the_last_version_bitwise() -> None:
    """Real concurrency: refits arrive in the engine's background thread while its main thread calls
    apply_staged() and ensure_current() between reads of the live weights, as an engine loop does."""
    with staged_session("gloo", ["generate 6"]) as (sender, tensors, peer):
        for version in range(1, 7):
            _step(tensors, version)
            sender.refit(version)
        got = peer.report()
        assert "error" not in got.get("event", ""), got
        assert (got["state"], got["version"], got["staged"]) == ("current", 6, None)
        assert got["fingerprints"] == _live(tensors)
        commits = got["commits"]
        assert commits == sorted(set(commits)) and commits[-1] == 6 and got["applied"] == len(commits)


def test_partial_staging_stages_what_fits_and_pauses_only_for_the_rest_then_holds_the_trainers_tensors() -> None:
    """Staging holds the first bucket's tensors (3100 bytes); layer.1.weight and steps (buckets 1-3) arrive
    during the pause. While the staged part arrives the engine generates on N; N+1 commits only in
    apply_staged(), and the live engine then holds the trainer's live tensors bitwise."""
    with staged_session("shm", ["loop 2"], staging_bytes=3100) as (sender, tensors, peer):
        before = _live(tensors)
        for version in (1, 2):
            _step(tensors, version)
            stats = sender.refit(version)
            assert stats.unverified == 0
            got = peer.report()
            assert got["applied"] is True, got
            during = got["during"][str(version)]  # a generation step while the staged part arrived
            assert (during["state"], during["version"], during["fingerprints"]) == ("current", version - 1, before)
            assert (got["state"], got["version"], got["staged"]) == ("current", version, None)
            assert got["fingerprints"] == _live(tensors)  # the trainer's live tensors at this step, bitwise
            assert got["commits"] == list(range(1, version + 1))  # all from apply_staged, in the engine loop
            assert (got["staged_bytes"], got["direct_bytes"]) == (3100, 48 * 48 * 4 + 3 * 8)
            assert got["staging_nbytes"] == 3100
            before = _live(tensors)
        got = peer.report()
        assert "receive_error" not in got, got
        assert got["split"] == (
            "staging holds 3100 of 12340 bytes (3 of 5 tensors, the first in bucket order); the pause covers "
            "receiving the other 2 tensor(s), 9240 bytes on the wire in buckets 1-3, straight into the live engine, "
            "the fingerprint check, every worker's verdict and the final copy of the 3100 staged bytes"
        )


DIE_SPECS = [[f"w{i}", [32, 32], "float32"] for i in range(6)]  # 4 KiB each: one tensor per bucket


@pytest.mark.parametrize("transport", ["shm", pytest.param("gloo", marks=pytest.mark.slow)])
def test_a_sender_dying_during_the_pause_leaves_the_live_engine_failed_not_current(transport: str) -> None:
    """w0, w1 are staged, w2..w5 arrive during the pause; the trainer dies before sending bucket 4 of
    version 2 (its slot was free only once w2 had been written into the live engine)."""
    from locations import helper, pythonpath

    args = {"specs": DIE_SPECS, "transport": transport, "bucket_bytes": 4096, "die_at_bucket": 5}
    proc = warm.popen([sys.executable, helper("sender_peer.py"), json.dumps(args)], stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": pythonpath()})  # fmt: skip
    assert proc.stdout is not None
    rendezvous = json.loads(proc.stdout.readline().removeprefix("@@sender "))
    live = make_tensors(DIE_SPECS, seed=5)
    engine = ModuleEngine(live)
    dtypes = {n: torch.float32 for n in live}
    with Receiver(engine, rendezvous, settings=Settings(timeout_s=30), staged=True, staging_bytes=8192) as receiver:
        errors, outcomes = _engine_loop(receiver, refits=2)
        assert outcomes[0] == 1 and engine.weights.version == 1
        assert receiver.staging is not None and receiver.staging.direct == {"w2", "w3", "w4", "w5"}
    assert proc.wait(timeout=60) == 17
    # the sender's death, seen on the control channel or (gloo) by the receive in flight, during refit 2
    died = (
        r"PeerError: (sender|gloo receive .* from the sender failed).*(closed the connection during|\(during) refit 2"
    )
    assert re.search(died, errors["receive"])
    assert "failed during the pause, after writing into the live engine" in errors["apply"]
    w = engine.weights
    assert (w.state, w.version, w.target) == (State.FAILED, 1, 2)
    v1 = fingerprints(make_tensors(DIE_SPECS, seed=1).items(), dtypes)
    v2 = fingerprints([(n, t + 1.0) for n, t in make_tensors(DIE_SPECS, seed=1).items()], dtypes)
    now = fingerprints(live.items(), dtypes)
    assert now["w0"] == v1["w0"] and now["w2"] == v2["w2"]  # really mixed: half-new weights, flagged failed
    with pytest.raises(RefitError, match=r"engine weights are failed \(last committed 1, target 2\)"):
        engine.ensure_current()


def _engine_loop(receiver: Receiver, *, refits: int) -> tuple[dict[str, str], list[int]]:
    """Receive in a thread while this thread calls apply_staged() as an engine loop does; returns the
    errors of each side and the versions applied."""
    done, errors, applied = threading.Event(), {}, []

    def serve() -> None:
        try:
            for _ in range(refits):
                receiver.receive()
        except Exception as e:  # noqa: BLE001 - the test reads it
            errors["receive"] = f"{type(e).__name__}: {e}"
        finally:
            done.set()

    thread = threading.Thread(target=serve)
    thread.start()
    while not done.is_set():
        try:
            if receiver.apply_staged():
                applied.append(receiver.engine.weights.version)
        except RefitError as e:
            errors["apply"] = str(e)
        done.wait(0.002)
    thread.join()
    return errors, applied


def test_partial_staging_without_apply_staged_fails_naming_the_fix_and_leaves_n_current() -> None:
    live = make_tensors(SPECS, seed=2)
    engine = ModuleEngine(live)
    engine.assume_current(0)
    staging = Staging(engine, device=torch.device("cpu"), limit=0, timeout_s=0.2)
    staging.specs()
    staging.split(_manifest(SPECS))
    staging.begin(1)
    with pytest.raises(RefitError, match=r"did not pause within 0.2 s.*call receiver.apply_staged\(\) between"):
        staging.load(list(make_tensors(SPECS, seed=3).items()))
    staging.fail(1, "the pause never came")
    assert (engine.weights.state.value, engine.weights.version) == ("current", 0)
    assert all(torch.equal(t, make_tensors(SPECS, seed=2)[n]) for n, t in live.items())


def test_the_split_stages_a_prefix_in_bucket_order_and_drops_staging_for_names_now_direct() -> None:
    live = make_tensors(SPECS, seed=2)
    staging = Staging(ModuleEngine(live), device=torch.device("cpu"))
    staging.specs()
    split = staging.split(_manifest(SPECS))
    assert (split.num_direct, split.first_direct_bucket, split.staged_nbytes) == (0, None, 12340)
    staging.begin(1)
    staging.load(list(make_tensors(SPECS, seed=3).items()))
    assert staging.nbytes == 12340
    staging.limit = 3200  # a later epoch with less room: embed, layer.0.* fit; layer.1.weight does not
    split = staging.split(_manifest(SPECS))
    assert staging.direct == {"layer.1.weight", "steps"}  # steps would fit, but it arrives during the pause anyway
    assert (split.staged_nbytes, split.direct_wire_nbytes, split.first_direct_bucket) == (3100, 9240, 1)
    assert staging.nbytes == 12340  # kept until the next refit begins: a version staged earlier may need them
    staging.begin(2)
    assert staging.nbytes == 3100 and staging.held("layer.1.weight")[0] is live["layer.1.weight"]


def _manifest(specs: list[list]):
    return plan(ModuleSource(make_tensors(specs, seed=1)).specs(), capacity=4096, epoch=1)


# -- in one process: the staging object itself ---------------------------------------------------


def test_the_final_copy_is_same_dtype_and_bitwise_and_tied_names_share_one_staging_tensor() -> None:
    live = make_tensors(SPECS, seed=2)
    live["lm_head.weight"] = live["embed.weight"]  # tied: one tensor, two names
    engine = ModuleEngine(live)
    staging = Staging(engine, device=torch.device("cpu"))
    specs = staging.specs()
    new = make_tensors(SPECS, seed=3)
    sent = [(n, new["embed.weight" if n == "lm_head.weight" else n]) for s in specs for n in s.names]
    staging.begin(1)
    staging.load(sent)
    staging.commit(1)
    assert staging.apply() is None  # committed but not published (the verdict is not in)
    staging.publish(1)
    assert engine.weights.staged == 1 and engine.weights.version is None
    assert staging.nbytes == sum(s.nbytes for s in specs)  # the alias costs nothing
    assert staging.apply() == 1
    assert engine.weights.version == 1 and engine.weights.staged is None
    for name, t in live.items():
        src = new["embed.weight" if name == "lm_head.weight" else name]
        assert staging.held(name)[0].dtype == t.dtype
        assert torch.equal(t.view(torch.uint8), src.view(torch.uint8)), name
    assert staging.apply() is None


def test_staging_follows_the_engine_when_its_tensors_change_dtype_storage_or_identity() -> None:
    """The staging tensors and copy plans are caches: after the engine casts its model (new dtype and
    storage) and replaces a parameter object, the next handshake's staging holds the engine's new dtype and
    `apply()` writes into the engine's current tensors, bitwise."""
    model = torch.nn.Linear(6, 4)
    engine = ModuleEngine(model)
    staging = Staging(engine, device=torch.device("cpu"))
    staging.specs()
    batch = [("weight", torch.randn(4, 6)), ("bias", torch.randn(4))]
    for version in (1, 2):
        if version == 2:
            model.to(torch.float64)  # every tensor: a new dtype and storage
            model.bias = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))  # and a new object
            staging.specs()  # the handshake of the new epoch (the engine's specs changed)
        staging.begin(version)
        staging.load(batch)  # the same list object: a stale plan would write into the old staging tensors
        staging.commit(version)
        staging.publish(version)
        assert staging.apply() == version
        for name, src in batch:
            live = getattr(model, name)
            assert staging.held(name)[0].dtype == live.dtype
            assert torch.equal(live, src.to(live.dtype)), name
    assert engine.held("bias")[0] is model.bias


@pytest.mark.slow
def test_a_failed_apply_leaves_the_version_staged_for_a_retry() -> None:
    class Flaky(ModuleEngine):
        fail_next = True

        def load(self, tensors: list) -> None:
            if self.fail_next:
                self.fail_next = False
                raise RuntimeError("injected")
            super().load(tensors)

    live = make_tensors(SPECS, seed=2)
    engine = Flaky(live)
    staging = Staging(engine, device=torch.device("cpu"))
    new = make_tensors(SPECS, seed=4)
    staging.specs()
    staging.begin(5)
    staging.load(list(new.items()))
    staging.commit(5)
    staging.publish(5)
    with pytest.raises(RefitError, match="applying staged version 5 failed: RuntimeError: injected"):
        staging.apply()
    assert (engine.weights.state.value, engine.weights.staged) == ("failed", 5)
    assert staging.apply() == 5
    assert all(torch.equal(live[n], new[n]) for n in live)


def test_staging_bytes_must_not_be_negative() -> None:
    engine = ModuleEngine(make_tensors(SPECS, seed=2))
    with pytest.raises(ValueError, match="staging_bytes"):
        Receiver(engine, {"transport": "shm"}, staged=True, staging_bytes=-1)


# -- per-rank: the two-phase commit ----------------------------------------------------------------


@pytest.mark.slow
def test_per_rank_a_worker_failing_its_staged_check_leaves_every_worker_on_n() -> None:
    """Worker 1's staged copy of version 2 fails the fingerprint check: the trainer's vote fails, both
    workers drop version 2 (neither applies it) and stay current at 1; version 3 then reaches both."""
    from fsdp_trainer import build

    engine_specs = [[n, list(t.shape), "float32"] for n, t in sorted(build(0).state_dict().items())]
    ranks = start({"mode": "ranked", "model": "replicated", "transport": "shm", "bucket_bytes": 16384, "steps": 3,
                   "verify": "fingerprint", "dtype_change_at": 99})  # fmt: skip
    infos = line(ranks[0])
    actions = ["receive", "apply", "receive", "apply", "receive", "apply"]
    workers = [
        StagedPeer({"rendezvous": infos, "index": i, "specs": engine_specs, "bucket_bytes": 16384,
                    "actions": actions, **({"corrupt_staging": {"version": 2, "name": "1.weight"}} if i else {})})
        for i in range(2)
    ]  # fmt: skip
    try:
        sent = line(ranks[0])
        for w in workers:
            assert w.report()["staged"] == 1
            got = w.report()
            assert got["applied"] and got["version"] == 1 and got["fingerprints"] == sent["fingerprints"]
        v1 = sent["fingerprints"]
        sent = line(ranks[0])
        assert "fingerprint check failed" in sent["error"], sent
        for w in workers:
            got = w.report()
            assert got["event"] == "error" and (got["state"], got["version"], got["staged"]) == ("current", 1, None)
            got = w.report()
            assert got["applied"] is False and got["version"] == 1 and got["fingerprints"] == v1
        sent = line(ranks[0])
        assert "error" not in sent, sent
        for w in workers:
            assert w.report()["staged"] == 3
            got = w.report()
            assert got["applied"] and got["version"] == 3 and got["fingerprints"] == sent["fingerprints"]
            assert got["commits"] == [1, 3]
    finally:
        codes = [p.wait(timeout=120) for p in ranks]
        for w in workers:
            w.wait()
        assert codes == [0, 0]


def test_refit_plan_shows_the_staging_bytes_a_real_staging_allocates(capsys) -> None:
    import json

    from refit.tools.bench.presets import PRESETS, specs
    from refit.tools.cli import main

    assert main(["plan", "--preset", "tiny", "--json", "-"]) == 0
    shown = json.loads(capsys.readouterr().out)
    model = specs(PRESETS["tiny"], torch.bfloat16)
    state: dict[str, torch.Tensor] = {}
    for s in model:
        state[s.name] = torch.ones(s.shape, dtype=s.dtype)
        state.update({a: state[s.name] for a in s.aliases})
    staging = Staging(ModuleEngine(state), device=torch.device("cpu"))
    staging.specs()
    staging.begin(1)
    staging.load([(n, state[s.name]) for s in model for n in s.names])
    assert shown["staging_bytes_per_engine"] == staging.nbytes > 0


def test_refit_plan_with_staging_bytes_shows_the_split_a_bounded_staging_makes(capsys) -> None:
    from refit.tools.bench.presets import PRESETS, specs
    from refit.tools.cli import main

    argv = ["plan", "--preset", "tiny", "--bucket-bytes", "300000", "--staging-bytes", "3000000", "--json", "-"]
    assert main(argv) == 0
    shown = json.loads(capsys.readouterr().out)
    model = specs(PRESETS["tiny"], torch.bfloat16)
    state = {n: torch.ones(s.shape, dtype=s.dtype) for s in model for n in s.names}
    staging = Staging(ModuleEngine(state), device=torch.device("cpu"), limit=3000000)
    staging.specs()
    split = staging.split(plan(model, capacity=shown["capacity"]))
    assert shown["staging_split"]["pause_covers"] == split.describe()
    assert 0 < split.staged_nbytes <= 3000000 and split.num_direct > 0
    assert split.staged_nbytes + split.direct_wire_nbytes == shown["nbytes"]  # the engine holds the wire dtype


# -- M:N -----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_m_to_n_workers_stage_their_slices_and_apply_them_bitwise() -> None:
    """A 2-rank FSDP2 trainer feeds two tensor-parallel workers with staged MeshReceivers (fingerprint on):
    after each refit a worker still holds the previous version, and after apply_staged exactly its slices of
    the trainer's live tensors."""
    import json
    import os
    import subprocess
    import sys

    helpers = os.path.dirname(os.path.abspath(__file__)).replace("protocol", "helpers")
    ranks = start({"kind": "mlp", "workers": 2, "transport": "gloo", "steps": 3, "verify": "fingerprint"},
                  script="mesh_trainer.py")  # fmt: skip
    info = line(ranks[0])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([helpers, *sys.path])}
    workers = [
        warm.popen([sys.executable, os.path.join(helpers, "mesh_worker.py"), json.dumps(
            {"rendezvous": info, "kind": "mlp", "worker": w, "workers": 2, "staged": True})],
            env=env, text=True, stdout=subprocess.PIPE)
        for w in range(2)
    ]  # fmt: skip
    try:
        previous = None
        for version in (1, 2, 3):
            out = line(ranks[0])
            assert "error" not in out, out
            for w, p in enumerate(workers):
                assert p.stdout is not None
                got = json.loads(p.stdout.readline())
                before = got["before"]
                assert (before["version"], before["staged"]) == (version - 1 if version > 1 else None, version)
                if previous is not None:
                    assert before["fingerprints"] == previous[w]  # the live engine was not touched
                assert got["applied"] is True and got["state"] == "current"
                assert got["fingerprints"] == out["expected"][w], f"worker {w} differs at version {version}"
            previous = out["expected"]
    finally:
        assert [p.wait(timeout=120) for p in ranks] == [0, 0]
        assert [p.wait(timeout=120) for p in workers] == [0, 0]


# -- partial staging, driven directly: what the review of its pause found --------------------------------------

PARTS = [[f"w{i}", [32, 32], "float32"] for i in range(4)]  # 4 KiB each, one bucket each at 4 KiB


def _engine_loop_thread(staging: Staging) -> tuple[threading.Thread, dict]:
    """An engine loop calling apply() between (empty) steps until one applies or raises."""
    out: dict = {}

    def loop() -> None:
        try:
            while (v := staging.apply()) is None:
                time.sleep(0.001)  # a generation step
            out["applied"] = v
        except RefitError as e:
            out["error"] = str(e)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return thread, out


def test_a_partial_refit_committed_then_cut_off_releases_the_paused_loop_and_fails_the_engine() -> None:
    live = make_tensors(PARTS, seed=2)
    engine = ModuleEngine(live)
    engine.assume_current(0)
    staging = Staging(engine, device=torch.device("cpu"), limit=4096, timeout_s=60)
    staging.specs()
    staging.split(plan(ModuleSource(live).specs(), capacity=4096, epoch=1))
    thread, out = _engine_loop_thread(staging)
    staging.begin(1)
    for name, t in make_tensors(PARTS, seed=3).items():
        staging.load([(name, t)])  # w1..w3 go live: the loop is paused from here
    staging.commit(1)  # the receiver committed; then sending DONE fails and the receive side stops
    staging.abort("DONE could not be sent")
    thread.join(60)
    assert not thread.is_alive() and "failed during the pause" in out["error"]
    assert (engine.weights.state, engine.weights.target) == (State.FAILED, 1)
    with pytest.raises(RefitError, match="engine weights are failed"):
        engine.ensure_current()


def test_a_handshake_moving_names_out_of_staging_leaves_the_ready_version_whole() -> None:
    live = make_tensors(PARTS, seed=2)
    engine = ModuleEngine(live)
    engine.assume_current(0)
    manifest = plan(ModuleSource(live).specs(), capacity=4096, epoch=1)
    staging = Staging(engine, device=torch.device("cpu"))
    staging.specs()
    staging.split(manifest)
    new = make_tensors(PARTS, seed=3)
    staging.begin(1)
    for name, t in new.items():
        staging.load([(name, t)])
    staging.commit(1)
    staging.publish(1)
    staging.limit = 8192  # a new epoch's handshake, with version 1 staged and not yet applied
    staging.specs()
    assert staging.split(manifest).num_direct == 2
    assert staging.apply() == 1
    assert all(torch.equal(live[n], new[n]) for n in live), "version 1 committed with tensors of version 0"


def test_a_tied_name_loaded_live_is_never_overwritten_by_its_old_staging_copy() -> None:
    shared = torch.zeros(8, 8)
    live = {"a": shared, "b": shared}  # tied: the engine's primary name is 'a', the sender sends 'b'
    engine = ModuleEngine(live)
    engine.assume_current(0)
    manifest = plan(ModuleSource({"b": torch.ones(8, 8)}).specs(), capacity=4096, epoch=1)
    staging = Staging(engine, device=torch.device("cpu"), timeout_s=60)
    for version, limit in ((1, None), (2, 0)):  # staged whole, then nothing fits: 'b' loads live
        staging.limit = limit
        staging.specs()
        staging.split(manifest)
        thread, out = _engine_loop_thread(staging)
        staging.begin(version)
        staging.load([("b", torch.full((8, 8), float(version)))])
        staging.commit(version)
        staging.publish(version)
        thread.join(60)
        assert out == {"applied": version} and engine.weights.version == version
        assert torch.equal(shared, torch.full((8, 8), float(version))), f"version {version} holds {shared[0, 0]}"
