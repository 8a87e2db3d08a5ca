"""Planner and manifest: exact layouts, alignment, oversize tensors, order independence, digest, JSON."""

from __future__ import annotations

import json

import pytest
import torch

from refit.layout.budget import bucket_capacity
from refit.layout.manifest import Manifest
from refit.layout.planner import forecast, plan
from refit.layout.spec import TensorSpec

BF16, F32, I64 = torch.bfloat16, torch.float32, torch.int64


def _layout(m: Manifest) -> list[tuple[str, int, int]]:
    return [(p.name, p.bucket, p.offset) for p in m.entries]


def test_exact_layout_with_mixed_dtypes_and_alignment() -> None:
    specs = [TensorSpec("a", (10,), F32), TensorSpec("b", (3,), BF16), TensorSpec("c", (90,), F32),
             TensorSpec("d", (1,), I64)]  # fmt: skip
    m = plan(specs, capacity=512, alignment=64)
    assert _layout(m) == [("a", 0, 0), ("b", 0, 64), ("c", 0, 128), ("d", 1, 0)]
    assert m.bucket_nbytes == (512, 64)
    assert m.nbytes == 40 + 6 + 360 + 8


def test_tensor_larger_than_a_bucket_starts_fresh_and_spans() -> None:
    specs = [TensorSpec("a", (4,), F32), TensorSpec("big", (300,), F32), TensorSpec("z", (2,), F32)]
    m = plan(specs, capacity=512, alignment=64)
    assert _layout(m) == [("a", 0, 0), ("big", 1, 0), ("z", 3, 192)]
    assert m.bucket_nbytes == (64, 512, 512, 256)
    segs = [[(s.entry, s.lo, s.hi, s.at) for s in b] for b in m.segments]
    assert segs == [[(0, 0, 16, 0)], [(1, 0, 512, 0)], [(1, 512, 1024, 0)], [(1, 1024, 1200, 0), (2, 0, 8, 192)]]
    assert m.last_bucket == (0, 3, 3)
    assert m.max_split_nbytes == 1200
    assert forecast(m, num_slots=2).receiver_bytes == 2 * 512 + 1200


def test_layout_and_digest_do_not_depend_on_insertion_order() -> None:
    specs = [TensorSpec(f"t{i}", (i + 1, 3), F32) for i in range(20)]
    a, b = plan(specs, capacity=1024), plan(list(reversed(specs)), capacity=1024)
    assert _layout(a) == _layout(b) and a.digest == b.digest


def test_digest_is_stable_and_layout_sensitive() -> None:
    m = plan([TensorSpec("w", (2, 2), BF16), TensorSpec("b", (2,), F32)], capacity=1024)
    assert m.to_json() == (
        b'{"alignment":256,"bucket_nbytes":[512],"capacity":1024,"epoch":0,"format":"refit.manifest/1",'
        b'"tensors":[["b",[2],"float32",0,0,8],["w",[2,2],"bfloat16",0,256,8]]}'
    )
    assert m.digest.hex() == "c643a8ba25ff12be4863cfbd8e00595a"
    assert plan([TensorSpec("w", (2, 2), F32), TensorSpec("b", (2,), F32)], capacity=1024).digest != m.digest
    assert plan([TensorSpec("w", (2, 2), BF16), TensorSpec("b", (2,), F32)], capacity=2048).digest != m.digest


def test_json_round_trip_is_exact() -> None:
    specs = [TensorSpec("x.weight", (3, 5), BF16), TensorSpec("x.bias", (5,), F32), TensorSpec("n", (), I64)]
    m = plan(specs, capacity=256, alignment=32, epoch=4)
    back = Manifest.from_json(m.to_json())
    assert back == m and back.digest == m.digest and back.epoch == 4 and back.to_json() == m.to_json()
    assert json.loads(m.to_json())["tensors"][0] == ["n", [], "int64", 0, 0, 8]


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (lambda o: o.update(format="other"), "not a refit manifest"),
        (lambda o: o["tensors"][0].__setitem__(2, "complex1024"), "unknown wire dtype"),
        (lambda o: o["tensors"][0].__setitem__(5, 999), "shape and dtype give"),
        (lambda o: o["tensors"][0].__setitem__(3, 50), "outside its buckets"),
        (lambda o: o.update(capacity=-1), "'capacity' must be an integer"),
    ],
)
def test_malformed_manifest_is_rejected_with_the_reason(mutate, needle: str) -> None:
    obj = json.loads(plan([TensorSpec("w", (4,), F32)], capacity=256).to_json())
    mutate(obj)
    with pytest.raises(ValueError, match=needle):
        Manifest.from_json(json.dumps(obj).encode())


def test_duplicate_names_and_bad_capacity_are_user_errors() -> None:
    with pytest.raises(ValueError, match="appears twice"):
        plan([TensorSpec("w", (1,), F32), TensorSpec("w", (2,), F32)], capacity=256)
    with pytest.raises(ValueError, match="multiple of the alignment"):
        plan([TensorSpec("w", (1,), F32)], capacity=300)


def test_capacity_from_bytes_or_ratio_of_free_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    assert bucket_capacity(bucket_bytes=1000, ratio=0.2, free=0) == 768
    assert bucket_capacity(bucket_bytes=None, ratio=0.2, free=10 << 20) == (2 << 20) // 2
    from refit.settings import Settings

    monkeypatch.delenv("REFIT_BUFFER_MEMORY_RATIO", raising=False)
    monkeypatch.setenv("NRL_REFIT_BUFFER_MEMORY_RATIO", "0.3")
    assert Settings().ratio == 0.3
    monkeypatch.setenv("REFIT_BUFFER_MEMORY_RATIO", "0.5")
    assert Settings().ratio == 0.5
    monkeypatch.setenv("REFIT_BUFFER_MEMORY_RATIO", "2")
    with pytest.raises(ValueError, match=r"REFIT_BUFFER_MEMORY_RATIO must be a number in \(0, 1\]"):
        Settings()


def test_column_parse_and_row_parse_give_the_same_manifest() -> None:
    """The column-by-column parse (plain rows in planner order) and the row-by-row one (aliases, any other
    valid order of placements) agree, entry for entry, with the sender's manifest."""
    specs = [TensorSpec(f"t{i:03d}", (i % 5, 3), (BF16, F32, I64)[i % 3]) for i in range(200)]
    plain = plan(specs, capacity=1024, alignment=32)
    tied = plan([*specs[:10], TensorSpec("emb", (4, 4), BF16, ("head",))], capacity=1024, alignment=32)
    for m in (plain, tied):
        back = Manifest.from_json(m.to_json())
        assert back == m and back.digest == m.digest and back.specs == [x for p in m.entries for x in p.spec.expanded()]
    obj = json.loads(
        plan([TensorSpec("a", (8,), F32), TensorSpec("b", (8,), F32)], capacity=256, alignment=64).to_json()
    )
    obj["tensors"][0][4], obj["tensors"][1][4] = 64, 0  # valid, but not in planner order: the general checks take it
    back = Manifest.from_json(json.dumps(obj).encode())
    assert [p.offset for p in back.entries] == [64, 0]
    obj["tensors"][0][4] = 0  # now overlapping
    with pytest.raises(ValueError, match="overlap"):
        Manifest.from_json(json.dumps(obj).encode())
