"""The short path of a repeated small call (issue 31): a blocking flat
``allreduce`` of a host numpy array (float32 or float64) on 2 ranks whose
settings make it a plain sum (``op="none"``, or a compressed op below
``$MPIGC_MIN_COMPRESS_BYTES``), rows point to point, made while the
scheduler lets a call run straight through (:func:`mpigc._sched.alone`: no
call pending, one user thread).

It does what the engine does for such a call (:mod:`mpigc._collective`,
:mod:`mpigc._flatagree`, :mod:`mpigc._plainsum`), in a straight line and
without the general call's objects: the same agreement row
(:class:`mpigc._agree.Rows`) on the same tag, and the peer's received the
same way, so that a peer on the engine's path matches it. Up to
``_ROWS_ALONE_MAX`` bytes (16 KiB) and from ``$MPIGC_INLINE_PLAIN_BYTES``
on, its row travels alone (the row's ``INLINE`` column 0, which each rank
sets for itself) and MPI's blocking sum follows on the communicator of what
follows the agreement, as the engine's blocking plain sum of a call whose
values did not travel with the rows (a peer on the engine's path that sent
its values sees this row and sums by MPI too; its values go unused):
measured at 2 ranks (issue 51), faster than the values in the agreement
message at these sizes (a 4 KiB message with its row is over Open MPI's
4 KiB shared-memory eager limit; past the inline limit the engine's path
was the alternative). Between, the values travel in the agreement message
as the engine's (:class:`mpigc._agree.Rows`: the row, then the values) and
each rank adds its peer's (a + b is b + a: the bits of ``MPI_Allreduce``
on 2 ranks); a "go" whose values are not all finite under
``nonfinite="ignore"`` is handed to the engine, which has MPI sum them
(:func:`mpigc._plainsum.inline_commutes`). The call is prepared once per
call signature, as the engine's (:func:`mpigc._prepared.prepare`).
Anything but a "go" verdict (another size, dtype or settings on the peer,
a peer that failed, non-finite values) is handed to the engine with the
rows exchanged (:class:`Handover`), which raises or skips on every rank as
it would have. A call the short path does not take (any other case, a
setting that fails to validate, a timeline being recorded,
``$MPIGC_SHORT_PATH=0``) has sent nothing and takes the engine's path.
``short_calls`` of :func:`mpigc.diagnostics.counters` counts the calls it
completed.

A grouped call (:func:`run_group`) of host float32 or float64 members
whose fused buffer the engine would sum as such a call (a plain allreduce,
its members one after another: :class:`mpigc._group.Group`) takes it too,
without the fused buffer: the members are copied straight into the
agreement message (up to ``$MPIGC_INLINE_PLAIN_BYTES``), and the peer's
values added straight into them (a + b is b + a: the bits of
``MPI_Allreduce`` on 2 ranks; non-finite values under
``nonfinite="ignore"`` are handed over: :func:`mpigc._plainsum.inline_commutes`);
the same message, bits and verdicts as the engine's grouped call
(``short_calls`` counts them too)."""
from functools import partial

import numpy as np
from mpi4py import MPI

from . import _agree
from . import _comm
from . import _plainsum
from . import _plan
from . import _prepared
from . import _sched
from . import _timeline
from . import _trace
from . import _wire
from .feedback import shard_bounds
from .kernels import cpu as _cpu

__all__ = ["run", "run_group", "Done", "Handover"]

_N, _DTYPE, _FP, _NBAD = _plan.N, _plan.DTYPE, _plan.FP, _plan.NBAD
# native float32 and float64 (a byte-swapped dtype is another key)
_DTYPES = {np.dtype(t): _plan.DTYPE_CODE[np.dtype(t)] for t in (np.float32, np.float64)}
# up to this many bytes of values (and from $MPIGC_INLINE_PLAIN_BYTES) the row
# travels alone and MPI_Allreduce sums: at 2 ranks, interleaved with the
# values in the message (issue 51, docs/benchmarks.md), faster from 256 bytes
# to 8 KiB (4 KiB: 4,168 bytes of row and values are over Open MPI's 4 KiB
# shared-memory eager limit), even at 16 KiB, and from 64 KiB faster in the
# minima but slower in the medians under load (MPI's sum needs both
# processes scheduled for each of its rounds; the message is one copy)
_ROWS_ALONE_MAX = 16 << 10
# from this many bytes the values are copied into the agreement message and
# counted in one pass (kernels.cpu.copy_count_nonfinite); below, a pass costs
# less than the closure and the calls
_FUSE_MIN_BYTES = 256 << 10


