"""Fused copy and digest: every pair is copied bit for bit and its digest equals the word-by-word reference
of the destination's bytes, on the compiled CPU kernel and on the PyTorch fallback (forced by
REFIT_CPU_KERNEL=0, and taken after a failed build)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

from refit.checks import copy_digest as fused
from refit.checks.copy_digest import FusedCopy, copy_digest
from refit.checks.tensor_digest import ROW_WORDS, digests
from tests.unit.test_digest import _reference_value

MASK = (1 << 64) - 1


def _pairs() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    srcs = [
        torch.randn(64, 48, generator=g),
        torch.randn(3, generator=g).to(torch.bfloat16),  # 6 bytes: a partial word
        torch.randn(ROW_WORDS * 2 + 37, generator=g, dtype=torch.float64),
        torch.zeros(0),
        torch.randn(7001, generator=g).to(torch.bfloat16)[1:],  # unaligned source
        torch.randn(5, 7, generator=g),
        torch.randint(-(2**62), 2**62, (41,), generator=g),  # sums that wrap
        torch.randn(9, generator=g),
        torch.randn(4, 6, generator=g).to(torch.float16),
    ]
    dsts = [torch.empty_like(s) for s in srcs]
    dsts[4] = torch.empty(7001, dtype=torch.bfloat16)[1:]  # unaligned destination
    dsts[5] = torch.empty(7, 5).t()  # strided destination: digested in its own logical order
    dsts[7] = torch.empty(18)[::2]  # a strided view of a larger storage
    return dsts, srcs


def _check(dsts: list[torch.Tensor], srcs: list[torch.Tensor], got: torch.Tensor) -> None:
    assert got.dtype == torch.int64 and got.device.type == "cpu"
    for d, s in zip(dsts, srcs):
        assert torch.equal(d.contiguous().view(-1).view(torch.uint8), s.contiguous().view(-1).view(torch.uint8))
    want = [_reference_value(d) for d in dsts]
    assert [v & MASK for v in got.tolist()] == want
    assert torch.equal(got, digests(dsts).cpu())


def test_the_kernel_copies_and_digests_every_pair_as_the_definition_says() -> None:
    assert fused.kernel_built(), "the CPU kernel did not build on this machine (see the WARNING)"
    dsts, srcs = _pairs()
    _check(dsts, srcs, copy_digest(dsts, srcs))


def test_a_replayed_plan_digests_the_sources_current_values() -> None:
    dsts, srcs = _pairs()
    plan = FusedCopy(dsts, srcs)
    first = plan.run()
    srcs[0][5, 5] += 1
    srcs[5][1, 1] += 1  # a pair torch copies (strided destination)
    second = plan.run()
    _check(dsts, srcs, second)
    assert second[0] != first[0] and second[5] != first[5] and torch.equal(second[1:5], first[1:5])


def test_digests_without_a_copy_read_each_tensor_where_it_lies_and_follow_its_values() -> None:
    assert fused.kernel_built(), "the CPU kernel did not build on this machine (see the WARNING)"
    _, srcs = _pairs()  # contiguous, among them an unaligned view, a partial word and an empty tensor
    run = fused.prepared_digests(srcs)
    assert run is not None
    got = run()
    assert [v & MASK for v in got.tolist()] == [_reference_value(s) for s in srcs]
    srcs[2][7] += 1  # a replay reads the current values, no copy kept
    again = run()
    assert torch.equal(again, digests(srcs)) and again[2] != got[2] and torch.equal(again[3:], got[3:])
    assert fused.prepared_digests([torch.empty(7, 5).t()]) is None  # strided: `digests` takes it


def test_the_fallback_forced_by_the_environment_gives_the_same_digests(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REFIT_CPU_KERNEL", "0")
    fused._kernel.cache_clear()
    try:
        assert not fused.kernel_built()
        dsts, srcs = _pairs()
        _check(dsts, srcs, copy_digest(dsts, srcs))
    finally:
        fused._kernel.cache_clear()


def test_a_failed_build_warns_once_and_falls_back(
    monkeypatch: pytest.MonkeyPatch, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    from torch.utils import cpp_extension

    def broken(**_: object) -> None:
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(cpp_extension, "load", broken)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no cached library to load either
    fused._kernel.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="refit"):
            dsts, srcs = _pairs()
            _check(dsts, srcs, copy_digest(dsts, srcs))
            copy_digest(dsts, srcs)
        warnings = [r for r in caplog.records if "did not build" in r.getMessage()]
        assert len(warnings) == 1 and "no compiler here" in warnings[0].getMessage()
    finally:
        fused._kernel.cache_clear()


def test_a_cast_is_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match="cast the source first"):
        copy_digest([torch.empty(4)], [torch.zeros(4, dtype=torch.float64)])
    with pytest.raises(ValueError, match="cast the source first"):  # narrowing is not exact: never fused
        copy_digest([torch.empty(4, dtype=torch.bfloat16)], [torch.zeros(4)])
    with pytest.raises(ValueError, match="as many targets"):
        FusedCopy([torch.empty(4)], [])


def _widening_pairs() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """bfloat16 sources into float32 targets: partial words, one element, a large aligned run (the streaming
    path), an unaligned source, a strided target (copied by torch), an empty pair; and a same-dtype pair."""
    g = torch.Generator().manual_seed(11)
    srcs = [torch.randn(n, generator=g).to(torch.bfloat16) for n in (1, 3, 5, 17, (ROW_WORDS << 2) + 7, 0)]
    srcs.append(torch.randn(7001, generator=g).to(torch.bfloat16)[1:])
    srcs.append(torch.randn(5, 7, generator=g).to(torch.bfloat16))
    srcs.append(torch.randn(9, generator=g))
    dsts = [torch.empty(s.shape) for s in srcs]
    dsts[7] = torch.empty(7, 5).t()
    return dsts, srcs


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "pytorch"])
def test_bfloat16_widened_into_float32_is_exact_and_digested_as_the_bfloat16_it_holds(
    kernel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not kernel:
        monkeypatch.setenv("REFIT_CPU_KERNEL", "0")
    fused._kernel.cache_clear()
    try:
        assert fused.kernel_built() is kernel
        dsts, srcs = _widening_pairs()
        got = copy_digest(dsts, srcs)
        for d, s in zip(dsts, srcs):
            assert torch.equal(d, s.to(d.dtype))
        held = [d.to(s.dtype) for d, s in zip(dsts, srcs)]  # what the targets hold, in the wire dtype
        assert [v & MASK for v in got.tolist()] == [_reference_value(h) for h in held]
        dsts[4][100] = 0.1  # a float32 no bfloat16 has: the same copy again restores it
        srcs[4][7] = -srcs[4][7] - 1
        again = FusedCopy(dsts, srcs).run()
        assert torch.equal(dsts[4], srcs[4].float()) and again[4] != got[4]
        assert torch.equal(again[:4], got[:4]) and torch.equal(again[5:], got[5:])
    finally:
        fused._kernel.cache_clear()


def test_a_large_widening_copy_shared_by_threads_adds_up_to_the_same_digest() -> None:
    g = torch.Generator().manual_seed(12)
    src = torch.randn(fused.PARALLEL_BYTES // 2 + (1 << 20) + 3, generator=g).to(torch.bfloat16)
    dst = torch.empty(src.shape)
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))
    try:
        got = copy_digest([dst], [src])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(dst, src.float()) and torch.equal(got, digests([src]))


def test_a_narrowing_pair_is_still_digested_as_the_bytes_its_target_holds() -> None:
    """The sender packs float32 into a bfloat16 bucket through FusedCopy: its digest is of the bucket's bytes."""
    src = torch.randn(1000)
    dst = torch.empty(1000, dtype=torch.bfloat16)
    got = FusedCopy([dst], [src]).run()
    assert torch.equal(dst, src.to(torch.bfloat16)) and torch.equal(got, digests([dst]))


