"""The declared seams hold: no topology module but sender.py touches a Sender's private state (a round and the
membership policies call `refit.topology.seat.SenderInterface`), and the topology calls the methods `Transport`
and `Engine` declare instead of probing for them with getattr; every registered transport has them."""

from __future__ import annotations

import ast
import inspect
import os
import re

import pytest
from locations import SRC

from refit import transports
from refit.engines.base import Engine
from refit.topology.seat import SenderInterface
from refit.topology.sender import Sender
from refit.transports.base import Transport

TOPOLOGY = os.path.join(SRC, "refit", "topology")
SESSION_TYPES = {"Sender", "SenderInterface"}
SESSION_NAMES = {"sender", "session"}
"""Names that hold the session whatever their annotation (`sender` argument, `self.sender`)."""


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _names_session_type(annotation: ast.expr | None) -> bool:
    if annotation is None:
        return False
    for node in ast.walk(annotation):
        if isinstance(node, ast.Name) and node.id in SESSION_TYPES:
            return True
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if set(re.findall(r"\w+", node.value)) & SESSION_TYPES:
                return True
    return False


class _Holders:
    """Which local names and `self.` attributes of one module hold the session: annotated as one, named as one,
    or assigned from one (`self.s = sender`, `s = self.s`, `s, m = self.s, self.members`)."""

    def __init__(self, tree: ast.Module) -> None:
        self.names = set(SESSION_NAMES)
        self.attrs = set(SESSION_NAMES)
        for node in ast.walk(tree):
            if isinstance(node, ast.arg) and _names_session_type(node.annotation):
                self.names.add(node.arg)
            elif isinstance(node, ast.AnnAssign) and _names_session_type(node.annotation):
                self._hold(node.target)
        pairs = [p for node in ast.walk(tree) if isinstance(node, ast.Assign) for p in _pairs(node)]
        grown = True
        while grown:
            before = (len(self.names), len(self.attrs))
            for target, value in pairs:
                if self.holds(value):
                    self._hold(target)
            grown = (len(self.names), len(self.attrs)) != before

    def _hold(self, target: ast.expr) -> None:
        if isinstance(target, ast.Name):
            self.names.add(target.id)
        elif isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
            self.attrs.add(target.attr)

    def holds(self, node: ast.expr) -> bool:
        if isinstance(node, ast.Name):
            return node.id in self.names
        return (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
            and node.attr in self.attrs
        )


def _pairs(node: ast.Assign) -> list[tuple[ast.expr, ast.expr]]:
    """(target, value) for each name an assignment binds, tuples unpacked element by element."""
    found = []
    for target in node.targets:
        if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
            found += zip(target.elts, node.value.elts, strict=False)
        else:
            found.append((target, node.value))
    return found


def session_reach_ins(source: str, module: str) -> list[str]:
    """Each access to a private attribute of the session in `source`, as 'module:line: expression'."""
    tree = ast.parse(source)
    holders = _Holders(tree)
    hits = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and _private(node.attr) and holders.holds(node.value)
    ]
    return [f"{module}:{n.lineno}: {ast.unparse(n)}" for n in sorted(hits, key=lambda n: (n.lineno, n.col_offset))]


def probes(source: str, module: str, declared: set[str]) -> list[str]:
    """Each `getattr(obj, "name", ...)` / `hasattr(obj, "name")` in `source` for a method in `declared`."""
    return [
        f"{module}:{node.lineno}: {ast.unparse(node)}"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("getattr", "hasattr")
        and len(node.args) >= 2
        and isinstance(node.args[1], ast.Constant)
        and node.args[1].value in declared
    ]


def _topology_modules() -> list[tuple[str, str]]:
    found = []
    for f in sorted(os.listdir(TOPOLOGY)):
        if f.endswith(".py"):
            with open(os.path.join(TOPOLOGY, f)) as fh:
                found.append((f, fh.read()))
    return found


def _declared(cls: type) -> set[str]:
    return {n for n, v in vars(cls).items() if callable(v) and not n.startswith("_")}


def test_reach_ins_are_caught_through_annotations_names_and_assignments() -> None:
    source = """
class Policy:
    def __init__(self, sender: SenderInterface) -> None:
        self.s = sender

    def a(self) -> None:
        self.s._session.lobby.close()

    def b(self) -> None:
        s, members = self.s, self.members
        s._path = None

    def c(self, other: "Sender | None") -> int:
        return other._epoch + self._own + members._count
"""
    found = session_reach_ins(source, "policy.py")
    assert [f.split(": ", 1)[1] for f in found] == ["self.s._session", "s._path", "other._epoch"]


def test_no_topology_module_but_the_sender_touches_the_sessions_private_state() -> None:
    found = [r for name, source in _topology_modules() if name != "sender.py" for r in session_reach_ins(source, name)]
    assert not found, (
        "declare what these need as a public, documented method of Sender and of "
        "refit.topology.seat.SenderInterface, and call that instead:\n" + "\n".join(found)
    )


