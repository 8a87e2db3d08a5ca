"""LoRA refits: the trainer's PEFT adapter moves alone into one of the engine's adapter slots, over a base the
engine already holds (checked by digest when it joins). A request keeps the version it started on while later
ones commit; the fingerprint covers the adapter; greedy output equals the trainer's own."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

import pytest
import torch
from adapters import adapter_step
from threaded import Peer, refit_both, session
from torch.utils._python_dispatch import TorchDispatchMode

from refit import Commit, Engine, HandshakeError, ModuleSource, PeerError, RefitError, Sender, Settings, State
from refit.stages.lora import (
    AdapterTensors,
    LoraEngine,
    LoraSource,
    base_digest,
    base_engine,
    base_source,
    parse,
)
from refit.topology.stats import RefitStats

peft = pytest.importorskip("peft")
pytest.importorskip("transformers")
from refit.tools.demo.model import build_model, greedy, model_config  # noqa: E402 - after the skips

SETTINGS = Settings(bucket_bytes=16 << 10, timeout_s=60.0)
CONFIG = model_config(layers=2, hidden=128, ffn=256)
PROMPTS = [[3, 4, 5, 6], [9, 8, 7]]


def _lora(**overrides: object) -> object:
    fields: dict = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"], "lora_dropout": 0.0}
    return peft.LoraConfig(**{**fields, **overrides})


def _peft(seed: int = 1, **overrides: object) -> torch.nn.Module:
    return peft.get_peft_model(build_model(CONFIG, seed=seed), _lora(**overrides)).eval()


def _adapter(model: torch.nn.Module, adapter: str = "default") -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in AdapterTensors(model, adapter).items()}


def _generate(model: torch.nn.Module, adapter: str) -> list[list[int]]:
    out = []
    with torch.no_grad():
        for ids in PROMPTS:
            x = torch.tensor([ids])
            y = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=10,
                do_sample=False,
                pad_token_id=1,
                eos_token_id=None,
                adapter_names=[adapter],
            )
            out.append(y[0, len(ids) :].tolist())
    return out


@contextlib.contextmanager
def _session(trainer: torch.nn.Module, engine: Engine, **options: object) -> Iterator[tuple[Sender, Peer]]:
    source = options.pop("source", None) or LoraSource(trainer)
    with session(source, engine, SETTINGS, **options) as pair:  # type: ignore[arg-type]
        yield pair


def _refit(sender: Sender, peer: Peer, version: int) -> None:
    stats, got = refit_both(sender, peer, version)
    assert isinstance(stats, RefitStats) and isinstance(got, RefitStats), (stats, got)


def _first(trainer: torch.nn.Module, sender: Sender, peer: Peer) -> list[list[int]]:
    """Version 1 trained and refit; the trainer's greedy output with it."""
    adapter_step(trainer, 1)
    _refit(sender, peer, 1)
    return greedy(trainer, PROMPTS, new_tokens=10)


@pytest.mark.parametrize("verify", ["fingerprint", None, "strict"])
def test_only_the_adapter_moves_and_each_version_lands_bitwise_in_a_free_slot(verify: str | None) -> None:
    trainer, model = _peft(), _peft()
    engine = LoraEngine(model)
    slots = []
    with _session(trainer, engine, verify=verify) as (sender, peer):
        for version in (1, 2, 3):
            adapter_step(trainer, version)
            _refit(sender, peer, version)
            with engine.adapter() as name:
                held = _adapter(model, name)
            slots.append(name)
            assert held.keys() == _adapter(trainer).keys()
            assert all(torch.equal(held[n], t) for n, t in _adapter(trainer).items()), f"version {version}"
            assert engine.live == {version: 0}
        assert sender.manifest is not None and sender.manifest.stages == ("lora",)
        names = [p.spec.name for p in sender.manifest.entries]
        assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
        assert not any(".default." in n for n in names)  # PEFT's saved names: no adapter name on the wire
        full = sum(p.numel() * p.element_size() for p in trainer.parameters())
        assert sender.manifest.nbytes < full / 20
    assert slots == ["default", "refit1", "default"]  # each refit wrote the slot new requests were not getting


