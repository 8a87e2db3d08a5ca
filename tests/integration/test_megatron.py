"""A megatron-core GPTModel trainer (TP and PP over gloo, CPU) refits into a transformers engine under
Hugging Face names: bitwise against the trainer's live weights after every refit, with a dtype change.

The layout test needs only transformers; the others need megatron-core (the `megatron` extra).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import warm
from locations import helper, pythonpath
from trainer_ranks import free_port, line

from refit.sources.megatron_layout import GptLayout, merge
from refit.tools.cli import main
from refit.tools.demo.model import model_config

MODEL = {"layers": 2, "hidden": 512, "ffn": 1024}
"""8 query heads in 2 groups of 64-dim heads: TP=2 splits the groups; PP=2 gives each stage a layer."""
BUCKET = 1 << 20


VOCAB, PADDED = 1000, 1024
"""The HF vocabulary, and Megatron's rows for it at TP=2 (make_vocab_size_divisible_by=512 x TP)."""


def _layout(tp: int, vocab: int | None = None, padded: int = 0) -> GptLayout:
    c = model_config(**MODEL)
    pad = {"padded_vocab_size": padded} if padded else {}
    return GptLayout(num_layers=c.num_hidden_layers, hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads,
                     num_query_groups=c.num_key_value_heads, head_dim=c.head_dim, ffn_hidden_size=c.intermediate_size,
                     vocab_size=vocab or c.vocab_size, tp=tp, **pad)  # fmt: skip


