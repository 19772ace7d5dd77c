"""Plain unit tests of the compressor API (no MPI): registry, configuration,
payload sizes, compress/decompress and their errors, golden wire vectors."""
import hashlib
import json
import math
import os

import numpy as np
import pytest

import mpigc
from mpigc import compressors as C

try:
    from .support import reference as ref
except ImportError:
    from support import reference as ref

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "golden.json")
IDS = ["1bit", "2bit", "bf16", "fp16", "none", "terngrad"]
CLASSES = {"none": mpigc.NoCompression, "fp16": mpigc.FP16, "bf16": mpigc.BF16,
           "2bit": mpigc.TwoBit,
           "1bit": mpigc.OneBit, "terngrad": mpigc.TernGrad}
# a non-default configuration of each id, as get_config returns it
CONFIGS = [
    {"id": "none"},
    {"id": "fp16", "error_feedback": True},
    {"id": "bf16", "error_feedback": True},
    {"id": "2bit", "threshold": 0.25, "error_feedback": False},
    {"id": "2bit", "rel_threshold": 1.5, "block_size": 64, "error_feedback": True},
    {"id": "1bit", "block_size": 64, "error_feedback": True},
    {"id": "terngrad", "seed": 7, "clip": 2.5, "error_feedback": True},
]
TERN_KW = {"stream": 12345, "offset": 0}


def _kw(c):
    return dict(TERN_KW) if c.codec_id == "terngrad" else {}


def _rng(seed=0):
    return np.random.default_rng(seed)


# ----------------------------------------------------------------------------
# registry
# ----------------------------------------------------------------------------
def test_available_ids():
    assert mpigc.available_compressors() == IDS


@pytest.mark.parametrize("cid", IDS)
def test_get_by_id(cid):
    c = mpigc.get_compressor(cid)
    assert type(c) is CLASSES[cid]
    assert c.codec_id == cid
    assert c == CLASSES[cid]()


def test_get_is_case_insensitive_and_none_means_none():
    assert mpigc.get_compressor("2BIT") == mpigc.TwoBit()
    assert type(mpigc.get_compressor(None)) is mpigc.NoCompression


def test_defaults():
    assert mpigc.get_compressor("2bit").get_config() == {
        "id": "2bit", "rel_threshold": 1.5, "block_size": 1024, "error_feedback": True}
    assert mpigc.get_compressor("1bit").get_config() == {
        "id": "1bit", "block_size": 1024, "error_feedback": True}
    assert mpigc.get_compressor("fp16").get_config() == {"id": "fp16", "error_feedback": False}
    assert mpigc.get_compressor("bf16").get_config() == {"id": "bf16", "error_feedback": False}
    assert mpigc.get_compressor("terngrad").get_config() == {
        "id": "terngrad", "seed": 0, "clip": None, "error_feedback": False}
    assert mpigc.get_compressor("none").get_config() == {"id": "none"}
    assert mpigc.get_compressor("2bit").uses_feedback
    assert not mpigc.get_compressor("fp16").uses_feedback
    assert not mpigc.get_compressor("bf16").uses_feedback
    assert mpigc.get_compressor("bf16", error_feedback=True).uses_feedback
    assert not mpigc.get_compressor("terngrad").uses_feedback
    assert not mpigc.get_compressor("none").uses_feedback


def test_mxnet_dict_form():
    c = mpigc.get_compressor({"type": "2bit", "threshold": 2.0})
    assert isinstance(c, mpigc.TwoBit) and c.threshold == 2.0


def test_id_key_and_both_keys():
    assert mpigc.get_compressor({"id": "2bit", "threshold": 2.0}).threshold == 2.0
    assert mpigc.get_compressor({"id": "2bit", "type": "2bit"}) == mpigc.TwoBit()
    with pytest.raises(mpigc.ConfigError):
        mpigc.get_compressor({"id": "2bit", "type": "1bit"})


def test_dict_without_type():
    with pytest.raises(mpigc.ConfigError, match="type"):
        mpigc.get_compressor({"threshold": 0.5})


def test_kwargs_and_merge_over_dict():
    assert mpigc.get_compressor("2bit", threshold=0.75).threshold == 0.75
    c = mpigc.get_compressor({"type": "2bit", "threshold": 0.5}, threshold=1.5)
    assert c.threshold == 1.5
    c = mpigc.get_compressor({"type": "1bit"}, block_size=256, error_feedback=False)
    assert c.block_size == 256 and c.error_feedback is False


def test_the_input_dict_is_not_modified():
    d = {"type": "2bit", "threshold": 0.5}
    mpigc.get_compressor(d, threshold=1.0)
    assert d == {"type": "2bit", "threshold": 0.5}


