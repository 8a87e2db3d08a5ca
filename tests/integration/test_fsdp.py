"""A 2-rank FSDP2 trainer (gloo, CPU) refits into an engine process, led by rank 0, gathering each tensor once."""

from __future__ import annotations

import pytest
import torch
from fsdp_trainer import build
from peer import Peer
from trainer_ranks import line, start

from refit.checks.fingerprints import fingerprints
from refit.dtypes import dtype_name
from refit.layout import fp8


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_fsdp2_trainer_refits_bitwise_gathering_each_tensor_once_within_budget(transport: str) -> None:
    """Also: a parameter replaced before the second refit (a new DTensor) is read, not the one wrapped first."""
    model = build(0)
    specs = [[n, list(t.shape), dtype_name(torch.float32)] for n, t in sorted(model.state_dict().items())]
    unsharded = fingerprints(model.state_dict().items(), {n: torch.bfloat16 for n, *_ in specs})
    ranks = start({"transport": transport, "bucket_bytes": 16384, "steps": 3, "replace_at": 2})
    rendezvous = line(ranks[0])
    peer = Peer({"rendezvous": rendezvous, "specs": specs, "bucket_bytes": 16384})
    try:
        for version in (1, 2, 3):
            sent, got = line(ranks[0]), peer.report()
            assert got["event"] == "refit" and got["version"] == version
            assert got["fingerprints"] == sent["fingerprints"]
            if version == 1:
                assert got["fingerprints"] == unsharded  # the very model before sharding, in bf16
            assert sent["stats"]["num_buckets"] > 4
            # 0.weight (300x64 fp32) spans several buckets, and is still gathered once per refit
            assert set(sent["gathers"].values()) == {version}, sent["gathers"]
            assert 0 < sent["peak"] <= sent["predicted"] < sent["model_bytes"]
        assert sent["stats"]["epoch"] == 2  # the dtype change at the last step re-handshook
    finally:
        assert [p.wait(timeout=60) for p in ranks] == [0, 0]
        peer.wait()


@pytest.mark.slow
def test_fsdp2_trainer_refits_an_fp8_engine_quantizing_each_gathered_tensor_whole() -> None:
    """The engine holds three weights in block FP8 whose 128-row blocks cross the two ranks' shard boundary
    (rows 150 and 48 of 300 and 96): rank 0 quantizes each tensor once gathered whole, so every block's scale is
    the one the unsharded tensor gives; 0.weight also spans buckets in FP8."""
    model = build(0)
    quantized = ["0.weight", "1.weight", "3.weight"]
    specs: list[list] = []
    for n, t in sorted(model.state_dict().items()):
        if n in quantized:
            specs.append([n, list(t.shape), "float8_e4m3fn"])
            specs.append([fp8.DEFAULT_FORMAT.scale_name(n), list(fp8.scale_shape(t.shape)), "float32"])
        else:
            specs.append([n, list(t.shape), dtype_name(torch.float32)])
    ranks = start({"transport": "shm", "bucket_bytes": 16384, "steps": 3, "fp8": quantized})
    peer = Peer({"rendezvous": line(ranks[0]), "specs": specs, "bucket_bytes": 16384})
    try:
        for version in (1, 2, 3):
            sent, got = line(ranks[0]), peer.report()
            assert got["event"] == "refit" and got["version"] == version, got
            assert got["fingerprints"] == sent["fingerprints"]
            assert {n: sent["fingerprints"][n] for n in quantized} != {}
        assert sent["stats"]["nbytes"] < sum(t.numel() * 2 for t in model.state_dict().values())
    finally:
        assert [p.wait(timeout=60) for p in ranks] == [0, 0]
        peer.wait()
