"""State only the engine holds, as docs/USAGE.md ("What a commit covers") says: a non-persistent buffer the
trainer does not send is kept, named at WARNING; a persistent one (part of the engine's checkpoint, which the
trainer cannot produce) fails the handshake as missing, naming it and the waiver, and is kept once waived."""

from __future__ import annotations

import logging

import pytest
import torch
from threaded import refit_both, session
from torch import nn

from refit import HandshakeError, ModuleEngine, ModuleSource, Settings
from refit.topology.stats import RefitStats

SETTINGS = Settings(timeout_s=60.0)


class _Layer(nn.Module):
    def __init__(self, seed: int, *, extra: bool = False, persistent: bool = True) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.proj = nn.Linear(8, 8)
        if extra:  # the engine's own buffer, which the trainer's model does not have
            self.register_buffer("calib", torch.randn(8, generator=g), persistent=persistent)


def test_a_persistent_buffer_only_the_engine_holds_fails_the_handshake_naming_it_and_the_waiver() -> None:
    held = _Layer(1, extra=True)
    before = held.calib.clone()
    with session(ModuleSource(_Layer(0)), ModuleEngine(held), SETTINGS) as (sender, peer):
        stats, got = refit_both(sender, peer, 1)
    for err in (stats, got):
        assert isinstance(err, HandshakeError), err
        assert "1 missing" in str(err) and "calib" in str(err) and "ignore=['calib']" in str(err)
    assert torch.equal(held.calib, before)


def test_a_waived_persistent_buffer_is_kept_and_the_rest_moves() -> None:
    trainer, held = _Layer(0), _Layer(1, extra=True)
    before = held.calib.clone()
    with session(ModuleSource(trainer), ModuleEngine(held, ignore=["calib"]), SETTINGS) as (sender, peer):
        stats, got = refit_both(sender, peer, 1)
    assert isinstance(stats, RefitStats) and isinstance(got, RefitStats), (stats, got)
    assert torch.equal(held.calib, before) and torch.equal(held.proj.weight, trainer.proj.weight)


def test_a_non_persistent_buffer_only_the_engine_holds_is_kept_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    held = _Layer(1, extra=True, persistent=False)
    before = held.calib.clone()
    with caplog.at_level(logging.WARNING, logger="refit"):
        with session(ModuleSource(_Layer(0)), ModuleEngine(held), SETTINGS) as (sender, peer):
            stats, got = refit_both(sender, peer, 1)
    assert isinstance(stats, RefitStats) and isinstance(got, RefitStats), (stats, got)
    assert torch.equal(held.calib, before)
    assert any("non-persistent" in r.getMessage() and "'calib'" in r.getMessage() for r in caplog.records)


def test_the_users_guide_says_what_these_tests_pin_in_one_table() -> None:
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "USAGE.md").read_text()
    section = text.split("### What a commit covers", 1)[1].split("\n### ", 1)[0]
    lines = section.strip().splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = lines[first : first + next(i for i, line in enumerate(lines[first:]) if not line.startswith("|"))]
    assert not [line for line in lines[first + len(rows) :] if line.startswith("|")], "a row outside the table"
    persistent = [r for r in rows if r.startswith("| persistent buffers the engine holds")]
    assert persistent and "the handshake fails" in persistent[0] and "ignore=" in persistent[0]
    assert any(r.startswith("| non-persistent buffers only the engine holds") and "WARNING" in r for r in rows)
