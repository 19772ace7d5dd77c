"""The engine's messages and limits: point-to-point messages of any size
(:func:`post`), the largest counts handed to MPI and the sizes up to which
data travels in the agreement messages (:func:`read_limits`, from the
environment, a :class:`Limits` value per call), the environment read cheaply (:func:`getenv`), and the
counters of :func:`mpigc.diagnostics.counters` and :func:`mpigc.traffic`."""
import os
from typing import NamedTuple

from mpi4py import MPI

from ._errors import ConfigError

__all__ = ["traffic", "reset_traffic", "add_traffic", "counters", "count", "Limits",
           "read_limits", "getenv", "env_int", "bytes_msg", "post"]

_counters = {"pipelined_calls": 0, "typed_messages": 0, "short_calls": 0,
             "plans_prepared": 0}
_traffic = {"calls": 0, "bytes_sent": 0, "logical_bytes": 0}


def traffic():
    """Counters of this process's mpigc collectives since start (or reset).

    ``calls``; ``bytes_sent``: payload bytes this rank handed to MPI sends
    (for ``op="none"``, the ``2 (N-1)/N`` bytes per byte of a bandwidth-optimal
    MPI allreduce, ``(N-1)/N`` for reduce-scatter: MPI does not report its
    own); ``logical_bytes``: the size of the buffers reduced.
    """
    return dict(_traffic)


def reset_traffic():
    """Set the :func:`traffic` counters to zero."""
    for k in _traffic:
        _traffic[k] = 0


def add_traffic(sent, logical):
    """One call is over: it sent ``sent`` bytes for a buffer of ``logical``."""
    _traffic["calls"] += 1
    _traffic["bytes_sent"] += sent
    _traffic["logical_bytes"] += logical


def counters():
    """Counters of how this process's calls ran, since the process started
    (never reset; take differences): ``pipelined_calls``, calls that went
    ahead on the pipelined path (``$MPIGC_CHUNK_BYTES``), counted when their
    pipeline starts (a call that then fails or is skipped is counted too);
    ``typed_messages``, point-to-point messages larger than
    ``$MPIGC_MAX_COUNT`` bytes, each sent or received as one element of a
    derived datatype. Both count the inter-node calls of hierarchical calls.
    ``short_calls``: calls that ran on the short path of a small repeated
    call (:mod:`mpigc._shortcall`). ``plans_prepared``: calls prepared
    anew, not found in the cache of prepared calls (:mod:`mpigc._prepared`)."""
    return dict(_counters)


def count(name):
    """Add one to counter ``name`` of :func:`counters`."""
    _counters[name] += 1


# op="none" and the small-buffer fallback on 2 ranks: up to this many bytes the
# values travel in the agreement message and each rank adds its peer's
# (a + b == b + a, MPI_Allreduce's bits on 2 ranks, except where both are NaN:
# values not all finite are summed by MPI, _plainsum.inline_commutes)
INLINE_PLAIN_MAX = 1 << 20
# compressed ops: phase 1's payloads travel with the rows when none is larger
# than this; larger ones go after the agreement into receives posted before
# the sends, so big transfers start at once instead of at the receiver's probe
INLINE_PAYLOAD_MAX = 256 << 10
# MPI-3 counts are C ints (Open MPI 5.0 has no MPI-4 large-count routines:
# mpi4py hands a larger count to MPI, which fails with MPI_ERR_ARG). The
# largest count the engine hands to MPI in one argument: a message of more
# bytes travels as one element of a derived datatype (bytes_msg), op="none"'s
# reductions of more elements in several reductions (mpigc._plainsum). Tests
# lower it to exercise both on small calls.
MAX_COUNT = (1 << 31) - 1
# the three limits above from the environment (see read_limits); constants
_LIMIT_ENV = (("MPIGC_INLINE_PLAIN_BYTES", INLINE_PLAIN_MAX, 0),
              ("MPIGC_INLINE_PAYLOAD_BYTES", INLINE_PAYLOAD_MAX, 0),
              ("MPIGC_MAX_COUNT", MAX_COUNT, 1))


class Limits(NamedTuple):
    """A call's limits (:func:`read_limits`), read once when it starts and
    passed to what needs them: bytes of ``op="none"``'s values that travel
    with the rows on 2 ranks (``inline_plain``), of a compressed call's
    payloads (``inline_payload``), and the largest count handed to MPI in
    one argument (``max_count``)."""
    inline_plain: int
    inline_payload: int
    max_count: int


# the limits parsed per value of the three variables (a cache, cleared when full)
_limits_cache = {}
_LIMITS_CACHE_MAX = 64


# the environment's own dict (bytes keys, POSIX): see getenv
_ENV_DATA = getattr(os.environ, "_data", None) if os.name == "posix" else None


