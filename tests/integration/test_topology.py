"""Topologies: per-rank colocated refit (every trainer rank feeds the worker on its own device) and
a sender and receiver on two hosts (two network namespaces), on CPU."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch
from fsdp_trainer import build
from locations import helper, pythonpath
from peer import MARK
from rank_worker import RankWorker
from trainer_ranks import line, start

from refit.dtypes import dtype_name
from refit.settings import Settings
from refit.transports.address import WILDCARDS, advertised, interfaces, reachable_address

BUCKET = 16384


def engine_specs() -> list[list]:
    """The engines hold fp32, so bf16 on the wire is held exactly."""
    return [[n, list(t.shape), dtype_name(torch.float32)] for n, t in sorted(build(0).state_dict().items())]


@contextlib.contextmanager
def per_rank(args: dict, *, faults: dict | None = None, device: str = "cpu", worker_env: list[dict] | None = None,
             worker_devices: list[str] | None = None) -> Iterator[tuple[list, list[RankWorker], list[dict]]]:  # fmt: skip
    """2 trainer ranks, each with its own Sender, and 2 engine workers, worker i given every rendezvous."""
    ranks = start({"mode": "ranked", "bucket_bytes": BUCKET, **args}, envs=args.pop("envs", None))
    infos = line(ranks[0])
    workers = []
    try:
        for i in range(2):
            wargs = {"rendezvous": infos, "index": i, "specs": engine_specs(), "bucket_bytes": BUCKET,
                     "device": (worker_devices or [device] * 2)[i], **({"fault": faults[i]} if faults and i in faults else {})}  # fmt: skip
            workers.append(RankWorker(wargs, env=(worker_env or [{}, {}])[i]))
        yield ranks, workers, infos
    finally:
        codes = [p.wait(timeout=120) for p in ranks]
        for w in workers:
            w.wait()
        assert codes == [0, 0]


def check_refits(ranks: list, workers: list[RankWorker], steps: int, *, fsdp: bool) -> dict:
    """Every worker holds, bitwise, the trainer's live full tensors after every refit."""
    for version in range(1, steps + 1):
        sent = line(ranks[0])
        got = [w.report() for w in workers]
        assert "error" not in sent, sent
        for r in got:
            assert r["event"] == "refit" and (r["state"], r["version"]) == ("current", version), r
            assert r["fingerprints"] == sent["fingerprints"]
        if fsdp:  # every sharded tensor gathered exactly once per refit, within the predicted peak
            assert set(sent["gathers"].values()) == {version}, sent["gathers"]
            assert 0 < sent["peak"] <= sent["predicted"] < sent["model_bytes"]
    return sent


@pytest.mark.slow
@pytest.mark.parametrize("model", ["fsdp", "replicated"])
def test_per_rank_refit_feeds_each_worker_bitwise_from_the_rank_on_its_device(model: str) -> None:
    """Also: 1.weight replaced by a new parameter before the second refit is what the workers get next;
    FSDP2 runs with the fingerprint check, each worker's held tensors checked against its own rank's digests."""
    verify = "fingerprint" if model == "fsdp" else None
    with per_rank({"model": model, "transport": "shm", "steps": 3, "replace_at": 2, "verify": verify}) as (
        ranks,
        workers,
        infos,
    ):
        assert [i["trainer_rank"] for i in infos] == [0, 1] and infos[0]["port"] != infos[1]["port"]
        sent = check_refits(ranks, workers, 3, fsdp=model == "fsdp")
        assert sent["stats"]["epoch"] == 2  # the dtype change at the last step re-handshook
        if model == "fsdp":  # evenly sharded whole tensors went straight into the bucket buffers
            assert sent["in_place"] > 0
            assert sent["stats"]["unverified"] == 0 and "verify" in sent["stats"]["seconds"]


@pytest.mark.slow
def test_a_failure_on_one_worker_leaves_every_worker_failed_until_the_retry() -> None:
    fault = {1: {"kind": "raise", "version": 2, "at_load": 1}}
    with per_rank({"model": "fsdp", "transport": "shm", "steps": 3, "dtype_change_at": 99}, faults=fault) as (
        ranks,
        workers,
        _,
    ):
        check_refits(ranks, workers, 1, fsdp=True)
        sent = line(ranks[0])
        assert "another trainer rank" in sent["error"] and "injected engine failure" in sent["error"]
        got = [w.report() for w in workers]
        assert [(r["event"], r["state"], r["target"]) for r in got] == [("error", "failed", 2)] * 2
        assert "failed on another worker" in got[0]["message"]
        sent = line(ranks[0])
        got = [w.report() for w in workers]
        assert "error" not in sent and all(r["state"] == "current" and r["version"] == 3 for r in got)
        assert all(r["fingerprints"] == sent["fingerprints"] for r in got)


