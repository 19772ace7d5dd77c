"""Pure-numpy reference of every mpigc wire format and its error feedback.

Written from ``ALGORITHMS.md`` and the docstrings of ``mpigc.compressors``,
never by calling the library, so that the tests can hold the Numba kernels
to it bit for bit (and the golden fixtures can be rebuilt without them).

Every ``encode_*`` function takes ``x`` (1-D, float32 or float64: the work
dtype) and an optional residual ``e`` of the same dtype, and returns
``(payload, residual)``: the payload as ``bytes`` and the new residual
``v - decoded(v)`` with ``v = x + e`` (zeros of ``x``'s dtype when ``e`` is
None, so that callers can compare both ways). Every ``decode_*`` function
returns a new array of ``dtype``.

Conventions spelled out here (the contract):

* ``none``: the values of ``v`` as little-endian bytes; residual 0.
* ``fp16``: ``h = half(float32(v / divisor))`` (the division in ``v``'s
  dtype), little-endian binary16; residual ``v - dtype(h) * divisor``.
* ``bf16``: ``b = bf16(float32(v / divisor))``: the upper 16 bits of the
  float32 after rounding to nearest even (integer add of ``0x7FFF`` plus the
  kept part's lowest bit); a NaN becomes ``0x7FC0`` with its sign; little-endian
  uint16; residual ``v - dtype(b) * divisor`` (``b`` decoded exactly: its bits
  as the upper half of a float32).
* ``2bit``: ``v >= t`` -> ``11`` (+t), ``v <= -t`` -> ``10`` (-t), else
  ``00`` (0); element i in the bit pair ``(0xC0, 0x30, 0x0C, 0x03)[i % 4]`` of
  byte ``i // 4``, the tail padded with ``00``. ``t`` is cast to the array's
  dtype (for comparisons and for the decoded values).
* ``1bit``: bit 1 for ``v >= 0``, element i in bit ``0x80 >> (i % 8)`` of
  byte ``i // 8``; then per block the pair (mean of the bit-0 elements, mean
  of the bit-1 elements) as little-endian float32 (empty class -> 0). The
  class sums are float64 in the canonical order (32 lanes, lane l sums the
  block's elements l, l+32, ... sequentially, then the tree
  ``sum[l] += sum[l + s]`` for s = 16, 8, 4, 2, 1); ``mean =
  float32(sum / count)``. Residual ``v - dtype(mean of v's class)``.
* ``2bit`` relative mode (``rel_threshold=c``, ``block_size=B``): blocks of
  ``B`` elements from element 0 (the last may be shorter, ``m_b`` elements);
  ``t_b = float32(c * sqrt(ss_b / m_b))`` with ``ss_b`` the float64 sum of
  the squares ``float64(v)**2`` in the canonical order of the 1bit sums, each
  step (division, sqrt, product) in float64. Codes as ``2bit`` with
  ``dtype(t_b)``, except that a block with ``t_b == 0`` (or NaN) is all
  ``00``. Fallback: where ``t_b`` is finite and > 0 but no ``|v| >= dtype(t_b)``,
  the block's threshold is ``dtype(float64(M) / max(c, 1))`` (``M`` its
  largest ``|v|`` in the dtype; ``M`` itself should that round to 0), so the
  largest values are always selected. The selected values (codes ``11``/``10``) decode to their mean
  magnitude ``r_b = float32(A_b / count)``, ``A_b`` the float64 sum of their
  ``|v|`` in the same canonical order (0 for no selected value): ``11`` ->
  ``dtype(r_b)``, ``10`` -> ``-dtype(r_b)``; residual ``v - decoded``.
  Payload: the codes (``ceil(n / 4)`` bytes), then ``r_b`` per block as
  little-endian float32 (``t_b`` does not travel).
* ``terngrad``: 2bit codes, then the scale as little-endian float32. The
  uniform draw of global index ``g = offset + i`` is
  ``(splitmix64(stream ^ (g * 0x9E3779B97F4A7C15 mod 2**64)) >> 11) * 2**-53``;
  the element is kept if ``u < |clip(v)| / scale`` (float64, ``scale`` the
  float32 value that travels); ``11`` if kept and ``v > 0``, ``10`` if kept and
  ``v < 0``. Without a given scale, ``scale = max |clip(v)|``; with ``clip=c``
  the clip bound is ``c * std(v)`` (no clipping when std is 0) (population std from float64 sums
  accumulated sequentially).
"""
import math

import numpy as np

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15

