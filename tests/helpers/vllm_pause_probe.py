"""Measures how long generation stalls while a refit runs through vLLM's trainer-side API: a vLLM server on
CPU streams one long completion while `send_weights()` runs (backend 'refit', vLLM's HTTP client and
ModuleSource), unstaged (the whole refit inside vLLM's engine loop) or `--staged` (bytes into staging memory
on a worker thread while vLLM generates, then paused with mode 'keep' for the final copy only). Prints one
JSON line: the refit's wall time, the median gap between streamed tokens away from the refit, the longest
gap overlapping it (the pause generation saw), and (staged) the pause the trainer timed from /pause to
/resume. A probe, not a test.

    python tests/helpers/vllm_pause_probe.py [--layers 2 --hidden 256 --refits 3] [--staged]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
import urllib.request


def stream_arrivals(base: str, model_dir: str, prompt: list[int], started: threading.Event) -> list[float]:
    """perf_counter() at each streamed chunk of one long greedy completion; `started` is set at the 10th."""
    body = {"model": model_dir, "prompt": prompt, "max_tokens": 240, "temperature": 0, "ignore_eos": True,
            "stream": True}  # fmt: skip
    req = urllib.request.Request(f"{base}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    times: list[float] = []
    with urllib.request.urlopen(req, timeout=600) as resp:
        for line in resp:
            if line.startswith(b"data: {"):
                times.append(time.perf_counter())
                if len(times) == 10:
                    started.set()
    return times


def worker_seconds(base: str) -> dict[str, float]:
    """The worker's engine time for the last refit ('copy', 'post', 'load'), through vLLM's /collective_rpc."""
    req = urllib.request.Request(f"{base}/collective_rpc", data=json.dumps({"method": "refit_engine_seconds"}).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    return json.loads(urllib.request.urlopen(req, timeout=60).read())["results"][0]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--refits", type=int, default=3)
    ap.add_argument("--staged", action="store_true")
    args = ap.parse_args()
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, ModuleSource, WeightTransferTrainerFactory
    from vllm_server import serving

    from refit import Settings
    from refit.integrations.vllm import RefitTrainerInitInfo
    from refit.tools.demo.model import PROMPTS, build_model, build_tokenizer, model_config, save

    tok = build_tokenizer()
    model = build_model(model_config(layers=args.layers, hidden=args.hidden, ffn=3 * args.hidden), seed=0)
    rows = []
    extension = ("--worker-extension-cls", "refit.integrations.vllm.RefitWorkerExtension")  # engine seconds
    with tempfile.TemporaryDirectory() as tmp, serving(save(model, tok, tmp), *extension) as base:
        model_dir, prompt = tmp, tok(PROMPTS[0])["input_ids"]
        info = RefitTrainerInitInfo(
            rank=0, transport="shm", settings=Settings(bucket_bytes=1 << 20), staged=args.staged
        )
        engine = WeightTransferTrainerFactory.trainer_init(
            info, client=HTTPVLLMWeightSyncClient(base), source=ModuleSource(model)
        )
        engine.send_weights()  # the handshake and the copy plan: once per session, not measured
        for _ in range(args.refits):
            started, out = threading.Event(), {}
            reader = threading.Thread(target=lambda: out.update(t=stream_arrivals(base, model_dir, prompt, started)))
            reader.start()
            started.wait()
            t0 = time.perf_counter()
            stats = engine.send_weights()
            t1 = time.perf_counter()
            reader.join()
            times = out["t"]
            gaps = [(a, b) for a, b in zip(times, times[1:])]
            away = [b - a for a, b in gaps if b < t0 or a > t1]
            over = [b - a for a, b in gaps if b >= t0 and a <= t1]
            row = {"refit_s": t1 - t0, "median_gap_s": statistics.median(away), "pause_s": max(over or [0.0])}
            worker = worker_seconds(base)
            row |= {"load_s": worker["load"], "post_s": worker["post"]}
            if args.staged:
                row["bracket_s"] = stats.seconds["pause"]
            rows.append(row)
        engine.shutdown()
    summary = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    out = {"layers": args.layers, "hidden": args.hidden, "staged": args.staged, "rows": rows, "median": summary}
    print("@@pause " + json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
