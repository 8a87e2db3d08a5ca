"""The demo's engine process: a transformers model behind a Receiver, reporting after every refit.

Started as `python -m refit.tools.demo.engine '<json args>'`; without a rendezvous in the args it
builds its model first, then serves one session per JSON line on stdin (rendezvous and prompts), each
into a freshly built model, so one process (one set of imports) serves the demo over every transport.
Reports are JSON lines on stdout marked '@@refit'.
"""

from __future__ import annotations

import json
import sys

import torch

from refit.checks.fingerprints import fingerprints
from refit.engines.module import ModuleEngine
from refit.errors import PeerError, RefitError
from refit.layout.state_layout import non_persistent_buffers
from refit.log import configure, get_logger
from refit.settings import Settings
from refit.stages.lora import LoraEngine
from refit.tools.demo.fp8 import ENGINE_DTYPES, QuantizedLinear, quantize_linears, refresh
from refit.tools.demo.model import build_model, greedy, model_config
from refit.topology.receiver import Receiver

MARK = "@@refit "
NOT_JOINED = 2
"""Exit code of an engine process whose session never joined the trainer (its 'exit' event says why)."""
log = get_logger("demo engine")


def emit(obj: dict) -> None:
    print(MARK + json.dumps(obj), flush=True)


def main(argv: list[str]) -> int:
    """Serve sessions; an error that ends this process is reported as an 'exit' event first, so that the
    trainer names it (its own one line) instead of waiting for a receiver that will never connect."""
    try:
        return _serve(json.loads(argv[1]))
    except Exception as e:  # noqa: BLE001 - reported to the trainer, which ends the demo with it
        log.debug("engine process failed", exc_info=True)
        emit({"event": "exit", "message": f"{type(e).__name__}: {e}" if not isinstance(e, ValueError) else str(e)})
        return 1


def _serve(args: dict) -> int:
    configure(args.get("verbosity", 0))
    if "rendezvous" in args:
        return _session(args, _model(args))
    model = _model(args)  # built before the trainer is ready: the first session needs no wait for it
    for line in sys.stdin:  # one session per line (a rendezvous and prompts) until the trainer closes stdin
        code = _session({**args, **json.loads(line)}, model)
        if code:
            return code
        model = _model(args)
    return 0


def _model(args: dict) -> torch.nn.Module:
    if args.get("lora"):  # the trainer's base, held already: only the adapter moves
        from refit.tools.demo.lora import BASE_SEED, wrap

        return wrap(build_model(model_config(**args["model"]), seed=BASE_SEED), args["lora"]).eval()
    model = build_model(model_config(**args["model"]), seed=12345)  # random: the first refit installs the weights
    quantize_linears(model, args.get("dtype", "float"))  # fp8, mxfp8: the trainer quantizes for them
    return model


def _engine(model: torch.nn.Module, *, computed: bool = False, dtype: str = "float") -> ModuleEngine | LoraEngine:
    """`computed`: the trainer sends no non-persistent buffers (the rotary tables, computed from the config
    on both sides): waived here by name, as a user would."""
    if hasattr(model, "peft_config"):
        return LoraEngine(model)
    ignore = [name for name, _, _ in non_persistent_buffers(model)] if computed else ()
    if dtype in ENGINE_DTYPES:  # its decoder's linears quantized: an engine that states them
        held = [f"{path}.weight" for path, m in model.named_modules() if isinstance(m, QuantizedLinear)]
        return ENGINE_DTYPES[dtype].engine(model, held, ignore=ignore)
    return ModuleEngine(model, ignore=ignore)


def _held(engine: ModuleEngine | LoraEngine, wire: dict, prompts: list[list[int]]) -> dict:
    """The report's fingerprints of what the engine holds and its greedy output."""
    if isinstance(engine, LoraEngine):
        from refit.tools.demo.lora import engine_report

        return engine_report(engine, wire, prompts)
    model = engine.module
    assert isinstance(model, torch.nn.Module)
    return {
        "fingerprints": fingerprints(model.state_dict().items(), wire, held=True),
        "generated": greedy(model, prompts),
    }


def _session(args: dict, model: torch.nn.Module) -> int:
    """One Receiver session into `model`, reporting after every refit, until the sender closes (0)."""
    engine = _engine(model, computed=bool(args.get("computed")), dtype=args.get("dtype", "float"))
    log.info("engine model built; connecting to %s:%s", args["rendezvous"]["host"], args["rendezvous"]["port"])
    settings = Settings(bucket_bytes=args.get("bucket_bytes"), timeout_s=args.get("timeout_s", 120.0))
    with Receiver(engine, args["rendezvous"], settings=settings) as receiver:
        while True:
            try:
                stats = receiver.receive()
            except RefitError as e:
                if receiver.channel is None:  # never joined (refused, nothing listens): no retry can help
                    emit({"event": "exit", "message": f"could not connect to the trainer: {e}"})
                    return NOT_JOINED
                emit({"event": "error", "message": str(e), "state": engine.weights.state.value})
                if isinstance(e, PeerError):
                    return 3
                continue
            if stats is None:
                return 0
            assert receiver.manifest is not None
            wire = {n: p.spec.dtype for p in receiver.manifest.entries for n in p.spec.names}  # aliases too (tied)
            engine.ensure_current()
            refresh(model)  # a quantized model's dequantized weights are of the last version
            emit(
                {
                    "event": "refit",
                    "version": engine.weights.version,
                    "state": engine.weights.state.value,
                    "stats": stats.to_json(),
                    **_held(engine, wire, args["prompts"]),
                }
            )


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    raise SystemExit(main(sys.argv))
