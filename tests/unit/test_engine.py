"""ModuleEngine: in-place loads, name mapping, and copy plans that do not outlive their manifest."""

from __future__ import annotations

import pytest
import torch

from refit import ModuleEngine, RefitError, State


def test_loads_in_place_through_a_name_map_and_tracks_versions() -> None:
    own = {"w": torch.zeros(3), "b": torch.zeros(2, dtype=torch.float32)}
    engine = ModuleEngine(own, name_map={"sender.w": "w"})
    assert sorted(s.name for s in engine.specs()) == ["b", "sender.w"]
    engine.begin(1)
    engine.load([("sender.w", torch.ones(3)), ("b", torch.full((2,), 2, dtype=torch.bfloat16))])
    engine.commit(1)
    assert torch.equal(own["w"], torch.ones(3)) and torch.equal(own["b"], torch.full((2,), 2.0))
    assert (engine.weights.state, engine.weights.version) == (State.CURRENT, 1)
    with pytest.raises(ValueError, match="name_map targets names the module does not have"):
        ModuleEngine(own, name_map={"x": "missing"})
    engine.begin(2)
    engine.fail(2, "boom")
    with pytest.raises(RefitError, match=r"engine weights are failed \(last committed 1, target 2\)"):
        engine.ensure_current()


def test_a_name_map_that_would_hide_a_module_tensor_is_refused_and_a_swap_loads_both() -> None:
    own = {"a": torch.zeros(2), "b": torch.zeros(2)}
    # sender 'b' -> module 'a' while the module has its own 'b': one of them would never be loaded
    with pytest.raises(ValueError, match=r"sender name 'b' to 'a', but the module also has a tensor named 'b'"):
        ModuleEngine(own, name_map={"b": "a"})
    with pytest.raises(ValueError, match=r"several sender names to one module tensor \('a' <- \['x', 'y'\]\)"):
        ModuleEngine(own, name_map={"x": "a", "y": "a"})
    engine = ModuleEngine(own, name_map={"a": "b", "b": "a"})
    assert sorted(s.name for s in engine.specs()) == ["a", "b"]
    engine.begin(1)
    engine.load([("a", torch.ones(2)), ("b", torch.full((2,), 2.0))])
    engine.commit(1)
    assert torch.equal(own["b"], torch.ones(2)) and torch.equal(own["a"], torch.full((2,), 2.0))


def test_copy_plans_of_an_old_manifest_are_dropped_after_one_refit() -> None:
    engine = ModuleEngine({"w": torch.zeros(4)})
    old = [("w", torch.ones(4))]
    new = [("w", torch.full((4,), 3.0))]
    engine.begin(1)
    engine.load(old)
    engine.begin(2)  # a new epoch: the receiver now passes other lists
    engine.load(new)
    engine.begin(3)
    assert list(engine._plans) == [id(new)]
    engine.load(new)
    assert torch.equal(engine.tensor("w"), torch.full((4,), 3.0))


def test_a_target_the_inference_side_replaced_receives_the_bytes_not_its_predecessor() -> None:
    model = torch.nn.Linear(4, 3)
    engine = ModuleEngine(model)
    engine.begin(1)
    engine.load(batch := [("weight", torch.ones(3, 4)), ("bias", torch.ones(3))])
    engine.commit(1)
    model.to(torch.float64)  # replaces every parameter's storage on the engine side
    model.bias = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))  # and one parameter object
    engine.begin(2)
    engine.load(batch)  # the same list again: a cached plan would write into the old tensors
    engine.commit(2)
    assert torch.equal(model.weight, torch.ones(3, 4, dtype=torch.float64))
    assert torch.equal(model.bias, torch.ones(3, dtype=torch.float64))
    assert engine.held("bias")[0] is model.bias


def test_release_buffers_drops_every_view_the_engine_keeps_into_a_receive_buffer() -> None:
    import gc
    import weakref

    engine = ModuleEngine({"a": torch.zeros(4)})
    buf = torch.arange(8, dtype=torch.float32)
    engine.begin(1)
    engine.load([("a", buf[2:6])])
    engine.commit(1)
    ref = weakref.ref(buf)
    del buf
    gc.collect()
    assert ref() is not None  # the cached copy plan keeps a view of it
    engine.release_buffers()
    gc.collect()
    assert ref() is None
    assert torch.equal(engine.tensor("a"), torch.arange(2, 6, dtype=torch.float32))


def test_an_engine_that_never_committed_a_refit_is_not_current_unless_declared() -> None:
    """A restarted replica must not serve its initial weights as current (issue 26)."""
    engine = ModuleEngine({"w": torch.zeros(3)})
    assert engine.weights.state == State.EMPTY
    with pytest.raises(RefitError, match="has not committed any refit yet.*assume_current"):
        engine.ensure_current()
    with pytest.raises(RefitError, match="has not committed any refit yet"):
        engine.ensure_current(allow_failed=True)
    loaded = ModuleEngine({"w": torch.zeros(3)})
    loaded.assume_current(7)  # loaded from the checkpoint the trainer starts from
    loaded.ensure_current()
    assert (loaded.weights.state, loaded.weights.version) == (State.CURRENT, 7)
    engine.begin(1)
    engine.load([("w", torch.ones(3))])
    engine.commit(1)
    engine.ensure_current()
    with pytest.raises(ValueError, match="after a refit began"):
        engine.assume_current(1)
