"""The Merkle root over per-tensor fingerprints: one wrong leaf changes it, a path proves a leaf belongs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from refit.checks.root import UNREADABLE, held_leaves, proof, root, roots, verified_root, verify_proof

hexes = st.lists(st.integers(0, (1 << 64) - 1).map(lambda v: f"{v:016x}"), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None)
@given(hexes, st.data())
def test_every_leaf_has_a_path_to_the_root_and_no_other_leaf_does(leaves: list[str], data: st.DataObject) -> None:
    top = root(leaves)
    i = data.draw(st.integers(0, len(leaves) - 1))
    path = proof(leaves, i)
    assert verify_proof(top, leaves[i], i, path, len(leaves))
    other = f"{int(leaves[i], 16) ^ 1:016x}"
    assert not verify_proof(top, other, i, path, len(leaves))
    if len(leaves) > 1:
        j = (i + 1) % len(leaves)
        assert leaves[j] == leaves[i] or not verify_proof(top, leaves[i], j, path, len(leaves))


@settings(max_examples=60, deadline=None)
@given(hexes, st.data())
def test_one_changed_leaf_or_a_swap_changes_the_root(leaves: list[str], data: st.DataObject) -> None:
    i = data.draw(st.integers(0, len(leaves) - 1))
    changed = [*leaves]
    changed[i] = f"{int(leaves[i], 16) ^ (1 << data.draw(st.integers(0, 63))):016x}"
    assert root(changed) != root(leaves)
    if len(leaves) > 1 and leaves[0] != leaves[-1]:
        assert root([leaves[-1], *leaves[1:-1], leaves[0]]) != root(leaves)


def test_a_path_with_a_step_too_many_or_too_few_or_bad_hex_is_refused() -> None:
    leaves = [f"{v:016x}" for v in range(5)]
    top, path = root(leaves), proof(leaves, 2)
    assert verify_proof(top, leaves[2], 2, path, 5)
    assert not verify_proof(top, leaves[2], 2, path[:-1], 5)
    assert not verify_proof(top, leaves[2], 2, [*path, path[0]], 5)
    assert not verify_proof(top, leaves[2], 2, ["zz"], 5)
    assert not verify_proof(top, leaves[2], 7, path, 5)
    with pytest.raises(ValueError, match="outside the 5 leaves"):
        proof(leaves, 5)
    with pytest.raises(ValueError, match="16-hex-digit"):
        root(["abc"])
    assert root([]) == "" and root(leaves[:1])[:16] == leaves[0] and len(root(leaves)) == 32  # a lone leaf: its lanes


def test_an_engine_root_over_held_tensors_equals_the_trainers_digests_root() -> None:
    from refit.checks.tensor_digest import Pending

    tensors = [torch.randn(3, 5), torch.arange(7, dtype=torch.int32), torch.randn(2, dtype=torch.float64)]
    pending = Pending()
    pending.add([t.to(torch.bfloat16) if t.is_floating_point() else t for t in tensors])
    wire = [torch.bfloat16, torch.int32, torch.bfloat16]
    held = held_leaves(["a", "b", "c"], tensors, wire)
    assert held == pending.hexes()
    assert verified_root(["a", "b", "c"], held, []) == root(held)
    assert verified_root(["a", "b", "c"], held, ["b"]) == root(
        held_leaves(["a", "b", "c"], [tensors[0], None, tensors[2]], wire)
    )
    assert held_leaves(["a"], [None], wire[:1]) == [UNREADABLE]
    assert verified_root(["a", "b", "c"], held, [], frozenset({"c*"})) == root([held[0], held[1], UNREADABLE])
    assert roots({0: held, 3: held, 4: held[::-1]}) == {0: root(held), 3: root(held), 4: root(held[::-1])}
