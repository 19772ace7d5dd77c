"""Kernel-level tests (no MPI): the Numba kernels against the numpy reference
bit for bit, round trips, error-feedback conservation, the statistics of
terngrad, float16 conversion, and the parallel kernel path."""
import math

import numba
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import mpigc
from mpigc.kernels import cpu

try:
    from .support import reference as ref
except ImportError:
    from support import reference as ref

# deterministic, fast property tests
PROP = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

DTYPES = [np.float32, np.float64]
FORMATS = ["none", "fp16", "bf16", "2bit", "2bit_rel", "1bit", "terngrad"]


# ----------------------------------------------------------------------------
# strategies
# ----------------------------------------------------------------------------
@st.composite
def vectors(draw, max_n=3000, dtype=None, magnitude=None):
    """A 1-D float32/float64 array: small ones element by element (so that
    hypothesis can shrink and inject special values), large ones from a seed."""
    dtype = np.dtype(draw(st.sampled_from(DTYPES)) if dtype is None else dtype)
    if draw(st.booleans()):
        n = draw(st.integers(0, 40))
        lim = 1e6 if magnitude is None else magnitude
        elems = st.floats(min_value=-lim, max_value=lim, allow_nan=False,
                          allow_infinity=False, width=8 * dtype.itemsize)
        return draw(hnp.arrays(dtype, n, elements=elems))
    n = draw(st.integers(0, max_n))
    seed = draw(st.integers(0, 2**32 - 1))
    scale = draw(st.sampled_from([1e-3, 1.0, 30.0])) if magnitude is None else magnitude
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n) * scale
    kind = draw(st.sampled_from(["normal", "zeros", "ties", "heavy"]))
    if kind == "zeros" and n:
        x[rng.random(n) < 0.3] = 0.0
    elif kind == "ties" and n:  # values on a coarse grid: many exact ties
        x = np.round(x * 4) / 4
    elif kind == "heavy" and n:
        x = x * np.exp(rng.standard_normal(n) * 3)
    return x.astype(dtype)


@st.composite
def vector_and_residual(draw, max_n=3000, magnitude=None):
    x = draw(vectors(max_n=max_n, magnitude=magnitude))
    if not draw(st.booleans()):
        return x, None
    seed = draw(st.integers(0, 2**32 - 1))
    scale = draw(st.sampled_from([0.0, 1e-2, 0.3, 3.0]))
    e = (np.random.default_rng(seed).standard_normal(x.size) * scale).astype(x.dtype)
    return x, e


thresholds = st.one_of(st.sampled_from([0.5, 0.1, 2.0, 1e-3, 1.0]),
                       st.floats(1e-4, 100.0, allow_nan=False))
block_sizes = st.sampled_from([8, 16, 24, 64, 1024])
rel_thresholds = st.one_of(st.sampled_from([1.0, 1.5, 2.0, 0.5, 3.0]),
                           st.floats(1e-3, 10.0, allow_nan=False))
rel_block_sizes = st.sampled_from([4, 12, 16, 100, 1024])
divisors = st.sampled_from([1.0, 2.0, 3.0, 4.0, 0.5, 7.0])
streams = st.integers(0, 2**64 - 1)
offsets = st.one_of(st.just(0), st.integers(0, 2**40), st.integers(0, 2**64 - 1))


# ----------------------------------------------------------------------------
# the kernels, called directly, with the three residual modes
# ----------------------------------------------------------------------------
def residual_args(x, e, mode):
    """``(e_in, e_out)`` for a mode: "none" (no feedback), "inplace"
    (e_out is e_in), "outofplace" (e_out a separate buffer, e_in unchanged)
    and "outonly" (no e_in, e_out written)."""
    if mode == "none":
        return None, None
    if mode == "outonly":
        return None, np.full(x.size, np.nan, x.dtype)
    e_in = np.zeros_like(x) if e is None else e.copy()
    if mode == "inplace":
        return e_in, e_in
    return e_in, np.full(x.size, np.nan, x.dtype)