def test_compressor_object_is_returned_as_is():
    c = mpigc.TwoBit(threshold=3.0)
    assert mpigc.get_compressor(c) is c
    with pytest.raises(mpigc.ConfigError):
        mpigc.get_compressor(c, threshold=1.0)


def test_unknown_id_names_available_ids():
    with pytest.raises(mpigc.ConfigError) as info:
        mpigc.get_compressor("3bit")
    msg = str(info.value)
    assert "3bit" in msg
    for cid in IDS:
        assert cid in msg
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, mpigc.MpigcError)


@pytest.mark.parametrize("op", [5, 2.0, ["2bit"]])
def test_bad_op_type(op):
    with pytest.raises(mpigc.ConfigError):
        mpigc.get_compressor(op)


BAD_PARAMS = [
    ("2bit", {"threshold": 0}),
    ("2bit", {"threshold": -0.5}),
    ("2bit", {"threshold": float("nan")}),
    ("2bit", {"threshold": float("inf")}),
    ("2bit", {"threshold": 1e39}),  # inf in float32
    ("2bit", {"threshold": 1e-50}),  # 0 in float32
    ("2bit", {"threshold": True}),
    ("2bit", {"threshold": "0.5"}),
    ("2bit", {"error_feedback": 1}),
    ("2bit", {"error_feedback": "yes"}),
    ("2bit", {"rel_threshold": 0}),
    ("2bit", {"rel_threshold": -1.5}),
    ("2bit", {"rel_threshold": float("nan")}),
    ("2bit", {"rel_threshold": float("inf")}),
    ("2bit", {"rel_threshold": True}),
    ("2bit", {"rel_threshold": "1.5"}),
    ("2bit", {"rel_threshold": 1.5, "threshold": 0.5}),
    ("2bit", {"rel_threshold": 1.5, "block_size": 6}),
    ("2bit", {"rel_threshold": 1.5, "block_size": 0}),
    ("2bit", {"rel_threshold": 1.5, "block_size": -4}),
    ("2bit", {"rel_threshold": 1.5, "block_size": 8.0}),
    ("2bit", {"rel_threshold": 1.5, "block_size": True}),
    ("2bit", {"threshold": 0.5, "block_size": 512}),  # block_size in the absolute mode
    ("1bit", {"block_size": 12}),
    ("1bit", {"block_size": 0}),
    ("1bit", {"block_size": -8}),
    ("1bit", {"block_size": 8.0}),
    ("1bit", {"block_size": True}),
    ("terngrad", {"clip": 0}),
    ("terngrad", {"clip": -2.5}),
    ("terngrad", {"clip": float("nan")}),
    ("terngrad", {"clip": True}),
    ("terngrad", {"seed": 1.5}),
    ("terngrad", {"seed": True}),
    ("fp16", {"error_feedback": None}),
    ("2bit", {"thresold": 0.5}),
    ("1bit", {"threshold": 0.5}),
    ("none", {"error_feedback": True}),
    ("fp16", {"threshold": 0.5}),
    ("bf16", {"error_feedback": 1}),
    ("bf16", {"threshold": 0.5}),
]


@pytest.mark.parametrize("cid,params", BAD_PARAMS,
                         ids=[f"{c}-{sorted(p)[0]}={p[sorted(p)[0]]!r}" for c, p in BAD_PARAMS])
def test_bad_params(cid, params):
    with pytest.raises(mpigc.ConfigError) as info:
        mpigc.get_compressor(cid, **params)
    assert isinstance(info.value, ValueError)
    # the dict form and the class itself validate the same way
    with pytest.raises(mpigc.ConfigError):
        mpigc.get_compressor({"type": cid, **params})
    with pytest.raises(mpigc.ConfigError):
        CLASSES[cid](**params)


def test_2bit_threshold_and_rel_threshold_together_is_a_clear_error():
    with pytest.raises(mpigc.ConfigError, match="either threshold .* or rel_threshold"):
        mpigc.get_compressor("2bit", threshold=0.5, rel_threshold=1.5)
    with pytest.raises(mpigc.ConfigError, match="not both"):
        mpigc.get_compressor({"type": "2bit", "threshold": 0.5}, rel_threshold=1.5)
    # threshold=None is how a relative config may spell "no absolute threshold"
    c = mpigc.TwoBit(threshold=None, rel_threshold=1.5)
    assert c.relative and c.threshold is None and c == mpigc.TwoBit(rel_threshold=1.5)
    with pytest.raises(mpigc.ConfigError, match="block_size"):
        mpigc.TwoBit(rel_threshold=1.5, block_size=1022)


