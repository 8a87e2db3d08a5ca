"""The fingerprint digest: equal to its definition (docs/PROTOCOL.md, step 4 of the Refit) on every path
(CPU rows, small batches, the Triton kernel, CUDA), changed by any change or move of a word and by every
single flipped bit, and additive over disjoint ranges at their global word offsets."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from refit.checks.tensor_digest import ROW_WORDS, Pending, digests
from refit.topology.digest_plan import _exact

SPEC_M = 0x9E3779B97F4A7C15
MASK = (1 << 64) - 1


def _weight(p: int) -> int:
    """The spec's weight of the word at global position p: 2 * M * p + 1 (mod 2^64), odd for every p."""
    return (2 * SPEC_M * p + 1) & MASK


def _reference_value(t: torch.Tensor, offset: int = 0) -> int:
    """The spec, word by word in plain Python integers (no shared code with the kernels): the sum of each
    little-endian word (zero-padded) times its weight at its global position, plus the byte length."""
    data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    data += bytes(-len(data) % 8)
    words = [int.from_bytes(data[i : i + 8], "little") for i in range(0, len(data), 8)]
    return (sum(w * _weight(offset + p) for p, w in enumerate(words)) + t.numel() * t.element_size()) & MASK


def _reference(t: torch.Tensor) -> str:
    return f"{_reference_value(t):016x}"


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    big = torch.randn(ROW_WORDS * 2 + 37, generator=g, dtype=torch.float64)  # whole rows and a remainder
    return [
        torch.randn(64, 48, generator=g),
        torch.randn(3, generator=g).to(torch.bfloat16),  # 6 bytes: one partial word
        big,
        torch.zeros(0),
        torch.randn(7001, generator=g).to(torch.bfloat16)[1:],  # starts 2 bytes into its storage
        torch.randn(5, 7, generator=g).t(),  # not contiguous
        torch.randint(-(2**62), 2**62, (40,), generator=g),  # sums that wrap
    ]


def _hexes(tensors: list[torch.Tensor]) -> list[str]:
    pending = Pending()
    pending.add(tensors)
    return pending.hexes()


def test_every_path_equals_the_definition() -> None:
    tensors = _tensors()
    assert _hexes(tensors) == [_reference(t) for t in tensors]
    assert _hexes(tensors[2:3]) == [_reference(tensors[2])]  # alone: the row path; above: the same value


def test_a_changed_moved_or_transposed_word_changes_the_digest() -> None:
    base = torch.randn(96, 64, generator=torch.Generator().manual_seed(1))
    swapped = base.clone().view(-1)
    swapped[[10, 500]] = swapped[[500, 10]]
    nudged = base.clone()
    nudged[3, 3] = torch.nextafter(nudged[3, 3], torch.tensor(1e9))
    shifted = torch.roll(base.view(-1), 2).view(96, 64)
    variants = [base, base.t().contiguous(), swapped.view(96, 64), nudged, shifted, base[:, :63]]
    assert len(set(_hexes(variants))) == len(variants)


_KERNEL = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
import test_digest as t
from refit.checks import tensor_digest as digest
assert digest.available(torch.device("cpu")), "Triton's interpreter is not active"
tensors = [x for x in t._tensors() if x.numel() < 100_000]  # the interpreter runs each program in Python
ok = t._hexes(tensors) == [t._reference(x) for x in tensors]
base = torch.randint(-(2**62), 2**62, (2 * t.ROW_WORDS + 3,), generator=torch.Generator().manual_seed(3))
variants = [base.clone() for _ in range(64)]
for bit, v in enumerate(variants):  # every bit, each in a word of another residue class
    t._flip(v, (bit * 1031) % base.numel(), bit)