@pytest.mark.parametrize("tp", [1, 2])
def test_layout_names_shapes_and_split_match_the_hf_model(tp: int) -> None:
    from refit.tools.demo.model import build_model

    hf = build_model(model_config(**MODEL), seed=0).state_dict()
    layout = _layout(tp)
    assert layout.hf_shapes() == {n: tuple(t.shape) for n, t in sorted(hf.items())}
    # Megatron's TP shards built from the HF tensors by hand (per group: its q heads, then k, then v;
    # per rank: [gate; up]) convert back both ways: concatenated first (as full_weights does), or
    # each shard first and the pieces concatenated (as MegatronSource gathers).
    p, c = "model.layers.1.", model_config(**MODEL)
    d, ng = c.head_dim, c.num_key_value_heads
    q, k, v = (hf[p + f"self_attn.{x}_proj.weight"] for x in "qkv")
    per = c.num_attention_heads // ng
    groups = [torch.cat([q[g * per * d : (g + 1) * per * d], k[g * d : (g + 1) * d], v[g * d : (g + 1) * d]])
              for g in range(ng)]  # fmt: skip
    qkv = [torch.cat(groups[r * ng // tp : (r + 1) * ng // tp]) for r in range(tp)]
    gate, up = hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]
    fc1 = [torch.cat([gate.chunk(tp)[r], up.chunk(tp)[r]]) for r in range(tp)]
    down = hf[p + "mlp.down_proj.weight"]
    for key, shards, dim, expected in [("1.qkv", qkv, 0, [q, k, v]), ("1.fc1", fc1, 0, [gate, up]),
                                       ("1.fc2", list(down.chunk(tp, dim=1)), 1, [down])]:  # fmt: skip
        assert all(map(torch.equal, layout.to_hf(key, torch.cat(shards, dim=dim)), expected))
        pieces = [layout.to_hf(key, shard, ranks=1) for shard in shards]
        for j, want in enumerate(expected):
            got = merge(torch.stack([piece[j].contiguous() for piece in pieces]), dim, tuple(want.shape))
            assert torch.equal(got, want), (key, j)


def test_a_padded_vocabulary_is_gathered_padded_and_sent_as_the_checkpoint_vocabulary() -> None:
    """Megatron's 1024 rows at TP=2 (512 per rank, the last 24 padding) against the checkpoint's 1000."""
    layout = _layout(2, VOCAB, PADDED)
    assert layout.slots["embed"].shape == layout.slots["output"].shape == (PADDED, 512)
    shapes = layout.hf_shapes()
    assert shapes["model.embed_tokens.weight"] == shapes["lm_head.weight"] == (VOCAB, 512)
    assert layout.hf_shapes(padded=True)["lm_head.weight"] == (PADDED, 512)
    full = torch.randn(PADDED, 512)
    for key in ("embed", "output"):
        assert torch.equal(layout.to_hf(key, full)[0], full[:VOCAB])  # the global tensor: trimmed
        shards = [layout.to_hf(key, shard, ranks=1)[0] for shard in full.chunk(2)]  # shards: kept whole
        merged = merge(torch.stack(shards), 0, layout.hf_shapes(padded=True)["lm_head.weight"])
        assert torch.equal(layout.trim(key, merged), full[:VOCAB])


@pytest.mark.parametrize(("vocab", "padded", "message"), [
    (1100, 1024, r"vocab_size \(1100\) must be at least 1 and at most the model's padded vocabulary \(1024 rows\)"),
    (1000, 1001, r"padded_vocab_size \(1001\) must be divisible by the tensor-parallel size \(2\)"),
])  # fmt: skip
def test_a_vocabulary_that_the_padded_rows_cannot_hold_is_refused(vocab: int, padded: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _layout(2, vocab, padded)


def test_an_unpadded_odd_checkpoint_vocabulary_needs_only_the_padded_rows_divisible() -> None:
    assert _layout(2, 1001, 1024).hf_shapes()["lm_head.weight"] == (1001, 512)


def test_local_and_transformer_engine_names_fill_the_same_slots_at_the_stage_offset() -> None:
    layout = _layout(1)
    for local, te in [("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"),
                      ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight")]:  # fmt: skip
        assert layout.slot_of(f"decoder.layers.0.{local}", 1) == layout.slot_of(f"decoder.layers.0.{te}", 1)
    assert layout.slot_of("decoder.layers.0.self_attention.linear_qkv.weight", 1) == "1.qkv"
    assert layout.slot_of("decoder.layers.0.self_attention.linear_qkv._extra_state") is None


def test_layout_rejects_a_tp_size_that_does_not_divide_the_query_groups() -> None:
    with pytest.raises(ValueError, match=r"num_query_groups \(2\) must be divisible by the tensor-parallel size \(4\)"):
        _layout(4)


def _start(args: dict, world: int) -> list[subprocess.Popen]:
    port = free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "PYTHONPATH": pythonpath()}  # fmt: skip
        procs.append(warm.popen([sys.executable, helper("megatron_trainer.py"), json.dumps(args)],
                                      env=env, text=True, stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL))  # fmt: skip
    return procs


class Engine:
    """refit.tools.demo.engine: a transformers Llama behind a Receiver, reporting fingerprints and greedy output."""

    def __init__(self, rendezvous: dict, prompts: list, arch: str) -> None:
        args = {"rendezvous": rendezvous, "model": {**MODEL, "arch": arch}, "prompts": prompts, "bucket_bytes": BUCKET}
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        self.proc = warm.popen([sys.executable, "-m", "refit.tools.demo.engine", json.dumps(args)],
                                     stdout=subprocess.PIPE, text=True, env=env)  # fmt: skip

    def report(self) -> dict:
        from refit.tools.demo.engine import MARK

        assert self.proc.stdout is not None
        for text in self.proc.stdout:
            if text.startswith(MARK):
                return json.loads(text[len(MARK) :])
        raise AssertionError(f"engine exited with {self.proc.wait()} before reporting")


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "pp", "transport", "arch"), [(2, 2, "gloo", "llama"), (2, 1, "shm", "qwen2")])
def test_megatron_trainer_refits_bitwise_under_hf_names_gathering_per_bucket(
    tp: int, pp: int, transport: str, arch: str
) -> None:
    """qwen2: q/k/v biases split like their weights; lm_head tied to the embedding, sent once under both names."""
    pytest.importorskip("megatron.core", reason="needs megatron-core: pip install -e '.[megatron]'")
    from refit.tools.demo.model import PROMPTS, build_tokenizer

    tok = build_tokenizer()
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    steps = 3
    ranks = _start({"tp": tp, "pp": pp, "transport": transport, "bucket_bytes": BUCKET, "steps": steps,
                    "dtype_change_at": 3, "model": {**MODEL, "arch": arch}}, world=tp * pp)  # fmt: skip
    engine = Engine(line(ranks[0]), prompts, arch)
    try:
        if pp == 1:  # the conversion itself: megatron's forward equals HF's with the converted weights
            assert line(ranks[0])["logits_gap"] < 1e-4
        for version in range(1, steps + 1):
            sent, got = line(ranks[0]), engine.report()
            assert "error" not in sent, sent["error"]
            assert got["event"] == "refit" and got["version"] == version
            assert got["fingerprints"] == sent["fingerprints"]  # the trainer's live weights, bitwise
            assert got["generated"] == sent["generated"]
            assert sent["stats"]["num_buckets"] > 4
            assert set(sent["gathers"].values()) == {version}, sent["gathers"]  # every parameter once per refit
            # the leader holds one bucket's tensors at a time: whole, in fp32 (2 x the bf16 bucket)
            assert 0 < sent["peak"] <= sent["predicted"] <= 2 * BUCKET < sent["model_bytes"] / 4
        assert sent["stats"]["epoch"] == 2  # the dtype change at the last step re-handshook
    finally:
        assert [p.wait(timeout=120) for p in ranks] == [0] * len(ranks)
        assert engine.proc.wait(timeout=120) == 0


@pytest.mark.slow
def test_megatron_moe_refits_bitwise_under_per_expert_checkpoint_names() -> None:
    """Qwen3-MoE over PP=2: the router as mlp.gate, each expert's fc1/fc2 as gate/up/down, q/k norms; the
    engine holds the checkpoint names transformers saves and vLLM loads (a state-dict engine: transformers
    fuses experts in its modules)."""
    pytest.importorskip("megatron.core", reason="needs megatron-core: pip install -e '.[megatron]'")
    from peer import Peer

    model = {**MODEL, "arch": "qwen3_moe"}
    ranks = _start({"tp": 1, "pp": 2, "transport": "gloo", "bucket_bytes": BUCKET, "steps": 2, "dtype_change_at": 2,
                    "model": model, "check_logits": True}, world=2)  # fmt: skip
    c = model_config(**model)
    layout = GptLayout(num_layers=c.num_hidden_layers, hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads,
                       num_query_groups=c.num_key_value_heads, head_dim=c.head_dim, ffn_hidden_size=c.intermediate_size,
                       vocab_size=c.vocab_size, qk_norm=True, num_experts=c.num_experts,
                       moe_ffn_hidden_size=c.moe_intermediate_size)  # fmt: skip
    specs = [[n, list(shape), "float32"] for n, shape in layout.hf_shapes().items()]
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in layout.hf_shapes()
    peer = Peer({"rendezvous": line(ranks[0]), "specs": specs, "bucket_bytes": BUCKET})
    try:
        assert line(ranks[0])["logits_gap"] < 1e-4  # megatron's MoE forward equals transformers' Qwen3-MoE
        for version in (1, 2):
            sent, got = line(ranks[0]), peer.report()
            assert "error" not in sent, sent["error"]
            assert got["fingerprints"] == sent["fingerprints"] and got["version"] == version
            assert set(sent["gathers"].values()) == {version}, {
                k: v for k, v in sent["gathers"].items() if v != version
            }
        assert sent["stats"]["epoch"] == 2
    finally:
        assert [p.wait(timeout=120) for p in ranks] == [0, 0]
        peer.wait(timeout=120)


@pytest.mark.slow
def test_a_padded_megatron_vocabulary_refits_bitwise_into_an_hf_shaped_module_engine() -> None:
    """Vocabulary 1000 padded to 1024 at TP=2: the engine holds the checkpoint's 1000 rows; the handshake
    passes, the padded rows are cut after the gather, and every refit is bitwise (and fingerprint-verified)."""
    pytest.importorskip("megatron.core", reason="needs megatron-core: pip install -e '.[megatron]'")
    from peer import Peer

    ranks = _start({"tp": 2, "pp": 1, "transport": "gloo", "bucket_bytes": BUCKET, "steps": 2, "dtype_change_at": -1,
                    "model": MODEL, "vocab": VOCAB, "padded_vocab": PADDED}, world=2)  # fmt: skip
    specs = [[n, list(shape), "float32"] for n, shape in _layout(2, VOCAB).hf_shapes().items()]
    assert ["model.embed_tokens.weight", [VOCAB, 512], "float32"] in specs
    peer = Peer({"rendezvous": line(ranks[0]), "specs": specs, "bucket_bytes": BUCKET})
    try:
        assert line(ranks[0])["logits_gap"] < 1e-4  # the trimmed weights are Megatron's model, padding aside
        for version in (1, 2):
            sent, got = line(ranks[0]), peer.report()
            assert "error" not in sent, sent["error"]
            assert got["fingerprints"] == sent["fingerprints"] and got["version"] == version
            assert set(sent["gathers"].values()) == {version}
    finally:
        assert [p.wait(timeout=300) for p in ranks] == [0, 0]
        peer.wait(timeout=300)


@pytest.mark.vllm
@pytest.mark.slow
def test_a_padded_megatron_vocabulary_refits_into_vllm_and_verifies() -> None:
    """The same trainer into vLLM (in rank 0, from dummy weights of the 1000-row checkpoint): vLLM's
    parameters equal the trainer's live weights after each fingerprint-verified refit."""
    pytest.importorskip("megatron.core", reason="needs megatron-core: pip install -e '.[megatron]'")
    pytest.importorskip("vllm")
    ranks = _start({"tp": 2, "pp": 1, "transport": "shm", "bucket_bytes": BUCKET, "steps": 2, "dtype_change_at": -1,
                    "model": MODEL, "vocab": VOCAB, "padded_vocab": PADDED, "engine": "vllm"}, world=2)  # fmt: skip
    try:
        assert line(ranks[0])["logits_gap"] < 1e-4
        for version in (1, 2):
            sent = line(ranks[0])
            assert "error" not in sent, sent["error"]
            assert sent["version"] == version and sent["vllm_params_ok"], sent
    finally:
        assert [p.wait(timeout=600) for p in ranks] == [0, 0]


@pytest.mark.slow
def test_a_failed_handshake_releases_every_rank_and_the_next_refit_fails_the_same_way() -> None:
    """The engine is Qwen2 (biases, tied lm_head), the trainer Llama: both sides get the sorted report;
    the followers, mid-refit on the leader's broadcast, are released each time and every rank exits."""
    pytest.importorskip("megatron.core", reason="needs megatron-core: pip install -e '.[megatron]'")
    ranks = _start({"tp": 2, "pp": 1, "transport": "gloo", "bucket_bytes": BUCKET, "steps": 2, "dtype_change_at": -1,
                    "model": MODEL}, world=2)  # fmt: skip
    engine = Engine(line(ranks[0]), [[0]], "qwen2")
    try:
        assert line(ranks[0])["logits_gap"] < 1e-4
        for version in (1, 2):
            sent, got = line(ranks[0]), engine.report()
            assert (
                sent["error"].startswith("HandshakeError") and "model.layers.0.self_attn.q_proj.bias" in sent["error"]
            )
            assert got["event"] == "error"
    finally:
        assert [p.wait(timeout=120) for p in ranks] == [0, 0]
        engine.proc.wait(timeout=120)


@pytest.mark.parametrize(("argv", "message"), [
    (["--tp", "2"], "--tp and --pp apply only to --trainer megatron"),
    (["--trainer", "megatron", "--tp", "3"], "--tp 3 must divide the KV heads (2 at hidden 512)"),
])  # fmt: skip
def test_demo_megatron_options_fail_with_the_fix(argv: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    if "megatron" in argv:  # without megatron-core the demo says how to install it first
        pytest.importorskip("megatron.core", reason="needs megatron-core: pip install -e '.[megatron]'")
    assert main(["demo", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.vllm
@pytest.mark.slow
def test_demo_megatron_tp2_into_vllm_verifies_every_refit(capfd: pytest.CaptureFixture,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """vLLM runs in rank 0 of the trainer, in its default multiprocess mode (test_vllm.py switches that off
    for the session; in-process it would deadlock on the trainer's world group, so the demo forces it on)."""
    pytest.importorskip("megatron.core", reason="needs megatron-core: pip install -e '.[megatron]'")
    pytest.importorskip("vllm")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    argv = "demo --trainer megatron --tp 2 --engine vllm --layers 2 --steps 2 --dtype-change-at 1 --transport shm"
    code = main(argv.split())
    out = capfd.readouterr().out
    assert code == 0, out
    assert "TP=2 x PP=1" in out and "all refits verified" in out and out.count("✓") == 4 and "2*" in out


_ALONE = """
import torch, torch.distributed as dist
from refit import Sender
from refit.tools.demo.megatron import MegatronTrainer
from refit.tools.demo.model import build_model, model_config
dist.init_process_group("gloo")
trainer = MegatronTrainer(build_model(model_config(layers=1, hidden=64, ffn=128), seed=0), torch.zeros(1, 8, dtype=torch.long), tp=1, pp=1)
names = [s.name for s in trainer.source.specs()][:1]
try:
    trainer.source.tensors(names)
except ValueError as e:
    print("refused:", e)
"""


@pytest.mark.slow
def test_a_single_rank_source_outside_megatron_refit_is_refused_not_served_stale() -> None:
    """megatron_refit re-reads the live parameters before each refit; a bare Sender.refit would serve the
    ones read at the last pass, so it is refused even when the model-parallel group has one rank."""
    pytest.importorskip("megatron.core")
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "PYTHONPATH": pythonpath()}  # fmt: skip
    r = subprocess.run([sys.executable, "-c", _ALONE], env=env, capture_output=True, text=True)
    assert "refused:" in r.stdout and "megatron_refit" in r.stdout, r.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "pp", "padded"), [(2, 1, 1024), (1, 2, None)])
def test_megatron_ranks_send_their_own_shards_m_to_n_into_one_hf_engine_bitwise(tp: int, pp: int, padded) -> None:
    """M:N (refit.topology.mesh): TP=2 -> one engine (the padded vocabulary trimmed per rank) and PP=2 -> one
    engine; every rank sends only what it holds, nothing is gathered, and the engine holds the live weights."""
    pytest.importorskip("megatron.core", reason="needs megatron-core: pip install -e '.[megatron]'")
    vocab = {"vocab": 1000, "padded_vocab": padded} if padded else {}
    args = {"tp": tp, "pp": pp, "transport": "gloo", "bucket_bytes": BUCKET, "steps": 3, "dtype_change_at": 3,
            "model": MODEL, "engine": "mesh", **vocab}  # fmt: skip
    ranks = _start(args, world=tp * pp)
    info = line(ranks[0])
    worker = {"rendezvous": info, "model": MODEL, **({"vocab": 1000} if padded else {})}
    env = {**os.environ, "PYTHONPATH": pythonpath()}
    engine = warm.popen([sys.executable, helper("mesh_hf_worker.py"), json.dumps(worker)], stdout=subprocess.PIPE,
                              text=True, env=env)  # fmt: skip
    try:
        for version in (1, 2, 3):
            sent = line(ranks[0])
            assert "error" not in sent, sent["error"]
            assert engine.stdout is not None
            got = json.loads(engine.stdout.readline())
            assert got["version"] == version and got["state"] == "current"
            assert got["fingerprints"] == sent["expected"]  # the live weights, bitwise, under HF names
            assert got["nbytes"] == sent["planned"][0] == sent["stats"]["model_bytes"]  # every byte once
        assert sent["stats"]["epoch"] == 2
    finally:
        assert [p.wait(timeout=120) for p in ranks] == [0] * len(ranks)
        assert engine.wait(timeout=120) == 0


@pytest.mark.vllm
@pytest.mark.slow
def test_megatron_tp2_refits_vllm_tp2_m_to_n_each_worker_from_its_own_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """Equal layouts: Megatron TP=2 into vLLM TP=2, each vLLM worker fed by both ranks with only its slices;
    the fingerprint of every pair, vLLM's params kept in checkpoint layout and its greedy output checked."""
    pytest.importorskip("megatron.core", reason="needs megatron-core: pip install -e '.[megatron]'")
    pytest.importorskip("vllm")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the trainer's helper turns it on for vLLM
    args = {"tp": 2, "pp": 1, "transport": "shm", "bucket_bytes": BUCKET, "steps": 2, "dtype_change_at": 2,
            "model": {**MODEL, "layers": 2}, "engine": "mesh", "vllm_tp": 2}  # fmt: skip
    ranks = _start(args, world=2)
    try:
        for version in (1, 2):
            sent = line(ranks[0])
            assert "error" not in sent, sent["error"]
            assert sent["version"] == version and sent["vllm_params_ok"]
            assert sent["vllm_generated"] == sent["generated"]  # vLLM generates what the live weights generate
            assert max(sent["planned"]) <= 0.55 * sent["stats"]["model_bytes"]
        assert sent["stats"]["epoch"] == 2
    finally:
        assert [p.wait(timeout=600) for p in ranks] == [0, 0]
