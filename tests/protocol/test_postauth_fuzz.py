"""Everything read from a peer after it proved the token, fuzzed: COMMIT (its canary), the two-phase verdict,
VERIFY's digests, the manifest's stages, REPORT and its regions, DONE, and the READY statements (FP8 formats,
LoRA, M:N shards, the canary's ability). Each parser yields a value that keeps its invariants or raises the
error it documents (a RefitError, which fails the refit or refuses the handshake with the session alive; a
ValueError for what a statement refuses at connect), never another exception. End to end: a malformed COMMIT
fails its refit at once, the engine reads failed, and the next refit commits."""

from __future__ import annotations

import json
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from threaded import refit_both, session

from refit import Canary, ModuleEngine, ModuleSource, RefitError, Settings, State
from refit.checks import canary
from refit.checks.manifest_check import Report
from refit.errors import IntegrityError
from refit.layout.manifest import Manifest
from refit.layout.planner import plan
from refit.layout.spec import TensorSpec
from refit.protocol.wire import Done, parse_json
from refit.stages import fp8, lora
from refit.topology import mesh
from refit.topology.digest_plan import compare, parse_regions
from refit.topology.receive_round import _carried
from refit.topology.stats import RefitStats

FAST = settings(
    derandomize=True, max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
SLOW = settings(
    derandomize=True, max_examples=600, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
PROFILES = [pytest.param(FAST, id="fast"), pytest.param(SLOW, id="slow", marks=pytest.mark.slow)]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.sampled_from([10**400, -(10**400), 2**63, -1, 0]),
    st.floats(),
    st.text(max_size=8),
)
values = st.recursive(
    scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4), max_leaves=12
)


def _fields(keys: list[str], near: st.SearchStrategy) -> st.SearchStrategy[dict]:
    """An object with any of `keys`, each a near-valid value or anything."""
    return st.fixed_dictionaries({}, optional={k: st.one_of(near, values) for k in keys})


def _dumps(obj: object) -> bytes:
    return json.dumps(obj, ensure_ascii=False).encode("utf-8", "surrogatepass")


def _payloads(objects: st.SearchStrategy) -> st.SearchStrategy[bytes]:
    """A message's payload: junk bytes, any JSON, or a near-valid object."""
    return st.one_of(st.binary(max_size=200), values.map(_dumps), objects.map(_dumps))


tokens = st.lists(st.integers(-2, 2**32), min_size=0, max_size=6)
logprobs = st.lists(st.one_of(st.floats(), st.sampled_from([-(10**400), -1, 0, 1])), max_size=6)
canaries = st.fixed_dictionaries(
    {"tokens": st.one_of(tokens, values), "logprobs": st.one_of(logprobs, values), "tolerance": values}
)
commits = st.one_of(st.fixed_dictionaries({"canary": st.one_of(canaries, values)}), _fields(["canary", "x"], canaries))
hex16 = st.one_of(
    st.binary(min_size=8, max_size=8).map(bytes.hex), st.text(min_size=16, max_size=16), st.just(" " * 2 + "0" * 14)
)
verifies = _fields(["digests"], st.lists(st.one_of(hex16, values), min_size=0, max_size=3))
regions = st.dictionaries(st.sampled_from(["a", "b", "zz"]), st.lists(scalars, max_size=4), max_size=3)
reports = _fields(
    ["missing", "unexpected", "mismatched", "waived", "stages", "unsynced", "regions"],
    st.one_of(st.lists(st.lists(scalars, max_size=4), max_size=3), regions),
)
blocks = st.lists(st.one_of(st.integers(-2, 2**40), values), max_size=3)
formats = st.dictionaries(
    st.text(max_size=4),
    _fields(["dtype", "block", "scale", "scale_dtype"], st.one_of(st.sampled_from(["float8_e4m3fn", "x"]), blocks)),
    max_size=2,
)
loras = _fields(
    ["rank", "alpha", "targets", "base"],
    st.one_of(st.integers(-1, 64), st.dictionaries(st.text(max_size=4), st.lists(scalars, max_size=3), max_size=2)),
)
statements = _fields(["formats", "lora", "canary", "shards", "ignore", "ties"], st.one_of(formats, loras, values))

