"""A call's settings: its arguments validated once per call signature
(:func:`settings_for`, a :class:`Settings` record), the buffer's checks (:func:`adopt_input`), and the
environment variables that shape a call (:func:`min_compress_bytes`,
:func:`chunk_bytes`, :func:`default_nonfinite`). No MPI, no state beyond a
cache of validated settings."""
import json
import os
import zlib
from typing import NamedTuple

import numpy as np

from . import _dispatch
from . import _plan
from . import _wire
from ._errors import ConfigError, DTypeError, InvalidBufferError
from .compressors import SUPPORTED_DTYPES, get_compressor
from .feedback import shard_bounds

__all__ = ["NONFINITE_POLICIES", "GATHER_MODES", "default_nonfinite", "min_compress_bytes",
           "chunk_bytes", "adopt_input", "Settings", "settings_for", "settings_key",
           "AUTO_MARK"]

NONFINITE_POLICIES = ("raise", "skip", "ignore")
# The parameter under which an op="auto" call (mpigc._auto) passes its mark:
# not the compressor's (taken out before it is made, never in its config nor
# in the residuals'), but in the settings and so in their fingerprint, which
# every rank's agreement row compares: an op="auto" call meets a plain call,
# or one with other auto settings, with a MismatchError on every rank.
AUTO_MARK = "mpigc.auto"
GATHER_MODES = ("compressed", "exact")


def default_nonfinite():
    return os.environ.get("MPIGC_NONFINITE", "raise")


def min_compress_bytes():
    """``$MPIGC_MIN_COMPRESS_BYTES``: compressed ops on smaller buffers (in
    bytes, the buffer's own dtype) run as ``op="none"`` (plain MPI sum, no
    residual used or changed). Default 8192; 0 always compresses. Ranks must
    agree (a difference is reported as a settings mismatch)."""
    return _wire.env_int("MPIGC_MIN_COMPRESS_BYTES", 8192)


def chunk_bytes():
    """``$MPIGC_CHUNK_BYTES``: compressed calls on host buffers of at least
    twice this many bytes (the buffer's own dtype) are pipelined in chunks of
    about this size: a chunk's payloads travel while the next chunk is
    compressed, and an owner recompresses a chunk of its shard as soon as
    every rank's contribution to it is in (see ``_Op._chunk_plan``).
    Default 2 MiB; 0 turns pipelining off. The results are the same bits
    either way. Ranks must agree (a difference is reported as a mismatch on
    the chunking)."""
    return _wire.env_int("MPIGC_CHUNK_BYTES", 2 << 20)


class Settings(NamedTuple):
    """A call's validated settings (:func:`settings_for`), frozen and shared
    by every call of one signature: the compressor (``comp``), ``average``,
    ``gather``, the ``nonfinite`` policy (the default resolved), the shards'
    ``bounds`` (``[(lo, hi)]`` per rank), the residuals' ``key`` (the
    default resolved), whether MPI sums the values (``plain``: op="none" or
    the small-buffer fallback), the settings that ranks must agree on
    (``config``, a dict, never changed) and their CRC (``fp``)."""
    comp: object
    average: bool
    gather: str
    nonfinite: str
    bounds: list
    key: str
    plain: bool
    config: dict
    fp: int


# validated settings and their fingerprint per call signature (see settings_key)
_settings_cache = {}
_SETTINGS_CACHE_MAX = 4096
_SCALAR = (str, int, float, bool, type(None))


def settings_key(kind, op, params, key, average, gather, nonfinite, n, dtype, recvcounts,
                  size, max_count):
    """What the validated settings of a call depend on, as a hashable key, or
    None where an argument is not a plain value (a compressor object, a dict
    op with a value that is not a plain scalar: validated on every call). A
    dict op of plain values is keyed by its items as they are at this call
    (a dict changed between calls is another key). The environment
    variables that settings read are part of the key, so changing them
    takes effect."""
    if type(op) is dict:
        if not all(type(k) is str and isinstance(v, _SCALAR) for k, v in op.items()):
            return None
        op = ("dict", repr(sorted(op.items())))
    elif not isinstance(op, str):
        return None
    if not (isinstance(average, bool)
            and isinstance(gather, (str, type(None)))
            and isinstance(nonfinite, (str, type(None)))
            and isinstance(key, (str, int, type(None)))):
        return None
    if params and not all(isinstance(v, _SCALAR) for v in params.values()):
        return None
    if recvcounts is not None:
        if not (isinstance(recvcounts, (list, tuple))
                and all(type(c) is int for c in recvcounts)):
            return None
        recvcounts = tuple(recvcounts)
    return (kind, op, repr(sorted(params.items())) if params else "", type(key), key,
            average, gather, nonfinite, n, dtype, recvcounts, size,
            _wire.getenv("MPIGC_NONFINITE"), _wire.getenv("MPIGC_MIN_COMPRESS_BYTES"),
            max_count)


