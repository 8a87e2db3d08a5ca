"""Fused copy and digest: dst[i].copy_(src[i]) for many pairs, returning the digest of each dst's bytes, read
once (the fingerprint of docs/PROTOCOL.md, word positions counted in the destination tensor).

On CPU a small C kernel, compiled at first use through `torch.utils.cpp_extension` (cached per machine in a
private folder under the user's cache directory, refit.layout.private_dir), copies each pair word by word and
sums the words as it writes them: one pass, one call for every pair of a plan, no per-tensor Python. Its sums
avoid 64-bit multiplies: over a lane of words w_0 .. w_{m-1}, sum(j * w_j) = m * S - sum of the running sums (S
the lane's total), so every step is two additions, which vectorise. Where the kernel does not build, or
REFIT_CPU_KERNEL=0, pairs are copied by `CopyPlan` and digested by `refit.checks.tensor_digest.digests` (a
second read: slower, same values). Pairs the kernel cannot take (other dtypes, non-contiguous or lazy
views) are copied by torch and their destinations digested afterwards. A bfloat16 source into a float32
target is widened by the kernel as it copies (exact), digesting the bfloat16 words the target now holds. On CUDA,
`refit.checks.copy_digest_cuda.copy_digest_cuda` does it where that module imports.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from refit.checks.tensor_digest import digests
from refit.layout.build_lock import build_lock
from refit.layout.copy_kernel import BatchedCopy
from refit.layout.private_dir import NotPrivate, owned_file, private_cache, refuse
from refit.log import get_logger
from refit.settings import cpu_kernel_enabled

log = get_logger("fused")

_SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <atomic>
#include <thread>
#include <vector>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

static const uint64_t STEP = 0x3C6EF372FE94F82AULL; /* 2 * 0x9E3779B97F4A7C15 mod 2^64 */
static const int64_t CHUNK = 1 << 20; /* bytes a thread takes at a time (a multiple of 32) */

/* Copy nbytes from src to dst (none where dst is 0) and add their two sums, words counted from 0. */
static void sums(const unsigned char *src, unsigned char *dst, int64_t nbytes, uint64_t *s0o, uint64_t *s1o) {
    int64_t nw = nbytes / 8, m = nw / 4, i;
    uint64_t a[4] = {0, 0, 0, 0}, b[4] = {0, 0, 0, 0}, s0 = 0, s1 = 0, w[4];
#if defined(__SSE2__)
    /* large aligned targets: streaming stores, so the target is not read into the cache first (as memcpy) */
    if (dst && nbytes >= (64 << 10) && (uintptr_t)dst % 16 == 0) {
        for (i = 0; i < m; i++) {
            memcpy(w, src + 32 * i, 32);
            _mm_stream_si128((__m128i *)(dst + 32 * i), _mm_loadu_si128((const __m128i *)w));
            _mm_stream_si128((__m128i *)(dst + 32 * i + 16), _mm_loadu_si128((const __m128i *)(w + 2)));
            for (int l = 0; l < 4; l++) { a[l] += w[l]; b[l] += a[l]; }
        }
        _mm_sfence();
    } else
#endif
    for (i = 0; i < m; i++) {
        memcpy(w, src + 32 * i, 32);
        if (dst) memcpy(dst + 32 * i, w, 32);
        for (int l = 0; l < 4; l++) { a[l] += w[l]; b[l] += a[l]; }
    }
    /* lane l holds words 4j + l: sum (4j + l) w = 4 (m a_l - b_l) + l a_l */
    for (int l = 0; l < 4; l++) { s0 += a[l]; s1 += 4 * ((uint64_t)m * a[l] - b[l]) + (uint64_t)l * a[l]; }
    for (i = 4 * m; i < nw; i++) {
        uint64_t x;
        memcpy(&x, src + 8 * i, 8);
        if (dst) memcpy(dst + 8 * i, &x, 8);
        s0 += x; s1 += (uint64_t)i * x;
    }
    if (nbytes % 8) {
        uint64_t x = 0;
        memcpy(&x, src + 8 * nw, nbytes % 8);
        if (dst) memcpy(dst + 8 * nw, &x, nbytes % 8);
        s0 += x; s1 += (uint64_t)nw * x;
    }
    *s0o = s0; *s1o = s1;
}

/* bfloat16 to float32 (exact): each 2-byte source element becomes the high half of a 4-byte float; the
   sums are of the source words, the bytes the float now holds exactly. nbytes counts source bytes (even). */
static void widen(const unsigned char *src, unsigned char *dst, int64_t nbytes, uint64_t *s0o, uint64_t *s1o) {
    int64_t nw = nbytes / 8, m = nw / 4, i;
    uint64_t a[4] = {0, 0, 0, 0}, b[4] = {0, 0, 0, 0}, s0 = 0, s1 = 0, w[4];
    uint16_t h[16];
    uint32_t f[16];
#if defined(__SSE2__)
    /* interleaving zeros below each element is the widening; streaming stores as in `sums` */
    if (nbytes >= (64 << 10) && (uintptr_t)dst % 16 == 0) {
        const __m128i z = _mm_setzero_si128();
        for (i = 0; i < m; i++) {
            memcpy(w, src + 32 * i, 32);
            __m128i x0 = _mm_loadu_si128((const __m128i *)w), x1 = _mm_loadu_si128((const __m128i *)(w + 2));
            __m128i *o = (__m128i *)(dst + 64 * i);
            _mm_stream_si128(o, _mm_unpacklo_epi16(z, x0));
            _mm_stream_si128(o + 1, _mm_unpackhi_epi16(z, x0));
            _mm_stream_si128(o + 2, _mm_unpacklo_epi16(z, x1));
            _mm_stream_si128(o + 3, _mm_unpackhi_epi16(z, x1));
            for (int l = 0; l < 4; l++) { a[l] += w[l]; b[l] += a[l]; }
        }
        _mm_sfence();
    } else
#endif
    for (i = 0; i < m; i++) {
        memcpy(w, src + 32 * i, 32);
        memcpy(h, w, 32);
        for (int e = 0; e < 16; e++) f[e] = (uint32_t)h[e] << 16;
        memcpy(dst + 64 * i, f, 64);
        for (int l = 0; l < 4; l++) { a[l] += w[l]; b[l] += a[l]; }
    }
    for (int l = 0; l < 4; l++) { s0 += a[l]; s1 += 4 * ((uint64_t)m * a[l] - b[l]) + (uint64_t)l * a[l]; }
    for (i = 4 * m; i < nw; i++) {
        uint64_t x;
        memcpy(&x, src + 8 * i, 8);
        memcpy(h, &x, 8);
        for (int e = 0; e < 4; e++) f[e] = (uint32_t)h[e] << 16;
        memcpy(dst + 16 * i, f, 16);
        s0 += x; s1 += (uint64_t)i * x;
    }
    if (nbytes % 8) {
        uint64_t x = 0;
        int64_t rest = nbytes % 8;
        memcpy(&x, src + 8 * nw, rest);
        memcpy(h, &x, 8);
        for (int e = 0; e < rest / 2; e++) f[e] = (uint32_t)h[e] << 16;
        memcpy(dst + 16 * nw, f, 2 * rest);
        s0 += x; s1 += (uint64_t)nw * x;
    }
    *s0o = s0; *s1o = s1;
}

/* Pair k: copy nbytes[k] bytes from src[k] to dst[k] (no copy where dst[k] is 0; where widen[k], bfloat16
   source bytes into float32 at dst[k]) and digest the source bytes. Pairs are cut into CHUNK-byte pieces
   shared by `threads` threads; a piece at word offset o adds s1 + o * s0. */
extern "C" void refit_copy_digest(int64_t n, const int64_t *src, const int64_t *dst, const int64_t *nbytes,
                                  const int64_t *wide, int64_t *out, int64_t threads) {
    std::vector<int64_t> first(n + 1, 0);
    for (int64_t k = 0; k < n; k++) first[k + 1] = first[k] + (nbytes[k] + CHUNK - 1) / CHUNK;
    int64_t pieces = first[n];
    std::vector<uint64_t> p0(pieces), p1(pieces);
    std::vector<int64_t> owner(pieces);
    for (int64_t k = 0; k < n; k++)
        for (int64_t c = first[k]; c < first[k + 1]; c++) owner[c] = k;
    std::atomic<int64_t> next(0);
    auto work = [&]() {
        for (int64_t c; (c = next.fetch_add(1)) < pieces;) {
            int64_t k = owner[c], at = (c - first[k]) * CHUNK, len = nbytes[k] - at < CHUNK ? nbytes[k] - at : CHUNK;
            const unsigned char *s = (const unsigned char *)src[k] + at;
            if (wide[k]) widen(s, (unsigned char *)dst[k] + 2 * at, len, &p0[c], &p1[c]);
            else sums(s, dst[k] ? (unsigned char *)dst[k] + at : 0, len, &p0[c], &p1[c]);
        }
    };
    std::vector<std::thread> helpers;
    for (int64_t t = 1; t < threads && t < pieces; t++) helpers.emplace_back(work);
    work();
    for (auto &h : helpers) h.join();
    for (int64_t k = 0; k < n; k++) {
        uint64_t s0 = 0, s1 = 0;
        for (int64_t c = first[k]; c < first[k + 1]; c++) {
            s0 += p0[c];
            s1 += p1[c] + (uint64_t)((c - first[k]) * (CHUNK / 8)) * p0[c];
        }
        out[k] = (int64_t)(s1 * STEP + s0 + (uint64_t)nbytes[k]);
    }
}
"""

