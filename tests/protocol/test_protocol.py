"""Protocol over real processes: bitwise refits, handshake failures, dtype changes, version order."""

from __future__ import annotations

import pytest
import torch
from sessions import live_fingerprints, session

from refit import HandshakeError

# Mixed dtypes, an odd-sized tensor and one larger than a 4 KiB bucket.
SPECS = [
    ["embed.weight", [40, 16], "float32"],
    ["layer.0.bias", [7], "float32"],
    ["layer.0.weight", [16, 16], "bfloat16"],
    ["layer.1.weight", [48, 48], "float32"],
    ["steps", [3], "int64"],
]


def _step(tensors: dict[str, torch.Tensor], k: int) -> None:
    for t in tensors.values():
        t.add_(k) if t.dtype == torch.int64 else t.mul_(1.01).add_(0.001 * k)


@pytest.mark.parametrize("receivers", [1, 2])
def test_every_refit_is_bitwise_exact(transport: str, receivers: int) -> None:
    with session(SPECS, transport=transport, receivers=receivers, wire_dtype=torch.bfloat16) as (
        sender,
        tensors,
        peers,
    ):
        for version in range(1, 4):
            _step(tensors, version)
            stats = sender.refit(version)
            expected = live_fingerprints(tensors, sender.manifest)
            for peer in peers:
                report = peer.report()
                assert report["event"] == "refit", report
                assert report["fingerprints"] == expected
                assert (report["state"], report["version"]) == ("current", version)
            assert stats.num_buckets > 2 and stats.handshake == (version == 1)


def test_oversize_tensor_spans_buckets_and_arrives_whole(transport: str) -> None:
    specs = [["big", [5000], "float32"], ["small", [3], "float32"]]  # 20 KB in 4 KiB buckets
    with session(specs, transport=transport) as (sender, tensors, (peer,)):
        stats = sender.refit(1)
        assert stats.num_buckets == 5
        assert peer.report()["fingerprints"] == live_fingerprints(tensors, sender.manifest)


def _control_bytes(num_tensors: int) -> tuple[int, int]:
    per = 64_000 // num_tensors  # 256 KB of float32 in all, either way
    specs = [[f"t{i:04d}", [per], "float32"] for i in range(num_tensors)]
    # verify=None: the fingerprint's VERIFY lists one digest per name, by design; this counts the rest
    with session(specs, transport="shm", bucket_bytes=128 << 10, verify=None) as (sender, tensors, (peer,)):
        sender.refit(1)
        peer.report()
        _step(tensors, 1)
        stats = sender.refit(2)
        peer.report()
        return stats.num_buckets, stats.control_bytes


@pytest.mark.slow
def test_control_traffic_per_refit_does_not_grow_with_tensor_count() -> None:
    few, many = _control_bytes(10), _control_bytes(1000)
    assert few == many == (2, few[1])
    assert few[1] == 64 * (2 + 2 * 2 + 1)  # BEGIN, BUCKET+ACK per bucket, COMMIT, DONE


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (lambda s: s[:-1], "1 unexpected (sender sends, engine lacks): steps"),
        pytest.param(
            lambda s: [*s, ["extra.weight", [2], "float32"]],
            "1 missing (engine expects, sender lacks): extra.weight",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            lambda s: [["embed.weight", [40, 17], "float32"], *s[1:]],
            "embed.weight: engine holds [40, 17] float32",
            marks=pytest.mark.slow,
        ),
        (
            lambda s: [s[0], ["layer.0.bias", [7], "bfloat16"], *s[2:]],
            "layer.0.bias: engine holds [7] bfloat16, sender sends [7] float32",
        ),
    ],
    ids=["engine-lacks", "sender-lacks", "shape", "dtype"],
)
def test_mismatch_fails_handshake_on_both_sides_and_loads_nothing(transport: str, change, needle: str) -> None:
    engine_specs = change(SPECS)
    with session(SPECS, transport=transport, engine_specs=engine_specs) as (sender, _, (peer,)):
        with pytest.raises(HandshakeError) as info:
            sender.refit(1)
        report = peer.report()
    assert needle in str(info.value)
    assert report["event"] == "error" and report["type"] == "HandshakeError"
    assert needle in report["message"]
    assert report["events"] == [] and report["state"] == "empty" and report["version"] is None  # never committed


def test_every_difference_is_listed_sorted_in_one_report() -> None:
    specs = [["b", [2], "float32"], ["d", [2], "float32"], ["a", [2], "float32"], ["c", [2], "float32"]]
    engine = [["b", [3], "float32"], ["z", [2], "float32"], ["y", [2], "float32"]]
    with session(specs, transport="shm", engine_specs=engine) as (sender, _, (peer,)):
        with pytest.raises(
            HandshakeError,
            match=r"2 missing \(engine expects, sender lacks\): y, z; 3 unexpected "
            r"\(sender sends, engine lacks\): a, c, d; 1 mismatched: b: engine holds \[3\]",
        ):
            sender.refit(1)
        assert peer.report()["type"] == "HandshakeError"


def test_dtype_change_starts_a_new_epoch_and_stays_exact(transport: str) -> None:
    with session(SPECS, transport=transport, wire_dtype=torch.bfloat16) as (sender, tensors, (peer,)):
        first = sender.refit(1)
        peer.report()
        sender.source.set_wire_dtype("layer.1.weight", torch.float32)
        _step(tensors, 2)
        second = sender.refit(2)
        report = peer.report()
        third = sender.refit(3)
        peer.report()
    assert (first.epoch, second.epoch, third.epoch) == (1, 2, 2)
    assert second.handshake and not third.handshake
    assert sender.manifest.entry("layer.1.weight").spec.dtype == torch.float32
    assert report["fingerprints"] == live_fingerprints(tensors, sender.manifest)


def test_version_is_committed_only_after_the_last_bucket() -> None:
    with session(SPECS, transport="shm") as (sender, _, (peer,)):
        stats = sender.refit(7)
        events = peer.report()["events"]
    assert events[0] == "begin 7" and events[-1] == "commit 7"
    loads = events[1:-1]
    assert 1 < len(loads) <= stats.num_buckets and all(e.startswith("load ") for e in loads)
    loaded = sorted(n for e in loads for n in e[5:].split(","))
    assert loaded == sorted(s[0] for s in SPECS)


def test_new_storage_without_a_spec_change_keeps_the_epoch_and_stays_exact(transport: str) -> None:
    with session(SPECS, transport=transport) as (sender, tensors, (peer,)):
        sender.refit(1)
        peer.report()
        moved = tensors["layer.1.weight"]
        moved.data = moved.data.clone() + 1  # new storage, same name, shape and dtype
        stats = sender.refit(2)
        report = peer.report()
    assert (stats.epoch, stats.handshake) == (1, False)
    assert report["fingerprints"] == live_fingerprints(tensors, sender.manifest)
