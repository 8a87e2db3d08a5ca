"""`refit plan`'s M:N figures count what the planner would move: equal to plan_reshard's bytes per
worker and per rank on a small MoE (every tensor kind: experts, MLA-free attention, norms, routers)."""

from __future__ import annotations

import torch

from refit.layout.reshard import plan_reshard
from refit.tools.bench.presets import PRESETS, specs
from refit.tools.mesh_figures import path_figures, statements


def test_path_figures_equal_the_planners_bytes_per_worker_and_per_rank() -> None:
    shape = PRESETS["moe-small"].truncated(2)
    all_specs = specs(shape, torch.bfloat16)
    for ranks, tp, ep in [(4, 2, 2), (3, 2, 1), (2, 1, 2)]:
        holders, workers = statements(all_specs, ranks=ranks, tp=tp, ep=ep)
        plan = plan_reshard(all_specs, holders, workers)
        got = path_figures(all_specs, ranks=ranks, tp=tp, ep=ep)
        assert got["worker_bytes_max"] == max(plan.worker_bytes())
        assert got["rank_sent_bytes_max"] == max(plan.rank_bytes())
        assert got["delivered_bytes"]["m_to_n"] == sum(plan.worker_bytes())
        assert got["bytes_per_gpu"]["broadcast"] == sum(s.nbytes for s in all_specs)
