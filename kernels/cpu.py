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
import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

__all__ = [
    "pack_2bit", "unpack_2bit",
    "pack_1bit", "unpack_1bit",
    "stats", "pack_ternary",
    "pack_fp16", "unpack_fp16",
    "count_nonfinite", "ternary_stream",
    "PARALLEL_MIN_ELEMENTS",
]

_JIT = dict(cache=True, nogil=True, boundscheck=False)

#: Below this many elements the single-thread kernels are used even when Numba
#: has several threads: a parallel launch costs more than it saves.
PARALLEL_MIN_ELEMENTS = 1 << 18

LANES = 32  # canonical summation order of the 1bit block sums (see _block_sums)


def _nchunks(n):
    """How many parallel chunks to cut ``n`` elements into (1 = serial)."""
    threads = numba.get_num_threads()
    if threads <= 1 or n < PARALLEL_MIN_ELEMENTS:
        return 1
    return threads * 4


# ----------------------------------------------------------------------------
# bit casts (float32 <-> uint32), used by the float16 conversions
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
    """float32 -> IEEE binary16 bits, round to nearest even (as numpy)."""
    u = _f32_as_u32(f)
    sign = np.uint32((u >> np.uint32(16)) & np.uint32(0x8000))
    u = np.uint32(u & np.uint32(0x7FFFFFFF))
    if u >= np.uint32(0x47800000):  # >= 65536: inf, or NaN
        o = np.uint32(0x7E00) if u > np.uint32(0x7F800000) else np.uint32(0x7C00)
    elif u < np.uint32(0x38800000):  # below the smallest normal half: subnormal
        magic = np.uint32(0x3F000000)  # 0.5f: aligns the mantissa for rounding
        o = _f32_as_u32(_u32_as_f32(u) + _u32_as_f32(magic)) - magic
        o = np.uint32(o)
    else:
        odd = (u >> np.uint32(13)) & np.uint32(1)
        u = np.uint32(u + np.uint32(0xC8000FFF) + odd)  # rebias, round half even
        o = np.uint32(u >> np.uint32(13))
    return np.uint16(o | sign)


@njit(inline="always", **_JIT)
def _f16_bits_to_f32(h):
    """IEEE binary16 bits -> float32 (exact)."""
    h = np.uint32(h)
    u = np.uint32((h & np.uint32(0x7FFF)) << np.uint32(13))
    exp = np.uint32(u & np.uint32(0x0F800000))
    u = np.uint32(u + np.uint32(0x38000000))  # (127 - 15) << 23
    if exp == np.uint32(0x0F800000):  # inf / NaN
        f = _u32_as_f32(np.uint32(u + np.uint32(0x38000000)))
    elif exp == 0:  # zero / subnormal
        f = (_u32_as_f32(np.uint32(u + np.uint32(0x00800000)))
             - _u32_as_f32(np.uint32(0x38800000)))
    else:
        f = _u32_as_f32(u)
    sign = np.uint32((h & np.uint32(0x8000)) << np.uint32(16))
    return _u32_as_f32(np.uint32(_f32_as_u32(f) | sign))


