"""The plain sum of a call: ``op="none"`` and the small-buffer fallback of
compressed ops, MPI's own ``MPI_Allreduce`` / ``MPI_Reduce_scatter`` with
``MPI.SUM`` after the agreement (:class:`PlainSum`).

Which thread sums, and when, is what keeps the bits those of the blocking
calls and the ranks from waiting on each other:

- a nonblocking call hands the sum to its communicator's reduction thread
  (:class:`mpigc._reducer.Reducer`) at once: the caller computes while that
  thread waits in MPI (``MPI_Iallreduce`` / ``MPI_Ireduce_scatter`` need not
  give the blocking bits: Open MPI 5.0's differ in the last bits on 3 ranks);
- a blocking call sums in its own thread, in a blocking wait on this very
  call once every earlier call of this rank is done (it is then first in the
  queue: :data:`mpigc._sched.Alone`); never from a progress step: blocking
  there, with the engine lock held, would keep an earlier call from
  advancing while the peers wait for it;
- once several user threads call mpigc no wait blocks in MPI, and a blocking
  call's sum runs in the reduction thread, on the same communicator, once no
  earlier call of this communicator is pending (the queue's order across
  communicators is the threads' timing, not the same on every rank);
- without ``MPI_THREAD_MULTIPLE`` there is no reduction thread: a
  nonblocking call starts MPI's nonblocking sum instead (other bits; see
  :meth:`mpigc._reducer.Reducer.available`). The choice is the same on every
  rank (blocking and nonblocking collectives do not match, MPI-3.1 5.12);
- on 2 ranks the values may have come with the peer's agreement row: each
  rank adds its peer's (a + b == b + a, the bits of ``MPI_Allreduce``),
  unless a value is not finite (:func:`inline_commutes`): then MPI sums them
  as it sums a larger call's, and the values that came inline go unused.

The steps that wait stay in the call's own generator
(:meth:`mpigc._collective._Op._steps`): small calls are made of them, and a
generator of its own would cost each call its creation. The sum is a
function of the call's prepared record (:class:`mpigc._prepared.Prepared`),
its communicator state and backend and the values it sums; it returns what
it produced (:meth:`PlainSum.finish`) to the call, which sets its result.
"""
from mpi4py import MPI

from . import _plan
from . import _reducer
from . import _sched
from . import _timeline
from .compressors import NoCompression
from .feedback import shard_bounds
from .kernels import cpu as _cpu

__all__ = ["PlainSum", "inline_commutes"]

_NONE = NoCompression()


def inline_commutes(mine, peer):
    """Whether this rank's values ``mine`` plus its peer's ``peer`` (host
    arrays of one float dtype; on 2 ranks, where they came with the
    agreement rows) is certain to have the bits of ``MPI_Allreduce``.

    IEEE addition commutes bit for bit but where both operands are NaN: the
    CPU then returns the first one's payload and sign, and MPI takes no
    single order. Open MPI 5.0.11 on 2 ranks, measured: the higher rank's
    value first on both ranks below 4 KiB and from 8 to 16 KiB (recursive
    doubling), each half of the buffer first by the rank that sums it, its
    own value, from 4 to 8 KiB and from 16 KiB (ring); other versions and
    tunings choose otherwise. So a call whose values are not all finite
    (which reaches the sum only under ``nonfinite="ignore"``) is summed by
    MPI itself, NaN payloads included. Each rank holds both operands, so
    both decide the same; inf alone, which commutes, takes MPI's sum too
    (the one count of non-finite values that the engine has)."""
    return _cpu.count_nonfinite(mine) == 0 and _cpu.count_nonfinite(peer) == 0


