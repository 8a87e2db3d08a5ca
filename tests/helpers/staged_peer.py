"""A staged-refit engine process: peer.py's recording engine behind `Receiver(..., staged=True)`.

Its JSON argument is peer.py's plus "actions", a list of "receive" (one refit into staging), "apply"
(`receiver.apply_staged()`) and "generate K" (K refits received in a background thread while the main
thread loops as an engine does: `apply_staged()`, `ensure_current()`, a read of every live tensor; then
one last apply), "loop K" (as "generate K", partial staging: one report per version applied or apply
error, then the action's own; at the first staged load of each refit the receive thread waits until the
loop took a generation step, recorded as "during", so generation provably went on while the staged part
arrived), each answered by one report line: the live engine's state, version, staged
version and fingerprints, the staging tensors' fingerprints, and the versions `on_commit` saw so far.
"corrupt_staging" {"version", "name"} changes one staged element after that version's first load holding
the name (before the fingerprint check), once. `on_commit` calls from a thread other than the main one
(the engine loop's) are recorded negated in "commits". With "index", "rendezvous" is every trainer rank's (per-rank, as rank_worker.py).
"""

from __future__ import annotations

import json
import queue
import sys
import threading

import torch
from peer import MARK, Peer, RecordingEngine, make_tensors

from refit import Receiver, RefitError, Settings
from refit.checks.fingerprints import fingerprints
from refit.topology.ranked import pick


def _corrupting(receiver: Receiver, fault: dict) -> None:
    staging = receiver.staging
    assert staging is not None
    load = staging.load

    def load_then_corrupt(tensors: list) -> None:
        load(tensors)
        got = staging.held(fault["name"]) if fault and fault["name"] in dict(tensors) else None
        if got is not None and staging.weights.target == fault["version"]:
            got[0].view(-1)[0] += 1
            fault.clear()  # once: the retry of the same version goes through

    staging.load = load_then_corrupt  # type: ignore[method-assign]


def _report(engine: RecordingEngine, receiver: Receiver, commits: list[int], **extra: object) -> dict:
    m = receiver.manifest
    own = {n: t.dtype for n, t in engine.module.items()}
    own.update({n: m.entry(n).spec.dtype for n in m.names} if m else {})  # as the trainer digests them
    staging = receiver.staging
    staged = {} if staging is None else {n: t for n in own if (t := (staging.held(n) or (None,))[0]) is not None}
    w = engine.weights
    return {
        "state": w.state.value,
        "version": w.version,
        "staged": w.staged,
        "fingerprints": fingerprints(engine.module.items(), own, held=True),
        "staging": fingerprints(staged.items(), own, held=True),
        "staging_nbytes": 0 if staging is None else staging.nbytes,
        "commits": list(commits),
        **extra,
    }


def _generate(engine: RecordingEngine, receiver: Receiver, refits: int) -> dict:
    """Receive `refits` refits in a thread while this thread applies and reads the live weights."""
    done = threading.Event()

    def serve() -> None:
        try:
            for _ in range(refits):
                receiver.receive()
        finally:
            done.set()

    thread = threading.Thread(target=serve)
    thread.start()
    steps = applied = 0
    while not done.is_set():
        applied += receiver.apply_staged()
        engine.ensure_current()  # never mixed: the live weights are one committed version at every step
        sum(float(t.float().sum()) for t in engine.module.values())
        steps += 1
    thread.join()
    applied += receiver.apply_staged()
    return {"steps": steps, "applied": applied}


def _await_a_step(receiver: Receiver, asked: queue.Queue, stepped: queue.Queue) -> None:
    """At the first staged load of each refit, the receive thread waits for one step of the engine loop."""
    staging = receiver.staging
    assert staging is not None
    load, seen = staging.load, set()

    def load_after_a_step(tensors: list) -> None:
        version = staging.weights.target
        if version not in seen and any(n not in staging.direct for n, _ in tensors):
            seen.add(version)
            asked.put(version)
            stepped.get(timeout=120)
        load(tensors)

    staging.load = load_after_a_step  # type: ignore[method-assign]


