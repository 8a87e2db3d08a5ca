"""Set-up problems are one line naming the problem and the fix, exit code 2, never a traceback: a host this
machine cannot listen on, nixl without NIXL, the Ray example without Ray, the demo's engine refused by its
trainer; and -q leaves only errors."""

from __future__ import annotations

import os
import runpy
import sys
import time
import warnings

import pytest
from locations import EXAMPLES

from refit.tools.cli import main
from refit.tools.commands.common import NIXL_MISSING


def _one_line(capsys: pytest.CaptureFixture, argv: list[str]) -> str:
    assert main(argv) == 2
    out = capsys.readouterr()
    assert out.out == "" and len(out.err.splitlines()) == 1 and out.err.startswith("error: "), out.err
    return out.err


@pytest.mark.parametrize("command", [["demo", "--steps", "1"], ["bench", "--quick"]])
def test_a_host_this_machine_cannot_listen_on_is_one_line(
    command: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setenv("REFIT_HOST", "not.a.host")
    err = _one_line(capsys, command)
    assert "REFIT_HOST=not.a.host: cannot listen there" in err and "unset it" in err


@pytest.mark.parametrize("command", [["demo", "--steps", "1"], ["bench", "--quick"]])
def test_nixl_without_nixl_is_one_line_naming_the_checkout_install(
    command: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from refit.tools import doctor

    monkeypatch.setattr(doctor, "nixl_installed", lambda: False)
    err = _one_line(capsys, [*command, "--transport", "nixl"])
    assert "pip install -e '.[nixl]'" in err and err.strip().endswith(NIXL_MISSING.split("; ")[-1])


def test_the_transport_names_the_checkout_install_when_nixl_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    from refit.transports import nixl

    for name in nixl.MODULES:
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ValueError, match=r"pip install -e '\.\[nixl\]' from the refit checkout"):
        nixl._nixl()


def test_the_ray_example_without_ray_is_one_line(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed
    with pytest.raises(SystemExit) as done:
        runpy.run_path(os.path.join(EXAMPLES, "ray_refit.py"), run_name="__main__")
    err = capsys.readouterr().err
    assert done.value.code == 2 and len(err.splitlines()) == 1
    assert "needs ray, which is not installed; pip install -e '.[ray,demo]'" in err


@pytest.mark.slow
def test_the_demo_stops_at_once_when_its_engine_is_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """The engine presents a wrong token: the demo ends with the engine's reason, long before the connect
    timeout (an hour here), exit code 2."""
    from refit.tools.demo import run

    attach = run.EngineProcess.attach

    def wrong_token(self, sender, args):  # type: ignore[no-untyped-def]
        attach(self, sender, {**args, "rendezvous": {**args["rendezvous"], "token": "not-the-token"}})

    monkeypatch.setattr(run.EngineProcess, "attach", wrong_token)
    monkeypatch.setenv("REFIT_CONNECT_TIMEOUT", "3600")
    t0 = time.monotonic()
    code = main(["-q", "demo", "--transport", "shm", "--steps", "1", "--layers", "1", "--hidden", "128"])
    err = capsys.readouterr().err
    assert code == 2 and time.monotonic() - t0 < 600, err
    last = err.splitlines()[-1]
    assert last.startswith("error: the demo's engine could not connect to the trainer:") and "token" in last, err


def test_quiet_turns_warnings_and_third_party_logs_off(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    for name in ("PYTHONWARNINGS", "NIXL_LOG_LEVEL", "UCX_LOG_LEVEL"):
        monkeypatch.delenv(name, raising=False)
    with warnings.catch_warnings(record=True) as caught:
        assert main(["plan", "--preset", "tiny", "-q"]) == 0
        warnings.warn("Failed to initialize NumPy", UserWarning, stacklevel=1)  # as torch warns at import
        assert os.environ["PYTHONWARNINGS"] == "ignore"  # the children too
        assert (os.environ["NIXL_LOG_LEVEL"], os.environ["UCX_LOG_LEVEL"]) == ("ERROR", "error")
    out = capsys.readouterr()
    assert caught == [] and out.out == "" and out.err == ""


def test_quiet_help_says_what_it_cannot_silence(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    assert "C++ code that writes to the terminal itself can still print" in " ".join(capsys.readouterr().out.split())