def test_2bit_without_a_threshold_is_the_relative_mode_everywhere():
    """One meaning of "2bit" (issue 45): the id, the dict form without a
    threshold (MXNet's compression_params spelling) and the class without
    arguments are the relative mode at rel_threshold=1.5; an explicit
    threshold is MXNet's absolute mode."""
    rel = {"id": "2bit", "rel_threshold": 1.5, "block_size": 1024, "error_feedback": True}
    for c in (mpigc.get_compressor("2bit"), mpigc.get_compressor({"type": "2bit"}),
              mpigc.get_compressor({"id": "2bit"}), mpigc.TwoBit(),
              mpigc.TwoBit(threshold=None), mpigc.get_compressor("2bit", threshold=None)):
        assert c.relative and c.get_config() == rel, c
    assert C.DEFAULT_REL_THRESHOLD == 1.5
    assert mpigc.get_compressor("2bit", block_size=256).get_config() == dict(rel, block_size=256)
    assert mpigc.get_compressor("2bit", error_feedback=False).get_config() == \
        dict(rel, error_feedback=False)
    for c in (mpigc.get_compressor("2bit", threshold=0.5),
              mpigc.get_compressor({"type": "2bit", "threshold": 0.5}), mpigc.TwoBit(threshold=0.5)):
        assert not c.relative and c.get_config() == {"id": "2bit", "threshold": 0.5,
                                                      "error_feedback": True}, c
    # a saved config keeps its meaning: the absolute form names its threshold
    old = {"id": "2bit", "threshold": 0.5, "error_feedback": True}
    assert mpigc.Compressor.from_config(old).get_config() == old
    with pytest.raises(mpigc.ConfigError, match="leave threshold out"):
        mpigc.get_compressor("2bit", threshold=0.5, block_size=256)


def test_2bit_modes():
    a, r = mpigc.TwoBit(threshold=0.5), mpigc.TwoBit(rel_threshold=2)
    assert not a.relative and a.threshold == 0.5
    assert r.relative and r.rel_threshold == 2.0 and type(r.rel_threshold) is float
    assert r.block_size == 1024 and r.threshold is None
    assert r != mpigc.TwoBit(rel_threshold=2.0, block_size=512)
    assert r != mpigc.TwoBit(rel_threshold=1.5)
    assert a.get_config() == {"id": "2bit", "threshold": 0.5, "error_feedback": True}
    assert r.get_config() == {"id": "2bit", "rel_threshold": 2.0, "block_size": 1024,
                              "error_feedback": True}


def test_unknown_parameter_message_names_the_parameters():
    with pytest.raises(mpigc.ConfigError) as info:
        mpigc.get_compressor("2bit", thresold=0.5)
    msg = str(info.value)
    assert "thresold" in msg and "threshold" in msg


def test_numeric_params_are_normalised():
    c = mpigc.get_compressor("2bit", threshold=np.float32(0.5))
    assert type(c.threshold) is float and c == mpigc.TwoBit(threshold=0.5)
    assert mpigc.TwoBit(threshold=1) == mpigc.TwoBit(threshold=1.0)
    c = mpigc.get_compressor("1bit", block_size=np.int64(64))
    assert type(c.block_size) is int and c == mpigc.OneBit(block_size=64)
    assert type(mpigc.TernGrad(clip=2).clip) is float
    assert type(mpigc.TernGrad(seed=np.int32(3)).seed) is int


# ----------------------------------------------------------------------------
# configuration
# ----------------------------------------------------------------------------
@pytest.mark.parametrize("config", CONFIGS, ids=[c["id"] for c in CONFIGS])
def test_config_json_round_trip(config):
    c = mpigc.get_compressor(dict(config))
    cfg = c.get_config()
    assert cfg == config
    text = json.dumps(cfg)
    back = type(c).from_config(json.loads(text))
    assert back == c and type(back) is type(c)
    assert mpigc.Compressor.from_config(json.loads(text)) == c
    assert hash(back) == hash(c)
    assert back.get_config() == cfg


@pytest.mark.parametrize("config", CONFIGS, ids=[c["id"] for c in CONFIGS])
def test_from_config_does_not_modify_its_argument(config):
    cfg = dict(config)
    mpigc.Compressor.from_config(cfg)
    assert cfg == config