class Done:
    """A call the short path completed, as :class:`mpigc._sched.Request`
    sees an engine call that is done."""
    __slots__ = ("result", "trace")
    state = "done"
    error = None
    straight = True  # Request.wait returns its result at once

    def __init__(self, result, trace):
        self.result, self.trace = result, trace

    def done_or_failed(self):
        return True

    def device_id(self):
        return None  # host arrays only; never queued

    def settle(self):
        pass

    def finished(self):
        return True


class Handover:
    """A call whose rows the short path exchanged and that it does not
    finish (a verdict but "go", or a grouped call's sum that MPI makes): the engine call
    made of it (``_Op(..., pre=handover)``) takes its tags, rows and sends
    instead of starting its own."""
    __slots__ = ("seq", "tags", "rows", "sendreqs", "limits")

    def __init__(self, seq, tags, rows, sendreqs, limits):
        self.seq, self.tags, self.rows, self.sendreqs = seq, tags, rows, sendreqs
        self.limits = limits  # the call's (mpigc._wire.Limits), read once


def run(buf, op, params, cs, key, average, gather, nonfinite):
    """Under the engine lock: the call completed (:class:`Done`), handed over
    (:class:`Handover`), or None (not taken: nothing sent)."""
    if (type(buf) is not np.ndarray or cs.size != 2 or _timeline.ON
            or _wire.getenv("MPIGC_SHORT_PATH") == "0"):
        return None
    dtype = buf.dtype
    code = _DTYPES.get(dtype)
    flags = buf.flags
    if code is None or not (flags.c_contiguous and flags.writeable) or buf.size == 0:
        return None
    n = buf.size
    # the record of a repeated call, its limits the environment's now
    rec = _prepared.lookup("allreduce", False, None, dtype, n, 2, cs.rank, op, params, key,
                           average, gather, nonfinite, None)
    if rec is None:
        try:
            rec = _prepared.prepare("allreduce", False, None, dtype, n, 2, cs.rank, op,
                                    params, key, average, gather, nonfinite, None,
                                    _wire.read_limits())
        except Exception:  # noqa: BLE001 - the engine reports it on every rank
            return None
    # a plain sum, its rows point to point
    if not rec.plain or _agree.P2P_MAX_RANKS < 2 or not _sched.alone():
        return None
    try:
        if rec.inline == "values" and buf.nbytes > _ROWS_ALONE_MAX:
            return _straight_inline(buf, cs, rec.settings, code, rec.limits)
        return _straight(buf, cs, rec.settings, code, rec.limits, rec.pieces)
    except BaseException as exc:
        # this rank's alone (a defect, no memory, an interrupt): its peer may
        # wait for it forever, so the job is aborted, as for an engine call
        # (MPIGC_ON_INTERNAL_ERROR=raise raises it instead)
        _comm.internal_error(exc, cs.comm, "mpigc allreduce")
        raise


