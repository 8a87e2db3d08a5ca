"""Bench output: the rich table, the JSON file and the scaling plot."""

from __future__ import annotations

import json
import sys

from rich.console import Console
from rich.table import Table

LABELS = {
    "floor": "floor",
    "foreach": "_foreach_copy_ of the tensors",
    "kernel": "batched copy kernel of the tensors",
    "refit": "refit (pipelined buckets)",
    "checksum": "refit + per-bucket checksum",
    "fingerprint": "refit + end-to-end fingerprint check",
    "zero_copy": "refit zero-copy (reads trainer tensors)",
    "zero_copy_fingerprint": "refit zero-copy + end-to-end fingerprint check",
    "digest": "probe: digest of the tensors alone",
    "copy_digest": "probe: fused copy + digest of the tensors",
    "serial": "serial buckets, no overlap",
    "per_tensor": "per-tensor, metadata once",
    "per_tensor_meta": "per-tensor, metadata every refit",
    "step_full": "refit + fingerprint after an AdamW step (lr 1e-6)",
    "step_delta": "delta refit + fingerprint after an AdamW step (lr 1e-6)",
    "step_delta_worst": "delta refit + fingerprint, every value changed (AdamW lr 1e-2)",
    "quantize": "probe: the trainer's FP8 quantizer alone (bytes read + written)",
}


COLOCATED = {"shm", "cuda-ipc"}


def floor_label(report: dict) -> str:
    """What the floor of this report is, in words."""
    link = report.get("link")
    if link:
        return f"floor: raw TCP send of the model's bytes across the veth ({link['rate']})"
    if report["config"]["transport"] in COLOCATED:
        where = "device" if report["device"] != "cpu" else "host"
        return f"floor: one flat {where} copy of the model's bytes"
    if report["config"]["transport"] == "nixl":
        return "floor: raw NIXL READs of one buffer"
    return "floor: raw broadcast of one buffer"


def _name(report: dict) -> str:
    c = report["config"]
    name = c["config"] or c["preset"]
    return name if c.get("layers") is None else f"{name} ({c['layers']} layers)"


def table(report: dict) -> Table:
    c, link = report["config"], report.get("link")
    dtypes = "+".join(report.get("dtypes") or [c["dtype"]])
    engine = report.get("engine_dtypes")
    if engine and engine != report.get("dtypes"):
        dtypes += f" in the trainer, {'+'.join(engine)} in the engine (GB on the wire)"
    sites = (link or {}).get("sites") or 0
    across = f" across a namespaced veth ({link['rate']})" if link else ""
    across = f" in {sites} site(s), each behind its own veth ({link['rate']})" if sites else across
    t = Table(
        title=f"{_name(report)}: {report['tensors']} tensors, {report['nbytes'] / 1e9:.3f} GB {dtypes}, "
        f"{c['transport']} to {c['receivers']} receiver(s) on {report['device']}{across}"
    )
    cols = ["method", "median ms", "min-max ms", "GB/s", "x floor", "x unverified"]
    cols += ["% of link rate", "refit MB", "veth MB", "delta refits"] if link else []
    cols += ["MB into each site"] if sites else []
    for col in (*cols, "stages (median ms)"):
        t.add_column(col, justify="left" if col in ("method", "stages (median ms)") else "right", no_wrap=True)
    for key, r in report["results"].items():
        ratio, plain = r["ratio_to_floor"], r.get("ratio_to_unverified")
        stages = " ".join(f"{k} {v * 1e3:.1f}" for k, v in r["stages"].items()) or _floors(r)
        label = floor_label(report) if key == "floor" else LABELS.get(key, key)
        cells = [
            f"{r['median_s'] * 1e3:.1f}",
            f"{r['min_s'] * 1e3:.1f}-{r['max_s'] * 1e3:.1f}",
            f"{r['gbps']:.2f}",
            "-" if ratio is None else f"{ratio:.2f}",
            "-" if plain is None else f"{plain:.2f}",
        ]
        into = [",".join(f"{b / 1e6:.1f}" for b in r.get("site_bytes") or [])] if sites else []
        t.add_row(label, *cells, *(_link_cells(r, len(r["times"])) if link else []), *into, stages)
    return t


def _link_cells(r: dict, timed: int) -> list[str]:
    """Across a link: the share of its rate the model's bytes reached, the bytes refit says it sent and the
    bytes the sender's veth sent during the method (warmup included), and how many timed refits went as deltas."""
    share, crossed, deltas = r.get("link_fraction"), r.get("link_bytes"), r.get("delta_refits")
    said = r.get("wire_bytes")
    return [
        "-" if share is None else f"{share * 100:.0f}%",
        "-" if said is None else f"{said / 1e6:.1f}",
        "-" if crossed is None else f"{crossed / 1e6:.1f}",
        "-" if deltas is None else f"{deltas}/{timed}",
    ]


