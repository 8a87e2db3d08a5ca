"""`refit bench --quick`: runs in CI, writes the documented JSON, and refit beats the seed's "before"."""

from __future__ import annotations

import json
import re
import sys

import pytest

from refit.tools.bench.presets import PRESETS, specs
from refit.tools.cli import main


def test_presets_have_the_documented_tensor_counts_and_sizes() -> None:
    import torch

    seven = specs(PRESETS["qwen2-7b"], torch.bfloat16)
    moe = specs(PRESETS["moe"], torch.bfloat16)
    assert (len(seven), round(sum(s.nbytes for s in seven) / 1e9, 1)) == (339, 15.2)
    assert (len(moe), round(sum(s.nbytes for s in moe) / 1e9, 2)) == (4779, 16.65)
    assert len(specs(PRESETS["moe-small"], torch.bfloat16)) == 4779


def test_deepseek_v3_preset_has_mla_fp8_weights_with_block_scales_and_truncates_dense_first() -> None:
    import torch

    full = {s.name: s for s in specs(PRESETS["deepseek-v3"], torch.bfloat16)}
    assert len(full) == 90427 and round(sum(s.nbytes for s in full.values()) / 1e9) == 673
    kv_b = "model.layers.3.self_attn.kv_b_proj."
    w, scale = full[kv_b + "weight"], full[kv_b + "weight_scale_inv"]
    assert (w.shape, w.dtype, scale.shape, scale.dtype) == ((32768, 512), torch.float8_e4m3fn, (256, 4), torch.float32)
    assert full["model.layers.60.mlp.experts.255.down_proj.weight"].shape == (7168, 2048)
    assert full["model.layers.60.mlp.shared_experts.gate_proj.weight_scale_inv"].shape == (16, 56)
    assert full["model.layers.5.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert "model.layers.2.mlp.gate_proj.weight" in full and "model.layers.2.mlp.gate.weight" not in full
    four = specs(PRESETS["deepseek-v3"].truncated(4), torch.bfloat16)
    assert len(four) == 1621 and not any(s.name.startswith("model.layers.4.") for s in four)


@pytest.mark.slow
def test_quick_bench_reports_every_method_and_refit_beats_per_tensor_metadata(tmp_path, capsys) -> None:
    out = tmp_path / "bench.json"
    assert main(["bench", "--quick", "--json", str(out)]) == 0
    reports = json.loads(out.read_text())
    assert [r["config"]["preset"] for r in reports] == ["tiny", "moe-small"]
    for r in reports:
        assert set(r["results"]) == {
            "floor",
            "foreach",
            "refit",
            "checksum",
            "fingerprint",
            "digest",
            "serial",
            "per_tensor",
            "per_tensor_meta",
        }
        for res in r["results"].values():
            assert res["median_s"] > 0 and res["gbps"] > 0 and res["ratio_to_floor"] > 0 and len(res["times"]) == 3
        # verified beside unverified, whatever the library's default; the digest probe beside its own floors
        results = r["results"]
        assert results["fingerprint"]["ratio_to_unverified"] == pytest.approx(
            results["fingerprint"]["median_s"] / results["refit"]["median_s"]
        )
        assert "ratio_to_unverified" not in results["refit"]
        digest = results["digest"]
        assert set(digest["floors"]) == {"copy_floor", "read_floor"} and all(v > 0 for v in digest["floors"].values())
        assert digest["ratio_to_copy_floor"] == pytest.approx(digest["median_s"] / digest["floors"]["copy_floor"])
        stages = set(r["results"]["refit"]["stages"])
        assert {"handshake", "pack", "send", "wait", "commit", "recv.load", "recv.commit"} <= stages
        memory = r["results"]["refit"]["memory"]
        assert memory["predicted_sender"] > 0
        if sys.platform == "linux":  # measured from the mappings and the buffers that exist, never from the prediction
            assert memory["measured_sender"] is not None and memory["measured_receiver"] is not None
            for side in ("sender", "receiver"):
                predicted, measured = memory[f"predicted_{side}"], memory[f"measured_{side}"]
                assert abs(measured - predicted) <= max(0.25 * predicted, 64 << 20), (side, memory)
    moe = reports[1]["results"]
    assert moe["refit"]["median_s"] < moe["per_tensor_meta"]["median_s"]
    out = capsys.readouterr().out
    # Not a terminal: every row, stage cells included, stays on one line.
    assert re.search(r"per-tensor, metadata every refit +│ +[0-9.]+ │", out)
    assert re.search(r"floor: one flat host copy of the model's bytes +│ +[0-9.]+ │", out)
    stage_cells = r"│ handshake [0-9.]+ pack [0-9.]+ send .* recv\.commit [0-9.]+ +│"
    assert re.search(r"refit \(pipelined buckets\) .*" + stage_cells, out)
    assert "scaling with the tensor count" in out
    assert re.search(
        r"refit \+ end-to-end fingerprint check +│ +[0-9.]+ │ +[0-9.-]+ │ +[0-9.]+ │ +[0-9.]+ │ +[0-9.]+ │", out
    )
    assert re.search(r"probe: digest of the tensors alone .*│ copy [0-9.]+ \(x[0-9.]+\) read [0-9.]+ \(x[0-9.]+\)", out)


@pytest.mark.slow
def test_delta_worst_case_changes_every_value_so_every_refit_moves_the_full_bytes(tmp_path) -> None:
    """step_delta_worst: delta refits after steps that change every trained value; each moves the model's bytes
    (against step_delta, whose small steps move less), so its time is delta's worst case beside step_full's."""
    out = tmp_path / "worst.json"
    argv = ["bench", "--preset", "tiny", "--transport", "shm", "--repeats", "2", "--json", str(out)]
    assert main([*argv, "--methods", "step_delta,step_delta_worst"]) == 0
    (r,) = json.loads(out.read_text())
    small, worst = r["results"]["step_delta"], r["results"]["step_delta_worst"]
    assert worst["delta_refits"] == small["delta_refits"] == 2  # the timed refits went as deltas
    assert worst["wire_bytes"] == r["nbytes"] * 4 > small["wire_bytes"]  # 1 primes, 1 warms up, 2 timed
    assert worst["median_s"] > 0


def test_bench_passes_verify_explicitly_to_every_refit_method(monkeypatch: pytest.MonkeyPatch) -> None:
    """`refit` and `zero_copy` stay unverified and the fingerprint methods verified whatever Sender's default."""
    from refit.tools.bench import runner
    from refit.tools.bench.config import BenchConfig

    seen: dict[str, dict] = {}
    monkeypatch.setattr(runner, "refit_method", lambda *a, name, **kw: seen.setdefault(name, kw))
    cfg = BenchConfig(preset="tiny", transport="shm")
    for m in ("refit", "serial", "checksum", "fingerprint"):
        runner._method(m, None, None, {}, [], cfg, None, 0)  # type: ignore[arg-type]
    cfg.transport = "cuda-ipc"  # (zero-copy methods apply to cuda-ipc only; nothing is started here)
    for m in ("zero_copy", "zero_copy_fingerprint"):
        runner._method(m, None, None, {}, [], cfg, None, 0)  # type: ignore[arg-type]
    assert {m: kw["verify"] for m, kw in seen.items()} == {
        "refit": None,
        "serial": None,
        "checksum": None,
        "fingerprint": "fingerprint",
        "zero_copy": None,
        "zero_copy_fingerprint": "fingerprint",
    }
    assert seen["zero_copy"]["zero_copy"] and seen["zero_copy_fingerprint"]["zero_copy"]


@pytest.mark.parametrize("preset", ["qwen2-7b", "moe"])
def test_plan_prints_buckets_and_predicted_memory(preset: str, capsys) -> None:
    assert main(["plan", "--preset", preset, "--bucket-bytes", str(1 << 30)]) == 0
    out = capsys.readouterr().out
    assert "memory allocated or mapped: sender 2048.0 MiB" in out and "buckets:" in out


def test_plan_takes_deepseek_v3_and_a_layer_count(capsys) -> None:
    assert main(["plan", "--preset", "deepseek-v3", "--layers", "4", "--bucket-bytes", str(1 << 30)]) == 0
    out = capsys.readouterr().out
    assert "1621 tensors" in out and "buckets: 17 of capacity 1024.0 MiB" in out


def test_deepseek_v3_config_json_gives_the_preset_and_layers_are_checked(tmp_path) -> None:
    from refit.tools.bench.presets import from_config

    config = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 61,
        "first_k_dense_replace": 3,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "vocab_size": 129280,
        "tie_word_embeddings": False,
        "topk_method": "noaux_tc",
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert from_config(str(path)) == PRESETS["deepseek-v3"]
    with pytest.raises(ValueError, match="layers"):
        PRESETS["deepseek-v3"].truncated(62)


def _report(**medians_ms: float) -> dict:
    """A bench report as `run_bench` writes it, with these methods' medians (ms) and moe-small's size."""
    results = {}
    for method, ms in medians_ms.items():
        copies = {"pack": ms / 3e3, "recv.load": ms / 3e3} if method in ("refit", "fingerprint") else {}
        times = {"median_s": ms / 1e3, "min_s": ms / 1e3 * 0.9, "max_s": ms / 1e3 * 1.2}
        results[method] = {**times, "gbps": 61e-3 / ms, "ratio_to_floor": None, "stages": copies, "floors": {}}
    return {"tensors": 4779, "nbytes": 61_000_000, "device": "cpu", "cpu_kernel": True, "results": results}


def test_a_verified_refit_faster_than_the_unverified_one_is_explained_under_the_table() -> None:
    from refit.tools.bench.report import notes

    [line] = notes(_report(refit=37.8, fingerprint=21.3))
    assert line.startswith("refit + end-to-end fingerprint check beats refit (pipelined buckets) (21.3 ms vs 37.8 ms)")
    assert "fused copy-and-digest C kernel" in line and "_foreach_copy_" in line and "4779 tensors of 13 KB" in line
    elsewhere = {**_report(refit=37.8, fingerprint=21.3), "device": "NVIDIA H200", "cpu_kernel": False}
    [line] = notes(elsewhere)  # no kernel to credit: the figures differ by their spread, and the line says so
    assert "run-to-run variation" in line and "min-max 19.2 ms-25.6 ms vs 34.0 ms-45.4 ms" in line
    assert notes(_report(refit=21.3, fingerprint=37.8)) == []  # as expected: nothing to explain


def test_a_probe_slower_than_the_whole_verified_refit_is_explained_under_the_table(capsys) -> None:
    from refit.tools.bench.report import show
    from refit.tools.console import console_for

    show(
        [{**_report(refit=50.0, fingerprint=60.0, digest=80.0), "config": _CONFIG, "dtypes": ["bfloat16"]}],
        console_for(),
    )
    out = capsys.readouterr().out
    [line] = [x for x in out.splitlines() if x.startswith("probe:")]
    assert "takes longer than refit + end-to-end fingerprint check (80.0 ms vs 60.0 ms)" in line
    assert "inside the copies it makes anyway" in line
    assert "x unverified" in out and "beats" not in out  # the table above it; the verified refit is slower here


_CONFIG = {
    "preset": "moe-small",
    "config": None,
    "layers": None,
    "dtype": "bfloat16",
    "transport": "shm",
    "receivers": 1,
}


def test_the_vllm_engine_bench_reports_verified_beside_unverified_and_the_disk_path() -> None:
    """The report's arithmetic and verdicts, on given medians (the bench itself needs vLLM: `refit bench --engine vllm`)."""
    from refit.tools.bench import engine

    row = lambda total, post=0.0: {"total": total, "transfer": 0.0, "copy": total - post, "post": post}  # noqa: E731
    results = {m: row(1.0) for m in engine.METHODS}
    results.update(
        plan=row(0.30, 0.20),
        plan_verified=row(0.33, 0.20),
        disk=row(0.90),
        plan_checkpoint_layout=row(0.10),
        plan_checkpoint_layout_verified=row(0.20),
        disk_checkpoint_layout=row(0.30),
    )
    report = {"results": results, "checks": engine._checks(results)}
    c = report["checks"]
    assert c["verified_vs_unverified"] == pytest.approx(1.1) and c["disk_vs_verified"] == pytest.approx(0.9 / 0.33)
    assert c["verified_vs_unverified_without_post"] == pytest.approx(1.3)
    lines = engine.verdicts(report)
    assert "repacked (vLLM's default): verified 1.10x unverified (target <= 1.5): met" in lines[2]
    assert "checkpoint layout: verified 2.00x unverified (target <= 1.5): NOT met" in lines[3]
    assert "disk path 1.50x the verified refit (target >= 2.0): NOT met" in lines[3]
    assert lines[4].endswith("inside the plan): 200.0 ms")


def test_an_fp8_engine_bench_quantizes_each_verified_refit_and_times_the_quantizer(tmp_path) -> None:
    """--engine-dtype fp8: the trainer holds bf16, the engine FP8 blocks and scales; every refit is verified
    (the fingerprint proves the engine's FP8 bytes and scales against the trainer's live tensors quantized by
    the rule) and the quantizer alone is timed against a flat cast-copy, checked bitwise against the rule."""
    out = tmp_path / "fp8.json"
    argv = ["bench", "--preset", "tiny", "--transport", "shm", "--engine-dtype", "fp8", "--repeats", "1"]
    assert main([*argv, "--methods", "floor,fingerprint,quantize", "--json", str(out)]) == 0
    (r,) = json.loads(out.read_text())
    assert r["dtypes"] == ["bfloat16"] and r["engine_dtypes"] == ["bfloat16", "float32", "float8_e4m3fn"]
    assert r["results"]["fingerprint"]["median_s"] > 0
    memory = r["results"]["fingerprint"]["memory"]  # the quantized copies the trainer keeps are predicted too
    assert abs(memory["measured_sender"] - memory["predicted_sender"]) < 0.01 * memory["predicted_sender"], memory
    q = r["results"]["quantize"]
    assert q["ratio_to_cast_floor"] > 0 and q["nbytes"] > r["nbytes"]  # reads bf16, writes FP8 and scales


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--methods", "quantize"], "pass --engine-dtype fp8"),
        (["--engine-dtype", "fp8", "--methods", "refit,step_delta"], "drop step_delta"),
        (["--engine-dtype", "fp8", "--engine", "vllm"], "--engine-dtype runs with the module engine"),
    ],
)
def test_fp8_engine_bench_options_that_do_not_combine_are_refused(argv: list[str], fragment: str, capsys) -> None:
    assert main(["bench", "--preset", "tiny", "--transport", "shm", *argv]) == 2
    assert fragment in capsys.readouterr().err


