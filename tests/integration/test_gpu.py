"""GPU transports on a real transformers model: cuda-ipc (colocated) and nccl (two GPUs), bitwise."""

from __future__ import annotations

import pytest
import torch
from sessions import sent_fingerprints, session

from refit.dtypes import dtype_name

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
needs_two = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


def _model() -> dict[str, torch.Tensor]:
    from refit.tools.demo.model import build_model, model_config

    model = build_model(model_config(layers=4, hidden=512, ffn=1536), seed=0).cuda()
    return dict(model.state_dict(keep_vars=True))


def _specs(tensors: dict[str, torch.Tensor]) -> list[list]:
    """The engine side holds fp32, so bf16 on the wire is held exactly."""
    return [[n, list(t.shape), dtype_name(torch.float32)] for n, t in tensors.items()]


def _refits(transport: str, peer_devices: list[str], bucket_bytes: int = 8 << 20) -> list[dict]:
    tensors = _model()
    reports = []
    with session(_specs(tensors), transport=transport, tensors=tensors, device="cuda:0",
                 wire_dtype=torch.bfloat16, bucket_bytes=bucket_bytes, receivers=len(peer_devices),
                 peer_devices=peer_devices) as (sender, _, peers):  # fmt: skip
        for version in range(1, 4):
            with torch.no_grad():
                for t in tensors.values():
                    t.mul_(1.001)
            if version == 3:
                sender.source.set_wire_dtype("model.norm.weight", torch.float32)
            stats = sender.refit(version)
            torch.cuda.synchronize()
            expected = sent_fingerprints(sender)
            for peer in peers:
                r = peer.report()
                assert r["event"] == "refit", r
                assert r["fingerprints"] == expected
                assert (r["state"], r["version"]) == ("current", version)
                reports.append({**r, "epoch": stats.epoch, "buckets": stats.num_buckets,
                                "events": getattr(sender.transport, "packed", None) is not None})  # fmt: skip
    return reports


@needs_cuda
def test_cuda_ipc_colocated_refit_is_bitwise_and_opens_handles_once() -> None:
    reports = _refits("cuda-ipc", ["cuda:0"])
    assert [r["epoch"] for r in reports] == [1, 1, 2]
    assert all(r["handles_opened"] == 2 for r in reports)  # two slots, opened at setup only
    assert reports[0]["buckets"] > 2


@needs_two
def test_cuda_ipc_receiver_on_another_gpu_uses_peer_access() -> None:
    reports = _refits("cuda-ipc", ["cuda:1"])
    assert all(r["handles_opened"] == 2 for r in reports)


@needs_two
def test_nccl_two_gpu_refit_is_bitwise_with_dtype_change() -> None:
    reports = _refits("nccl", ["cuda:1"])
    assert [r["epoch"] for r in reports] == [1, 1, 2]


@needs_cuda
def test_zero_copy_reads_the_trainer_tensors_and_re_exports_when_storage_moves() -> None:
    tensors = {n: t.detach().to(torch.bfloat16) for n, t in _model().items()}
    specs = _specs(tensors)
    with session(specs, transport="cuda-ipc", tensors=tensors, device="cuda:0", peer_devices=["cuda:0"],
                 zero_copy=True) as (sender, _, (peer,)):  # fmt: skip
        epochs, opened = [], []
        for version in range(1, 4):
            for t in tensors.values():
                t.mul_(1.01)
            if version == 3:  # new storage for one tensor: its handle must be exported again
                tensors["model.norm.weight"] = tensors["model.norm.weight"].clone()
                sender.source = type(sender.source)(tensors)
            stats = sender.refit(version)
            r = peer.report()
            assert r["event"] == "refit" and r["fingerprints"] == sent_fingerprints(sender)
            epochs.append(stats.epoch)
            opened.append(r["handles_opened"])
            assert stats.num_buckets > 1 and "pack" not in stats.seconds
    assert epochs == [1, 1, 2]
    assert opened[0] == opened[1] > 2 and opened[2] > opened[1]


