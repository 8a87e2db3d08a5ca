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


@pytest.mark.slow  # imports peft
@pytest.mark.parametrize("lora_bias", [False, True])
def test_the_merge_for_a_sync_leaves_every_base_parameter_with_its_bits(lora_bias: bool) -> None:
    peft = pytest.importorskip("peft")
    torch = pytest.importorskip("torch")
    from refit.integrations.trl import TrlRefit

    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["0", "2"], lora_bias=lora_bias)
    model = peft.get_peft_model(base, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.normal_()  # lora_B (and its bias) start at zero, where a merge changes nothing
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with TrlRefit(trainer=None, sender=None, peft_model=model).as_sent():  # type: ignore[arg-type]
        inside = {n: p.detach().clone() for n, p in model.named_parameters()}
    moved = [n for n in before if not torch.equal(before[n], inside[n])]
    assert any(n.endswith("base_layer.bias") for n in moved) == lora_bias, moved
    changed = [
        n for n, p in model.named_parameters() if not torch.equal(before[n].view(torch.int32), p.view(torch.int32))
    ]
    assert changed == []


class _Sender:
    def __init__(self) -> None:
        self.sent: list[int] = []
        self.closed = False

    def refit(self, version: int) -> object:
        self.sent.append(version)
        return SimpleNamespace(version=version)

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize(("synced", "sync", "sent"), [(2, True, [3]), (3, True, []), (2, False, [])])
def test_close_refits_the_last_steps_weights_unless_they_were_sent(synced: int, sync: bool, sent: list) -> None:
    from refit.integrations.trl import SyncTime, TrlRefit

    sender = _Sender()
    session = TrlRefit(trainer=SimpleNamespace(state=SimpleNamespace(global_step=3)), sender=sender)  # type: ignore[arg-type]
    session.history.append(SyncTime(synced, 0.0, SimpleNamespace()))  # type: ignore[arg-type]
    session.close(sync=sync)
    assert sender.sent == sent and sender.closed
