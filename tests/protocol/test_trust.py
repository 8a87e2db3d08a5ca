"""Trust, in real processes: after every refit the engine holds exactly what the trainer holds right now,
whatever the source tensors' layout or identity; aliases go on the wire once; the fingerprint check
catches an engine that holds something else."""

from __future__ import annotations

import pytest
import torch
from sessions import live_fingerprints, session
from torch import nn

from refit import HandshakeError, ModuleSource, RefitError

BF16 = torch.bfloat16


def _specs(live: dict[str, torch.Tensor]) -> list[list]:
    from refit.dtypes import dtype_name

    return [[n, list(t.shape), dtype_name(t.dtype)] for n, t in live.items()]


def _layouts() -> dict[str, torch.Tensor]:
    """One source tensor per layout a trainer produces, none of them a plain contiguous tensor."""
    g = torch.Generator().manual_seed(3)
    fused = torch.randn(12, 8, generator=g)
    return {
        "transposed": torch.randn(6, 10, generator=g).t(),
        "fused.q": fused[:4],  # a storage offset, contiguous
        "fused.k_cols": fused[4:8, 2:6],  # a strided slice of a fused weight
        "expanded": torch.randn(1, 5, generator=g).expand(4, 5),
        "channels_last": torch.randn(2, 3, 4, 4, generator=g).to(memory_format=torch.channels_last),
        "every_other": torch.randn(40, generator=g)[::2],
        "big_transposed": torch.randn(64, 48, generator=g).t(),  # 12 KiB: spans 4 KiB buckets
    }


def _train(live: dict[str, torch.Tensor], step: int) -> None:
    """An optimizer step: new values in place, through whatever view the trainer holds."""
    with torch.no_grad():
        for name, t in live.items():
            if name == "expanded":
                t.as_strided((5,), (1,)).add_(step)  # the one row the expansion repeats
            else:
                t.mul_(1.01).add_(0.5 * step)


@pytest.mark.parametrize("transport", ["shm", pytest.param("gloo", marks=pytest.mark.slow)])
def test_non_contiguous_sources_arrive_current_on_every_refit(transport: str) -> None:
    live = _layouts()
    with session(_specs(live), transport=transport, tensors=live, wire_dtype=BF16) as (sender, _, (peer,)):
        seen = set()
        for version in range(1, 5):
            _train(live, version)
            sender.refit(version)
            report = peer.report()
            assert report["state"] == "current" and report["version"] == version
            assert report["fingerprints"] == live_fingerprints(live, sender.manifest)
            seen.add(report["fingerprints"]["transposed"])
        assert len(seen) == 4  # the values really moved, and every refit carried the new ones


