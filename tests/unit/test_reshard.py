"""The M:N reshard plan: executed byte by byte here, every worker ends with exactly its slice."""

from __future__ import annotations

import pytest
import torch

from refit.layout.reshard import plan_reshard
from refit.layout.spec import Slice, TensorSpec


def _part(t: torch.Tensor, held: Slice | None) -> torch.Tensor:
    return t if held is None else t.narrow(held.dim, held.start, held.length)


def _execute(specs, full, ranks, workers):
    """Run the plan with plain byte copies from each rank's contiguous local part; the workers' parts."""
    plan = plan_reshard(specs, ranks, workers)
    local = [{n: _part(full[n], h).contiguous().view(-1).view(torch.uint8) for n, h in held.items()} for held in ranks]
    got = [
        {n: torch.full((_part(full[n], h).nbytes,), 0xAB, dtype=torch.uint8) for n, h in need.items()}
        for need in workers
    ]
    for m in plan.moves:
        src, dst = local[m.rank][m.name], got[m.worker][m.name]
        for r in m.runs:
            for i in range(r.count):
                s, d = r.src + i * r.src_stride, r.dst + i * r.dst_stride
                dst[d : d + r.nbytes] = src[s : s + r.nbytes]
    return plan, got


def _assert_exact(full, workers, got) -> None:
    for w, need in enumerate(workers):
        for n, h in need.items():
            want = _part(full[n], h).contiguous().view(-1).view(torch.uint8)
            assert torch.equal(got[w][n], want), f"worker {w} holds the wrong bytes of {n}"


