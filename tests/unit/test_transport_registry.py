"""The transport registry as an extension point: a class or a "module:Class" string registered from outside the
package, an entry point of group "refit.transports" in an installed distribution, the errors of each wrong
registration, the doctor's verdict on a registered transport, and a real refit over a registered wrapper of shm."""

from __future__ import annotations

import importlib
import itertools
import json
import logging
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from threaded import Peer

from refit import ModuleEngine, ModuleSource, RefitStats, Sender, Settings, transports
from refit.tools.cli import main
from refit.tools.doctor import FAIL, OK, diagnose
from refit.topology.receiver import Receiver
from refit.transports.base import Transport
from refit.transports.shm import ShmTransport

_EXTENSION = '''
from refit.transports.shm import ShmTransport


class Counted(ShmTransport):
    """shm, counting the offers and joins that went through it."""

    name = "counted-shm"
    offers = 0
    joins = 0

    @classmethod
    def offer(cls, **kwargs):
        cls.offers += 1
        return super().offer(**kwargs)

    @classmethod
    def join(cls, info, **kwargs):
        cls.joins += 1
        return super().join(info, **kwargs)


class NotATransport:
    pass
'''
_modules = itertools.count()


@pytest.fixture(autouse=True)
def _registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts from the built-ins, with the entry points unread, and leaves the registry as it was."""
    monkeypatch.setattr(transports, "_REGISTRY", dict(transports._BUILTIN))
    monkeypatch.setattr(transports, "_ENTRY_POINTS", None)


def _extension(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A module outside the package, importable under a name no other test used: its name."""
    name = f"refit_test_extension_{next(_modules)}"
    (tmp_path / f"{name}.py").write_text(_EXTENSION)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return name


def _distribution(site: Path, entry_points: str) -> None:
    """An installed distribution as importlib.metadata finds one: a dist-info directory on sys.path."""
    info = site / "refit_test_plugin-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: refit-test-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(textwrap.dedent(entry_points))


class Local(ShmTransport):
    name = "local"


def test_a_class_registered_from_outside_the_package_is_what_get_returns() -> None:
    transports.register("local", Local)
    assert transports.get("local") is Local
    assert transports.names() == ["shm", "gloo", "cuda-ipc", "nccl", "nixl", "relay", "local"]
    assert transports.default_device("local") == torch.device("cpu") and transports.unavailable("local") == ""


def test_a_string_is_imported_at_the_first_get_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module = _extension(tmp_path, monkeypatch)
    transports.register("counted", f"{module}:Counted")
    assert module not in sys.modules
    got = transports.get("counted")
    assert got is importlib.import_module(module).Counted and issubclass(got, Transport)
    assert transports.get("counted") is got


def test_an_entry_point_is_listed_and_resolved_and_cannot_shadow_a_built_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    module = _extension(tmp_path, monkeypatch)
    _distribution(
        tmp_path,
        f"""
        [refit.transports]
        plugin-shm = {module}:Counted
        shm = {module}:Counted
        """,
    )
    importlib.invalidate_caches()
    transports._forget_entry_points()
    with caplog.at_level(logging.WARNING, logger="refit"):
        listed = transports.names()
    assert listed == ["shm", "gloo", "cuda-ipc", "nccl", "nixl", "relay", "plugin-shm"]
    assert transports.get("plugin-shm") is importlib.import_module(module).Counted
    assert transports.get("shm") is ShmTransport
    assert any(
        "ignoring entry point shm" in r.getMessage() and "'shm' is a built-in transport" in r.getMessage()
        for r in caplog.records
    ), [r.getMessage() for r in caplog.records]
    transports._forget_entry_points()
    assert "plugin-shm" not in transports._REGISTRY


def test_an_entry_point_is_read_at_the_first_lookup_of_an_unknown_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = _extension(tmp_path, monkeypatch)
    _distribution(tmp_path, f"[refit.transports]\nlate = {module}:Counted\n")
    importlib.invalidate_caches()
    transports._forget_entry_points()
    transports.get("shm")
    assert transports._ENTRY_POINTS is None  # a known name reads no metadata
    assert transports.get("late").__name__ == "Counted"
    assert transports._ENTRY_POINTS == {"late"}


def test_a_name_already_registered_is_refused_unless_replace() -> None:
    transports.register("local", Local)
    with pytest.raises(ValueError, match=r"transport 'local' is already registered \(as .*Local\); pass replace=True"):
        transports.register("local", "elsewhere:Local")
    transports.register("local", "elsewhere:Local", replace=True)
    assert transports._REGISTRY["local"] == "elsewhere:Local"


def test_a_built_in_cannot_be_replaced() -> None:
    with pytest.raises(ValueError, match="transport 'shm' is built in and cannot be replaced; register yours under"):
        transports.register("shm", Local, replace=True)


@pytest.mark.parametrize("target", ["no_colon", "a:b:c", ":Cls", "mod:", "my-mod:Cls", "mod:Cls [extra]"])
def test_a_string_that_is_not_module_colon_class_is_refused(target: str) -> None:
    with pytest.raises(ValueError) as e:
        transports.register("x", target)
    assert str(e.value) == (
        f"cannot register transport 'x': {target!r} is not of the form 'package.module:ClassName' (exactly one ':'); "
        "pass a Transport subclass or 'package.module:ClassName'"
    )


