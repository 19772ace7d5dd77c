"""A call prepared once: what a flat or grouped call's signature fixes,
derived on its first call into a frozen :class:`Prepared` record and cached
per signature (:func:`prepare`), as libnbc caches a collective's schedule
per argument set; the working buffers its calls re-bind (:class:`Buffers`).

A signature is what the record depends on: the settings' cache key
(:func:`mpigc._settings.settings_key`: kind, op and its parameters, key,
average, gather, nonfinite, size, dtype, recvcounts, the communicator's
size, the environment that settings read), this rank, the buffer's side and
GPU, ``$MPIGC_CHUNK_BYTES`` and the call's :class:`mpigc._wire.Limits`. A
grouped call's layout is in it through its key (the members' keys and
sizes) and its recvcounts; a dict op by its items at the call. A
signature that is not hashable (a compressor object, a dict op holding
something other than plain scalars) is prepared on every call, as its
settings are validated on every call. ``$MPIGC_PLAN_CACHE=0`` prepares every call
(``plans_prepared`` of :func:`mpigc.diagnostics.counters` counts the
records made).

The record holds no MPI and nothing of one call: no arrays of the caller,
no transaction, no request. What it owns is a pool of working buffers
(:class:`Buffers`): a call takes a set, the engine's steps take their
arrays from it by name (allocated the first time), and the call gives the
set back once it completed or was skipped on every rank, every transfer
done and its kernels synchronised; several pending calls of one signature
each hold a set of their own, and a failed call's set is dropped (an MPI
operation may still write it). An array that becomes the call's result
(a reduce-scatter's reduced shard) leaves the set.
"""
from typing import NamedTuple

import numpy as np

from . import _plan
from . import _settings
from . import _wire
from .compressors import work_dtype

__all__ = ["Prepared", "Buffers", "BufferSet", "Bound", "prepare", "lookup", "cache_enabled"]


class BufferSet:
    """One call's working buffers (:class:`Buffers`), by name: ``"send"``
    (phase 1's payloads), ``"recv1"`` (phase 1's receives), ``"acc"`` (this
    rank's reduced shard), ``"recv2"`` (the compressed gather's receives),
    ``"x"`` (a compressed float16 call's float32 copy), ``"f32"`` (a plain
    float16 call's float32 copy), ``"fused"`` (a grouped call's fused
    buffer)."""

    __slots__ = ("arrays",)

    def __init__(self):
        self.arrays = {}

    def get(self, name, be, n, dtype):
        """Array ``name``: this set's, or ``be.empty(n, dtype)`` the first
        time (a signature fixes every size, dtype and side)."""
        a = self.arrays.get(name)
        if a is None:
            a = self.arrays[name] = be.empty(n, dtype)
        return a


class Buffers:
    """The pool of buffer sets of the records of one geometry (a signature
    but for its residuals' key: calls on many keys of one size share it, as
    the store's spares are shared): :meth:`take` one per call, :meth:`give`
    it back when the call completed (one set is kept: more are only for
    calls of one geometry pending together)."""

    _KEEP = 1

    __slots__ = ("_free",)

    def __init__(self):
        self._free = []

    def take(self):
        try:
            return self._free.pop()  # atomic: calls of several threads
        except IndexError:
            return BufferSet()

    def give(self, bufs, result=None):
        """The call of ``bufs`` completed: its set serves a later call, less
        any array that is its ``result`` (the caller's from now on)."""
        if result is not None:
            for name, a in list(bufs.arrays.items()):
                if a is result:
                    del bufs.arrays[name]
        if len(self._free) < self._KEEP:
            self._free.append(bufs)