def test_equality_and_hash():
    a, b = mpigc.TwoBit(threshold=0.5), mpigc.get_compressor({"type": "2bit",
                                                              "threshold": 0.5})
    assert a == b and hash(a) == hash(b)
    assert len({a, b, mpigc.TwoBit(threshold=0.25)}) == 2
    assert mpigc.TwoBit(threshold=0.5) != mpigc.TwoBit(threshold=0.25)
    assert mpigc.TwoBit() != mpigc.TwoBit(error_feedback=False)
    assert mpigc.OneBit() != mpigc.TwoBit()
    assert mpigc.FP16() != mpigc.NoCompression()
    assert mpigc.BF16() != mpigc.FP16()
    assert mpigc.TernGrad(seed=1) != mpigc.TernGrad(seed=2)
    assert mpigc.TwoBit(threshold=0.5) != {"id": "2bit", "threshold": 0.5,
                                           "error_feedback": True}
    assert mpigc.TwoBit() != "2bit"


def test_repr():
    assert repr(mpigc.get_compressor({"type": "2bit", "threshold": 2.0})) == \
        "TwoBit(threshold=2.0, error_feedback=True)"
    assert repr(mpigc.OneBit(block_size=64)) == "OneBit(block_size=64, error_feedback=True)"
    assert repr(mpigc.TwoBit(rel_threshold=1.5, block_size=64)) == \
        "TwoBit(rel_threshold=1.5, block_size=64, error_feedback=True)"
    assert repr(mpigc.TernGrad()) == "TernGrad(seed=0, clip=None, error_feedback=False)"
    assert repr(mpigc.FP16()) == "FP16(error_feedback=False)"
    assert repr(mpigc.BF16()) == "BF16(error_feedback=False)"
    assert repr(mpigc.NoCompression()) == "NoCompression()"


@pytest.mark.parametrize("config", CONFIGS, ids=[c["id"] for c in CONFIGS])
def test_repr_round_trips(config):
    c = mpigc.get_compressor(dict(config))
    assert eval(repr(c), {k: getattr(mpigc, k) for k in mpigc.__all__}) == c


# ----------------------------------------------------------------------------
# payload sizes
# ----------------------------------------------------------------------------
SIZES = [0, 1, 2, 3, 4, 5, 7, 8, 9, 13, 15, 16, 17, 1023, 1024, 1025, 1027, 4096, 10**6 + 3]


@pytest.mark.parametrize("n", SIZES)
def test_payload_nbytes(n):
    assert mpigc.NoCompression().payload_nbytes(n) == 4 * n
    assert mpigc.NoCompression().payload_nbytes(n, np.float64) == 8 * n
    assert mpigc.FP16().payload_nbytes(n) == 2 * n
    assert mpigc.FP16().payload_nbytes(n, np.float64) == 2 * n
    assert mpigc.BF16().payload_nbytes(n) == 2 * n
    assert mpigc.BF16().payload_nbytes(n, np.float64) == 2 * n
    assert mpigc.TwoBit(threshold=0.5).payload_nbytes(n) == math.ceil(n / 4)
    assert mpigc.TwoBit(threshold=0.5).payload_nbytes(n, np.float64) == math.ceil(n / 4)
    assert mpigc.TwoBit().payload_nbytes(n) == math.ceil(n / 4) + 4 * math.ceil(n / 1024)
    for b in (8, 16, 1024):
        assert mpigc.OneBit(block_size=b).payload_nbytes(n) == \
            math.ceil(n / 8) + 8 * math.ceil(n / b)
    assert mpigc.TernGrad().payload_nbytes(n) == (math.ceil(n / 4) + 4 if n else 0)
    for b in (4, 12, 1024):
        assert mpigc.TwoBit(rel_threshold=1.5, block_size=b).payload_nbytes(n) == \
            math.ceil(n / 4) + 4 * math.ceil(n / b)
    for cid in IDS:
        assert type(mpigc.get_compressor(cid).payload_nbytes(n)) is int


