"""The demo's report: one row per refit (80 columns by default, every stage with --wide or -v), the legends
for what was asked, wrapped to the terminal, and the lines under the table."""

from __future__ import annotations

import textwrap

from rich.console import Console
from rich.table import Table

TRAINER_STAGES = ("handshake", "pack", "send", "wait", "verify", "commit")
"""The Sender's stages (RefitStats.seconds), timed one after another in its thread: with 'other' they add up to
'total'."""
ENGINE_STAGES = ("load", "verify")
"""The engine's own stages shown beside them (the Receiver's RefitStats.seconds, in the engine's process)."""
PIPE_WIDTH = 80
"""Where a legend wraps when the output is not a terminal (a pipe, a file)."""

LEGEND = (
    "ms: the refit's wall time, from its handshake to the engine's commit. MB: the model's bytes in their wire "
    "dtypes; wire MB: the bytes that crossed the link. epoch*: a handshake began a new epoch (the manifest "
    "went out again). params: every engine tensor bitwise what was sent; gen: the engine's greedy output "
    "equals the trainer's. --wide (or -v) shows each stage of the refit."
)
STAGES_LEGEND = (
    "The trainer's stages run one after another and add up to total: handshake (at a new epoch the manifest out "
    "and the engine's report back, else the check that no shape or dtype changed), pack (each bucket copied and "
    "cast into its buffer, the live tensors digested on the way), send (the bucket handed to the transport), wait "
    "(until each bucket was off the wire and acknowledged by the engine), verify (the trainer's digests sent), "
    "commit (from COMMIT sent until the engine's DONE: the engine's fingerprint check, then its own commit), other "
    "(what the stages leave of total). engine load and engine verify are the engine's own time, in its own process, "
    "overlapping the trainer's: it loads bucket i while the trainer packs the next; its verify (digests of what it "
    "holds, compared with the trainer's) starts when the trainer's digests arrive and is most of commit."
)
LORA_LEGEND = "--lora: MB is the adapter's bytes; full MB the whole model's in bf16, what a full refit would move."
DELTA_LEGEND = (
    "--delta: Δ marks a refit where some buckets went as a delta (only the wire units changed since the last "
    "commit); Δ bkts: those buckets of all; the lines under the table say why the others went full."
)
FULL_WHY = {
    "full-base": "a full refit (the first of an epoch)",
    "full-link": "the link moved them faster than the scan for changed values pays",
    "full-dense-sample": "too many values changed (seen by the sample)",
    "full-dense-scan": "too many values changed (seen by the whole compare)",
    "full-unkept": "found dense lately, not kept in the image",
    "full-reprime": "kept in the image again after being dense",
}
"""Why a bucket went full under --delta, per way `RefitStats.buckets` counts it."""


def demo_table(transport: str, rows: list[dict], *, wide: bool = False) -> Table:
    """The refits over `transport`: version, what moved, how long, verified and generation equal (fits 80
    columns); `wide`: every stage of both sides too."""
    if wide:
        return _wide_table(transport, rows)
    t = Table(title=f"refits over {transport}")
    full = any("full_model_bytes" in r for r in rows)
    delta = any(r.get("delta") for r in rows)
    columns = ("ver", "epoch", "loss", "MB", *(("full MB",) if full else ()), "wire MB")
    for col in (*columns, *(("Δ bkts",) if delta else ()), "ms", "params", "gen"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(
            *_moved(r, full),
            *((f"{r.get('buckets', {}).get('delta', 0)}/{r['num_buckets']}",) if delta else ()),
            _ms(r["seconds"], "total"),
            _mark(r["params_ok"]),
            _mark(r["generate_ok"]),
        )
    return t


def _wide_table(transport: str, rows: list[dict]) -> Table:
    t = Table(title=f"refits over {transport}")
    full = any("full_model_bytes" in r for r in rows)  # LoRA: the adapter's MB beside the whole model's
    columns = ("ver", "epoch", "loss", "MB", *(("full MB",) if full else ()), "wire MB", "bkts", *TRAINER_STAGES)
    columns = (*columns, "other", "total", "GB/s")
    for col in (*columns, *(f"engine {k}" for k in ENGINE_STAGES), "params", "gen"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(
            *_moved(r, full),
            str(r["num_buckets"]),
            *(_ms(r["seconds"], k) for k in (*TRAINER_STAGES, "other", "total")),
            f"{r['gbps']:.2f}",
            *(_ms(r["engine_seconds"], k) for k in ENGINE_STAGES),
            _mark(r["params_ok"]),
            _mark(r["generate_ok"]),
        )
    return t


def _moved(r: dict, full: bool) -> tuple[str, ...]:
    return (
        str(r["version"]),
        f"{r['epoch']}{'*' if r['handshake'] else ''}",
        f"{r['loss']:.3f}",
        f"{r['nbytes'] / 1e6:.1f}",
        *((f"{r.get('full_model_bytes', 0) / 1e6:.1f}",) if full else ()),
        wire_mb(r),
    )


def _mark(ok: bool) -> str:
    return "[green]✓[/]" if ok else "[red]✗[/]"


def _ms(d: dict, k: str) -> str:
    return "n/a" if d.get(k) is None else f"{d[k] * 1e3:.1f}"


def wire_mb(r: dict) -> str:
    """What crossed the link; 'Δ' marks a delta refit (only the chunks changed since the last commit)."""
    wire = r["wire_bytes"] if r.get("delta") else r.get("wire_bytes") or r["nbytes"]
    return f"{wire / 1e6:.1f}{' Δ' if r.get('delta') else ''}"


def delta_lines(rows: list[dict]) -> list[str]:
    """Per refit under --delta: how many buckets went as a delta, and why the rest went full."""
    lines = []
    for r in rows:
        ways = dict(r.get("buckets") or {})
        went = ways.pop("delta", 0)
        why = "; ".join(f"{n} {FULL_WHY.get(way, way)}" for way, n in sorted(ways.items()) if n)
        lines.append(
            f"version {r['version']}: {went} of {r['num_buckets']} bucket(s) as a delta"
            + (f"; full: {why}" if why else "")
        )
    return lines


def legends(*, wide: bool, lora: bool, delta: bool, dtype_legend: str = "") -> list[str]:
    """The legends for what was asked: the table's own, the stages' with --wide, one per flag given
    (`dtype_legend`: the engine dtype's)."""
    return [
        LEGEND,
        *((STAGES_LEGEND,) if wide else ()),
        *((LORA_LEGEND,) if lora else ()),
        *((DELTA_LEGEND,) if delta else ()),
        *((dtype_legend,) if dtype_legend else ()),
    ]


def print_wrapped(console: Console, text: str) -> None:
    """`text` wrapped to the terminal's width, or to PIPE_WIDTH in a pipe or a file."""
    width = console.width if console.is_terminal else PIPE_WIDTH
    console.print(textwrap.fill(text, width=max(40, width)), highlight=False, markup=False, soft_wrap=True)
