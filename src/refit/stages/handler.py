"""Handler: what the engines state with READY, and what a check carries to their commit, read in one place each.

A handler is registered by name (`refit.stages.register_handler`) and made once per session on the trainer from
the session's options. The session (Sender, its membership policy and its rounds) calls every registered
handler at the same fixed points and names none of them:

- at connect, `adapt` reads every engine's READY statement (JSON bytes; empty when it states nothing) and
  returns the source the session sends from and the stages it adds; a ValueError refuses the session, and its
  message is told to every engine;
- when an engine joins an elastic session later, `vet` says why its statement does not fit, or '';
- before each refit's handshake, `due` gives what that refit's COMMIT carries under the handler's name, for the
  engines' check before they commit (a check's veto point: a failed check fails the version everywhere it runs);
  None carries nothing;
- after each refit commits, `committed` is told on which receivers, and whether it carried something;
- when a receiver's DONE fails the version, `diagnose` reads it and may say where it went wrong.

Its engine half is class-level (an engine process makes no session): `stated` adds to the engine's READY
statement, `parse` reads what COMMIT carried under the handler's name (before the engine loads a byte more),
and `veto`, after the engine's own commit ran and before the version reads current there, may fail it; then
`explain` adds to the failing DONE what the trainer's `diagnose` needs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

from refit.engines.base import Engine
from refit.errors import RefitError
from refit.layout.manifest import Manifest
from refit.sources.base import Source


class Handler:
    """One reader of the engines' statements; the base class reads nothing and changes nothing."""

    name: ClassVar[str] = ""
    """The name it is registered under, and the field of COMMIT that carries what `due` gives."""

    def __init__(self, options: Any) -> None:
        """`options`: the session's (refit.topology.options.SenderOptions); a handler reads the ones it knows."""
        self.options = options

    def adapt(self, source: Source, statements: Sequence[bytes]) -> tuple[Source, tuple[str, ...]]:
        """At connect: `statements` (one per receiver, by rank) as the engines sent them. Returns the source to
        send from (`source` or a view of it) and the stage names this adds; ValueError refuses the session."""
        return source, ()

    def vet(self, raw: bytes, rank: int) -> str:
        """Why an engine joining later as receiver `rank`, stating `raw`, does not fit this session, or ''."""
        return ""

    def due(self, ranks: frozenset[int]) -> object | None:
        """What the next refit (to the receivers of `ranks`) carries in COMMIT for the engines' pre-commit
        check: a JSON-able value, or None for nothing."""
        return None

    def committed(self, ranks: list[int], carried: bool) -> None:
        """A refit committed on `ranks`; `carried`: its COMMIT carried what `due` gave (never called on failure)."""

    def diagnose(self, done: dict, cache: dict) -> str:
        """A receiver's failing DONE (its JSON, with what `explain` added there): the text appended to its
        failure that says where it went wrong, or ''. `cache` lives for one refit, shared by its receivers."""
        return ""

    # -- the engine's half -------------------------------------------------------------------------

    @classmethod
    def stated(cls, engine: Engine) -> dict:
        """What `engine` states with READY for this handler, by key (JSON-able); ValueError for an engine that
        misstates what it holds (its connect fails, naming it)."""
        return {}

    @classmethod
    def parse(cls, value: object) -> object:
        """What COMMIT carried under this handler's name, checked field by field (IntegrityError fails the refit)."""
        return value

    @classmethod
    def veto(cls, parsed: object, engine: Engine, manifest: Manifest, version: int) -> RefitError | None:
        """Before `version` reads current on `engine` (its own commit ran): the reason it fails here, or None."""
        return None

    @classmethod
    def explain(cls, parsed: object, engine: Engine, manifest: Manifest) -> dict:
        """After `veto` failed the version: fields (JSON-able) the engine adds to its failing DONE for the
        trainer's `diagnose`; advice only, never needed for the verdict."""
        return {}


def adapt(handlers: Iterable[Handler], source: Source, statements: Sequence[bytes]) -> tuple[Source, tuple[str, ...]]:
    """Every handler's `adapt` in turn, each on the source the one before returned: (the source to send from,
    the stages they add, in their order). The first ValueError refuses the session."""
    added: tuple[str, ...] = ()
    for handler in handlers:
        source, more = handler.adapt(source, statements)
        added += more
    return source, added