SPECS = [TensorSpec("a", (4, 6), torch.float32), TensorSpec("b", (3,), torch.float32)]
MANIFEST = plan(SPECS, capacity=1024)
ENGINE = ModuleEngine(torch.nn.ParameterDict({n: torch.nn.Parameter(torch.zeros(s.shape)) for n, s in [("a", SPECS[0]), ("b", SPECS[1])]}))  # fmt: skip


def _commit(payload: bytes) -> None:
    """The engine's parse of COMMIT (refit.topology.receive_round): a probe that keeps its invariants, or a
    RefitError that fails the refit."""
    try:
        probe = _carried(payload).get("canary")
    except RefitError:
        return
    if probe is not None:
        assert 2 <= len(probe.tokens) <= canary.MAX_PROBE_TOKENS and len(probe.logprobs) == len(probe.tokens) - 1
        assert all(isinstance(v, float) and -float("inf") < v <= 0 for v in probe.logprobs)
        assert probe.tolerance is None or 0 < probe.tolerance < float("inf")
        assert canary.diverged([0.0] * len(probe.logprobs), probe, probe.tolerance or 1.0, 1) is not True


def _verify(payload: bytes) -> None:
    """The engine's parse of VERIFY against what it holds: names that differ, or a RefitError."""
    try:
        bad, unreadable = compare(MANIFEST, ENGINE, parse_json(payload, "VERIFY").get("digests"))
    except RefitError:
        return
    assert set(bad) <= set(MANIFEST.names) and not unreadable


def _verdict(payload: bytes) -> None:
    """The two-phase verdict's COMMIT: its message, or IntegrityError."""
    try:
        str(parse_json(payload, "COMMIT").get("message", ""))
    except IntegrityError:
        return


def _stages(names: object) -> None:
    """A manifest whose stages field is anything: a manifest (its stages registered names or refused at the
    REPORT) or ValueError."""
    obj = json.loads(MANIFEST.to_json())
    obj["stages"] = names
    try:
        m = Manifest.from_json(_dumps(obj))
    except ValueError:
        return
    assert all(isinstance(n, str) for n in m.stages)


def _report(payload: bytes) -> None:
    """The sender's parse of REPORT: a report whose message is a string, regions inside the tensors, or a
    RefitError (the handshake is refused)."""
    try:
        obj = parse_json(payload, "REPORT")
        assert isinstance(Report.from_json(obj).message(), str)
        got = parse_regions(obj.get("regions"), MANIFEST)
    except RefitError:
        return
    for name, (dim, start, stop) in got.items():
        assert 0 <= start <= stop <= MANIFEST.entry(name).spec.shape[dim]


def _done(payload: bytes) -> None:
    try:
        d = Done.from_json(parse_json(payload, "DONE"))
    except IntegrityError:
        return
    assert isinstance(d.message, str) and d.unverified >= 0


def _statement(raw: bytes) -> None:
    """Every parse of a READY statement: what it states, or ValueError (refused at connect, naming it)."""
    canary.unable([raw])
    canary.mismatch(raw, 1)
    for parse in (
        lambda: fp8.parse_statement(raw, "receiver 1"),
        lambda: lora.parse(raw, "receiver 1"),
        lambda: mesh._parse_statement(raw, 1),
    ):
        try:
            parse()
        except (ValueError, RefitError):
            pass


PARSERS = {
    "commit": (_commit, _payloads(commits)),
    "verify": (_verify, _payloads(verifies)),
    "verdict": (_verdict, _payloads(_fields(["message"], values))),
    "stages": (_stages, st.one_of(values, st.lists(st.one_of(st.sampled_from(["delta", "fp8", "x"]), values)))),
    "report": (_report, _payloads(reports)),
    "done": (_done, _payloads(_fields(["message", "unverified", "unverified_names"], values))),
    "statement": (_statement, st.one_of(st.just(b""), _payloads(statements))),
}


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("name", sorted(PARSERS))
def test_every_post_handshake_parser_yields_a_value_or_its_own_error(name: str, profile: settings) -> None:
    check, strategy = PARSERS[name]
    profile(given(strategy)(check))()