def _floors(result: dict) -> str:
    """A probe's own floors: a flat copy and a flat read of as many bytes, and its ratio to each."""
    floors = result.get("floors") or {}
    return " ".join(
        f"{k.replace('_floor', '')} {v * 1e3:.2f} (x{result['median_s'] / v:.2f})" for k, v in floors.items()
    )


VERIFIED = {"fingerprint": "refit", "zero_copy_fingerprint": "zero_copy"}
"""Each verified method and its unverified twin: the report gives their ratio. Every method passes `verify`
explicitly, so a figure means the same whatever the library's default."""


def notes(report: dict) -> list[str]:
    """One line under the table for each figure a reader would take for a contradiction, saying why it holds:
    a verified refit faster than its unverified twin, a probe slower than the whole verified refit."""
    res, lines = report["results"], []
    for verified, plain in VERIFIED.items():
        v, p = res.get(verified), res.get(plain)
        if v and p and v["median_s"] < p["median_s"]:
            lines.append(_verified_faster(report, verified, plain))
    for probe in ("digest", "copy_digest"):
        slower = [m for m in VERIFIED if probe in res and m in res and res[probe]["median_s"] > res[m]["median_s"]]
        if slower:
            lines.append(_probe_slower(res, probe, slower[0]))
    if "serial" in res and "refit" in res and res["serial"]["median_s"] < res["refit"]["median_s"]:
        lines.append(_serial_faster(report))
    return lines


