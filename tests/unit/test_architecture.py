"""The layering holds: import-linter's contracts, no package reaching into another's private names, and ruff
format (not `# fmt: skip`) owning the layout of src/."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys

import pytest
from locations import ROOT, SRC

PACKAGE = os.path.join(SRC, "refit")
MAX_FMT_SKIPS = 10


def _modules() -> list[tuple[str, str]]:
    """(dotted module name, path) for every module under src/refit."""
    found = []
    for folder, _, files in os.walk(PACKAGE):
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                parts = os.path.relpath(path, SRC)[: -len(".py")].split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                found.append((".".join(parts), path))
    return sorted(found)


def _is_package(module: str) -> bool:
    return os.path.isfile(os.path.join(SRC, *module.split("."), "__init__.py"))


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_imports(source: str, importer: str) -> list[str]:
    """`from refit.x.y import _z` (or `import refit.x._y`, or a name from a private module) in `importer`'s
    source where `importer` lies outside package refit.x: each as 'importer: from module import name'."""
    found = []
    package = importer if _is_package(importer) else importer.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            targets = [(module, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [tuple(a.name.rsplit(".", 1)) for a in node.names if "." in a.name]
        else:
            continue
        for module, name in targets:
            parts = module.split(".")
            if parts[0] != "refit" or not any(_private(p) for p in [*parts[1:], name]):
                continue
            owner = ".".join(parts[:2])
            if importer != owner and not importer.startswith(owner + "."):
                found.append(f"{importer}: from {module} import {name}")
    return found


def test_private_imports_are_caught_across_packages_and_allowed_within() -> None:
    bad = "from refit.layout.spec import _parse\nfrom refit.checks import _digest\nimport refit.layout._hidden\n"
    assert len(private_imports(bad, "refit.topology.sender")) == 3
    good = "from refit.layout.spec import _parse\nfrom ._x import y\nfrom refit.layout.spec import TensorSpec\n"
    assert private_imports(good, "refit.layout.packing") == []
    assert private_imports("from .spec import _parse\n", "refit.layout.packing") == []
    assert private_imports("from ..layout.spec import _parse\n", "refit.topology.sender") != []
    assert private_imports("from refit.settings import _default\n", "refit.topology.sender") != []
    assert private_imports("from refit.errors import __doc__\n", "refit.topology.sender") == []


def test_no_package_imports_another_packages_private_names() -> None:
    found = []
    for module, path in _modules():
        with open(path) as f:
            found += private_imports(f.read(), module)
    assert not found, "\n".join(found)


def test_import_linter_contracts_hold() -> None:
    exe = shutil.which("lint-imports") or shutil.which("lint-imports", path=os.path.dirname(sys.executable))
    if exe is None:
        pytest.skip("lint-imports is not installed (pip install -e '.[test]')")
    r = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "broken" in r.stdout and " 0 broken" in r.stdout, r.stdout[-2000:]


def test_ruff_format_owns_the_layout_of_src() -> None:
    skips = []
    for _, path in _modules():
        with open(path) as f:
            skips += [f"{os.path.relpath(path, ROOT)}:{i}" for i, line in enumerate(f, 1) if "# fmt: skip" in line]
    assert len(skips) <= MAX_FMT_SKIPS, f"{len(skips)} '# fmt: skip' in src/ (at most {MAX_FMT_SKIPS}): {skips}"