_lock = threading.Lock()
PARALLEL_BYTES = 8 << 20
"""A plan moving fewer bytes than this runs on one thread."""


def _cache_dir() -> Path | None:
    """The kernel's checked private cache folder (refit.layout.private_dir), or None after one WARNING."""
    tag = hashlib.sha256(f"{_SOURCE}|{torch.__version__}".encode()).hexdigest()[:16]
    return private_cache("cpu_kernels", tag)


BUILD_WAIT_S = 300.0
"""How long a process waits for another one's build of the kernel before it takes the PyTorch path."""


@functools.cache
def _kernel() -> ctypes.CDLL | None:
    """The compiled kernel, built once per machine (later processes load the cached library); None, after
    one WARNING, where it cannot be built, and None without trying where REFIT_CPU_KERNEL=0."""
    if not cpu_kernel_enabled():
        return None
    where = _cache_dir()
    if where is None:
        return None
    try:
        with _lock:
            path = _built(where) or _build(where)
        lib = ctypes.CDLL(str(path))
        fn = lib.refit_copy_digest
        fn.argtypes = [ctypes.c_int64] + [ctypes.c_void_p] * 5 + [ctypes.c_int64]
        fn.restype = None
        return lib
    except NotPrivate as e:
        refuse(where, e)
        return None
    except Exception as e:  # noqa: BLE001 - no compiler, no headers, any build error: the slower path, never a failure
        log.warning(
            "the fused copy-and-digest CPU kernel did not build (%s: %s); using the slower PyTorch path",
            type(e).__name__,
            str(e).strip().splitlines()[-1:] or "",
        )
        return None