def _loop(engine: RecordingEngine, receiver: Receiver, commits: list[int], refits: int) -> dict:
    """Partial staging: refits received in a thread while this thread loops as an engine does."""
    done, out, last = threading.Event(), {}, {}
    asked: queue.Queue = queue.Queue()
    stepped: queue.Queue = queue.Queue()
    _await_a_step(receiver, asked, stepped)
    during: dict = {}

    def serve() -> None:
        try:
            for _ in range(refits):
                stats = receiver.receive()
                last.update(staged_bytes=stats.staged_bytes, direct_bytes=stats.direct_bytes)
        except Exception as e:  # noqa: BLE001 - reported to the test
            out["receive_error"] = f"{type(e).__name__}: {e}"
        finally:
            done.set()

    thread = threading.Thread(target=serve)
    thread.start()
    while not done.is_set():
        try:
            if receiver.apply_staged():
                print(MARK + json.dumps(_report(engine, receiver, commits, applied=True, during=during,
                                                **last)), flush=True)  # fmt: skip
        except RefitError as e:
            print(MARK + json.dumps(_report(engine, receiver, commits, event="error", message=str(e))), flush=True)
        with_step = engine.weights.state.value == "current"
        if with_step:  # a generation step: only on one committed version
            engine.ensure_current()
            sum(float(t.float().sum()) for t in engine.module.values())
        if with_step and not asked.empty():
            w = engine.weights
            during[str(asked.get())] = {"state": w.state.value, "version": w.version, "fingerprints": _report(
                engine, receiver, commits)["fingerprints"]}  # fmt: skip
            stepped.put(True)
        done.wait(0.002)  # the rest of a generation step
    thread.join()
    return {**out, "split": None if receiver.staging_split is None else receiver.staging_split.describe()}


def main() -> int:
    args = json.loads(sys.argv[1])
    engine = RecordingEngine(make_tensors(args["specs"], args.get("seed", 99)), args.get("fault"))
    if args.get("assume") is not None:
        engine.assume_current(args["assume"])
    settings = Settings(bucket_bytes=args.get("bucket_bytes"), timeout_s=args.get("timeout_s", 60.0))
    rendezvous = args["rendezvous"]
    if "index" in args:
        rendezvous = pick(rendezvous, torch.device("cpu"), index=args["index"])
    commits: list[int] = []

    def on_commit(version: int) -> None:
        commits.append(version if threading.current_thread() is threading.main_thread() else -version)

    with Receiver(engine, rendezvous, settings=settings, staged=True, on_commit=on_commit,
                  staging_bytes=args.get("staging_bytes")) as receiver:  # fmt: skip
        if args.get("corrupt_staging"):
            _corrupting(receiver, args["corrupt_staging"])
        for action in args["actions"]:
            extra: dict = {"action": action}
            try:
                if action.startswith("loop "):
                    extra.update(_loop(engine, receiver, commits, int(action.split()[1])))
                elif action.startswith("generate "):
                    extra.update(_generate(engine, receiver, int(action.split()[1])))
                elif action == "receive":
                    stats = receiver.receive()
                    extra["event"] = "closed" if stats is None else "refit"
                    extra["unverified"] = None if stats is None else stats.unverified
                else:
                    extra["applied"] = receiver.apply_staged()
            except RefitError as e:
                extra.update(event="error", type=type(e).__name__, message=str(e))
            print(MARK + json.dumps(_report(engine, receiver, commits, **extra)), flush=True)
    return 0


class StagedPeer(Peer):
    """Starts staged_peer.py as a child process and reads its reports (as peer.Peer)."""

    SCRIPT = __file__


if __name__ == "__main__":
    raise SystemExit(main())
