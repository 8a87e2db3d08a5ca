"""The per-module sketches a failing engine sends with DONE: any hostile value is refused as advice, never
trusted and never raising; the trainer's bisection of well-formed ones names the first point that diverges."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from refit.checks import canary_bisect
from refit.checks.canary_bisect import SKETCH, first_divergence, parse, trainer_half

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner, max_size=6),
    max_leaves=30,
)


@settings(max_examples=100, deadline=None)
@given(json_values)
def test_any_json_is_parsed_or_refused_without_raising(raw: object) -> None:
    got = parse(raw)
    assert got is None or all(len(v) % (1 + SKETCH) == 0 for v in got.values())
    out = trainer_half(object(), {"tolerance": 0.1, "points": raw}, {})
    assert isinstance(out, str)


@settings(max_examples=50, deadline=None)
@given(json_values)
def test_a_hostile_tolerance_or_field_is_refused_as_malformed(raw: object) -> None:
    out = trainer_half(object(), {"tolerance": raw, "points": {"a": [1.0] * (1 + SKETCH)}}, {})
    assert out.startswith("; ")
    assert trainer_half(None, raw, {}) == ""


def test_the_first_point_beyond_the_tolerance_is_named_with_the_layers_before_it() -> None:
    ok = [1.0, 0.5, -0.5, 0.25, 0.0]
    bad = [1.0, 3.5, -0.5, 0.25, 0.0]
    ref = {f"model.layers.{i}": ok for i in range(3)} | {"model.layers.3.mlp": ok, "lm_head": ok}
    got = dict(ref) | {"model.layers.3.mlp": bad, "lm_head": bad}
    assert first_divergence(ref, got, 0.15) == (
        "first divergence at model.layers.3.mlp (max |diff| 3 > tolerance 0.15); layers 0-2 agree"
    )
    assert first_divergence(ref, ref, 0.15).startswith("every probe point agrees")
    assert "no output comparable" in first_divergence(ref, {"model.layers.0": ok}, 0.15)
    assert canary_bisect.parse({"x": [float("nan")] * 5}) is None
