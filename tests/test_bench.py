"""`refit bench --quick`: runs in CI, writes the documented JSON, and refit beats the seed's "before"."""

from __future__ import annotations

import json

import pytest

from refit.bench.presets import PRESETS, specs
from refit.cli import main


def test_presets_have_the_documented_tensor_counts_and_sizes() -> None:
    import torch

    seven = specs(PRESETS["qwen2-7b"], torch.bfloat16)
    moe = specs(PRESETS["moe"], torch.bfloat16)
    assert (len(seven), round(sum(s.nbytes for s in seven) / 1e9, 1)) == (339, 15.2)
    assert (len(moe), round(sum(s.nbytes for s in moe) / 1e9, 2)) == (4779, 16.65)
    assert len(specs(PRESETS["moe-small"], torch.bfloat16)) == 4779


def test_quick_bench_reports_every_method_and_refit_beats_per_tensor_metadata(tmp_path, capsys) -> None:
    out = tmp_path / "bench.json"
    assert main(["bench", "--quick", "--json", str(out)]) == 0
    reports = json.loads(out.read_text())
    assert [r["config"]["preset"] for r in reports] == ["tiny", "moe-small"]
    for r in reports:
        assert set(r["results"]) == {"floor", "refit", "checksum", "serial", "per_tensor", "per_tensor_meta"}
        for res in r["results"].values():
            assert res["median_s"] > 0 and res["gbps"] > 0 and res["ratio_to_floor"] > 0 and len(res["times"]) == 3
        assert set(r["results"]["refit"]["stages"]) == {"pack", "send", "wait", "commit"}
        assert r["results"]["refit"]["memory"]["predicted_sender"] > 0
    moe = reports[1]["results"]
    assert moe["refit"]["median_s"] < moe["per_tensor_meta"]["median_s"]
    assert "per-tensor, metadata every refit" in capsys.readouterr().out


@pytest.mark.parametrize("preset", ["qwen2-7b", "moe"])
def test_plan_prints_buckets_and_predicted_memory(preset: str, capsys) -> None:
    assert main(["plan", "--preset", preset, "--bucket-bytes", str(1 << 30)]) == 0
    out = capsys.readouterr().out
    assert "predicted peak extra memory: sender 2048.0 MiB" in out and "buckets:" in out