# -- two hosts ------------------------------------------------------------------------------------


def test_a_wildcard_is_never_advertised() -> None:
    assert advertised("0.0.0.0", Settings()) not in WILDCARDS
    assert advertised("0.0.0.0", Settings()) == reachable_address()
    assert advertised("127.0.0.1", Settings()) == "127.0.0.1"
    lo = next(n for n, a in interfaces().items() if a.startswith("127."))
    assert advertised("0.0.0.0", Settings(ifname=lo)) == "127.0.0.1"
    with pytest.raises(ValueError, match="no-such-if"):
        advertised("0.0.0.0", Settings(ifname="no-such-if"))


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


@pytest.fixture
def two_hosts() -> Iterator[tuple[str, str]]:
    """Two network namespaces joined by a veth pair: 10.231.0.1 (veth-ra) and 10.231.0.2 (veth-rb)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to make network namespaces")
    a, b = f"refit-a-{os.getpid()}", f"refit-b-{os.getpid()}"
    try:
        _sh("ip", "netns", "add", a)
        _sh("ip", "netns", "add", b)
        _sh("ip", "link", "add", "veth-ra", "netns", a, "type", "veth", "peer", "name", "veth-rb", "netns", b)
        for ns, dev, ip in ((a, "veth-ra", "10.231.0.1/24"), (b, "veth-rb", "10.231.0.2/24")):
            _sh("ip", "-n", ns, "addr", "add", ip, "dev", dev)
            _sh("ip", "-n", ns, "link", "set", dev, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
    except subprocess.CalledProcessError as e:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)
        pytest.skip(f"cannot make network namespaces here: {' '.join(e.cmd)}: {e.stderr.strip()}")
    try:
        yield a, b
    finally:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)


def _in(ns: str, script: str, args: dict, env: dict) -> subprocess.Popen:
    full = {**os.environ, "PYTHONPATH": pythonpath(), **env}
    return subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, helper(script), json.dumps(args)],
                            stdout=subprocess.PIPE, text=True, env=full)  # fmt: skip


def _json(proc: subprocess.Popen, mark: str) -> dict:
    assert proc.stdout is not None
    for text in proc.stdout:
        if text.startswith(mark):
            return json.loads(text[len(mark) :])
    raise AssertionError(f"process exited with {proc.wait()}")


@pytest.mark.slow
@pytest.mark.parametrize("env", [{"REFIT_HOST": "0.0.0.0"}, {"REFIT_IFNAME": "veth-ra"}], ids=["wildcard", "ifname"])
def test_gloo_refit_between_two_hosts_advertises_and_binds_a_reachable_address(
    two_hosts: tuple[str, str], env: dict
) -> None:
    a, b = two_hosts
    specs = engine_specs()
    sender = _in(a, "net_sender.py", {"specs": specs, "transport": "gloo", "bucket_bytes": BUCKET, "steps": 2}, env)
    try:
        info = _json(sender, "@@sender ")
        assert info["host"] == "10.231.0.1"
        worker = _in(
            b, "peer.py", {"rendezvous": info, "specs": specs, "bucket_bytes": BUCKET}, {"REFIT_HOST": "127.0.0.1"}
        )
        for version in (1, 2):
            sent, got = _json(sender, "@@sender "), _json(worker, MARK)
            assert got["event"] == "refit" and got["version"] == version, got
            assert got["fingerprints"] == sent["fingerprints"]
        assert worker.wait(timeout=60) == 0
    finally:
        assert sender.wait(timeout=60) == 0


# -- vLLM at tensor-parallel 2, one worker per trainer rank ---------------------------------------


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_tensor_parallel_2_fed_by_a_2_rank_fsdp2_trainer_one_worker_per_rank(tmp_path) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("vllm")
    from refit.tools.demo.model import PROMPTS, build_model, build_tokenizer, model_config, save

    tok = build_tokenizer()
    path = save(build_model(model_config(layers=2, hidden=256, ffn=768), seed=0), tok, str(tmp_path))
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"  # two CPU workers on this machine's one NUMA node
    script = helper("vllm_ranked.py")
    port = __import__("trainer_ranks").free_port()
    procs = [subprocess.Popen([sys.executable, script, path, json.dumps(prompts)], text=True,
                              stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL,
                              env={**env, "RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                   "PYTHONPATH": pythonpath()})
             for r in range(2)]  # fmt: skip
    result = _json(procs[0], "@@ranked ")
    assert [p.wait(timeout=600) for p in procs] == [0, 0]
    assert result["rendezvous"] == 2 and result["gathers"] == [1] and result["buckets"] > 3
    assert result["out"] == result["trainer"]