def test_onebit_pairs_cost_at_most_7_percent_at_default_block():
    c = mpigc.OneBit()
    n = 1024 * 100
    assert (c.payload_nbytes(n) - n // 8) / c.payload_nbytes(n) <= 0.07


@pytest.mark.parametrize("cid", IDS)
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("n", [0, 1, 5, 13, 1027])
def test_compress_size_matches_payload_nbytes(cid, dtype, n):
    c = mpigc.get_compressor(cid)
    x = _rng(n).standard_normal(n).astype(dtype)
    p = c.compress(x, **_kw(c))
    assert p.dtype == np.uint8 and p.ndim == 1
    assert p.size == c.payload_nbytes(n, C.work_dtype(dtype))
    d = c.decompress(p, n, dtype=dtype)
    assert d.dtype == dtype and d.shape == (n,)


# ----------------------------------------------------------------------------
# compress / decompress against the reference
# ----------------------------------------------------------------------------
@pytest.mark.parametrize("config", CONFIGS, ids=[c["id"] for c in CONFIGS])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_compress_matches_reference(config, dtype):
    c = mpigc.get_compressor(dict(config))
    rng = _rng(1)
    x = rng.standard_normal(1027).astype(dtype)
    e = (rng.standard_normal(1027) * 0.3).astype(dtype)
    p_ref, e_ref = ref.encode(c.get_config(), x, e, **_kw(c))
    e_lib = e.copy()
    p = c.compress(x, e_lib, **_kw(c))
    assert p.tobytes() == p_ref
    np.testing.assert_array_equal(e_lib, e_ref)
    np.testing.assert_array_equal(c.decompress(p, x.size, dtype=dtype),
                                  ref.decode(c.get_config(), p_ref, x.size, dtype))


def test_mxnet_example():
    c = mpigc.get_compressor({"type": "2bit", "threshold": 2})
    x = np.array([0.5, 3.1, -1.0, -2.0, 2.0, 0.1, 1.9, -7.0], np.float32)
    p = c.compress(x)
    assert p.tolist() == [0x32, 0xC2]
    np.testing.assert_array_equal(c.decompress(p, 8), [0, 2, 0, -2, 2, 0, 0, -2])
    e = np.zeros(8, np.float32)
    c.compress(x, e)
    np.testing.assert_array_equal(e, x - np.array([0, 2, 0, -2, 2, 0, 0, -2], np.float32))


def test_x_is_not_modified_and_no_residual_means_no_feedback():
    rng = _rng(2)
    for cid in IDS:
        c = mpigc.get_compressor(cid)
        x = rng.standard_normal(100).astype(np.float32)
        x0 = x.copy()
        p1 = c.compress(x, **_kw(c))
        p2 = c.compress(x, **_kw(c))
        np.testing.assert_array_equal(x, x0)
        assert p1.tobytes() == p2.tobytes()


@pytest.mark.parametrize("cid", IDS)
def test_multidimensional_input_is_flattened(cid):
    c = mpigc.get_compressor(cid)
    x = _rng(3).standard_normal((5, 7)).astype(np.float32)
    e = np.zeros((5, 7), np.float32)
    e_flat = np.zeros(35, np.float32)
    p = c.compress(x, e, **_kw(c))
    assert p.tobytes() == c.compress(x.reshape(-1), e_flat, **_kw(c)).tobytes()
    np.testing.assert_array_equal(e.reshape(-1), e_flat)


@pytest.mark.parametrize("cid", IDS)
def test_compress_into_out(cid):
    c = mpigc.get_compressor(cid)
    x = _rng(4).standard_normal(37).astype(np.float32)
    out = np.full(c.payload_nbytes(37), 0xAA, np.uint8)
    r = c.compress(x, out=out, **_kw(c))
    assert r is out
    assert out.tobytes() == c.compress(x, **_kw(c)).tobytes()


@pytest.mark.parametrize("cid", IDS)
@pytest.mark.parametrize("bad", ["short", "long", "dtype", "2d", "strided"])
def test_compress_bad_out(cid, bad):
    c = mpigc.get_compressor(cid)
    x = _rng(4).standard_normal(37).astype(np.float32)
    nb = c.payload_nbytes(37)
    out = {"short": np.empty(nb - 1, np.uint8), "long": np.empty(nb + 1, np.uint8),
           "dtype": np.empty(nb, np.int8), "2d": np.empty((1, nb), np.uint8),
           "strided": np.empty(2 * nb, np.uint8)[::2]}[bad]
    with pytest.raises(mpigc.InvalidBufferError):
        c.compress(x, out=out, **_kw(c))


@pytest.mark.parametrize("cid", IDS)
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_decompress_out_and_accumulate(cid, dtype):
    c = mpigc.get_compressor(cid)
    rng = _rng(5)
    n = 41
    x = rng.standard_normal(n).astype(dtype)
    p = c.compress(x, **_kw(c))
    wd = C.work_dtype(dtype)
    decoded = ref.decode(c.get_config(), p.tobytes(), n, wd)
    # new array
    d = c.decompress(p, n, dtype=dtype)
    assert d.dtype == dtype
    np.testing.assert_array_equal(d, decoded.astype(dtype))
    # into out
    out = np.full(n, 7.0, dtype)
    assert c.decompress(p, n, out=out) is out
    np.testing.assert_array_equal(out, decoded.astype(dtype))
    # accumulate: one addition per element, in the work dtype for float16
    base = rng.standard_normal(n).astype(dtype)
    out = base.copy()
    assert c.decompress(p, n, out=out, accumulate=True) is out
    np.testing.assert_array_equal(out, (base.astype(wd) + decoded).astype(dtype))


def test_decompress_accumulate_sums_contributions():
    c = mpigc.TwoBit(threshold=1.0)
    rng = _rng(6)
    out = np.zeros(50, np.float32)
    expect = np.zeros(50, np.float32)
    for _ in range(3):
        p = c.compress(rng.standard_normal(50).astype(np.float32) * 2)
        c.decompress(p, 50, out=out, accumulate=True)
        expect += ref.decode_2bit(p.tobytes(), 50, 1.0)
    np.testing.assert_array_equal(out, expect)


@pytest.mark.parametrize("cid", IDS)
def test_float16_input_is_computed_in_float32(cid):
    c = mpigc.get_compressor(cid)
    rng = _rng(7)
    x16 = rng.standard_normal(29).astype(np.float16)
    e = (rng.standard_normal(29) * 0.2).astype(np.float32)
    e_lib = e.copy()
    p = c.compress(x16, e_lib, **_kw(c))
    p_ref, e_ref = ref.encode(c.get_config(), x16.astype(np.float32), e, **_kw(c))
    assert p.tobytes() == p_ref
    assert e_lib.dtype == np.float32
    np.testing.assert_array_equal(e_lib, e_ref)
    with pytest.raises(mpigc.InvalidBufferError):
        c.compress(x16, e.astype(np.float16), **_kw(c))


# ----------------------------------------------------------------------------
# validation errors
# ----------------------------------------------------------------------------
@pytest.mark.parametrize("cid", IDS)
def test_residual_validation(cid):
    c = mpigc.get_compressor(cid)
    x = np.ones(10, np.float32)
    bad = [np.zeros(9, np.float32), np.zeros(11, np.float32), np.zeros(10, np.float64),
           np.zeros(10, np.float16)]
    for e in bad:
        with pytest.raises(mpigc.InvalidBufferError):
            c.compress(x, e, **_kw(c))
    e = np.zeros(10, np.float32)
    e.flags.writeable = False
    with pytest.raises(mpigc.InvalidBufferError):
        c.compress(x, e, **_kw(c))
    with pytest.raises(mpigc.InvalidBufferError):
        c.compress(x, np.zeros(20, np.float32)[::2], **_kw(c))
    with pytest.raises(mpigc.DTypeError):
        c.compress(x, np.zeros(10, np.int32), **_kw(c))
    with pytest.raises(mpigc.DTypeError):
        c.compress(x, [0.0] * 10, **_kw(c))
    x64 = np.ones(10, np.float64)
    with pytest.raises(mpigc.InvalidBufferError):
        c.compress(x64, np.zeros(10, np.float32), **_kw(c))


@pytest.mark.parametrize("cid", IDS)
def test_input_validation(cid):
    c = mpigc.get_compressor(cid)
    with pytest.raises(mpigc.DTypeError) as info:
        c.compress(np.ones(10, np.int32))
    assert isinstance(info.value, TypeError)
    with pytest.raises(mpigc.DTypeError):
        c.compress(np.ones(10, np.complex64))
    with pytest.raises(mpigc.DTypeError):
        c.compress([1.0, 2.0])
    with pytest.raises(mpigc.InvalidBufferError):
        c.compress(np.ones(20, np.float32)[::2])


@pytest.mark.parametrize("cid", IDS)
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_raises_and_keeps_residual(cid, dtype, bad):
    c = mpigc.get_compressor(cid)
    rng = _rng(8)
    x = rng.standard_normal(23).astype(dtype)
    x[11] = bad
    e = (rng.standard_normal(23) * 0.1).astype(C.work_dtype(dtype))
    e0 = e.copy()
    with pytest.raises(mpigc.NonFiniteError) as info:
        c.compress(x, e, **_kw(c))
    assert isinstance(info.value, FloatingPointError)
    assert isinstance(info.value, mpigc.MpigcError)
    assert e.tobytes() == e0.tobytes()
    with pytest.raises(mpigc.NonFiniteError):
        c.compress(x, **_kw(c))


@pytest.mark.parametrize("cid", IDS)
def test_nonfinite_residual_raises_and_is_kept(cid):
    c = mpigc.get_compressor(cid)
    x = np.ones(9, np.float32)
    e = np.zeros(9, np.float32)
    e[4] = np.nan
    e0 = e.copy()
    with pytest.raises(mpigc.NonFiniteError):
        c.compress(x, e, **_kw(c))
    assert e.tobytes() == e0.tobytes()


@pytest.mark.parametrize("cid", ["2bit", "1bit", "fp16", "bf16", "none"])
def test_nonfinite_without_check_does_not_raise(cid):
    c = mpigc.get_compressor(cid, **({"threshold": 0.5} if cid == "2bit" else {}))
    x = np.ones(9, np.float32)
    x[2] = np.inf
    e = np.zeros(9, np.float32)
    p = c.compress(x, e, check_finite=False)
    assert p.size == c.payload_nbytes(9)
    if cid == "2bit":
        # finite elements still get their residual (in place, no scratch buffer)
        np.testing.assert_array_equal(np.delete(e, 2), np.float32(0.5))


@pytest.mark.parametrize("cid", IDS)
def test_decompress_validation(cid):
    c = mpigc.get_compressor(cid)
    x = _rng(9).standard_normal(13).astype(np.float32)
    p = c.compress(x, **_kw(c))
    for bad in (p[:-1], np.concatenate([p, p[:1]])):
        with pytest.raises(mpigc.InvalidBufferError) as info:
            c.decompress(bad, 13)
        assert isinstance(info.value, ValueError)
    with pytest.raises(mpigc.InvalidBufferError):
        c.decompress(p, 12 if cid != "1bit" else 5)
    with pytest.raises(mpigc.InvalidBufferError):
        c.decompress(p.view(np.int8), 13)
    with pytest.raises(mpigc.InvalidBufferError):
        c.decompress(p.reshape(1, -1), 13)
    with pytest.raises(mpigc.InvalidBufferError):
        c.decompress(p, 13, out=np.zeros(12, np.float32))
    with pytest.raises(mpigc.DTypeError):
        c.decompress(p, 13, out=np.zeros(13, np.int32))


def test_decompress_none_needs_payload_of_the_out_dtype():
    c = mpigc.NoCompression()
    p = c.compress(np.ones(4, np.float32))
    with pytest.raises(mpigc.InvalidBufferError):
        c.decompress(p, 4, dtype=np.float64)
    assert c.decompress(p, 2, dtype=np.float64).size == 2  # 16 bytes = 2 float64


def test_terngrad_zero_input_and_empty():
    c = mpigc.TernGrad()
    p = c.compress(np.zeros(7, np.float32), stream=1)
    assert p.tobytes() == bytes(2) + np.float32(0).tobytes()
    np.testing.assert_array_equal(c.decompress(p, 7), np.zeros(7))
    for cid in IDS:
        c = mpigc.get_compressor(cid)
        e = np.zeros(0, np.float32)
        p = c.compress(np.zeros(0, np.float32), e, **_kw(c))
        assert p.size == 0
        assert c.decompress(p, 0).size == 0


# ----------------------------------------------------------------------------
# golden vectors (tests/fixtures/golden.json, built from the reference)
# ----------------------------------------------------------------------------
def _load_golden():
    with open(GOLDEN) as f:
        return json.load(f)["cases"]


CASES = _load_golden()


def _from_hex(h, dtype):
    return np.frombuffer(bytes.fromhex(h), np.dtype(dtype).newbyteorder("<")).astype(dtype)


def _check_array(case, name, a):
    b = np.ascontiguousarray(a, a.dtype.newbyteorder("<")).tobytes()
    if name + "_hex" in case:
        assert b.hex() == case[name + "_hex"], name
    else:
        assert hashlib.sha256(b).hexdigest() == case[name + "_sha256"], name


def _case_inputs(case):
    dtype = np.dtype(case["dtype"])
    x = _from_hex(case["x_hex"], dtype)
    assert x.size == case["n"]
    e = case["residual_in_hex"]
    e = None if e is None else _from_hex(e, C.work_dtype(dtype))
    return x, e


def test_golden_fixture_covers_every_format():
    ids = {c["config"]["id"] for c in CASES}
    assert ids == set(IDS)
    names = {c["name"] for c in CASES}
    assert "mxnet_example" in names
    for fmt in IDS:
        for dt in ("float32", "float64", "float16"):
            assert any(c["config"]["id"] == fmt and c["dtype"] == dt for c in CASES)
    assert [c for c in CASES if c["name"] == "mxnet_example"][0]["payload_hex"] == "32c2"


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_golden_library(case):
    c = mpigc.get_compressor(dict(case["config"]))
    assert c.get_config() == case["config"]
    x, e = _case_inputs(case)
    n = case["n"]
    wd = C.work_dtype(x.dtype)
    kw = dict(case["kwargs"])
    assert c.payload_nbytes(n, wd) * 2 == len(case["payload_hex"])
    if e is None:
        p = c.compress(x, **kw)
    else:
        res = e.copy()
        p = c.compress(x, res, **kw)
        _check_array(case, "residual_out", res)
    assert p.tobytes().hex() == case["payload_hex"]
    _check_array(case, "decoded", c.decompress(p, n, dtype=wd))


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_golden_reference(case):
    """The reference still produces the committed vectors (so a change of
    reference.py is seen too; rebuild with tests/fixtures/make_golden.py)."""
    x, e = _case_inputs(case)
    wd = C.work_dtype(x.dtype)
    p, res = ref.encode(case["config"], x.astype(wd), e, **case["kwargs"])
    assert p.hex() == case["payload_hex"]
    _check_array(case, "residual_out", res)
    _check_array(case, "decoded", ref.decode(case["config"], p, case["n"], wd))


# ----------------------------------------------------------------------------
# regressions of bugs found by these tests
# ----------------------------------------------------------------------------
def test_fp16_finite_input_never_leaves_a_nonfinite_residual():
    c = mpigc.FP16(error_feedback=True)
    x = np.array([7e4, 1.0], np.float32)
    e = np.zeros(2, np.float32)
    try:
        c.compress(x, e)
    except mpigc.NonFiniteError:
        assert not e.any()  # refused: residual unchanged
    else:
        assert np.isfinite(e).all()


@pytest.mark.parametrize("n", [1, 8])
def test_terngrad_clip_delivers_a_constant_gradient(n):
    c = mpigc.TernGrad(clip=2.5, error_feedback=True)
    g = np.full(n, 0.5, np.float32)
    e = np.zeros(n, np.float32)
    delivered = np.zeros(n)
    steps = 50
    for k in range(steps):
        delivered += c.decompress(c.compress(g, e, stream=k), n)
    np.testing.assert_allclose(delivered / steps, g, atol=0.1)


# ----------------------------------------------------------------------------
# finite values that a wire format cannot carry (issue 14)
# ----------------------------------------------------------------------------
# the configurations of the wire formats, and the (config, dtype) pairs whose
# largest values do not fit: fp16's halves, bf16's bfloat16s; the float32
# means, magnitudes, thresholds or scale of 1bit, relative 2bit and terngrad
# (float64 input; float32 input too for relative 2bit, whose threshold is
# c * rms with c > 1)
RANGE_CONFIGS = {"none": {"id": "none"}, "2bit": {"id": "2bit", "threshold": 0.5},
                 "2bit_rel": {"id": "2bit", "rel_threshold": 1.5},
                 "1bit": {"id": "1bit"},
                 "terngrad": {"id": "terngrad", "error_feedback": True},
                 "fp16": {"id": "fp16", "error_feedback": True},
                 "bf16": {"id": "bf16", "error_feedback": True}}
# bf16: float32's largest value rounds up to inf (the largest bfloat16 is
# 0x7F7F, 3.3895e38); float64's 1e39 is beyond float32
BEYOND = {("fp16", np.float32), ("fp16", np.float64), ("bf16", np.float32),
          ("bf16", np.float64), ("1bit", np.float64),
          ("terngrad", np.float64), ("2bit_rel", np.float32), ("2bit_rel", np.float64)}


@pytest.mark.parametrize("name", sorted(RANGE_CONFIGS))
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_finite_values_beyond_the_wire_range(name, dtype):
    """Never a silent inf, 0 or NaN: values beyond what the wire carries are
    refused like NaN (residual unchanged); the others round-trip with a
    finite residual that keeps what was not delivered."""
    c = mpigc.get_compressor(RANGE_CONFIGS[name])
    big = 1e39 if dtype == np.float64 else float(np.finfo(dtype).max)
    x = np.full(40, big).astype(dtype)
    x[1::2] = -big
    x[5] = 1.0
    wd = C.work_dtype(dtype)
    e = np.zeros(40, wd)
    if (name, dtype) in BEYOND:
        with pytest.raises(mpigc.NonFiniteError, match="beyond the"):
            c.compress(x, e, **_kw(c))
        assert not e.any()
        return
    p = c.compress(x, e if c.uses_feedback or name == "none" else None, **_kw(c))
    d = c.decompress(p, 40, dtype=wd)
    assert np.isfinite(d).all() and np.isfinite(e).all()
    if c.uses_feedback:
        np.testing.assert_allclose(d + e, x.astype(wd), rtol=0, atol=1e-6 * big)
    else:
        np.testing.assert_allclose(d, x.astype(wd), rtol=0, atol=1e-6 * big)
