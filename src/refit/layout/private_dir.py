"""Private folders: where refit keeps what it compiles, and the checks before it loads anything from there.

A compiled helper runs inside every process that loads it, so refit loads one only from a folder that no other
user can write: the folder and every folder from the cache root down to it are real folders (no symbolic links
below the root), owned by the current user, writable by no group and no other user. Folders refit creates are
made 0700. The build lock is opened without following links; a library is loaded only under the name refit
expects, inside that folder, and only as a regular file of the user's. A folder that fails these checks is
refused with one WARNING naming the folder and the fix, and the caller takes its slower, pure-PyTorch path.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path

from refit.log import get_logger

log = get_logger("private_dir")
_warned: set[str] = set()


class NotPrivate(Exception):
    """A folder or file another user could have written: refit does not load from it."""


def cache_root() -> Path:
    """`$XDG_CACHE_HOME`, or `~/.cache`: the root of refit's cache folders."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")


def _check(path: Path, st: os.stat_result, what: str) -> None:
    if st.st_uid != os.geteuid():
        raise NotPrivate(f"{what} {path} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise NotPrivate(f"{what} {path} is writable by its group or by others (mode {stat.filemode(st.st_mode)})")


def check_folder(where: Path, root: Path) -> None:
    """NotPrivate unless `root` and every folder from it down to `where` is the user's and writable by no one
    else; below `root` none may be a symbolic link."""
    rel = where.relative_to(root)
    _check(root, os.stat(root), "the folder")
    at = root
    for part in rel.parts:
        at = at / part
        st = os.lstat(at)
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
            raise NotPrivate(f"{at} is not a folder (a symbolic link or a file stands in its place)")
        _check(at, st, "the folder")


def make_private(where: Path, root: Path) -> Path:
    """Create `where` (and its missing parents below `root`) with mode 0700, then check it (NotPrivate)."""
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    at = root
    for part in where.relative_to(root).parts:
        at = at / part
        with contextlib.suppress(FileExistsError):
            os.mkdir(at, 0o700)
    check_folder(where, root)
    return where


def private_cache(*parts: str) -> Path | None:
    """The checked private folder `cache_root()/refit/<parts>`, created 0700; None (after one WARNING per folder
    and process) where it or a folder above it up to the root fails the checks, or cannot be made."""
    try:
        root = cache_root()
    except RuntimeError as e:  # no home folder to be found
        refuse(Path("~/.cache").joinpath("refit", *parts), e)
        return None
    where = root.joinpath("refit", *parts)
    try:
        return make_private(where, root)
    except (NotPrivate, OSError) as e:
        refuse(where, e)
        return None


def refuse(where: Path, why: BaseException, variable: str = "XDG_CACHE_HOME") -> None:
    """The one WARNING per problem (a bad cache root is one, whichever helpers it refuses): what failed and the
    fix."""
    if str(why) in _warned:
        return
    _warned.add(str(why))
    log.warning(
        "not loading refit's compiled kernels from %s: %s. Fix: make the folder and its parents yours and "
        "writable only by you (chown $USER; chmod 700), or point %s at a private folder. Using the slower "
        "PyTorch path meanwhile",
        where,
        why,
        variable,
    )


def open_lock(where: Path) -> int:
    """The descriptor of `where`/refit.lock, created 0600, never through a symbolic link (OSError), and the
    user's own (NotPrivate)."""
    try:
        fd = os.open(where / "refit.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise NotPrivate(f"{where / 'refit.lock'} is a symbolic link") from None
        raise
    try:
        _check(where / "refit.lock", os.fstat(fd), "the lock file")
    except NotPrivate:
        os.close(fd)
        raise
    return fd


def owned_file(where: Path, name: str) -> Path | None:
    """`where`/`name` if it is a regular file of the user's that no one else may write; None if absent;
    NotPrivate for a link, another kind of file, or someone else's. `name` is a plain file name, never a path."""
    if os.sep in name or name in ("", ".", ".."):
        raise ValueError(f"{name!r} is not a plain file name")
    path = where / name
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode):
        raise NotPrivate(f"{path} is not a regular file (a symbolic link or another kind of file)")
    _check(path, st, "the file")
    return path


def triton_cache_private() -> bool:
    """Whether Triton's own cache (where it keeps compiled kernels and the host launchers it loads) is private
    by the same rules, checked from the user's home (or Triton's home) down to it, as far as it exists; False
    after one WARNING otherwise."""
    home = Path(os.environ.get("TRITON_HOME") or Path.home())
    where = Path(os.environ.get("TRITON_CACHE_DIR") or home / ".triton" / "cache")
    root = home if where.is_relative_to(home) else where
    while not root.exists() and root != root.parent:
        root = root.parent  # not made yet: its first existing folder decides who can put it there
    exists = where
    while not exists.exists() and exists != root:
        exists = exists.parent
    try:
        check_folder(exists, root)
    except (NotPrivate, OSError) as e:
        refuse(where, e, "TRITON_CACHE_DIR")
        return False
    return True
