"""M:N statements that do not fit fail at connect, on the trainer and the workers, before any byte moves;
a worker refuses pieces that do not tile its parts exactly once (a wrong plan never writes)."""

from __future__ import annotations

import threading

import pytest
import torch

from refit import ModuleEngine, ModuleSource, Settings
from refit.engines.pieces import ShardTarget
from refit.errors import RefitError
from refit.layout.manifest import Manifest
from refit.layout.planner import plan
from refit.layout.reshard import Slice, piece_name
from refit.layout.spec import TensorSpec
from refit.topology.mesh import MeshReceiver, MeshRefit

FULL = {"w": torch.arange(24, dtype=torch.float32).reshape(6, 4), "b": torch.ones(6)}


def _connect(shards: list[dict[str, Slice]], locals_: list[dict[str, torch.Tensor]]) -> tuple[str, list[str]]:
    """Connect one trainer (every tensor whole) to workers with these statements; (trainer error, worker errors)."""
    settings = Settings(timeout_s=20, bucket_bytes=1 << 16)
    mesh = MeshRefit(ModuleSource(dict(FULL)), num_workers=len(shards), transport="shm", settings=settings)
    info = mesh.rendezvous()
    engines = [ModuleEngine(loc, shards=sh) for loc, sh in zip(locals_, shards)]
    errors = [""] * len(engines)
    written = [{n: t.clone() for n, t in loc.items()} for loc in locals_]

    def serve(w: int) -> None:
        with MeshReceiver(engines[w], info, worker=w, settings=settings) as rx:
            try:
                rx.receive()
            except Exception as e:  # noqa: BLE001 - the test reads what each worker saw
                errors[w] = str(e)

    threads = [threading.Thread(target=serve, args=(w,)) for w in range(len(engines))]
    for t in threads:
        t.start()
    try:
        mesh.refit(1)
        trainer = ""
    except (RefitError, ValueError) as e:
        trainer = str(e)
    finally:
        mesh.close()
    for t in threads:
        t.join()
    for loc, before in zip(locals_, written):
        assert all(torch.equal(loc[n], before[n]) for n in loc), "a byte was written despite the mismatch"
    return trainer, errors


def _zeros(parts: dict[str, Slice | None]) -> dict[str, torch.Tensor]:
    return {
        n: torch.zeros_like(FULL[n] if h is None else FULL[n].narrow(h.dim, h.start, h.length))
        for n, h in parts.items()
    }


def test_a_slice_outside_the_tensor_fails_at_connect_naming_tensor_slice_and_fix() -> None:
    parts = [{"w": Slice(0, 0, 3), "b": None}, {"w": Slice(0, 4, 3), "b": None}]  # rows 4..7 of 6
    locs = [_zeros({"w": Slice(0, 0, 3), "b": None}), {"w": torch.zeros(3, 4), "b": torch.zeros(6)}]
    trainer, _ = _connect([{k: v for k, v in p.items() if v} for p in parts], locs)
    assert "'w'" in trainer and "outside the tensor" in trainer and "fix that holder's shard spec" in trainer


def test_a_tensor_no_worker_loads_fails_at_connect_naming_it() -> None:
    locs = [{"w": torch.zeros(6, 4)}]
    trainer, _ = _connect([{}], locs)
    assert "no engine worker loads 1 tensor(s)" in trainer and "b" in trainer and "ignore=" in trainer


def _target(parts: dict[str, Slice], shapes: dict[str, tuple]) -> ShardTarget:
    engine = ModuleEngine({n: torch.zeros(s) for n, s in shapes.items()}, shards=parts)
    return ShardTarget(engine, 2, timeout_s=5, device=torch.device("cpu"))


def _manifest(pieces: list[tuple[str, tuple[int, ...], tuple[int, ...]]]) -> Manifest:
    return plan([TensorSpec(piece_name(n, at), shape, torch.float32) for n, at, shape in pieces], capacity=1 << 16)


def test_pieces_of_two_ranks_that_overlap_or_leave_a_gap_are_refused_before_any_byte() -> None:
    for second in [((2, 0), (2, 4)), ((4, 0), (1, 4))]:  # rows 2-3 twice; row 3 missing... (see below)
        target = _target({"w": Slice(0, 0, 5)}, {"w": (5, 4)})
        target.expect(0, _manifest([("w", (0, 0), (3, 4))]))
        target.expect(1, _manifest([("w", *second)]))
        errors = [None, None]
        threads = [threading.Thread(target=lambda i=i: errors.__setitem__(i, target.begin(1))) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors[0] == errors[1] and "do not tile" in errors[0] and "w" in errors[0]
        engine = target.engine
        assert engine.weights.state.value == "failed" and "do not tile" in engine.weights.reason
        assert not engine.tensor("w").any()  # nothing written


def test_a_piece_outside_the_workers_part_or_of_an_unstated_tensor_is_refused_at_the_handshake() -> None:
    target = _target({"w": Slice(0, 0, 3)}, {"w": (3, 4)})
    with pytest.raises(ValueError, match="outside this worker's part"):
        target.expect(0, _manifest([("w", (2, 0), (2, 4))]))
    with pytest.raises(ValueError, match="did not state"):
        target.expect(0, _manifest([("x", (0,), (4,))]))
