"""Canary bisection: when a canary fails, the first module whose output differs between trainer and engine.

Only on a failure, and once per side: the engine runs the probe again through its module with a forward hook on
each probe point (every decoder layer, its attention, MLP and norms, and the modules outside the layers that hold
weights: the embedding, the final norm, the head) and sends, with its failing DONE, a sketch of each point's
output (`summaries`): per row (token), its root mean square and its projections on a few fixed ±1 directions.
The trainer runs its own model once the same way and compares the sketches in the order its forward ran them: the
first point whose sketch differs by more than the canary's tolerance, relative to the size of the trainer's
output there, is named (`explain`). The sketches do not depend on exact bytes, so a bfloat16 engine agrees with
a float32 trainer everywhere its weights are right.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence

import torch
from torch import nn

SKETCH = 4
"""Projections per row, beside its root mean square."""
MAX_POINTS = 8192
"""Most probe points a peer's sketches may name (the rest of an engine's are dropped)."""
MAX_NAME_CHARS = 512
_LAYER = re.compile(r"(^|\.)(layers|h|blocks|layer)\.(\d+)(\.[^.]+)?$")
Sketches = dict[str, list[float]]


def probe_points(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules whose outputs are compared: each decoder layer and its direct children, and every module
    outside the layers that holds weights of its own (embedding, final norm, head)."""
    out = []
    for name, m in model.named_modules():
        inside = re.search(r"(^|\.)(layers|h|blocks|layer)\.\d+(\.|$)", name) is not None
        if _LAYER.search(name) or (name and not inside and any(True for _ in m.parameters(recurse=False))):
            out.append((name, m))
    return out[:MAX_POINTS]


def _sketch(x: torch.Tensor) -> list[float]:
    rows = x.detach().float().reshape(-1, x.shape[-1] if x.dim() else 1)
    d = rows.shape[1]
    signs = torch.randint(0, 2, (d, SKETCH), generator=torch.Generator().manual_seed(d)).float() * 2 - 1
    rms = rows.pow(2).mean(1, keepdim=True).sqrt()
    proj = rows.cpu() @ signs / math.sqrt(d)
    return torch.cat([rms.cpu(), proj], 1).reshape(-1).tolist()


def _first_tensor(out: object) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return getattr(out, "last_hidden_state", None) if not isinstance(out, (tuple, list)) else None


def summaries(model: nn.Module, tokens: Sequence[int]) -> Sketches:
    """One forward of `tokens` through `model` with hooks on its probe points: each point's sketch, in the order
    the forward ran them (a point run twice keeps its first output)."""
    got: Sketches = {}
    hooks = []

    def hook(name: str) -> Callable:
        def record(_m: nn.Module, _args: object, out: object) -> None:
            t = _first_tensor(out)
            if t is not None and t.is_floating_point() and name not in got:
                got[name] = _sketch(t)

        return record

    for name, m in probe_points(model):
        hooks.append(m.register_forward_hook(hook(name)))
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.inference_mode():
            model(torch.tensor(list(tokens), dtype=torch.int64, device=device)[None])
    finally:
        for h in hooks:
            h.remove()
        for m, training in modes:
            m.training = training
    return got


def parse(raw: object) -> Sketches | None:
    """A peer's sketches, checked: an object of at most MAX_POINTS names, each a list of finite floats whose
    length is a multiple of 1 + SKETCH; None for anything else (bisection is advice, never trusted)."""
    if not isinstance(raw, dict) or not 0 < len(raw) <= MAX_POINTS:
        return None
    out: Sketches = {}
    for name, values in raw.items():
        if not (isinstance(name, str) and 0 < len(name) <= MAX_NAME_CHARS and isinstance(values, list)):
            return None
        if not values or len(values) % (1 + SKETCH) or len(values) > (1 << 20):
            return None
        if not all(_finite(v) for v in values):
            return None
        out[name] = [float(v) for v in values]
    return out


