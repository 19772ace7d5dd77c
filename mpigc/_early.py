"""What a compressed call computes before its agreement, and what its two
phases (:mod:`mpigc._twophase`) share: the values it compresses, the
residuals it reads and writes, terngrad's local scale, every shard packed
when the call is not pipelined (:func:`compress_early`, :class:`Early`),
the counts of values the wire format cannot carry (:func:`count_bad`),
terngrad's scale (:func:`local_scale`) and its random stream
(:func:`stream`). Functions of the call's prepared record
(:class:`mpigc._prepared.Prepared`), its backend, buffers and residual
transaction, that return what they produced; no MPI. What differs between
host and device arrays (the statistics, the counts) is the backend's
(:mod:`mpigc._backend`): nothing here asks which side an array is on."""
import math
import struct
import zlib
from typing import NamedTuple

import numpy as np

from . import _plan
from . import _timeline
from .kernels import cpu as _cpu

__all__ = ["Early", "compress_early", "pack_shards", "count_bad", "local_scale", "put_bad",
           "f64_bits", "bits_f64", "stream"]


def f64_bits(x):
    """A float64's bits as an int64 (terngrad's scale travels in the rows so)."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def bits_f64(i):
    """The float64 of :func:`f64_bits`'s bits."""
    return struct.unpack("<d", struct.pack("<q", int(i)))[0]


def stream(rec, txn, seq, key, rank, stage):
    """terngrad's random stream: seed and key, rank, the key's call count
    (the communicator's call count ``seq`` for calls without state), stage."""
    calls = None if txn is None else txn.calls()
    if calls is None:
        calls = seq
    seed = rec.comp.seed ^ (zlib.crc32(key.encode()) << 32)
    return _cpu.ternary_stream(seed, rank, calls, stage)


def pack_shards(rec, be, bufs, x, e_in, e_out, rank, size, scale_kw=None):
    """Compress every shard of ``x`` (residuals ``e_in``, the new ones into
    ``e_out``) into one send buffer, laid out as the one chunk of the
    call's phases (``rec.phases``); ``scale_kw``: terngrad's scale, clip
    bound and stream. Returns ``(sendbuf, nbad)``, the encoder's bad count."""
    plan = rec.phases
    comp = rec.comp
    sendbuf = bufs.get("send", be, plan.total, np.uint8)
    kw = {}
    if comp.needs_global_scale:
        kw = scale_kw
    elif comp.prescales_average and rec.settings.average:
        kw = {"divisor": float(size)}
    # every shard in one call: one kernel launch on a GPU (the host loops)
    t0 = _timeline.ON and _timeline.now()
    nbad = comp.encode_shards(x, e_in, e_out, sendbuf, _plan.shard_starts(rec.bounds, rec.n),
                              plan.poff[0], **kw)
    if t0:
        _timeline.span("compress", t0)
    return sendbuf, nbad


def count_bad(be, x, e_in, nonfinite, nbad):
    """Split the encoder's bad count ``nbad`` into the non-finite values of
    ``x + e`` (column ``NBAD``) and the finite values that the wire format
    cannot carry (column ``RANGE``), counted by backend ``be``: returns
    ``(nf, out_of_range)``, the second None where not counted. The exact
    count runs only when ``nbad`` is not 0, and not at all under
    ``nonfinite="ignore"``."""
    if nbad == 0 or nonfinite == "ignore":
        return nbad, None
    nf = be.stats(x, e_in)[3]
    return nf, max(nbad - nf, 0)


def local_scale(rec, be, x, e_in):
    """terngrad's ``(max |v| after clipping, clip bound, bad count)`` of ``v =
    x + e_in`` (:meth:`mpigc.compressors.TernGrad.local_scale`), its
    statistics computed by backend ``be``."""
    if x.size == 0:
        return 0.0, math.inf, 0
    return rec.comp.scale_of(be.stats(x, e_in), x.size)


class Early(NamedTuple):
    """What a compressed call computes before its agreement
    (:func:`compress_early`): the values it compresses ``x``, the worker
    residual it reads ``e_in`` and the one it writes ``e_out`` (None until
    terngrad's scale is agreed), terngrad's ``clip_bound`` and ``scale``
    (the float64's bits for the agreement row), phase 1's packed payloads
    ``sendbuf`` (a call that is not pipelined, but terngrad), and ``bad``
    (:func:`count_bad`'s counts; None where not counted yet)."""
    x: object
    e_in: object
    e_out: object
    clip_bound: object
    scale: object
    sendbuf: object
    bad: object


def compress_early(rec, be, bufs, flat, txn, use_ef, rank, size):
    """A compressed call before its agreement (:class:`Early`): ``flat`` (a
    float16 buffer: its float32 copy), the residuals of transaction ``txn``
    (``use_ef``), terngrad's local scale, or every shard packed now (the
    new residual into a scratch array) where the call is not pipelined."""
    if rec.dtype == rec.wdtype:
        x = flat
    else:
        x = bufs.get("x", be, rec.n, rec.wdtype)
        be.assign(x, flat)
    e_in = txn.worker() if use_ef else None
    nonfinite = rec.settings.nonfinite
    if rec.comp.needs_global_scale:
        amax, clip_bound, nbad = local_scale(rec, be, x, e_in)
        return Early(x, e_in, None, clip_bound, f64_bits(amax), None,
                     count_bad(be, x, e_in, nonfinite, nbad))
    # compress every shard now; the new residual goes to a scratch buffer
    e_out = txn.take_scratch() if use_ef else None
    if rec.chunks is not None:  # pipelined: chunk by chunk once the rows agree
        return Early(x, e_in, e_out, None, None, None, None)
    sendbuf, nbad = pack_shards(rec, be, bufs, x, e_in, e_out, rank, size)
    return Early(x, e_in, e_out, None, None, sendbuf,
                 count_bad(be, x, e_in, nonfinite, nbad))


def put_bad(row, counts):
    """The counts of :func:`count_bad` into the agreement row ``row``."""
    row[_plan.NBAD] = counts[0]
    if counts[1] is not None:
        row[_plan.RANGE] = counts[1]