def run_group(group, op, params, cs, average, gather, nonfinite):
    """:func:`run` for a blocking grouped allreduce (``group``: its
    :class:`mpigc._group.Group`, which this adopts: an engine call made of
    it does not adopt it again)."""
    if cs.size != 2 or _timeline.ON or _wire.getenv("MPIGC_SHORT_PATH") == "0":
        return None
    try:
        be, dtype = group.adopt(cs)
        code = _DTYPES.get(dtype)
        if be.device or code is None:
            return None
        n = sum(group.sizes)
        # the engine's record of the group (mpigc._collective._Input.adopt)
        rec = _prepared.prepare("allreduce", False, None, dtype, n, 2, cs.rank, op, params,
                                group.key, average, gather, nonfinite, group.counts(2),
                                _wire.read_limits())
    except Exception:  # noqa: BLE001 - the engine reports it on every rank
        return None
    if n == 0 or rec.inline != "values" or _agree.P2P_MAX_RANKS < 2 or not _sched.alone():
        return None
    try:
        return _straight_group(group, cs, rec, code)
    except BaseException as exc:
        _comm.internal_error(exc, cs.comm, "mpigc allreduce")  # as run()'s
        raise


def _straight_group(group, cs, rec, code):
    """A grouped call, straight through (see :func:`run_group`): its
    members' values, one after another, are the values of :func:`_straight_inline`."""
    st, dtype, n = rec.settings, rec.dtype, rec.n
    flats = group.flats
    nbytes = n * dtype.itemsize
    nonfinite = st.nonfinite
    rank, comm = cs.rank, cs.comm
    peer = 1 - rank
    seq = cs.seq
    tags = cs.next_tags()
    row = _plan.new_row()
    row[_N], row[_DTYPE], row[_FP] = n, code, st.fp

    sent = []

    def pack(j, dst):
        # the members into the message (the engine's fused buffer), their
        # non-finite values counted there
        mine = dst.view(dtype)
        np.concatenate(flats, out=mine)
        if nonfinite != "ignore":
            row[_NBAD] = _cpu.count_nonfinite(mine)
        sent.append(mine)
    sendreqs = []
    rows = _agree.Rows(comm, rank, 2, tags[2], row, {peer: nbytes}, nbytes, sendreqs,
                       pack=pack)
    _sched.wait_alone(_sched.Received(comm, peer, tags[2], partial(rows.slot, peer)))
    rows.read()
    trace = _trace.CallTrace()
    trace.agreed()
    theirs = rows.payload(peer).view(dtype)
    mine = sent[0]  # read only: MPI may still be sending it
    if (_plan.verdict(rows.table, rank, nonfinite) is not _plan.GO
            or nonfinite == "ignore" and not _plainsum.inline_commutes(mine, theirs)):
        return Handover(seq, tags, rows, sendreqs, rec.limits)
    trace.went("plain", True)
    # NoCompression's decode of the fused buffer (b + a is a + b: the values
    # are finite, or commute), summed in the received message, then into
    # the members (one sum and a copy per member: 64 members of 4 KiB, a
    # quarter less time than a sum per member)
    np.add(theirs, mine, out=theirs)
    if st.average:
        np.divide(theirs, 2, out=theirs)
    for f, at in zip(flats, group.offsets()):
        f[...] = theirs[at:at + f.size]
    _wire.add_traffic(nbytes, nbytes)
    rows.release(sendreqs)
    _wire.count("short_calls")
    return Done(group.given, trace)


def _straight(buf, cs, st, code, limits, pieces):
    """The call, straight through (see :func:`run`), with its settings
    ``st`` (:class:`mpigc._settings.Settings`), ``limits`` and number of MPI
    sums ``pieces``: this rank's row alone to its peer (its ``INLINE``
    column 0), the peer's row, then, on "go", MPI's blocking sum on the
    communicator of what follows the agreement, as the engine's blocking
    plain sum of a call whose values did not travel with the rows
    (:meth:`mpigc._plainsum.PlainSum.start`: the same communicator, pieces
    and bits)."""
    nonfinite, rank = st.nonfinite, cs.rank
    flat, row, seq, tags, peer = _begin(buf, cs, st, code)
    if nonfinite != "ignore":
        row[_NBAD] = _cpu.count_nonfinite(flat)
    sendreqs = []
    rows = _agree.Rows(cs.comm, rank, 2, tags[2], row, None, 0, sendreqs)
    # a peer on the engine's path may have sent its values after its row
    # (then unused)
    trace = _received(cs.comm, peer, tags, rows)
    if _plan.verdict(rows.table, rank, nonfinite) is not _plan.GO:
        return Handover(seq, tags, rows, sendreqs, limits)
    trace.went("plain", False)
    # MPI's sum, finite values or not (nonfinite="ignore"): the engine's bits
    post = cs.post
    if pieces == 1:
        post.Allreduce(MPI.IN_PLACE, flat, op=MPI.SUM)
    else:  # $MPIGC_MAX_COUNT: as PlainSum's pieces
        for a, b in shard_bounds(flat.size, pieces):
            post.Allreduce(MPI.IN_PLACE, flat[a:b], op=MPI.SUM)
    trace.summed(pieces)
    return _end(buf, flat, st, rows, sendreqs, trace)


