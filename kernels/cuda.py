"""Numba CUDA kernels: the device twins of ``mpigc.kernels.cpu``.

Every public function here has the name and the positional signature of its
sibling in :mod:`mpigc.kernels.cpu` (plus a keyword-only ``cuda_stream``) and the
same conventions (``e_in`` / ``e_out`` error feedback, ``None`` for no
residual, ``pack_*`` return the non-finite count). A kernel itself never
receives ``None``: an absent residual is launched as an empty device array
plus a flag (``has_e_in``, ``has_e_out``), see :func:`_launch`. Arrays are
CUDA device arrays: anything with ``__cuda_array_interface__`` (CuPy, CUDA torch tensors,
Numba device arrays); host ``numpy`` arrays are refused rather than silently
copied.

Bit-identity with the CPU kernels
---------------------------------
- ``2bit`` (both modes), ``1bit``, ``fp16``, ``bf16``, ``terngrad`` (same ``stream``,
  ``scale`` and ``clip``): packed bytes, block means or thresholds and
  residuals are bit-identical for finite inputs. The 1bit block sums follow the canonical order of
  ``kernels/cpu.py`` (32 lanes strided by 32, sequential float64, then the
  pairwise tree s = 16, 8, 4, 2, 1): one warp per block, the tree in shared
  memory. The relative 2bit block sums of squares, and the sums of |v| over
  the selected values, follow the same order (squares by ``mul.rn``, never
  fused into the sum). float16 uses the same integer conversion as the CPU kernels (not
  the hardware ``cvt``, whose NaN payload differs); bfloat16 likewise (integer
  round to nearest even, NaN as ``0x7FC0`` with its sign). A product followed by a
  sum or difference (the fp16 and bf16 residual ``v - wire * divisor``) uses
  ``mul.rn`` (libdevice ``__fmul_rn`` / ``__dmul_rn``) so that neither NVVM
  nor ptxas contracts it into an fma, which rounds once where the CPU
  rounds twice.
- ``stats``: ``max |v|`` and the non-finite count are exact; the float64 sum
  and sum of squares are summed in a different order (per thread, then a
  tree per CUDA block, then the blocks in order on the host), deterministic
  for a given device. TernGrad with ``clip`` derives its clip bound from them,
  so in rare last-bit cases the bound (and then a code) can differ from the
  CPU's. Without ``clip`` the scale is ``max |v|``: exact.

Execution
---------
Nothing happens at import: no CUDA context, no compilation. Kernels compile
on first launch. Launch geometry: integer ceil-division of the work by the
block size, capped at a multiple of the SM count; every kernel loops
grid-stride. No ``fastmath``. Kernels run on ``cuda_stream`` (default: the
default stream). Functions that return a value (counts, stats) synchronise on it;
``unpack_*`` do not: synchronise the stream before MPI reads ``out``.
"""
import math

import numpy as np
from numba import cuda

from .cpu import ternary_stream  # the host-side stream hash (pure Python), shared

try:  # numba-cuda
    from numba.cuda.core import config as _config
except ImportError:  # pragma: no cover - numba's bundled CUDA target
    from numba.core import config as _config

__all__ = [
    "pack_2bit", "unpack_2bit",
    "pack_1bit", "unpack_1bit",
    "pack_2bit_rel", "unpack_2bit_rel",
    "stats", "pack_ternary",
    "pack_fp16", "unpack_fp16",
    "pack_bf16", "unpack_bf16",
    "count_nonfinite", "ternary_stream",
    "PARALLEL_MIN_ELEMENTS",
]

#: Whether Numba's CUDA simulator runs these kernels (NUMBA_ENABLE_CUDASIM=1).
SIMULATOR = bool(getattr(_config, "ENABLE_CUDASIM", 0))

#: Kept for symmetry with the CPU module (the dispatch layer may read it);
#: the device kernels are always parallel.
PARALLEL_MIN_ELEMENTS = 0

LANES = 32  # canonical summation order of the 1bit block sums (see kernels/cpu.py)

# Geometry. The simulator runs every thread as a Python thread: small blocks
# and a tiny grid there, which also makes the grid-stride loops do several
# rounds in the tests.
THREADS = 64 if SIMULATOR else 256          # threads per CUDA block (power of 2)
WARPS = THREADS // LANES                    # 1bit: one warp per quantization block
_BLOCKS_PER_SM = 32
_SIM_MAX_BLOCKS = 3
_max_blocks_cache = {}


def _max_blocks():
    """Grid cap: a multiple of the current device's SM count."""
    if SIMULATOR:
        return _SIM_MAX_BLOCKS
    dev = cuda.get_current_device()
    cap = _max_blocks_cache.get(dev.id)
    if cap is None:
        cap = _max_blocks_cache[dev.id] = dev.MULTIPROCESSOR_COUNT * _BLOCKS_PER_SM
    return cap


