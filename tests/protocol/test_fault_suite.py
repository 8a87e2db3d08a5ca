"""Faults an engine can make after the bytes arrived, each caught before its version commits: a skipped
post-load step, a scale applied twice, a derived tensor left stale and two experts swapped fail the canary,
which names the module whose output first diverges; a tensor loaded wrong once fails the fingerprint."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from threaded import refit_both, session

from refit import Canary, ModuleEngine, ModuleSource, RefitError, RefitStats, Settings, State, causal_lm
from refit.checks import canary_bisect

SETTINGS = Settings(bucket_bytes=64 << 10, timeout_s=60.0)
PROBE = [1, 17, 250, 3, 999, 42, 7, 512]


pytestmark = pytest.mark.slow


def _lm(seed: int, arch: str = "llama") -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from refit.tools.demo.model import model_config

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(model_config(layers=3, hidden=64, ffn=128, arch=arch)).eval()


def _step(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape) * 0.05)


class SkipsPostLoad(ModuleEngine):
    """(a) Each MLP computes with gate and up fused into one matrix, built at commit; layer 1's is skipped."""

    def __init__(self, model: torch.nn.Module, skip: int = 1) -> None:
        super().__init__(model)
        self.fused: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(model.model.layers):
            self._fuse(i, layer.mlp)
            layer.mlp.forward = self._forward(i, layer.mlp)
        self.skip = skip

    def _fuse(self, i: int, mlp: torch.nn.Module) -> None:
        self.fused[i] = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach().clone()

    def _forward(self, i: int, mlp: torch.nn.Module):  # noqa: ANN202 - a forward
        def forward(x: torch.Tensor) -> torch.Tensor:
            gate, up = (x @ self.fused[i].T).chunk(2, dim=-1)
            return mlp.down_proj(F.silu(gate) * up)

        return forward

    def commit(self, version: int) -> None:
        for i, layer in enumerate(self.module.model.layers):
            if i != self.skip:
                self._fuse(i, layer.mlp)
        super().commit(version)


class ScaleTwice(ModuleEngine):
    """(b) Layer 2's o_proj computes from a quantized copy and its scale (q * s); the commit multiplies by the
    scale once more."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        self.o_proj = model.model.layers[2].self_attn.o_proj
        self.dequant = self.o_proj.weight.detach().clone()
        self.o_proj.forward = lambda x: x @ self.dequant.T

    def commit(self, version: int) -> None:
        w = self.o_proj.weight.detach()
        scale = w.abs().max() / 448.0
        q = w / scale
        self.dequant = q * scale * scale  # the bug: the scale applied again
        super().commit(version)


class StaleDerived(ModuleEngine):
    """(c) Layer 0's attention computes its keys with a transposed copy of k_proj (as MLA's W_UK_T), derived
    once at start and never again."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        k_proj = model.model.layers[0].self_attn.k_proj
        self.k_t = k_proj.weight.detach().T.clone()
        k_proj.forward = lambda x: x @ self.k_t


class SwapsExperts(ModuleEngine):
    """(d) After loading, layer 1's experts 0 and 1 trade places (a permutation applied twice, or never undone)."""

    def commit(self, version: int) -> None:
        experts = self.module.model.layers[1].mlp.experts
        with torch.no_grad():
            for _, p in experts.named_parameters():
                p[[0, 1]] = p[[1, 0]].clone()
        super().commit(version)


def _fails_naming(engine: ModuleEngine, trainer: torch.nn.Module, module: str) -> str:
    with session(ModuleSource(trainer), engine, SETTINGS, canary=Canary(PROBE, causal_lm(trainer))) as (sender, peer):
        _step(trainer)
        stats, got = refit_both(sender, peer, 1)
    assert isinstance(stats, RefitError) and isinstance(got, RefitError), (stats, got)
    assert "canary failed at refit 1" in str(stats), stats
    assert f"first divergence at {module} (max |diff|" in str(stats), stats
    assert engine.weights.state == State.FAILED
    return str(stats)


def test_a_skipped_post_load_step_on_one_layer_is_named_at_that_layers_mlp() -> None:
    message = _fails_naming(SkipsPostLoad(_lm(1)), _lm(0), "model.layers.1.mlp")
    assert "layer 0 agree" in message, message


