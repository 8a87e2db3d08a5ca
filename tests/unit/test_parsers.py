"""Hostile input to every parser (property tests): each either yields a value that keeps its invariants
or raises the one error it documents, never anything else, and never allocates from a claimed size."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from refit.checks.manifest_check import Report
from refit.errors import IntegrityError, PeerError
from refit.layout.manifest import Manifest
from refit.layout.planner import plan
from refit.layout.spec import TensorSpec
from refit.protocol.lobby import _parse_hello
from refit.protocol.wire import HEADER, MAX_JSON_BYTES, WITH_PAYLOAD, Header, Kind, _message, parse_json
from refit.topology.digest_plan import parse_regions

FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
numbers = st.one_of(
    st.integers(-(2**70), 2**70), st.integers(-3, 3000), st.floats(), st.booleans(), st.none(), st.text(max_size=3)
)
dtypes = st.sampled_from(["float32", "bfloat16", "int64", "uint8", "complex", 3, None])
names = st.one_of(st.text(min_size=0, max_size=4), st.integers())
entry = st.lists(st.one_of(names, st.lists(numbers, max_size=3), dtypes, numbers), min_size=5, max_size=8)
wellformed = st.tuples(
    st.sampled_from("abcdefgh"),
    st.lists(st.integers(0, 9), max_size=2),
    dtypes,
    st.integers(0, 4),
    st.sampled_from([0, 256, 512, 768, 1024]),
    st.integers(0, 600),
)


def _check(m: Manifest) -> None:
    """What a receiver relies on: every byte range inside its bucket's moved bytes, none overlapping."""
    for b, segs in enumerate(m.segments):
        spans = sorted((s.at, s.at + s.hi - s.lo) for s in segs)
        assert all(0 <= lo <= hi <= m.bucket_nbytes[b] <= m.capacity for lo, hi in spans)
        assert all(a[1] <= b_[0] for a, b_ in zip(spans, spans[1:]))
    for p in m.entries:
        assert 0 <= p.offset < m.capacity and p.offset % m.alignment == 0


def _parse(obj: object) -> None:
    try:
        m = Manifest.from_json(json.dumps(obj).encode())
    except ValueError:
        return
    _check(m)


@FAST
@given(
    capacity=numbers,
    alignment=numbers,
    sizes=st.lists(numbers, max_size=5),
    tensors=st.lists(entry, max_size=5),
    epoch=numbers,
)
def test_any_manifest_json_is_a_valid_layout_or_a_value_error(capacity, alignment, sizes, tensors, epoch) -> None:
    _parse(
        {
            "format": "refit.manifest/1",
            "capacity": capacity,
            "alignment": alignment,
            "bucket_nbytes": sizes,
            "tensors": tensors,
            "epoch": epoch,
        }
    )


@FAST
@given(
    rows=st.lists(wellformed, max_size=6, unique_by=lambda r: r[0]),
    sizes=st.lists(st.sampled_from([0, 256, 512, 1024, 1280]), min_size=1, max_size=5),
)
def test_near_valid_layouts_with_overlaps_or_overruns_are_rejected(rows, sizes) -> None:
    tensors = [[n, s, d, b, o, k] for n, s, d, b, o, k in sorted(rows)]
    _parse(
        {
            "format": "refit.manifest/1",
            "capacity": 1024,
            "alignment": 256,
            "bucket_nbytes": sizes,
            "tensors": tensors,
            "epoch": 1,
        }
    )


def test_overlapping_and_out_of_capacity_placements_are_named() -> None:
    ok = json.loads(
        plan([TensorSpec("a", (64,), torch.float32), TensorSpec("b", (64,), torch.float32)], capacity=1024).to_json()
    )
    overlap = {**ok, "tensors": [ok["tensors"][0], [*ok["tensors"][1][:4], 0, 256]]}
    beyond = {**ok, "tensors": [ok["tensors"][0], [*ok["tensors"][1][:4], 1280, 256]]}
    for bad, needle in ((overlap, "overlap"), (beyond, "outside its buckets")):
        try:
            Manifest.from_json(json.dumps(bad).encode())
        except ValueError as e:
            assert needle in str(e)
        else:
            raise AssertionError(f"accepted {bad}")


@FAST
@given(st.binary(max_size=200))
def test_manifest_bytes_are_a_manifest_or_a_value_error(data: bytes) -> None:
    try:
        _check(Manifest.from_json(data))
    except ValueError:
        pass


@FAST
@given(st.binary(min_size=HEADER.size, max_size=HEADER.size))
def test_any_64_bytes_are_a_bounded_header_or_an_integrity_error(data: bytes) -> None:
    try:
        h = Header.unpack(data)
    except IntegrityError:
        return
    assert h.kind not in WITH_PAYLOAD or h.nbytes <= MAX_JSON_BYTES


@FAST
@given(
    st.one_of(
        st.binary(max_size=100),
        st.builds(
            lambda o: json.dumps(o).encode(),
            st.recursive(
                numbers | st.text(max_size=5),
                lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=3), c, max_size=3),
                max_leaves=8,
            ),
        ),
    )
)
def test_json_payloads_and_hellos_parse_to_objects_or_integrity_errors(data: bytes) -> None:
    for parse in (lambda d: parse_json(d, "X"), lambda d: _parse_hello(Header(Kind.HELLO, nbytes=len(d)).pack() + d)):
        try:
            assert isinstance(parse(data), dict)
        except IntegrityError:
            pass


@FAST
@given(
    st.one_of(st.dictionaries(st.sampled_from(["a", "b", "zz"]), st.lists(numbers, max_size=4), max_size=3), numbers)
)
def test_regions_from_a_report_are_inside_the_tensor_or_a_peer_error(raw) -> None:
    m = plan([TensorSpec("a", (4, 6), torch.float32), TensorSpec("b", (3,), torch.float32)], capacity=1024)
    try:
        regions = parse_regions(raw, m)
    except PeerError:
        return
    for name, (dim, start, stop) in regions.items():
        assert 0 <= start <= stop <= m.entry(name).spec.shape[dim]


@FAST
@given(st.dictionaries(st.sampled_from(["missing", "unexpected", "mismatched", "x"]), numbers | st.lists(numbers)))
def test_reports_parse_without_raising(obj: dict) -> None:
    Report.from_json(obj).message()


@pytest.mark.parametrize(
    "data",
    [b"[" * 2000, b'{"a":' * 2000, b"\xff\xfe{}", b'{"a":' * 40 + b"1" + b"}" * 40, b'{"m":"\xc3("}'],
    ids=["deep-list", "deep-object", "bad-utf8", "over-depth", "bad-utf8-in-string"],
)
def test_deep_or_undecodable_json_is_an_integrity_error_in_every_parser(data: bytes) -> None:
    for parse in (lambda d: parse_json(d, "X"), lambda d: _parse_hello(Header(Kind.HELLO, nbytes=len(d)).pack() + d)):
        with pytest.raises(IntegrityError):
            parse(data)
    assert _message(data) == "(unreadable error message)"
