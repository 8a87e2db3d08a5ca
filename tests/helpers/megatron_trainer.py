"""One rank of a megatron-core GPTModel trainer (TP x PP over gloo, CPU) refitting into an engine process.

Run with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set and one JSON argument: "tp", "pp", "transport",
"bucket_bytes", "steps", "dtype_change_at" (the step whose refit sends model.norm.weight as fp32),
"model" (refit.tools.demo.model.model_config keywords), "vocab" and "padded_vocab" (the HF model's vocabulary
and Megatron's rows for it, padded as `make_vocab_size_divisible_by` x TP pads it; default: the config's,
unpadded), "engine": "peer" (an engine process that connects to the
printed rendezvous) or "vllm" (rank 0 runs vLLM from dummy weights, refitted through the 'refit'
backend). Rank 0 prints its rendezvous (peer), then (PP=1 or "check_logits") how far
megatron's logits are from the Hugging Face model's with the converted weights, then one '@@rank0'
JSON line per refit: the stats (or error), fingerprints of the trainer's live weights under checkpoint
names in their wire dtypes, the HF model's greedy output with those weights, and the gathers' figures.
"""

from __future__ import annotations

import copy
import json
import sys
import tempfile

import torch
import torch.distributed as dist
from exits import leave

from refit import RefitError, Sender, Settings
from refit.checks.fingerprints import fingerprints
from refit.sources.megatron import MegatronSource
from refit.tools.demo.megatron import MegatronTrainer, build_gpt, forward
from refit.tools.demo.model import PROMPTS, TEXT, build_model, build_tokenizer, greedy, model_config


class PaddedTrainer(MegatronTrainer):
    """The demo's trainer with Megatron's vocabulary padded to `padded` rows (the HF model's stays as it is),
    sent with the checkpoint's vocabulary: `MegatronSource(vocab_size=...)`."""

    def __init__(self, hf_model: torch.nn.Module, ids: torch.Tensor, *, tp: int, pp: int, padded: int) -> None:
        config = copy.deepcopy(hf_model.config)
        config.vocab_size = padded
        self.model = build_gpt(config, tp=tp, pp=pp)
        self.hf_model, self.ids = hf_model, ids
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-3)
        vocab = hf_model.config.vocab_size
        self.source = MegatronSource(self.model, vocab_size=vocab, wire_dtype=torch.bfloat16)
        self.num_params = sum(p.numel() for p in hf_model.parameters())


def emit(obj: object) -> None:
    print("@@rank0 " + json.dumps(obj), flush=True)