def _grid(work, per_block=THREADS):
    """Number of CUDA blocks for ``work`` items, ``per_block`` per block."""
    return max(1, min((work + per_block - 1) // per_block, _max_blocks()))


def _dev(a, what):
    """``a`` as a Numba device array (no copy); ``None`` stays ``None``."""
    if a is None:
        return None
    if getattr(a, "__cuda_ndarray__", False):  # Numba's (or the simulator's) own
        return a
    if isinstance(a, np.ndarray) or not hasattr(a, "__cuda_array_interface__"):
        raise TypeError(f"{what}: expected a CUDA device array, got {type(a).__name__}")
    return cuda.as_cuda_array(a)


def _opt(a, like):
    """An optional kernel input as the launch takes it: ``(array, True)``, or,
    for ``None``, ``(empty array of like's dtype, False)``. A real launch
    rejects ``None`` (numba-cuda's dispatcher raises ``NotImplementedError``),
    so a kernel never sees it: the flag says whether the array is there."""
    if a is None:
        return cuda.device_array(0, like.dtype), False
    return a, True


def _launch(kernel, blocks, stream, *args):
    """Launch ``kernel`` on ``blocks`` CUDA blocks of ``THREADS`` threads.

    Every launch of this module goes through here, with device arrays and
    numeric scalars only (no ``None``, no host arrays): what a real launch
    accepts. The simulator tests wrap this function to check that contract and
    to record the argument types that ``tests/test_cuda_sim.py`` compiles to
    PTX."""
    kernel[blocks, THREADS, stream](*args)


def _counter(stream):
    return cuda.to_device(np.zeros(1, np.int64), stream=stream)


def _read_count(counter, stream):
    host = counter.copy_to_host(stream=stream)
    if stream:
        stream.synchronize()
    return int(host[0])


# ----------------------------------------------------------------------------
# products that are never contracted into an fma (ptxas fuses a plain mul.f32
# and a following add/sub by default; the CPU kernels round both)
# ----------------------------------------------------------------------------
if SIMULATOR:
    @cuda.jit(device=True)
    def _fmul_rn(a, b):
        return a * b

    _dmul_rn = _fmul_rn
else:
    from numba.cuda import libdevice as _libdevice

    @cuda.jit(device=True)
    def _fmul_rn(a, b):
        return _libdevice.fmul_rn(a, b)

    @cuda.jit(device=True)
    def _dmul_rn(a, b):
        return _libdevice.dmul_rn(a, b)


# ----------------------------------------------------------------------------
# float16 <-> float32 (the CPU kernels' integer conversion, bit for bit)
# ----------------------------------------------------------------------------
@cuda.jit(device=True)
def _f32_to_f16_bits(f):
    """float32 -> IEEE binary16 bits, round to nearest even (as numpy)."""
    u = f.view(np.uint32)
    sign = np.uint32((u >> np.uint32(16)) & np.uint32(0x8000))
    u = np.uint32(u & np.uint32(0x7FFFFFFF))
    if u >= np.uint32(0x47800000):  # >= 65536: inf, or NaN
        o = np.uint32(0x7E00) if u > np.uint32(0x7F800000) else np.uint32(0x7C00)
    elif u < np.uint32(0x38800000):  # below the smallest normal half: subnormal
        magic = np.uint32(0x3F000000)  # 0.5f: aligns the mantissa for rounding
        s = u.view(np.float32) + magic.view(np.float32)
        o = np.uint32(s.view(np.uint32) - magic)
    else:
        odd = np.uint32((u >> np.uint32(13)) & np.uint32(1))
        # u + 0xC8000FFF + odd modulo 2**32 (rebias, round half even), written
        # without the wrap-around: u >= 0x38800000 here
        u = np.uint32(u - np.uint32(0x37FFF001))
        u = np.uint32(u + odd)
        o = np.uint32(u >> np.uint32(13))
    return np.uint16(o | sign)


@cuda.jit(device=True)
def _f16_bits_to_f32(h):
    """IEEE binary16 bits -> float32 (exact)."""
    h = np.uint32(h)
    u = np.uint32((h & np.uint32(0x7FFF)) << np.uint32(13))
    exp = np.uint32(u & np.uint32(0x0F800000))
    u = np.uint32(u + np.uint32(0x38000000))  # (127 - 15) << 23
    if exp == np.uint32(0x0F800000):  # inf / NaN
        f = np.uint32(u + np.uint32(0x38000000)).view(np.float32)
    elif exp == np.uint32(0):  # zero / subnormal
        f = (np.uint32(u + np.uint32(0x00800000)).view(np.float32)
             - np.uint32(0x38800000).view(np.float32))
    else:
        f = u.view(np.float32)
    sign = np.uint32((h & np.uint32(0x8000)) << np.uint32(16))
    return np.uint32(f.view(np.uint32) | sign).view(np.float32)


# ----------------------------------------------------------------------------
# 2bit (MXNet layout): one thread per output byte, 4 consecutive values
# ----------------------------------------------------------------------------
@cuda.jit
def _pack_2bit_kernel(x, e_in, has_e_in, e_out, has_e_out, out, t, nbad_out):
    n = x.size
    neg_t = -t
    zero = t - t
    nbad = 0
    for k in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        byte = 0
        for j in range(min(4, n - 4 * k)):
            i = 4 * k + j
            v = x[i]
            if has_e_in:
                v = v + e_in[i]
            pos = v >= t
            neg = v <= neg_t
            d = t if pos else (neg_t if neg else zero)
            if has_e_out:
                e_out[i] = v - d
            nbad += (v - v) != zero
            byte |= ((3 if pos else (2 if neg else 0)) << (6 - 2 * j))
        out[k] = byte
    if nbad:
        cuda.atomic.add(nbad_out, 0, nbad)


@cuda.jit
def _unpack_2bit_kernel(payload, out, t, accumulate):
    neg_t = -t
    zero = t - t
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        c = (payload[i >> 2] >> (6 - 2 * (i & 3))) & 3
        d = t if c == 3 else (neg_t if c == 2 else zero)
        if accumulate:
            out[i] += d
        else:
            out[i] = d


def pack_2bit(x, e_in, e_out, out, threshold, *, cuda_stream=0):
    """Quantize ``x + e_in`` to 2-bit codes (MXNet layout) into ``out``.

    ``out`` is uint8 of ``ceil(n / 4)`` bytes. Returns the non-finite count.
    """
    x, e_in, e_out, out = (_dev(x, "x"), _dev(e_in, "e_in"), _dev(e_out, "e_out"),
                           _dev(out, "out"))
    t = x.dtype.type(threshold)
    cnt = _counter(cuda_stream)
    if out.size:
        _launch(_pack_2bit_kernel, _grid(out.size), cuda_stream,
                x, *_opt(e_in, x), *_opt(e_out, x), out, t, cnt)
    return _read_count(cnt, cuda_stream)


def unpack_2bit(payload, out, threshold, accumulate, *, cuda_stream=0):
    """Decode ``out.size`` 2-bit codes: ``11`` -> +t, ``10`` -> -t, else 0.

    Writes into ``out``, or adds to it when ``accumulate`` is true.
    Asynchronous on ``cuda_stream``.
    """
    payload, out = _dev(payload, "payload"), _dev(out, "out")
    t = out.dtype.type(threshold)
    if out.size:
        _launch(_unpack_2bit_kernel, _grid(out.size), cuda_stream,
                payload, out, t, bool(accumulate))


# ----------------------------------------------------------------------------
# 1bit (Seide et al.): one warp per quantization block
# ----------------------------------------------------------------------------
@cuda.jit
def _pack_1bit_kernel(x, e_in, has_e_in, e_out, has_e_out, bits, means, block, nbad_out):
    sp = cuda.shared.array((WARPS, LANES), np.float64)
    sn = cuda.shared.array((WARPS, LANES), np.float64)
    cp = cuda.shared.array((WARPS, LANES), np.int64)
    sbad = cuda.shared.array((WARPS, LANES), np.int64)
    n = x.size
    nblk = means.size // 2
    zero = x.dtype.type(0)
    w = cuda.threadIdx.x // LANES
    lane = cuda.threadIdx.x % LANES
    nbad = 0
    # the trip count is the same for every warp of a CUDA block (syncthreads)
    for kk in range(cuda.blockIdx.x * WARPS, nblk, cuda.gridDim.x * WARPS):
        k = kk + w
        active = k < nblk
        lo = k * block
        hi = min(n, lo + block)
        if active:
            # pass 1: lane l sums elements lo+l, lo+l+32, ... sequentially
            a = 0.0
            b = 0.0
            c = 0
            for i in range(lo + lane, hi, LANES):
                v = x[i]
                if has_e_in:
                    v = v + e_in[i]
                p = v >= zero
                f = np.float64(v)
                a += f if p else 0.0
                b += 0.0 if p else f
                c += p
            sp[w, lane] = a
            sn[w, lane] = b
            cp[w, lane] = c
        cuda.syncthreads()
        s = LANES // 2
        while s > 0:  # the canonical pairwise tree: sum[l] += sum[l + s]
            if active and lane < s:
                sp[w, lane] += sp[w, lane + s]
                sn[w, lane] += sn[w, lane + s]
                cp[w, lane] += cp[w, lane + s]
            cuda.syncthreads()
            s //= 2
        m0 = np.float32(0.0)
        m1 = np.float32(0.0)
        if active:
            npos = cp[w, 0]
            nneg = (hi - lo) - npos
            m1 = np.float32(sp[w, 0] / npos) if npos > 0 else np.float32(0.0)
            m0 = np.float32(sn[w, 0] / nneg) if nneg > 0 else np.float32(0.0)
            if lane == 0:
                means[2 * k] = m0
                means[2 * k + 1] = m1
            d1 = x.dtype.type(m1)
            d0 = x.dtype.type(m0)
            kbad = 0
            # pass 2: one lane per byte (the block was just read: in cache)
            for bb in range(lo // 8 + lane, (hi + 7) // 8, LANES):
                byte = 0
                for j in range(min(8, hi - 8 * bb)):
                    i = 8 * bb + j
                    v = x[i]
                    if has_e_in:
                        v = v + e_in[i]
                    p = v >= zero
                    if has_e_out:
                        e_out[i] = v - (d1 if p else d0)
                    kbad += (v - v) != zero
                    byte |= (1 if p else 0) << (7 - j)
                bits[bb] = byte
            sbad[w, lane] = kbad
        cuda.syncthreads()
        if active and lane == 0:
            tot = 0
            for l in range(LANES):
                tot += sbad[w, l]
            # finite values whose mean is beyond float32: each such mean is
            # one bad value
            if tot == 0:
                tot = (0 if math.isfinite(m0) else 1) + (0 if math.isfinite(m1) else 1)
            nbad += tot
        cuda.syncthreads()  # the next round overwrites sp, sn, cp, sbad
    if nbad:
        cuda.atomic.add(nbad_out, 0, nbad)


@cuda.jit
def _unpack_1bit_kernel(bits, means, out, block, accumulate):
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        bit = np.int64((bits[i >> 3] >> (7 - (i & 7))) & 1)
        d = out.dtype.type(means[2 * (i // block) + bit])
        if accumulate:
            out[i] += d
        else:
            out[i] = d


def pack_1bit(x, e_in, e_out, bits, means, block_size, *, cuda_stream=0):
    """Sign bits of ``x + e_in`` into ``bits`` (uint8, ``ceil(n/8)``) and the
    per-block reconstruction pairs into ``means`` (float32, 2 per block).

    ``block_size`` must be a multiple of 8. Returns the non-finite count.
    """
    x, e_in, e_out = _dev(x, "x"), _dev(e_in, "e_in"), _dev(e_out, "e_out")
    bits, means = _dev(bits, "bits"), _dev(means, "means")
    nblk = means.size // 2
    cnt = _counter(cuda_stream)
    if nblk:
        _launch(_pack_1bit_kernel, _grid(nblk, WARPS), cuda_stream,
                x, *_opt(e_in, x), *_opt(e_out, x), bits, means, int(block_size), cnt)
    return _read_count(cnt, cuda_stream)


def unpack_1bit(bits, means, out, block_size, accumulate, *, cuda_stream=0):
    """Decode ``out.size`` 1-bit values with their block pairs (asynchronous)."""
    bits, means, out = _dev(bits, "bits"), _dev(means, "means"), _dev(out, "out")
    if out.size:
        _launch(_unpack_1bit_kernel, _grid(out.size), cuda_stream,
                bits, means, out, int(block_size), bool(accumulate))


# ----------------------------------------------------------------------------
# 2bit, relative mode: one warp per quantization block (as 1bit)
# ----------------------------------------------------------------------------
@cuda.jit
def _pack_2bit_rel_kernel(x, e_in, has_e_in, e_out, has_e_out, out, scales, rel, block,
                          nbad_out):
    sq = cuda.shared.array((WARPS, LANES), np.float64)
    sa = cuda.shared.array((WARPS, LANES), np.float64)
    scnt = cuda.shared.array((WARPS, LANES), np.int64)
    sbad = cuda.shared.array((WARPS, LANES), np.int64)
    n = x.size
    nblk = scales.size
    zero = x.dtype.type(0)
    nan = x.dtype.type(np.nan)
    w = cuda.threadIdx.x // LANES
    lane = cuda.threadIdx.x % LANES
    nbad = 0
    # the trip count is the same for every warp of a CUDA block (syncthreads)
    for kk in range(cuda.blockIdx.x * WARPS, nblk, cuda.gridDim.x * WARPS):
        k = kk + w
        active = k < nblk
        lo = k * block
        hi = min(n, lo + block)
        if active:
            # pass 1: lane l sums the squares of lo+l, lo+l+32, ... in order
            a = 0.0
            for i in range(lo + lane, hi, LANES):
                v = x[i]
                if has_e_in:
                    v = v + e_in[i]
                f = np.float64(v)
                a += _dmul_rn(f, f)
            sq[w, lane] = a
        cuda.syncthreads()
        s = LANES // 2
        while s > 0:  # the canonical pairwise tree: sum[l] += sum[l + s]
            if active and lane < s:
                sq[w, lane] += sq[w, lane + s]
            cuda.syncthreads()
            s //= 2
        kbad = 0
        t32 = np.float32(0.0)
        tc = nan
        if active:
            t32 = np.float32(_dmul_rn(rel, math.sqrt(sq[w, 0] / (hi - lo))))
            if t32 > np.float32(0.0):
                tc = x.dtype.type(t32)  # else (t_b = 0 or NaN) nothing selected
            neg_tc = -tc
            # pass 2: lane l sums |v| of the selected lo+l, lo+l+32, ... in order
            a = 0.0
            c = 0
            for i in range(lo + lane, hi, LANES):
                v = x[i]
                if has_e_in:
                    v = v + e_in[i]
                sel = (v >= tc) or (v <= neg_tc)
                a += abs(np.float64(v)) if sel else 0.0
                c += 1 if sel else 0
            sa[w, lane] = a
            scnt[w, lane] = c
        cuda.syncthreads()
        s = LANES // 2
        while s > 0:  # the same tree
            if active and lane < s:
                sa[w, lane] += sa[w, lane + s]
                scnt[w, lane] += scnt[w, lane + s]
            cuda.syncthreads()
            s //= 2
        r32 = np.float32(0.0)
        if active:
            cnt = scnt[w, 0]
            if cnt > 0:
                r32 = np.float32(sa[w, 0] / cnt)  # the mean magnitude r_b
            if lane == 0:
                scales[k] = r32
            td = x.dtype.type(r32)
            neg_td = -td
            neg_tc = -tc
            # pass 3: one lane per byte (the block was just read: in cache)
            for bb in range(lo // 4 + lane, (hi + 3) // 4, LANES):
                byte = 0
                for j in range(min(4, hi - 4 * bb)):
                    i = 4 * bb + j
                    v = x[i]
                    if has_e_in:
                        v = v + e_in[i]
                    pos = v >= tc
                    neg = v <= neg_tc
                    d = td if pos else (neg_td if neg else zero)
                    if has_e_out:
                        e_out[i] = v - d
                    kbad += (v - v) != zero
                    byte |= ((3 if pos else (2 if neg else 0)) << (6 - 2 * j))
                out[bb] = byte
            sbad[w, lane] = kbad
        cuda.syncthreads()
        if active and lane == 0:
            tot = 0
            for l in range(LANES):
                tot += sbad[w, l]
            # finite values whose threshold or mean magnitude is not
            # finite: one bad value
            if tot == 0 and not (math.isfinite(t32) and math.isfinite(r32)):
                tot = 1
            nbad += tot
        cuda.syncthreads()  # the next round overwrites sq, sa, scnt, sbad
    if nbad:
        cuda.atomic.add(nbad_out, 0, nbad)


@cuda.jit
def _unpack_2bit_rel_kernel(payload, scales, out, block, accumulate):
    zero = out.dtype.type(0)
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        c = (payload[i >> 2] >> (6 - 2 * (i & 3))) & 3
        t = out.dtype.type(scales[i // block])
        d = t if c == 3 else (-t if c == 2 else zero)
        if accumulate:
            out[i] += d
        else:
            out[i] = d


def pack_2bit_rel(x, e_in, e_out, out, scales, rel_threshold, block_size, *,
                  cuda_stream=0):
    """2bit codes of ``v = x + e_in`` with one threshold per block into ``out``
    (uint8, ``ceil(n / 4)``) and the selected values' mean magnitudes r_b
    into ``scales`` (float32, one per block): as
    ``kernels.cpu.pack_2bit_rel``, bit for bit.

    ``block_size`` must be a multiple of 4. Returns the non-finite count.
    """
    x, e_in, e_out = _dev(x, "x"), _dev(e_in, "e_in"), _dev(e_out, "e_out")
    out, scales = _dev(out, "out"), _dev(scales, "scales")
    nblk = scales.size
    cnt = _counter(cuda_stream)
    if nblk:
        _launch(_pack_2bit_rel_kernel, _grid(nblk, WARPS), cuda_stream,
                x, *_opt(e_in, x), *_opt(e_out, x), out, scales, float(rel_threshold),
                int(block_size), cnt)
    return _read_count(cnt, cuda_stream)


def unpack_2bit_rel(payload, scales, out, block_size, accumulate, *, cuda_stream=0):
    """Decode ``out.size`` 2bit codes with their block magnitudes r_b
    (asynchronous)."""
    payload, scales, out = _dev(payload, "payload"), _dev(scales, "scales"), _dev(out, "out")
    if out.size:
        _launch(_unpack_2bit_rel_kernel, _grid(out.size), cuda_stream,
                payload, scales, out, int(block_size), bool(accumulate))


# ----------------------------------------------------------------------------
# terngrad: statistics (two-level reduction), then stochastic ternary codes
# ----------------------------------------------------------------------------
@cuda.jit
def _stats_kernel(x, e_in, has_e_in, partial):
    ssum = cuda.shared.array(THREADS, np.float64)
    ssq = cuda.shared.array(THREADS, np.float64)
    smax = cuda.shared.array(THREADS, np.float64)
    sbad = cuda.shared.array(THREADS, np.int64)
    s = 0.0
    ss = 0.0
    amax = 0.0
    nbad = 0
    for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
        v = x[i]
        if has_e_in:
            v = v + e_in[i]
        f = np.float64(v)
        s += f
        ss += _dmul_rn(f, f)
        a = abs(f)
        amax = a if a > amax else amax
        nbad += (f - f) != 0.0
    t = cuda.threadIdx.x
    ssum[t] = s
    ssq[t] = ss
    smax[t] = amax
    sbad[t] = nbad
    cuda.syncthreads()
    h = THREADS // 2
    while h > 0:
        if t < h:
            ssum[t] += ssum[t + h]
            ssq[t] += ssq[t + h]
            m = smax[t + h]
            smax[t] = m if m > smax[t] else smax[t]
            sbad[t] += sbad[t + h]
        cuda.syncthreads()
        h //= 2
    if t == 0:
        b = cuda.blockIdx.x
        partial[b, 0] = ssum[0]
        partial[b, 1] = ssq[0]
        partial[b, 2] = smax[0]
        partial[b, 3] = np.float64(sbad[0])


def stats(x, e_in, *, cuda_stream=0):
    """Return ``(sum, sum of squares, max |v|, non-finite count)`` of
    ``v = x + e_in``, accumulated in float64 (summation order: see the module
    docstring)."""
    x, e_in = _dev(x, "x"), _dev(e_in, "e_in")
    if x.size == 0:
        return 0.0, 0.0, 0.0, 0
    nb = _grid(x.size)
    partial = cuda.device_array((nb, 4), np.float64, stream=cuda_stream)
    _launch(_stats_kernel, nb, cuda_stream, x, *_opt(e_in, x), partial)
    p = partial.copy_to_host(stream=cuda_stream)
    if cuda_stream:
        cuda_stream.synchronize()
    s = 0.0
    ss = 0.0
    for b in range(nb):  # fixed order: deterministic for a given grid
        s += float(p[b, 0])
        ss += float(p[b, 1])
    return s, ss, float(p[:, 2].max()), int(p[:, 3].sum())


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


@cuda.jit(device=True)
def _splitmix64(z):
    z = np.uint64(z + np.uint64(0x9E3779B97F4A7C15))
    z = np.uint64((z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9))
    z = np.uint64((z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB))
    return np.uint64(z ^ (z >> np.uint64(31)))


@cuda.jit
def _pack_ternary_kernel(x, e_in, has_e_in, e_out, has_e_out, out, s, scale, clip, stream_id,
                         offset, nbad_out):
    n = x.size
    neg_s = -s
    zero = s - s
    nbad = 0
    for k in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        byte = 0
        for j in range(min(4, n - 4 * k)):
            i = 4 * k + j
            v = x[i]
            if has_e_in:
                v = v + e_in[i]
            f = min(max(np.float64(v), -clip), clip)
            ctr = np.uint64(offset + np.uint64(i))
            h = _splitmix64(stream_id ^ np.uint64(ctr * np.uint64(0x9E3779B97F4A7C15)))
            u = np.float64(h >> np.uint64(11)) * (1.0 / 9007199254740992.0)
            keep = scale > 0.0 and u < abs(f) / scale
            pos = keep and f > 0.0
            neg = keep and f < 0.0
            d = s if pos else (neg_s if neg else zero)
            if has_e_out:
                e_out[i] = v - d
            nbad += (v - v) != zero
            byte |= ((3 if pos else (2 if neg else 0)) << (6 - 2 * j))
        out[k] = byte
    if nbad:
        cuda.atomic.add(nbad_out, 0, nbad)


def pack_ternary(x, e_in, e_out, out, scale, clip, stream, offset, *, cuda_stream=0):
    """TernGrad codes of ``v = clip(x + e_in)`` in the 2bit layout.

    As ``kernels.cpu.pack_ternary``: ``stream`` is the RNG stream id (see
    :func:`ternary_stream`), ``offset`` the global index of ``x[0]``.
    Returns the non-finite count.
    """
    x, e_in, e_out, out = (_dev(x, "x"), _dev(e_in, "e_in"), _dev(e_out, "e_out"),
                           _dev(out, "out"))
    scale = float(np.float32(scale))
    s = x.dtype.type(scale)
    cnt = _counter(cuda_stream)
    if out.size:
        _launch(_pack_ternary_kernel, _grid(out.size), cuda_stream,
                x, *_opt(e_in, x), *_opt(e_out, x), out, s, scale, float(clip),
                np.uint64(stream), np.uint64(offset), cnt)
    return _read_count(cnt, cuda_stream)


# ----------------------------------------------------------------------------
# fp16: IEEE half on the wire, one thread per element
# ----------------------------------------------------------------------------
def _make_pack_fp16_kernel(mul_rn):
    """The fp16 pack kernel for one work dtype (``mul_rn`` of that dtype)."""
    @cuda.jit
    def kernel(x, e_in, has_e_in, e_out, has_e_out, out, dv, nbad_out):
        zero = dv - dv
        nbad = 0
        for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
            v = x[i]
            if has_e_in:
                v = v + e_in[i]
            h = _f32_to_f16_bits(np.float32(v / dv))
            out[i] = h
            if has_e_out:
                e_out[i] = v - mul_rn(x.dtype.type(_f16_bits_to_f32(h)), dv)
            # a value beyond the half range is as bad as a non-finite one
            nbad += ((v - v) != zero) or ((h & 0x7C00) == 0x7C00)
        if nbad:
            cuda.atomic.add(nbad_out, 0, nbad)
    return kernel


_pack_fp16_kernel_f32 = _make_pack_fp16_kernel(_fmul_rn)
_pack_fp16_kernel_f64 = _make_pack_fp16_kernel(_dmul_rn)


@cuda.jit
def _unpack_fp16_kernel(payload, out, accumulate):
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        if accumulate:
            out[i] += _f16_bits_to_f32(payload[i])
        else:
            out[i] = _f16_bits_to_f32(payload[i])


def pack_fp16(x, e_in, e_out, out, divisor, *, cuda_stream=0):
    """``out`` (uint16 bits of binary16) = half(float32((x + e_in) / divisor)).

    The residual is ``v - half * divisor``. Returns the non-finite count.
    """
    x, e_in, e_out, out = (_dev(x, "x"), _dev(e_in, "e_in"), _dev(e_out, "e_out"),
                           _dev(out, "out"))
    dv = x.dtype.type(divisor)
    cnt = _counter(cuda_stream)
    if x.size:
        kernel = (_pack_fp16_kernel_f64 if x.dtype == np.float64
                  else _pack_fp16_kernel_f32)
        _launch(kernel, _grid(x.size), cuda_stream,
                x, *_opt(e_in, x), *_opt(e_out, x), out, dv, cnt)
    return _read_count(cnt, cuda_stream)


def unpack_fp16(payload, out, accumulate, *, cuda_stream=0):
    """Decode ``out.size`` binary16 values (uint16 bits) into ``out``
    (asynchronous)."""
    payload, out = _dev(payload, "payload"), _dev(out, "out")
    if out.size:
        _launch(_unpack_fp16_kernel, _grid(out.size), cuda_stream,
                payload, out, bool(accumulate))


# ----------------------------------------------------------------------------
# bf16: bfloat16 on the wire, one thread per element
# ----------------------------------------------------------------------------
@cuda.jit(device=True)
def _f32_to_bf16_bits(f):
    """float32 -> bfloat16 bits, round to nearest even; NaN -> ``0x7FC0`` with
    its sign (the CPU kernels' conversion, bit for bit)."""
    u = f.view(np.uint32)
    if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):  # NaN
        o = np.uint32(((u >> np.uint32(16)) & np.uint32(0x8000)) | np.uint32(0x7FC0))
    else:  # u <= 0xFF800000: the sum does not wrap
        odd = np.uint32((u >> np.uint32(16)) & np.uint32(1))
        u = np.uint32(u + np.uint32(0x7FFF))
        u = np.uint32(u + odd)
        o = np.uint32(u >> np.uint32(16))
    return np.uint16(o)


@cuda.jit(device=True)
def _bf16_bits_to_f32(b):
    """bfloat16 bits -> float32 (exact)."""
    return np.uint32(np.uint32(b) << np.uint32(16)).view(np.float32)


def _make_pack_bf16_kernel(mul_rn):
    """The bf16 pack kernel for one work dtype (``mul_rn`` of that dtype)."""
    @cuda.jit
    def kernel(x, e_in, has_e_in, e_out, has_e_out, out, dv, nbad_out):
        zero = dv - dv
        nbad = 0
        for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
            v = x[i]
            if has_e_in:
                v = v + e_in[i]
            b = _f32_to_bf16_bits(np.float32(v / dv))
            out[i] = b
            if has_e_out:
                e_out[i] = v - mul_rn(x.dtype.type(_bf16_bits_to_f32(b)), dv)
            # a value beyond the bfloat16 range is as bad as a non-finite one
            nbad += ((v - v) != zero) or ((b & 0x7F80) == 0x7F80)
        if nbad:
            cuda.atomic.add(nbad_out, 0, nbad)
    return kernel


_pack_bf16_kernel_f32 = _make_pack_bf16_kernel(_fmul_rn)
_pack_bf16_kernel_f64 = _make_pack_bf16_kernel(_dmul_rn)


@cuda.jit
def _unpack_bf16_kernel(payload, out, accumulate):
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        if accumulate:
            out[i] += _bf16_bits_to_f32(payload[i])
        else:
            out[i] = _bf16_bits_to_f32(payload[i])


def pack_bf16(x, e_in, e_out, out, divisor, *, cuda_stream=0):
    """``out`` (uint16 bits of bfloat16) = bf16(float32((x + e_in) / divisor)).

    The residual is ``v - bf16 * divisor``. Returns the non-finite count.
    """
    x, e_in, e_out, out = (_dev(x, "x"), _dev(e_in, "e_in"), _dev(e_out, "e_out"),
                           _dev(out, "out"))
    dv = x.dtype.type(divisor)
    cnt = _counter(cuda_stream)
    if x.size:
        kernel = (_pack_bf16_kernel_f64 if x.dtype == np.float64
                  else _pack_bf16_kernel_f32)
        _launch(kernel, _grid(x.size), cuda_stream,
                x, *_opt(e_in, x), *_opt(e_out, x), out, dv, cnt)
    return _read_count(cnt, cuda_stream)


def unpack_bf16(payload, out, accumulate, *, cuda_stream=0):
    """Decode ``out.size`` bfloat16 values (uint16 bits) into ``out``
    (asynchronous)."""
    payload, out = _dev(payload, "payload"), _dev(out, "out")
    if out.size:
        _launch(_unpack_bf16_kernel, _grid(out.size), cuda_stream,
                payload, out, bool(accumulate))


# ----------------------------------------------------------------------------
@cuda.jit
def _count_nonfinite_kernel(x, nbad_out):
    zero = x.dtype.type(0)
    nbad = 0
    for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
        v = x[i]
        nbad += (v - v) != zero
    if nbad:
        cuda.atomic.add(nbad_out, 0, nbad)


def count_nonfinite(x, *, cuda_stream=0):
    """Number of NaN and infinite values in ``x``."""
    x = _dev(x, "x")
    cnt = _counter(cuda_stream)
    if x.size:
        _launch(_count_nonfinite_kernel, _grid(x.size), cuda_stream, x, cnt)
    return _read_count(cnt, cuda_stream)


# ----------------------------------------------------------------------------
# element-wise helpers of the collectives (float16 buffers, averaging); not
# in __all__ and not in kernels/cpu.py, where numpy does the same (astype,
# divide) bit for bit
# ----------------------------------------------------------------------------
@cuda.jit
def _f16_to_f32_kernel(src, dst):
    for i in range(cuda.grid(1), dst.size, cuda.gridsize(1)):
        dst[i] = _f16_bits_to_f32(src[i])


@cuda.jit
def _f32_to_f16_kernel(src, dst):
    for i in range(cuda.grid(1), dst.size, cuda.gridsize(1)):
        dst[i] = _f32_to_f16_bits(src[i])


@cuda.jit
def _convert_kernel(src, dst):
    for i in range(cuda.grid(1), dst.size, cuda.gridsize(1)):
        dst[i] = dst.dtype.type(src[i])


def convert(src, dst, *, cuda_stream=0):
    """``dst[:] = src`` converted to ``dst``'s dtype (float16, float32, float64),
    rounded as numpy's ``astype`` rounds (float16 through the CPU kernels'
    integer conversion: bit-identical to numpy except for NaN payloads).
    Asynchronous on ``cuda_stream``."""
    src, dst = _dev(src, "src"), _dev(dst, "dst")
    if src.size != dst.size:
        raise ValueError(f"convert: expected equal sizes, got {src.size} and {dst.size}")
    if dst.size == 0:
        return
    f16 = np.dtype(np.float16)
    if src.dtype == f16 and dst.dtype == f16:
        dst.copy_to_device(src, stream=cuda_stream)
        return
    if src.dtype == f16:
        if dst.dtype != np.float32:
            raise TypeError(f"convert: float16 converts to float32, not {dst.dtype}")
        _launch(_f16_to_f32_kernel, _grid(dst.size), cuda_stream, src.view(np.uint16), dst)
    elif dst.dtype == f16:
        if src.dtype != np.float32:
            raise TypeError(f"convert: float16 is made from float32, not {src.dtype}")
        _launch(_f32_to_f16_kernel, _grid(dst.size), cuda_stream, src, dst.view(np.uint16))
    elif src.dtype == dst.dtype:
        dst.copy_to_device(src, stream=cuda_stream)
    else:
        _launch(_convert_kernel, _grid(dst.size), cuda_stream, src, dst)


@cuda.jit
def _divide_kernel(a, d):
    for i in range(cuda.grid(1), a.size, cuda.gridsize(1)):
        a[i] = a[i] / d


def divide(a, divisor, *, cuda_stream=0):
    """``a /= divisor`` in ``a``'s dtype (float32 or float64; IEEE division, as
    ``numpy.divide(a, divisor, out=a)``). Asynchronous on ``cuda_stream``."""
    a = _dev(a, "a")
    if a.size:
        _launch(_divide_kernel, _grid(a.size), cuda_stream, a, a.dtype.type(divisor))