class Router(nn.Module):
    """A DeepSeek-V3-like router: a weight and a correction-bias buffer the trainer replaces."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 16))
        self.register_buffer("e_score_correction_bias", torch.zeros(8))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.gate = Router()
        self.register_buffer("step", torch.zeros(1))


def _replace(model: Block, how: str) -> None:
    with torch.no_grad():
        if how == "buffer-reassigned":
            model.gate.e_score_correction_bias = model.gate.e_score_correction_bias + 1.5
        elif how == "module-to":
            model.gate.to(torch.float64).to(torch.float32)  # replaces the buffer and every param's .data
            model.gate.e_score_correction_bias.add_(2.0)
        elif how == "load-state-dict-assign":
            fresh = {k: v.detach() + 3.0 for k, v in model.state_dict().items()}
            model.load_state_dict(fresh, assign=True)
        elif how == "param-data":
            model.proj.weight.data = model.proj.weight.data.t().contiguous().t()  # same values, new strided storage
            model.proj.weight.add_(1.0)
        elif how == "submodule-rewrapped":
            old = model.gate
            model.gate = Router()
            model.gate.load_state_dict({k: v + 4.0 for k, v in old.state_dict().items()})


@pytest.mark.parametrize(
    "how",
    [
        pytest.param("buffer-reassigned", marks=pytest.mark.slow),
        "module-to",
        pytest.param("load-state-dict-assign", marks=pytest.mark.slow),
        "param-data",
        pytest.param("submodule-rewrapped", marks=pytest.mark.slow),
    ],
)
def test_tensors_replaced_after_the_source_was_built_are_sent_from_the_module(how: str) -> None:
    torch.manual_seed(0)
    model = Block()
    live = model.state_dict(keep_vars=True)
    with session(_specs(live), transport="shm", source=ModuleSource(model)) as (sender, _, (peer,)):
        sender.refit(1)
        assert peer.report()["fingerprints"] == live_fingerprints(model.state_dict(), sender.manifest)
        _replace(model, how)
        stats = sender.refit(2)
        report = peer.report()
        now = model.state_dict()
        assert report["fingerprints"] == live_fingerprints(now, sender.manifest)
        assert report["state"] == "current" and stats.epoch == 1  # same specs: no new handshake needed
        with torch.no_grad():
            model.gate.e_score_correction_bias.add_(1.0)  # in place, on the replaced tensor
        sender.refit(3)
        assert peer.report()["fingerprints"] == live_fingerprints(model.state_dict(), sender.manifest)


def test_a_dtype_change_through_to_starts_a_new_epoch_and_a_shape_change_fails_clearly() -> None:
    torch.manual_seed(0)
    model = Block()
    specs = _specs(model.state_dict())
    specs = [[n, s, "float64" if n.startswith("gate.") else d] for n, s, d in specs]  # the engine holds fp64 there
    with session(specs, transport="shm", source=ModuleSource(model)) as (sender, _, (peer,)):
        assert sender.refit(1).epoch == 1
        peer.report()
        model.gate.to(torch.float64)
        stats = sender.refit(2)
        assert (stats.epoch, stats.handshake) == (2, True)
        assert sender.manifest.entry("gate.weight").spec.dtype == torch.float64
        assert peer.report()["fingerprints"] == live_fingerprints(model.state_dict(), sender.manifest)
        model.proj.weight = nn.Parameter(torch.randn(16, 17))
        with pytest.raises(
            HandshakeError, match=r"proj.weight: engine holds \[16, 16\] float32, sender sends \[16, 17\]"
        ):
            sender.refit(3)
        report = peer.report()
        assert report["type"] == "HandshakeError" and report["version"] == 2 and report["state"] == "current"


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.norm = nn.LayerNorm(16)
        self.lm_head = nn.Linear(16, 64, bias=False)
        self.lm_head.weight = self.embed.weight


def test_tied_weights_go_on_the_wire_once_and_reach_every_alias() -> None:
    torch.manual_seed(0)
    model = Tied()
    live = model.state_dict(keep_vars=True)
    with session(_specs(live), transport="shm", source=ModuleSource(model, wire_dtype=BF16), bucket_bytes=1024) as (
        sender,
        _,
        (peer,),
    ):
        stats = sender.refit(1)
        entry = sender.manifest.entry("lm_head.weight")
        assert entry.name == "embed.weight" and entry.spec.aliases == ("lm_head.weight",)
        unique = sum(t.numel() * 2 for n, t in live.items() if n != "lm_head.weight")
        assert stats.nbytes == unique
        assert peer.report()["fingerprints"] == live_fingerprints(model.state_dict(), sender.manifest)
        model.lm_head.weight = nn.Parameter(model.embed.weight.detach() * 2)  # untied: a new epoch, two entries
        stats = sender.refit(2)
        assert stats.handshake and sender.manifest.entry("lm_head.weight").name == "lm_head.weight"
        assert stats.nbytes == unique + 64 * 16 * 2
        assert peer.report()["fingerprints"] == live_fingerprints(model.state_dict(), sender.manifest)


SPECS = [["a", [32, 32], "float32"], ["b", [40], "float32"], ["c", [64, 40], "float32"]]


def test_fingerprint_check_passes_on_good_refits_and_names_a_tensor_the_engine_got_wrong() -> None:
    fault = {"kind": "corrupt", "version": 2, "name": "b"}
    with session(SPECS, transport="shm", verify="fingerprint", peer_args={"fault": fault}) as (sender, live, (peer,)):
        assert sender.refit(1).unverified == 0
        assert peer.report()["fingerprints"] == live_fingerprints(live, sender.manifest)
        with pytest.raises(RefitError, match=r"fingerprint check failed: .* 1 tensor\(s\): b$"):
            sender.refit(2)
        report = peer.report()
        assert report["state"] == "failed" and report["version"] == 1 and "b" in report["message"]
        sender.refit(2)  # the fault fired once; a retry of the same version restores the engine
        report = peer.report()
        assert report["state"] == "current" and report["fingerprints"] == live_fingerprints(live, sender.manifest)


def test_fingerprint_check_compares_a_tensor_parallel_shard_with_its_region_of_the_live_tensor() -> None:
    shard = {"name": "c", "dim": 1, "start": 10, "stop": 30}
    with session(SPECS, transport="gloo", receivers=2, verify="fingerprint", peer_args={"shard": shard}) as (
        sender,
        live,
        peers,
    ):
        for version in (1, 2):
            with torch.no_grad():
                live["c"].add_(1.0)
            stats = sender.refit(version)
            assert stats.unverified == 0
            expected = live_fingerprints({**live, "c": live["c"][:, 10:30]}, sender.manifest)
            for peer in peers:
                report = peer.report()
                assert report["state"] == "current" and report["fingerprints"] == expected
        assert sender._offers.regions[1] == {"c": (1, 10, 30)}


def _change(live: dict[str, torch.Tensor], how: str) -> None:
    """One way a trainer's tensor can change between refits, each with the same name and spec."""
    t = live["w"]
    with torch.no_grad():
        if how == "values":
            t.add_(1.0)
        elif how == "identity":  # same layout, a new tensor object and storage
            live["w"] = t.detach().clone() + 2.0
        elif how == "storage":  # the same object, set to new memory
            t.set_(torch.randn(t.shape))
        elif how == "offset":  # the same object, at an offset into a larger storage
            base = torch.randn(t.numel() + 7)
            t.set_(base.untyped_storage(), 7, t.shape, t.stride())
        elif how == "layout":  # same shape, transposed strides, new storage
            t.data = t.data.t().contiguous().t() + 3.0
        elif how == "restride-in-place":  # same storage and address, other strides: other values per index
            t.as_strided_(t.shape, (1, t.shape[0]))
        elif how == "dtype":  # a float64 master copy; the wire dtype (bf16) stays
            t.data = t.data.double() * 1.5
        elif how == "neg-view":  # the same memory and layout, read negated (a lazy view)
            live["w"] = t._neg_view()