def _straight_inline(buf, cs, st, code, limits):
    """:func:`_straight` for a call whose values travel in its agreement
    message (``rec.inline``, over ``_ROWS_ALONE_MAX``): each rank adds its
    peer's values (a + b is b + a: the bits of ``MPI_Allreduce`` on 2 ranks),
    as the engine's inline plain sum; a "go" whose values are not all finite
    under ``nonfinite="ignore"`` is handed over (MPI sums it:
    :func:`mpigc._plainsum.inline_commutes`)."""
    nbytes, nonfinite, rank = buf.nbytes, st.nonfinite, cs.rank
    flat, row, seq, tags, peer = _begin(buf, cs, st, code)
    pack = None
    if nonfinite != "ignore":
        if nbytes < _FUSE_MIN_BYTES:
            row[_NBAD] = _cpu.count_nonfinite(flat)
        else:
            def pack(j, dst):
                # the values into the message and their non-finite count into
                # the row in one pass (issue 51: a pass fewer at 1 MiB)
                row[_NBAD] = _cpu.copy_count_nonfinite(flat, dst)
    sendreqs = []
    rows = _agree.Rows(cs.comm, rank, 2, tags[2], row, {peer: flat.view(np.uint8)}, nbytes,
                       sendreqs, pack=pack)
    trace = _received(cs.comm, peer, tags, rows)
    theirs = rows.payload(peer)
    if (_plan.verdict(rows.table, rank, nonfinite) is not _plan.GO
            or nonfinite == "ignore" and not _plainsum.inline_commutes(
                flat, theirs.view(flat.dtype))):
        return Handover(seq, tags, rows, sendreqs, limits)
    trace.went("plain", True)
    np.add(flat, theirs.view(flat.dtype), out=flat)  # NoCompression's decode, a + b
    return _end(buf, flat, st, rows, sendreqs, trace)


def _begin(buf, cs, st, code):
    """What a straight call starts with: ``buf`` flat, this rank's row
    (size, dtype code, settings fingerprint), the call's sequence number and
    tags, the peer."""
    n = buf.size
    flat = buf if buf.ndim == 1 else buf.reshape(n)  # a reshape costs 0.3 us
    row = _plan.new_row()
    row[_N], row[_DTYPE], row[_FP] = n, code, st.fp
    seq = cs.seq
    return flat, row, seq, cs.next_tags(), 1 - cs.rank


def _received(comm, peer, tags, rows):
    """The peer's message (its row, and the values that travel with it),
    matched by probe and received blocking in MPI (one effect, no request:
    issue 51, the per-call cost at 4 KiB), read into ``rows``: the call's
    trace, agreed."""
    _sched.wait_alone(_sched.Received(comm, peer, tags[2], partial(rows.slot, peer)))
    rows.read()
    trace = _trace.CallTrace()
    trace.agreed()
    return trace


def _end(buf, flat, st, rows, sendreqs, trace):
    """What a straight call that went ends with: the average, the traffic,
    the sends released: :class:`Done`."""
    if st.average:
        np.divide(flat, 2, out=flat)
    _wire.add_traffic(buf.nbytes, buf.nbytes)
    rows.release(sendreqs)
    _wire.count("short_calls")
    return Done(buf, trace)