def test_the_engines_greedy_output_equals_the_trainers_with_the_same_adapter() -> None:
    trainer, model = _peft(), _peft()
    engine = LoraEngine(model)
    base = _generate(trainer, "__base__")
    with _session(trainer, engine) as (sender, peer):
        for version in (1, 2):
            adapter_step(trainer, version)
            _refit(sender, peer, version)
            want = greedy(trainer, PROMPTS, new_tokens=10)
            with engine.adapter() as name:
                assert _generate(model, name) == want
    assert want != base  # the adapter changes what the model says: the comparison could have failed


def test_a_request_started_on_version_v_finishes_on_v_after_v_plus_1_commits() -> None:
    trainer, model = _peft(), _peft()
    engine = LoraEngine(model)
    with _session(trainer, engine) as (sender, peer):
        on_v1 = _first(trainer, sender, peer)
        with engine.adapter() as v1:
            adapter_step(trainer, 2)
            _refit(sender, peer, 2)
            assert engine.live == {1: 1, 2: 0}
            assert _generate(model, v1) == on_v1  # the request's version, untouched by refit 2
            with engine.adapter() as v2:
                assert v2 != v1
                assert _generate(model, v2) == greedy(trainer, PROMPTS, new_tokens=10) != on_v1
        assert engine.live == {2: 0}  # version 1 retired with its last request


def test_a_refit_finding_every_other_slot_in_use_is_refused_loads_nothing_and_leaves_the_engine_current() -> None:
    trainer, model = _peft(), _peft()
    engine = LoraEngine(model, keep=2)
    with _session(trainer, engine) as (sender, peer):
        adapter_step(trainer, 1)
        _refit(sender, peer, 1)
        with engine.adapter() as v1:
            before = _adapter(model, v1)
            adapter_step(trainer, 2)
            _refit(sender, peer, 2)  # into the second slot
            on_v2 = _adapter(trainer)
            adapter_step(trainer, 3)
            stats, got = refit_both(sender, peer, 3)  # slot 1 holds the pinned version 1, slot 2 the current
            message = str(stats)
            assert isinstance(stats, RefitError) and "all 2 adapter slots are in use by requests" in message
            assert "failed to state" not in message
            assert isinstance(got, RefitError)
            assert all(torch.equal(_adapter(model, v1)[n], t) for n, t in before.items())
            assert engine.live == {1: 1, 2: 0}
            _serves(engine, model, on_v2, 2)  # current at its last version, not 'failed'
            engine.ensure_current()
        _refit(sender, peer, 3)  # the request ended: its slot is free again
        assert engine.live == {3: 0}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def _claims(engine: LoraEngine) -> list[int]:
    return sorted(s.version for s in engine.slots if s.version is not None)


def _serves(engine: LoraEngine, model: torch.nn.Module, want: dict[str, torch.Tensor], version: int) -> None:
    """The invariant: an engine that reads current at `version` serves exactly `want` (the trainer's adapter at the
    last committed refit), and no two slots claim one version."""
    assert engine.weights.state == State.CURRENT and engine.weights.version == version, engine.weights
    with engine.adapter() as name:
        assert _same(_adapter(model, name), want)
    claims = _claims(engine)
    assert len(claims) == len(set(claims)), [(s.name, s.version) for s in engine.slots]


@pytest.mark.parametrize("versions", [(1, 1), (1, 1, 1), (3, 1, 2), (2, 2, 1, 1)], ids=str)
def test_repeated_and_out_of_order_versions_serve_the_last_committed_adapter(versions: tuple[int, ...]) -> None:
    trainer, model = _peft(), _peft()
    engine = LoraEngine(model, keep=3)
    with _session(trainer, engine) as (sender, peer):
        for step, version in enumerate(versions, 1):
            adapter_step(trainer, step)
            _refit(sender, peer, version)
            _serves(engine, model, _adapter(trainer), version)
            assert engine.live == {version: 0}