def _tensors(shapes: dict[str, tuple[int, ...]], dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    full = {n: torch.randn(s, generator=g).to(dtype) for n, s in shapes.items()}
    return [TensorSpec(n, s, dtype) for n, s in shapes.items()], full


def _even(n: int, parts: int, dim: int = 0) -> list[Slice]:
    """torch.chunk-style (uneven) slices, as FSDP2 Shard(dim) makes them."""
    size = -(-n // parts)
    return [Slice(dim, min(i * size, n), max(0, min(size, n - i * size))) for i in range(parts)]


def test_uneven_fsdp_shards_into_uneven_tensor_parallel_workers_move_each_byte_once() -> None:
    specs, full = _tensors({"w": (7, 6), "b": (7,)})
    ranks = [{"w": s, "b": t} for s, t in zip(_even(7, 2), _even(7, 2))]
    workers = [{"w": s, "b": t} for s, t in zip(_even(7, 3), _even(7, 3))]
    plan, got = _execute(specs, full, ranks, workers)
    _assert_exact(full, workers, got)
    assert sum(plan.worker_bytes()) == sum(t.nbytes for t in full.values())  # no byte twice
    assert plan.paths == {"b": "direct", "w": "direct"}


def test_a_dim0_sharded_trainer_feeds_row_parallel_workers_through_strided_runs() -> None:
    specs, full = _tensors({"o_proj": (8, 12)})
    ranks = [{"o_proj": s} for s in _even(8, 2)]
    workers = [{"o_proj": s} for s in _even(12, 2, dim=1)]
    plan, got = _execute(specs, full, ranks, workers)
    _assert_exact(full, workers, got)
    assert plan.paths["o_proj"] == "strided"
    assert all(r.count == 4 for m in plan.moves for r in m.runs)  # four rows of each rank's half per worker


def test_a_replicated_tensor_goes_to_each_worker_from_one_rank_spread_over_the_ranks() -> None:
    specs, full = _tensors({"norm": (16,)})
    ranks = [{"norm": None}, {"norm": None}]
    workers = [{"norm": None} for _ in range(4)]
    plan, got = _execute(specs, full, ranks, workers)
    _assert_exact(full, workers, got)
    assert [m.rank for m in plan.moves] == [0, 1, 0, 1]
    assert plan.rank_bytes() == [64, 64]


def test_experts_split_across_workers_from_an_fsdp_trainer() -> None:
    specs, full = _tensors({"experts.gate_up": (5, 6, 4), "experts.down": (5, 4, 3)})
    ranks = [{n: s for n in full} for s in _even(5, 2)]
    workers = [{n: s for n in full} for s in [Slice(0, 0, 2), Slice(0, 2, 2), Slice(0, 4, 1)]]
    plan, got = _execute(specs, full, ranks, workers)
    _assert_exact(full, workers, got)
    assert len(plan.pair(1, 0)) == 0  # a rank with nothing for a worker sends it nothing


def test_equal_tensor_parallel_layouts_are_one_direct_run_per_pair() -> None:
    specs, full = _tensors({"qkv": (12, 8), "down": (8, 10)})
    ranks = [{"qkv": a, "down": b} for a, b in zip(_even(12, 2), _even(10, 2, dim=1))]
    workers = [dict(r) for r in ranks]
    plan, got = _execute(specs, full, ranks, workers)
    _assert_exact(full, workers, got)
    assert {(m.rank, m.worker) for m in plan.moves} == {(0, 0), (1, 1)}
    assert all(len(m.runs) == 1 and m.runs[0].count == 1 for m in plan.moves)


def test_tensor_parallel_ranks_into_one_whole_engine_and_pipeline_stages_into_one_engine() -> None:
    specs, full = _tensors({"l0.w": (6, 4), "l1.w": (6, 4), "l0.norm": (4,)})
    ranks = [{"l0.w": Slice(0, 0, 3), "l0.norm": None}, {"l0.w": Slice(0, 3, 3), "l1.w": None}]
    workers = [{n: None for n in full}]
    plan, got = _execute(specs, full, ranks, workers)
    _assert_exact(full, workers, got)
    assert plan.rank_bytes() == [3 * 4 * 2 + 4 * 2, 3 * 4 * 2 + 6 * 4 * 2]


def test_tensor_parallel_two_workers_receive_about_half_the_model_each() -> None:
    shapes = {}
    for i in range(2):
        shapes |= {
            f"l{i}.q": (64, 64),
            f"l{i}.o": (64, 64),
            f"l{i}.up": (128, 64),
            f"l{i}.down": (64, 128),
            f"l{i}.norm": (64,),
        }
    specs, full = _tensors(shapes)
    ranks = [{n: s for n in shapes for s in [_even(shapes[n][0], 2)[r]]} for r in range(2)]
    col = {n for n in shapes if n.endswith((".q", ".up"))}
    row = {n for n in shapes if n.endswith((".o", ".down"))}

    def needs(w: int) -> dict:
        out = {n: _even(shapes[n][0], 2)[w] for n in col}
        out |= {n: _even(shapes[n][1], 2, 1)[w] for n in row}
        return out | {n: None for n in shapes if n.endswith(".norm")}

    workers = [needs(w) for w in range(2)]
    plan, got = _execute(specs, full, ranks, workers)
    _assert_exact(full, workers, got)
    model = sum(t.nbytes for t in full.values())
    assert max(plan.worker_bytes()) <= 0.55 * model


@pytest.mark.parametrize(
    ("ranks", "workers", "words"),
    [
        ([{"w": Slice(0, 0, 3)}, {"w": Slice(0, 4, 4)}], [{"w": None}], "no rank holds [3, 4)"),
        ([{"w": Slice(0, 0, 5)}, {"w": Slice(0, 4, 4)}], [{"w": None}], "overlaps"),
        ([{"w": Slice(0, 0, 4)}, {"w": Slice(1, 0, 2)}], [{"w": None}], "along different dims"),
        ([{"w": Slice(0, 0, 8)}], [{"w": Slice(1, 2, 9)}], "outside the tensor"),
        ([{}], [{"w": None}], "no trainer rank holds it"),
        ([{"w": None}], [{"v": None}], "does not send"),
    ],
)
def test_statements_that_do_not_fit_fail_naming_the_tensor_and_the_fix(ranks, workers, words) -> None:
    specs, _ = _tensors({"w": (8, 4)})
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace(")", r"\)")):
        plan_reshard(specs, ranks, workers)


def test_the_digest_covers_every_move() -> None:
    specs, _ = _tensors({"w": (8, 4)})
    a = plan_reshard(specs, [{"w": s} for s in _even(8, 2)], [{"w": None}])
    b = plan_reshard(specs, [{"w": s} for s in _even(8, 2)], [{"w": Slice(0, 0, 8)}])
    c = plan_reshard(specs, [{"w": s} for s in _even(8, 2)], [{"w": Slice(0, 0, 4)}])
    assert a.digest == b.digest != c.digest