def _finite(v: object) -> bool:
    """A JSON number a float holds (an integer of 400 digits overflows it: not finite here)."""
    try:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    except OverflowError:
        return False


def first_divergence(reference: Sketches, engine: Sketches, tol: float) -> str:
    """Where the engine's outputs first leave the trainer's, as a sentence: the first point (in the trainer's
    order) whose sketch differs by more than `tol` times the trainer's largest row RMS there."""
    agree: list[str] = []
    for name, ref in reference.items():
        mine = engine.get(name)
        if mine is None or len(mine) != len(ref):
            return f"the engine has no output comparable with the trainer's {name}" + _agreeing(agree)
        rms = max(ref[0 :: 1 + SKETCH])
        diff = max(abs(a - b) for a, b in zip(ref, mine)) / max(rms, 1e-12)
        if not diff <= tol:
            return f"first divergence at {name} (max |diff| {diff:.3g} > tolerance {tol:g})" + _agreeing(agree)
        agree.append(name)
    return "every probe point agrees within the tolerance: the engine's scoring differs after the model's outputs"


def _agreeing(names: list[str]) -> str:
    whole = (_LAYER.search(n) for n in names)  # a layer agrees when its own output does
    layers = sorted({int(m.group(3)) for m in whole if m is not None and m.group(4) is None})
    if not layers:
        return "; nothing before it agrees" if not names else f"; {names[-1]} and everything before it agree"
    span = f"layer {layers[0]}" if len(layers) == 1 else f"layers {layers[0]}-{layers[-1]}"
    return f"; {span} agree"


def module_of(engine: object) -> nn.Module | None:
    """The nn.Module an engine computes with, where it exposes one (`ModuleEngine.module`)."""
    m = getattr(engine, "module", None)
    return m if isinstance(m, nn.Module) else None


def reference_module(reference: object) -> nn.Module | None:
    """The trainer's model behind a canary reference (`causal_lm(model)` marks it; a custom scoring may set
    `.module` on itself to allow bisection)."""
    m = getattr(reference, "module", None)
    return m if isinstance(m, nn.Module) else None


FIELD = "canary_modules"
"""DONE's field (status 1, after a canary failure) carrying the engine's sketches: {"tolerance", "points"}."""


def engine_half(engine: object, tokens: Sequence[int], tol: float) -> dict:
    """DONE's extra field after a failed canary: the engine's sketches of the probe (one more probe pass), or
    nothing where the engine exposes no module or its forward fails (the canary's own message still stands)."""
    model = module_of(engine)
    if model is None:
        return {}
    try:
        return {FIELD: {"tolerance": tol, "points": summaries(model, tokens)}}
    except Exception:  # noqa: BLE001 - bisection is advice: the refit already failed on the canary
        return {}


def trainer_half(canary: object, raw: object, cache: dict) -> str:
    """The sentence appended to a receiver's canary failure: where its outputs first leave the trainer's. The
    trainer's sketches are taken once per refit (`cache`), one more pass of the probe through its model."""
    if canary is None or not isinstance(raw, dict):
        return ""
    tol, engine = raw.get("tolerance"), parse(raw.get("points"))
    if engine is None or not isinstance(tol, (int, float)) or isinstance(tol, bool) or not 0 < tol < math.inf:
        return "; the engine's per-module sketches were malformed (no bisection)"
    model = reference_module(getattr(canary, "reference", None))
    if model is None:
        return "; no bisection: the canary's reference names no model (causal_lm(model) does)"
    if "trainer" not in cache:
        try:
            cache["trainer"] = summaries(model, getattr(canary, "tokens", ()))
        except Exception as e:  # noqa: BLE001 - advice only
            cache["trainer"] = f"; no bisection: the trainer's probe pass failed ({type(e).__name__}: {e})"
    ref = cache["trainer"]
    return ref if isinstance(ref, str) else "; " + first_divergence(ref, engine, float(tol))