# Unverified (no longer the default) in the full tier only: the fast tier keeps the default.
@pytest.mark.parametrize("verify", [pytest.param(None, marks=pytest.mark.slow), "fingerprint"])
# The fast tier keeps four kinds of change (a process start each); the full tier runs all eight.
@pytest.mark.parametrize(
    "how",
    [
        "values",
        "identity",
        "storage",
        pytest.param("offset", marks=pytest.mark.slow),
        pytest.param("layout", marks=pytest.mark.slow),
        "restride-in-place",
        pytest.param("dtype", marks=pytest.mark.slow),
        pytest.param("neg-view", marks=pytest.mark.slow),
    ],
)
def test_cached_plans_and_signatures_are_dropped_by_every_kind_of_change(how: str, verify: str | None) -> None:
    """Packing replays a cached plan while the source's layout guard holds: every change the guard must
    see, on a tensor among thousands (so the batched checks are the ones at work), reaches the engine.
    With the fingerprint check, the digest plan kept for the epoch digests the live tensors and agrees."""
    g = torch.Generator().manual_seed(5)
    live = {"w": torch.randn(8, 8, generator=g), **{f"x{i:04d}": torch.randn(4, generator=g) for i in range(2000)}}
    with session(_specs(live), transport="shm", bucket_bytes=1 << 16, tensors=live, wire_dtype=BF16, verify=verify) as (
        sender,
        _,
        (peer,),
    ):
        for version in range(1, 5):
            if version == 3:
                _change(live, how)
            else:
                with torch.no_grad():
                    live["x0007"].add_(1.0)
                    live["w"].add_(0.25)
            stats = sender.refit(version)
            assert stats.epoch == 1  # specs never changed: the cache, not a new handshake, carried it
            assert peer.report()["fingerprints"] == live_fingerprints(live, sender.manifest), version