def _serial_faster(report: dict) -> str:
    res, c = report["results"], report["config"]
    size = max(1, min(c["bucket_bytes"], report["nbytes"]))  # the runner caps a bucket at the model's bytes
    buckets = max(1, -(-report["nbytes"] // size))
    return (
        f"{LABELS['serial']} beats {LABELS['refit']} ({_ms(res['serial'])} vs {_ms(res['refit'])}): pipelining packs "
        f"bucket i+1 while bucket i is on the wire, which pays only when a refit spans several buckets and packing "
        f"and the link do not share the same cores; here the model takes about {buckets} bucket(s) of "
        f"{size / 2**20:.1f} MiB, so the second buffer only adds its setup (try a smaller --bucket-bytes)."
    )


def _ms(r: dict, key: str = "median_s") -> str:
    return f"{r[key] * 1e3:.1f} ms"


def _copies(r: dict) -> float:
    """A refit's copy stages: the sender's pack and the first engine's load."""
    return r["stages"].get("pack", 0.0) + r["stages"].get("recv.load", 0.0)


def _verified_faster(report: dict, verified: str, plain: str) -> str:
    v, p = report["results"][verified], report["results"][plain]
    head = f"{LABELS[verified]} beats {LABELS[plain]} ({_ms(v)} vs {_ms(p)})"
    if report.get("cpu_kernel") and v["stages"] and p["stages"] and _copies(v) < _copies(p):
        return (
            f"{head}: on CPU its copies (pack + engine load {_copies(v) * 1e3:.1f} vs {_copies(p) * 1e3:.1f} ms) run "
            "refit's fused copy-and-digest C kernel, one call for all of a bucket's tensors, while the unverified "
            f"copies go through torch's _foreach_copy_, tensor by tensor: over {report['tensors']} tensors of "
            f"{report['nbytes'] / max(1, report['tensors']) / 1e3:.0f} KB on average that costs more than the digest."
        )
    return (
        f"{head}: the verified refit adds no pass of its own (its digests are taken inside the copies both make), "
        f"so the two differ by run-to-run variation here (min-max {_ms(v, 'min_s')}-{_ms(v, 'max_s')} vs "
        f"{_ms(p, 'min_s')}-{_ms(p, 'max_s')})."
    )


def _probe_slower(res: dict, probe: str, verified: str) -> str:
    return (
        f"{LABELS[probe]} takes longer than {LABELS[verified]} ({_ms(res[probe])} vs {_ms(res[verified])}) because it "
        "is not a part of it: the refit takes its digests inside the copies it makes anyway (the sender's pack, the "
        "engine's load), spread over buckets and over the sender and engine processes at once, while the probe is "
        "one pass of its own over every tensor in one process."
    )


def memory_line(report: dict) -> str:
    m = report["results"].get("refit", {}).get("memory", {})
    if not m:
        return ""
    fmt = lambda v: "n/a" if v is None else f"{v / 2**20:.0f} MiB"  # noqa: E731
    return (
        "refit memory allocated or mapped: "
        f"sender predicted {fmt(m['predicted_sender'])}, measured {fmt(m['measured_sender'])}; "
        f"receiver predicted {fmt(m['predicted_receiver'])}, measured {fmt(m['measured_receiver'])}"
    )


def scaling(reports: list[dict]) -> Table:
    """One row per report: how each method's time and ratio move with the tensor count."""
    methods = [m for m in LABELS if any(m in r["results"] for r in reports)]
    t = Table(title="scaling with the tensor count (median ms, x floor)")
    for col in ("model", "transport", "tensors", "GB", *methods):
        t.add_column(col, justify="left" if col in ("model", "transport") else "right", no_wrap=True)
    for r in sorted(reports, key=lambda r: (r["config"]["transport"], r["tensors"])):
        cells = []
        for m in methods:
            res = r["results"].get(m)
            ratio = "" if res is None or res["ratio_to_floor"] is None else f" ({res['ratio_to_floor']:.2f}x)"
            cells.append("-" if res is None else f"{res['median_s'] * 1e3:.1f}{ratio}")
        t.add_row(_name(r), r["config"]["transport"], str(r["tensors"]), f"{r['nbytes'] / 1e9:.2f}", *cells)
    return t


def _print(console: Console, renderable: Table | str) -> None:
    """Print without wrapping: a console that is not a terminal (a pipe, a file) gets the table's full width."""
    if console.is_terminal or isinstance(renderable, str):
        console.print(renderable, soft_wrap=isinstance(renderable, str))
        return
    width = console.measure(renderable, options=console.options.update_width(4000)).maximum
    Console(file=console.file, width=max(width, console.width), no_color=console.no_color, color_system=None).print(
        renderable
    )


def show(reports: list[dict], console: Console) -> None:
    for r in reports:
        _print(console, table(r))
        for note in notes(r):
            _print(console, note)
        line = memory_line(r)
        if line:
            _print(console, line)


def show_scaling(reports: list[dict], console: Console) -> None:
    """The scaling table, when the reports differ in tensor count."""
    if len({r["tensors"] for r in reports}) > 1:
        _print(console, scaling(reports))


def write_json(reports: list[dict], path: str) -> None:
    """`path` "-" (`--json` alone) prints to stdout, where the JSON is the only output."""
    if path == "-":
        sys.stdout.write(json.dumps(reports, indent=1) + "\n")
        sys.stdout.flush()
        return
    with open(path, "w") as f:
        json.dump(reports, f, indent=1)


def plot(reports: list[dict], path: str) -> None:
    """Time vs model size and vs receivers, each with the floor line (needs matplotlib; the CLI checks for it before
    the bench runs)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError(
            "--plot needs matplotlib, which is not installed; pip install matplotlib "
            "(or pip install -e '.[plot]' from the refit checkout)"
        ) from None
    if any(r.get("link") for r in reports):
        _plot_link(plt, reports, path)
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, label in ((axes[0], "nbytes", "model size (GB)"), (axes[1], "receivers", "receivers")):
        fixed = reports[0]["config"]["receivers"] if key == "nbytes" else reports[-1]["nbytes"]
        group = [r for r in reports if (r["config"]["receivers"] == fixed if key == "nbytes" else r["nbytes"] == fixed)]
        xs = [r["nbytes"] / 1e9 if key == "nbytes" else r["config"]["receivers"] for r in group]
        for method in LABELS:
            ys = [r["results"][method]["median_s"] * 1e3 for r in group if method in r["results"]]
            if len(ys) == len(xs) and xs:
                ax.plot(xs, ys, marker="o", linestyle="--" if method == "floor" else "-", label=method)
        ax.set_xlabel(label)
        ax.set_ylabel("refit time (ms)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _plot_link(plt, reports: list[dict], path: str) -> None:  # type: ignore[no-untyped-def]
    """Across namespaced links: refit time against the link's rate, one line per transport and method, per
    model; the floor (a raw TCP transfer of the model's bytes) dashed."""
    models = sorted({r["config"]["preset"] for r in reports})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.2), squeeze=False)
    for ax, model in zip(axes[0], models):
        group = sorted((r for r in reports if r["config"]["preset"] == model and r.get("link")),
                       key=lambda r: r["link"]["rate_bits"] or float("inf"))  # fmt: skip
        transports = sorted({r["config"]["transport"] for r in group})
        for transport in transports:
            runs = [r for r in group if r["config"]["transport"] == transport and r["link"]["rate_bits"]]
            xs = [r["link"]["rate_bits"] / 1e9 for r in runs]
            for method in LABELS:
                ys = [r["results"][method]["median_s"] * 1e3 for r in runs if method in r["results"]]
                if len(ys) == len(xs) and xs and (method != "floor" or transport == transports[0]):
                    name = "floor" if method == "floor" else f"{transport} {method}"
                    ax.plot(xs, ys, marker="o", linestyle="--" if method == "floor" else "-", label=name)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("link rate (Gbit/s, tc tbf on a veth between two namespaces)")
        ax.set_ylabel("refit time (ms)")
        ax.set_title(model)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
