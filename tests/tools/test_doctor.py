"""`refit doctor`: each check, the verdict per transport, the exit code, and the real CUDA IPC probe on a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

import pytest
import torch
from locations import ROOT, SRC

from refit.settings import Settings
from refit.tools import doctor
from refit.tools.cli import main
from refit.tools.doctor import FAIL, OK, WARN, Check, Report, diagnose, verdict
from refit.tools.ipc_probe import IPC_FIX

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")


def _refit(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [SRC, os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "refit", *args], capture_output=True, text=True, env=env)


@no_cuda
def test_a_cpu_machine_gets_shm_and_gloo_and_is_told_why_not_the_gpu_transports() -> None:
    report = diagnose(transports=["shm", "gloo", "cuda-ipc", "nccl"])
    verdicts = {v.transport: v for v in report.verdicts}
    assert verdicts["shm"].status == OK and verdicts["gloo"].status == OK
    for name in ("cuda-ipc", "nccl"):
        assert verdicts[name].status == FAIL
        assert "cuda" in verdicts[name].reason and "shm" in verdicts[name].fix
    assert report.by_name("cuda-ipc probe") is None  # no GPU: nothing to probe


@pytest.mark.slow
@no_cuda
def test_doctor_exits_1_only_when_an_asked_transport_cannot_work() -> None:
    bad = _refit("doctor", "--transport", "nccl")
    assert bad.returncode == 1, bad.stderr
    assert "nccl cannot work on this machine" in bad.stdout and "fix: install a CUDA build of torch" in bad.stdout
    good = _refit("doctor", "--transport", "shm,gloo")
    assert good.returncode == 0, good.stdout + good.stderr
    assert _refit("doctor").returncode == 0  # nothing asked: a report, not a verdict


def test_doctor_json_lists_every_check_and_a_verdict_per_transport(capsys: pytest.CaptureFixture) -> None:
    assert main(["doctor", "--transport", "shm", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    names = {c["name"] for c in out["checks"]}
    assert {"torch", "cuda", "rendezvous", "/dev/shm", "memory cpu", "container", "vllm", "ray"} <= names
    assert out["transports"]["shm"]["status"] == OK and out["asked"] == ["shm"] and out["ok"] is True


def test_buffers_larger_than_memory_and_dev_shm_rule_out_shm_and_name_the_fix() -> None:
    report = diagnose(transports=["shm", "gloo"], settings=Settings(bucket_bytes=1 << 50))
    shm = report.by_name("/dev/shm")
    assert shm is not None and shm.status == FAIL and "REFIT_BUCKET_BYTES" in shm.fix
    assert {v.transport: v.status for v in report.verdicts} == {"shm": FAIL, "gloo": FAIL}
    assert report.failed(["shm", "gloo"]) == ["shm", "gloo"]


def test_a_containers_default_dev_shm_is_a_warning_naming_shm_size(monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.statvfs

    class Small:
        f_frsize, f_blocks, f_bavail = 4096, (64 << 20) // 4096, (64 << 20) // 4096

    monkeypatch.setattr(os, "statvfs", lambda p: Small() if p == "/dev/shm" else real(p))
    check = doctor.check_shm(Settings())
    assert check.status == WARN and "--shm-size" in check.fix


def test_expandable_segments_make_cuda_ipc_stage_through_host_memory() -> None:
    conf = {"PYTORCH_CUDA_ALLOC_CONF": "garbage_collection_threshold:0.6, expandable_segments:True"}
    allocator = doctor.check_allocator(conf, Settings())
    assert allocator.status == WARN and "expandable_segments" in allocator.fix
    assert doctor.check_allocator({}, Settings()).status == OK
    ok = lambda name: Check(name=name, status=OK, detail="")  # noqa: E731
    report = Report(checks=[ok("cuda"), ok("rendezvous"), ok("/dev/shm"), allocator])
    v = verdict(report, "cuda-ipc")
    assert v.status == WARN and "falls back" in v.reason and "zero_copy" in v.reason


def test_a_failed_ipc_probe_with_no_dev_shm_to_fall_back_on_rules_cuda_ipc_out() -> None:
    ok = lambda name: Check(name=name, status=OK, detail="")  # noqa: E731
    probe = Check(name="cuda-ipc probe", status=FAIL, detail="opening the handle failed", fix=IPC_FIX)
    report = Report(
        checks=[
            ok("cuda"),
            ok("rendezvous"),
            ok("allocator"),
            probe,
            Check(name="/dev/shm", status=FAIL, detail="no /dev/shm"),
        ]
    )
    v = verdict(report, "cuda-ipc")
    assert v.status == FAIL and "--ipc=host" in v.fix


def test_a_rendezvous_host_that_is_not_this_machine_fails() -> None:
    check = doctor.check_rendezvous(Settings(host="203.0.113.7"))  # TEST-NET-3: never an address of this machine
    assert check.status == FAIL and "REFIT_HOST" in check.fix


def test_vllm_and_its_refit_backend_are_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    check = doctor.check_vllm()
    if doctor.installed("vllm"):
        assert check.status in (OK, WARN) and "vLLM" in check.detail
        if check.status == OK:
            with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
                plugin = tomllib.load(f)["project"]["entry-points"]["vllm.general_plugins"]["refit"]
            assert f"backend 'refit' registered ({plugin})" in check.detail
    monkeypatch.setitem(sys.modules, "vllm", None)  # as if not installed
    missing = doctor.check_vllm()
    assert missing.status == "info" and "not installed" in missing.detail and "vllm" in missing.fix


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_machine_the_ipc_probe_really_shares_memory_and_nccl_is_found() -> None:
    report = diagnose(transports=["shm", "gloo", "cuda-ipc", "nccl"])
    checks = {c.name: c for c in report.checks}
    assert checks["cuda"].status == OK and "GPU" in checks["cuda"].detail
    assert checks["cuda-ipc probe"].status == OK, checks["cuda-ipc probe"].detail
    assert checks["nccl"].status == OK and checks["nccl"].detail.startswith("NCCL 2.")
    assert all(checks[f"memory cuda:{i}"].status == OK for i in range(torch.cuda.device_count()))
    verdicts = {v.transport: v.status for v in report.verdicts}
    assert verdicts["cuda-ipc"] == OK
    if torch.cuda.device_count() >= 2:
        assert checks["peers"].status in (OK, WARN) and "NVLink" in checks["peers"].detail
        assert verdicts["nccl"] == OK
    result = _refit("doctor", "--transport", "cuda-ipc", "--json")
    assert result.returncode == 0 and json.loads(result.stdout)["transports"]["cuda-ipc"]["status"] == OK
