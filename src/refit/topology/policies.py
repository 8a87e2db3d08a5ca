"""How a Sender decides a refit, as a policy given at construction (`Sender(commit=...)`).

`Commit()` commits where every receiver committed; `Commit(strict=True)` also fails a refit in which any
tensor went unverified (receivers hold their commit open until told, since the verdict needs every list);
`Commit(vote=...)` is a per-rank or M:N refit's: the receivers hold their commit open until the vote across
every trainer rank is in."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

Vote = Callable[[str], str]
"""Given this Sender's failure ('' when its receivers committed), the failure across every trainer rank
('' when every worker committed)."""
Vet = Callable[[bytes], str]
"""Elastic M:N: given what a joiner sent with READY, '' to take it in, else why not."""


@dataclass(frozen=True)
class Commit:
    strict: bool = False
    vote: Vote | None = None

    @property
    def two_phase(self) -> bool:
        """Receivers hold their commit open until they are told the verdict."""
        return self.vote is not None or self.strict

    @classmethod
    def matching(cls, commit: Commit | None, verify: str | None) -> Commit:
        """`commit` (default: strict when `verify` is 'strict'), refused when it disagrees with `verify`."""
        chosen = commit or cls(strict=verify == "strict")
        if chosen.strict != (verify == "strict"):
            raise ValueError(f"commit={chosen} disagrees with verify={verify!r}: strict is verify='strict'")
        return chosen

    def decide(self, own: str) -> str:
        return self.vote(own) if self.vote is not None else own
