"""`refit plan`: what a model's refit would allocate and move (buckets, memory, digests, the M:N paths),
computed here without starting a session; the CLI (refit.tools.cli) only parses and prints."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from refit.layout.manifest import Manifest


def config_file(path: str) -> str:
    """`path` if it holds JSON; else ValueError naming the fix (checked before any work starts)."""
    try:
        with open(path) as f:
            json.load(f)
    except OSError as e:
        raise ValueError(f"--config {path}: {e.strerror}; pass the path of a transformers config.json") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--config {path} is not JSON ({e}); pass a transformers config.json") from None
    return path


def _mesh_report(args: argparse.Namespace, spec_list: list) -> dict:
    """With --trainer-ranks: bytes and time per GPU on each path (refit.tools.mesh_figures), and, where the
    model is small enough to plan every move here, which path each tensor takes in the real plan."""
    ranks = getattr(args, "trainer_ranks", None)
    if not ranks:
        return {}
    from refit.layout.reshard import plan_reshard
    from refit.tools.mesh_figures import path_figures, statements

    tp, ep = args.engine_tp, args.engine_ep
    out = {"paths": path_figures(spec_list, ranks=ranks, tp=tp, ep=ep)}
    if len(spec_list) * ranks * tp * ep <= 2_000_000:
        plan = plan_reshard(spec_list, *statements(spec_list, ranks=ranks, tp=tp, ep=ep))
        kinds: dict[str, int] = {}
        for kind in plan.paths.values():
            kinds[kind] = kinds.get(kind, 0) + 1
        out["paths"]["tensor_paths"] = kinds
        out["paths"]["plan_digest"] = plan.digest.hex()
    return out


def plan_settings(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """The environment's Settings (the CLI's, checked before any work), with --ratio and --bucket-bytes over
    their variables."""
    import dataclasses

    from refit.settings import Settings

    env = getattr(args, "settings", None) or Settings()
    return dataclasses.replace(
        env,
        ratio=env.ratio if args.ratio is None else args.ratio,
        bucket_bytes=env.bucket_bytes if args.bucket_bytes is None else args.bucket_bytes,
    )


def plan_report(args: argparse.Namespace) -> dict:
    """What `refit plan` shows, as JSON-able numbers."""
    import torch

    from refit.dtypes import dtype_from_name
    from refit.engines.staging import staging_nbytes
    from refit.layout.budget import NUM_SLOTS, bucket_capacity, free_bytes, needed_bytes
    from refit.layout.planner import forecast, plan, specs_digest
    from refit.tools.bench.presets import PRESETS, from_config, specs

    if args.config:
        shape = from_config(config_file(args.config))
    elif args.preset not in PRESETS:
        raise ValueError(f"unknown preset {args.preset!r}; choose one of {', '.join(PRESETS)}, or pass --config")
    else:
        shape = PRESETS[args.preset]
    if getattr(args, "layers", None) is not None:
        shape = shape.truncated(args.layers)
    spec_list = specs(shape, dtype_from_name(args.dtype))
    settings = plan_settings(args)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    free = free_bytes(device)
    # As the Sender's connect computes it: the budget, capped at what the model needs.
    cap = bucket_capacity(
        bucket_bytes=settings.bucket_bytes, ratio=settings.ratio, free=free, needed=needed_bytes(spec_list)
    )
    m = plan(spec_list, capacity=cap, epoch=1)
    f = forecast(m, num_slots=NUM_SLOTS)
    dtypes: dict[str, int] = {}
    for s in spec_list:
        name = str(s.dtype).removeprefix("torch.")
        dtypes[name] = dtypes.get(name, 0) + 1
    mesh = _mesh_report(args, spec_list)
    return {
        **mesh,
        "model": args.config or args.preset,
        "tensors": len(spec_list),
        "nbytes": m.nbytes,
        "dtypes": dtypes,
        "num_buckets": m.num_buckets,
        "capacity": cap,
        "device": device.type,
        "free": free,
        "ratio": settings.ratio,
        "largest_tensor": max(s.nbytes for s in spec_list),
        "spans_buckets": m.max_split_nbytes > 0,
        "sender_bytes": f.sender_bytes,
        "receiver_bytes": f.receiver_bytes,
        "bucket_bytes": sum(m.bucket_nbytes),
        "digest": m.digest.hex(),
        "specs_digest": specs_digest(spec_list),
        "manifest_json_bytes": len(m.to_json()),
        "control_bytes_per_refit": 64 * (3 + 2 * m.num_buckets),
        "staging_bytes_per_engine": staging_nbytes(spec_list),
        **_staging_split(args, m),
        **_delta_image(args, m),
    }


def _delta_image(args: argparse.Namespace, m: Manifest) -> dict:
    """`--delta`: the committed wire image each side keeps (refit.stages.delta), one more copy of the wire bytes."""
    from refit.stages.delta import UNIT, num_units

    if not getattr(args, "delta", False):
        return {}
    return {"delta_image_bytes": sum(num_units(nb) * UNIT for nb in m.bucket_nbytes)}


def _staging_split(args: argparse.Namespace, m: Manifest) -> dict:
    """`--staging-bytes`: how that bound splits a staged refit between staging memory and the pause."""
    from dataclasses import asdict

    from refit.engines.staging import plan_split

    if getattr(args, "staging_bytes", None) is None:
        return {}
    split = plan_split(m, args.staging_bytes)[0]
    return {"staging_split": {**asdict(split), "pause_covers": split.describe()}}


def show_plan(r: dict, args: argparse.Namespace, console: Console) -> int:
    """`refit plan`'s report, as the terminal shows it."""
    size = f"{r['nbytes'] / 1e9:.3f} GB" if r["nbytes"] >= 1e8 else f"{r['nbytes'] / 1e6:.3f} MB"
    console.print(f"model: {r['model']}: {r['tensors']} tensors, {size}; dtypes {r['dtypes']}")
    console.print(
        f"buckets: {r['num_buckets']} of capacity {r['capacity'] / 2**20:.1f} MiB (free {r['device']} memory "
        f"{r['free'] / 2**30:.1f} GiB, ratio {r['ratio']}); largest tensor "
        f"{r['largest_tensor'] / 2**20:.1f} MiB, spanning buckets: {r['spans_buckets']}"
    )
    console.print(
        f"memory allocated or mapped: sender {r['sender_bytes'] / 2**20:.1f} MiB, "
        f"each receiver {r['receiver_bytes'] / 2**20:.1f} MiB (buffers for {r['bucket_bytes'] / 2**20:.1f} MiB "
        "of bucket bytes)"
    )
    console.print(
        f"manifest digest {r['digest']} (the layout too: a run's equals it when --bucket-bytes is given or "
        "the model fits one bucket), "
        f"specs digest {r['specs_digest']} (names, shapes, dtypes); JSON {r['manifest_json_bytes']} bytes "
        f"(sent once per epoch); per refit {r['control_bytes_per_refit']} control bytes per receiver"
    )
    console.print(
        f"staged refit (Receiver(staged=True)): {r['staging_bytes_per_engine'] / 2**20:.1f} MiB more per engine "
        "(one staging copy of what it loads, in this wire dtype; an engine holding a wider dtype stages in that)"
    )
    if "delta_image_bytes" in r:
        console.print(
            f"delta refits (delta=True): {r['delta_image_bytes'] / 2**20:.1f} MiB more on the sender (on its device) "
            "and on each receiver: the committed wire image, one copy of the model in its wire dtype"
        )
    if "staging_split" in r:
        console.print(f"with --staging-bytes {args.staging_bytes}: {r['staging_split']['pause_covers']}")
    if "paths" in r:
        _show_paths(r["paths"], console)
    return 0


def _show_paths(p: dict, console: Console) -> None:
    table = Table(
        title=f"per refit, {p['trainer_ranks']} trainer ranks (FSDP2 Shard(0)) -> {p['engine_workers']} engine workers"
    )
    for col in ("path", "bytes per GPU", "at NVLink class", "at 50 GB/s per GPU (assumed)"):
        table.add_column(col, justify="left" if col == "path" else "right")
    labels = {"broadcast": "broadcast (one Sender)", "per_rank": "per-rank (all-gather)", "m_to_n": "M:N"}
    for key, label in labels.items():
        t = p["seconds"][key]
        table.add_row(label, f"{p['bytes_per_gpu'][key] / 1e9:.2f} GB", f"{t['nvlink']:.3f} s", f"{t['nic']:.2f} s")
    console.print(table)
    for name, b in p["bandwidths"].items():
        console.print(f"  {name}: {b['gbps']:.0f} GB/s ({b['source']})")
    if "tensor_paths" in p:
        console.print(f"  M:N tensor paths: {p['tensor_paths']}, plan digest {p['plan_digest'][:12]}")
