"""Cache policies of the vLLM driver without vLLM: the policy is checked, the salt is new at every commit and
valid for vLLM, prompts are salted, and each policy does what it says at commit (a fake LLM records it)."""

from __future__ import annotations

import pytest
import torch

from refit import ModuleSource, Sender, Settings
from refit.integrations.vllm.cache import VersionSalt, check_cache_policy, salted
from refit.integrations.vllm.driver import VllmRefit


class _FakeLlm:
    """Records prefix-cache resets and the prompts given to generate."""

    def __init__(self) -> None:
        self.resets = 0
        self.prompts: list = []

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        self.resets += 1
        return True

    def generate(self, prompts: object, *args: object, **kwargs: object) -> list:
        self.prompts.append(prompts)
        return []


def _driver(policy: str) -> tuple[VllmRefit, _FakeLlm]:
    llm = _FakeLlm()
    sender = Sender(ModuleSource({"w": torch.ones(4)}), transport="shm", settings=Settings(timeout_s=5.0))
    return VllmRefit(llm, sender, cache_policy=policy), llm  # type: ignore[arg-type]


def test_an_unknown_policy_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(ValueError, match="cache_policy must be one of reset, salt, keep, not 'drop'"):
        check_cache_policy("drop")
    with pytest.raises(ValueError, match="cache_policy must be one of"):
        _driver("drop")


def test_the_salt_is_new_at_every_commit_unique_per_driver_and_valid_for_vllm() -> None:
    a, b = VersionSalt(), VersionSalt()
    assert a.current is None
    first, retried = a.advance(3), a.advance(3)
    assert first != retried and "-v3-" in first and first != b.advance(3)
    assert len(first) <= 128 and not set(first) & {"@", "/", "\\", "\0"}


def test_prompts_get_the_salt_and_a_prompt_with_its_own_salt_is_refused() -> None:
    assert salted("hi", "s") == {"prompt": "hi", "cache_salt": "s"}
    assert salted([{"prompt_token_ids": [1]}, "x"], "s") == [
        {"prompt_token_ids": [1], "cache_salt": "s"},
        {"prompt": "x", "cache_salt": "s"},
    ]
    with pytest.raises(ValueError, match="drop the prompt's own salt"):
        salted({"prompt": "x", "cache_salt": "mine"}, "s")
    with pytest.raises(ValueError, match="strings or dicts"):
        salted(7, "s")


@pytest.mark.parametrize(
    ("policy", "resets", "salted_prompt"), [("reset", 1, False), ("salt", 0, True), ("keep", 0, False)]
)
def test_each_policy_does_what_it_says_at_commit(policy: str, resets: int, salted_prompt: bool) -> None:
    driver, llm = _driver(policy)
    driver.generate(["before"])
    driver._settle_cache(1)  # what refit() and apply() run once the version is committed
    driver.generate(["after"])
    assert llm.resets == resets
    assert llm.prompts[0] == ["before"]  # nothing committed yet: nothing to salt
    assert (llm.prompts[1] != ["after"]) == salted_prompt
    assert (driver.cache_salt is not None) == salted_prompt
    driver.close()
