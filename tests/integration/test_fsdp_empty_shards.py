"""FSDP2 ranks whose local shards are empty (a 1-row weight on 2 ranks) list the same specs as the others:
aliases come from the tensors themselves, never from an empty shard's null address."""

from __future__ import annotations

import json

import pytest
from trainer_ranks import start


@pytest.mark.slow
def test_ranks_with_empty_local_shards_list_every_tensor_and_the_same_specs(tmp_path) -> None:
    ranks = start({"specs_to": str(tmp_path), "model": "tiny"})
    assert [p.wait(timeout=600) for p in ranks] == [0, 0]
    specs = [json.loads((tmp_path / f"specs-{r}.json").read_text()) for r in (0, 1)]
    assert specs[0] == specs[1], "the ranks would build different gather schedules"
    assert [(name, aliases) for name, _, _, aliases in specs[1]] == [
        ("0.bias", []),
        ("0.weight", ["2.weight"]),  # the tie stays an alias on every rank
        ("1.bias", []),
        ("1.weight", []),
        ("2.bias", []),
    ]
