"""What refit compiles is loaded only from a folder no other user can write: a cache folder (or a folder above
it, up to the cache root) that another user owns or that its group or others may write is refused with one
WARNING naming it and the fix; the build lock is never opened through a symbolic link; the library loaded is
the expected file inside the folder, never a path read from a file. Each time a refit still succeeds, on the
slower PyTorch path. (Run as root in CI: another owner is simulated with os.chown.)"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch
from threaded import refit_both, session

from refit import ModuleEngine, ModuleSource, Settings
from refit.checks import copy_digest as fused
from refit.layout import private_dir, tensor_guard
from refit.layout.private_dir import NotPrivate, check_folder, open_lock, owned_file, triton_cache_private

OTHER_UID = 54321
"""A uid that is not this process's (the tests chown to it as root, or skip)."""


def _as_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("simulating another user's folder needs root (os.chown)")


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A fresh cache root (XDG_CACHE_HOME), both helpers forgotten before and after, and no compiler: a test that
    reaches a build sees it fail (and records that it was asked)."""
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_CACHE_HOME", str(root))
    builds: list[str] = []

    def no_compiler(**kw: object) -> None:
        builds.append(str(kw["name"]))
        raise RuntimeError("no compiler in this test")

    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    tensor_guard._helper.cache_clear()
    fused._kernel.cache_clear()
    yield root, builds
    tensor_guard._helper.cache_clear()
    fused._kernel.cache_clear()


def _guard_dir() -> Path:
    where = tensor_guard._where()
    assert where is not None
    return where


def _refits_on_the_fallback() -> None:
    """Both helpers give None (their slower paths) and a verified refit still commits, bitwise."""
    assert tensor_guard._helper() is None and fused._kernel() is None
    g = torch.Generator().manual_seed(5)
    trainer = {"w": torch.randn(8, 8, generator=g), "b": torch.randn(8, generator=g)}
    engine = ModuleEngine({n: torch.zeros_like(t) for n, t in trainer.items()})
    settings = Settings(timeout_s=30.0)  # the fingerprint on, as by default
    with session(ModuleSource(trainer), engine, settings) as (sender, peer):
        sent, got = refit_both(sender, peer, 1)
        assert not isinstance(sent, Exception) and not isinstance(got, Exception), (sent, got)
    assert all(torch.equal(engine.module[n], t) for n, t in trainer.items())


def _one_warning(caplog: pytest.LogCaptureFixture, names: str) -> None:
    got = [r.getMessage() for r in caplog.records if "not loading refit's compiled kernels" in r.getMessage()]
    assert len(got) == 1, got
    assert names in got[0] and "chmod 700" in got[0]


def _tamper_other_writable(root: Path) -> str:
    root.chmod(0o777)
    return str(root)


def _tamper_group_writable(root: Path) -> str:
    (root / "refit").chmod(0o770)
    return str(root / "refit")


def _tamper_foreign_owner(root: Path) -> str:
    _as_root()
    os.chown(root / "refit", OTHER_UID, OTHER_UID)
    return str(root / "refit")


TAMPER = {
    "other-writable cache root": _tamper_other_writable,
    "group-writable folders": _tamper_group_writable,
    "a folder another user owns": _tamper_foreign_owner,
}


@pytest.mark.parametrize("how", sorted(TAMPER))
def test_a_cache_folder_another_user_could_write_is_refused_with_one_warning_and_the_refit_succeeds(
    how: str, cache: tuple[Path, list[str]], caplog: pytest.LogCaptureFixture
) -> None:
    root, builds = cache
    _guard_dir()  # made private, then tampered with
    named = TAMPER[how](root)
    tensor_guard._helper.cache_clear()
    with caplog.at_level(logging.WARNING, logger="refit"):
        _refits_on_the_fallback()
    _one_warning(caplog, named)
    assert builds == [], "nothing is compiled into a folder refit refused"


def test_new_cache_folders_are_made_for_this_user_alone(cache: tuple[Path, list[str]]) -> None:
    root, _ = cache
    where = _guard_dir()
    for at in (root / "refit", where.parent, where):
        assert at.stat().st_mode & 0o777 == 0o700, at


def test_a_symlinked_build_lock_is_refused_and_what_it_points_to_is_left_alone(
    cache: tuple[Path, list[str]], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _, builds = cache
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    (_guard_dir() / "refit.lock").symlink_to(victim)
    fused_dir = fused._cache_dir()
    assert fused_dir is not None
    (fused_dir / "refit.lock").symlink_to(victim)
    with caplog.at_level(logging.WARNING, logger="refit"):
        _refits_on_the_fallback()
    assert victim.read_text() == "keep me"
    got = [r.getMessage() for r in caplog.records if "not loading refit's compiled kernels" in r.getMessage()]
    assert len(got) == 2 and all("symbolic link" in m for m in got), got  # one per lock
    assert builds == []


def test_a_built_marker_pointing_elsewhere_is_never_loaded(
    cache: tuple[Path, list[str]], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _, builds = cache
    marker = tmp_path / "ran"
    planted = tmp_path / "planted.py"
    planted.write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    (_guard_dir() / "built.ok").write_text(str(planted))
    _refits_on_the_fallback()
    assert not marker.exists(), "refit ran a module named by built.ok"
    assert builds, "with no library of the expected name in the folder, refit builds one"


def test_a_library_of_the_expected_name_that_is_a_link_or_anothers_file_is_refused(tmp_path: Path) -> None:
    where = tmp_path / "d"
    where.mkdir(mode=0o700)
    (tmp_path / "elsewhere.so").write_text("")
    (where / "lib.so").symlink_to(tmp_path / "elsewhere.so")
    with pytest.raises(NotPrivate, match="not a regular file"):
        owned_file(where, "lib.so")
    assert owned_file(where, "absent.so") is None
    with pytest.raises(ValueError, match="plain file name"):
        owned_file(where, "../elsewhere.so")
    (where / "mine.so").write_text("")
    (where / "mine.so").chmod(0o666)
    with pytest.raises(NotPrivate, match="writable by its group or by others"):
        owned_file(where, "mine.so")


def test_a_symlinked_folder_below_the_root_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    (root / "refit").symlink_to(real)
    with pytest.raises(NotPrivate, match="symbolic link"):
        check_folder(root / "refit", root)


def test_the_lock_is_made_0600_and_never_opened_through_a_link(tmp_path: Path) -> None:
    fd = open_lock(tmp_path)
    os.close(fd)
    assert (tmp_path / "refit.lock").stat().st_mode & 0o777 == 0o600
    (tmp_path / "refit.lock").unlink()
    (tmp_path / "refit.lock").symlink_to(tmp_path / "target")
    with pytest.raises(NotPrivate, match="symbolic link"):
        open_lock(tmp_path)
    assert not (tmp_path / "target").exists()


def test_tritons_cache_is_used_only_where_no_other_user_can_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    monkeypatch.setenv("TRITON_HOME", str(home))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    assert triton_cache_private()  # not made yet, under a private home
    (home / ".triton" / "cache").mkdir(parents=True, mode=0o700)
    assert triton_cache_private()
    (home / ".triton").chmod(0o777)
    with caplog.at_level(logging.WARNING, logger="refit"):
        assert not triton_cache_private()
    assert "TRITON_CACHE_DIR" in caplog.text and str(home / ".triton") in caplog.text
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(shared))
    assert not triton_cache_private()


def test_the_warning_is_given_once_per_problem(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    why = NotPrivate(f"the folder {tmp_path} is writable by its group or by others")
    with caplog.at_level(logging.WARNING, logger="refit"):
        private_dir.refuse(tmp_path / "a", why)
        private_dir.refuse(tmp_path / "b", why)
    assert len(caplog.records) == 1