def test_a_repeated_version_leaves_a_request_pinned_on_the_old_bytes_and_new_requests_get_the_new() -> None:
    trainer, model = _peft(), _peft()
    engine = LoraEngine(model, keep=3)
    with _session(trainer, engine) as (sender, peer):
        _first(trainer, sender, peer)
        first = _adapter(trainer)
        with engine.adapter() as pinned:
            adapter_step(trainer, 2)
            _refit(sender, peer, 1)  # the same version again, with other bytes
            assert _same(_adapter(model, pinned), first)
            _serves(engine, model, _adapter(trainer), 1)
        _serves(engine, model, _adapter(trainer), 1)


def _vetoed(own: str) -> str:
    return own or "another trainer rank failed"


@pytest.mark.parametrize("again", [1, 2], ids=["same-version", "next-version"])
def test_a_failed_verdict_in_a_two_phase_refit_keeps_the_committed_slot_current(again: int) -> None:
    trainer, model = _peft(), _peft()
    engine = LoraEngine(model, keep=3)
    verdicts = iter([_passes, _vetoed, _passes])
    commit = Commit(vote=lambda own: next(verdicts)(own))
    with _session(trainer, engine, commit=commit) as (sender, peer):
        adapter_step(trainer, 1)
        _refit(sender, peer, 1)
        good = _adapter(trainer)
        adapter_step(trainer, 2)
        stats, got = refit_both(sender, peer, again)  # lands and commits here, then the vote vetoes it
        assert isinstance(stats, RefitError) and isinstance(got, RefitError), (stats, got)
        assert engine.weights.version == 1
        with engine.adapter() as name:
            assert _same(_adapter(model, name), good)
        assert _claims(engine) == [1]
        adapter_step(trainer, 3)
        _refit(sender, peer, again)  # a retry restores it
        _serves(engine, model, _adapter(trainer), again)


def _passes(own: str) -> str:
    return own


def test_a_different_base_is_refused_when_the_engine_joins_naming_the_fix_and_moving_it_once_fixes_it() -> None:
    trainer, model = _peft(seed=1), _peft(seed=2)
    engine = LoraEngine(model)
    with _session(trainer, engine) as (sender, peer):
        stats, got = refit_both(sender, peer, 1)
    assert isinstance(stats, HandshakeError) and "base weights differ" in str(stats) and "base_source" in str(stats)
    assert isinstance(got, PeerError) and "base weights differ" in str(got)
    with _session(trainer, base_engine(model), source=base_source(trainer)) as (sender, peer):
        _refit(sender, peer, 0)  # the base, once
    assert base_digest(model) == base_digest(trainer)
    with _session(trainer, LoraEngine(model)) as (sender, peer):
        _refit(sender, peer, 1)


@pytest.mark.parametrize(
    ("engine_side", "said"),
    [({"lora_alpha": 16}, "scaling"), ({"target_modules": ["q_proj", "v_proj"]}, "other modules")],
    ids=["alpha", "targets"],
)
def test_an_engine_with_another_adapter_layout_is_refused_when_it_joins(engine_side: dict, said: str) -> None:
    trainer, model = _peft(), _peft(**engine_side)
    with _session(trainer, LoraEngine(model)) as (sender, peer):
        stats, got = refit_both(sender, peer, 1)
    assert isinstance(stats, HandshakeError) and said in str(stats), stats
    assert isinstance(got, PeerError)


def test_a_plain_source_into_a_lora_engine_is_refused_naming_the_lora_source() -> None:
    trainer, model = _peft(), _peft()
    with _session(trainer, LoraEngine(model), source=ModuleSource(trainer)) as (sender, peer):
        stats, _ = refit_both(sender, peer, 1)
    assert isinstance(stats, HandshakeError) and "LoraSource" in str(stats)


