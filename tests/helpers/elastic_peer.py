"""An engine process for the elastic tests: peer.py's recording engine behind a Receiver that may leave.

Run as `python tests/helpers/elastic_peer.py '<json>'` with peer.py's arguments plus `leave_after` (a
version: after committing it, the receiver says LEAVE with `reason` and exits 0), `close_after` (the same
with a plain `Receiver.close()`) or `stall_regroup` (seconds its engine stalls before joining a new group). Reports JSON lines on
stdout as peer.py does (event "refit", "error" or "left"), after "started" once its imports are done.
"""

from __future__ import annotations

import json
import sys
import time

import torch
from peer import MARK, Peer, RecordingEngine, _report, make_tensors

from refit import PeerError, Receiver, RefitError, Settings


def main() -> int:
    args = json.loads(sys.argv[1])
    print(MARK + json.dumps({"event": "started"}), flush=True)
    engine = RecordingEngine(make_tensors(args["specs"], args.get("seed", 99)), args.get("fault"))
    settings = Settings(bucket_bytes=args.get("bucket_bytes"), timeout_s=args.get("timeout_s", 60.0))
    rendezvous = {**args["rendezvous"], **args.get("override", {})}
    receiver = Receiver(engine, rendezvous, settings=settings, device=torch.device("cpu"))
    if "stall_regroup" in args:  # an engine that never gets round to joining a new group (the fault under test)
        engine.release_buffers = lambda: time.sleep(args["stall_regroup"])
    try:
        while True:
            try:
                stats = receiver.receive()
            except RefitError as e:
                report = _report(engine, receiver, event="error", type=type(e).__name__, message=str(e))
                print(MARK + json.dumps(report), flush=True)
                if isinstance(e, PeerError):
                    return 3
                continue
            if stats is None:
                return 0
            print(
                MARK + json.dumps(_report(engine, receiver, event="refit", rank=receiver.rank, stats=stats.to_json())),
                flush=True,
            )
            engine.events = []
            if stats.version == args.get("leave_after"):
                receiver.leave(args.get("reason", "leaving"))
                print(MARK + json.dumps({"event": "left"}), flush=True)
                return 0
            if stats.version == args.get("close_after"):
                receiver.close()
                print(MARK + json.dumps({"event": "closed"}), flush=True)
                return 0
    finally:
        receiver.close()


class ElasticPeer(Peer):
    """Starts this script as a child process and reads its reports; `started()` waits for its imports."""

    SCRIPT = __file__

    def __init__(self, args: dict) -> None:
        super().__init__(args)
        self._started = False

    def started(self) -> None:
        """Wait (unbounded: a process start on a loaded machine) until its imports are done, so that a
        timeout after this bounds only its connection."""
        assert super().report() == {"event": "started"}
        self._started = True

    def report(self) -> dict:
        if not self._started:
            self.started()
        return super().report()


if __name__ == "__main__":
    raise SystemExit(main())
