"""The root per replica: after every committed refit the trainer's root, the receiver's and the engine's own
(read from what it holds) are equal; one wrong tensor changes the engine's, so a replica reading version v
with another root is caught by comparing with the trainer's record (`refit verify-root`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from threaded import RowsEngine, refit_both, session

from refit import ModuleEngine, ModuleSource, RefitStats, Settings, State
from refit.checks.root import root
from refit.tools.commands.verify_root import verdicts

SETTINGS = Settings(bucket_bytes=4 << 10, timeout_s=60.0)


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i}.weight": torch.randn(16, 24, generator=g) for i in range(6)} | {
        "steps": torch.arange(5, dtype=torch.int64) + seed
    }


def test_trainer_receiver_and_engine_roots_agree_after_every_refit_and_one_wrong_tensor_is_caught() -> None:
    trainer, held = _tensors(0), _tensors(1)
    engine = ModuleEngine(held)
    with pytest.raises(ValueError, match="no manifest yet"):
        engine.root()
    seen = set()
    with session(ModuleSource(trainer), engine, SETTINGS) as (sender, peer):
        for version in (1, 2, 3):
            with torch.no_grad():
                trainer["layer2.weight"].add_(0.5)
            stats, got = refit_both(sender, peer, version)
            assert isinstance(stats, RefitStats) and isinstance(got, RefitStats), (stats, got)
            assert stats.root and stats.root == got.root and list(stats.roots.values()) == [stats.root], (stats, got)
            assert engine.root() == (version, stats.root)
            seen.add(stats.root)
        with torch.no_grad():  # the replica's bytes change after the commit: its label still says 3
            held["layer4.weight"][3, 7] += 1.0
        version, drifted = engine.root()
    assert len(seen) == 3  # every version has its own root
    assert version == 3 and drifted != stats.root
    found = verdicts(3, stats.root, [{"version": version, "root": drifted}])
    assert found == [("differs", f"worker 0 reads version 3 with root {drifted}, not {stats.root}")]


def test_the_root_is_not_read_while_a_refit_is_under_way() -> None:
    engine = ModuleEngine(_tensors(1))
    with session(ModuleSource(_tensors(0)), engine, SETTINGS) as (sender, peer):
        stats, _ = refit_both(sender, peer, 1)
        assert isinstance(stats, RefitStats)
        engine.versions.begin(2)
        with pytest.raises(ValueError, match="weights are updating .* read the root once a refit committed"):
            engine.root()
        assert engine.weights.state == State.UPDATING


def test_a_sharded_receiver_has_the_root_of_its_own_shard() -> None:
    trainer = _tensors(0)
    engine = RowsEngine(_tensors(1), "layer1.weight", 4, 12)
    with session(ModuleSource(trainer), engine, SETTINGS) as (sender, peer):
        stats, got = refit_both(sender, peer, 1)
    assert isinstance(stats, RefitStats) and isinstance(got, RefitStats), (stats, got)
    assert got.root == stats.root == engine.root()[1] and list(stats.roots.values()) == [got.root]
    whole = ModuleEngine(_tensors(2))
    with session(ModuleSource(trainer), whole, SETTINGS) as (sender, peer):
        plain, _ = refit_both(sender, peer, 1)
    assert isinstance(plain, RefitStats) and plain.root != got.root  # a shard's leaf is its region's digest


def test_verify_root_cli_exits_1_naming_the_worker_that_differs(tmp_path: Path) -> None:
    from refit.tools.cli import main

    good = root([f"{v:016x}" for v in range(4)])
    stats = tmp_path / "stats.json"
    stats.write_text(json.dumps({"version": 7, "root": good}))
    readings = tmp_path / "workers.json"
    readings.write_text(json.dumps([{"version": 7, "root": good}]))
    assert main(["verify-root", "--readings", str(readings), "--stats", str(stats)]) == 0
    readings.write_text(json.dumps([{"version": 7, "root": good}, {"version": 7, "root": "0" * 32}]))
    assert main(["verify-root", "--readings", str(readings), "--stats", str(stats)]) == 1
    assert main(["verify-root", "--readings", str(readings)]) == 2  # no trainer's record: a usage error