def test_the_fingerprint_names_an_adapter_tensor_loaded_wrong_and_the_current_version_keeps_serving() -> None:
    trainer, model = _peft(), _peft()
    engine = LoraEngine(model)
    with _session(trainer, engine) as (sender, peer):
        on_v1 = _first(trainer, sender, peer)
        victim = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
        slot = engine.slots[1].engine  # where refit 2 lands
        real_load, real_digested = slot.load, slot.load_digested

        def swap(tensors: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
            return [(n, t * 2 if n == victim else t) for n, t in tensors]

        slot.load = lambda tensors: real_load(swap(tensors))  # type: ignore[method-assign]
        slot.load_digested = lambda tensors: real_digested(swap(tensors))  # type: ignore[method-assign]
        adapter_step(trainer, 2)
        stats, got = refit_both(sender, peer, 2)
        assert isinstance(stats, RefitError) and victim in str(stats)
        assert isinstance(got, RefitError)
        assert engine.live == {1: 0}
        with engine.adapter() as name:
            assert _generate(model, name) == on_v1


def test_engine_and_source_refuse_what_they_cannot_move() -> None:
    with pytest.raises(ValueError, match="use_dora"):
        LoraSource(_peft(use_dora=True))
    with pytest.raises(ValueError, match="modules_to_save"):
        LoraEngine(_peft(modules_to_save=["lm_head"]))
    with pytest.raises(ValueError, match="at least 2"):
        LoraEngine(_peft(), keep=1)
    with pytest.raises(ValueError, match="not a PEFT model"):
        LoraSource(build_model(CONFIG, seed=1))
    with pytest.raises(RefitError, match="no adapter version committed"), LoraEngine(_peft()).adapter():
        pass


def test_the_base_digest_is_the_plain_models_and_moves_with_one_bit() -> None:
    plain = build_model(CONFIG, seed=1)
    wrapped = _peft(seed=1)
    assert base_digest(plain) == base_digest(wrapped)
    adapter_step(wrapped, 1)  # the adapter is not the base
    assert base_digest(plain) == base_digest(wrapped)
    with torch.no_grad():
        w = plain.model.layers[1].mlp.up_proj.weight
        w.view(torch.int32)[3, 7] ^= 1
    assert base_digest(plain) != base_digest(wrapped)


@pytest.mark.parametrize(
    "lora",
    [
        [],
        {"rank": 4, "alpha": 8},
        {"rank": "4", "alpha": 8, "targets": {}, "base": ""},
        {"rank": 4, "alpha": 8, "targets": {"q": [4]}, "base": ""},
        {"rank": 4, "alpha": 8, "targets": {"q": [4, float("inf")]}, "base": ""},
    ],
)
def test_impossible_lora_statements_are_refused(lora: object) -> None:
    with pytest.raises(ValueError, match="impossible LoRA adapter"):
        parse(json.dumps({"lora": lora}).encode(), "receiver 0")


def test_statements_round_trip() -> None:
    model = _peft()
    stated = LoraEngine(model).statement()
    assert parse(json.dumps(stated).encode(), "receiver 0") == stated["lora"]
    assert parse(b"", "receiver 0") is None and parse(b"{}", "receiver 0") is None


class _Ops(TorchDispatchMode):
    """Counts the aten operations that run inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's protocol
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def test_a_bucket_cast_to_its_wire_dtype_is_one_operation_with_each_tensors_own_bytes() -> None:
    trainer = _peft()
    source = LoraSource(trainer, wire_dtype=torch.bfloat16)
    names = [s.name for s in source.specs()]
    source.tensors(names)  # the first refit plans the flat tensor and its views
    for version in (1, 2):
        adapter_step(trainer, version)
        source.signature()  # as every refit begins
        with _Ops() as seen:
            got = source.tensors(names)
        data = [op for op in seen.ops if op not in ("aten.view", "aten.reshape", "aten.detach", "aten._unsafe_view")]
        assert data == ["aten._foreach_copy_"], data  # one operation for the bucket
        want = [t.detach().to(torch.bfloat16) for t in AdapterTensors(trainer, "default").values()]
        assert all(torch.equal(g.view(torch.int16), w.view(torch.int16)) for g, w in zip(got, want, strict=True))
    assert source.held_bytes() == sum(t.numel() * 2 for t in want)


def test_a_bfloat16_wire_into_float32_adapters_lands_each_tensors_cast_bytes_verified() -> None:
    trainer, model = _peft(), _peft()
    engine = LoraEngine(model)
    with _session(trainer, engine, source=LoraSource(trainer, wire_dtype=torch.bfloat16)) as (sender, peer):
        for version in (1, 2):
            adapter_step(trainer, version)
            _refit(sender, peer, version)
            want = {n: t.to(torch.bfloat16).float() for n, t in _adapter(trainer).items()}
            _serves(engine, model, want, version)
