"""CachePolicy: what vLLM's prefix (KV) cache does when a refit commits, and the per-version cache salt of
policy 'salt'. Imports nothing of vLLM.

- 'reset' (the default): every KV block is dropped at commit, the running requests' too (they are
  preempted and recomputed with the new weights).
- 'salt': nothing is dropped; every commit makes a new cache salt, and requests that carry it (vLLM's
  `cache_salt`) never hit KV computed with an older version. In-flight requests keep their KV.
- 'keep': nothing is dropped and nothing is salted: a cached prompt is served with KV of older versions
  (stale). Only for measuring, or when the caller resets the cache itself.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import Any, Literal, get_args

CachePolicy = Literal["reset", "salt", "keep"]
CACHE_POLICIES: tuple[str, ...] = get_args(CachePolicy)


def check_cache_policy(policy: object) -> CachePolicy:
    """`policy` itself when it is one of CACHE_POLICIES; else ValueError naming them."""
    if policy not in CACHE_POLICIES:
        raise ValueError(f"cache_policy must be one of {', '.join(CACHE_POLICIES)}, not {policy!r}")
    return policy  # type: ignore[return-value]


class VersionSalt:
    """The cache salt of the committed version: new at every commit (a retried version gets a new one too),
    unique to this driver (a random prefix), and valid for vLLM (at most 128 characters, no '@' or '/')."""

    def __init__(self) -> None:
        self._prefix = f"refit-{secrets.token_hex(6)}"
        self._commits = 0
        self.current: str | None = None
        """None until the first commit: requests before it are not salted."""

    def advance(self, version: int) -> str:
        self._commits += 1
        self.current = f"{self._prefix}-v{version}-c{self._commits}"
        return self.current


def salted(prompts: Any, salt: str) -> Any:
    """`prompts` (one prompt or a sequence: strings, or dicts such as vLLM's `TokensPrompt`) with `cache_salt`
    set to `salt`; a prompt that already carries a cache salt is refused (ValueError), since it would either
    be overridden or hit KV of an older version."""
    if isinstance(prompts, (str, dict)):
        return _salted_one(prompts, salt)
    if isinstance(prompts, Sequence):
        return [_salted_one(p, salt) for p in prompts]
    raise ValueError(
        f"cache_policy 'salt' salts prompts given as strings or dicts, not {type(prompts).__name__}: "
        "pass those, or set cache_salt=driver.cache_salt on each request yourself"
    )


def _salted_one(prompt: Any, salt: str) -> dict:
    if isinstance(prompt, str):
        return {"prompt": prompt, "cache_salt": salt}
    if isinstance(prompt, dict):
        if "cache_salt" in prompt and prompt["cache_salt"] != salt:
            raise ValueError(
                f"a prompt carries cache_salt={prompt['cache_salt']!r}, but cache_policy 'salt' gives every "
                f"request the committed version's salt ({salt!r}): drop the prompt's own salt"
            )
        return {**prompt, "cache_salt": salt}
    raise ValueError(
        f"cache_policy 'salt' salts prompts given as strings or dicts, not {type(prompt).__name__}: "
        "pass those, or set cache_salt=driver.cache_salt on each request yourself"
    )