class Prepared:
    """What a call's signature fixes (see the module docstring), frozen:

    ``kind``, ``n``, ``dtype`` (the buffer's), ``wdtype`` (the compressor's
    working dtype), ``sum_dtype`` (the owners' sums: float64 for float64,
    else float32); ``settings`` (:class:`mpigc._settings.Settings`) and its
    fields used on every call (``comp``, ``bounds``, ``plain``);
    ``chunks`` (a pipelined call's cuts, :func:`mpigc._plan.chunk_cuts`;
    None: not pipelined); ``phases`` (the two phases' layout,
    :func:`mpigc._plan.phases`; None for a plain sum); ``inline`` and
    ``inline_bytes`` (what this rank's agreement messages carry after its
    row, :func:`mpigc._plan.inline_data`, and the bytes a peer that agrees
    sends after its own); ``f32_copy`` (a plain float16 call sums a
    float32 copy: MPI has no float16 sum), ``plain_bytes`` (the bytes MPI
    sums) and ``pieces`` (in how many MPI sums); ``device``, ``device_id``
    (the buffer's side and GPU); ``limits``; ``buffers`` (:class:`Buffers`)."""

    __slots__ = ("kind", "n", "dtype", "wdtype", "sum_dtype", "settings", "comp", "bounds",
                 "plain", "chunks", "phases", "inline", "inline_bytes", "f32_copy",
                 "plain_bytes", "pieces", "device", "device_id", "limits", "buffers")

    def __init__(self, kind, n, dtype, size, rank, st, device, device_id, limits,
                 buffers=None):
        s = object.__setattr__
        s(self, "kind", kind)
        s(self, "n", n)
        s(self, "dtype", dtype)
        s(self, "wdtype", work_dtype(dtype))  # not buf.dtype: torch's is a torch dtype
        s(self, "sum_dtype", np.dtype(np.float64 if dtype == np.float64 else np.float32))
        s(self, "settings", st)
        s(self, "comp", st.comp)
        s(self, "bounds", st.bounds)
        s(self, "plain", st.plain)
        s(self, "device", device)
        s(self, "device_id", device_id)
        s(self, "limits", limits)
        s(self, "buffers", Buffers() if buffers is None else buffers)
        comp = st.comp
        chunks = phases = None
        if not st.plain and not device and size >= 2:
            # a pipelined call's cuts (see docs/engine.md): host buffers of a
            # compressor that says where it may cut, on 2 ranks or more, at
            # least two chunks of $MPIGC_CHUNK_BYTES; each piece encodes as
            # its part of the whole shard would (the same bits)
            chunks = _plan.chunk_cuts(st.bounds, n * dtype.itemsize, comp.chunk_align(),
                                      _settings.chunk_bytes())
        if not st.plain:
            wdt, adt = self.wdtype, self.sum_dtype
            phases = _plan.phases(kind, st.gather, dtype.itemsize, st.bounds, chunks,
                                  lambda k: comp.payload_nbytes(k, wdt),
                                  lambda k: comp.payload_nbytes(k, adt))
        s(self, "chunks", chunks)
        s(self, "phases", phases)
        f32 = st.plain and dtype == np.float16
        s(self, "f32_copy", f32)
        s(self, "plain_bytes", n * 4 if f32 else n * dtype.itemsize)
        s(self, "pieces", _plan.sum_pieces(n, limits.max_count))
        # what travels with the rows: the payloads' sizes are known before
        # the agreement unless the call is pipelined or waits for the
        # global scale
        scaled = not st.plain and comp.needs_global_scale
        pipelined = chunks is not None
        sizes = None if st.plain or scaled or pipelined else phases.sizes
        inline = _plan.inline_data(
            kind, size, st.plain, self.plain_bytes if st.plain else 0, sizes, scaled,
            device=device, pipelined=pipelined, plain_max=limits.inline_plain,
            payload_max=limits.inline_payload)
        s(self, "inline", inline)
        # bytes of data that a peer that agrees with this rank sends after its row
        s(self, "inline_bytes", 0 if inline is None else
          self.plain_bytes if inline == "values" else phases.sizes[rank])

    def __setattr__(self, name, value):
        raise AttributeError(f"a prepared call is frozen: cannot set {name!r}")


class Bound(NamedTuple):
    """What one call binds to its prepared record ``rec`` for its two phases
    (:class:`mpigc._twophase.TwoPhase`):
    its communicator state ``cs``, ``tags``, backend ``be``, working
    buffers ``bufs`` (:class:`mpigc._prepared.BufferSet`), residual
    transaction ``txn`` (None: no residuals), ``use_ef``; the buffer
    ``flat``, the values compressed ``x``, the residuals ``e_in`` and
    ``e_out`` (terngrad's: once its scale is agreed), phase 1's packed
    payloads ``sendbuf`` (None where the phases pack them), ``clip_bound``
    (terngrad); ``fill`` (see ``_Op``); the agreement ``table`` and
    ``rows``; ``sendreqs``, the call's list of sends, which the phases
    extend; ``seq`` (the communicator's call count) and the key."""
    rec: object
    cs: object
    tags: tuple
    be: object
    bufs: object
    txn: object
    use_ef: bool
    flat: object
    x: object
    e_in: object
    e_out: object
    sendbuf: object
    clip_bound: object
    fill: object
    table: object
    rows: object
    sendreqs: list
    seq: int
    key: str


# the records per signature (see the module docstring), and their buffer pools
# per geometry (the signature without the residuals' key)
_cache = {}
_pools = {}
_CACHE_MAX = 4096


