"""M:N refit in real processes: a 2-rank FSDP2 trainer (gloo) feeds engine workers that each keep only
their slices (ModuleEngine shard specs), every byte from the rank that holds it, no rank gathering."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import warm
from trainer_ranks import go, line, start

from refit.tools.doctor import nixl_installed

NIXL = pytest.param("nixl", marks=pytest.mark.skipif(not nixl_installed(), reason="needs nixl: pip install '.[nixl]'"))

HELPERS = os.path.dirname(os.path.abspath(__file__)).replace("integration", "helpers")


def _worker(info: dict, kind: str, w: int, workers: int, device: str = "cpu", **extra) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([HELPERS, *sys.path])}
    script = os.path.join(HELPERS, "mesh_worker.py")
    args = {"rendezvous": info, "kind": kind, "worker": w, "workers": workers, "device": device, **extra}
    return warm.popen([sys.executable, script, json.dumps(args)], env=env, text=True, stdout=subprocess.PIPE)


def _workers(info: dict, kind: str, workers: int, device: str = "cpu") -> list[subprocess.Popen]:
    return [_worker(info, kind, w, workers, device) for w in range(workers)]


def _report(p: subprocess.Popen) -> dict:
    assert p.stdout is not None
    text = p.stdout.readline()
    assert text, f"worker exited with {p.wait()}"
    return json.loads(text)


def _run(kind: str, workers: int, transport: str, steps: int = 3, **extra) -> list[dict]:
    args = {"kind": kind, "workers": workers, "transport": transport, "steps": steps, **extra}
    ranks = start(args, script="mesh_trainer.py")
    info = line(ranks[0])
    engines = _workers(info, kind, workers)
    sent = []
    try:
        for version in range(1, steps + 1):
            out = line(ranks[0])
            assert "error" not in out, out["error"]
            assert out["version"] == version
            for w, p in enumerate(engines):
                got = _report(p)
                assert got["version"] == version and got["state"] == "current"
                assert got["fingerprints"] == out["expected"][w], f"worker {w} differs at version {version}"
                assert got["nbytes"] == out["planned"][w]
                out.setdefault("received", []).append(got["nbytes"])
            sent.append(out)
    finally:
        assert [p.wait(timeout=120) for p in ranks] == [0, 0]
        assert [p.wait(timeout=120) for p in engines] == [0] * workers
    return sent


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["gloo", "shm", NIXL])
def test_fsdp2_to_two_tensor_parallel_workers_bitwise_with_fingerprint_and_dtype_change(transport: str) -> None:
    sent = _run("mlp", 2, transport, verify="fingerprint", dtype_change_at=3, replace_at=2)
    model = sent[0]["stats"]["model_bytes"]
    for out in sent:
        assert not out["gathers"].get("all_gather_into_tensor") and not out["gathers"].get("_all_gather_base")
    assert sent[1]["gathers"] == {}  # no handshake at step 2: nothing gathered at all
    assert sent[2]["stats"]["epoch"] == 2  # the dtype change made a new epoch and a new plan
    assert max(sent[0]["received"]) < 0.55 * model  # each worker receives only its half (and the whole 2.bias)


@pytest.mark.slow
def test_delta_refits_m_to_n_move_less_and_stay_bitwise_through_a_dtype_change() -> None:
    sent = _run("mlp", 2, "gloo", steps=5, delta=True, lr=1e-4, dtype_change_at=3)  # each worker checked bitwise
    stats = [out["stats"] for out in sent]
    assert [s["delta"] for s in stats] == [False, True, False, True, True]  # 3: a new epoch, full
    assert all(s["wire_bytes"] < s["full_bytes"] for s in stats if s["delta"])
    assert all(s["wire_bytes"] == s["full_bytes"] for s in stats if not s["delta"])


@pytest.mark.slow
def test_fsdp2_to_three_uneven_workers_bitwise() -> None:
    """Three workers: uneven slices (301 rows in 101, 101, 99) crossing the two ranks' uneven shards."""
    sent = _run("mlp", 3, "shm", steps=2)
    total = sum(sent[0]["received"])
    model = sent[0]["stats"]["model_bytes"]
    assert total < model + 2 * 48 * 2 + 1  # every byte once, except 2.bias (48 bf16) held whole by all three


@pytest.mark.slow
def test_moe_experts_split_across_workers_from_fsdp2_bitwise() -> None:
    """Expert parallelism: each worker holds its experts whole (and none of the others'), sharded embeddings."""
    sent = _run("moe", 2, "gloo", steps=3, verify="fingerprint", dtype_change_at=2, replace_at=3)
    model = sent[0]["stats"]["model_bytes"]
    assert max(sent[0]["received"]) < 0.62 * model  # 3 of 5 experts on worker 0
    assert sum(sent[0]["received"]) < model + 2 * 5 * 16 * 2 + 2 * 5 * 2 + 1  # only the router is held by both