def _built(where: Path) -> Path | None:
    """The library of a finished build (its marker is written only after the build returned), else None: only
    the expected file name inside `where`, a regular file of the user's (refit.layout.private_dir.owned_file)."""
    lib = owned_file(where, f"refit_fused_{where.name}.so")
    return lib if lib is not None and owned_file(where, "built.ok") is not None else None


def _build(where: Path) -> Path:
    """Build under the build lock (refit.layout.build_lock); past BUILD_WAIT_S the caller takes the PyTorch
    path."""
    from torch.utils import cpp_extension

    with build_lock(where, "the kernel", BUILD_WAIT_S):
        done = _built(where)
        if done is not None:
            return done
        src = where / "refit_fused.cpp"
        src.unlink(missing_ok=True)
        src.write_text(_SOURCE)
        cpp_extension.load(
            name=f"refit_fused_{where.name}",
            sources=[str(src)],
            build_directory=str(where),
            extra_cflags=["-O3", "-pthread"],
            extra_ldflags=["-pthread"],
            is_python_module=False,
            verbose=False,
        )
        (where / "built.ok").write_text("built\n")
        done = _built(where)
        if done is None:
            raise FileNotFoundError(f"the build left no refit_fused_{where.name}.so in {where}")
        return done


def _plain(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.is_contiguous() and not (t.is_neg() or t.is_conj())


def widens(d: torch.Tensor, s: torch.Tensor) -> bool:
    """Whether copying `s` into `d` widens bfloat16 to float32: exact, so `d` then holds `s`'s bytes."""
    return s.dtype == torch.bfloat16 and d.dtype == torch.float32 and d.numel() == s.numel()


def _takes(d: torch.Tensor, s: torch.Tensor) -> bool:
    """Whether the kernel copies this pair: CPU, same dtype (or bfloat16 widened to float32) and size, both
    contiguous, no lazy views."""
    return (d.dtype == s.dtype and d.numel() == s.numel() or widens(d, s)) and _plain(d) and _plain(s)


def _readable(d: torch.Tensor, s: torch.Tensor) -> bool:
    """Whether the kernel can digest `d` as it lies in memory (its words are its logical words; a widened
    target is digested in its source's dtype)."""
    return _plain(d) and not widens(d, s)


class FusedCopy:
    """dst[i].copy_(src[i]) for every i, planned once at construction (an address table) and replayed by
    `run()`, which returns the digest of each dst's bytes after the copy (int64, CPU), but for bfloat16 widened
    into float32 (`widens`): there of the bfloat16 bytes the float32 now holds exactly. Valid while the
    tensors keep their storage and layout, like `BatchedCopy`."""

    def __init__(self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
        if len(dsts) != len(srcs):
            raise ValueError(f"copy_digest needs as many targets ({len(dsts)}) as sources ({len(srcs)})")
        self.dsts, self.srcs = list(dsts), list(srcs)
        self._n = len(self.dsts)
        self._replay = None
        lib = _kernel() if self.dsts and all(d.device.type == "cpu" for d in self.dsts) else None
        self._lib = lib
        if lib is None:
            same = all(d.dtype == s.dtype for d, s in zip(self.dsts, self.srcs))
            cuda = same and self.dsts and all(d.is_cuda and d.is_contiguous() for d in self.dsts)
            self._cuda = _cuda_kernel() if cuda else None
            self._replay = _cuda_prepared(self.dsts, self.srcs) if self._cuda else None
            self._copy = None if self._cuda else BatchedCopy(self.dsts, self.srcs)
            return
        fused = list(map(_takes, self.dsts, self.srcs))
        rest = [i for i, f in enumerate(fused) if not f]
        self._copy = BatchedCopy([self.dsts[i] for i in rest], [self.srcs[i] for i in rest]) if rest else None
        # the kernel digests every dst it can read, in place for the pairs torch copied (dst 0: no copy)
        readable = [f or _readable(d, s) for f, d, s in zip(fused, self.dsts, self.srcs)]
        self._slow = [i for i, r in enumerate(readable) if not r]
        rows = [
            (s.data_ptr(), d.data_ptr(), s.nbytes, int(d.dtype != s.dtype)) if f else (d.data_ptr(), 0, d.nbytes, 0)
            for d, s, f, r in zip(self.dsts, self.srcs, fused, readable)
            if r
        ]
        self._table = torch.tensor(rows, dtype=torch.int64).reshape(-1, 4).t().contiguous()
        self._nbytes = sum(r[2] << r[3] for r in rows)  # a widened pair writes twice what it reads
        self._rows = [i for i, r in enumerate(readable) if r]

    def run(self) -> torch.Tensor:
        """Copy every pair; the digest of each dst after the copy (as the class says), in order (int64, on the
        dsts' device: no host synchronisation)."""
        if self._lib is None:
            if self._replay is not None:
                return self._replay()
            if self._cuda is not None:
                return self._cuda(self.dsts, self.srcs)
            self._copy.run()  # type: ignore[union-attr]
            return _digests_as(self.dsts, self.srcs)
        if self._copy is not None:
            self._copy.run()
        n = self._table.shape[1]
        got = torch.empty(n, dtype=torch.int64)
        if n:
            t = self._table
            # threads as torch's own copies use, where there is enough to share (starting one costs ~50 us)
            threads = torch.get_num_threads() if self._nbytes >= PARALLEL_BYTES else 1
            ptrs = (t[0].data_ptr(), t[1].data_ptr(), t[2].data_ptr(), t[3].data_ptr())
            self._lib.refit_copy_digest(n, *ptrs, got.data_ptr(), threads)
        if not self._slow:
            return got
        out = torch.empty(self._n, dtype=torch.int64)
        out[self._rows] = got
        out[self._slow] = _digests_as([self.dsts[i] for i in self._slow], [self.srcs[i] for i in self._slow]).cpu()
        return out


def _digests_as(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> torch.Tensor:
    """The digest of each dst's bytes, of a widened one's in its src's dtype (exact: `widens`)."""
    if not dsts:
        return torch.zeros(0, dtype=torch.int64)
    with torch.no_grad():
        return digests([d.to(s.dtype) if widens(d, s) else d for d, s in zip(dsts, srcs)])


def _cuda_prepared(dsts: list[torch.Tensor], srcs: list[torch.Tensor]):  # type: ignore[no-untyped-def]
    from refit.checks.copy_digest_cuda import prepared  # type: ignore[import-not-found]

    return prepared(dsts, srcs)


def _cuda_kernel():  # type: ignore[no-untyped-def]
    try:
        from refit.checks.copy_digest_cuda import copy_digest_cuda  # type: ignore[import-not-found]
    except ImportError:
        return None
    return copy_digest_cuda


def copy_digest(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> torch.Tensor:
    """Copy each src into its dst (same dtype and size, or bfloat16 into float32; any strided dst) and return
    the digest of each dst's bytes after the copy, as an int64 CPU tensor: bit for bit `digests(dsts)` after
    `dst.copy_(src)` (for a widening pair, `digests([dst.to(torch.bfloat16)])`)."""
    for d, s in zip(dsts, srcs):
        if not (d.dtype == s.dtype and d.numel() == s.numel() or widens(d, s)):
            raise ValueError(
                f"copy_digest copies without casting (but bfloat16 into float32): a {s.dtype} tensor of "
                f"{s.numel()} elements into a {d.dtype} one of {d.numel()}; cast the source first"
            )
    return FusedCopy(dsts, srcs).run().cpu()


def prepared_digests(tensors: Sequence[torch.Tensor]) -> Callable[[], torch.Tensor] | None:
    """`digests(tensors)` by the CPU kernel without a copy, planned once: each tensor read where it lies, the
    fingerprint's kernel alone. Valid while the tensors keep their storage and layout. None where the kernel
    is not built or a tensor is not a readable CPU tensor (contiguous, no lazy view): call `digests`."""
    lib = _kernel()
    if lib is None or not tensors or not all(map(_plain, tensors)):
        return None
    keep = list(tensors)
    # rows (address, 0, bytes, not widened): a target address of 0 tells the kernel to digest without copying
    table = torch.tensor([(t.data_ptr(), 0, t.nbytes, 0) for t in keep], dtype=torch.int64).t().contiguous()
    threads = torch.get_num_threads() if sum(t.nbytes for t in keep) >= PARALLEL_BYTES else 1

    def run() -> torch.Tensor:
        assert keep  # the tensors stay alive with the table of their addresses
        got = torch.empty(len(keep), dtype=torch.int64)
        src, dst, nbytes, wide = (row.data_ptr() for row in table)
        lib.refit_copy_digest(len(keep), src, dst, nbytes, wide, got.data_ptr(), threads)
        return got

    return run


def kernel_built() -> bool:
    """Whether the compiled CPU kernel is in use (False: the PyTorch path)."""
    return _kernel() is not None
