"""The vLLM LoRA engine's plain parts, without vLLM: its options from a PEFT config, the adapter's layout worked out
by PEFT on the meta device (equal to the trainer's own statement), where vLLM keeps each target, and the capacity
vLLM must be started with. tests/integration/test_vllm_lora.py runs the engine in a real vLLM."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

peft = pytest.importorskip("peft")
pytest.importorskip("transformers")

from refit.integrations.vllm.lora import VllmLoraOptions, adapter_layout, check_capacity, places  # noqa: E402
from refit.stages.lora import AdapterTensors, layout_statement  # noqa: E402
from refit.tools.demo.model import build_model, model_config  # noqa: E402

CONFIG = model_config(layers=2, hidden=128, ffn=256)


def _peft(**lora: object) -> torch.nn.Module:
    fields: dict = {"r": 4, "lora_alpha": 12, "target_modules": ["q_proj", "v_proj", "down_proj"], **lora}
    return peft.get_peft_model(build_model(CONFIG, seed=0), peft.LoraConfig(**fields))


@pytest.mark.parametrize(
    "lora",
    [
        {},
        {"use_rslora": True},
        {"rank_pattern": {"down_proj": 2}, "alpha_pattern": {"q_proj": 3.0}},
        {"layers_to_transform": [1]},
        {"target_modules": "all-linear"},
    ],  # fmt: skip
    ids=["plain", "rslora", "patterns", "layers", "all-linear"],
)
def test_the_engines_layout_is_the_trainers_own_statement_and_tensors(lora: dict) -> None:
    trainer = _peft(**lora)
    options = VllmLoraOptions.from_peft(trainer.peft_config["default"])
    stated, specs = adapter_layout(CONFIG, options, torch.float32)
    assert stated == layout_statement(trainer, "default")
    want = {n: tuple(t.shape) for n, t in AdapterTensors(trainer, "default").items()}
    assert {s.name: s.shape for s in specs} == want and all(s.dtype == torch.float32 for s in specs)
    assert VllmLoraOptions.from_json(options.to_json()) == options  # what crosses collective_rpc


def test_options_refuse_what_cannot_be_served() -> None:
    with pytest.raises(ValueError, match="keep"):
        VllmLoraOptions(r=4, lora_alpha=8, target_modules=["q_proj"], keep=1)
    with pytest.raises(ValueError, match="r "):
        VllmLoraOptions(r=0, lora_alpha=8, target_modules=["q_proj"])
    with pytest.raises(ValueError, match="target_modules"):
        VllmLoraOptions(r=4, lora_alpha=8, target_modules=[])
    with pytest.raises(ValueError, match="embedding"):
        adapter_layout(CONFIG, VllmLoraOptions(r=4, lora_alpha=8, target_modules=["embed_tokens"]), torch.float32)


def test_each_target_is_found_in_vllms_lora_layers_packed_or_not() -> None:
    manager = SimpleNamespace(
        modules={"model.layers.0.self_attn.qkv_proj": 0, "model.layers.0.mlp.down_proj": 0},
        packed_modules={"model.layers.0.self_attn.qkv_proj": [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]},
    )
    got = places(manager, ["model.layers.0.self_attn.v_proj", "model.layers.0.mlp.down_proj"])
    assert got == {
        "model.layers.0.self_attn.v_proj": ("model.layers.0.self_attn.qkv_proj", 2),
        "model.layers.0.mlp.down_proj": ("model.layers.0.mlp.down_proj", 0),
    }
    with pytest.raises(ValueError, match="no LoRA layer for 'model.layers.0.mlp.up_proj'"):
        places(manager, ["model.layers.0.mlp.up_proj"])


@pytest.mark.parametrize(
    ("started", "said"),
    [
        ({"max_lora_rank": 2}, "max_lora_rank=4"),
        ({"max_loras": 1}, "max_loras=2"),
        ({"max_cpu_loras": 1}, "max_cpu_loras=2"),
    ],
)
def test_vllm_started_too_small_is_refused_naming_the_setting(started: dict, said: str) -> None:
    lora_config = SimpleNamespace(**{"max_lora_rank": 8, "max_loras": 2, "max_cpu_loras": 2, **started})
    with pytest.raises(ValueError, match=said):
        check_capacity(lora_config, VllmLoraOptions(r=4, lora_alpha=8, target_modules=["q_proj"]))