def run_sliced_ranks(transport: str, device: str, workers: int = 2, steps: int = 3) -> list[dict]:
    """Two trainer ranks holding dim-0 slices in a ModuleSource (no FSDP) refit `workers` M:N workers;
    each worker checked bitwise against the weights the ranks hold at that step (initial + step)."""
    import torch
    from mesh_model import build, local_part, statement

    from refit.checks.fingerprints import fingerprint

    args = {"workers": workers, "transport": transport, "steps": steps, "device": device, "verify": "fingerprint"}
    ranks = start(args, script="mesh_ranks.py")
    engines = _workers(line(ranks[0]), "mlp", workers, device)
    sent = []
    try:
        for version in range(1, steps + 1):
            out = line(ranks[0])
            assert "error" not in out, out["error"]
            full = {n: t + version for n, t in build("mlp").state_dict().items()}
            for w, p in enumerate(engines):
                got = _report(p)
                want = {n: fingerprint(local_part(full[n], h).bfloat16().float(), torch.float32)
                        for n, h in statement("mlp", w, workers).items()}  # fmt: skip
                assert got["version"] == version and got["fingerprints"] == want, f"worker {w}, version {version}"
                assert got["nbytes"] == out["planned"][w]
            sent.append(out)
    finally:
        assert [p.wait(timeout=120) for p in ranks] == [0, 0]
        assert [p.wait(timeout=120) for p in engines] == [0] * workers
    return sent


@pytest.mark.slow
def test_sliced_module_sources_on_two_ranks_refit_m_to_n_over_shm() -> None:
    run_sliced_ranks("shm", "cpu")


def _current(out: dict, engines: list[subprocess.Popen], version: int) -> None:
    """Every rank's refit committed, and every worker holds its slices of the trainer's live weights."""
    assert out["version"] == version and out["errors"] == [None, None], out["errors"]
    for w, p in enumerate(engines):
        got = _report(p)
        assert (got.get("version"), got["state"]) == (version, "current"), got
        assert got["fingerprints"] == out["expected"][w], f"worker {w} differs at version {version}"


def _failed(out: dict, alive: subprocess.Popen, *said: str) -> None:
    """The refit failed on every rank saying `said`, and the worker still there reads 'failed' (not half-loaded)."""
    assert all(e is not None and all(s in e for s in said) for e in out["errors"]), out["errors"]
    got = _report(alive)
    assert "error" in got and got["state"] == "failed", got


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_an_elastic_m_to_n_session_fails_the_refit_a_worker_departs_in_and_goes_on_with_its_replacement(
    transport: str,
) -> None:
    """Worker 1 dies after every byte of version 2 landed (before it commits): version 2 fails on both ranks and
    worker 0 reads 'failed'. A replacement stating other slices is refused (version 3 fails, saying so); one
    stating the same slices takes version 4; one started after a kill between refits takes version 5."""
    args = {"kind": "mlp", "workers": 2, "transport": transport, "steps": 5, "verify": "fingerprint", "elastic": True,
            "gated": True}  # fmt: skip
    ranks = start(args, script="mesh_trainer.py", gate=True)
    info = line(ranks[0])
    engines = [_worker(info, "mlp", 0, 2), _worker(info, "mlp", 1, 2, fault={"kind": "die", "version": 2, "at": "commit"})]  # fmt: skip
    wrong = None
    try:
        go(ranks[0])
        _current(line(ranks[0]), engines, 1)
        go(ranks[0])
        _failed(line(ranks[0]), engines[0], "engine worker departed during the refit", "no other holder")
        assert engines[1].wait(timeout=120) == 9
        wrong = _worker(info, "mlp", 1, 2, stated_workers=3)
        go(ranks[0])
        _failed(line(ranks[0]), engines[0], "no engine worker 1 is connected", "states other shards")
        assert "states other shards" in _report(wrong)["error"] and wrong.wait(timeout=120) == 3
        engines[1] = _worker(info, "mlp", 1, 2)
        go(ranks[0])
        _current(line(ranks[0]), engines, 4)
        os.kill(engines[1].pid, signal.SIGKILL)
        assert engines[1].wait(timeout=120) == -signal.SIGKILL
        engines[1] = _worker(info, "mlp", 1, 2)
        go(ranks[0])
        _current(line(ranks[0]), engines, 5)
    finally:
        codes = [p.wait(timeout=120) for p in ranks]
        assert [p.wait(timeout=120) for p in engines] == [0, 0]
    assert codes == [0, 0]


@pytest.mark.slow
def test_an_elastic_m_to_n_refit_that_no_replacement_reaches_in_time_fails_before_it_begins() -> None:
    """Worker 1 is killed between refits and no replacement comes within the wait (3 s here: no process is
    starting): version 2 fails on both ranks before any pair begins, so worker 0 hears nothing of it and stays
    current; a replacement, connected before version 3 starts (the 3 s never bound its start), takes version 3."""
    args = {"kind": "mlp", "workers": 2, "transport": "shm", "steps": 3, "verify": "fingerprint", "elastic": True,
            "gated": True, "await_s": 3.0}  # fmt: skip
    ranks = start(args, script="mesh_trainer.py", gate=True)
    info = line(ranks[0])
    engines = _workers(info, "mlp", 2)
    try:
        go(ranks[0])
        _current(line(ranks[0]), engines, 1)
        os.kill(engines[1].pid, signal.SIGKILL)
        assert engines[1].wait(timeout=120) == -signal.SIGKILL
        go(ranks[0])
        errors = line(ranks[0])["errors"]
        said = ("did not begin", "engine worker 1 departed and no replacement connected within 3 s", "no other holder")
        assert all(e is not None and all(s in e for s in said) for e in errors), errors
        engines[1] = _worker(info, "mlp", 1, 2, announce=True)
        assert _report(engines[1]) == {"event": "connected"}  # waited for unbounded: a process start
        go(ranks[0])
        _current(line(ranks[0]), engines, 3)  # worker 0's next report is version 3: version 2 never reached it
    finally:
        codes = [p.wait(timeout=120) for p in ranks]
        assert [p.wait(timeout=120) for p in engines] == [0, 0]
    assert codes == [0, 0]