@pytest.mark.parametrize("name", ["", " x", "a,b", None, 3])
def test_a_name_must_be_a_plain_non_empty_string(name: object) -> None:
    with pytest.raises(ValueError, match="a transport name is a non-empty string without commas"):
        transports.register(name, Local)  # type: ignore[arg-type]


def test_a_class_that_is_not_a_transport_is_refused_at_registration() -> None:
    class Plain:
        pass

    with pytest.raises(ValueError) as e:
        transports.register("plain", Plain)  # type: ignore[arg-type]
    assert "cannot register transport 'plain': " in str(e.value)
    assert f"{__name__}.{Plain.__qualname__} is not a subclass of refit.transports.base.Transport" in str(e.value)
    with pytest.raises(ValueError, match="cannot register transport 'plain': got int 42; pass a Transport subclass"):
        transports.register("plain", 42)  # type: ignore[arg-type]


def test_a_transport_without_a_device_type_is_refused() -> None:
    class Nowhere(ShmTransport):
        device_type = "tpu"

    with pytest.raises(ValueError, match="Nowhere.device_type must be 'cpu' or 'cuda', not 'tpu'"):
        transports.register("nowhere", Nowhere)


def test_a_string_naming_no_transport_fails_at_get_naming_name_target_and_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = _extension(tmp_path, monkeypatch)
    transports.register("plain", f"{module}:NotATransport")
    with pytest.raises(ValueError) as e:
        transports.get("plain")
    assert str(e.value) == (
        f"transport 'plain' is '{module}:NotATransport', but {module}.NotATransport is not a subclass of "
        "refit.transports.base.Transport; point it at a Transport subclass"
    )
    transports.register("missing", f"{module}:Absent")
    with pytest.raises(ValueError, match=f"transport 'missing' is '{module}:Absent', but module '{module}' has no"):
        transports.get("missing")


def test_a_string_whose_module_fails_to_import_is_one_error_naming_transport_and_module() -> None:
    transports.register("gone", "refit_no_such_module:Transport")
    with pytest.raises(ValueError) as e:
        transports.get("gone")
    assert str(e.value) == (
        "transport 'gone' is 'refit_no_such_module:Transport', but importing module 'refit_no_such_module' failed: "
        "ModuleNotFoundError: No module named 'refit_no_such_module'; install what it needs or fix the registration"
    )
    assert isinstance(e.value.__cause__, ModuleNotFoundError)
    assert transports._REGISTRY["gone"] == "refit_no_such_module:Transport"  # the next get tries again


def test_an_unknown_name_lists_the_known_ones() -> None:
    transports.register("local", Local)
    with pytest.raises(ValueError, match=r"unknown transport 'nope'; choose one of shm, gloo, .*local$"):
        transports.get("nope")


def test_doctor_gives_a_registered_transport_a_verdict_and_a_broken_one_a_failure(
    capsys: pytest.CaptureFixture,
) -> None:
    transports.register("local", Local)
    transports.register("gone", "refit_no_such_module:Transport")
    verdicts = {v.transport: v for v in diagnose(transports=["local", "gone"], probe=False).verdicts}
    assert verdicts["local"].status == OK and "not built in" in verdicts["local"].reason
    assert (
        verdicts["gone"].status == FAIL and "importing module 'refit_no_such_module' failed" in verdicts["gone"].reason
    )
    assert main(["doctor", "--no-probe", "--json"]) == 0  # every name, the broken one included: a report
    out = json.loads(capsys.readouterr().out)
    assert out["transports"]["local"]["status"] == OK and out["transports"]["gone"]["status"] == FAIL


def test_a_real_refit_runs_over_a_registered_wrapper_of_shm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sender and Receiver each resolve the name: the Receiver from the rendezvous the Sender gave it."""
    module = _extension(tmp_path, monkeypatch)
    transports.register("counted-shm", f"{module}:Counted")
    g = torch.Generator().manual_seed(5)
    trainer = {
        "w": torch.randn(33, 17, generator=g),
        "b": torch.randn(300, generator=g).bfloat16(),
        "i": torch.arange(7),
    }
    live = {n: torch.zeros_like(t) for n, t in trainer.items()}
    sender = Sender(
        ModuleSource(trainer), transport="counted-shm", settings=Settings(bucket_bytes=2048, timeout_s=60.0)
    )
    assert sender.rendezvous()["transport"] == "counted-shm"
    peer = Peer(Receiver(ModuleEngine(live), sender.rendezvous()))
    try:
        peer.ask("connect")
        peer.ask("receive")
        sender.refit(1)
        assert isinstance(peer.outcome(), RefitStats)
    finally:
        sender.close()
        peer.stop()
    counted = importlib.import_module(module).Counted
    assert (counted.offers, counted.joins) == (1, 1)
    for n, want in trainer.items():
        assert torch.equal(live[n].view(torch.uint8), want.view(torch.uint8)), n