ok = ok and t._hexes(variants) == [t._reference(v) for v in variants]
pieces, offsets = t._ranges(base.view(torch.uint8)[:-1], [5, t.ROW_WORDS + 1])
values = digest.digests(pieces, offsets)
ok = ok and [int(v) & t.MASK for v in values] == [t._reference_value(p, o) for p, o in zip(pieces, offsets)]
print("OK" if ok else "MISMATCH")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a CUDA machine the gpu test runs the compiled kernel")
def test_the_triton_kernel_equals_the_definition_under_the_interpreter() -> None:
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run(
        [sys.executable, "-c", _KERNEL, os.path.dirname(__file__)], env=env, capture_output=True, text=True
    )
    assert r.returncode == 0 and r.stdout.strip() == "OK", r.stderr[-2000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_digests_equal_the_cpu_ones_bit_for_bit() -> None:
    """Mixed (regular tensors through the address table, the others as copied bytes), then regular ones alone."""
    tensors = _tensors() + [torch.randn(3 << 20).to(torch.bfloat16)]
    assert _hexes([t.cuda() for t in tensors]) == _hexes(tensors)
    regular = [t.cuda() for t in tensors if t.is_contiguous() and t.nbytes % 8 == 0]
    assert len(regular) >= 4 and all(t.data_ptr() % 8 == 0 for t in regular)
    assert _hexes(regular) == [_reference(t) for t in regular]


def test_many_small_whole_word_tensors_take_the_flat_path_and_equal_the_definition() -> None:
    """Whole-word tensors of mixed dtypes and layouts, flattened per dtype in one C call each."""
    g = torch.Generator().manual_seed(1)
    base = torch.randn(9, 16, generator=g)
    tensors = [
        *(torch.randn(4 * k + 4, generator=g).to(torch.bfloat16) for k in range(50)),
        base.t(),  # not contiguous: its logical order, not its storage order
        base[2:5],  # a storage offset
        torch.tensor(7, dtype=torch.int64),  # 0-dim
        torch.zeros(0, 3),
        torch.randint(-(2**62), 2**62, (16,), generator=g),
        torch.randn(8, generator=g).to(torch.float16).expand(2, 8),
    ]
    assert _hexes(tensors) == [_reference(t) for t in tensors]
    from refit.checks import tensor_digest as digest

    assert digest._sums_flat(tensors, torch.device("cpu")) is not None  # the path under test


# -- single-bit flips: every weight is odd, so every flipped bit of every word changes the digest ----------

ROW_PATH_WORDS = 2 * ROW_WORDS + 40
"""A tensor this long, digested alone on CPU, takes the row path (whole rows and a remainder)."""


def _old_weight_zeros(p: int) -> int:
    """Trailing zero bits of the old weight M * p + 1: the top bits of word p it dropped."""
    w = (SPEC_M * p + 1) & MASK
    return 64 if w == 0 else (w & -w).bit_length() - 1


def _probe_positions(n: int) -> list[int]:
    """Word positions of every residue class that matters: the first 16, the row and block (2048) boundaries,
    36035 (the old weight dropped its top 16 bits), the worst positions of the old weight, the last word."""
    worst = sorted(range(n), key=_old_weight_zeros)[-4:]
    edges = [2047, 2048, ROW_WORDS - 1, ROW_WORDS, ROW_WORDS + 1, 2 * ROW_WORDS - 1, 2 * ROW_WORDS, n - 1]
    return sorted({*range(16), *edges, 36035, *worst})


def _flip(words: torch.Tensor, p: int, bit: int) -> None:
    """Flip bit `bit` of int64 word `p`, in place (flipping it twice restores it)."""
    words[p] ^= -(1 << 63) if bit == 63 else 1 << bit


def _delta(old: int, new: int, p: int) -> int:
    """How a word's change from `old` to `new` (signed int64) at position p moves the digest, per the spec."""
    return ((new - old) * _weight(p)) & MASK


def _assert_every_flip_detected(words: torch.Tensor, positions: list[int], bits: range = range(64)) -> None:
    """Flip each bit of each word in turn (in place, restored after): each changes the digest, by exactly
    the spec's delta."""
    base = int(digests([words])[0])
    for p in positions:
        for bit in bits:
            old = int(words[p])
            _flip(words, p, bit)
            new = int(words[p])
            got = int(digests([words])[0])
            _flip(words, p, bit)
            assert got != base, f"flipping bit {bit} of word {p} left the digest unchanged"
            assert (got - base) & MASK == _delta(old, new, p), f"bit {bit} of word {p}: not the spec's change"


def _row_path_words(device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randint(-(2**62), 2**62, (ROW_PATH_WORDS,), generator=g).to(device)


def test_the_weights_are_odd_at_every_position_the_old_ones_were_even() -> None:
    assert max(_old_weight_zeros(p) for p in range(ROW_PATH_WORDS)) >= 16  # the old weight: up to 16 bits lost
    assert all(_weight(p) % 2 == 1 for p in range(ROW_PATH_WORDS))


def test_every_bit_of_words_at_every_weight_residue_changes_the_digest_on_the_row_path() -> None:
    words = _row_path_words()
    assert words.numel() > ROW_WORDS and int(digests([words])[0]) & MASK == _reference_value(words)
    _assert_every_flip_detected(words, _probe_positions(words.numel()))


def test_every_bit_of_the_first_words_changes_the_digest_on_the_small_and_partial_word_paths() -> None:
    """Small whole-word tensors (the flat path, many at once) and one with a partial last word (general path)."""
    g = torch.Generator().manual_seed(3)
    base = torch.randint(-(2**62), 2**62, (16,), generator=g)
    variants = []
    for p in range(16):
        for bit in range(64):
            v = base.clone()
            _flip(v, p, bit)
            variants.append(v)
    hexes = _hexes([base, *variants])
    assert hexes == [_reference(t) for t in [base, *variants]]
    assert hexes[0] not in set(hexes[1:])  # (two flips may move it alike: bit 63 of any word adds 2^63)
    odd = torch.randn(37, generator=g).to(torch.bfloat16)  # 74 bytes: 9 words and 2 bytes
    flipped = [odd.clone() for _ in range(16)]
    for k, t in enumerate(flipped):
        t.view(torch.int16)[k * 2 + 1] ^= -(1 << 15)  # sign bit of element 2k+1: bit 31 or 63 of word k // 2
    hexes = _hexes([odd, *flipped])
    assert hexes == [_reference(t) for t in [odd, *flipped]] and hexes[0] not in set(hexes[1:])


def test_flipping_the_sign_of_bf16_element_7_changes_the_digest() -> None:
    """Element 7 is the top half of word 1: its sign is bit 63 of an odd word, which the old weight dropped."""
    t = torch.randn(4096, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    negated = t.clone()
    negated[7] = -negated[7]
    assert _hexes([t])[0] != _hexes([negated])[0]
    assert _hexes([t, negated]) == [_reference(t), _reference(negated)]


def _assert_random_flips_detected(words: torch.Tensor, count: int = 2000) -> None:
    g = torch.Generator().manual_seed(11)
    positions = torch.randint(0, words.numel(), (count,), generator=g).tolist()
    bits = torch.randint(0, 64, (count,), generator=g).tolist()
    base = int(digests([words])[0])
    missed = []
    for p, bit in zip(positions, bits):
        old = int(words[p])
        _flip(words, p, bit)
        new = int(words[p])
        got = int(digests([words])[0])
        _flip(words, p, bit)
        if got == base or (got - base) & MASK != _delta(old, new, p):
            missed.append((p, bit))
    assert not missed, f"{len(missed)} of {count} single-bit flips not detected as the spec says: {missed[:5]}"


@pytest.mark.slow  # 22 s; the exhaustive per-bit tests above stay in the fast tier
def test_2000_random_single_bit_flips_on_a_large_tensor_are_all_detected() -> None:
    words = torch.randint(-(2**62), 2**62, (8 * ROW_WORDS + 5,), generator=torch.Generator().manual_seed(2))
    _assert_random_flips_detected(words)


# -- ranges at global offsets add up ------------------------------------------------------------------------


def _ranges(whole: torch.Tensor, cuts: list[int]) -> tuple[list[torch.Tensor], list[int]]:
    """`whole` (uint8) cut at the word boundaries `cuts` (in words): the pieces and their word offsets."""
    edges = [0, *cuts, -(-whole.numel() // 8)]
    pieces = [whole[8 * a : min(8 * b, whole.numel())] for a, b in zip(edges, edges[1:])]
    return pieces, edges[:-1]


def test_digests_of_disjoint_ranges_at_their_global_offsets_add_up_to_the_whole() -> None:
    g = torch.Generator().manual_seed(4)
    whole = torch.randint(0, 256, (8 * (2 * ROW_WORDS + 37) + 5,), generator=g, dtype=torch.uint8)
    pieces, offsets = _ranges(whole, [3, ROW_WORDS - 1, ROW_WORDS + 100, 2 * ROW_WORDS + 30])
    parts = digests(pieces, offsets)
    assert [int(v) & MASK for v in parts] == [_reference_value(p, o) for p, o in zip(pieces, offsets)]
    assert int(parts.sum()) & MASK == _reference_value(whole) == int(digests([whole])[0]) & MASK
    alone = [int(digests([p], [o])[0]) & MASK for p, o in zip(pieces, offsets)]  # each alone: its own path
    assert alone == [int(v) & MASK for v in parts]
    pending = Pending()
    pending.add(pieces, offsets)
    assert pending.hexes() == [f"{_reference_value(p, o):016x}" for p, o in zip(pieces, offsets)]


def test_offsets_that_do_not_match_the_tensors_are_refused() -> None:
    with pytest.raises(ValueError, match="one word offset per tensor"):
        digests([torch.zeros(4), torch.zeros(4)], [0])


# -- CUDA: the same, through the compiled kernel and the torch paths ----------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_every_bit_of_words_at_every_weight_residue_changes_the_digest() -> None:
    """The kernel's address table (a regular tensor) and the copied-bytes path (a tensor with a partial word)."""
    words = _row_path_words("cuda")
    assert int(digests([words])[0]) & MASK == _reference_value(words)
    _assert_every_flip_detected(words, _probe_positions(words.numel()))
    odd = torch.randn(37, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    flipped = [odd.clone() for _ in range(16)]
    for k, t in enumerate(flipped):
        t.view(torch.int16)[k * 2 + 1] ^= -(1 << 15)
    assert _hexes([t.cuda() for t in [odd, *flipped]]) == [_reference(t) for t in [odd, *flipped]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_2000_random_single_bit_flips_and_ranges_are_detected_and_add_up() -> None:
    words = torch.randint(-(2**62), 2**62, (8 * ROW_WORDS + 5,), generator=torch.Generator().manual_seed(2))
    _assert_random_flips_detected(words.cuda())
    whole = words.view(torch.uint8)[:-3]
    pieces, offsets = _ranges(whole, [3, ROW_WORDS - 1, 5 * ROW_WORDS + 1])
    parts = digests([p.cuda() for p in pieces], offsets)
    assert [int(v) & MASK for v in parts] == [_reference_value(p, o) for p, o in zip(pieces, offsets)]
    assert int(parts.sum()) & MASK == _reference_value(whole)


def test_digest_of_a_view_at_an_offset_that_is_not_a_whole_word_equals_the_digest_of_its_copy() -> None:
    """An M:N box of an engine tensor starts mid-word (3 floats in): it is digested, not refused."""
    from refit.checks.tensor_digest import digests

    base = torch.arange(16, dtype=torch.float32)
    for view in (base[3:5], base[1:7], base[3:16], torch.randn(999).bfloat16()[3:803]):
        assert torch.equal(digests([view]), digests([view.clone()]))


# -- the Triton kernels (digest, fused copy and digest) under the interpreter, with small tiles -------------

_TILED = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
import test_digest as t
from refit.checks import tensor_digest as digest
from refit.checks.copy_digest_cuda import copy_digest_cuda
assert digest.available(torch.device("cpu")) and (digest.ROWS, digest.COLS, digest.CHUNK_WORDS) == (4, 64, 1024)
g = torch.Generator().manual_seed(8)
store = torch.randint(-(2**62), 2**62, (9000,), generator=g)
bf = torch.randn(4001, generator=g).to(torch.bfloat16)
# whole tiles, masked tails, several chunks, runs at odd words (a peeled first word), one word, empty,
# a partial last word, a view at a non-word offset, a transposed source
srcs = [store[1:], store[2:3001], store[:1], store[1:2], store[:256], store[1:513], store[:0],
        bf[:37], bf[3:803], torch.randn(9, 9, generator=g).t(), torch.randn(301, generator=g)]
ok = [int(v) & t.MASK for v in digest.digests(srcs)] == [t._reference_value(s) for s in srcs]
out = torch.zeros(20000, dtype=torch.int64)
dsts, at = [], 1
for s in srcs:  # int64 destinations at odd and even words of one buffer; others fresh
    if s.dtype == torch.int64:
        dsts.append(out[at : at + s.numel()])
        at += s.numel() + 1
    else:  # the last, float32, into bfloat16: cast by torch
        dsts.append(torch.empty(s.shape, dtype=torch.bfloat16 if s is srcs[-1] else s.dtype))
sums = copy_digest_cuda(dsts, srcs)
ok = ok and all(torch.equal(d, s.to(d.dtype)) for d, s in zip(dsts, srcs))
ok = ok and [int(v) & t.MASK for v in sums] == [t._reference_value(d) for d in dsts]
ok = ok and torch.equal(sums, digest.digests(dsts)) and torch.equal(copy_digest_cuda(dsts, srcs), sums)
for p, bit in ((0, 0), (1, 63), (255, 7), (2998, 31)):  # a flipped bit of the source changes the copy's digest
    src = store[2:3001].clone()
    t._flip(src, p, bit)
    dst = torch.empty_like(src)
    ok = ok and int(copy_digest_cuda([dst], [src])[0]) & t.MASK == t._reference_value(src) != t._reference_value(store[2:3001])
print("OK" if ok else "MISMATCH")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a CUDA machine the gpu tests run the compiled kernels")
def test_the_digest_and_fused_copy_kernels_equal_the_definition_under_the_interpreter_with_small_tiles() -> None:
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", REFIT_DIGEST_ROWS="4", REFIT_DIGEST_COLS="64",
               REFIT_DIGEST_CHUNK_WORDS="1024")  # fmt: skip
    r = subprocess.run(
        [sys.executable, "-c", _TILED, os.path.dirname(__file__)], env=env, capture_output=True, text=True
    )
    assert r.returncode == 0 and r.stdout.strip() == "OK", r.stdout[-500:] + r.stderr[-2000:]


def test_copy_digest_cuda_refuses_mismatched_pairs() -> None:
    from refit.checks.copy_digest_cuda import copy_digest_cuda

    with pytest.raises(ValueError, match="as many destinations"):
        copy_digest_cuda([torch.zeros(4)], [])
    with pytest.raises(ValueError, match="element count"):
        copy_digest_cuda([torch.zeros(4)], [torch.zeros(5)])
    with pytest.raises(ValueError, match="contiguous destinations"):
        copy_digest_cuda([torch.zeros(4, 4).t()], [torch.zeros(4, 4)])


def test_copy_digest_cuda_casts_a_pair_of_two_dtypes_and_digests_what_it_wrote() -> None:
    from refit.checks.copy_digest_cuda import copy_digest_cuda

    src, dst = torch.randn(33, generator=torch.Generator().manual_seed(9)), torch.zeros(33, dtype=torch.bfloat16)
    out = copy_digest_cuda([dst], [src])
    assert torch.equal(dst, src.to(torch.bfloat16)) and torch.equal(out, digests([dst]))


def test_digests_go_on_the_wire_as_big_endian_hex_and_come_back_exactly() -> None:
    from refit.topology.digest_plan import from_hex, to_hex

    edge = [0, 1, -1, 2**63 - 1, -(2**63), 0x0102030405060708, -0x0102030405060708]
    values = torch.cat([torch.tensor(edge), torch.randint(-(2**63), 2**63 - 1, (5000,))])
    hexes = to_hex(values)
    assert hexes[:3] == ["0000000000000000", "0000000000000001", "ffffffffffffffff"]
    assert hexes == [format(v & (2**64 - 1), "016x") for v in values.tolist()]
    back = from_hex(hexes)
    assert back is not None and torch.equal(back, values)
    assert from_hex(["0102"]) is None and from_hex(["zz" * 8]) is None and from_hex([]).numel() == 0


@pytest.mark.parametrize("change", ["values", "storage", "identity", "layout", "dtype", "shape"])
def test_zero_copy_digest_views_kept_per_generation_follow_every_change(change: str) -> None:
    """Zero-copy digests keep each target's view of its live tensor while the session's generation stays (as the
    Sender bumps it: the source's signature moved, or it does not cover layout; a changed spec is a new plan).
    After each change the payload is the digest of what the trainer holds now, never of what it held."""
    from refit import ModuleSource
    from refit.checks.tensor_digest import digests
    from refit.layout.planner import plan
    from refit.topology.digest_plan import DigestPlan, to_hex

    g = torch.Generator().manual_seed(4)
    live = {"a": torch.randn(8, 6, generator=g), "b": torch.randn(33, generator=g), "c": torch.randn(4, 4, generator=g)}
    source = ModuleSource(live)
    state = {"gen": 0, "sig": source.signature(), "plan": None, "specs": None}

    def payload() -> list[str]:
        sig = source.signature()
        if sig != state["sig"] or not source.signature_covers_layout:
            state["gen"] += 1
        state["sig"] = sig
        if source.specs() != state["specs"]:  # a new epoch: a new manifest and digest plan
            state["specs"] = source.specs()
            m = plan(source.specs(), capacity=1 << 20, epoch=state["gen"] + 1)
            state["plan"], state["m"] = DigestPlan(m, {1: {"a": (0, 2, 6)}}), m
        dp = state["plan"]
        dp.reset()
        dp.take_all(source, state["gen"])
        return dp.payloads()[1]

    def expected() -> list[str]:
        m = state["m"]
        held = [live[n].narrow(0, 2, 4) if n == "a" else live[n] for n in m.names]
        return to_hex(digests([t.contiguous() for t in held]))

    assert payload() == expected()
    assert payload() == expected()  # from the kept views
    with torch.no_grad():
        t = live["b"]
        if change == "values":
            t.add_(1)
        elif change == "storage":
            t.set_(t.detach().clone().untyped_storage(), 0, t.shape, t.stride())
            t.mul_(3)
        elif change == "identity":
            live["b"] = t.detach().clone() * 5
        elif change == "layout":
            live["c"] = live["c"].t().contiguous().t()  # the same values, another stride
        elif change == "dtype":
            live["b"] = t.double()
        elif change == "shape":
            live["b"] = torch.randn(40, generator=g)
    assert payload() == expected(), change
    assert payload() == expected(), change


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_prepared_digest_and_copy_replay_equal_the_unprepared_calls_as_values_change() -> None:
    """The planned-once CUDA paths (no pass over the tensors per call) give `digests` bit for bit, and a replay
    copies and digests the values the tensors hold at that call, not at planning."""
    from refit.checks.copy_digest_cuda import copy_digest_cuda
    from refit.checks.copy_digest_cuda import prepared as prepared_copy
    from refit.checks.tensor_digest import prepared

    g = torch.Generator(device="cuda").manual_seed(11)
    sizes = [0, 1, 2, 3, 7, 8, 255, 256, 1000, 4099, 1 << 16, 300_001]
    srcs = [torch.randint(-(2**62), 2**62, (n,), generator=g, device="cuda", dtype=torch.int64) for n in sizes]
    dsts = [torch.full_like(s, -7) for s in srcs]  # poisoned: every word must be written
    digest_run, copy_run = prepared(srcs), prepared_copy(dsts, srcs)
    assert digest_run is not None and copy_run is not None
    for _ in range(3):
        assert torch.equal(digest_run(), digests(srcs))
        got = copy_run()
        assert all(torch.equal(d, s) for d, s in zip(dsts, srcs)) and torch.equal(got, digests(dsts))
        assert torch.equal(got, copy_digest_cuda([torch.empty_like(s) for s in srcs], srcs))
        for s in srcs:
            s.add_(1)


def test_a_wider_engine_tensor_is_exact_only_when_it_holds_nothing_the_wire_dtype_lacks() -> None:
    g = torch.Generator().manual_seed(11)
    held = torch.randn(64, 48, generator=g).to(torch.bfloat16).float()
    specials = torch.tensor([float("inf"), -float("inf"), 0.0, -0.0, 3.0, -2.5])
    for t in (held, held.t(), held[:, 5:9], specials):  # contiguous, transposed, strided
        assert _exact(t, torch.bfloat16), t.shape
    for bit in range(16):  # any of the 16 bits bfloat16 drops, in any element
        flipped = held.clone()
        flipped.view(torch.int32)[3, 7] ^= 1 << bit
        assert not _exact(flipped, torch.bfloat16) and not _exact(flipped.t(), torch.bfloat16), bit
    halves = torch.randn(40, generator=g).to(torch.float16)
    assert _exact(halves.float(), torch.float16) and not _exact(halves.float() + 1e-4, torch.float16)