class PlainSum:
    """The plain sum of ``values`` (the buffer, or its float32 copy) of a
    call prepared as ``rec`` on communicator state ``cs`` with backend
    ``be``; ``call`` is the call only as an entry of the queue (whether an
    earlier call of its communicator is pending), ``blocking`` whether it
    is a blocking call."""

    __slots__ = ("call", "rec", "cs", "be", "values", "blocking", "wire", "rwire", "out",
                 "pieces", "job", "inline_sent")

    def __init__(self, call, rec, cs, be, values, blocking):
        self.call, self.rec, self.cs, self.be = call, rec, cs, be
        self.values, self.blocking = values, blocking
        self.wire = self.rwire = self.out = self.job = None
        self.pieces = 0  # MPI sums made (0: the values came with the rows)
        self.inline_sent = 0  # bytes sent with the rows, then summed by MPI

    def add_inline(self, peer):
        """On 2 ranks, the peer's values (``peer``, the bytes that came with
        its row) are here: add them to this rank's, in place, and return
        True (:meth:`finish` gives the sum); or, where the bits of the sum
        would depend on the order of its operands (:func:`inline_commutes`,
        ``nonfinite="ignore"`` only), add nothing and return False: MPI sums
        the values (:meth:`start`), as a larger call's, on both ranks."""
        values = self.values
        if self.rec.settings.nonfinite == "ignore" and not inline_commutes(
                values, peer.view(values.dtype)):
            self.inline_sent = values.nbytes
            return False
        _NONE.decode_into(peer, values, True)
        self.out = self.wire = values
        return True

    def may_hand_over(self):
        """A blocking call's sum may run in the reduction thread: several user
        threads call mpigc, and no earlier call of this communicator is
        pending."""
        cs = self.cs
        return (not _sched.may_block() and _reducer.Reducer.available()
                and not any(o.cs is cs for o in _sched.earlier(self.call)))

    def start(self, here):
        """Start the sum (see the module's docstring). ``here``: a blocking
        call may sum in this thread (the ``Alone`` effect said so). Returns
        the effect left to wait for (the reduction thread's job, the
        nonblocking sum's requests) or None (done)."""
        be, cs, rec = self.be, self.cs, self.rec
        sendbuf = self.values
        be.ready_for_mpi()
        # staged: the full-precision values cross to the host
        self.wire = be.wire(sendbuf, send=True)
        if rec.kind == "allreduce":
            self.out = sendbuf
        else:
            lo, hi = rec.bounds[cs.rank]
            recv = be.empty(hi - lo, sendbuf.dtype)  # the result: not the record's
            self.rwire = be.wire(recv)
            self.out = recv
        reqs = []
        dev = be.device_id  # made current in the reduction thread
        if self.blocking and here:
            self._reduce(cs.post, blocking=True)
        elif self.blocking:
            self.job = _reducer.Reducer.of(cs).submit(
                lambda: self._reduce(cs.post, blocking=True), dev)
        elif _reducer.Reducer.available():
            self.job = _reducer.Reducer.of(cs).submit(
                lambda: self._reduce(cs.reduce, blocking=True), dev)
        else:
            reqs = self._reduce(cs.post, blocking=False)
        if self.job is not None:
            return _sched.Job(self.job.done)
        return _sched.All(reqs) if reqs else None

    def _reduce(self, comm, blocking):
        """MPI's sum of ``wire`` on ``comm`` (reduce_scatter: this rank's
        shard into ``rwire``), blocking or not (then it returns the
        requests). A call of more than the call's ``limits.max_count``
        (:class:`mpigc._wire.Limits`) elements is
        summed in pieces of at most that many: an allreduce slice by slice, a
        reduce_scatter by one reduction to its owner per piece of each shard
        (MPI's counts are C ints); the record's ``pieces``."""
        t0 = blocking and _timeline.ON and _timeline.now()
        reqs = self._sum(comm, blocking)
        if t0:
            _timeline.span("MPI sum", t0, args={"pieces": self.pieces})
        return reqs

    def _sum(self, comm, blocking):
        rec, rank = self.rec, self.cs.rank
        wire, reqs = self.wire, []
        self.pieces = npieces = rec.pieces
        n = len(wire)
        if rec.kind == "allreduce":
            for a, b in shard_bounds(n, npieces):
                if blocking:
                    comm.Allreduce(MPI.IN_PLACE, wire[a:b], op=MPI.SUM)
                else:
                    reqs.append(comm.Iallreduce(MPI.IN_PLACE, wire[a:b], op=MPI.SUM))
            return reqs
        rwire = self.rwire
        if npieces == 1:
            counts = [h - l for l, h in rec.bounds]
            if blocking:
                comm.Reduce_scatter(wire, rwire, counts, op=MPI.SUM)
            else:
                reqs.append(comm.Ireduce_scatter(wire, rwire, counts, op=MPI.SUM))
            return reqs
        for j, (lo, hi) in enumerate(rec.bounds):
            for a, b in shard_bounds(hi - lo, npieces):
                if b == a:
                    continue
                recv = rwire[a:b] if j == rank else None
                if blocking:
                    comm.Reduce(wire[lo + a:lo + b], recv, op=MPI.SUM, root=j)
                else:
                    reqs.append(comm.Ireduce(wire[lo + a:lo + b], recv, op=MPI.SUM,
                                             root=j))
        return reqs

    def finish(self):
        """The sum is in (or failed in the reduction thread: raise that):
        returns ``(v, sent, pieces)``, the sum (allreduce: the values
        summed in place; reduce_scatter: this rank's shard), the bytes sent
        and in how many MPI sums (0: the values came with the rows)."""
        if self.job is not None and self.job.error is not None:
            raise self.job.error
        kind = self.rec.kind
        v = self.out
        # staged: back to the device
        self.be.unstage(v, self.wire if kind == "allreduce" else self.rwire)
        size = self.cs.size
        factor = 2 * (size - 1) / size if kind == "allreduce" else (size - 1) / size
        return v, int(round(factor * self.values.nbytes)) + self.inline_sent, self.pieces
