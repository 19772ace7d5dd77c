"""Numba CPU kernels: the numerics of every mpigc wire format.

Kernels own numerics only: no MPI, no dispatch, no allocation of results.
Every public function here has a sibling of the same name and signature in
``mpigc.kernels.cuda``. Arrays are 1-D and contiguous; ``x`` (the gradient) and
the residuals share one dtype (float32 or float64); decoded output may be any of
those two. Optional residuals are passed as ``None``.

Conventions
-----------
``e_in`` / ``e_out``
    Error feedback: the kernel quantizes ``v = x + e_in`` and writes
    ``e_out = v - decoded(v)``. ``e_out`` may be ``e_in`` (in place) or another
    buffer of the same size (double buffering, so a failed collective can keep
    the old residual). Both ``None``: no error feedback.
return value of the ``pack_*`` kernels
    The number of non-finite values of ``v`` met (0 when all are finite).

No ``fastmath`` anywhere: results must be bit-identical to the CUDA kernels
and to the numpy reference in the tests.
"""
import sys

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload

__all__ = [
    "pack_2bit", "unpack_2bit", "pack_2bit_shards", "unpack_2bit_shards",
    "pack_1bit", "unpack_1bit", "pack_1bit_shards", "unpack_1bit_shards",
    "pack_2bit_rel", "unpack_2bit_rel", "pack_2bit_rel_shards", "unpack_2bit_rel_shards",
    "stats", "pack_ternary", "pack_ternary_shards", "unpack_ternary_shards",
    "pack_fp16", "unpack_fp16", "unpack_fp16_shards",
    "pack_bf16", "unpack_bf16", "unpack_bf16_shards",
    "count_nonfinite", "ternary_stream",
    "PARALLEL_MIN_ELEMENTS",
]

from .. import _jitcache  # noqa: E402  (the on-disk cache lives per user, not in site-packages)
from .._errors import ConfigError  # noqa: E402

_JIT = dict(cache=_jitcache.enabled(), nogil=True, boundscheck=False)

#: Below this many elements the single-thread kernels are used even when Numba
#: has several threads: a parallel launch costs more than it saves.
PARALLEL_MIN_ELEMENTS = 1 << 18

LANES = 32  # canonical summation order of the 1bit block sums (see _block_sums)


def check_block_size(block_size, multiple, what):
    """``block_size`` as an int, or a ``ConfigError`` before anything runs:
    a 1bit block must be a positive multiple of 8 and a relative 2bit block
    one of 4, so that no byte of codes holds values of two blocks (on a GPU,
    two warps would write that byte, and its bits would depend on timing).
    The CPU kernels refuse it too: both sides accept the same inputs."""
    if (isinstance(block_size, (bool, np.bool_))
            or not isinstance(block_size, (int, np.integer))
            or block_size <= 0 or block_size % multiple):
        raise ConfigError(f"{what}: block_size must be a positive multiple of {multiple}, "
                          f"got {block_size!r}")
    return int(block_size)


_max_threads = None


def set_max_threads(k):
    """Cap the threads of the parallel kernels at ``k`` (None: Numba's own
    setting). Numba's thread count is per calling thread; the cap is applied
    in whichever thread calls a kernel."""
    global _max_threads
    _max_threads = None if k is None else max(1, int(k))


_pool_started = False


def _start_pool():
    """Start Numba's thread pool without changing PyTorch's thread count.

    Numba's OpenMP threading layer sets the OpenMP thread count of the
    process (``omp_set_num_threads``) to ``NUMBA_NUM_THREADS`` when it starts
    its pool, and PyTorch's CPU wheels share that libgomp: with 4 ranks on 2
    cores and ``torch.set_num_threads(1)``, torch then ran 2 threads per rank
    and its forward pass took 2.4x longer. The count torch had is put back.
    """
    global _pool_started
    torch = sys.modules.get("torch")
    get = getattr(torch, "get_num_threads", None)
    saved = get() if get is not None else None
    numba.get_num_threads()  # starts the pool
    if saved is not None and get() != saved:
        torch.set_num_threads(saved)
    _pool_started = True


def _nchunks(n):
    """How many parallel chunks to cut ``n`` elements into (1 = serial)."""
    if n < PARALLEL_MIN_ELEMENTS or _max_threads == 1:
        return 1  # serial (capped at 1: Numba's thread pool is never started)
    if not _pool_started:
        _start_pool()
    threads = numba.get_num_threads()
    if _max_threads is not None and threads > _max_threads:
        numba.set_num_threads(_max_threads)
        threads = _max_threads
    if threads <= 1:
        return 1
    return threads * 4


# ----------------------------------------------------------------------------
# bit casts (float32 <-> uint32), used by the float16 and bfloat16 conversions
# ----------------------------------------------------------------------------
@intrinsic
def _f32_as_u32(typingctx, x):
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@intrinsic
def _u32_as_f32(typingctx, x):
    if x != types.uint32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.uint32), codegen


@njit(inline="always", **_JIT)
def _f32_to_f16_bits(f):
    """float32 -> IEEE binary16 bits, round to nearest even (as numpy).

    All three cases (inf/NaN, subnormal, normal) are computed and one is
    selected, without branches, so that loops over it vectorize.
    """
    u = _f32_as_u32(f)
    sign = np.uint32((u >> np.uint32(16)) & np.uint32(0x8000))
    u = np.uint32(u & np.uint32(0x7FFFFFFF))
    # >= 65536: inf, or NaN
    o_big = np.uint32(0x7E00) if u > np.uint32(0x7F800000) else np.uint32(0x7C00)
    # below the smallest normal half: subnormal; 0.5f aligns the mantissa
    magic = np.uint32(0x3F000000)
    o_sub = np.uint32(_f32_as_u32(_u32_as_f32(u) + _u32_as_f32(magic)) - magic)
    odd = (u >> np.uint32(13)) & np.uint32(1)
    o_norm = np.uint32(np.uint32(u + np.uint32(0xC8000FFF) + odd) >> np.uint32(13))
    o = o_big if u >= np.uint32(0x47800000) else (
        o_sub if u < np.uint32(0x38800000) else o_norm)
    return np.uint16(o | sign)


@njit(inline="always", **_JIT)
def _f16_bits_to_f32(h):
    """IEEE binary16 bits -> float32 (exact), branch-free (see above)."""
    h = np.uint32(h)
    u = np.uint32((h & np.uint32(0x7FFF)) << np.uint32(13))
    exp = np.uint32(u & np.uint32(0x0F800000))
    u = np.uint32(u + np.uint32(0x38000000))  # (127 - 15) << 23
    f_big = _u32_as_f32(np.uint32(u + np.uint32(0x38000000)))  # inf / NaN
    f_sub = (_u32_as_f32(np.uint32(u + np.uint32(0x00800000)))  # zero / subnormal
             - _u32_as_f32(np.uint32(0x38800000)))
    f_norm = _u32_as_f32(u)
    b = _f32_as_u32(f_big) if exp == np.uint32(0x0F800000) else (
        _f32_as_u32(f_sub) if exp == 0 else _f32_as_u32(f_norm))
    sign = np.uint32((h & np.uint32(0x8000)) << np.uint32(16))
    return _u32_as_f32(np.uint32(b | sign))


@njit(inline="always", **_JIT)
def _f32_to_bf16_bits(f):
    """float32 -> bfloat16 bits: the upper 16 bits after rounding to nearest
    even. A NaN becomes the quiet NaN ``0x7FC0`` with its sign (payload bits
    dropped, as fp16 does); inf stays inf; finite values whose rounding
    carries into the exponent (|f| >= 0x7F7F8000) become inf. Branch-free."""
    u = _f32_as_u32(f)
    odd = (u >> np.uint32(16)) & np.uint32(1)
    # no wrap-around for non-NaN u (<= 0xFF800000); a NaN's sum is discarded
    o_num = np.uint32(np.uint32(u + np.uint32(0x7FFF) + odd) >> np.uint32(16))
    o_nan = np.uint32(((u >> np.uint32(16)) & np.uint32(0x8000)) | np.uint32(0x7FC0))
    o = o_nan if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000) else o_num
    return np.uint16(o)