def getenv(name):
    """``os.environ.get(name)``, without its cost for an unset variable:
    about 0.8 us (a KeyError raised and caught inside ``Mapping.get``), where
    a small call reads five (measured: 786 ns against 22 ns for a lookup in
    the dict behind ``os.environ``, which POSIX Pythons keep in sync with
    it). Elsewhere, ``os.environ.get`` itself."""
    if _ENV_DATA is None:
        return os.environ.get(name)
    v = _ENV_DATA.get(name.encode())
    return None if v is None else os.fsdecode(v)


# the variables that shape a call's record (mpigc._prepared): its limits
# (read_limits), its settings (mpigc._settings.settings_key), its chunks and the
# cache itself, as bytes keys of _ENV_DATA
_SHAPING = ("MPIGC_INLINE_PLAIN_BYTES", "MPIGC_INLINE_PAYLOAD_BYTES", "MPIGC_MAX_COUNT",
            "MPIGC_NONFINITE", "MPIGC_MIN_COMPRESS_BYTES", "MPIGC_CHUNK_BYTES",
            "MPIGC_PLAN_CACHE")
_SHAPING_B = tuple(name.encode() for name in _SHAPING)


def env_snapshot():
    """The raw values (None where unset) of the environment variables that
    shape a call's prepared record, in one tuple: a key for records whose
    limits and settings these variables fix (about 0.3 us, where reading
    them one by one costs a function call each)."""
    if _ENV_DATA is None:
        return tuple(map(os.environ.get, _SHAPING))
    return tuple(map(_ENV_DATA.get, _SHAPING_B))


def env_int(name, default, least=0, most=None):
    """The integer in the environment variable ``name`` (``default`` when it
    is unset), from ``least`` to ``most``; ConfigError otherwise."""
    env = getenv(name)
    if env is None:
        return default
    try:
        v = int(env)
    except ValueError:
        v = least - 1
    if v < least or (most is not None and v > most):
        span = (f"an integer from {least} to {most}" if most is not None else
                "a non-negative integer" if least == 0 else f"an integer >= {least}")
        raise ConfigError(f"{name}: expected {span}, got {env!r}")
    return v


def read_limits():
    """The :class:`Limits` of a call starting now, from
    ``$MPIGC_INLINE_PLAIN_BYTES``, ``$MPIGC_INLINE_PAYLOAD_BYTES`` and
    ``$MPIGC_MAX_COUNT`` (unset: the defaults above), read when a call
    starts (parsed only for values not seen before; ConfigError on a bad
    value, reported by the call on every rank). Tuning and test knobs: the
    first two move only the point where data stops travelling in the
    agreement messages, never a result; ``$MPIGC_MAX_COUNT`` lowers the
    largest count handed to MPI in one argument (the results are the same
    bits). The ranks of an op="none" call that sums in pieces must agree on
    it: the number of pieces is part of the call's settings (a difference
    is a settings mismatch on every rank). It must not change while a call
    is pending."""
    raw = (getenv("MPIGC_INLINE_PLAIN_BYTES"), getenv("MPIGC_INLINE_PAYLOAD_BYTES"),
           getenv("MPIGC_MAX_COUNT"))
    hit = _limits_cache.get(raw)
    if hit is None:
        hit = Limits(*(env_int(name, default, least, MAX_COUNT)
                       for name, default, least in _LIMIT_ENV))
        if len(_limits_cache) >= _LIMITS_CACHE_MAX:
            _limits_cache.clear()
        _limits_cache[raw] = hit
    return hit


def bytes_msg(buf, max_count=None):
    """``(message, datatype)``: the mpi4py message of the bytes of ``buf`` (a
    1-d uint8 array, host or device), ``[buf, MPI.BYTE]`` up to
    ``max_count`` bytes (the call's ``Limits.max_count``; None: the
    environment's now, :func:`read_limits`); beyond, ``[buf, 1, datatype]``,
    one element of a datatype of ``len(buf)`` bytes made of blocks of
    ``max_count`` bytes and the rest (BigMPI's construction), which the caller frees once the
    communication is posted (MPI completes the ones that use it). One
    message and one request either way, the same bytes on the wire, so a
    receive matches a send whatever grouping either uses."""
    if max_count is None:
        max_count = read_limits().max_count
    nbytes = len(buf)
    if nbytes <= max_count:
        return [buf, MPI.BYTE], None
    _counters["typed_messages"] += 1
    q, rem = divmod(nbytes, max_count)
    block = MPI.BYTE.Create_contiguous(max_count)
    if rem:
        t = MPI.Datatype.Create_struct([q, rem], [0, q * max_count], [block, MPI.BYTE])
    else:
        t = block.Create_contiguous(q)
    t.Commit()
    block.Free()
    return [buf, 1, t], t


def post(start, buf, peer, tag, max_count=None):
    """``start(message, peer, tag)``, a communicator's ``Isend`` or ``Irecv``,
    of the bytes of ``buf``, of any size (:func:`bytes_msg`, ``max_count``
    as there); its request."""
    msg, t = bytes_msg(buf, max_count)
    req = start(msg, peer, tag)
    if t is not None:
        t.Free()
    return req
