"""Across a rate-limited veth (tests/helpers/link.py): the delta stage sees the link's real cost with small
buckets, whose sends a socket buffer hides, and so sends a sparse step as a delta where the link is slow."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from link import A_ADDR, B_ADDR, Link, can_make_links, env, first_json, refits
from locations import helper
from peer import MARK

pytestmark = pytest.mark.slow

SPECS = [[f"layer.{i}.weight", [256, 256], "float32"] for i in range(8)]
"""1 MiB in bf16 on the wire: 8 buckets of 128 KiB, each far below a socket buffer."""
BUCKET = 128 << 10
STEPS = 5


@pytest.fixture
def slow_link() -> Iterator[Link]:
    why = can_make_links()
    if why:
        pytest.skip(why)
    with Link(rate="10mbit") as made:  # 105 ms a bucket: well above a delta's own work on a loaded machine
        yield made


def test_on_a_slow_link_small_buckets_go_as_deltas_by_the_costs_measured(slow_link: Link) -> None:
    """The costs are measured, not pinned: after the full first refit and the first delta refit (which times the
    scan), the later refits of a sparse step go as deltas, landing bitwise."""
    args = {"specs": SPECS, "transport": "gloo", "bucket_bytes": BUCKET, "steps": STEPS, "delta": True}
    sender = slow_link.popen("a", [helper("fleet_sender.py"), json.dumps(args)], env(REFIT_HOST=A_ADDR))
    try:
        info = first_json(sender, "@@sender ")
        engine = {"rendezvous": info, "specs": SPECS, "bucket_bytes": BUCKET}
        worker = slow_link.popen("b", [helper("peer.py"), json.dumps(engine)], env(REFIT_HOST=B_ADDR))
        went = [sent["buckets"] for sent in refits(sender, worker, STEPS, MARK)]
        assert worker.wait(timeout=120) == 0
    finally:
        assert sender.wait(timeout=120) == 0
    for version, buckets in enumerate(went[2:], start=3):
        assert buckets.get("delta", 0) >= 6, f"refit {version} went {buckets}: the link's cost was not seen"


def test_one_site_of_four_behind_one_veth_takes_the_model_across_it_once_per_refit() -> None:
    """Four replicas behind one veth, stating one site: the trainer's side sends each bucket across it once (its
    relay passes it on inside the site), where gloo's broadcast sent it about three times; each replica bitwise."""
    why = can_make_links()
    if why:
        pytest.skip(why)
    steps, replicas = 2, 4
    args = {"specs": SPECS, "transport": "relay", "bucket_bytes": BUCKET, "steps": steps, "receivers": replicas}
    with Link(rate="1gbit") as link:
        sender = link.popen("a", [helper("fleet_sender.py"), json.dumps(args)], env(REFIT_HOST=A_ADDR))
        workers = []
        try:
            info = first_json(sender, "@@sender ")
            before = link.bytes_a_to_b()
            engine = json.dumps({"rendezvous": info, "specs": SPECS, "bucket_bytes": BUCKET})
            for _ in range(replicas):
                site = env(REFIT_HOST=B_ADDR, REFIT_SITE="rack-1")
                workers.append(link.popen("b", [helper("peer.py"), engine], site))
            sent = refits(sender, workers[0], steps, MARK)
            for w in workers[1:]:
                for version in range(1, steps + 1):
                    got = first_json(w, MARK)
                    assert got["version"] == version and got["fingerprints"] == sent[version - 1]["fingerprints"]
            crossed = link.bytes_a_to_b() - before
        finally:
            assert sender.wait(timeout=120) == 0
            assert [w.wait(timeout=120) for w in workers] == [0] * len(workers)
    moved = sum(r["wire_bytes"] for r in sent)
    assert crossed >= moved, f"the veth carried {crossed} bytes, fewer than the {moved} refit reports"
    assert crossed <= 1.05 * moved + (1 << 20), f"the veth carried {crossed} bytes for {moved} sent once per site"
