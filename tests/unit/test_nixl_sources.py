"""SOURCES over nixl (zero-copy): the trainer's tensors registered and described, the engine's strict parse of
that description (every field typed, bounded and range-checked), and ranges the trainer's agent did not
register refused before anything is read; a READ lands bitwise in the engine's registered targets."""

from __future__ import annotations

import base64

import pytest
import torch

from refit.tools.doctor import nixl_installed

if not nixl_installed():
    pytest.skip("needs nixl: pip install '.[nixl]'", allow_module_level=True)

from refit import PeerError  # noqa: E402
from refit.transports.nixl_tensors import Exposed, Remote, Sources, Targets  # noqa: E402

SIZES = [64, 128]


def _info(**over: object) -> dict:
    good = {
        "agent": "a",
        "metadata": base64.b64encode(b"m").decode(),
        "mem": "DRAM",
        "tensors": [[4096, 64, 0], [8192, 128, 0]],
    }
    return {**good, **over}


HOSTILE = {
    "not an object": ["tensors"],
    "an extra key": {**_info(), "extra": 1},
    "a missing key": {k: v for k, v in _info().items() if k != "mem"},
    "an empty agent": _info(agent=""),
    "a long agent": _info(agent="a" * 257),
    "an unknown memory type": _info(mem="HBM"),
    "metadata not base64": _info(metadata="@@@"),
    "metadata not a string": _info(metadata=[1]),
    "metadata too large": _info(metadata="A" * (30 << 20)),
    "one tensor too few": _info(tensors=[[4096, 64, 0]]),
    "a range of two fields": _info(tensors=[[4096, 64], [8192, 128, 0]]),
    "a negative address": _info(tensors=[[-1, 64, 0], [8192, 128, 0]]),
    "a boolean length": _info(tensors=[[4096, True, 0], [8192, 128, 0]]),
    "a float address": _info(tensors=[[4096.0, 64, 0], [8192, 128, 0]]),
    "a length other than the entry's": _info(tensors=[[4096, 65, 0], [8192, 128, 0]]),
    "a range past the address space": _info(tensors=[[(1 << 64) - 8, 64, 0], [8192, 128, 0]]),
    "a null address": _info(tensors=[[0, 64, 0], [8192, 128, 0]]),
    "a device out of range": _info(tensors=[[4096, 64, 1 << 20], [8192, 128, 0]]),
}


@pytest.mark.parametrize("why", list(HOSTILE))
def test_a_hostile_sources_description_is_refused_with_peer_error(why: str) -> None:
    with pytest.raises(PeerError, match="SOURCES"):
        Sources.parse(HOSTILE[why], SIZES)


def test_a_well_formed_description_parses_to_its_ranges() -> None:
    got = Sources.parse(_info(), SIZES)
    assert (got.agent, got.metadata, got.mem, got.ranges) == ("a", b"m", "DRAM", [(4096, 64, 0), (8192, 128, 0)])


def test_ranges_the_trainers_agent_did_not_register_are_refused_before_any_read() -> None:
    tensors = [torch.arange(16, dtype=torch.float32), torch.arange(32, dtype=torch.float32)]
    exposed = Exposed(tensors)
    sizes = [t.nbytes for t in tensors]
    info = dict(exposed.info)
    addr, length, dev = info["tensors"][1]
    outside = {**info, "tensors": [info["tensors"][0], [addr + 4096 * 1024, length, dev]]}
    with pytest.raises(PeerError, match="did not register"):
        Remote(Sources.parse(outside, sizes))
    remote = Remote(Sources.parse(info, sizes))
    targets = [torch.zeros(16), torch.zeros(32)]
    kept = Targets(targets)
    remote.read([0, 1], targets, "a test READ").wait(30)
    assert all(torch.equal(a, b) for a, b in zip(tensors, targets))
    del kept


def test_the_trainer_shares_only_contiguous_tensors_of_one_kind_of_memory() -> None:
    with pytest.raises(ValueError, match="contiguous"):
        Exposed([torch.zeros(4, 4).t()])
    assert Exposed([torch.zeros(0), torch.ones(3)]).info["tensors"][0][1] == 0  # empty: described, not registered