def test_the_colocated_floor_copies_in_chunks_that_fit_beside_the_receivers() -> None:
    import torch

    from refit.tools.bench.floors import copy_in_chunks, floor_chunk

    assert floor_chunk(28 << 30, None) == 28 << 30  # no limit known: one flat copy
    assert floor_chunk(28 << 30, 40 << 30) == 10 << 30  # two buffers in half of what is free
    assert floor_chunk(28 << 30, 1 << 20) == 1 << 20  # never below 1 MiB
    assert floor_chunk(4096, 40 << 30) == 4096
    src, dst = torch.arange(100, dtype=torch.uint8), torch.zeros(100, dtype=torch.uint8)
    copy_in_chunks(dst, src, 250)  # 100 + 100 + 50 bytes
    assert torch.equal(dst, src)


@pytest.mark.slow
def test_each_presets_tensors_are_released_before_the_next_preset_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    import weakref

    from refit.tools.bench import runner

    held: list[weakref.ref] = []
    alive_at_start: list[int] = []
    method, measure = runner._method, runner.measure

    def recording(m, workers, source, tensors, *rest):  # type: ignore[no-untyped-def]
        held.extend(weakref.ref(t) for t in tensors.values())
        return method(m, workers, source, tensors, *rest)

    def measuring(*args):  # type: ignore[no-untyped-def]
        alive_at_start.append(sum(r() is not None for r in held))
        return measure(*args)

    monkeypatch.setattr(runner, "_method", recording)
    monkeypatch.setattr(runner, "measure", measuring)
    argv = ["bench", "-q", "--preset", "tiny,moe-small", "--methods", "foreach", "--transport", "shm"]
    assert main([*argv, "--repeats", "1", "--warmup", "0"]) == 0
    assert alive_at_start == [0, 0] and held and all(r() is None for r in held)