def cache_enabled():
    """``$MPIGC_PLAN_CACHE``: ``0`` prepares every call anew (a record and
    buffers of its own); anything else, or unset, caches records per
    signature."""
    return _wire.getenv("MPIGC_PLAN_CACHE") != "0"


# the records of the commonest signatures (a str op without parameters, no
# recvcounts, keys and flags of their exact types) by their arguments as they
# come and the raw values of the variables that shape a call
# (_wire.env_snapshot, the limits' among them): a dict lookup where the full
# signature costs a few microseconds per call (settings_key's checks, its
# variables read one by one, a nested key hashed). The same records as _cache.
_front = {}
_KEY_TYPES = frozenset((str, int, type(None)))
_OPT_STR = frozenset((str, type(None)))


def _front_key(kind, device, device_id, dtype, n, size, rank, op, params, key, average,
               gather, nonfinite, recvcounts):
    """The call's key in ``_front``, or None (not one of its signatures)."""
    if (type(op) is not str or params or recvcounts is not None
            or type(average) is not bool or type(key) not in _KEY_TYPES
            or type(gather) not in _OPT_STR or type(nonfinite) not in _OPT_STR):
        return None
    return (kind, op, type(key), key, average, gather, nonfinite, n, dtype, size, rank,
            device, device_id, _wire.env_snapshot())


def lookup(kind, device, device_id, dtype, n, size, rank, op, params, key, average, gather,
           nonfinite, recvcounts):
    """The cached :class:`Prepared` record of a call of the commonest
    signatures, its limits those that :func:`mpigc._wire.read_limits` reads
    now (``rec.limits``), or None: then :func:`prepare` it."""
    fk = _front_key(kind, device, device_id, dtype, n, size, rank, op, params, key, average,
                    gather, nonfinite, recvcounts)
    return None if fk is None else _front.get(fk)


def prepare(kind, device, device_id, dtype, n, size, rank, op, params, key, average, gather,
            nonfinite, recvcounts, limits):
    """The call's :class:`Prepared` record: the cached one of its signature,
    or made now (its settings validated: raises ConfigError or
    InvalidBufferError as :func:`mpigc._settings.settings_for` does).
    ``device``, ``device_id``: the buffer's backend's (host: False, None).
    ``limits``: :func:`mpigc._wire.read_limits`'s now."""
    fk = _front_key(kind, device, device_id, dtype, n, size, rank, op, params, key, average,
                    gather, nonfinite, recvcounts)
    if fk is not None:
        hit = _front.get(fk)
        if hit is not None and hit.limits == limits:
            return hit
    sk = _settings.settings_key(kind, op, params, key, average, gather, nonfinite, n, dtype,
                                recvcounts, size, limits.max_count)
    ck = None
    if sk is not None and cache_enabled():
        ck = (sk, rank, device, device_id, _wire.getenv("MPIGC_CHUNK_BYTES"), limits)
        hit = _cache.get(ck)
        if hit is not None:
            _remember(fk, hit)
            return hit
    st = _settings.settings_for(kind, dtype, size, op, params, key, average, gather,
                                nonfinite, n, recvcounts, limits)
    pool = None
    if ck is not None:
        # the working buffers depend on everything but the key: one pool for
        # every key of this geometry (a model's many layers of one size hold
        # one set, not one per layer); nor on an op="auto" call's mark (its
        # index in the model changes from call to call, no buffer's size)
        geo = params
        if params and _settings.AUTO_MARK in params:
            geo = {k: v for k, v in params.items() if k != _settings.AUTO_MARK}
        gk = (_settings.settings_key(kind, op, geo, None, average, gather, nonfinite, n,
                                     dtype, recvcounts, size, limits.max_count),) + ck[1:]
        if len(_pools) >= _CACHE_MAX:
            _pools.clear()
        pool = _pools.setdefault(gk, Buffers())
    rec = Prepared(kind, n, dtype, size, rank, st, device, device_id, limits, pool)
    _wire.count("plans_prepared")
    if ck is not None:
        if len(_cache) >= _CACHE_MAX:
            _cache.clear()
        _cache[ck] = rec
        _remember(fk, rec)
    return rec


def _remember(fk, rec):
    """Put ``rec``, cached under its signature, in ``_front`` (``fk``: its
    key there, or None) when its limits are the environment's now (those
    that the key's variables give)."""
    if fk is not None and rec.limits == _wire.read_limits():
        if len(_front) >= _CACHE_MAX:
            _front.clear()
        _front[fk] = rec