@needs_cuda
@pytest.mark.parametrize("events", ["1", "0"])
def test_cuda_ipc_many_small_buckets_through_two_slots_are_bitwise(
    events: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Slots reused many times a refit, ordered by interprocess events (no host sync per bucket) or by syncs."""
    monkeypatch.setenv("REFIT_CUDA_IPC_EVENTS", events)
    reports = _refits("cuda-ipc", ["cuda:0", "cuda:0"], bucket_bytes=1 << 20)
    assert all(r["buckets"] > 10 for r in reports)
    assert all(r["events"] == (events == "1") for r in reports)


@needs_cuda
def test_cuda_ipc_falls_back_to_pinned_host_memory_with_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REFIT_CUDA_IPC", "0")  # stands in for a container without IPC rights
    with pytest.warns(RuntimeWarning, match=r"cuda-ipc cannot be used \(REFIT_CUDA_IPC=0\); staging through pinned"):
        reports = _refits("cuda-ipc", ["cuda:0"])
    assert all(r["handles_opened"] == 0 for r in reports)


# -- per-rank colocated: each trainer rank feeds the engine worker on its own GPU ------------------


@needs_two
@pytest.mark.parametrize("visible", ["shared", "per_process"])
def test_per_rank_fsdp2_nccl_refit_feeds_the_worker_on_each_gpu_bitwise(visible: str) -> None:
    """2 FSDP2 ranks (NCCL) and 2 engine workers, one per GPU, over cuda-ipc, with a dtype change.
    per_process: each trainer rank sees only its GPU and each worker sees both in reverse order, so
    device indices differ across processes and only the UUIDs match."""
    from test_topology import check_refits, per_rank

    args = {"model": "fsdp", "transport": "cuda-ipc", "steps": 3, "device": "cuda", "device_index": [0, 1]}
    kwargs: dict = {"worker_devices": ["cuda:0", "cuda:1"]}
    if visible == "per_process":
        args.update(device_index=[0, 0], envs=[{"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "1"}])
        kwargs = {"worker_devices": ["cuda:1", "cuda:0"], "worker_env": [{"CUDA_VISIBLE_DEVICES": "1,0"}] * 2}
    with per_rank(args, **kwargs) as (ranks, workers, infos):
        assert len({i["device_uuid"] for i in infos}) == 2
        sent = check_refits(ranks, workers, 3, fsdp=True)
        assert sent["stats"]["epoch"] == 2


@needs_cuda
def test_m_to_n_cuda_ipc_pairs_on_one_gpu_two_ranks_into_two_workers_bitwise() -> None:
    """M:N over cuda-ipc: two trainer processes' slices on one GPU, two workers on the same GPU, each pair
    its own cuda-ipc session; every worker bitwise against what the ranks hold, with the fingerprint."""
    from test_mesh import run_sliced_ranks

    sent = run_sliced_ranks("cuda-ipc", "cuda")
    assert max(sent[0]["planned"]) < 0.55 * sent[0]["stats"]["model_bytes"]


# -- the fingerprint's kernels: the digest and the fused copy and digest, bitwise against the CPU digest ------


def _odd_tensors(device: str) -> list[torch.Tensor]:
    """Many small tensors, odd sizes, partial last words, views at odd and non-word offsets, several chunks
    (the same values on every device; tensors 600 to 602 views of one run of words)."""
    from refit.checks.tensor_digest import CHUNK_WORDS

    g = torch.Generator().manual_seed(21)
    words = torch.randint(-(2**62), 2**62, (2 * CHUNK_WORDS + 9001,), generator=g).to(device)
    sizes = torch.randint(1, 700, (600,), generator=g).tolist()
    small = [torch.randn(n, generator=g).to(torch.bfloat16).to(device) for n in sizes]
    return [
        *small,  # many small ones, most with a partial last word
        words,  # whole tiles in several chunks and a masked tail
        words[1:],  # a run at an odd word: its first word peeled
        words[3 : CHUNK_WORDS + 4],
        torch.randn(4001, generator=g).to(torch.bfloat16).to(device)[3:2003],  # 6 bytes into its storage
        torch.randn(37, 5, generator=g).to(device).t(),  # not contiguous
        torch.zeros(0, device=device),
        torch.tensor(3.0, device=device),
    ]


@needs_cuda
def test_cuda_digest_kernel_equals_the_cpu_digest_on_many_small_odd_and_offset_tensors() -> None:
    from refit.checks.tensor_digest import digests

    expected = digests(_odd_tensors("cpu"))
    on_gpu = _odd_tensors("cuda")
    assert torch.equal(digests(on_gpu).cpu(), expected)
    assert torch.equal(digests(on_gpu).cpu(), expected)  # the cached chunk table gives the same
    on_gpu[600].view(torch.int64)[1000] ^= 1 << 40  # a flipped bit in the big run, seen through its views
    again = digests(on_gpu).cpu()
    changed = [i for i in range(len(on_gpu)) if again[i] != expected[i]]
    assert changed == [600, 601, 602]


@needs_cuda
def test_cuda_fused_copy_digest_equals_a_copy_and_the_digest_of_the_copy() -> None:
    from refit.checks.copy_digest_cuda import copy_digest_cuda
    from refit.checks.tensor_digest import digests

    srcs = _odd_tensors("cuda")
    whole = sum(t.nbytes // 8 + 2 for t in srcs)
    pool = torch.zeros(whole, dtype=torch.int64, device="cuda")
    dsts, at = [], 1  # int64 destinations at odd and even words of one buffer (some of another parity)
    for s in srcs:
        if s.dtype == torch.int64:
            dsts.append(pool[at : at + s.numel()])
            at += s.numel() + (1 if len(dsts) % 2 else 2)
        else:
            dsts.append(torch.full(s.shape, float("nan"), dtype=s.dtype, device="cuda"))
    sums = copy_digest_cuda(dsts, srcs)
    assert all(
        torch.equal(d.reshape(-1).view(torch.uint8), s.reshape(-1).view(torch.uint8)) for d, s in zip(dsts, srcs)
    )
    assert torch.equal(sums, digests(dsts))
    assert torch.equal(sums.cpu(), digests([s.cpu() for s in srcs]))
    srcs[600].mul_(3)  # new values at the same addresses: the cached plan copies and digests them
    sums = copy_digest_cuda(dsts, srcs)
    assert torch.equal(dsts[600], srcs[600]) and torch.equal(sums, digests(dsts))
