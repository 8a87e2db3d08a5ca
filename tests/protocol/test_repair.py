"""Repair, not resend: the REPAIR exchange's parsers refuse anything but the tensors asked for, and a repair that
does not restore the tensor fails the version as the fingerprint check does, nothing committed."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from threaded import refit_both, session

from refit import ModuleEngine, ModuleSource, RefitError, RefitStats, Settings, State
from refit.errors import IntegrityError
from refit.layout.planner import plan
from refit.layout.spec import TensorSpec
from refit.topology import repair

SETTINGS = Settings(bucket_bytes=4 << 10, timeout_s=60.0)
SPECS = [TensorSpec("a", (4, 8), torch.float32), TensorSpec("b", (3,), torch.int64)]


def _manifest():  # noqa: ANN202 - a Manifest
    return plan(SPECS, capacity=1 << 12)


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(64, 64, generator=g) for i in range(8)} | {"n": torch.randn(16, generator=g)}


def test_repair_payload_round_trips_and_refuses_a_tensor_not_asked_for() -> None:
    m = _manifest()
    live = {"a": torch.randn(4, 8), "b": torch.arange(3)}
    body = repair.pack(m, ModuleSource(live), ["b", "a"])
    got = repair.unpack(body, m, ["b", "a"])
    assert [n for n, _ in got] == ["b", "a"] and torch.equal(got[1][1], live["a"]) and torch.equal(got[0][1], live["b"])
    with pytest.raises(IntegrityError, match="exactly the tensors asked for"):
        repair.unpack(body, m, ["a"])
    with pytest.raises(IntegrityError, match="bytes after its last tensor"):
        repair.unpack(body + b"x", m, ["b", "a"])


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=300), st.lists(st.sampled_from(["a", "b", "c", ""]), max_size=3))
def test_any_repair_payload_is_parsed_or_refused_with_an_integrity_error(raw: bytes, asked: list[str]) -> None:
    for payload in (raw, struct.pack("<Q", len(raw)) + raw):
        try:
            repair.unpack(payload, _manifest(), asked)
        except IntegrityError:
            pass


@settings(max_examples=100, deadline=None)
@given(st.recursive(st.none() | st.integers() | st.text(max_size=4), lambda x: st.lists(x, max_size=4), max_leaves=10))
def test_any_repair_request_is_parsed_or_refused_with_an_integrity_error(names: object) -> None:
    payload = json.dumps({"repair": names}).encode()
    try:
        got = repair.parse_request(payload, _manifest())
    except IntegrityError:
        return
    assert set(got) <= {"a", "b"} and len(set(got)) == len(got)


class AlwaysWrong(ModuleEngine):
    """Every load of one tensor writes a flipped value: a repair cannot restore it."""

    def load(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        super().load(tensors)
        if any(n == "n" for n, _ in tensors):
            with torch.no_grad():
                self.tensor("n")[0] += 1.0


def test_a_repair_that_does_not_restore_the_tensor_fails_the_version_and_nothing_commits() -> None:
    engine = AlwaysWrong(_tensors(1), repair=True)
    with session(ModuleSource(_tensors(0)), engine, SETTINGS) as (sender, peer):
        stats, got = refit_both(sender, peer, 1)
    assert isinstance(stats, RefitError) and isinstance(got, RefitError), (stats, got)
    assert "fingerprint check failed after repair: 1 tensor(s) still differ: ['n']" in str(stats), stats
    assert engine.weights.state == State.FAILED and engine.weights.version is None


def test_more_wrong_bytes_than_a_repair_moves_fail_the_version_as_without_repair() -> None:
    class Scrambles(ModuleEngine):
        def load(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
            super().load([(n, t + 1) for n, t in tensors])

    engine = Scrambles(_tensors(1), repair=True)
    with session(ModuleSource(_tensors(0)), engine, SETTINGS) as (sender, peer):
        stats, _ = refit_both(sender, peer, 1)
    assert isinstance(stats, RefitError) and "does not hold what the trainer holds for 9 tensor(s)" in str(stats)
    assert not isinstance(stats, RefitStats) and engine.weights.state == State.FAILED
