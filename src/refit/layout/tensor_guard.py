"""Tensor guard: checks that many plain tensors kept their identity, storage, dtype, device, shape and strides,
in one C call.

Two checks, the faster first. `layout_snapshot`: a small C++ helper compiled once per machine (as the fused digest
kernel is, `torch.utils.cpp_extension`, cached in a private folder under ~/.cache/refit, refit.layout.private_dir)
records each tensor's object, type, storage, address, dtype, device, dispatch keys, sizes and strides, and compares
them again in one loop (under 0.01 us a tensor). `tensor_guard`: where that helper cannot be built, torch.compile's
own `torch._C._dynamo.guards.TensorGuards` (dispatch keys, dtype, device, sizes and strides, under 0.1 us a tensor;
addresses are then read through Python). Both are used only after a probe shows, on this torch, that they hold for
the same tensors and fail after each kind of change; otherwise they return None and callers compare the metadata
themselves.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import ModuleType

import torch

from refit.layout.build_lock import build_lock
from refit.layout.private_dir import NotPrivate, owned_file, private_cache, refuse
from refit.log import get_logger
from refit.settings import cpu_kernel_enabled

log = get_logger("tensor_guard")
Check = Callable[..., bool]
_PLAIN = frozenset({torch.Tensor, torch.nn.Parameter})
Items = Sequence[torch.Tensor] | Mapping[str, torch.Tensor]


def plain(tensors: Sequence[torch.Tensor]) -> bool:
    """Every tensor a plain Tensor or Parameter (no subclass whose metadata lives elsewhere, e.g. DTensor)."""
    return set(map(type, tensors)) <= _PLAIN


def _build(tensors: Sequence[torch.Tensor]) -> Check:
    from torch._C._dynamo.guards import TensorGuards

    guards = TensorGuards(
        *tensors,
        dynamic_dims_sizes=[list(t.size()) for t in tensors],
        dynamic_dims_strides=[list(t.stride()) for t in tensors],
    )
    return guards.check


class _Probe(torch.Tensor):
    """A tensor subclass, for the probe's type change."""


@functools.cache
def _works() -> bool:
    """The probe: a snapshot holds for the same tensors, and fails after a reshape, a restride, a recast,
    a resize and a move to a different dtype of the same object (`.data =`), and for a tensor of another
    Python type in a tensor's place (so a check that holds also says every tensor is still plain)."""
    try:
        ts = [torch.zeros(4, 4), torch.zeros(16)]
        check = _build(ts)
        if not check(*ts):
            return False
        changes = [
            lambda: ts[0].as_strided_((4, 4), (1, 4)),
            lambda: ts[0].as_strided_((2, 8), (8, 1)),
            lambda: ts[1].resize_(8),
            lambda: setattr(ts[1], "data", torch.zeros(16, dtype=torch.float64)),
            lambda: setattr(ts[1], "data", torch.zeros(16, 1)),
        ]
        for change in changes:
            ts[0].set_(torch.zeros(4, 4))
            ts[1].data = torch.zeros(16)
            if not check(*ts):
                return False
            change()
            if check(*ts):
                return False
        ts[0].set_(torch.zeros(4, 4))
        ts[1].data = torch.zeros(16)
        return not check(torch.nn.Parameter(ts[0]), ts[1]) and not check(ts[0].as_subclass(_Probe), ts[1])
    except Exception as e:  # noqa: BLE001 - any other torch: fall back, never guess
        log.info("TensorGuards unusable here (%s: %s); layout checks read metadata through Python", type(e).__name__, e)
        return False


def tensor_guard(tensors: Sequence[torch.Tensor]) -> Check | None:
    """A check `check(*tensors) -> bool` that holds while every tensor keeps its dtype, device, shape and
    strides (not its address: check data_ptr apart), or None where that cannot be had."""
    if not tensors or not plain(tensors) or not _works():
        return None
    try:
        return _build(tensors)
    except Exception:  # noqa: BLE001 - an unusable guard means the Python fallback, never a wrong answer
        return None