#: where element i % 4 of a byte sits in the 2bit layout
MASKS_2BIT = (0xC0, 0x30, 0x0C, 0x03)
CODE_POS, CODE_NEG, CODE_ZERO = 3, 2, 0
LANES = 32


# ----------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------
def work_dtype(dtype):
    """float64 stays float64, float16 and float32 are computed in float32."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def _v(x, e):
    x = np.asarray(x)
    assert x.ndim == 1 and x.dtype in (np.float32, np.float64), x.dtype
    if e is None:
        return x.copy()
    e = np.asarray(e)
    assert e.dtype == x.dtype and e.shape == x.shape
    return x + e


def payload_nbytes(fmt, n, dtype=np.float32, block_size=1024):
    n = int(n)
    if fmt == "none":
        return n * np.dtype(dtype).itemsize
    if fmt in ("fp16", "bf16"):
        return 2 * n
    if fmt == "2bit":
        return -(-n // 4)
    if fmt == "2bit_rel":
        return -(-n // 4) + 4 * (-(-n // block_size))
    if fmt == "1bit":
        return -(-n // 8) + 8 * (-(-n // block_size))
    if fmt == "terngrad":
        return -(-n // 4) + 4 if n else 0
    raise ValueError(fmt)


def pack_codes(codes):
    """2-bit codes (values 0..3) -> bytes, MXNet layout."""
    codes = np.asarray(codes, dtype=np.uint8)
    n = codes.size
    out = np.zeros(-(-n // 4), np.uint8)
    for j, mask in enumerate(MASKS_2BIT):
        # code * (mask // 3) puts the two bits of the code under ``mask``
        out[: codes[j::4].size] |= codes[j::4] * np.uint8(mask // 3)
    return out.tobytes()


def unpack_codes(payload, n):
    """bytes -> ``n`` 2-bit codes, MXNet layout."""
    b = np.frombuffer(bytes(payload), np.uint8)
    i = np.arange(n)
    masks = np.array(MASKS_2BIT, np.uint8)[i % 4]
    return ((b[i // 4] & masks) // (masks // 3)).astype(np.uint8)


def pack_bits(bits):
    """Booleans -> bytes, MSB first: element i in bit ``0x80 >> (i % 8)``."""
    bits = np.asarray(bits, dtype=bool)
    out = np.zeros(-(-bits.size // 8), np.uint8)
    for j in range(8):
        sel = bits[j::8]
        out[: sel.size] |= np.where(sel, np.uint8(0x80 >> j), np.uint8(0))
    return out.tobytes()


def unpack_bits(payload, n):
    b = np.frombuffer(bytes(payload), np.uint8)
    i = np.arange(n)
    return (b[i // 8] & (0x80 >> (i % 8)).astype(np.uint8)) != 0


def _codes_to_values(codes, t, dtype):
    dt = np.dtype(dtype)
    tt = dt.type(t)
    return np.where(codes == CODE_POS, tt,
                    np.where(codes == CODE_NEG, -tt, dt.type(0))).astype(dt)


# ----------------------------------------------------------------------------
# none
# ----------------------------------------------------------------------------
def encode_none(x, e=None):
    v = _v(x, e)
    return v.astype(v.dtype.newbyteorder("<")).tobytes(), np.zeros_like(v)


def decode_none(payload, n, dtype=np.float32):
    dt = np.dtype(dtype)
    return np.frombuffer(bytes(payload), dt.newbyteorder("<"), count=n).astype(dt)


# ----------------------------------------------------------------------------
# fp16
# ----------------------------------------------------------------------------
def encode_fp16(x, e=None, divisor=1.0):
    v = _v(x, e)
    dt = v.dtype
    dv = dt.type(divisor)
    with np.errstate(over="ignore", invalid="ignore"):  # overflow -> inf, as IEEE
        h = (v / dv).astype(np.float32).astype(np.float16)
        residual = v - h.astype(dt) * dv
    return h.astype("<f2").tobytes(), residual


def decode_fp16(payload, n, dtype=np.float32):
    return np.frombuffer(bytes(payload), "<f2", count=n).astype(dtype)


# ----------------------------------------------------------------------------
# bf16
# ----------------------------------------------------------------------------
def f32_to_bf16_bits(f):
    """float32 array -> uint16 bfloat16 bits (round to nearest even; NaN ->
    0x7FC0 with its sign)."""
    u = np.asarray(f, np.float32).view(np.uint32).astype(np.uint64)
    b = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    b[nan] = ((u[nan] >> 16) & 0x8000).astype(np.uint16) | np.uint16(0x7FC0)
    return b


def bf16_bits_to_f32(b):
    """uint16 bfloat16 bits -> float32 (exact)."""
    return (np.asarray(b, np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def encode_bf16(x, e=None, divisor=1.0):
    v = _v(x, e)
    dt = v.dtype
    dv = dt.type(divisor)
    with np.errstate(over="ignore", invalid="ignore"):  # overflow -> inf, as IEEE
        b = f32_to_bf16_bits((v / dv).astype(np.float32))
        residual = v - bf16_bits_to_f32(b).astype(dt) * dv
    return b.astype("<u2").tobytes(), residual


def decode_bf16(payload, n, dtype=np.float32):
    b = np.frombuffer(bytes(payload), "<u2", count=n)
    return bf16_bits_to_f32(b).astype(dtype)


# ----------------------------------------------------------------------------
# 2bit
# ----------------------------------------------------------------------------
def encode_2bit(x, t, e=None):
    v = _v(x, e)
    dt = v.dtype
    tt = dt.type(t)
    codes = np.full(v.size, CODE_ZERO, np.uint8)
    codes[v >= tt] = CODE_POS
    codes[v <= -tt] = CODE_NEG
    residual = v - _codes_to_values(codes, t, dt)
    return pack_codes(codes), residual


def decode_2bit(payload, n, t, dtype=np.float32):
    assert len(payload) == payload_nbytes("2bit", n)
    return _codes_to_values(unpack_codes(payload, n), t, dtype)


# ----------------------------------------------------------------------------
# 1bit
# ----------------------------------------------------------------------------
def canonical_sum(vals):
    """float64 sum of ``vals`` in the canonical order of the 1bit block sums."""
    vals = np.asarray(vals, np.float64)
    lanes = np.zeros(LANES, np.float64)
    for base in range(0, vals.size, LANES):
        row = vals[base:base + LANES]
        lanes[: row.size] = lanes[: row.size] + row  # one IEEE add per lane
    s = LANES // 2
    while s > 0:
        lanes[:s] = lanes[:s] + lanes[s:2 * s]
        s //= 2
    return float(lanes[0])


def onebit_means(v, block_size):
    """The per-block pairs ``[(m0, m1), ...]`` as a float32 array of 2*nblocks."""
    v = np.asarray(v)
    n = v.size
    nblk = -(-n // block_size)
    means = np.zeros(2 * nblk, np.float32)
    for k in range(nblk):
        blk = v[k * block_size:(k + 1) * block_size].astype(np.float64)
        pos = v[k * block_size:(k + 1) * block_size] >= 0
        for cls, sel in ((0, ~pos), (1, pos)):
            count = int(sel.sum())
            if count:
                # non-members contribute +0.0, which changes no sum
                total = canonical_sum(np.where(sel, blk, 0.0))
                means[2 * k + cls] = np.float32(total / count)
    return means


def encode_1bit(x, block_size=1024, e=None):
    v = _v(x, e)
    dt = v.dtype
    n = v.size
    pos = v >= 0
    means = onebit_means(v, block_size)
    blk = np.arange(n) // block_size
    m0 = means[0::2].astype(dt)
    m1 = means[1::2].astype(dt)
    decoded = np.where(pos, m1[blk], m0[blk]) if n else np.zeros(0, dt)
    residual = v - decoded
    return pack_bits(pos) + means.astype("<f4").tobytes(), residual


def decode_1bit(payload, n, block_size=1024, dtype=np.float32):
    payload = bytes(payload)
    assert len(payload) == payload_nbytes("1bit", n, block_size=block_size)
    nb = -(-n // 8)
    bits = unpack_bits(payload[:nb], n)
    means = np.frombuffer(payload[nb:], "<f4").astype(np.float32)
    dt = np.dtype(dtype)
    blk = np.arange(n) // block_size
    m0 = means[0::2].astype(dt)
    m1 = means[1::2].astype(dt)
    return np.where(bits, m1[blk], m0[blk]).astype(dt) if n else np.zeros(0, dt)


# ----------------------------------------------------------------------------
# 2bit, relative mode
# ----------------------------------------------------------------------------
def rel_thresholds(v, rel, block_size):
    """The per-block thresholds ``t_b`` of ``v`` as a float32 array."""
    v = np.asarray(v)
    n = v.size
    nblk = -(-n // block_size)
    t = np.zeros(nblk, np.float32)
    for k in range(nblk):
        f = v[k * block_size:(k + 1) * block_size].astype(np.float64)
        with np.errstate(over="ignore", invalid="ignore"):
            ss = canonical_sum(f * f)
            rms = math.sqrt(ss / f.size) if ss == ss and ss >= 0 else math.nan
            t[k] = np.float32(rel * rms)
    return t


def rel_magnitudes(v, selected, block_size):
    """The per-block mean magnitudes ``r_b`` of the selected values of ``v``
    as a float32 array: float32(canonical float64 sum of |v| / count), 0 for
    a block with nothing selected."""
    v = np.asarray(v)
    n = v.size
    nblk = -(-n // block_size)
    r = np.zeros(nblk, np.float32)
    for k in range(nblk):
        sl = slice(k * block_size, (k + 1) * block_size)
        sel = selected[sl]
        count = int(sel.sum())
        if count:
            a = np.where(sel, np.abs(v[sl].astype(np.float64)), 0.0)
            with np.errstate(over="ignore"):
                r[k] = np.float32(canonical_sum(a) / count)
    return r


def encode_2bit_rel(x, rel, block_size=1024, e=None):
    v = _v(x, e)
    dt = v.dtype
    n = v.size
    t = rel_thresholds(v, rel, block_size)
    tb = t.astype(dt)
    for k in range(t.size):  # the fallback: nothing reaches t_b
        vb = v[k * block_size:(k + 1) * block_size]
        if np.isfinite(t[k]) and t[k] > 0 and not (np.abs(vb) >= tb[k]).any():
            m = np.abs(vb).max()
            f = dt.type(np.float64(m) / max(rel, 1.0))
            tb[k] = f if f > 0 else m
    tt = tb[np.arange(n) // block_size] if n else np.zeros(0, dt)
    live = tt > 0  # a block whose threshold is 0 (or NaN) sends only 00
    codes = np.full(n, CODE_ZERO, np.uint8)
    with np.errstate(invalid="ignore"):
        codes[live & (v >= tt)] = CODE_POS
        codes[live & (v <= -tt)] = CODE_NEG
    r = rel_magnitudes(v, codes != CODE_ZERO, block_size)
    rr = r.astype(dt)[np.arange(n) // block_size] if n else np.zeros(0, dt)
    with np.errstate(invalid="ignore"):
        decoded = np.where(codes == CODE_POS, rr,
                           np.where(codes == CODE_NEG, -rr, dt.type(0))).astype(dt)
        residual = v - decoded
    return pack_codes(codes) + r.astype("<f4").tobytes(), residual


def decode_2bit_rel(payload, n, block_size=1024, dtype=np.float32):
    payload = bytes(payload)
    assert len(payload) == payload_nbytes("2bit_rel", n, block_size=block_size)
    nb = -(-n // 4)
    codes = unpack_codes(payload[:nb], n)
    dt = np.dtype(dtype)
    t = np.frombuffer(payload[nb:], "<f4").astype(dt)
    tt = t[np.arange(n) // block_size] if n else np.zeros(0, dt)
    return np.where(codes == CODE_POS, tt,
                    np.where(codes == CODE_NEG, -tt, dt.type(0))).astype(dt)


# ----------------------------------------------------------------------------
# terngrad
# ----------------------------------------------------------------------------
def splitmix64(z):
    """SplitMix64 finaliser of the state ``z`` (Python int), as in Vigna's
    ``splitmix64.c``: the output of ``next()`` when the state was ``z``."""
    z = (z + GOLDEN) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def splitmix64_array(z):
    """Vectorised :func:`splitmix64` on a uint64 array (wrapping arithmetic)."""
    z = np.asarray(z, np.uint64)
    with np.errstate(over="ignore"):
        z = z + np.uint64(GOLDEN)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def uniform_draws(stream, offset, n):
    """The uniforms in [0, 1) of global indices ``offset .. offset + n - 1``."""
    idx = (np.arange(n, dtype=np.uint64) + np.uint64(int(offset) & MASK64))
    with np.errstate(over="ignore"):
        key = np.uint64(int(stream) & MASK64) ^ (idx * np.uint64(GOLDEN))
    h = splitmix64_array(key)
    return (h >> np.uint64(11)).astype(np.float64) * 2.0 ** -53


def uniform_draw_int(stream, g):
    """The same draw with Python integers only (a cross-check)."""
    h = splitmix64((int(stream) & MASK64) ^ ((int(g) * GOLDEN) & MASK64))
    return (h >> 11) * 2.0 ** -53


def terngrad_local(v, clip=None):
    """``(max |clip(v)|, clip bound)`` as TernGrad computes them on one rank."""
    v64 = np.asarray(v, np.float64)
    n = v64.size
    if n == 0:
        return 0.0, math.inf
    amax = float(np.max(np.abs(v64)))
    bound = math.inf
    if clip is not None:
        s = float(np.cumsum(v64)[-1])            # sequential float64 sums
        ss = float(np.cumsum(v64 * v64)[-1])
        mean = s / n
        std = math.sqrt(max(ss / n - mean * mean, 0.0))
        if std > 0.0:  # all values equal: no clipping
            bound = clip * std
            amax = min(amax, bound)
    return amax, bound


def encode_terngrad(x, e=None, scale=None, stream=0, offset=0, clip=None,
                    clip_bound=None):
    v = _v(x, e)
    dt = v.dtype
    n = v.size
    if n == 0:
        return b"", v.copy()
    amax, bound = terngrad_local(v, clip)
    if scale is None:
        scale = amax
    if clip_bound is None:
        clip_bound = bound
    s32 = np.float32(scale)
    sc = float(s32)
    f = np.clip(v.astype(np.float64), -clip_bound, clip_bound)
    u = uniform_draws(stream, offset, n)
    if sc > 0:
        keep = u < np.abs(f) / sc
    else:
        keep = np.zeros(n, bool)
    codes = np.full(n, CODE_ZERO, np.uint8)
    codes[keep & (f > 0)] = CODE_POS
    codes[keep & (f < 0)] = CODE_NEG
    residual = v - _codes_to_values(codes, s32, dt)
    return pack_codes(codes) + np.array([s32], "<f4").tobytes(), residual


def decode_terngrad(payload, n, dtype=np.float32):
    payload = bytes(payload)
    if n == 0:
        return np.zeros(0, dtype)
    nb = -(-n // 4)
    scale = np.frombuffer(payload[nb:nb + 4], "<f4")[0]
    return _codes_to_values(unpack_codes(payload[:nb], n), scale, dtype)


# ----------------------------------------------------------------------------
# one entry point, by config
# ----------------------------------------------------------------------------
def encode(config, x, e=None, **kw):
    """Encode by an mpigc-style config dict ``{"id": ..., params...}``."""
    fmt = config["id"]
    if fmt == "none":
        return encode_none(x, e)
    if fmt == "fp16":
        return encode_fp16(x, e, **kw)
    if fmt == "bf16":
        return encode_bf16(x, e, **kw)
    if fmt == "2bit" and config.get("rel_threshold") is not None:
        return encode_2bit_rel(x, config["rel_threshold"], config.get("block_size", 1024), e)
    if fmt == "2bit":
        return encode_2bit(x, config.get("threshold", 0.5), e)
    if fmt == "1bit":
        return encode_1bit(x, config.get("block_size", 1024), e)
    if fmt == "terngrad":
        return encode_terngrad(x, e, clip=config.get("clip"), **kw)
    raise ValueError(fmt)


def decode(config, payload, n, dtype=np.float32):
    fmt = config["id"]
    if fmt == "none":
        return decode_none(payload, n, dtype)
    if fmt == "fp16":
        return decode_fp16(payload, n, dtype)
    if fmt == "bf16":
        return decode_bf16(payload, n, dtype)
    if fmt == "2bit" and config.get("rel_threshold") is not None:
        return decode_2bit_rel(payload, n, config.get("block_size", 1024), dtype)
    if fmt == "2bit":
        return decode_2bit(payload, n, config.get("threshold", 0.5), dtype)
    if fmt == "1bit":
        return decode_1bit(payload, n, config.get("block_size", 1024), dtype)
    if fmt == "terngrad":
        return decode_terngrad(payload, n, dtype)
    raise ValueError(fmt)


# ----------------------------------------------------------------------------
# the collectives, all ranks at once (ALGORITHMS.md, "Collectives")
# ----------------------------------------------------------------------------
def _bounds(n, parts):
    """``(lo, hi)`` of ``numpy.array_split(range(n), parts)``."""
    q, r = divmod(n, parts)
    out, lo = [], 0
    for j in range(parts):
        hi = lo + q + (1 if j < r else 0)
        out.append((lo, hi))
        lo = hi
    return out


def two_phase(config, xs, E=None, O=None, gather="compressed", phase2=True):
    """The two-phase compressed allreduce of ``xs`` (one 1-D work-dtype array
    per rank, in rank order) without averaging. ``E``: per-rank worker
    residuals (updated in place), ``O``: per-rank owner residuals of their
    shards (updated in place); None: no error feedback. Returns the reduced
    vector (the work dtype): after phase 2 with ``phase2``, else the owners'
    sums (what reduce_scatter returns)."""
    N, n = len(xs), xs[0].size
    wd = xs[0].dtype
    acc_dtype = np.float64 if wd == np.float64 else np.float32
    out = np.empty(n, wd)
    for j, (lo, hi) in enumerate(_bounds(n, N)):
        if hi == lo:
            continue
        acc = None
        for r in range(N):  # the owner sums the contributions in rank order
            e = None if E is None else E[r][lo:hi]
            payload, res = encode(config, xs[r][lo:hi], e)
            if E is not None:
                E[r][lo:hi] = res
            d = decode(config, payload, hi - lo, acc_dtype)
            acc = d if acc is None else acc + d
        if not phase2 or gather == "exact":
            out[lo:hi] = acc
            continue
        o = None if O is None else O[j]
        payload, res = encode(config, acc.astype(wd), o)
        if O is not None:
            O[j] = res
        out[lo:hi] = decode(config, payload, hi - lo, wd)
    return out


class Hierarchical:
    """The hierarchical allreduce / reduce-scatter (ALGORITHMS.md,
    "Hierarchical") for all ranks at once.

    ``nodes``: the world ranks of each node, in local-rank order. With L the
    largest node size, the n elements are cut into L slices; on a node of L
    ranks local rank l handles slice l, on a smaller node of k ranks local
    rank l handles the slices ``array_split(range(L), k)[l]``. Each node sums
    each slice exactly (work dtype, local-rank order); the handlers of slice
    s (one per node, in node order) run :func:`two_phase` on the node sums;
    the result is gathered on every rank. ``ef``: error feedback on (worker
    residual per slice and node, owner residuals per slice and node).
    """

    def __init__(self, config, nodes, n, dtype, ef=True, gather="compressed"):
        self.config, self.nodes, self.n = config, nodes, n
        self.dtype = np.dtype(dtype)
        self.wd = np.dtype(np.float64 if self.dtype == np.float64 else np.float32)
        self.L = max(len(m) for m in nodes)
        self.M = len(nodes)
        self.W = sum(len(m) for m in nodes)
        self.gather = gather
        self.slices = _bounds(n, self.L)
        self.E = self.O = None
        if ef:
            self.E = {s: [np.zeros(hi - lo, self.wd) for _ in nodes]
                      for s, (lo, hi) in enumerate(self.slices)}
            self.O = {s: [np.zeros(b - a, self.wd) for a, b in _bounds(hi - lo, self.M)]
                      for s, (lo, hi) in enumerate(self.slices)}

    def handler(self, m, s):
        """The world rank of node ``m`` that handles slice ``s``."""
        ranks = self.nodes[m]
        for l, (a, b) in enumerate(_bounds(self.L, len(ranks))):
            if a <= s < b:
                return ranks[l]
        raise AssertionError

    def _reduce(self, xs, phase2):
        out = np.empty(self.n, self.wd)
        for s, (lo, hi) in enumerate(self.slices):
            sums = []
            for ranks in self.nodes:
                acc = xs[ranks[0]][lo:hi].astype(self.wd)
                for r in ranks[1:]:
                    acc = acc + xs[r][lo:hi].astype(self.wd)
                sums.append(acc)
            out[lo:hi] = two_phase(self.config, sums,
                                   None if self.E is None else self.E[s],
                                   None if self.O is None else self.O[s],
                                   self.gather, phase2)
        return out

    def allreduce(self, xs, average=False):
        out = self._reduce(xs, True)
        if average:
            out = out / self.W
        return out.astype(self.dtype)

    def reduce_scatter(self, xs, average=False):
        """The reduced vector (work dtype): rank r's result is its shard of it."""
        out = self._reduce(xs, False)
        if average:
            out = out / self.W
        return out

    def residual_total(self):
        """Sum over every rank of the worker and owner residuals, per element."""
        tot = np.zeros(self.n, np.float64)
        if self.E is None:
            return tot
        for s, (lo, hi) in enumerate(self.slices):
            for e in self.E[s]:
                tot[lo:hi] += e
            for (a, b), o in zip(_bounds(hi - lo, self.M), self.O[s]):
                tot[lo + a:lo + b] += o
        return tot
