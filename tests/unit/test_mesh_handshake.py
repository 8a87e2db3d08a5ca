"""M:N statements that do not fit fail at connect, on the trainer and the workers, before any byte moves;
a worker refuses pieces that do not tile its parts exactly once (a wrong plan never writes)."""

from __future__ import annotations

import threading

import pytest
import torch

from refit import ModuleEngine, ModuleSource, Settings
from refit.engines.base import Engine
from refit.engines.pieces import PieceEngine, ShardTarget
from refit.errors import RefitError
from refit.layout.manifest import Manifest
from refit.layout.planner import plan
from refit.layout.reshard import piece_name
from refit.layout.spec import Slice, TensorSpec
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


class _StagingEngine(Engine):
    """An engine that loads whole slices (as VllmEngine does): the worker stages pieces, then load_shards."""

    def __init__(self) -> None:
        super().__init__()
        self.got: dict[str, torch.Tensor] = {}

    def specs(self) -> list[TensorSpec]:
        return [TensorSpec("x", (4, 2), torch.float32), TensorSpec("y", (2,), torch.float32)]

    def shards(self) -> dict[str, Slice | None]:
        return {"x": None, "y": None}

    def load(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        raise AssertionError("an M:N worker loads through load_shards")

    def load_shards(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        self.got = {n: t.clone() for n, t in tensors}


def test_one_pairs_new_manifest_never_leaves_another_pair_writing_into_a_dropped_staging_tensor() -> None:
    """Pair 0 alone re-handshakes (y's wire dtype changed); pair 1's cached copy plan must land in the
    staging tensor that load_shards reads, not in the old one (it did: rows 2-3 read as garbage)."""
    engine = _StagingEngine()
    target = ShardTarget(engine, 2, timeout_s=10, device=torch.device("cpu"))
    pairs = [PieceEngine(target, 0), PieceEngine(target, 1)]
    m0 = _manifest([("x", (0, 0), (2, 2)), ("y", (0,), (2,))])
    m1 = _manifest([("x", (2, 0), (2, 2))])
    pairs[0].prepare(m0)
    pairs[1].prepare(m1)
    loads = [
        [(p.name, torch.full(p.spec.shape, v, dtype=p.spec.dtype)) for p in m.entries]
        for m, v in ((m0, 1.0), (m1, 2.0))
    ]

    def refit(version: int) -> None:
        def one(i: int) -> None:
            pairs[i].begin(version)
            pairs[i].load(loads[i])
            pairs[i].commit(version)

        target.reset()
        threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    refit(1)
    assert engine.got["x"].tolist() == [[1.0, 1.0]] * 2 + [[2.0, 2.0]] * 2
    m0b = plan([TensorSpec("x@0,0", (2, 2), torch.float32), TensorSpec("y@0", (2,), torch.float16)], capacity=1 << 16)
    pairs[0].prepare(m0b)
    loads[0] = [(p.name, torch.full(p.spec.shape, 3.0, dtype=p.spec.dtype)) for p in m0b.entries]
    for _, t in loads[1]:
        t.fill_(4.0)  # the same list (a receiver reuses its bucket views), new values
    refit(2)
    assert engine.got["x"].tolist() == [[3.0, 3.0]] * 2 + [[4.0, 4.0]] * 2
    assert engine.got["y"].dtype == torch.float16 and engine.got["y"].tolist() == [3.0, 3.0]


@pytest.mark.parametrize("how", ["dtype", "shape", "storage", "identity"])
def test_a_worker_tensor_recast_or_reshaped_since_the_plan_is_refused_before_any_byte_a_moved_one_is_followed(
    how: str,
) -> None:
    held = {"x": torch.zeros(2, 4)}
    engine = ModuleEngine(held)
    pair = PieceEngine(ShardTarget(engine, 1, timeout_s=10, device=torch.device("cpu")), 0)
    m = _manifest([("x", (0, 0), (2, 4))])
    pair.prepare(m)
    bucket = [(m.entries[0].name, torch.ones(2, 4))]

    def refit(version: int) -> None:
        pair.target.reset()
        pair.begin(version)
        pair.load(bucket)
        pair.commit(version)
        assert engine.weights.state.value == "updating"  # never current before the ranks' verdict
        engine.versions.commit(version)  # the verdict, as MeshReceiver applies it

    refit(1)
    t = held["x"]
    with torch.no_grad():
        if how == "dtype":
            t.data = t.data.half()
        elif how == "shape":
            t.data = torch.zeros(4, 2)
        elif how == "storage":
            t.set_(torch.zeros(2, 4).untyped_storage(), 0, (2, 4), (4, 1))
        else:
            held["x"] = torch.zeros(2, 4)
    bucket[0][1].fill_(5.0)
    if how in ("dtype", "shape"):
        with pytest.raises(RefitError, match=r"tensor x changed from torch.float32 \(2, 4\) to .* since the M:N plan"):
            refit(2)
        assert not (held["x"].float() == 5.0).any()  # nothing of version 2 written
        assert engine.weights.state.value == "failed"
        return
    refit(2)
    assert torch.equal(held["x"], torch.full((2, 4), 5.0)) and engine.weights.version == 2
