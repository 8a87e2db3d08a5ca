"""`refit verify-root`: whether every worker of a vLLM server holds the trainer's version, proven by its root.

The trainer records (version, root) per committed refit (`RefitStats.version`, `RefitStats.root`); each worker
answers its own (version, root) read together (`RefitWorkerExtension.refit_root`, through vLLM's dev-mode
/collective_rpc route). A worker agrees when both are equal; one that reads the same version with another root
holds other bytes than the trainer sent for it (a label drifted from the weights, or a tensor changed after
the commit), and a router should not send it that version's traffic.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

from rich.console import Console
from rich.markup import escape


def verdicts(version: int, root: str, readings: Sequence[object]) -> list[tuple[str, str]]:
    """Per worker: ("ok" | "stale" | "differs" | "unreadable", detail), for the trainer's `version` and `root`."""
    out = []
    for i, r in enumerate(readings):
        if not isinstance(r, dict) or not isinstance(r.get("root"), str) or not isinstance(r.get("version"), int):
            out.append(("unreadable", f"worker {i} answered {str(r)[:200]!r}, not {{'version', 'root'}}"))
        elif r["version"] != version:
            out.append(("stale", f"worker {i} holds version {r['version']}, not {version}"))
        elif r["root"] != root.lower():
            out.append(("differs", f"worker {i} reads version {version} with root {r['root']}, not {root}"))
        else:
            out.append(("ok", f"worker {i} holds version {version} (root {root})"))
    return out


def _expected(args: argparse.Namespace) -> tuple[int, str]:
    """(version, root) from --version and --root, or from a RefitStats JSON file (--stats)."""
    if args.stats:
        with open(args.stats) as f:
            raw = json.load(f)
        if not isinstance(raw, dict) or not isinstance(raw.get("version"), int) or not raw.get("root"):
            raise ValueError(f"--stats {args.stats} must be a RefitStats JSON with 'version' and a non-empty 'root'")
        return raw["version"], raw["root"]
    if args.expect_version is None or not args.expect_root:
        raise ValueError("give the trainer's --expect-version and --expect-root, or --stats FILE (its RefitStats JSON)")
    return args.expect_version, args.expect_root


def _readings(args: argparse.Namespace) -> list[object]:
    if args.readings:
        with open(args.readings) as f:
            raw = json.load(f)
        return raw if isinstance(raw, list) else [raw]
    from refit.integrations.vllm.driver import HttpEngine

    return HttpEngine(args.server, timeout_s=args.timeout).collective_rpc("refit_root")


def run(args: argparse.Namespace, console: Console) -> int:
    version, root = _expected(args)
    found = verdicts(version, root, _readings(args))
    if not found:
        raise ValueError("no worker answered: is the server running refit's worker extension?")
    if args.json:
        text = json.dumps([{"verdict": v, "detail": d} for v, d in found])
        if args.json == "-":
            print(text)  # noqa: T201 - the command's output
        else:
            with open(args.json, "w") as f:
                f.write(text)
    for verdict, detail in found:
        colour = "green" if verdict == "ok" else "red"
        console.print(f"[{colour}]{verdict}[/] {escape(detail)}", highlight=False)
    return 0 if all(v == "ok" for v, _ in found) else 1


def add_parser(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "verify-root",
        parents=[common],
        help="check that every worker of a vLLM server holds the trainer's version, by its root",
        description="Read each worker's (version, root) from a vLLM server (VLLM_SERVER_DEV_MODE=1, refit's worker "
        "extension) or a JSON file, and compare with the trainer's. Exit code 1 when any worker differs.",
    )
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--server", help="the vllm serve URL, e.g. http://localhost:8000")
    where.add_argument("--readings", metavar="FILE", help="a JSON list of the workers' {'version', 'root'}")
    p.add_argument("--stats", metavar="FILE", help="the trainer's RefitStats of the version, as JSON")
    p.add_argument("--expect-version", type=int, help="the trainer's version (without --stats)")
    p.add_argument("--expect-root", help="the trainer's root of that version (without --stats)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the server")
    p.add_argument("--json", nargs="?", const="-", metavar="FILE", help="the verdicts as JSON: to stdout, or FILE")
    p.set_defaults(func=run)