def kernel_encode(fmt, params, x, e_in, e_out):
    """Payload bytes and non-finite count from the Numba kernels."""
    n = x.size
    if fmt == "2bit":
        out = np.empty((n + 3) // 4, np.uint8)
        nbad = cpu.pack_2bit(x, e_in, e_out, out, params["threshold"])
        return out.tobytes(), nbad
    if fmt == "2bit_rel":
        b = params["block_size"]
        out = np.empty((n + 3) // 4, np.uint8)
        scales = np.empty(-(-n // b), np.float32)
        nbad = cpu.pack_2bit_rel(x, e_in, e_out, out, scales, params["rel_threshold"], b)
        return out.tobytes() + scales.astype("<f4").tobytes(), nbad
    if fmt == "1bit":
        b = params["block_size"]
        bits = np.empty((n + 7) // 8, np.uint8)
        means = np.empty(2 * (-(-n // b)), np.float32)
        nbad = cpu.pack_1bit(x, e_in, e_out, bits, means, b)
        return bits.tobytes() + means.astype("<f4").tobytes(), nbad
    if fmt == "fp16":
        out = np.empty(n, np.uint16)
        nbad = cpu.pack_fp16(x, e_in, e_out, out, params.get("divisor", 1.0))
        return out.astype("<u2").tobytes(), nbad
    if fmt == "bf16":
        out = np.empty(n, np.uint16)
        nbad = cpu.pack_bf16(x, e_in, e_out, out, params.get("divisor", 1.0))
        return out.astype("<u2").tobytes(), nbad
    if fmt == "terngrad":
        out = np.empty((n + 3) // 4, np.uint8)
        nbad = cpu.pack_ternary(x, e_in, e_out, out, params["scale"], params["clip_bound"],
                                params["stream"], params["offset"])
        if n == 0:  # an empty terngrad payload carries no scale either
            return b"", nbad
        return out.tobytes() + np.array([params["scale"]], "<f4").tobytes(), nbad
    raise ValueError(fmt)


def kernel_decode(fmt, params, payload, out, accumulate=False):
    n = out.size
    p = np.frombuffer(payload, np.uint8)
    if fmt == "2bit":
        cpu.unpack_2bit(p, out, params["threshold"], accumulate)
    elif fmt == "2bit_rel":
        nb = (n + 3) // 4
        scales = np.frombuffer(payload[nb:], "<f4").astype(np.float32)
        cpu.unpack_2bit_rel(p[:nb], scales, out, params["block_size"], accumulate)
    elif fmt == "1bit":
        nb = (n + 7) // 8
        means = np.frombuffer(payload[nb:], "<f4").astype(np.float32)
        cpu.unpack_1bit(p[:nb], means, out, params["block_size"], accumulate)
    elif fmt == "fp16":
        cpu.unpack_fp16(np.frombuffer(payload, "<u2").astype(np.uint16), out, accumulate)
    elif fmt == "bf16":
        cpu.unpack_bf16(np.frombuffer(payload, "<u2").astype(np.uint16), out, accumulate)
    elif fmt == "terngrad":
        if n == 0:
            return out
        nb = (n + 3) // 4
        scale = float(np.frombuffer(payload[nb:nb + 4], "<f4")[0])
        cpu.unpack_2bit(p[:nb], out, scale, accumulate)
    else:
        raise ValueError(fmt)
    return out


def reference_encode(fmt, params, x, e):
    if fmt == "2bit":
        return ref.encode_2bit(x, params["threshold"], e)
    if fmt == "2bit_rel":
        return ref.encode_2bit_rel(x, params["rel_threshold"], params["block_size"], e)
    if fmt == "1bit":
        return ref.encode_1bit(x, params["block_size"], e)
    if fmt == "fp16":
        return ref.encode_fp16(x, e, params.get("divisor", 1.0))
    if fmt == "bf16":
        return ref.encode_bf16(x, e, params.get("divisor", 1.0))
    if fmt == "terngrad":
        return ref.encode_terngrad(x, e, scale=params["scale"], stream=params["stream"],
                                   offset=params["offset"], clip_bound=params["clip_bound"])
    raise ValueError(fmt)


def reference_decode(fmt, params, payload, n, dtype):
    if fmt == "2bit":
        return ref.decode_2bit(payload, n, params["threshold"], dtype)
    if fmt == "2bit_rel":
        return ref.decode_2bit_rel(payload, n, params["block_size"], dtype)
    if fmt == "1bit":
        return ref.decode_1bit(payload, n, params["block_size"], dtype)
    if fmt == "fp16":
        return ref.decode_fp16(payload, n, dtype)
    if fmt == "bf16":
        return ref.decode_bf16(payload, n, dtype)
    if fmt == "terngrad":
        return ref.decode_terngrad(payload, n, dtype) if n else np.zeros(0, dtype)
    raise ValueError(fmt)


@st.composite
def kernel_params(draw, fmt):
    if fmt == "2bit":
        return {"threshold": draw(thresholds)}
    if fmt == "2bit_rel":
        return {"rel_threshold": draw(rel_thresholds), "block_size": draw(rel_block_sizes)}
    if fmt == "1bit":
        return {"block_size": draw(block_sizes)}
    if fmt in ("fp16", "bf16"):
        return {"divisor": draw(divisors)}
    if fmt == "terngrad":
        return {"scale": draw(st.sampled_from([0.0, 0.5, 1.0, 3.0, 100.0])),
                "clip_bound": draw(st.sampled_from([math.inf, 0.5, 2.0])),
                "stream": draw(streams), "offset": draw(offsets)}
    raise ValueError(fmt)


def assert_same(a, b):
    """Bitwise equality of two float arrays (NaN-safe, sign of zero counts)."""
    a = np.asarray(a)
    b = np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape
    if a.tobytes() != b.tobytes():
        w = a.dtype.itemsize
        diff = np.flatnonzero((a.view(np.uint8).reshape(-1, w)
                               != b.view(np.uint8).reshape(-1, w)).any(axis=1))
        raise AssertionError(f"arrays differ at {diff[:10]} (of {diff.size}): "
                             f"{a[diff[:5]]} != {b[diff[:5]]}")


# ----------------------------------------------------------------------------
# kernels == reference, bit for bit
# ----------------------------------------------------------------------------
# what is not finite on the wire: all exponent bits set (inf or NaN)
WIRE_EXP = {"fp16": 0x7C00, "bf16": 0x7F80}


@pytest.mark.parametrize("fmt", ["2bit", "2bit_rel", "1bit", "fp16", "bf16", "terngrad"])
@pytest.mark.parametrize("mode", ["none", "inplace", "outofplace", "outonly"])
@PROP
@given(data=st.data())
def test_kernel_matches_reference(fmt, mode, data):
    x, e = data.draw(vector_and_residual(
        magnitude={"fp16": 1e4, "bf16": 2.0 ** 100}.get(fmt)))
    params = data.draw(kernel_params(fmt))
    e_in, e_out = residual_args(x, e, mode)
    e_in_before = None if e_in is None else e_in.copy()
    payload, nbad = kernel_encode(fmt, params, x, e_in, e_out)
    ref_e = e_in_before if mode in ("inplace", "outofplace") else None
    ref_payload, ref_res = reference_encode(fmt, params, x, ref_e)
    assert payload == ref_payload
    if fmt not in WIRE_EXP:  # fp16, bf16 may overflow to inf; the others are finite
        assert nbad == 0
    v = x if ref_e is None else x + ref_e
    if fmt in WIRE_EXP:  # what is not finite on the wire: non-finite or beyond the range
        m = WIRE_EXP[fmt]
        halves = np.frombuffer(ref_payload, np.uint16)
        assert nbad == int(np.count_nonzero((halves & m) == m))
    else:
        assert nbad == int(np.count_nonzero(~np.isfinite(v)))
    if e_out is not None:
        assert_same(e_out, ref_res)
    if mode == "outofplace":
        assert_same(e_in, e_in_before)  # e_in is only read
    # decoding, in the array's dtype and in the other one, fresh and accumulated
    for dt in DTYPES:
        out = kernel_decode(fmt, params, payload, np.full(x.size, np.nan, dt))
        assert_same(out, reference_decode(fmt, params, ref_payload, x.size, dt))
        base = np.linspace(-1, 1, x.size).astype(dt)
        acc = kernel_decode(fmt, params, payload, base.copy(), accumulate=True)
        assert_same(acc, base + out)


@pytest.mark.parametrize("config", [
    {"id": "none"}, {"id": "fp16"}, {"id": "bf16"}, {"id": "2bit", "threshold": 0.5},
    {"id": "2bit", "threshold": 0.1}, {"id": "1bit", "block_size": 16},
    {"id": "1bit", "block_size": 1024}, {"id": "terngrad"},
    {"id": "terngrad", "clip": 2.5}, {"id": "2bit", "rel_threshold": 1.5},
    {"id": "2bit", "rel_threshold": 1.0, "block_size": 12}],
    ids=lambda c: "-".join(map(str, c.values())))
@PROP
@given(data=st.data())
def test_public_api_matches_reference(config, data):
    """compress/decompress (local scale for terngrad) == the reference; with
    check_finite=False the residual is updated in place."""
    c = mpigc.get_compressor(dict(config))
    x, e = data.draw(vector_and_residual())
    kw = {}
    if config["id"] == "terngrad":
        kw = {"stream": data.draw(streams), "offset": data.draw(offsets)}
    check = data.draw(st.booleans())
    e_lib = None if e is None else e.copy()
    p_ref, r_ref = ref.encode(c.get_config(), x, e, **kw)
    m = WIRE_EXP.get(config["id"])
    if check and m and np.any((np.frombuffer(p_ref, np.uint16) & m) == m):
        with pytest.raises(mpigc.NonFiniteError):  # beyond the wire's range
            c.compress(x, e_lib, check_finite=check, **kw)
        assert e is None or e_lib.tobytes() == e.tobytes()
        return
    p = c.compress(x, e_lib, check_finite=check, **kw)
    assert p.tobytes() == p_ref
    if e is not None:
        assert_same(e_lib, r_ref)
    assert_same(c.decompress(p, x.size, dtype=x.dtype),
                ref.decode(c.get_config(), p_ref, x.size, x.dtype))


# ----------------------------------------------------------------------------
# round trips and error-feedback conservation
# ----------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
@PROP
@given(data=st.data())
def test_conservation_one_step(fmt, data):
    """x + e_old == decoded + e_new up to one rounding of the residual."""
    x, e = data.draw(vector_and_residual(magnitude=1e3))
    if fmt == "fp16":  # stay inside the half range (overflow: see test_fp16_overflow)
        x = np.clip(x, -3e4, 3e4)
    cfg = {"2bit": {"threshold": data.draw(thresholds)},
           "2bit_rel": {"rel_threshold": data.draw(rel_thresholds),
                        "block_size": data.draw(rel_block_sizes)},
           "1bit": {"block_size": data.draw(block_sizes)}}.get(fmt, {})
    c = mpigc.get_compressor(fmt.replace("_rel", ""), **cfg)
    kw = {"stream": data.draw(streams)} if fmt == "terngrad" else {}
    e = np.zeros_like(x) if e is None else e
    v = x + e
    e_new = e.copy()
    d = c.decompress(c.compress(x, e_new, **kw), x.size, dtype=x.dtype)
    # e_new is v - d rounded once: |d + e_new - v| <= ulp of the operands
    eps = np.finfo(x.dtype).eps
    tol = eps * (np.abs(v) + np.abs(d))
    assert np.all(np.abs((d.astype(np.float64) + e_new) - v) <= tol)
    if fmt == "none":
        assert_same(d, v)
        assert not e_new.any()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_conservation_many_steps(fmt, dtype):
    """Summed over steps, delivered + final residual == total input."""
    rng = np.random.default_rng(11)
    c = mpigc.get_compressor(fmt.replace("_rel", ""),
                             **({"error_feedback": True} if fmt in ("fp16", "bf16",
                                                                    "terngrad")
                                else {"rel_threshold": 1.5, "block_size": 16}
                                if fmt == "2bit_rel" else {}))
    n, steps = 257, 40
    e = np.zeros(n, dtype)
    total = np.zeros(n)
    delivered = np.zeros(n)
    for k in range(steps):
        g = rng.standard_normal(n).astype(dtype)
        kw = {"stream": cpu.ternary_stream(1, 0, k, 0)} if fmt == "terngrad" else {}
        p = c.compress(g, e, **kw)
        delivered += c.decompress(p, n, dtype=dtype)
        total += g
    eps = np.finfo(dtype).eps
    np.testing.assert_allclose(delivered + e, total, rtol=0, atol=steps * 20 * eps)
    # and the residual stays bounded (nothing accumulates without limit)
    assert np.abs(e).max() < 20


@PROP
@given(ks=hnp.arrays(np.int64, st.integers(1, 300), elements=st.integers(-2000, 2000)),
       steps=st.integers(1, 8), dtype=st.sampled_from(DTYPES),
       t=st.sampled_from([0.5, 0.25, 1.0, 2.0]))
def test_2bit_conservation_is_exact_on_a_dyadic_grid(ks, steps, dtype, t):
    """With values k/16 and a power-of-two threshold every operation is
    exact, so x + e_old == decoded + e_new holds exactly, step after step."""
    c = mpigc.TwoBit(threshold=t)
    e = np.zeros(ks.size, dtype)
    total = np.zeros(ks.size, dtype)
    delivered = np.zeros(ks.size, dtype)
    for k in range(steps):
        g = (np.roll(ks, k) / 16).astype(dtype)
        e_old = e.copy()
        d = c.decompress(c.compress(g, e), ks.size, dtype=dtype)
        assert_same(g + e_old, d + e)
        total += g
        delivered += d
    assert_same(total, delivered + e)


@pytest.mark.parametrize("dtype", DTYPES)
@PROP
@given(data=st.data())
def test_2bit_decodes_to_three_values(dtype, data):
    x, e = data.draw(vector_and_residual())
    x = x.astype(dtype)
    t = data.draw(thresholds)
    c = mpigc.TwoBit(threshold=t)
    e = np.zeros_like(x) if e is None else e.astype(dtype)
    v = x + e
    p = c.compress(x, e)
    d = c.decompress(p, x.size, dtype=dtype)
    tt = dtype(t)
    assert set(np.unique(d).tolist()) <= {-float(tt), 0.0, float(tt)}
    assert_same(d, np.where(v >= tt, tt, np.where(v <= -tt, -tt, dtype(0))).astype(dtype))
    # |residual| < t wherever |v| < 2t (the quantizer never overshoots)
    small = np.abs(v) < 2 * tt
    assert np.all(np.abs(e[small]) < tt)
    # padding of the last byte is 00
    if x.size % 4:
        assert p[-1] & (0xFF >> (2 * (x.size % 4))) == 0


def test_2bit_code_01_decodes_to_zero():
    p = np.array([0b01010101, 0b01100111], np.uint8)
    d = mpigc.TwoBit(threshold=1.5).decompress(p, 8)
    np.testing.assert_array_equal(d, [0, 0, 0, 0, 0, -1.5, 0, 1.5])


def test_2bit_layout_by_position():
    """Element i sits under (0xC0, 0x30, 0x0C, 0x03)[i % 4] of byte i // 4."""
    c = mpigc.TwoBit(threshold=1.0)
    for n in (1, 4, 5, 9):
        for i in range(n):
            x = np.zeros(n, np.float32)
            x[i] = 1.0
            p = c.compress(x)
            expect = np.zeros((n + 3) // 4, np.uint8)
            expect[i // 4] = (0xC0, 0x30, 0x0C, 0x03)[i % 4]
            np.testing.assert_array_equal(p, expect)
            x[i] = -1.0
            expect[i // 4] = (0x80, 0x20, 0x08, 0x02)[i % 4]
            np.testing.assert_array_equal(c.compress(x), expect)


def test_1bit_layout_by_position():
    c = mpigc.OneBit(block_size=8)
    for n in (1, 8, 9, 17):
        for i in range(n):
            x = -np.ones(n, np.float32)
            x[i] = 2.0
            p = c.compress(x)
            expect = np.zeros((n + 7) // 8, np.uint8)
            expect[i // 8] = 0x80 >> (i % 8)
            np.testing.assert_array_equal(p[:(n + 7) // 8], expect)
            means = np.frombuffer(p[(n + 7) // 8:].tobytes(), "<f4").reshape(-1, 2)
            blk = np.zeros(len(means), bool)
            blk[i // 8] = True
            m0 = -1.0 if min(n, (i // 8 + 1) * 8) - (i // 8) * 8 > 1 else 0.0
            np.testing.assert_array_equal(means[blk], [[m0, 2.0]])
            np.testing.assert_array_equal(means[~blk, 0], -1.0)
            np.testing.assert_array_equal(means[~blk, 1], 0.0)  # empty class -> 0


# ----------------------------------------------------------------------------
# 1bit: the pairs are the class means (which minimise the squared error)
# ----------------------------------------------------------------------------
@PROP
@given(data=st.data())
def test_1bit_pairs_are_class_means(data):
    x, e = data.draw(vector_and_residual(max_n=2000))
    b = data.draw(block_sizes)
    c = mpigc.OneBit(block_size=b)
    v = x if e is None else x + e
    p = c.compress(x, None if e is None else e.copy())
    n = x.size
    nb = (n + 7) // 8
    means = np.frombuffer(p[nb:].tobytes(), "<f4").reshape(-1, 2)
    bits = np.unpackbits(p[:nb], count=n).astype(bool)
    assert np.array_equal(bits, v >= 0)
    d = c.decompress(p, n, dtype=np.float64)
    for k in range(len(means)):
        blk = v[k * b:(k + 1) * b].astype(np.float64)
        pos = blk >= 0
        for cls, sel in ((0, ~pos), (1, pos)):
            m = float(means[k, cls])
            if not sel.any():
                assert m == 0.0
                continue
            mean = math.fsum(blk[sel]) / sel.sum()
            # float32 of a float64 sum: within a float32 ulp of the exact mean
            assert abs(m - mean) <= np.spacing(np.float32(abs(mean))) + 1e-300
        # the pair minimises the squared error of this split: no other
        # reconstruction of the same bits does better
        dk = d[k * b:(k + 1) * b]
        sse = np.sum((blk - dk) ** 2)
        rms = math.sqrt(np.mean(blk ** 2))
        mabs = float(np.mean(np.abs(blk)))
        for alt in [(-rms, rms), (-mabs, mabs), (float(means[k, 0]) * 1.01, float(means[k, 1])),
                    (float(means[k, 0]), float(means[k, 1]) * 0.99)]:
            alt_d = np.where(pos, alt[1], alt[0])
            # up to the float32 rounding of the means
            slack = blk.size * float(np.spacing(np.float32(np.max(np.abs(blk))))) ** 2
            assert sse <= np.sum((blk - alt_d) ** 2) * (1 + 1e-6) + slack


def test_1bit_canonical_sum_order_matters_and_is_followed():
    """A block whose float32 mean depends on the order of the float64 sum:
    the exact mean without the tiny values is a float32 tie (1 + 2**-24).
    Added sequentially, every tiny value is lost (tie -> even -> 1.0); in the
    canonical 32-lane order they survive and the mean rounds up."""
    b = 104
    vals = np.array([b * (1 + 2.0 ** -24)] + [2.0 ** -48] * (b - 1), np.float64)
    canonical = ref.canonical_sum(vals)
    sequential = float(np.cumsum(vals)[-1])
    # the test means something: the two orders give different float32 means
    assert np.float32(canonical / b) == np.float32(1 + 2.0 ** -23)
    assert np.float32(sequential / b) == np.float32(1.0)
    for dtype in DTYPES[1:]:
        p = mpigc.OneBit(block_size=b).compress(vals.astype(dtype))
        m0, m1 = np.frombuffer(p[b // 8:].tobytes(), "<f4")
        assert p[:b // 8].tolist() == [0xFF] * (b // 8)
        assert m0 == 0.0 and m1 == np.float32(canonical / b)


# ----------------------------------------------------------------------------
# terngrad: unbiased, reproducible, independent of the sharding
# ----------------------------------------------------------------------------
def test_splitmix64_reference_vectors():
    # Vigna's splitmix64.c seeded with 0: the first outputs
    z, outs = 0, []
    for _ in range(3):
        outs.append(ref.splitmix64(z))
        z = (z + ref.GOLDEN) & ref.MASK64
    assert outs == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]
    z = np.array([0, ref.GOLDEN, 2 * ref.GOLDEN & ref.MASK64], np.uint64)
    assert ref.splitmix64_array(z).tolist() == outs
    for g in (0, 1, 12345, 2**63 + 5):
        assert ref.uniform_draws(99, g, 1)[0] == ref.uniform_draw_int(99, g)


@pytest.mark.parametrize("dtype", DTYPES)
def test_terngrad_unbiased(dtype):
    rng = np.random.default_rng(3)
    n, reps = 64, 4000
    x = rng.uniform(-1, 1, n).astype(dtype)
    x[:4] = [0.0, 1.0, -1.0, 1e-3]
    s = 1.0
    c = mpigc.TernGrad()
    # many independent draws in one call: the draw depends on the global index
    big = np.tile(x, reps)
    for stream in (cpu.ternary_stream(5, 0, 0, 0), cpu.ternary_stream(5, 1, 0, 0)):
        d = c.decompress(c.compress(big, scale=s, stream=stream), big.size, dtype=np.float64)
        mean = d.reshape(reps, n).mean(axis=0)
        p = np.abs(x.astype(np.float64)) / s
        sigma = s * np.sqrt(p * (1 - p) / reps)
        assert np.all(np.abs(mean - x) <= 6 * sigma + 1e-12), np.max(np.abs(mean - x) / (sigma + 1e-12))
        # the aggregate bias over all elements is far smaller still
        assert abs(np.sum(mean - x)) <= 6 * math.sqrt(np.sum(sigma ** 2))
        assert mean[0] == 0.0 and mean[1] == 1.0 and mean[2] == -1.0


def test_terngrad_local_scale_is_max_abs():
    x = np.array([0.5, -3.0, 2.0, 0.0, 1.0], np.float32)
    c = mpigc.TernGrad()
    p = c.compress(x, stream=9)
    assert np.frombuffer(p[-4:].tobytes(), "<f4")[0] == 3.0
    d = c.decompress(p, 5)
    assert d[1] == -3.0 and d[3] == 0.0  # the max element is always kept
    assert set(np.unique(d).tolist()) <= {-3.0, 0.0, 3.0}


@PROP
@given(x=vectors(max_n=500), stream=streams, offset=offsets)
def test_terngrad_reproducible(x, stream, offset):
    assume(x.size > 0)
    c = mpigc.TernGrad()
    a = c.compress(x, stream=stream, offset=offset)
    b = c.compress(x.copy(), stream=stream, offset=offset)
    assert a.tobytes() == b.tobytes()


def test_terngrad_different_streams_differ():
    x = np.random.default_rng(4).uniform(-1, 1, 1000).astype(np.float32)
    c = mpigc.TernGrad()
    ids = [cpu.ternary_stream(0, 0, 0, 0), cpu.ternary_stream(0, 1, 0, 0),
           cpu.ternary_stream(0, 0, 1, 0), cpu.ternary_stream(0, 0, 0, 1),
           cpu.ternary_stream(7, 0, 0, 0)]
    assert len(set(ids)) == len(ids)
    payloads = {c.compress(x, scale=1.0, stream=s).tobytes() for s in ids}
    assert len(payloads) == len(ids)
    # offsets shift the draws too
    assert (c.compress(x, scale=1.0, stream=ids[0], offset=1).tobytes()
            != c.compress(x, scale=1.0, stream=ids[0]).tobytes())


def test_ternary_stream_is_a_pure_function():
    assert cpu.ternary_stream(3, 1, 7, 0) == cpu.ternary_stream(3, 1, 7, 0)
    assert 0 <= cpu.ternary_stream(-1, 2**70, 3, 1) < 2**64
    # one seed: every (rank, call, stage) has its own stream
    ids = {cpu.ternary_stream(5, r, k, st_) for r in range(16) for k in range(50)
           for st_ in range(2)}
    assert len(ids) == 16 * 50 * 2


def test_ternary_stream_distinct_seeds_and_ranks():
    assert cpu.ternary_stream(1, 0, 0, 0) != cpu.ternary_stream(0, 1, 0, 0)
    ids = {cpu.ternary_stream(s, r, k, st_) for s in range(3) for r in range(4)
           for k in range(5) for st_ in range(2)}
    assert len(ids) == 3 * 4 * 5 * 2


@PROP
@given(x=vectors(max_n=1500), stream=streams, data=st.data())
def test_terngrad_shards_give_the_same_codes(x, stream, data):
    """Draws depend on the global index only: packing shards with their
    offsets gives the codes of packing the whole."""
    assume(x.size > 0)
    cuts = sorted(data.draw(st.lists(st.integers(0, x.size), max_size=4)))
    c = mpigc.TernGrad()
    s = float(np.max(np.abs(x.astype(np.float64)))) or 1.0
    whole = ref.unpack_codes(c.compress(x, scale=s, stream=stream).tobytes(), x.size)
    parts = []
    for lo, hi in zip([0] + cuts, cuts + [x.size]):
        if hi > lo:
            p = c.compress(x[lo:hi].copy(), scale=s, stream=stream, offset=lo)
            parts.append(ref.unpack_codes(p.tobytes(), hi - lo))
    assert np.array_equal(np.concatenate(parts), whole)


def test_terngrad_scale_below_values_always_keeps():
    x = np.array([5.0, -5.0, 0.5, -0.0], np.float64)
    c = mpigc.TernGrad()
    for stream in range(20):
        d = c.decompress(c.compress(x, scale=1.0, stream=stream), 4, dtype=np.float64)
        assert d[0] == 1.0 and d[1] == -1.0 and d[3] == 0.0


def test_terngrad_clip_bounds_scale():
    rng = np.random.default_rng(6)
    x = rng.standard_normal(1000)
    x[17] = 100.0
    c = mpigc.TernGrad(clip=2.5)
    p = c.compress(x, stream=3)
    std = np.std(x)
    assert np.frombuffer(p[-4:].tobytes(), "<f4")[0] == np.float32(min(100.0, 2.5 * std))
    amax, bound = c.local_scale(x, None)[:2]
    assert bound == pytest.approx(2.5 * std, rel=1e-12)


def test_terngrad_keep_test_divides_by_the_scale():
    # |v| / 3 rounds above the draw u of (stream 2, index 0), |v| * (1/3) does not
    x = np.array([1.7735692025942384], np.float64)
    u = ref.uniform_draw_int(2, 0)
    assert x[0] / 3.0 > u >= x[0] * (1.0 / 3.0)  # the case is what it claims
    p_ref, _ = ref.encode_terngrad(x, scale=3.0, stream=2)
    assert p_ref[0] == 0xC0
    p = mpigc.TernGrad().compress(x, scale=3.0, stream=2)
    assert p.tobytes() == p_ref


# ----------------------------------------------------------------------------
# fp16 conversion == numpy's astype(float16)
# ----------------------------------------------------------------------------
def _f32_probe_values():
    """Every finite half, the midpoints between neighbours (ties), one float32
    ulp either side of them, values around the overflow bound, float32
    subnormals and extremes, infinities."""
    h = np.arange(0, 0x7C00, dtype=np.uint16).view(np.float16).astype(np.float32)
    nxt = np.append(h[1:], np.float32(65536.0))  # 65536: next step above 65504
    mid = ((h.astype(np.float64) + nxt) / 2).astype(np.float32)
    assert np.all(mid.astype(np.float64) == (h.astype(np.float64) + nxt) / 2)
    up = np.nextafter(mid, np.float32(np.inf))
    down = np.nextafter(mid, np.float32(0))
    extra = np.array([65519.0, 65519.996, 65520.0, 65536.0, 1e5, 3.4e38, np.inf,
                      1e-45, 1e-40, 1.1754942e-38, 2.0 ** -25, 2.0 ** -26, 3 * 2.0 ** -26,
                      5.960464477539063e-08, 2.0 ** -14, 2.0 ** -15 * 1.5],
                     np.float32)
    v = np.concatenate([h, mid, up, down, extra])
    return np.concatenate([v, -v])


def test_fp16_encode_equals_numpy_everywhere():
    v = _f32_probe_values()
    with np.errstate(over="ignore"):
        expect = v.astype(np.float16).view(np.uint16)
    out = np.empty(v.size, np.uint16)
    nbad = cpu.pack_fp16(v, None, None, out, 1.0)
    # what is not finite on the wire: +-inf, and every value beyond the range
    assert nbad == int(np.count_nonzero((expect & 0x7C00) == 0x7C00))
    bad = np.flatnonzero(out != expect)
    assert bad.size == 0, [(float(v[i]), hex(out[i]), hex(expect[i])) for i in bad[:5]]
    # overflow to inf, round half to even, subnormals
    check = {65504.0: 0x7BFF, 65519.0: 0x7BFF, 65520.0: 0x7C00, 1e5: 0x7C00,
             2.0 ** -24: 0x0001, 2.0 ** -25: 0x0000, 3 * 2.0 ** -26: 0x0001,
             3 * 2.0 ** -25: 0x0002, 1 + 2.0 ** -11: 0x3C00, 1 + 3 * 2.0 ** -11: 0x3C02,
             -0.0: 0x8000}
    xs = np.array(list(check), np.float32)
    out = np.empty(xs.size, np.uint16)
    cpu.pack_fp16(xs, None, None, out, 1.0)
    assert out.tolist() == list(check.values())


def test_fp16_decode_all_bit_patterns():
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    expect = bits.view(np.float16).astype(np.float32)
    for dt in DTYPES:
        out = np.empty(bits.size, dt)
        cpu.unpack_fp16(bits, out, False)
        nan = np.isnan(expect)
        assert np.array_equal(np.isnan(out), nan)
        assert_same(out[~nan], expect[~nan].astype(dt))


def test_fp16_overflow_is_inf_on_the_wire():
    """Values beyond the half range arrive as inf; compress refuses them (they
    would corrupt a residual) unless check_finite=False."""
    x = np.array([65520.0, -1e6, 65519.0], np.float32)
    with pytest.raises(mpigc.NonFiniteError):
        mpigc.FP16().compress(x)
    p = mpigc.FP16().compress(x, check_finite=False)
    assert p.view(np.uint16).tolist() == [0x7C00, 0xFC00, 0x7BFF]


def test_fp16_float64_goes_through_float32():
    """half(float32(v)): a float64 just above a half tie rounds to the tie in
    float32, then to even (a direct float64 -> half cast would round up)."""
    v = np.array([1 + 2.0 ** -11 + 2.0 ** -40], np.float64)
    assert v.astype(np.float16)[0] == np.float16(1 + 2.0 ** -10)
    p = mpigc.FP16().compress(v)
    assert p.view(np.uint16)[0] == 0x3C00


def test_fp16_residual_and_divisor():
    x = np.array([1 + 2.0 ** -12, 3.0, 60001.0 * 4], np.float32)
    e = np.zeros(3, np.float32)
    out = np.empty(3, np.uint16)
    cpu.pack_fp16(x, e, e, out, 4.0)
    np.testing.assert_array_equal(out.view(np.float16).astype(np.float32),
                                  [np.float16(0.25), 0.75, np.float16(60000.0)])
    # 240004 fits after / 4; 60001 rounds to 60000 (half step 32 there)
    np.testing.assert_array_equal(e, [2.0 ** -12, 0.0, 4.0])


# ----------------------------------------------------------------------------
# bf16 conversion: round to nearest even, NaN as 0x7FC0 with its sign
# ----------------------------------------------------------------------------
def _bf16_probe_bits():
    """Every one of the 65536 upper halves (every sign, exponent and kept
    significand, NaN and inf included) with low halves 0, 1, the tie 0x8000
    and its neighbours, 0xFFFF and a few random ones: 720896 float32 bit
    patterns, every rounding case of every bfloat16."""
    hi = np.arange(65536, dtype=np.uint32) << np.uint32(16)
    low = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF, 0x4000, 0xC000, 0x0100,
                    0x1234, 0xEDCB], np.uint32)
    return (hi[:, None] | low[None, :]).ravel()


def test_bf16_encode_equals_reference_on_bit_patterns():
    u = _bf16_probe_bits()
    v = u.view(np.float32)
    expect = ref.f32_to_bf16_bits(v)
    out = np.empty(v.size, np.uint16)
    nbad = cpu.pack_bf16(v, None, None, out, 1.0)
    bad = np.flatnonzero(out != expect)
    assert bad.size == 0, [(hex(u[i]), hex(out[i]), hex(expect[i])) for i in bad[:5]]
    # what is not finite on the wire: NaN, +-inf, and values rounding beyond the range
    assert nbad == int(np.count_nonzero((expect & 0x7F80) == 0x7F80))
    check = {0x3F808000: 0x3F80,  # 1 + 2**-8: tie, to even (down)
             0x3F818000: 0x3F82,  # 1 + 3 * 2**-8: tie, to even (up)
             0x3F808001: 0x3F81, 0x3F807FFF: 0x3F80,
             0x7F7F7FFF: 0x7F7F,  # just below the tie under the largest finite
             0x7F7F8000: 0x7F80,  # the tie above the largest bfloat16: inf
             0x7F7FFFFF: 0x7F80,  # float32's largest: inf
             0x7F800000: 0x7F80, 0xFF800000: 0xFF80,
             0x00008000: 0x0000, 0x00018000: 0x0002,  # subnormal ties
             0x807FFFFF: 0x8080,  # the largest subnormal rounds to the smallest normal
             0x80000000: 0x8000,
             # NaN: quiet NaN 0x7FC0 with the sign, payload dropped, never inf
             0x7F800001: 0x7FC0, 0xFF800001: 0xFFC0, 0x7FBF0000: 0x7FC0,
             0x7FFFFFFF: 0x7FC0, 0xFFFFFFFF: 0xFFC0, 0x7FC00000: 0x7FC0}
    xs = np.array(list(check), np.uint32).view(np.float32)
    out = np.empty(xs.size, np.uint16)
    cpu.pack_bf16(xs, None, None, out, 1.0)
    assert [hex(b) for b in out] == [hex(b) for b in check.values()]


def test_bf16_encode_equals_torch():
    """Finite values round as torch's float32 -> bfloat16 cast (torch sends a
    NaN as 0x7FC0 whatever its sign; mpigc keeps the sign, as fp16 does)."""
    torch = pytest.importorskip("torch")
    v = _bf16_probe_bits().view(np.float32)
    out = np.empty(v.size, np.uint16)
    cpu.pack_bf16(v, None, None, out, 1.0)
    t = torch.from_numpy(v.copy()).to(torch.bfloat16).view(torch.int16).numpy()
    fin = ~np.isnan(v)
    np.testing.assert_array_equal(out[fin], t.view(np.uint16)[fin])


def test_bf16_decode_all_bit_patterns():
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    expect = (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)
    for dt in DTYPES:
        out = np.empty(bits.size, dt)
        cpu.unpack_bf16(bits, out, False)
        nan = np.isnan(expect)
        assert np.array_equal(np.isnan(out), nan)
        assert_same(out[~nan], expect[~nan].astype(dt))
    out = np.empty(bits.size, np.float32)
    cpu.unpack_bf16(bits, out, False)
    assert_same(out, expect)  # exact, NaN payloads included


def test_bf16_overflow_is_inf_on_the_wire():
    """float32 values that round beyond the largest bfloat16 (3.3895e38) and
    float64 values beyond float32 arrive as inf: compress refuses them like NaN
    (residual unchanged) unless check_finite=False."""
    x = np.array([3.4e38, -3.4e38, 3.3895e38], np.float32)
    e = np.zeros(3, np.float32)
    with pytest.raises(mpigc.NonFiniteError, match="beyond the bf16 range"):
        mpigc.BF16(error_feedback=True).compress(x, e)
    assert not e.any()
    p = mpigc.BF16().compress(x, check_finite=False)
    assert p.view(np.uint16).tolist() == [0x7F80, 0xFF80, 0x7F7F]
    x64 = np.array([1e39, -1e300, 1.0], np.float64)
    assert cpu.pack_bf16(x64, None, None, np.empty(3, np.uint16), 1.0) == 2
    with pytest.raises(mpigc.NonFiniteError, match="beyond the bf16 range"):
        mpigc.BF16().compress(x64)
    # 1e39 / 4 fits: the count is of what is on the wire, after the division
    assert cpu.pack_bf16(x64[:1], None, None, np.empty(1, np.uint16), 4.0) == 0


def test_bf16_float64_goes_through_float32():
    """bf16(float32(v)): a float64 just above a bfloat16 tie rounds to the tie
    in float32, then to even (a direct float64 -> bfloat16 rounding would go up)."""
    v = np.array([1 + 2.0 ** -8 + 2.0 ** -40], np.float64)
    p = mpigc.BF16().compress(v)
    assert p.view(np.uint16)[0] == 0x3F80


def test_bf16_residual_and_divisor():
    x = np.array([1 + 2.0 ** -9, 3.0, 257.0 * 4, 3e38], np.float32)
    e = np.zeros(4, np.float32)
    out = np.empty(4, np.uint16)
    assert cpu.pack_bf16(x, e, e, out, 4.0) == 0
    dec = (out.astype(np.uint32) << np.uint32(16)).view(np.float32)
    # 257 is a tie between 256 and 258 (step 2 there): to even, 256
    np.testing.assert_array_equal(dec[:3], [0.25, 0.75, 256.0])
    np.testing.assert_array_equal(e[:3], [2.0 ** -9, 0.0, 4.0])
    assert np.isfinite(e[3]) and e[3] == np.float32(3e38) - dec[3] * np.float32(4)


# ----------------------------------------------------------------------------
# non-finite counts and the statistics kernel
# ----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_nonfinite_counts(dtype):
    rng = np.random.default_rng(7)
    x = rng.standard_normal(1001).astype(dtype)
    pos = rng.choice(1001, 37, replace=False)
    x[pos] = rng.choice([np.nan, np.inf, -np.inf], 37)
    assert cpu.count_nonfinite(x) == 37
    e = np.zeros_like(x)
    params = {"2bit": {"threshold": 0.5}, "1bit": {"block_size": 64},
              "2bit_rel": {"rel_threshold": 1.5, "block_size": 64},
              "fp16": {"divisor": 1.0}, "bf16": {"divisor": 1.0},
              "terngrad": {"scale": 1.0, "clip_bound": math.inf, "stream": 1, "offset": 0}}
    for fmt, prm in params.items():
        assert kernel_encode(fmt, prm, x, None, None)[1] == 37, fmt
        assert kernel_encode(fmt, prm, x, e, e.copy())[1] == 37, fmt
    s, ss, amax, nbad = cpu.stats(x, None)
    assert nbad == 37


@pytest.mark.parametrize("dtype", DTYPES)
@PROP
@given(x=vectors(max_n=2000), data=st.data())
def test_stats_are_sequential_float64(dtype, x, data):
    x = x.astype(dtype)
    e = None
    if data.draw(st.booleans()):
        e = np.random.default_rng(1).standard_normal(x.size).astype(dtype)
    v = (x if e is None else x + e).astype(np.float64)
    s, ss, amax, nbad = cpu.stats(x, e)
    if x.size:
        assert s == float(np.cumsum(v)[-1])
        assert ss == float(np.cumsum(v * v)[-1])
        assert amax == float(np.max(np.abs(v)))
    else:
        assert (s, ss, amax) == (0.0, 0.0, 0.0)
    assert nbad == 0


# ----------------------------------------------------------------------------
# the parallel kernel path gives the bytes of the serial one
# ----------------------------------------------------------------------------
def _everything(n, dtype, seed):
    """Payloads, residuals, decodings and statistics of every format."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * np.exp(rng.standard_normal(n))).astype(dtype)
    e0 = (rng.standard_normal(n) * 0.3).astype(dtype)
    s, ss, amax, nbad = cpu.stats(x, e0)
    # the float64 sums may be added in another order by the parallel kernel
    res = {"stats": (round(s, 6), float(np.float32(ss)), amax, nbad),
           "count": cpu.count_nonfinite(x)}
    configs = [("none", {}), ("fp16", {}), ("bf16", {}), ("2bit", {"threshold": 0.5}),
               ("1bit", {"block_size": 16}), ("1bit", {"block_size": 1024}),
               ("terngrad", {}), ("terngrad", {"clip": 2.5}),
               ("2bit", {"rel_threshold": 1.5}), ("2bit", {"rel_threshold": 1.0,
                                                           "block_size": 12})]
    for fmt, prm in configs:
        c = mpigc.get_compressor(fmt, **prm)
        kw = {"stream": 77, "offset": 3} if fmt == "terngrad" else {}
        e = e0.copy()
        p = c.compress(x, e, **kw)
        d = c.decompress(p, n, dtype=dtype)
        acc = np.linspace(-1, 1, n).astype(dtype)
        c.decompress(p, n, out=acc, accumulate=True)
        res[fmt + str(prm)] = (p.tobytes(), e.tobytes(), d.tobytes(), acc.tobytes())
    xb = x.copy()
    xb[::97] = np.nan
    res["count_bad"] = cpu.count_nonfinite(xb)
    with pytest.raises(mpigc.NonFiniteError):
        mpigc.TwoBit().compress(xb)
    return res


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs 2 Numba threads")
@pytest.mark.parametrize("dtype", DTYPES)
def test_parallel_path_gives_identical_bytes(monkeypatch, dtype):
    sizes = [1, 5, 13, 1027, 5003]
    serial = {n: _everything(n, dtype, n) for n in sizes}
    old = numba.get_num_threads()
    try:
        numba.set_num_threads(2)
        monkeypatch.setattr(cpu, "PARALLEL_MIN_ELEMENTS", 1)
        for n in sizes:
            assert cpu._nchunks(n) > 1  # the parallel kernels really run
            par = _everything(n, dtype, n)
            assert par.keys() == serial[n].keys()
            for k in par:
                assert par[k] == serial[n][k], (n, k)
    finally:
        numba.set_num_threads(old)


# ----------------------------------------------------------------------------
# 2bit, relative mode: per-block thresholds
# ----------------------------------------------------------------------------
@st.composite
def rel_inputs(draw):
    """Inputs of 1..5000 elements, float16/32/64, with zero blocks, huge and
    tiny values (all finite in the input dtype)."""
    dtype = np.dtype(draw(st.sampled_from([np.float16, np.float32, np.float64])))
    n = draw(st.integers(1, 5000))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    x = rng.standard_normal(n) * np.exp(rng.standard_normal(n) * draw(
        st.sampled_from([0.0, 1.0, 4.0])))
    info = np.finfo(dtype)
    kind = draw(st.sampled_from(["plain", "zero_blocks", "huge", "tiny", "mixed"]))
    if kind in ("zero_blocks", "mixed"):
        lo = int(rng.integers(0, n))
        x[lo:lo + int(rng.integers(1, 2000))] = 0.0
    if kind in ("huge", "mixed"):
        k = rng.choice(n, size=min(n, 5), replace=False)
        x[k] = rng.choice([-1, 1], k.size) * float(info.max) * rng.uniform(0.1, 1, k.size)
    if kind in ("tiny", "mixed"):
        k = rng.choice(n, size=max(1, n // 3), replace=False)
        x[k] = rng.standard_normal(k.size) * float(info.smallest_subnormal) * 4
    x = np.clip(x, -float(info.max), float(info.max)).astype(dtype)
    assert np.isfinite(x).all()
    wd = mpigc.compressors.work_dtype(dtype)
    e = None
    if draw(st.booleans()):
        e = (rng.standard_normal(n) * draw(st.sampled_from([0.0, 1e-3, 0.3]))).astype(wd)
        e[rng.random(n) < 0.2] = 0.0
    return x, e


@PROP
@given(xe=rel_inputs(), rel=rel_thresholds, block=rel_block_sizes)
def test_2bit_rel_matches_reference(xe, rel, block):
    """Packed bytes, mean magnitudes, residual and decoding == the reference
    bit for bit, through the public API (float16 is computed in float32); the
    non-finite count is that of v plus one per block whose threshold or mean
    magnitude overflows."""
    x, e = xe
    c = mpigc.TwoBit(rel_threshold=rel, block_size=block)
    wd = mpigc.compressors.work_dtype(x.dtype)
    e = np.zeros(x.size, wd) if e is None else e  # compress() adds the residual
    p_ref, r_ref = ref.encode_2bit_rel(x.astype(wd), rel, block, e)
    nblk = -(-x.size // block)
    r = np.frombuffer(p_ref[-4 * nblk:], "<f4")
    e_lib = e.copy()
    v = x.astype(wd) + e_lib
    t = ref.rel_thresholds(v, rel, block)
    bad = int(np.count_nonzero(~np.isfinite(v)))
    if bad == 0:
        bad = int(np.count_nonzero(~(np.isfinite(t) & np.isfinite(r))))
    if bad:
        with pytest.raises(mpigc.NonFiniteError):
            c.compress(x, e_lib)
        assert e_lib.tobytes() == e.tobytes()  # residual unchanged
        p = c.compress(x, e_lib, check_finite=False)
    else:
        p = c.compress(x, e_lib)
    assert p.size == c.payload_nbytes(x.size, wd) == len(p_ref)
    assert p.tobytes() == p_ref
    assert_same(e_lib, r_ref)
    for dt in DTYPES:
        assert_same(c.decompress(p, x.size, dtype=dt),
                    ref.decode_2bit_rel(p_ref, x.size, block, dt))
    # the kernel's own count, directly
    out = np.empty((x.size + 3) // 4, np.uint8)
    scales = np.empty(nblk, np.float32)
    nbad = cpu.pack_2bit_rel(x.astype(wd), e.copy(), None, out, scales, rel, block)
    assert nbad == bad


def test_2bit_rel_zero_block_sends_00_and_keeps_the_residual():
    """A block of zeros (and a block whose threshold underflows to 0 in
    float32) has t_b = 0: all codes 00, r_b = 0, nothing delivered, residual
    = v, no NaN anywhere."""
    x = np.zeros(20, np.float64)
    x[8:12] = 1e-300  # squares underflow to 0 in float64: t_b = 0
    x[12:16] = 1e-50  # t_b underflows float32: 0
    x[16:20] = [1.0, -1.0, 2.0, 0.0]
    e = np.zeros_like(x)
    c = mpigc.TwoBit(rel_threshold=1.0, block_size=4)
    p = c.compress(x, e)
    t = np.frombuffer(p[5:].tobytes(), "<f4")
    assert t[:4].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert p[:4].tolist() == [0, 0, 0, 0]
    assert_same(e[:16], x[:16])  # everything kept
    # the last block: t_b = sqrt(6 / 4) = 1.22, codes for 2.0 only, r_b = 2
    assert t[4] == 2.0
    assert p[4] == 0b00001100
    d = c.decompress(p, 20, dtype=np.float64)
    assert not np.isnan(d).any() and not d[:16].any()
    assert d[16:].tolist() == [0, 0, 2, 0] and e[16:].tolist() == [1, -1, 0, 0]


def test_2bit_rel_threshold_formula_and_layout():
    """t_b = float32(c * sqrt(mean of squares)) selects; codes after MXNet;
    the mean magnitudes r_b as little-endian float32 after the codes, in
    block order; a last, shorter block uses its own length."""
    x = np.array([3.0, -4.0, 0.0, 1.0, 2.0, 0.5, 1.25, -1.5], np.float32)  # 4 + 4
    c = mpigc.TwoBit(rel_threshold=1.0, block_size=4)
    for n in (8, 6):  # 6: the last block is [2.0, 0.5]
        t = ref.rel_thresholds(x[:n], 1.0, 4)
        assert t[0] == np.float32(math.sqrt(26 / 4))
        p = c.compress(x[:n])
        assert p.size == 2 + 8 == c.payload_nbytes(n)
        r = np.frombuffer(p[2:].tobytes(), "<f4")
        assert r[0] == 3.5  # (3 + 4) / 2
        if n == 8:
            # t_1 = sqrt(8.0625 / 4) = 1.42: 2.0 -> 11, -1.5 -> 10, r_1 = 1.75
            assert t[1] == np.float32(math.sqrt(8.0625 / 4)) and r[1] == 1.75
            assert p[:2].tolist() == [0b11100000, 0b11000010]
        else:
            # t_1 = sqrt(4.25 / 2) = 1.46: 2.0 -> 11, 0.5 -> 00, r_1 = 2
            assert t[1] == np.float32(math.sqrt(4.25 / 2)) and r[1] == 2.0
            # 3.0 >= 2.55 -> 11, -4.0 -> 10, 0 -> 00, 1.0 -> 00
            assert p[:2].tolist() == [0b11100000, 0b11000000]
        d = c.decompress(p, n)
        assert d.tolist() == [3.5, -3.5, 0, 0, r[1], 0, 0, -r[1]][:n]


def test_2bit_rel_decodes_the_mean_magnitude_by_hand():
    """[3, -1, 0.5, -4] with c = 1: t_b = sqrt(26.25 / 4) = 2.56 selects 3
    and -4; r_b = (3 + 4) / 2 = 3.5; decoded [3.5, 0, 0, -3.5], residual
    [-0.5, -1, 0.5, -0.5]."""
    x = np.array([3.0, -1.0, 0.5, -4.0], np.float32)
    assert ref.rel_thresholds(x, 1.0, 4)[0] == np.float32(math.sqrt(26.25 / 4))
    e = np.zeros(4, np.float32)
    c = mpigc.TwoBit(rel_threshold=1.0, block_size=4)
    p = c.compress(x, e)
    assert p.tobytes() == bytes([0b11000010]) + np.float32(3.5).tobytes()
    assert c.decompress(p, 4).tolist() == [3.5, 0.0, 0.0, -3.5]
    assert e.tolist() == [-0.5, -1.0, 0.5, -0.5]


def test_2bit_rel_canonical_sum_order_matters_and_is_followed():
    """A block whose float32 threshold depends on the order of the float64
    sum of squares: without the tiny squares sqrt(ss / 64) is the float32 tie
    1 + 2**-24 (-> 1.0). Added sequentially, every tiny square is lost; in
    the canonical 32-lane order they survive and t rounds up."""
    b = 64
    vals = np.array([8 * (1 + 2.0 ** -24)] + [2.0 ** -24] * (b - 1), np.float64)
    sq = vals * vals
    canonical = np.float32(math.sqrt(ref.canonical_sum(sq) / b))
    sequential = np.float32(math.sqrt(float(np.cumsum(sq)[-1]) / b))
    assert canonical == np.float32(1 + 2.0 ** -23) and sequential == np.float32(1.0)
    assert ref.rel_thresholds(vals, 1.0, b)[0] == canonical


def test_2bit_rel_mean_magnitude_follows_the_canonical_order():
    """The float64 sum of |v| over the selected values follows the same
    order: 64 + 2**-18 and 63 values 2**-48 (all selected with a tiny c)
    give the float32 tie 1 + 2**-24 (-> 1.0) when summed sequentially, but
    1 + 2**-23 in the canonical order (pairs of tiny values survive)."""
    b = 64
    vals = np.array([64 + 2.0 ** -18] + [2.0 ** -48] * (b - 1), np.float64)
    canonical = np.float32(ref.canonical_sum(vals) / b)
    sequential = np.float32(float(np.cumsum(vals)[-1]) / b)
    assert canonical == np.float32(1 + 2.0 ** -23) and sequential == np.float32(1.0)
    p = mpigc.TwoBit(rel_threshold=1e-20, block_size=b).compress(vals)
    assert p[:b // 4].tolist() == [255] * (b // 4)  # all selected, all positive
    assert np.frombuffer(p[b // 4:].tobytes(), "<f4")[0] == canonical


@pytest.mark.parametrize("dtype", DTYPES)
def test_2bit_rel_overflowing_threshold_is_counted(dtype):
    """Finite values whose threshold overflows float32 count as one bad
    value per block; nothing is selected (r_b = 0) and the residual keeps
    the values (all codes 00)."""
    big = 3e38 if dtype == np.float32 else 1e200  # 1e200: squares overflow float64
    x = np.array([big, big, 1.0, 1.0, big, -big, 1, 2], dtype)
    out = np.empty(2, np.uint8)
    scales = np.empty(2, np.float32)
    e = np.zeros_like(x)
    assert cpu.pack_2bit_rel(x, e, e, out, scales, 2.0, 4) == 2
    assert scales.tolist() == [0, 0] and out.tolist() == [0, 0]
    assert_same(e, x)
    with pytest.raises(mpigc.NonFiniteError):
        mpigc.TwoBit(rel_threshold=2.0, block_size=4).compress(x, np.zeros_like(x))


def test_2bit_rel_overflowing_mean_magnitude_is_counted():
    """float64 values with a finite float32 threshold whose mean magnitude
    overflows float32 (r_b would travel as inf): one bad value."""
    x = np.array([1e39, -1e39, 1e39, 1.0], np.float64)
    out = np.empty(1, np.uint8)
    scales = np.empty(1, np.float32)
    assert cpu.pack_2bit_rel(x, None, None, out, scales, 0.1, 4) == 1
    assert np.isinf(scales[0]) and out[0] == 0b11101100
    with pytest.raises(mpigc.NonFiniteError):
        mpigc.TwoBit(rel_threshold=0.1, block_size=4).compress(x, np.zeros_like(x))


def test_2bit_rel_nonfinite_never_corrupts_finite_residuals():
    """A NaN or inf in a block makes its threshold non-finite: every code of
    the block is 00 (or +-r_b = +-inf for the infinities; r_b = 0 for a NaN
    block) and the finite values keep their residual exactly; the count is
    that of the non-finite values."""
    x = np.array([1.0, np.nan, -2.0, 0.5, 3.0, np.inf, -1.0, 0.25, 1.0, 2.0, -3.0, 0.0],
                 np.float32)
    e = np.zeros_like(x)
    out = np.empty(3, np.uint8)
    scales = np.empty(3, np.float32)
    assert cpu.pack_2bit_rel(x, e, e, out, scales, 1.0, 4) == 2
    fin = np.isfinite(x)
    assert_same(e[fin][:6], x[fin][:6])  # blocks 0 and 1: nothing sent for finite values
    assert out[0] == 0 and scales[0] == 0 and np.isinf(scales[1])
    p_ref, r_ref = ref.encode_2bit_rel(x, 1.0, 4, np.zeros_like(x))
    assert out.tobytes() + scales.astype("<f4").tobytes() == p_ref
    assert_same(e, r_ref)


def test_2bit_rel_conservation_is_exact_on_a_dyadic_grid():
    """Error feedback over steps: delivered + residual == input, up to float
    rounding, with float64 values on a grid of 1/16."""
    rng = np.random.default_rng(5)
    c = mpigc.TwoBit(rel_threshold=1.0, block_size=4)
    e = np.zeros(103)
    delivered = np.zeros(103)
    total = np.zeros(103)
    for _ in range(10):
        g = np.repeat(rng.integers(-64, 64, 103 // 4 + 1), 4)[:103] / 16.0  # blocks const
        g[::4] *= 2
        g = g.astype(np.float64)
        delivered += c.decompress(c.compress(g, e), 103, dtype=np.float64)
        total += g
    np.testing.assert_allclose(delivered + e, total, rtol=0, atol=1e-12)
