"""Whether the demo's sizes fit this machine, checked before any process starts (a model too large for
memory otherwise grows both processes for minutes before the kernel kills one)."""

from __future__ import annotations

from collections.abc import Callable

from refit.tools.demo.model import param_count

BYTES_PER_PARAM = 24
"""What trainer and engine hold per parameter together: fp32 weights, gradients and AdamW's two moments
(16), the trainer's reference copy (4), the engine's model (4); the bf16 bucket buffers are bounded apart."""
RANK_BYTES_PER_PARAM = 8
"""Every further trainer rank builds the full model and its reference before sharding."""
PROCESS_BYTES = 512 << 20
"""One Python process with torch and transformers imported."""
_GB = 1e9
MAX_BUCKETS = 4096
"""More buckets than this in one refit of the demo model is a mistake, not a setting: each bucket is a round trip
with the engine, so 196,678 buckets of 256 bytes take minutes a refit."""


def demo_bytes(*, layers: int, hidden: int, trainer_processes: int) -> int:
    """About what the demo's processes hold at once (the trainer's ranks and one engine)."""
    params = param_count(layers=layers, hidden=hidden, ffn=hidden * 3)
    per_param = BYTES_PER_PARAM + RANK_BYTES_PER_PARAM * (trainer_processes - 1)
    return params * per_param + PROCESS_BYTES * (trainer_processes + 1)


def check_fits(sizes: dict[str, int], options: list[str], free: int) -> None:
    """Refuse `sizes` (layers, hidden, processes) that would not fit in `free` bytes, naming the first of
    `options` (the ones the user gave, as "--layers") that can be lowered to fit, with its largest value."""
    need = demo_bytes(layers=sizes["layers"], hidden=sizes["hidden"], trainer_processes=sizes["processes"])
    if need <= free:
        return
    given = " ".join(f"{o} {sizes[_KEYS[o]]}" for o in options) or "the default sizes"
    head = f"{given} make{'s' if len(options) == 1 else ''} a demo of about {need / _GB:.1f} GB"
    head += f"; this machine has {free / _GB:.1f} GB free"
    for option in options:
        most = _largest(option, sizes, free)
        if most is not None:
            raise ValueError(f"{head}: give at most {option} {most}")
    raise ValueError(f"{head}: give smaller sizes")


_KEYS = {"--layers": "layers", "--hidden": "hidden", "--ranks": "processes"}
_STEP = {"--hidden": 256}  # hidden: a multiple of 256 always passes the head-count check


def _largest(option: str, sizes: dict[str, int], free: int) -> int | None:
    """The largest value of `option` that fits with the other sizes as given; None when not even the least does."""
    key, step = _KEYS[option], _STEP.get(option, 1)

    def fits(n: int) -> bool:
        s = {**sizes, key: n * step}
        return demo_bytes(layers=s["layers"], hidden=s["hidden"], trainer_processes=s["processes"]) <= free

    return None if not fits(1) else _bisect(fits, 1, sizes[key] // step) * step


def _bisect(fits: Callable[[int], bool], lo: int, hi: int) -> int:
    """The largest n in [lo, hi] with fits(n), given fits(lo) and fits monotone decreasing."""
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def check_buckets(bucket_bytes: int, option: str, *, layers: int, hidden: int) -> None:
    """Refuse a bucket capacity (`option`: where it came from) that splits the demo's model into more than
    MAX_BUCKETS buckets, naming the count and the least capacity that does not."""
    nbytes = 2 * param_count(layers=layers, hidden=hidden, ffn=hidden * 3)  # bf16 on the wire
    count = -(-nbytes // bucket_bytes)
    if count > MAX_BUCKETS:
        least = 1 << (-(-nbytes // MAX_BUCKETS) - 1).bit_length()
        raise ValueError(
            f"{option} {bucket_bytes} splits the demo's {nbytes / 1e6:.1f} MB model into about {count:,} buckets, "
            f"each a round trip with the engine (minutes a refit); give at least {least} (the default is 8388608)"
        )