@njit(inline="always", **_JIT)
def _bf16_bits_to_f32(b):
    """bfloat16 bits -> float32 (exact: the bits become the upper half)."""
    return _u32_as_f32(np.uint32(np.uint32(b) << np.uint32(16)))


# ----------------------------------------------------------------------------
# helpers for the chunked kernels
# ----------------------------------------------------------------------------
# How the kernels reach memory speed: every kernel walks its range in chunks of
# _CH elements. Per chunk, one flat loop over slices (indices start at 0, so
# Numba's negative-index wraparound folds away, and nothing in the loop body
# branches) computes the values, the residual and a small uint8 code per
# element in a scratch buffer that stays in L1; a second flat loop converts the
# codes to or from the packed bytes with word arithmetic on a uint32 / uint64
# view of the scratch (little-endian byte order, as on every platform numba
# targets). Both loops vectorize. The arithmetic per element is exactly that of
# the scalar formulation, so results do not change.

_CH = 4096  # elements per chunk (a multiple of 8)


def _win(a, lo, hi):
    """``a[lo:hi]``, or ``None`` for ``None`` (resolved at compile time)."""
    return None if a is None else a[lo:hi]


@overload(_win, inline="always")
def _win_impl(a, lo, hi):
    if isinstance(a, types.NoneType):
        return lambda a, lo, hi: None
    return lambda a, lo, hi: a[lo:hi]


def _same(a, b):
    """Whether ``a`` and ``b`` are the same buffer (in-place residual)."""
    return a is not None and b is not None and a.ctypes.data == b.ctypes.data


@overload(_same, inline="always")
def _same_impl(a, b):
    if isinstance(a, types.NoneType) or isinstance(b, types.NoneType):
        return lambda a, b: False
    return lambda a, b: a.ctypes.data == b.ctypes.data and a.size == b.size


# An in-place residual (e_out is e_in) is passed to the chunk loops as one
# array ``ep`` that is read and then written at the same index: through two
# distinct array arguments LLVM would have to assume overlap and fall back to
# its scalar loop whenever the buffers are the same.

_U32 = np.uint32
_U64 = np.uint64


@njit(inline="always", **_JIT)
def _codes_to_2bit(words, ob):
    """ob[k] = the byte of the four codes in words[k] (code j in byte j)."""
    for k in range(ob.size):
        w = words[k]
        ob[k] = np.uint8(((w << _U32(6)) | (w >> _U32(4)) | (w >> _U32(14))
                          | (w >> _U32(24))) & _U32(0xFF))


@njit(inline="always", **_JIT)
def _2bit_to_codes(pb, words):
    """words[k] = the four codes of byte pb[k], code j in byte j."""
    for k in range(pb.size):
        b = _U32(pb[k])
        words[k] = _U32((b >> _U32(6)) | ((b << _U32(4)) & _U32(0x300))
                        | ((b << _U32(14)) & _U32(0x30000))
                        | ((b << _U32(24)) & _U32(0x3000000)))


@njit(inline="always", **_JIT)
def _codes_to_1bit(words, ob):
    """ob[k] = the 8 flags (0/1) of words[k], flag j in bit 7 - j."""
    for k in range(ob.size):
        ob[k] = np.uint8((words[k] * _U64(0x8040201008040201)) >> _U64(56))


@njit(inline="always", **_JIT)
def _1bit_to_codes(pb, words):
    """words[k]: byte j nonzero iff bit 7 - j of pb[k] is set."""
    for k in range(pb.size):
        words[k] = ((_U64(pb[k]) * _U64(0x0101010101010101))
                    & _U64(0x0102040810204080))


# ----------------------------------------------------------------------------
# 2bit (MXNet layout): byte k holds elements 4k..4k+3, element 0 in bits 7-6
# ----------------------------------------------------------------------------
@njit(**_JIT)
def _quantize_2bit(xs, ei, eo, ep, codes, tc, td):
    """2bit codes of ``v = xs + ei (+ ep)`` against the threshold ``tc``,
    decoding to ``±td`` (MXNet's mode: ``tc = td = t``; the relative mode:
    the block's threshold and mean magnitude); the residual ``v - decoded``
    to ``eo`` or in place to ``ep``. Returns the non-finite count of ``v``.

    ``tc = NaN`` (a block whose threshold is 0 or NaN) makes every code
    ``00``: no comparison with NaN holds, not even for an infinite ``v``.
    """
    neg_tc = -tc
    neg_td = -td
    zero = xs.dtype.type(0)  # not td - td: td may be inf or NaN
    nbad = 0
    for i in range(xs.size):
        v = xs[i]
        if ei is not None:
            v = v + ei[i]
        if ep is not None:
            v = v + ep[i]
        pos = v >= tc
        neg = v <= neg_tc
        d = td if pos else (neg_td if neg else zero)
        if eo is not None:
            eo[i] = v - d
        if ep is not None:
            ep[i] = v - d
        nbad += (v - v) != zero
        codes[i] = np.uint8(3) if pos else (np.uint8(2) if neg else np.uint8(0))
    return nbad