_SOURCE = r"""
#include <Python.h>
#include <torch/csrc/autograd/python_variable.h>
#include <cstring>
#include <vector>

#define REFIT_CAT2(a, b) a##b
#define REFIT_CAT(a, b) REFIT_CAT2(a, b)
#define REFIT_STR2(a) #a
#define REFIT_STR(a) REFIT_STR2(a)

namespace {

// Records each field; a check records into a scratch vector and compares it with the snapshot at the end.
// Without `identity` the tensor objects themselves are not recorded (another object over the same memory,
// in the same layout, passes): a caller whose tensors are fresh views each time still matches.
// `held` (a snapshot only) keeps a weak reference to each storage: while one is held the StorageImpl object is
// never freed, so no other storage can take its address; a storage that died (expired) fails the check.
using Weak = std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>>;
struct Sink {
    std::vector<int64_t>& out;
    bool identity;
    Weak* held;
    void put(int64_t v) { out.push_back(v); }
};

int64_t word(const void* p) { return static_cast<int64_t>(reinterpret_cast<intptr_t>(p)); }

// False when `o` is no readable strided tensor (the snapshot is then refused, the check fails).
bool record(PyObject* key, PyObject* o, Sink& s) {
    if (!THPVariable_Check(o)) return false;
    const at::Tensor& t = THPVariable_Unpack(o);
    c10::TensorImpl* impl = t.unsafeGetTensorImpl();
    if (impl->layout() != c10::kStrided || !impl->has_storage() || impl->has_symbolic_sizes_strides()) return false;
    const c10::Storage& storage = impl->storage();
    if (s.held) s.held->push_back(storage.getWeakStorageImpl());
    const char* base = static_cast<const char*>(storage.data());  // const: never materialises a lazy copy
    s.put(s.identity ? word(o) : 0);
    s.put(s.identity ? word(key) : 0);
    s.put(word(Py_TYPE(o)));
    s.put(word(storage.unsafeGetStorageImpl()));
    s.put(word(base ? base + impl->storage_offset() * static_cast<int64_t>(impl->itemsize()) : nullptr));
    s.put(static_cast<int64_t>(impl->dtype().toScalarType()));
    s.put((static_cast<int64_t>(impl->device_type()) << 16) | static_cast<uint16_t>(impl->device().index()));
    s.put(static_cast<int64_t>(impl->key_set().raw_repr()));
    s.put(impl->dim());
    for (int64_t v : impl->sizes()) s.put(v);
    for (int64_t v : impl->strides()) s.put(v);
    return true;
}

bool walk(PyObject* items, Sink& s) {
    s.put(s.identity);
    if (PyDict_CheckExact(items)) {
        s.put(PyDict_GET_SIZE(items));
        Py_ssize_t pos = 0;
        PyObject *k, *v;
        while (PyDict_Next(items, &pos, &k, &v))
            if (!record(k, v, s)) return false;
        return true;
    }
    if (!PyList_CheckExact(items) && !PyTuple_CheckExact(items)) return false;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(items);
    PyObject** each = PySequence_Fast_ITEMS(items);
    s.put(n);
    for (Py_ssize_t i = 0; i < n; ++i)
        if (!record(nullptr, each[i], s)) return false;
    return true;
}

const char* WEAK = "refit_layout_storages";

void drop(PyObject* capsule) { delete static_cast<Weak*>(PyCapsule_GetPointer(capsule, WEAK)); }

PyObject* take(PyObject*, PyObject* args) {
    PyObject* items;
    int identity;
    if (!PyArg_ParseTuple(args, "Op", &items, &identity)) return nullptr;
    std::vector<int64_t> out;
    Weak* held = new Weak();
    Sink s{out, identity != 0, held};
    try {
        if (!walk(items, s)) {
            delete held;
            Py_RETURN_NONE;
        }
    } catch (...) {
        delete held;
        Py_RETURN_NONE;
    }
    PyObject* capsule = PyCapsule_New(held, WEAK, drop);
    if (!capsule) {
        delete held;
        return nullptr;
    }
    const char* raw = reinterpret_cast<const char*>(out.data());
    PyObject* bytes = PyBytes_FromStringAndSize(raw, out.size() * sizeof(int64_t));
    if (!bytes) {
        Py_DECREF(capsule);
        return nullptr;
    }
    return Py_BuildValue("(NN)", bytes, capsule);
}

PyObject* same(PyObject*, PyObject* args) {
    PyObject *items, *snap, *capsule;
    if (!PyArg_ParseTuple(args, "OSO", &items, &snap, &capsule)) return nullptr;
    Weak* held = static_cast<Weak*>(PyCapsule_GetPointer(capsule, WEAK));
    if (!held) return nullptr;
    static std::vector<int64_t> now;  // under the GIL: one caller at a time
    now.clear();
    const int64_t* want = reinterpret_cast<const int64_t*>(PyBytes_AS_STRING(snap));
    Sink s{now, PyBytes_GET_SIZE(snap) >= 8 && want[0] != 0, nullptr};
    bool ok;
    try {
        ok = walk(items, s) && static_cast<Py_ssize_t>(now.size() * sizeof(int64_t)) == PyBytes_GET_SIZE(snap) &&
             std::memcmp(now.data(), PyBytes_AS_STRING(snap), PyBytes_GET_SIZE(snap)) == 0;
        for (size_t i = 0; ok && i < held->size(); ++i) ok = !(*held)[i].expired();
    } catch (...) {
        ok = false;
    }
    return PyBool_FromLong(ok);
}

PyMethodDef methods[] = {
    {"take", take, METH_VARARGS, "(items, identity): the snapshot of a list, tuple or dict of tensors, or None"},
    {"same", same, METH_VARARGS, "whether (items, snapshot) still matches"},
    {nullptr, nullptr, 0, nullptr},
};
PyModuleDef module = {PyModuleDef_HEAD_INIT, REFIT_STR(TORCH_EXTENSION_NAME), nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC REFIT_CAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&module); }
"""

BUILD_WAIT_S = 300.0
"""How long a process waits for another one's build of the helper before it takes the slower checks."""