def test_a_scale_applied_twice_at_commit_is_named_at_that_attention() -> None:
    message = _fails_naming(ScaleTwice(_lm(1)), _lm(0), "model.layers.2.self_attn")
    assert "layers 0-1 agree" in message, message


def test_a_derived_tensor_left_at_the_old_version_is_named_where_it_computes() -> None:
    message = _fails_naming(StaleDerived(_lm(1)), _lm(0), "model.layers.0.self_attn")
    assert "nothing before it agrees" not in message and "model.layers.0.input_layernorm and" in message, message


def test_two_swapped_experts_are_named_at_that_layers_moe() -> None:
    _fails_naming(SwapsExperts(_lm(1, "qwen3_moe")), _lm(0, "qwen3_moe"), "model.layers.1.mlp")


class LoadsWrongOnce(ModuleEngine):
    """(e) The first load of one tensor writes a flipped value (a flaky copy); later loads are right."""

    def __init__(self, model: torch.nn.Module, name: str, *, repair: bool = True) -> None:
        super().__init__(model, repair=repair)
        self.name, self.flipped = name, False

    def load(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        super().load(tensors)
        if not self.flipped and any(n == self.name for n, _ in tensors):
            self.flipped = True
            with torch.no_grad():
                self.tensor(self.name).view(-1)[5] += 1.0


def test_a_tensor_loaded_wrong_once_is_repaired_within_the_refit_which_commits_saying_so() -> None:
    trainer, name = _lm(0), "model.layers.1.post_attention_layernorm.weight"
    engine = LoadsWrongOnce(_lm(1), name)
    with session(ModuleSource(trainer), engine, SETTINGS, canary=Canary(PROBE, causal_lm(trainer))) as (sender, peer):
        _step(trainer)
        stats, got = refit_both(sender, peer, 1)
        assert isinstance(stats, RefitStats) and isinstance(got, RefitStats), (stats, got)
        assert engine.flipped and stats.repaired == got.repaired == [name]
        assert got.repair_bytes == 64 * 4 <= stats.repair_bytes <= 0.01 * stats.nbytes, stats
        assert engine.weights.state == State.CURRENT and engine.root() == (1, stats.root) == (1, got.root)
        assert torch.equal(engine.tensor(name), trainer.get_parameter(name))
        _step(trainer)
        stats, got = refit_both(sender, peer, 2)  # the next refit moves no repair
        assert isinstance(stats, RefitStats) and stats.repaired == [] and stats.repair_bytes == 0, stats


def test_without_repair_a_tensor_loaded_wrong_once_fails_the_version_and_the_retry_commits() -> None:
    trainer, name = _lm(0), "model.layers.1.post_attention_layernorm.weight"
    engine = LoadsWrongOnce(_lm(1), name, repair=False)
    with session(ModuleSource(trainer), engine, SETTINGS) as (sender, peer):
        _step(trainer)
        stats, _ = refit_both(sender, peer, 1)
        assert isinstance(stats, RefitError) and f"for 1 tensor(s): {name}" in str(stats), stats
        assert engine.weights.state == State.FAILED
        stats, _ = refit_both(sender, peer, 1)
        assert isinstance(stats, RefitStats) and stats.repaired == [] and engine.root() == (1, stats.root)


def test_bisection_costs_no_probe_pass_when_the_canary_passes_and_two_when_it_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    passes: list[int] = []
    real = canary_bisect.summaries
    monkeypatch.setattr(canary_bisect, "summaries", lambda model, tokens: passes.append(1) or real(model, tokens))
    trainer, engine = _lm(0), StaleDerived(_lm(1))
    fix = engine.module.model.layers[0].self_attn.k_proj
    with session(ModuleSource(trainer), engine, SETTINGS, canary=Canary(PROBE, causal_lm(trainer))) as (sender, peer):
        _step(trainer)
        stats, _ = refit_both(sender, peer, 1)
        assert isinstance(stats, RefitError) and "first divergence at model.layers.0.self_attn" in str(stats)
        assert len(passes) == 2  # one on the engine, one on the trainer
        engine.k_t = None
        fix.forward = lambda x: F.linear(x, fix.weight)  # the engine fixed: it computes with what it holds
        for version in (1, 2):
            _step(trainer)
            stats, got = refit_both(sender, peer, version)
            assert isinstance(stats, RefitStats) and isinstance(got, RefitStats), (stats, got)
    assert len(passes) == 2