def adopt_input(kind, buf, cs):
    """The checks every call (flat or hierarchical) makes of its buffer:
    ``(backend, array, dtype)``, the array as the backend sees it (dtype and
    shape come from it, never from ``buf``: a torch tensor's dtype is a torch
    dtype); raises DTypeError or InvalidBufferError."""
    be = _dispatch.backend(buf)
    dbuf = be.adopt(buf, kind, cs)
    dtype = np.dtype(dbuf.dtype)
    if dtype not in SUPPORTED_DTYPES or not dtype.isnative:
        raise DTypeError(f"{kind}: expected float16, float32 or float64 "
                         f"(native byte order), got {dtype}")
    if dbuf.size == 0:
        raise InvalidBufferError(f"{kind}: expected a non-empty array, got shape "
                                 f"{tuple(dbuf.shape)}")
    if not be.is_c_contiguous(buf, dbuf):
        raise InvalidBufferError(f"{kind}: expected a C-contiguous array; pass "
                                 "a contiguous copy and copy the result back")
    if kind == "allreduce" and not be.is_writable(buf):
        raise InvalidBufferError("allreduce: expected a writable array (it reduces in "
                                 "place), got a read-only one")
    return be, dbuf, dtype


def settings_for(kind, dtype, size, op, params, key, average, gather, nonfinite, n,
                 recvcounts, limits=None):
    """A call's :class:`Settings`, validated (raises ConfigError or
    InvalidBufferError); cached per :func:`settings_key`. ``limits``: the
    call's :class:`mpigc._wire.Limits` (None: read now), whose ``max_count``
    decides in how many pieces MPI sums a plain call."""
    if limits is None:
        limits = _wire.read_limits()
    max_count = limits.max_count
    ck = settings_key(kind, op, params, key, average, gather, nonfinite, n, dtype,
                       recvcounts, size, max_count)
    hit = None if ck is None else _settings_cache.get(ck)
    if hit is None:
        hit = _validate_settings(kind, dtype, size, op, params, key, average, gather,
                                 nonfinite, n, recvcounts, max_count)
        if ck is not None:
            if len(_settings_cache) >= _SETTINGS_CACHE_MAX:
                _settings_cache.clear()
            _settings_cache[ck] = hit
    return hit


def _validate_settings(kind, dtype, size, op, params, key, average, gather, nonfinite, n,
                       recvcounts, max_count):
    mark = params.get(AUTO_MARK)
    if mark is not None:
        params = {k: v for k, v in params.items() if k != AUTO_MARK}
    comp = get_compressor(op, **params)
    if gather not in GATHER_MODES:
        raise ConfigError(f"gather must be one of {GATHER_MODES}, got {gather!r}")
    if nonfinite is None:
        nonfinite = default_nonfinite()
    if nonfinite not in NONFINITE_POLICIES:
        raise ConfigError(f"nonfinite must be one of {NONFINITE_POLICIES}, got "
                          f"{nonfinite!r}")
    if key is not None and not isinstance(key, (str, int)):
        raise ConfigError(f"key must be a str or int, got {type(key).__name__}")
    average = bool(average)
    if recvcounts is None:
        bounds = shard_bounds(n, size)
    else:
        counts = [int(c) for c in recvcounts]
        if len(counts) != size or min(counts) < 0 or sum(counts) != n:
            raise InvalidBufferError(
                f"recvcounts: expected {size} non-negative counts summing to {n}, "
                f"got {list(recvcounts)}")
        starts = np.concatenate([[0], np.cumsum(counts)]).tolist()
        bounds = list(zip(starts[:-1], starts[1:]))
    key = (f"auto/{n}/{dtype.name}" if key is None else str(key))
    # small buffers: plain MPI sum (see min_compress_bytes)
    fallback = comp.codec_id != "none" and n * dtype.itemsize < min_compress_bytes()
    plain = comp.codec_id == "none" or fallback
    settings = {"kind": kind, "comp": comp.get_config(), "key": key,
                "average": average, "gather": gather, "nonfinite": nonfinite,
                "bounds": None if recvcounts is None else bounds,
                "fallback": fallback}
    if mark is not None:
        settings["auto"] = mark
    if plain and n > max_count:
        # MPI sums this many pieces, one collective each: ranks that cut
        # differently ($MPIGC_MAX_COUNT) would wait in different collectives
        settings["sum_pieces"] = _plan.sum_pieces(n, max_count)
    fp = zlib.crc32(json.dumps(settings, sort_keys=True).encode())
    return Settings(comp, average, gather, nonfinite, bounds, key, plain, settings, fp)