def test_the_module_engine_digests_only_what_its_copy_proves() -> None:
    from torch import nn

    from refit.engines.module import ModuleEngine

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(6, 4)
            self.head = nn.Linear(4, 6, bias=False)
            self.head.weight = self.embed.weight
            base = torch.zeros(16)
            self.register_buffer("x", base[0:6])  # x and y overlap: a copy into one changes the other
            self.register_buffer("y", base[4:10])
            self.register_buffer("z", base[10:16])  # beside them, overlapping nothing
            self.register_buffer("c", torch.zeros(3, dtype=torch.float64))  # loaded through a cast
            self.register_buffer("w", torch.zeros(5))  # bfloat16 widened into it: exact, proven by its copy

    engine = ModuleEngine(Tied())
    engine.specs()
    g = torch.Generator().manual_seed(5)
    sent = {"embed.weight": torch.randn(6, 4, generator=g), "head.weight": None}
    sent.update({k: torch.randn(6, generator=g) for k in ("x", "y", "z")})
    sent["head.weight"] = sent["embed.weight"]
    sent["c"] = torch.randn(3, generator=g)
    sent["w"] = torch.randn(5, generator=g).to(torch.bfloat16)
    with torch.no_grad():
        names, values = engine.load_digested(list(sent.items()))
    assert names == ["embed.weight", "head.weight", "z", "w"]
    wire = [engine.tensor(n).to(sent[n].dtype) for n in names]  # what the module holds, in the wire dtypes
    assert torch.equal(values, digests(wire))
    assert torch.equal(engine.tensor("z"), sent["z"]) and torch.equal(engine.tensor("c"), sent["c"].double())
    assert torch.equal(engine.tensor("w"), sent["w"].float())


