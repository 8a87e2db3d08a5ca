"""refit.integrations.trl refuses, with a ValueError naming the setting, the TRL setups it does not support,
before it builds anything; the module imports without trl."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from refit.integrations.trl import attach


def _trainer(*, use_vllm: bool = True, mode: str = "colocate", processes: int = 1, tp: int = 1, sleep: bool = False):
    gen = SimpleNamespace(mode=mode, tensor_parallel_size=tp, enable_sleep_mode=sleep)
    return SimpleNamespace(use_vllm=use_vllm, vllm_generation=gen, accelerator=SimpleNamespace(num_processes=processes))


@pytest.mark.parametrize(
    ("trainer", "says"),
    [
        (_trainer(use_vllm=False), "use_vllm=True"),
        (_trainer(mode="server"), "vllm_mode='colocate'"),
        (_trainer(processes=2), "one trainer process"),
        (_trainer(tp=2), "vllm_tensor_parallel_size=1"),
        (_trainer(sleep=True), "vllm_enable_sleep_mode"),
    ],
)
def test_attach_refuses_an_unsupported_trl_setup_naming_it(trainer: object, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        attach(trainer)