# ----------------------------------------------------------------------------
# 2bit (MXNet layout): byte k holds elements 4k..4k+3, element 0 in bits 7-6
# ----------------------------------------------------------------------------
@njit(**_JIT)
def _pack_2bit_range(x, e_in, e_out, out, t, b0, b1):
    n = x.size
    neg_t = -t
    zero = t - t
    nbad = 0
    full = min(b1, n // 4)
    for k in range(b0, full):
        byte = 0
        for j in range(4):
            i = 4 * k + j
            v = x[i]
            if e_in is not None:
                v = v + e_in[i]
            pos = v >= t
            neg = v <= neg_t
            d = t if pos else (neg_t if neg else zero)
            if e_out is not None:
                e_out[i] = v - d
            nbad += (v - v) != zero
            byte |= ((3 if pos else (2 if neg else 0)) << (6 - 2 * j))
        out[k] = byte
    for k in range(max(b0, full), b1):  # the last, partial byte
        byte = 0
        for j in range(n - 4 * k):
            i = 4 * k + j
            v = x[i]
            if e_in is not None:
                v = v + e_in[i]
            pos = v >= t
            neg = v <= neg_t
            d = t if pos else (neg_t if neg else zero)
            if e_out is not None:
                e_out[i] = v - d
            nbad += (v - v) != zero
            byte |= ((3 if pos else (2 if neg else 0)) << (6 - 2 * j))
        out[k] = byte
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
    n = out.size
    neg_t = -t
    zero = t - t
    full = min(b1, n // 4)
    if accumulate:
        for k in range(b0, full):
            byte = payload[k]
            for j in range(4):
                c = (byte >> (6 - 2 * j)) & 3
                out[4 * k + j] += t if c == 3 else (neg_t if c == 2 else zero)
    else:
        for k in range(b0, full):
            byte = payload[k]
            for j in range(4):
                c = (byte >> (6 - 2 * j)) & 3
                out[4 * k + j] = t if c == 3 else (neg_t if c == 2 else zero)
    for k in range(max(b0, full), b1):
        byte = payload[k]
        for j in range(n - 4 * k):
            c = (byte >> (6 - 2 * j)) & 3
            d = t if c == 3 else (neg_t if c == 2 else zero)
            if accumulate:
                out[4 * k + j] += d
            else:
                out[4 * k + j] = d


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
def _pack_1bit_range(x, e_in, e_out, bits, means, block, k0, k1):
    n = x.size
    zero = x.dtype.type(0)
    sp = np.empty(LANES, np.float64)
    sn = np.empty(LANES, np.float64)
    cp = np.empty(LANES, np.int64)
    nbad = 0
    for k in range(k0, k1):
        lo = k * block
        hi = min(n, lo + block)
        # pass 1: the block's class sums in the canonical order: lane l sums
        # elements lo+l, lo+l+32, ... sequentially, then a pairwise tree
        for l in range(LANES):
            sp[l] = 0.0
            sn[l] = 0.0
            cp[l] = 0
        for base in range(lo, hi, LANES):
            for l in range(min(LANES, hi - base)):
                v = x[base + l]
                if e_in is not None:
                    v = v + e_in[base + l]
                p = v >= zero
                f = np.float64(v)
                sp[l] += f if p else 0.0
                sn[l] += 0.0 if p else f
                cp[l] += p
        s = LANES // 2
        while s > 0:
            for l in range(s):
                sp[l] += sp[l + s]
                sn[l] += sn[l + s]
                cp[l] += cp[l + s]
            s //= 2
        npos = cp[0]
        nneg = (hi - lo) - npos
        m1 = np.float32(sp[0] / npos) if npos > 0 else np.float32(0.0)
        m0 = np.float32(sn[0] / nneg) if nneg > 0 else np.float32(0.0)
        means[2 * k] = m0
        means[2 * k + 1] = m1
        d1 = x.dtype.type(m1)
        d0 = x.dtype.type(m0)
        # pass 2 (the block is in cache): bits and residual
        for b in range(lo // 8, (hi + 7) // 8):
            byte = 0
            for j in range(min(8, hi - 8 * b)):
                i = 8 * b + j
                v = x[i]
                if e_in is not None:
                    v = v + e_in[i]
                p = v >= zero
                if e_out is not None:
                    e_out[i] = v - (d1 if p else d0)
                nbad += (v - v) != zero
                byte |= (1 if p else 0) << (7 - j)
            bits[b] = byte
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
    for k in range(k0, k1):
        lo = k * block
        hi = min(n, lo + block)
        d0 = out.dtype.type(means[2 * k])
        d1 = out.dtype.type(means[2 * k + 1])
        for b in range(lo // 8, (hi + 7) // 8):
            byte = bits[b]
            if accumulate:
                for j in range(min(8, hi - 8 * b)):
                    out[8 * b + j] += d1 if (byte >> (7 - j)) & 1 else d0
            else:
                for j in range(min(8, hi - 8 * b)):
                    out[8 * b + j] = d1 if (byte >> (7 - j)) & 1 else d0


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

    ``block_size`` must be a multiple of 8. Returns the non-finite count.
    """
    nch = _nchunks(x.size)
    if nch == 1:
        return int(_pack_1bit_range(x, e_in, e_out, bits, means, block_size, 0,
                                    means.size // 2))
    return int(_pack_1bit_par(x, e_in, e_out, bits, means, block_size, nch))


def unpack_1bit(bits, means, out, block_size, accumulate):
    """Decode ``out.size`` 1-bit values with their block pairs."""
    nch = _nchunks(out.size)
    if nch == 1:
        _unpack_1bit_range(bits, means, out, block_size, bool(accumulate), 0,
                           means.size // 2)
    else:
        _unpack_1bit_par(bits, means, out, block_size, bool(accumulate), nch)


# ----------------------------------------------------------------------------
# terngrad: statistics, then stochastic ternary codes in the 2bit layout
# ----------------------------------------------------------------------------
@njit(**_JIT)
def _stats_range(x, e_in, i0, i1):
    s = 0.0
    ss = 0.0
    amax = 0.0
    nbad = 0
    for i in range(i0, i1):
        v = x[i]
        if e_in is not None:
            v = v + e_in[i]
        f = np.float64(v)
        s += f
        ss += f * f
        a = abs(f)
        amax = a if a > amax else amax
        nbad += (f - f) != 0.0
    return s, ss, amax, nbad


@njit(parallel=True, **_JIT)
def _stats_par(x, e_in, nchunks):
    n = x.size
    per = (n + nchunks - 1) // nchunks
    sums = np.zeros(nchunks)
    sqs = np.zeros(nchunks)
    maxs = np.zeros(nchunks)
    bads = np.zeros(nchunks, np.int64)
    for c in prange(nchunks):
        i0 = min(n, c * per)
        sums[c], sqs[c], maxs[c], bads[c] = _stats_range(x, e_in, i0, min(n, i0 + per))
    return sums.sum(), sqs.sum(), maxs.max(), bads.sum()


def stats(x, e_in):
    """Return ``(sum, sum of squares, max |v|, non-finite count)`` of
    ``v = x + e_in``, accumulated in float64."""
    nch = _nchunks(x.size)
    if nch == 1:
        s, ss, amax, nbad = _stats_range(x, e_in, 0, x.size)
    else:
        s, ss, amax, nbad = _stats_par(x, e_in, nch)
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
    z = seed & 0xFFFFFFFFFFFFFFFF
    for word in (rank, call, stage):
        z = _splitmix64_int(z ^ (word & 0xFFFFFFFFFFFFFFFF))
    return z


@njit(**_JIT)
def _pack_ternary_range(x, e_in, e_out, out, scale, clip, stream, offset, b0, b1):
    n = x.size
    s = x.dtype.type(scale)
    neg_s = -s
    zero = s - s
    inv = 1.0 / scale if scale > 0.0 else 0.0
    nbad = 0
    for k in range(b0, b1):
        byte = 0
        for j in range(min(4, n - 4 * k)):
            i = 4 * k + j
            v = x[i]
            if e_in is not None:
                v = v + e_in[i]
            f = min(max(np.float64(v), -clip), clip)
            h = _splitmix64(stream ^ (np.uint64(offset + i) * _GOLDEN))
            u = np.float64(h >> np.uint64(11)) * (1.0 / 9007199254740992.0)
            keep = u < abs(f) * inv
            pos = keep and f > 0.0
            neg = keep and f < 0.0
            d = s if pos else (neg_s if neg else zero)
            if e_out is not None:
                e_out[i] = v - d
            nbad += (v - v) != zero
            byte |= ((3 if pos else (2 if neg else 0)) << (6 - 2 * j))
        out[k] = byte
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
# fp16: IEEE half on the wire
# ----------------------------------------------------------------------------
@njit(**_JIT)
def _pack_fp16_range(x, e_in, e_out, out, divisor, i0, i1):
    zero = x.dtype.type(0)
    dv = x.dtype.type(divisor)
    nbad = 0
    for i in range(i0, i1):
        v = x[i]
        if e_in is not None:
            v = v + e_in[i]
        h = _f32_to_f16_bits(np.float32(v / dv))
        out[i] = h
        if e_out is not None:
            e_out[i] = v - x.dtype.type(_f16_bits_to_f32(h)) * dv
        nbad += (v - v) != zero
    return nbad


@njit(parallel=True, **_JIT)
def _pack_fp16_par(x, e_in, e_out, out, divisor, nchunks):
    n = x.size
    per = (n + nchunks - 1) // nchunks
    nbad = 0
    for c in prange(nchunks):
        i0 = min(n, c * per)
        nbad += _pack_fp16_range(x, e_in, e_out, out, divisor, i0, min(n, i0 + per))
    return nbad


@njit(**_JIT)
def _unpack_fp16_range(payload, out, accumulate, i0, i1):
    if accumulate:
        for i in range(i0, i1):
            out[i] += _f16_bits_to_f32(payload[i])
    else:
        for i in range(i0, i1):
            out[i] = _f16_bits_to_f32(payload[i])


@njit(parallel=True, **_JIT)
def _unpack_fp16_par(payload, out, accumulate, nchunks):
    n = out.size
    per = (n + nchunks - 1) // nchunks
    for c in prange(nchunks):
        i0 = min(n, c * per)
        _unpack_fp16_range(payload, out, accumulate, i0, min(n, i0 + per))


def pack_fp16(x, e_in, e_out, out, divisor):
    """``out`` (uint16 bits of binary16) = half(float32((x + e_in) / divisor)).

    The residual is ``v - half * divisor``. Returns the non-finite count.
    """
    nch = _nchunks(x.size)
    if nch == 1:
        return int(_pack_fp16_range(x, e_in, e_out, out, float(divisor), 0, x.size))
    return int(_pack_fp16_par(x, e_in, e_out, out, float(divisor), nch))


def unpack_fp16(payload, out, accumulate):
    """Decode ``out.size`` binary16 values (uint16 bits) into ``out``."""
    nch = _nchunks(out.size)
    if nch == 1:
        _unpack_fp16_range(payload, out, bool(accumulate), 0, out.size)
    else:
        _unpack_fp16_par(payload, out, bool(accumulate), nch)


# ----------------------------------------------------------------------------
@njit(**_JIT)
def _count_nonfinite_range(x, i0, i1):
    zero = x.dtype.type(0)
    nbad = 0
    for i in range(i0, i1):
        v = x[i]
        nbad += (v - v) != zero
    return nbad


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