def from_checkpoint(trainer: MegatronTrainer, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The HF model loaded by transformers from `weights` saved as a checkpoint (MoE experts per expert,
    as vLLM reads them; transformers fuses them on load)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    aliases = trainer.source.layout.aliases()
    with tempfile.TemporaryDirectory() as path:
        trainer.hf_model.config.save_pretrained(path)
        save_file({n: t.contiguous() for n, t in weights.items() if n not in aliases}, f"{path}/model.safetensors")
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def logits_gap(trainer: MegatronTrainer, ids: torch.Tensor) -> float | None:
    """Every rank: max |megatron logits - HF logits| with the converted live weights (fp32), on rank 0.
    Activations go stage to stage; the last stage's logits (gathered over TP) come back to rank 0."""
    from megatron.core import parallel_state as ps

    weights = trainer.full_weights()
    stages, logits = trainer.source.stage_ranks, None
    with torch.no_grad():
        out = forward(trainer.model, ids)
        if not ps.is_pipeline_last_stage():
            dist.send(out, ps.get_pipeline_model_parallel_next_rank())
        else:
            parts = [torch.empty_like(out) for _ in range(ps.get_tensor_model_parallel_world_size())]
            dist.all_gather(parts, out.contiguous(), group=ps.get_tensor_model_parallel_group())
            logits = torch.cat(parts, dim=-1)
        if len(stages) > 1 and ps.get_tensor_model_parallel_rank() == 0 and ps.is_pipeline_last_stage():
            dist.send(logits, stages[0])
        if dist.get_rank() != 0:
            return None
        if logits is None:
            logits = torch.empty(1, ids.shape[1], trainer.source.layout.padded_vocab_size)
            dist.recv(logits, stages[-1])
        logits = logits[..., : trainer.source.layout.vocab_size]  # the padded rows' logits: no token's
        return float((logits - from_checkpoint(trainer, weights)(input_ids=ids).logits).abs().max())


def report(trainer: MegatronTrainer, sender: Sender | None, prompts: list, out: dict, vllm=None) -> None:  # type: ignore[no-untyped-def]
    weights = trainer.full_weights()
    if dist.get_rank() != 0:
        return
    if "error" in out:
        emit(out)
        return
    assert sender is not None and sender.manifest is not None
    wire = {n: p.spec.dtype for p in sender.manifest.entries for n in p.spec.names}
    out["fingerprints"] = fingerprints(weights.items(), wire)
    out["generated"] = greedy(from_checkpoint(trainer, {n: t.to(wire[n]).float() for n, t in weights.items()}), prompts)
    if vllm is not None:  # what vLLM holds (in its fused layout) against the live weights, and its output
        got = vllm.report(weights)
        out.update(vllm_params_ok=got["fingerprints"] == got["expected"], vllm_generated=got["generated"])
    src = trainer.source
    out.update(peak=src.peak_gathered_bytes, predicted=src.predicted_gather_bytes(sender.manifest),
               gathers=dict(src.gather_counts), model_bytes=sum(t.numel() * t.element_size() for t in weights.values()))  # fmt: skip
    emit(out)


def mesh_vllm(trainer: MegatronTrainer, mesh, hf, tok, prompts, workdir: str, args: dict):  # type: ignore[no-untyped-def]
    """ "vllm_tp": rank 0 runs vLLM at that tensor-parallel size, refitted M:N through VllmRefit over `mesh`."""
    from refit.tools.demo.run import VllmSide

    if dist.get_rank() != 0:
        mesh.rendezvous()
        return None
    return VllmSide(mesh, hf, tok, prompts, workdir, tp=args["vllm_tp"])


def mesh_main(trainer: MegatronTrainer, args: dict, extra: tuple = ()) -> None:
    """ "engine": "mesh": every model-parallel rank sends its own shards to `workers` M:N workers
    (tests/helpers/mesh_hf_worker.py); rank 0 prints the rendezvous, then per refit the stats and the
    fingerprints of the live weights as the engine must hold them (cast to the wire dtype, read in fp32)."""
    from refit.checks.fingerprints import fingerprint
    from refit.topology.mesh import MeshRefit

    settings = Settings(bucket_bytes=args["bucket_bytes"], timeout_s=120.0)
    workers = args.get("vllm_tp") or args.get("workers", 1)
    mesh = MeshRefit(trainer.source, num_workers=workers, transport=args["transport"],
                     group=trainer.source.group, settings=settings, verify="fingerprint")  # fmt: skip
    vllm = mesh_vllm(trainer, mesh, *extra, args) if args.get("vllm_tp") else None
    info = mesh.rendezvous()
    if dist.get_rank() == 0 and vllm is None:
        emit(info)
    for version in range(1, args["steps"] + 1):
        if version > 1:
            trainer.step()
        if version == args["dtype_change_at"]:
            trainer.source.set_wire_dtype("model.norm.weight", torch.float32)
        out: dict = {"version": version}
        try:
            out["stats"] = (vllm.refit(version) if vllm is not None else mesh.refit(version)).to_json()
        except RefitError as e:
            out["error"] = f"{type(e).__name__}: {e}"
        weights = trainer.full_weights()
        wire = {n: sp.dtype for sp in trainer.source.specs() for n in sp.names}
        if dist.get_rank() == 0:
            out["expected"] = {n: fingerprint(t.to(wire[n]).float(), torch.float32) for n, t in weights.items()}
            out["planned"] = mesh.plan.worker_bytes() if mesh.plan is not None else []
            if vllm is not None and "error" not in out:
                got = vllm.report(weights)
                hf_out = greedy(from_checkpoint(trainer, {n: t.to(wire[n]).float() for n, t in weights.items()}),
                                extra[2])  # fmt: skip
                out.update(vllm_generated=got["generated"], generated=hf_out,
                           vllm_params_ok=got["fingerprints"] == got["expected"])  # fmt: skip
            emit(out)
    if vllm is not None:
        vllm.close()
    else:
        mesh.close()


def main() -> int:
    args = json.loads(sys.argv[1])
    dist.init_process_group("gloo")
    tok = build_tokenizer()
    ids = torch.tensor([tok(TEXT)["input_ids"][:128]])
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    config = model_config(**args["model"])
    config.vocab_size = args.get("vocab", config.vocab_size)
    hf = build_model(config, seed=0)
    if "padded_vocab" in args:
        trainer = PaddedTrainer(hf, ids, tp=args["tp"], pp=args["pp"], padded=args["padded_vocab"])
    else:
        trainer = MegatronTrainer(hf, ids, tp=args["tp"], pp=args["pp"])
    sender = vllm = None
    workdir = tempfile.TemporaryDirectory()
    if args.get("engine") == "mesh":
        mesh_main(trainer, args, (hf, tok, prompts, workdir.name))
    elif dist.get_rank() == 0:
        sender = Sender(trainer.source, transport=args["transport"], verify="fingerprint",
                        settings=Settings(bucket_bytes=args["bucket_bytes"], timeout_s=120.0))  # fmt: skip
        if args.get("engine") == "vllm":
            from refit.tools.demo.run import VllmSide

            vllm = VllmSide(sender, hf, tok, prompts, workdir.name)
        else:
            emit(sender.rendezvous())
    if args.get("engine") == "mesh":
        pass
    elif args["pp"] == 1 or args.get("check_logits"):
        gap = logits_gap(trainer, ids[:, :32])
        if dist.get_rank() == 0:
            emit({"logits_gap": gap})
    for version in range(1, 0 if args.get("engine") == "mesh" else args["steps"] + 1):
        if version > 1:
            trainer.step()
        if version == args["dtype_change_at"]:
            trainer.source.set_wire_dtype("model.norm.weight", torch.float32)
        out: dict = {"version": version}
        try:
            stats = trainer.refit(vllm or sender, version)
            out["stats"] = stats.to_json() if stats is not None else None
        except RefitError as e:
            out["error"] = f"{type(e).__name__}: {e}"
        report(trainer, sender, prompts, out, vllm)
    if vllm is not None:
        vllm.close()
    elif sender is not None:
        sender.close()
    workdir.cleanup()
    return 0


if __name__ == "__main__":
    leave(main())