def test_the_sender_implements_every_method_of_its_declared_interface() -> None:
    members = [n for n in dir(SenderInterface) if not n.startswith("_")] + list(SenderInterface.__annotations__)
    missing = [n for n in members if not hasattr(Sender, n) and n not in Sender.__init__.__code__.co_names]
    assert not missing, f"Sender lacks {missing} of SenderInterface"
    private = [n for n in members if n.startswith("_")]
    assert not private, f"SenderInterface declares private names {private}: a seam is public"


def test_the_topology_calls_declared_transport_and_engine_methods_instead_of_probing() -> None:
    declared = _declared(Transport) | _declared(Engine)
    assert {"abort", "arrived", "close", "prepare", "release_buffers"} <= declared
    found = {name: probes(source, name, declared) for name, source in _topology_modules()}
    stray = [p for hits in found.values() for p in hits]
    assert not stray, "call the method Transport or Engine declares (its default covers the rest):\n" + "\n".join(stray)


@pytest.mark.parametrize("name", transports.names())
def test_every_registered_transport_has_abort_and_arrived_as_the_base_declares(name: str) -> None:
    cls = transports.get(name)
    assert issubclass(cls, Transport)
    for method in ("abort", "arrived"):
        ours, base = inspect.signature(getattr(cls, method)), inspect.signature(getattr(Transport, method))
        assert list(ours.parameters) == list(base.parameters), f"{cls.__qualname__}.{method}{ours} differs from base"


def test_the_base_defaults_abort_by_closing_know_no_arrivals_and_prepare_nothing() -> None:
    closed: list[bool] = []

    class Plain(Transport):
        name, device_type = "plain", "cpu"
        offer = join = send = recv = None  # type: ignore[assignment]

        def close(self) -> None:
            closed.append(True)

    Plain.__abstractmethods__ = frozenset()
    plain = Plain()
    assert plain.arrived() is None
    plain.abort()
    assert closed == [True]
    assert Engine.prepare(object(), None) is None  # type: ignore[arg-type]
    assert list(inspect.signature(Engine.prepare).parameters) == ["self", "manifest"]


MODE_WORDS = (
    "zero_copy",
    "delta",
    "staging",
    "elastic",
    "two_phase",
    "strict",
    "vote",
    "verify",
    "regroups",
    "fingerprint",
)
MAX_MODE_BRANCHES = 3


def mode_branches(source: str) -> dict[str, int]:
    """Per class: the `if` statements and conditional expressions whose test names a mode (MODE_WORDS)."""
    counts: dict[str, int] = {}
    for cls in (n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef)):
        tests = [ast.unparse(n.test) for n in ast.walk(cls) if isinstance(n, (ast.If, ast.IfExp))]
        counts[cls.name] = sum(any(w in t for w in MODE_WORDS) for t in tests)
    return counts


def test_mode_branches_are_counted_in_if_statements_and_conditional_expressions() -> None:
    source = (
        "class A:\n"
        "    def f(self):\n"
        "        if self.zero_copy:\n"
        "            x = 1 if self.delta else 2\n"
        "        if self.size:\n"
        "            pass\n"
        "class B:\n"
        "    pass\n"
    )
    assert mode_branches(source) == {"A": 2, "B": 0}


def test_no_topology_class_branches_on_modes_more_than_three_times() -> None:
    """Modes are policies and paths chosen once (a zero-copy epoch is its own send path), not flags each class
    asks again: at most MAX_MODE_BRANCHES mode tests per class."""
    over = [
        f"{module}: {cls} has {n} mode branches"
        for module, source in _topology_modules()
        for cls, n in mode_branches(source).items()
        if n > MAX_MODE_BRANCHES
    ]
    assert not over, "\n".join(over)


FORMATS_AND_CHECKS = re.compile(r"fp8|lora|canary|mxfp8")
"""Their modules' and functions' names (a message to the user may still say 'FP8')."""
OPTION_FIELDS = {"options.py"}
"""The one place a check is named in the topology: the Sender's own `canary` option, which its handler reads."""


def test_the_topology_names_no_format_or_check_but_the_senders_option() -> None:
    named = []
    for entry in sorted(os.listdir(TOPOLOGY)):
        if not entry.endswith(".py") or entry in OPTION_FIELDS:
            continue
        with open(os.path.join(TOPOLOGY, entry), encoding="utf-8") as f:
            named += [f"{entry}:{i}: {line.strip()}" for i, line in enumerate(f, 1) if FORMATS_AND_CHECKS.search(line)]
    assert not named, "the topology names formats or checks; read them through refit.stages handlers:\n" + "\n".join(
        named
    )


def test_the_sender_class_stays_small_and_mirrors_no_option_into_a_field() -> None:
    lines, _ = inspect.getsourcelines(Sender)
    assert len(lines) <= 350, f"Sender is {len(lines)} lines; move a job into its own module"
    from refit.topology.options import SenderOptions

    tree = ast.parse(inspect.getsource(Sender))
    fields = {f for f in SenderOptions.__dataclass_fields__} - {"delta_costs"}  # costs measured: the session's own
    mirrored = sorted(
        t.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        for target in node.targets
        for t in (target.elts if isinstance(target, ast.Tuple) else [target])
        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self" and t.attr in fields
    )
    assert not mirrored, f"Sender mirrors options into fields {mirrored}: read them from self.options"