@njit(**_JIT)
def _pack_2bit_range(x, e_in, e_out, out, t, b0, b1):
    i0 = 4 * b0
    i1 = min(x.size, 4 * b1)
    codes = np.zeros(_CH, np.uint8)
    words = codes.view(np.uint32)
    inplace = _same(e_in, e_out)
    nbad = 0
    for c0 in range(i0, i1, _CH):
        c1 = min(i1, c0 + _CH)
        m = c1 - c0
        if inplace:
            nbad += _quantize_2bit(x[c0:c1], None, None, _win(e_in, c0, c1), codes, t, t)
        else:
            nbad += _quantize_2bit(x[c0:c1], _win(e_in, c0, c1), _win(e_out, c0, c1),
                                   None, codes, t, t)
        nw = (m + 3) // 4
        for j in range(m, 4 * nw):  # the tail is padded with 00
            codes[j] = 0
        _codes_to_2bit(words, out[c0 // 4:c0 // 4 + nw])
    return nbad


@njit(parallel=True, **_JIT)
def _pack_2bit_par(x, e_in, e_out, out, t, nchunks):
    nb = out.size
    per = (nb + nchunks - 1) // nchunks
    nbad = 0
    for c in prange(nchunks):
        b0 = min(nb, c * per)
        nbad += _pack_2bit_range(x, e_in, e_out, out, t, b0, min(nb, b0 + per))
    return nbad


@njit(**_JIT)
def _unpack_2bit_range(payload, out, t, accumulate, b0, b1):
    neg_t = -t
    zero = t - t
    i0 = 4 * b0
    i1 = min(out.size, 4 * b1)
    codes = np.empty(_CH, np.uint8)
    words = codes.view(np.uint32)
    for c0 in range(i0, i1, _CH):
        c1 = min(i1, c0 + _CH)
        _2bit_to_codes(payload[c0 // 4:(c1 + 3) // 4], words)
        os = out[c0:c1]
        if accumulate:
            for i in range(os.size):
                c = codes[i]
                os[i] += t if c == 3 else (neg_t if c == 2 else zero)
        else:
            for i in range(os.size):
                c = codes[i]
                os[i] = t if c == 3 else (neg_t if c == 2 else zero)


@njit(parallel=True, **_JIT)
def _unpack_2bit_par(payload, out, t, accumulate, nchunks):
    nb = (out.size + 3) // 4
    per = (nb + nchunks - 1) // nchunks
    for c in prange(nchunks):
        b0 = min(nb, c * per)
        _unpack_2bit_range(payload, out, t, accumulate, b0, min(nb, b0 + per))


def pack_2bit(x, e_in, e_out, out, threshold):
    """Quantize ``x + e_in`` to 2-bit codes (MXNet layout) into ``out``.

    ``out`` is uint8 of ``ceil(n / 4)`` bytes. Returns the non-finite count.
    """
    t = x.dtype.type(threshold)
    nch = _nchunks(x.size)
    if nch == 1:
        return int(_pack_2bit_range(x, e_in, e_out, out, t, 0, out.size))
    return int(_pack_2bit_par(x, e_in, e_out, out, t, nch))


def unpack_2bit(payload, out, threshold, accumulate):
    """Decode ``out.size`` 2-bit codes: ``11`` -> +t, ``10`` -> -t, else 0.

    Writes into ``out``, or adds to it when ``accumulate`` is true.
    """
    t = out.dtype.type(threshold)
    nch = _nchunks(out.size)
    if nch == 1:
        _unpack_2bit_range(payload, out, t, bool(accumulate), 0, (out.size + 3) // 4)
    else:
        _unpack_2bit_par(payload, out, t, bool(accumulate), nch)


# ----------------------------------------------------------------------------
# 1bit (Seide et al.): bit 1 for v >= 0, MSB first; per block the pair
# (mean of the bit-0 elements, mean of the bit-1 elements) as float32
# ----------------------------------------------------------------------------
@njit(**_JIT)
def _lane_sums_1bit(xb, eb, sp, sn, cp):
    """Add the elements of one block to the lane sums: lane l gets elements
    l, l + LANES, ... in this order; ``cp[l]`` counts its elements with bit 1
    (int32: a narrow, vectorizable count)."""
    zero = xb.dtype.type(0)
    ng = xb.size // LANES
    x2 = xb[:ng * LANES].reshape((ng, LANES))
    e2 = None if eb is None else eb[:ng * LANES].reshape((ng, LANES))
    g = 0
    # two whole groups per step (constant inner trip count: the lanes are
    # vectorized); each lane still adds its elements one by one, in order
    while g + 2 <= ng:
        for l in range(LANES):
            v0 = x2[g, l]
            v1 = x2[g + 1, l]
            if e2 is not None:
                v0 = v0 + e2[g, l]
                v1 = v1 + e2[g + 1, l]
            p0 = v0 >= zero
            p1 = v1 >= zero
            f0 = np.float64(v0)
            f1 = np.float64(v1)
            sp[l] = (sp[l] + (f0 if p0 else 0.0)) + (f1 if p1 else 0.0)
            sn[l] = (sn[l] + (0.0 if p0 else f0)) + (0.0 if p1 else f1)
            cp[l] += np.int32(p0) + np.int32(p1)
        g += 2
    while g < ng:
        for l in range(LANES):
            v = x2[g, l]
            if e2 is not None:
                v = v + e2[g, l]
            p = v >= zero
            f = np.float64(v)
            sp[l] += f if p else 0.0
            sn[l] += 0.0 if p else f
            cp[l] += np.int32(p)
        g += 1
    for l in range(xb.size - ng * LANES):  # the partial group
        v = xb[ng * LANES + l]
        if eb is not None:
            v = v + eb[ng * LANES + l]
        p = v >= zero
        f = np.float64(v)
        sp[l] += f if p else 0.0
        sn[l] += 0.0 if p else f
        cp[l] += np.int32(p)


@njit(**_JIT)
def _quantize_1bit(xs, ei, eo, ep, codes, d0, d1):
    zero = xs.dtype.type(0)
    for i in range(xs.size):
        v = xs[i]
        if ei is not None:
            v = v + ei[i]
        if ep is not None:
            v = v + ep[i]
        p = v >= zero
        if eo is not None:
            eo[i] = v - (d1 if p else d0)
        if ep is not None:
            ep[i] = v - (d1 if p else d0)
        codes[i] = np.uint8(p)


@njit(**_JIT)
def _pack_1bit_range(x, e_in, e_out, bits, means, block, k0, k1):
    n = x.size
    sp = np.empty(LANES, np.float64)
    sn = np.empty(LANES, np.float64)
    cp = np.empty(LANES, np.int32)
    codes = np.zeros(_CH, np.uint8)
    words = codes.view(np.uint64)
    inplace = _same(e_in, e_out)
    nbad = 0
    for k in range(k0, k1):
        lo = k * block
        hi = min(n, lo + block)
        # pass 1: the block's class sums in the canonical order: lane l sums
        # elements lo+l, lo+l+32, ... sequentially, then a pairwise tree
        sp[:] = 0.0
        sn[:] = 0.0
        cp[:] = 0
        _lane_sums_1bit(x[lo:hi], _win(e_in, lo, hi), sp, sn, cp)
        npos = 0
        for l in range(LANES):
            npos += cp[l]
        s = LANES // 2
        while s > 0:
            for l in range(s):
                sp[l] += sp[l + s]
                sn[l] += sn[l + s]
            s //= 2
        nneg = (hi - lo) - npos
        m1 = np.float32(sp[0] / npos) if npos > 0 else np.float32(0.0)
        m0 = np.float32(sn[0] / nneg) if nneg > 0 else np.float32(0.0)
        means[2 * k] = m0
        means[2 * k + 1] = m1
        # A non-finite v makes a class sum non-finite (+inf goes to the bit-1
        # sum, which only grows; -inf and NaN to the bit-0 sum), so the exact
        # count is needed only then (or after an overflow of finite values).
        kbad = 0
        if not (np.isfinite(sp[0]) and np.isfinite(sn[0])):
            kbad = _count_nonfinite_sum(x[lo:hi], _win(e_in, lo, hi))
        # finite values whose mean is beyond float32 (float64 input, or a
        # float64 sum that overflows): each such mean is one bad value
        if kbad == 0:
            kbad = (0 if np.isfinite(m0) else 1) + (0 if np.isfinite(m1) else 1)
        nbad += kbad
        # pass 2 (the block is in cache): bits and residual
        d1 = x.dtype.type(m1)
        d0 = x.dtype.type(m0)
        for c0 in range(lo, hi, _CH):
            c1 = min(hi, c0 + _CH)
            m = c1 - c0
            if inplace:
                _quantize_1bit(x[c0:c1], None, None, _win(e_in, c0, c1), codes, d0, d1)
            else:
                _quantize_1bit(x[c0:c1], _win(e_in, c0, c1), _win(e_out, c0, c1),
                               None, codes, d0, d1)
            nw = (m + 7) // 8
            for j in range(m, 8 * nw):  # the tail is padded with 0
                codes[j] = 0
            _codes_to_1bit(words, bits[c0 // 8:c0 // 8 + nw])
    return nbad


@njit(parallel=True, **_JIT)
def _pack_1bit_par(x, e_in, e_out, bits, means, block, nchunks):
    nblk = means.size // 2
    per = (nblk + nchunks - 1) // nchunks
    nbad = 0
    for c in prange(nchunks):
        k0 = min(nblk, c * per)
        nbad += _pack_1bit_range(x, e_in, e_out, bits, means, block, k0,
                                 min(nblk, k0 + per))
    return nbad


@njit(**_JIT)
def _unpack_1bit_range(bits, means, out, block, accumulate, k0, k1):
    n = out.size
    codes = np.empty(_CH, np.uint8)
    words = codes.view(np.uint64)
    for k in range(k0, k1):
        lo = k * block
        hi = min(n, lo + block)
        d0 = out.dtype.type(means[2 * k])
        d1 = out.dtype.type(means[2 * k + 1])
        for c0 in range(lo, hi, _CH):
            c1 = min(hi, c0 + _CH)
            _1bit_to_codes(bits[c0 // 8:(c1 + 7) // 8], words)
            os = out[c0:c1]
            if accumulate:
                for i in range(os.size):
                    os[i] += d1 if codes[i] != 0 else d0
            else:
                for i in range(os.size):
                    os[i] = d1 if codes[i] != 0 else d0


@njit(parallel=True, **_JIT)
def _unpack_1bit_par(bits, means, out, block, accumulate, nchunks):
    nblk = means.size // 2
    per = (nblk + nchunks - 1) // nchunks
    for c in prange(nchunks):
        k0 = min(nblk, c * per)
        _unpack_1bit_range(bits, means, out, block, accumulate, k0, min(nblk, k0 + per))


def pack_1bit(x, e_in, e_out, bits, means, block_size):
    """Sign bits of ``x + e_in`` into ``bits`` (uint8, ``ceil(n/8)``) and the
    per-block reconstruction pairs into ``means`` (float32, 2 per block).

    ``block_size`` must be a multiple of 8. Returns the non-finite count of
    ``x + e_in``, plus, for each block of finite values, the number of its
    means (0 to 2) that are not finite in float32 (values beyond the wire
    format's range).
    """
    block_size = check_block_size(block_size, 8, "pack_1bit")
    nch = _nchunks(x.size)
    if nch == 1:
        return int(_pack_1bit_range(x, e_in, e_out, bits, means, block_size, 0,
                                    means.size // 2))
    return int(_pack_1bit_par(x, e_in, e_out, bits, means, block_size, nch))


def unpack_1bit(bits, means, out, block_size, accumulate):
    """Decode ``out.size`` 1-bit values with their block pairs (``block_size``
    checked as :func:`pack_1bit` checks it: the device twin reads a byte of
    bits with one block's pair)."""
    block_size = check_block_size(block_size, 8, "unpack_1bit")
    nch = _nchunks(out.size)
    if nch == 1:
        _unpack_1bit_range(bits, means, out, block_size, bool(accumulate), 0,
                           means.size // 2)
    else:
        _unpack_1bit_par(bits, means, out, block_size, bool(accumulate), nch)


# ----------------------------------------------------------------------------
# 2bit, relative mode: MXNet codes with one threshold per block,
# t_b = float32(c * sqrt(sum(v^2) / len)), the float64 sum of squares in the
# canonical order of the 1bit block sums (32 lanes, then the pairwise tree),
# or, where no |v| reaches it, dtype(max|v| / max(c, 1)) (the fallback: no
# block starves); the selected values decode to their mean magnitude r_b (an
# mpigc rule: the float64 sum of |v| over the selection, in the same order,
# over its count)
# ----------------------------------------------------------------------------
@njit(**_JIT)
def _lane_sumsq(xb, eb, sq):
    """Add the squares (float64) of one block's values to the lane sums: lane
    l gets elements l, l + LANES, ... in this order."""
    ng = xb.size // LANES
    x2 = xb[:ng * LANES].reshape((ng, LANES))
    e2 = None if eb is None else eb[:ng * LANES].reshape((ng, LANES))
    g = 0
    # two whole groups per step (see _lane_sums_1bit); each lane still adds
    # its squares one by one, in order
    while g + 2 <= ng:
        for l in range(LANES):
            v0 = x2[g, l]
            v1 = x2[g + 1, l]
            if e2 is not None:
                v0 = v0 + e2[g, l]
                v1 = v1 + e2[g + 1, l]
            f0 = np.float64(v0)
            f1 = np.float64(v1)
            sq[l] = (sq[l] + f0 * f0) + f1 * f1
        g += 2
    while g < ng:
        for l in range(LANES):
            v = x2[g, l]
            if e2 is not None:
                v = v + e2[g, l]
            f = np.float64(v)
            sq[l] += f * f
        g += 1
    for l in range(xb.size - ng * LANES):  # the partial group
        v = xb[ng * LANES + l]
        if eb is not None:
            v = v + eb[ng * LANES + l]
        f = np.float64(v)
        sq[l] += f * f


@njit(**_JIT)
def _lane_abssum_sel(xb, eb, tc, sa, sc):
    """Add |v| (float64) of one block's selected values (``v >= tc`` or
    ``v <= -tc``) to the lane sums ``sa`` in the order of _lane_sumsq, and
    count them per lane in ``sc``. A value left out adds +0.0, which changes
    no sum (every sum starts at +0.0 and only grows)."""
    neg_tc = -tc
    ng = xb.size // LANES
    x2 = xb[:ng * LANES].reshape((ng, LANES))
    e2 = None if eb is None else eb[:ng * LANES].reshape((ng, LANES))
    g = 0
    # two whole groups per step, as _lane_sumsq; each lane still adds in order
    while g + 2 <= ng:
        for l in range(LANES):
            v0 = x2[g, l]
            v1 = x2[g + 1, l]
            if e2 is not None:
                v0 = v0 + e2[g, l]
                v1 = v1 + e2[g + 1, l]
            s0 = (v0 >= tc) | (v0 <= neg_tc)
            s1 = (v1 >= tc) | (v1 <= neg_tc)
            a0 = np.float64(abs(v0)) if s0 else 0.0
            a1 = np.float64(abs(v1)) if s1 else 0.0
            sa[l] = (sa[l] + a0) + a1
            sc[l] += np.int64(s0) + np.int64(s1)
        g += 2
    while g < ng:
        for l in range(LANES):
            v = x2[g, l]
            if e2 is not None:
                v = v + e2[g, l]
            s0 = (v >= tc) | (v <= neg_tc)
            sa[l] += np.float64(abs(v)) if s0 else 0.0
            sc[l] += np.int64(s0)
        g += 1
    for l in range(xb.size - ng * LANES):  # the partial group
        v = xb[ng * LANES + l]
        if eb is not None:
            v = v + eb[ng * LANES + l]
        s0 = (v >= tc) | (v <= neg_tc)
        sa[l] += np.float64(abs(v)) if s0 else 0.0
        sc[l] += np.int64(s0)


@njit(**_JIT)
def _rel_threshold(ss, count, rel):
    """float32(rel * sqrt(ss / count)), every step in float64."""
    return np.float32(rel * np.sqrt(ss / count))


@njit(**_JIT)
def _block_absmax(xb, eb):
    """max |v| of one block (``v = xb + eb`` in its dtype) by explicit
    compares: exact, in any order (the CUDA kernel takes the integer max of
    the bits of float64(|v|): the same value). Only called for blocks of
    finite values (a NaN would never win here, and would on the GPU)."""
    m = xb.dtype.type(0)
    for i in range(xb.size):
        v = xb[i]
        if eb is not None:
            v = v + eb[i]
        a = abs(v)
        if a > m:
            m = a
    return m


@njit(**_JIT)
def _rel_mean_magnitude(xb, eb, tc, sq, sc):
    """r_b of the values of one block selected by ``tc`` (float32, 0 when
    none) and their count: the float64 sum of their |v| in the canonical
    order over the count."""
    sq[:] = 0.0
    sc[:] = 0
    _lane_abssum_sel(xb, eb, tc, sq, sc)
    cnt = 0
    for l in range(LANES):
        cnt += sc[l]
    s = LANES // 2
    while s > 0:
        for l in range(s):
            sq[l] += sq[l + s]
        s //= 2
    return (np.float32(sq[0] / cnt) if cnt > 0 else np.float32(0.0)), cnt


@njit(**_JIT)
def _pack_2bit_rel_range(x, e_in, e_out, out, scales, rel, block, k0, k1):
    n = x.size
    sq = np.empty(LANES, np.float64)
    sc = np.empty(LANES, np.int64)
    codes = np.zeros(_CH, np.uint8)
    words = codes.view(np.uint32)
    inplace = _same(e_in, e_out)
    nan = x.dtype.type(np.nan)
    zero = x.dtype.type(0)
    nbad = 0
    for k in range(k0, k1):
        lo = k * block
        hi = min(n, lo + block)
        # pass 1: the block's sum of squares in the canonical order
        sq[:] = 0.0
        _lane_sumsq(x[lo:hi], _win(e_in, lo, hi), sq)
        s = LANES // 2
        while s > 0:
            for l in range(s):
                sq[l] += sq[l + s]
            s //= 2
        t32 = _rel_threshold(sq[0], hi - lo, rel)
        tc = x.dtype.type(t32)
        if not t32 > np.float32(0.0):
            tc = nan  # t_b = 0 (or NaN): nothing selected, all 00
        # pass 2 (the block is in cache): the mean magnitude of the selected
        # values, the float64 sum of |v| in the same canonical order
        r32, cnt = _rel_mean_magnitude(x[lo:hi], _win(e_in, lo, hi), tc, sq, sc)
        if cnt == 0 and np.isfinite(t32) and t32 > np.float32(0.0):
            # nothing reaches c * rms (a block of similar magnitudes): the
            # fallback tc = dtype(float64(max|v|) / max(c, 1)) (never above
            # max|v|: rounding is monotone; max|v| itself should it round to
            # 0) selects at least the largest values, so no block starves
            # (docs/error-feedback.md). t_b is finite: so are the values
            mx = _block_absmax(x[lo:hi], _win(e_in, lo, hi))
            tc = mx
            if rel > 1.0:
                tc = x.dtype.type(np.float64(mx) / rel)
            if not tc > zero:
                tc = mx
            r32, cnt = _rel_mean_magnitude(x[lo:hi], _win(e_in, lo, hi), tc, sq, sc)
        scales[k] = r32
        td = x.dtype.type(r32)
        # pass 3: codes and residual
        kbad = 0
        for c0 in range(lo, hi, _CH):
            c1 = min(hi, c0 + _CH)
            m = c1 - c0
            if inplace:
                kbad += _quantize_2bit(x[c0:c1], None, None, _win(e_in, c0, c1),
                                           codes, tc, td)
            else:
                kbad += _quantize_2bit(x[c0:c1], _win(e_in, c0, c1),
                                           _win(e_out, c0, c1), None, codes, tc, td)
            nw = (m + 3) // 4
            for j in range(m, 4 * nw):  # the tail is padded with 00
                codes[j] = 0
            _codes_to_2bit(words, out[c0 // 4:c0 // 4 + nw])
        # finite values whose threshold overflows float32 (or whose squares
        # overflow float64), or whose mean magnitude does (float64 input):
        # one bad value
        if kbad == 0 and not (np.isfinite(t32) and np.isfinite(r32)):
            kbad = 1
        nbad += kbad
    return nbad


@njit(parallel=True, **_JIT)
def _pack_2bit_rel_par(x, e_in, e_out, out, scales, rel, block, nchunks):
    nblk = scales.size
    per = (nblk + nchunks - 1) // nchunks
    nbad = 0
    for c in prange(nchunks):
        k0 = min(nblk, c * per)
        nbad += _pack_2bit_rel_range(x, e_in, e_out, out, scales, rel, block, k0,
                                     min(nblk, k0 + per))
    return nbad


@njit(**_JIT)
def _unpack_2bit_rel_range(payload, scales, out, block, accumulate, k0, k1):
    n = out.size
    codes = np.empty(_CH, np.uint8)
    words = codes.view(np.uint32)
    for k in range(k0, k1):
        lo = k * block
        hi = min(n, lo + block)
        t = out.dtype.type(scales[k])
        neg_t = -t
        zero = out.dtype.type(0)
        for c0 in range(lo, hi, _CH):
            c1 = min(hi, c0 + _CH)
            _2bit_to_codes(payload[c0 // 4:(c1 + 3) // 4], words)
            os = out[c0:c1]
            if accumulate:
                for i in range(os.size):
                    c = codes[i]
                    os[i] += t if c == 3 else (neg_t if c == 2 else zero)
            else:
                for i in range(os.size):
                    c = codes[i]
                    os[i] = t if c == 3 else (neg_t if c == 2 else zero)


@njit(parallel=True, **_JIT)
def _unpack_2bit_rel_par(payload, scales, out, block, accumulate, nchunks):
    nblk = scales.size
    per = (nblk + nchunks - 1) // nchunks
    for c in prange(nchunks):
        k0 = min(nblk, c * per)
        _unpack_2bit_rel_range(payload, scales, out, block, accumulate, k0,
                               min(nblk, k0 + per))


def pack_2bit_rel(x, e_in, e_out, out, scales, rel_threshold, block_size):
    """2bit codes of ``v = x + e_in`` with one threshold per block, the
    selected values decoding to the block's mean magnitude.

    Block b (``block_size`` elements, a multiple of 4, from element 0; the
    last may be shorter) has ``t_b = float32(rel_threshold * sqrt(ss_b / m_b))``
    with ``ss_b`` the float64 sum of its squares in the canonical order (32
    lanes, lane l summing elements l, l+32, ... in sequence, then the tree
    ``sum[l] += sum[l + s]``, s = 16, 8, 4, 2, 1) and ``m_b`` its length.
    Codes as :func:`pack_2bit` with ``t_b`` (all ``00`` where ``t_b`` is 0
    or NaN) into ``out`` (uint8, ``ceil(n / 4)``); where ``t_b`` is finite
    and > 0 but no ``|v|`` reaches it, the block uses the fallback
    ``dtype(float64(max|v|) / max(rel_threshold, 1))`` instead (``max|v|``
    itself should that round to 0), so a nonzero block always sends its
    largest values and no residual grows without bound
    (docs/error-feedback.md). The selected values S_b
    (codes ``11``/``10``) give ``r_b = float32(A_b / |S_b|)``, ``A_b`` the
    float64 sum of their ``|v|`` in the same canonical order (0 when S_b is
    empty); ``r_b`` goes into ``scales`` (float32, one per block; ``t_b``
    does not travel) and the residual is ``v - (+-dtype(r_b) or 0)``.
    Returns the non-finite count of ``v``, plus one per block of finite
    values whose ``t_b`` or ``r_b`` is not finite.
    """
    block_size = check_block_size(block_size, 4, "pack_2bit_rel")
    rel = float(rel_threshold)
    nch = _nchunks(x.size)
    if nch == 1:
        return int(_pack_2bit_rel_range(x, e_in, e_out, out, scales, rel, block_size,
                                        0, scales.size))
    return int(_pack_2bit_rel_par(x, e_in, e_out, out, scales, rel, block_size, nch))


def unpack_2bit_rel(payload, scales, out, block_size, accumulate):
    """Decode ``out.size`` 2bit codes with their block magnitudes: ``11`` ->
    +r_b, ``10`` -> -r_b, else 0. Writes into ``out``, or adds to it
    (``block_size`` checked as :func:`pack_2bit_rel` checks it)."""
    block_size = check_block_size(block_size, 4, "unpack_2bit_rel")
    nch = _nchunks(out.size)
    if nch == 1:
        _unpack_2bit_rel_range(payload, scales, out, block_size, bool(accumulate), 0,
                               scales.size)
    else:
        _unpack_2bit_rel_par(payload, scales, out, block_size, bool(accumulate), nch)


# ----------------------------------------------------------------------------
# terngrad: statistics, then stochastic ternary codes in the 2bit layout
# ----------------------------------------------------------------------------
@njit(**_JIT)
def _stats_sums(xs, es):
    # The float64 sums run sequentially in element order (that order is part
    # of the results), so this loop is bound by the latency of the additions.
    s = 0.0
    ss = 0.0
    amax = 0.0
    for i in range(xs.size):
        v = xs[i]
        if es is not None:
            v = v + es[i]
        f = np.float64(v)
        s += f
        ss += f * f
        a = abs(f)
        amax = a if a > amax else amax
    return s, ss, amax


#: stats sums blocks of this many elements, then the block sums in order, so
#: its results do not depend on the number of threads
STATS_BLOCK = 1 << 16


@njit(**_JIT)
def _stats_blocks(x, e_in, sums, sqs, maxs, b0, b1):
    n = x.size
    for b in range(b0, b1):
        i0 = b * STATS_BLOCK
        i1 = min(n, i0 + STATS_BLOCK)
        sums[b], sqs[b], maxs[b] = _stats_sums(x[i0:i1], _win(e_in, i0, i1))


@njit(parallel=True, **_JIT)
def _stats_blocks_par(x, e_in, sums, sqs, maxs, nchunks):
    nb = sums.size
    per = (nb + nchunks - 1) // nchunks
    for c in prange(nchunks):
        b0 = min(nb, c * per)
        _stats_blocks(x, e_in, sums, sqs, maxs, b0, min(nb, b0 + per))


@njit(**_JIT)
def _combine(sums, sqs, maxs):
    s = 0.0
    ss = 0.0
    amax = 0.0
    for b in range(sums.size):
        s += sums[b]
        ss += sqs[b]
        amax = maxs[b] if maxs[b] > amax else amax
    return s, ss, amax


def stats(x, e_in):
    """Return ``(sum, sum of squares, max |v|, non-finite count)`` of
    ``v = x + e_in``, accumulated in float64: sequentially within blocks of
    ``STATS_BLOCK`` elements, then over the blocks in order."""
    nb = (x.size + STATS_BLOCK - 1) // STATS_BLOCK
    sums, sqs, maxs = np.empty(nb), np.empty(nb), np.empty(nb)
    nch = _nchunks(x.size)
    if nch == 1:
        _stats_blocks(x, e_in, sums, sqs, maxs, 0, nb)
    else:
        _stats_blocks_par(x, e_in, sums, sqs, maxs, nch)
    s, ss, amax = _combine(sums, sqs, maxs)
    nbad = 0
    if not np.isfinite(ss):  # a non-finite v makes the sum of squares inf or NaN
        nbad = count_nonfinite(x) if e_in is None else int(
            _count_nonfinite_sum(x, e_in))
    return float(s), float(ss), float(amax), int(nbad)


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


@njit(inline="always", **_JIT)
def _splitmix64(z):
    z = z + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _splitmix64_int(z):
    m = 0xFFFFFFFFFFFFFFFF
    z = (z + 0x9E3779B97F4A7C15) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


def ternary_stream(seed, rank, call, stage):
    """The 64-bit stream id of one terngrad quantization: a hash of the seed,
    the rank, the call count and the stage (0 worker, 1 owner)."""
    z = _splitmix64_int(seed & 0xFFFFFFFFFFFFFFFF)
    for word in (rank, call, stage):
        z = _splitmix64_int(z ^ (word & 0xFFFFFFFFFFFFFFFF))
    return z


@njit(**_JIT)
def _quantize_ternary(xs, ei, eo, ep, codes, s, scale, clip, stream, offset, i0):
    """Codes and residual of one chunk; ``i0`` is its first element's index."""
    neg_s = -s
    zero = s - s
    for j in range(xs.size):
        v = xs[j]
        if ei is not None:
            v = v + ei[j]
        if ep is not None:
            v = v + ep[j]
        f = min(max(np.float64(v), -clip), clip)
        i = i0 + j
        h = _splitmix64(stream ^ ((offset + np.uint64(i)) * _GOLDEN))
        u = np.float64(h >> np.uint64(11)) * (1.0 / 9007199254740992.0)
        keep = u < abs(f) / scale  # scale > 0 here (the caller checks)
        pos = keep & (f > 0.0)
        neg = keep & (f < 0.0)
        d = s if pos else (neg_s if neg else zero)
        if eo is not None:
            eo[j] = v - d
        if ep is not None:
            ep[j] = v - d
        codes[j] = np.uint8(3) if pos else (np.uint8(2) if neg else np.uint8(0))


@njit(**_JIT)
def _pack_ternary_range(x, e_in, e_out, out, scale, clip, stream, offset, b0, b1):
    s = x.dtype.type(scale)
    if not scale > 0.0:  # nothing to send: every code 00 (and no division by 0)
        s = x.dtype.type(0.0)
        clip = 0.0
        scale = 1.0
    i0 = 4 * b0
    i1 = min(x.size, 4 * b1)
    codes = np.zeros(_CH, np.uint8)
    words = codes.view(np.uint32)
    inplace = _same(e_in, e_out)
    nbad = 0
    for c0 in range(i0, i1, _CH):
        c1 = min(i1, c0 + _CH)
        m = c1 - c0
        nbad += _count_nonfinite_sum(x[c0:c1], _win(e_in, c0, c1))
        if inplace:
            _quantize_ternary(x[c0:c1], None, None, _win(e_in, c0, c1), codes, s, scale,
                              clip, stream, offset, c0)
        else:
            _quantize_ternary(x[c0:c1], _win(e_in, c0, c1), _win(e_out, c0, c1), None,
                              codes, s, scale, clip, stream, offset, c0)
        nw = (m + 3) // 4
        for j in range(m, 4 * nw):  # the tail is padded with 00
            codes[j] = 0
        _codes_to_2bit(words, out[c0 // 4:c0 // 4 + nw])
    return nbad


@njit(parallel=True, **_JIT)
def _pack_ternary_par(x, e_in, e_out, out, scale, clip, stream, offset, nchunks):
    nb = out.size
    per = (nb + nchunks - 1) // nchunks
    nbad = 0
    for c in prange(nchunks):
        b0 = min(nb, c * per)
        nbad += _pack_ternary_range(x, e_in, e_out, out, scale, clip, stream, offset,
                                    b0, min(nb, b0 + per))
    return nbad


def pack_ternary(x, e_in, e_out, out, scale, clip, stream, offset):
    """TernGrad codes of ``v = clip(x + e_in)`` in the 2bit layout.

    Element i becomes ``scale * sign(v) * b`` with ``b ~ Bernoulli(|v| / scale)``;
    the uniform draw is a counter-based hash of ``stream`` and the global
    element index ``offset + i``, so it does not depend on threads or shards.
    ``scale`` is a float32 value (it travels as such); ``clip`` bounds ``|v|``
    (``inf`` for none). Returns the non-finite count.
    """
    stream = np.uint64(stream)
    offset = np.uint64(offset)
    scale = float(np.float32(scale))
    nch = _nchunks(x.size)
    if nch == 1:
        return int(_pack_ternary_range(x, e_in, e_out, out, scale, float(clip), stream,
                                       offset, 0, out.size))
    return int(_pack_ternary_par(x, e_in, e_out, out, scale, float(clip), stream, offset,
                                 nch))


# ----------------------------------------------------------------------------
# fp16 (IEEE half) and bf16 (bfloat16: float32's range, 8 bits of
# significand) on the wire: one body, the conversion as the parameter
# (``bf16``: False for fp16, True for bf16; a loop-invariant branch)
# ----------------------------------------------------------------------------
@njit(inline="always", **_JIT)
def _half_bits(f, bf16):
    return _f32_to_bf16_bits(f) if bf16 else _f32_to_f16_bits(f)


@njit(inline="always", **_JIT)
def _half_value(h, bf16):
    return _bf16_bits_to_f32(h) if bf16 else _f16_bits_to_f32(h)


@njit(**_JIT)
def _quantize_half(xs, ei, eo, ep, hs, dv, bf16):
    for i in range(xs.size):
        v = xs[i]
        if ei is not None:
            v = v + ei[i]
        if ep is not None:
            v = v + ep[i]
        h = _half_bits(np.float32(v / dv), bf16)
        hs[i] = h
        if eo is not None:
            eo[i] = v - xs.dtype.type(_half_value(h, bf16)) * dv
        if ep is not None:
            ep[i] = v - xs.dtype.type(_half_value(h, bf16)) * dv


@njit(**_JIT)
def _count_half_nonfinite(hs, bf16):
    """NaN/inf on the wire: all exponent bits set."""
    mask = np.uint16(0x7F80) if bf16 else np.uint16(0x7C00)
    nbad = 0
    for i in range(hs.size):
        nbad += (hs[i] & mask) == mask
    return nbad


@njit(**_JIT)
def _pack_half_range(x, e_in, e_out, out, divisor, i0, i1, bf16):
    dv = x.dtype.type(divisor)
    inplace = _same(e_in, e_out)
    nbad = 0
    for c0 in range(i0, i1, _CH):
        c1 = min(i1, c0 + _CH)
        if inplace:
            _quantize_half(x[c0:c1], None, None, _win(e_in, c0, c1), out[c0:c1], dv, bf16)
        else:
            _quantize_half(x[c0:c1], _win(e_in, c0, c1), _win(e_out, c0, c1), None,
                           out[c0:c1], dv, bf16)
        # NaN/inf on the wire: from a non-finite value, or one beyond the range
        nbad += _count_half_nonfinite(out[c0:c1], bf16)
    return nbad


@njit(parallel=True, **_JIT)
def _pack_half_par(x, e_in, e_out, out, divisor, nchunks, bf16):
    n = x.size
    per = (n + nchunks - 1) // nchunks
    nbad = 0
    for c in prange(nchunks):
        i0 = min(n, c * per)
        nbad += _pack_half_range(x, e_in, e_out, out, divisor, i0, min(n, i0 + per), bf16)
    return nbad


@njit(**_JIT)
def _unpack_half_range(payload, out, accumulate, i0, i1, bf16):
    hs = payload[i0:i1]
    os = out[i0:i1]
    if accumulate:
        for i in range(os.size):
            os[i] += _half_value(hs[i], bf16)
    else:
        for i in range(os.size):
            os[i] = _half_value(hs[i], bf16)


@njit(parallel=True, **_JIT)
def _unpack_half_par(payload, out, accumulate, nchunks, bf16):
    n = out.size
    per = (n + nchunks - 1) // nchunks
    for c in prange(nchunks):
        i0 = min(n, c * per)
        _unpack_half_range(payload, out, accumulate, i0, min(n, i0 + per), bf16)


def _pack_half(x, e_in, e_out, out, divisor, bf16):
    nch = _nchunks(x.size)
    if nch == 1:
        return int(_pack_half_range(x, e_in, e_out, out, float(divisor), 0, x.size, bf16))
    return int(_pack_half_par(x, e_in, e_out, out, float(divisor), nch, bf16))


def _unpack_half(payload, out, accumulate, bf16):
    nch = _nchunks(out.size)
    if nch == 1:
        _unpack_half_range(payload, out, bool(accumulate), 0, out.size, bf16)
    else:
        _unpack_half_par(payload, out, bool(accumulate), nch, bf16)


def pack_fp16(x, e_in, e_out, out, divisor):
    """``out`` (uint16 bits of binary16) = half(float32((x + e_in) / divisor)).

    The residual is ``v - half * divisor``. Returns the number of values that
    are not finite on the wire: non-finite ones, and finite ones beyond the
    half range (which would arrive as inf).
    """
    return _pack_half(x, e_in, e_out, out, divisor, False)


def unpack_fp16(payload, out, accumulate):
    """Decode ``out.size`` binary16 values (uint16 bits) into ``out``."""
    _unpack_half(payload, out, accumulate, False)


def pack_bf16(x, e_in, e_out, out, divisor):
    """``out`` (uint16 bits of bfloat16) = bf16(float32((x + e_in) / divisor)).

    bf16 rounds to nearest even; a NaN becomes ``0x7FC0`` with its sign. The
    residual is ``v - bf16 * divisor``. Returns the number of values that are
    not finite on the wire: non-finite ones, and finite ones beyond the
    bfloat16 range (float64 values beyond float32's, and float32 values that
    round up to inf), which would arrive as inf.
    """
    return _pack_half(x, e_in, e_out, out, divisor, True)


def unpack_bf16(payload, out, accumulate):
    """Decode ``out.size`` bfloat16 values (uint16 bits) into ``out``."""
    _unpack_half(payload, out, accumulate, True)

# ----------------------------------------------------------------------------
@njit(**_JIT)
def _count_nonfinite_sum(xs, es):
    """Number of non-finite values of ``xs + es`` (``es`` may be None)."""
    zero = xs.dtype.type(0)
    nbad = 0
    for i in range(xs.size):
        v = xs[i]
        if es is not None:
            v = v + es[i]
        nbad += (v - v) != zero
    return nbad


@njit(**_JIT)
def _count_nonfinite_range(x, i0, i1):
    return _count_nonfinite_sum(x[i0:i1], None)


@njit(parallel=True, **_JIT)
def _count_nonfinite_par(x, nchunks):
    n = x.size
    per = (n + nchunks - 1) // nchunks
    nbad = 0
    for c in prange(nchunks):
        i0 = min(n, c * per)
        nbad += _count_nonfinite_range(x, i0, min(n, i0 + per))
    return nbad


def count_nonfinite(x):
    """Number of NaN and infinite values in ``x``."""
    nch = _nchunks(x.size)
    if nch == 1:
        return int(_count_nonfinite_range(x, 0, x.size))
    return int(_count_nonfinite_par(x, nch))


# the bits of each float dtype's exponent (all ones: NaN or infinite), by itemsize
_EXP_BITS = {2: (np.uint16, np.uint16(0x7C00)), 4: (np.uint32, np.uint32(0x7F800000)),
             8: (np.uint64, np.uint64(0x7FF0000000000000))}


@njit(**_JIT)
def _copy_count(src, dst, mask):
    nbad = 0
    for i in range(src.size):
        v = src[i]
        dst[i] = v
        nbad += (v & mask) == mask
    return nbad


@njit(**_JIT)
def _copy_count_range(src, dst, mask, i0, i1):
    # on slices: a loop over range(i0, i1) of the whole arrays was not
    # vectorised (318 us for 256K float32, against 38 us)
    return _copy_count(src[i0:i1], dst[i0:i1], mask)


@njit(parallel=True, **_JIT)
def _copy_count_par(src, dst, mask, nchunks):
    n = src.size
    per = (n + nchunks - 1) // nchunks
    nbad = 0
    for c in prange(nchunks):
        i0 = min(n, c * per)
        nbad += _copy_count_range(src, dst, mask, i0, min(n, i0 + per))
    return nbad


def copy_count_nonfinite(x, out):
    """Copy the bytes of ``x`` (float16, float32 or float64, 1-D, contiguous)
    into ``out`` (uint8, ``x.nbytes``, aligned for ``x``'s dtype) and return
    :func:`count_nonfinite` of ``x``, in one pass over the values instead of
    two (the values that travel in an agreement message, whose row holds
    their count). The copy is of the bits (NaN payloads as they are); a
    value is counted where its exponent bits are all ones.

    Host only, not in ``__all__``: the values travel inline in agreement
    messages of host buffers only (:func:`mpigc._plan.inline_data`), so the
    device module has no sibling."""
    ut, mask = _EXP_BITS[x.dtype.itemsize]
    src, dst = x.view(ut), out.view(ut)
    nch = _nchunks(src.size)
    if nch == 1:
        return int(_copy_count_range(src, dst, mask, 0, src.size))
    return int(_copy_count_par(src, dst, mask, nch))


# ----------------------------------------------------------------------------
# the shards of one collective call: the device module packs (decodes) them
# all in one launch; here each is a call of the kernels above, in order
# ----------------------------------------------------------------------------
def _shards(starts, offs):
    """``(j, lo, hi, payload offset)`` of every non-empty shard."""
    for j in range(len(starts) - 1):
        lo, hi = int(starts[j]), int(starts[j + 1])
        if hi > lo:
            yield j, lo, hi, int(offs[j])


def _part(a, lo, hi):
    return None if a is None else a[lo:hi]


def _put_f32s(payload, at, values):
    """The float32 ``values`` as little-endian bytes at ``payload[at:]``."""
    payload[at:at + 4 * values.size] = values.astype("<f4", copy=False).view(np.uint8)


def _get_f32s(payload, at, count):
    return np.frombuffer(payload[at:at + 4 * count].tobytes(), "<f4").astype(np.float32)


def pack_2bit_shards(x, e_in, e_out, payload, starts, offs, threshold):
    """:func:`pack_2bit` of every shard ``x[starts[j]:starts[j + 1]]`` into
    ``payload[offs[j]:]`` (each shard from bit 0). Returns the non-finite
    count of all shards."""
    nbad = 0
    for _, lo, hi, o in _shards(starts, offs):
        nbad += pack_2bit(x[lo:hi], _part(e_in, lo, hi), _part(e_out, lo, hi),
                          payload[o:o + (hi - lo + 3) // 4], threshold)
    return nbad


def unpack_2bit_shards(payload, stride, nsrc, starts, offs, out, threshold, accumulate):
    """Decode shard j of ``nsrc`` payloads (sender s's at
    ``payload[s * stride + offs[j]:]``) onto ``out[starts[j]:starts[j + 1]]``:
    sender 0 written (added when ``accumulate``), the others added, in order."""
    for _, lo, hi, o in _shards(starts, offs):
        for s in range(nsrc):
            b = s * stride + o
            unpack_2bit(payload[b:b + (hi - lo + 3) // 4], out[lo:hi], threshold,
                        accumulate or s > 0)


def pack_1bit_shards(x, e_in, e_out, payload, starts, offs, block_size):
    """:func:`pack_1bit` of every shard into ``payload[offs[j]:]``: its bits,
    then its reconstruction pairs as little-endian float32 (the wire
    format). Returns the bad count of all shards."""
    block_size = check_block_size(block_size, 8, "pack_1bit_shards")
    nbad = 0
    for _, lo, hi, o in _shards(starts, offs):
        nb = (hi - lo + 7) // 8
        means = np.empty(2 * ((hi - lo + block_size - 1) // block_size), np.float32)
        nbad += pack_1bit(x[lo:hi], _part(e_in, lo, hi), _part(e_out, lo, hi),
                          payload[o:o + nb], means, block_size)
        _put_f32s(payload, o + nb, means)
    return nbad


def unpack_1bit_shards(payload, stride, nsrc, starts, offs, out, block_size, accumulate):
    """Decode 1bit shards (bits, then pairs) of ``nsrc`` payloads onto ``out``
    (as :func:`unpack_2bit_shards`)."""
    block_size = check_block_size(block_size, 8, "unpack_1bit_shards")
    for _, lo, hi, o in _shards(starts, offs):
        nb = (hi - lo + 7) // 8
        nm = 2 * ((hi - lo + block_size - 1) // block_size)
        for s in range(nsrc):
            b = s * stride + o
            unpack_1bit(payload[b:b + nb], _get_f32s(payload, b + nb, nm), out[lo:hi],
                        block_size, accumulate or s > 0)


def pack_2bit_rel_shards(x, e_in, e_out, payload, starts, offs, rel_threshold, block_size):
    """:func:`pack_2bit_rel` of every shard into ``payload[offs[j]:]``: its
    codes, then its block magnitudes as little-endian float32. Returns the
    bad count of all shards."""
    block_size = check_block_size(block_size, 4, "pack_2bit_rel_shards")
    nbad = 0
    for _, lo, hi, o in _shards(starts, offs):
        nb = (hi - lo + 3) // 4
        scales = np.empty((hi - lo + block_size - 1) // block_size, np.float32)
        nbad += pack_2bit_rel(x[lo:hi], _part(e_in, lo, hi), _part(e_out, lo, hi),
                              payload[o:o + nb], scales, rel_threshold, block_size)
        _put_f32s(payload, o + nb, scales)
    return nbad


def unpack_2bit_rel_shards(payload, stride, nsrc, starts, offs, out, block_size, accumulate):
    """Decode relative 2bit shards (codes, then magnitudes) of ``nsrc``
    payloads onto ``out`` (as :func:`unpack_2bit_shards`)."""
    block_size = check_block_size(block_size, 4, "unpack_2bit_rel_shards")
    for _, lo, hi, o in _shards(starts, offs):
        nb = (hi - lo + 3) // 4
        nm = (hi - lo + block_size - 1) // block_size
        for s in range(nsrc):
            b = s * stride + o
            unpack_2bit_rel(payload[b:b + nb], _get_f32s(payload, b + nb, nm), out[lo:hi],
                            block_size, accumulate or s > 0)


def pack_ternary_shards(x, e_in, e_out, payload, starts, offs, scale, clip, stream, offset):
    """:func:`pack_ternary` of every shard into ``payload[offs[j]:]``: its
    codes, then ``scale`` as a little-endian float32. Element i of ``x``
    draws with counter ``offset + i``. Returns the non-finite count."""
    nbad = 0
    with np.errstate(over="ignore"):
        s32 = np.array([scale], np.float32)
    for _, lo, hi, o in _shards(starts, offs):
        nb = (hi - lo + 3) // 4
        nbad += pack_ternary(x[lo:hi], _part(e_in, lo, hi), _part(e_out, lo, hi),
                             payload[o:o + nb], s32[0], clip, stream, int(offset) + lo)
        _put_f32s(payload, o + nb, s32)
    return nbad


def unpack_ternary_shards(payload, stride, nsrc, starts, offs, out, accumulate):
    """Decode terngrad shards (codes, then the scale) of ``nsrc`` payloads onto
    ``out`` (as :func:`unpack_2bit_shards`)."""
    for _, lo, hi, o in _shards(starts, offs):
        nb = (hi - lo + 3) // 4
        for s in range(nsrc):
            b = s * stride + o
            scale = float(_get_f32s(payload, b + nb, 1)[0])
            unpack_2bit(payload[b:b + nb], out[lo:hi], scale, accumulate or s > 0)


def _unpack_half_shards(payload, stride, nsrc, starts, offs, out, accumulate, bf16):
    for _, lo, hi, o in _shards(starts, offs):
        for s in range(nsrc):
            b = s * stride + o
            _unpack_half(payload[b:b + 2 * (hi - lo)].view(np.uint16), out[lo:hi],
                         accumulate or s > 0, bf16)


def unpack_fp16_shards(payload, stride, nsrc, starts, offs, out, accumulate):
    """Decode the fp16 payloads (uint8) of ``nsrc`` senders onto ``out``
    (as :func:`unpack_2bit_shards`)."""
    _unpack_half_shards(payload, stride, nsrc, starts, offs, out, accumulate, False)


def unpack_bf16_shards(payload, stride, nsrc, starts, offs, out, accumulate):
    """Decode the bf16 payloads (uint8) of ``nsrc`` senders onto ``out``."""
    _unpack_half_shards(payload, stride, nsrc, starts, offs, out, accumulate, True)