def _where() -> Path | None:
    """The helper's checked private cache folder (refit.layout.private_dir), or None after one WARNING."""
    tag = hashlib.sha256(f"{_SOURCE}|{torch.__version__}|{sys.version}".encode()).hexdigest()[:16]
    return private_cache("layout_guard", tag)


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _compile(where: Path) -> ModuleType:
    """Build under the build lock; a finished build is marked by `built.ok`, written last. Only the library of
    the expected name inside `where` is ever loaded (never a path read from a file)."""
    from torch.utils import cpp_extension

    name = f"refit_layout_{where.name}"
    with build_lock(where, "the layout helper", BUILD_WAIT_S):
        path = owned_file(where, f"{name}.so")
        if path is not None and owned_file(where, "built.ok") is not None:
            return _load(name, path)
        src = where / "refit_layout.cpp"
        src.unlink(missing_ok=True)
        src.write_text(_SOURCE)
        cpp_extension.load(name=name, sources=[str(src)], build_directory=str(where), extra_cflags=["-O2"])
        path = owned_file(where, f"{name}.so")
        if path is None:
            raise FileNotFoundError(f"the build left no {name}.so in {where}")
        (where / "built.ok").write_text("built\n")
        return _load(name, path)


@functools.cache
def _helper() -> ModuleType | None:
    """The compiled helper, probed; None (after one INFO line) where it cannot be built or fails the probe, and
    without trying where REFIT_CPU_KERNEL=0."""
    if not cpu_kernel_enabled():
        return None
    where = _where()
    if where is None:
        return None
    try:
        lib = _compile(where)
        if _probe(lambda ts: _checker(lib, ts)):
            return lib
        log.info("the compiled layout check failed its probe on this torch; using TensorGuards")
    except NotPrivate as e:
        refuse(where, e)
    except Exception as e:  # noqa: BLE001 - no compiler, no headers, any build error: the slower check, never a failure
        log.info("the compiled layout check did not build (%s: %s); using TensorGuards", type(e).__name__, e)
    return None


def _probe(snapshot: Callable[[list[torch.Tensor]], Callable[[Items], bool] | None]) -> bool:
    """A snapshot holds for the same tensors after their values changed, and fails after each change of
    layout, memory, identity or type."""
    changes: list[Callable[[list[torch.Tensor]], object]] = [
        lambda ts: ts[0].as_strided_((4, 4), (1, 4)),
        lambda ts: ts[0].resize_(2, 4),
        lambda ts: ts[0].set_(torch.zeros(4, 4)),
        lambda ts: ts[0].set_(ts[0].untyped_storage(), 4, (3, 4), (4, 1)),
        lambda ts: setattr(ts[1], "data", torch.zeros(16, dtype=torch.float64)),
        lambda ts: setattr(ts[1], "data", torch.zeros(16)),
        lambda ts: ts.__setitem__(1, ts[1].detach()),
        lambda ts: ts.__setitem__(1, torch.nn.Parameter(ts[1])),
        lambda ts: ts.__setitem__(1, ts[1]._neg_view()),
        lambda ts: ts.__setitem__(1, ts[1].as_subclass(_Probe)),
        lambda ts: ts.append(torch.zeros(1)),
        lambda ts: (setattr(ts[1], "data", torch.empty(0)), setattr(ts[1], "data", torch.zeros(16))),
    ]
    for change in changes:
        ts = [torch.zeros(4, 4), torch.zeros(16)]
        holds = snapshot(ts)
        ts[0].add_(1.0)
        if holds is None or not holds(ts) or not holds(tuple(ts)):
            return False
        change(ts)
        if holds(ts):
            return False
    return True


def _flat(items: Items) -> Items:
    """What the helper walks: a list, tuple or dict itself; another mapping as a dict (its key objects, in its
    order); another sequence as a list."""
    if type(items) in (list, tuple, dict):
        return items
    return dict(items) if isinstance(items, Mapping) else list(items)


def _checker(lib: ModuleType, items: Items, identity: bool = True) -> Callable[[Items], bool] | None:
    taken = lib.take(_flat(items), identity)
    if taken is None:
        return None
    snap, storages = taken  # the storages weakly held: a freed one fails the check, its address is never reused
    same = lib.same
    return lambda now: bool(same(_flat(now), snap, storages))


def layout_snapshot(items: Items, *, identity: bool = True) -> Callable[[Items], bool] | None:
    """A check `holds(items)` that is True only while `items` (tensors, or a mapping of names to tensors) has
    the same length and, item by item, a tensor of the same type on the same storage at the same address, with
    the same dtype, device, dispatch keys (negated or conjugated views), shape and strides (values may change);
    with `identity`, also the very same tensor object, and for a mapping the same key object in the same order.
    One C pass. None where the compiled helper is unavailable or an item is no plain strided tensor.
    Storages are held weakly, so one freed since the snapshot fails it even where a new one took its address;
    tensor and key objects are compared by address: keep them alive while the check is in use."""
    tensors = list(items.values()) if isinstance(items, Mapping) else items
    if not tensors or not plain(tensors):
        return None
    lib = _helper()
    return None if lib is None else _checker(lib, items, identity)


def prepare() -> None:
    """Build (or load) the compiled helper now, at a session's connect, so that no refit waits for its build."""
    _helper()