@pytest.mark.parametrize(
    "bad",
    [
        {"tokens": [1, 2], "logprobs": [-(10**400)], "tolerance": None},
        {"tokens": [1, 2], "logprobs": [-1.0], "tolerance": 10**400},
        {"tokens": [1, 2], "logprobs": [float("-inf")], "tolerance": None},
        {"tokens": [1, 2], "logprobs": [-1.0], "tolerance": float("inf")},
        {"tokens": [1, 2], "logprobs": [float("nan")], "tolerance": None},
    ],
)
def test_a_canary_number_no_float_holds_is_refused_as_malformed(bad: dict) -> None:
    with pytest.raises(IntegrityError, match="COMMIT's canary is malformed"):
        canary.parse(bad)
    with pytest.raises(IntegrityError, match="COMMIT's canary is malformed"):
        _carried(_dumps({"canary": bad}))


def test_a_report_row_of_the_wrong_length_is_dropped_not_raised() -> None:
    _report(b'{"mismatched":[[], ["a"], ["a", "b", "c", "d"]]}')


def test_a_statement_whose_formats_are_no_collection_is_refused_at_connect() -> None:
    _statement(b'{"formats": true}')


def test_a_verify_digest_with_whitespace_is_refused_not_misread() -> None:
    with pytest.raises(IntegrityError, match="VERIFY must list one digest"):
        compare(MANIFEST, ENGINE, ["  " + "0" * 14, "0" * 16])


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(32, 8), torch.nn.Linear(8, 32))


def test_a_malformed_commit_fails_its_refit_at_once_and_the_next_refit_commits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    trainer, engine = _model(0), ModuleEngine(_model(1))
    real = canary.Canary.reference_payload
    with session(
        ModuleSource(trainer),
        engine,
        Settings(bucket_bytes=64 << 10, timeout_s=60.0),
        canary=Canary([1, 5, 7, 3], canary.causal_lm(trainer)),
    ) as (sender, peer):
        monkeypatch.setattr(
            canary.Canary, "reference_payload", lambda self: {**real(self), "logprobs": [-(10**400)] * 3}
        )
        t = time.monotonic()
        stats, got = refit_both(sender, peer, 1)
        assert time.monotonic() - t < 30  # at once, not at the timeout
        assert isinstance(stats, RefitError) and "COMMIT's canary is malformed" in str(stats), stats
        assert isinstance(got, IntegrityError) and engine.weights.state == State.FAILED, got
        monkeypatch.setattr(canary.Canary, "reference_payload", real)
        stats, got = refit_both(sender, peer, 1)
        assert isinstance(got, RefitStats) and "canary" in got.seconds, got
        assert (engine.weights.state, engine.weights.version) == (State.CURRENT, 1)


def test_an_unexpected_error_in_a_refit_fails_the_engine_and_tells_the_trainer_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from refit.topology.receive_path import ReceivePath

    def broken(*args: object, **kwargs: object) -> None:
        raise ZeroDivisionError("a bug on the engine's side")

    trainer, engine = _model(0), ModuleEngine(_model(1))
    with session(ModuleSource(trainer), engine, Settings(bucket_bytes=64 << 10, timeout_s=60.0)) as (sender, peer):
        assert isinstance(refit_both(sender, peer, 1)[1], RefitStats)
        monkeypatch.setattr(ReceivePath, "take", broken)
        t = time.monotonic()
        stats, got = refit_both(sender, peer, 2)
        assert time.monotonic() - t < 30  # told at once, not at the timeout
        assert isinstance(got, ZeroDivisionError) and "a bug on the engine's side" in str(stats), (stats, got)
        assert (engine.weights.state, engine.weights.version) == (State.FAILED, 1)