def test_a_loaded_digest_that_differs_fails_the_check_and_the_rest_is_read_back() -> None:
    from refit.engines.module import ModuleEngine
    from refit.layout.planner import plan
    from refit.topology.digest_plan import compare

    held = {"a": torch.randn(4), "b": torch.randn(3)}
    engine = ModuleEngine(held)
    m = plan(engine.specs(), capacity=1 << 20)
    want = [f"{v & MASK:016x}" for v in digests([held["a"], held["b"]]).tolist()]
    read: list[str] = []
    engine.held = lambda name: (read.append(name), ModuleEngine.held(engine, name))[1]  # type: ignore[method-assign]
    a = torch.tensor([m.names.index("a")])
    assert compare(m, engine, want, loaded=[(a, digests([held["a"]]))]) == ([], [])
    assert read == ["b"]  # "a" was proven by its load: never read back
    assert compare(m, engine, want, loaded=[(a, torch.tensor([1]))]) == (["a"], [])
    assert compare(m, engine, want) == ([], [])  # everything read back: the same verdict


def test_a_large_copy_shared_by_threads_adds_up_to_the_same_digest() -> None:
    """Over PARALLEL_BYTES the kernel cuts pairs into 1 MiB pieces taken by several threads; each piece's
    sums are shifted to its word offset, so the digests equal the one-pass `digests` bit for bit."""
    g = torch.Generator().manual_seed(9)
    srcs = [
        torch.randint(0, 256, (fused.PARALLEL_BYTES + (3 << 20) + 5,), generator=g, dtype=torch.uint8),
        torch.randn(1000, generator=g),
    ]
    dsts = [torch.empty_like(s) for s in srcs]
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))
    try:
        got = copy_digest(dsts, srcs)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs))
    assert torch.equal(got, digests(dsts))


def _build_in_a_child(cache: str) -> subprocess.CompletedProcess:
    """A fresh process (nothing cached in memory) that builds or loads the kernel and copies one pair."""
    code = (
        "import torch; from refit.checks import copy_digest as fused\n"
        "d, s = torch.empty(9), torch.arange(9.0)\n"
        "assert fused._kernel() is not None\n"
        "assert torch.equal(fused.copy_digest([d], [s]), fused.digests([s])) and torch.equal(d, s)\n"
    )
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, "XDG_CACHE_HOME": cache})


@pytest.mark.slow  # two builds from scratch in a fresh cache
def test_a_build_killed_midway_leaves_no_lock_that_stalls_the_next_process(tmp_path) -> None:
    # What a process killed inside torch's own build leaves behind: torch's lock file and no finished build.
    assert _build_in_a_child(str(tmp_path)).returncode == 0
    (built,) = list(tmp_path.glob("refit/cpu_kernels/*"))
    (built / "built.ok").unlink()
    (built / "lock").write_text("")
    assert _build_in_a_child(str(tmp_path)).returncode == 0  # rebuilt, not stalled
    assert (built / "built.ok").exists() and not (built / "lock").exists()


def test_a_build_lock_held_past_the_bound_takes_the_pytorch_path_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    import fcntl

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(fused, "BUILD_WAIT_S", 0.2)
    where = fused._cache_dir()  # made, private
    fused._kernel.cache_clear()
    with open(where / "refit.lock", "w") as other:  # another builder, alive, holding the lock
        fcntl.flock(other, fcntl.LOCK_EX)
        try:
            with caplog.at_level(logging.WARNING, logger="refit"):
                assert fused._kernel() is None
            assert "build lock" in caplog.text
            d, s = torch.empty(5), torch.arange(5.0)
            assert torch.equal(fused.copy_digest([d], [s]), fused.digests([s])) and torch.equal(d, s)
        finally:
            fused._kernel.cache_clear()
