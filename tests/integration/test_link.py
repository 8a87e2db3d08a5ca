"""Across a real link: the trainer and the engine in two network namespaces joined by a rate-limited veth
(tests/helpers/link.py), so every byte between them crosses the veth; its counters are checked against the
bytes refit reports, and the engine's tensors against the trainer's, bitwise."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator

import pytest
from link import A_ADDR, B_ADDR, Link, can_make_links, env, first_json
from locations import helper
from peer import MARK
from trainer_ranks import line, start

SPECS = [[f"layer.{i}.weight", [256, 256], "float32"] for i in range(8)]
"""1 MiB in bf16 on the wire: 8 buckets of 128 KiB."""
BUCKET = 128 << 10
STEPS = 4

pytestmark = pytest.mark.slow


@pytest.fixture
def link() -> Iterator[Link]:
    why = can_make_links()
    if why:
        pytest.skip(why)
    with Link(rate="1gbit") as made:
        yield made


NET_ONLY = {"UCX_TLS": "tcp"}
"""nixl's UCX kept to TCP: by default it reads through cross-memory attach (cma) or shared memory, which reach
another network namespace of the same kernel without crossing the veth."""


def _nixl_or_skip(transport: str) -> dict[str, str]:
    if transport == "nixl":
        from refit.tools.doctor import nixl_installed

        if not nixl_installed():
            pytest.skip("needs nixl: pip install '.[nixl]'")
        return NET_ONLY
    return {}


@pytest.mark.parametrize("transport", ["gloo", "nixl"])
@pytest.mark.parametrize("delta", [False, True], ids=["full", "delta"])
def test_across_a_rate_limited_link_a_refit_moves_what_it_reports_and_lands_bitwise(
    link: Link, transport: str, delta: bool
) -> None:
    """Every data-plane byte refit reports crosses the veth (its counter grows by at least that much per
    refit, and by little more: headers and the control channel), and a delta refit after a sparse step moves
    far fewer bytes than a full one."""
    net = _nixl_or_skip(transport)
    args = {"specs": SPECS, "transport": transport, "bucket_bytes": BUCKET, "steps": STEPS, "delta": delta,
            "sparse": True}  # fmt: skip
    sender = link.popen("a", [helper("net_sender.py"), json.dumps(args)], env(REFIT_HOST=A_ADDR, **net))
    try:
        info = first_json(sender, "@@sender ")
        assert info["host"] == A_ADDR
        before = link.bytes_a_to_b()
        engine = {"rendezvous": info, "specs": SPECS, "bucket_bytes": BUCKET}
        worker = link.popen("b", [helper("peer.py"), json.dumps(engine)], env(REFIT_HOST="10.232.0.2", **net))
        moved = []
        for version in range(1, STEPS + 1):
            sent, got = first_json(sender, "@@sender "), first_json(worker, MARK)
            assert got["event"] == "refit" and got["version"] == version, got
            assert got["fingerprints"] == sent["fingerprints"], f"refit {version} did not land bitwise"
            moved.append(sent["wire_bytes"])
            assert sent["delta"] == (delta and version > 1)
        crossed = link.bytes_a_to_b() - before
        assert worker.wait(timeout=120) == 0
    finally:
        assert sender.wait(timeout=120) == 0
    full = 256 * 256 * 2 * len(SPECS)
    assert moved[0] == full
    assert crossed >= sum(moved), f"the veth carried {crossed} bytes, fewer than the {sum(moved)} refit reports"
    assert crossed <= 1.2 * sum(moved) + (1 << 20), f"the veth carried {crossed} bytes for {sum(moved)} reported"
    if delta:
        assert all(m < full / 4 for m in moved[1:]), moved


@pytest.mark.parametrize("verify", [False, True], ids=["unverified", "fingerprint"])
def test_zero_copy_over_nixl_across_the_link_reads_every_version_bitwise(link: Link, verify: bool) -> None:
    """Engines READ the trainer's live tensors across the veth. The sender's VERIFY and COMMIT follow BEGIN at
    once, while the READs still cross a slow link: the engine keeps them for after its READ (it once took them
    for a sender that gave up and failed every refit)."""
    net = _nixl_or_skip("nixl")
    specs = [[f"layer.{i}.weight", [1024, 1024], "bfloat16"] for i in range(8)]  # 16 MiB: 134 ms a READ at 1 Gbit/s
    args = {"specs": specs, "transport": "nixl", "bucket_bytes": BUCKET, "steps": STEPS, "zero_copy": True,
            "verify": "fingerprint" if verify else None}  # fmt: skip
    sender = link.popen("a", [helper("net_sender.py"), json.dumps(args)], env(REFIT_HOST=A_ADDR, **net))
    try:
        info = first_json(sender, "@@sender ")
        before = link.bytes_a_to_b()
        engine = {"rendezvous": info, "specs": specs, "bucket_bytes": BUCKET}
        worker = link.popen("b", [helper("peer.py"), json.dumps(engine)], env(REFIT_HOST=B_ADDR, **net))
        for version in range(1, STEPS + 1):
            sent, got = first_json(sender, "@@sender "), first_json(worker, MARK)
            assert got["event"] == "refit" and got["version"] == version, got
            assert got["fingerprints"] == sent["fingerprints"], f"refit {version} did not land bitwise"
        crossed = link.bytes_a_to_b() - before
        assert worker.wait(timeout=120) == 0
    finally:
        assert sender.wait(timeout=120) == 0
    model = 1024 * 1024 * 2 * len(specs)
    assert crossed >= STEPS * model, f"the veth carried {crossed} bytes for {STEPS} READs of {model}"


def test_m_to_n_across_the_link_two_trainer_ranks_into_two_workers_bitwise(link: Link) -> None:
    """FSDP2 on two trainer ranks in the trainer's namespace, two engine workers in the engine's, each
    receiving its slices from the rank that holds them over gloo: every byte crosses the veth, bitwise."""
    args = {"kind": "mlp", "workers": 2, "transport": "gloo", "steps": 3, "verify": "fingerprint"}
    host = {"REFIT_HOST": A_ADDR}
    ranks = start(args, script="mesh_trainer.py", envs=[host, host], within=lambda argv: link.command("a", argv))
    workers: list[subprocess.Popen] = []
    try:
        info = line(ranks[0])
        before = link.bytes_a_to_b()
        for w in range(2):
            job = {"rendezvous": info, "kind": "mlp", "worker": w, "workers": 2, "device": "cpu"}
            workers.append(link.popen("b", [helper("mesh_worker.py"), json.dumps(job)], env(REFIT_HOST=B_ADDR)))
        received = 0
        for version in (1, 2, 3):
            out = line(ranks[0])
            assert "error" not in out, out["error"]
            for w, p in enumerate(workers):
                assert p.stdout is not None
                got = json.loads(p.stdout.readline())
                assert got["version"] == version and got["state"] == "current", got
                assert got["fingerprints"] == out["expected"][w], f"worker {w} differs at version {version}"
                received += got["nbytes"]
        crossed = link.bytes_a_to_b() - before
    finally:
        assert [p.wait(timeout=120) for p in ranks] == [0, 0]
        assert [p.wait(timeout=120) for p in workers] == [0] * len(workers)
    assert crossed >= received > 0, f"the veth carried {crossed} bytes for the {received} the workers received"
