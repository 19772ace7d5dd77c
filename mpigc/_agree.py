"""A call's agreement on the wire: every rank's row, and the data that can
travel with it (:class:`Rows`), and the report of a failed agreement
(:func:`failure_report`, its texts by :class:`Report`); hierarchical calls
use both too (their rows by allgather, the texts of their groups' outcome
by a report).

Up to :data:`P2P_MAX_RANKS` ranks each rank sends every peer its row point
to point, in front of the data it sends that peer where the data is known
before the agreement (phase 1's payloads; ``op="none"``'s values on 2
ranks), so the agreement costs no round of its own; receives are matched by
probe, so a peer whose message has another size (another buffer size, a
rank that failed early) is read, not truncated. Beyond, one nonblocking
allgather of the rows (log N rounds). What the table says, and what a call
does about it, is :func:`mpigc._plan.verdict` and the call's
(:mod:`mpigc._collective`).
"""
import numpy as np
from mpi4py import MPI

from . import _plan
from . import _sched

__all__ = ["P2P_MAX_RANKS", "Rows", "Report", "failure_report", "Outcomes"]

# up to this many ranks the agreement travels point to point, each rank's row
# in front of the data it sends to each peer (one round for the whole call
# where the data fits); beyond, an Iallgather of the rows (log N rounds)
P2P_MAX_RANKS = 16
_HDR = _plan.ROW_BYTES  # at the head of each agreement message


class _BufferPool:
    """Reusable host byte buffers for agreement messages, by size: a fresh
    ``np.empty`` of a large buffer costs page faults on every first touch.
    Keeps at most ``per_size`` buffers of a size and ``max_bytes`` in all."""

    def __init__(self, per_size=4, max_bytes=256 << 20):
        self.free = {}
        self.per_size, self.max_bytes, self.held = per_size, max_bytes, 0

    def take(self, nbytes):
        lst = self.free.get(nbytes)
        if lst:
            self.held -= nbytes
            return lst.pop()
        return np.empty(nbytes, np.uint8)

    def give(self, a):
        lst = self.free.setdefault(a.size, [])
        if len(lst) < self.per_size and self.held + a.size <= self.max_bytes:
            lst.append(a)
            self.held += a.size


_pool = _BufferPool()
# sends of finished calls that MPI had not completed yet, with their buffers
_draining = []


def _drain():
    """Recycle the buffers of finished calls' sends that have completed,
    all but the newest call's: a send is tested once the call after it has
    received its peer's rows (issue 51). By then a peer of a blocking call
    has received it (it finished the call before it sent its next row, and
    Open MPI delivers its acknowledgement ahead of that row): the test
    finds it done and makes no progress call. A test of a send the peer
    has not received yet (a rendezvous message over the eager limit, its
    peer still on its way) is a progress call that finds nothing, and with
    ``mpi_yield_when_idle`` (set when ranks oversubscribe the cores) gives
    the core away: half a millisecond a call at 64 KiB under load
    (cProfile of the short path, when each call tested its own sends)."""
    keep = []
    for reqs, bufs in _draining[:-1]:
        if _sched.test(reqs):
            for a in bufs:
                _pool.give(a)
        else:
            keep.append((reqs, bufs))
    keep.append(_draining[-1])
    _draining[:] = keep


_rings = {}


def _ring(rank, size):
    """The peers ``rank`` sends to, in order, and the sources it receives
    from, in order (tuples), made once per rank and size."""
    hit = _rings.get((rank, size))
    if hit is None:
        hit = _rings[rank, size] = (tuple((rank + k) % size for k in range(1, size)),
                                    tuple((rank - k) % size for k in range(1, size)))
    return hit


class Rows:
    """The exchange of one call's agreement rows: started at once; the
    call's steps receive them (:attr:`req` to wait for, or a probe per
    source in :attr:`sources` and :meth:`slot`), then :meth:`read`.
    ``table``: every rank's row (this rank's at once)."""

    __slots__ = ("table", "req", "sources", "buf", "size", "data", "held")

    def __init__(self, comm, rank, size, tag, row, inline, expected, sendreqs,
                 by_allgather=False, pack=None):
        """Send ``row`` to every peer, followed by ``inline[peer]`` (a uint8
        array) when ``inline`` is not None (the row's ``INLINE`` column says
        so); a peer that agrees with this rank sends ``expected`` bytes after
        its row. The sends join ``sendreqs``. ``by_allgather``: the rows
        alone, by allgather, whatever the size (hierarchical calls).
        ``pack(j, dst)``, with ``inline``: writes peer ``j``'s data into
        ``dst`` (the message's bytes after the row) instead of a copy of
        ``inline[j]`` (then an array or its size in bytes), and may set ``row``'s columns first (the short path
        copies its values and counts their non-finite ones in one pass,
        :func:`mpigc.kernels.cpu.copy_count_nonfinite`); every peer's data
        is packed before ``row`` is read."""
        self.table = _plan.new_table(size)
        self.req = self.sources = self.buf = None
        self.data, self.held = {}, []  # received messages; pooled send buffers
        if len(_draining) > 1:
            _drain()
        if by_allgather or size > P2P_MAX_RANKS:
            # always the nonblocking form: whether anything is pending here
            # depends on timing (the progress thread), and a blocking
            # MPI_Allgather does not match another rank's MPI_Iallgather
            self.req = comm.Iallgather(row, self.table)
            return
        peers, sources = _ring(rank, size)
        if inline is None:
            msgs = None
        else:
            msgs = []
            for j in peers:
                p = inline[j]
                msg = _pool.take(_HDR + (p if type(p) is int else p.size))
                if pack is None:
                    msg[_HDR:] = p
                else:
                    pack(j, msg[_HDR:])
                msgs.append(msg)
            self.held.extend(msgs)
        row[_plan.INLINE] = 0 if inline is None else 1
        self.table[rank] = row
        hdr = row.view(np.uint8)
        for i, j in enumerate(peers):
            if msgs is None:
                msg = hdr
            else:
                msg = msgs[i]
                msg[:_HDR] = hdr
            sendreqs.append(comm.Isend([msg, MPI.BYTE], dest=j, tag=tag))
        self.size = _HDR + expected
        # one pooled buffer, a slot per source (this rank's slot unused)
        self.buf = _pool.take(size * self.size)
        self.sources = sources

    def slot(self, j, count):
        """Where source ``j``'s message of ``count`` bytes is received: its
        slot, or, at another size (the call will fail), a buffer that keeps
        only the row."""
        if count == self.size:
            buf = self.buf[j * self.size:(j + 1) * self.size]
        else:
            buf = np.empty(max(count, _HDR), np.uint8)
        self.data[j] = buf
        return buf

    def read(self):
        """Every source's message is in: its row into the table (and no
        source is left to receive from)."""
        for j in self.sources:
            self.table[j] = self.data[j][:_HDR].view(np.int64)
        self.sources = ()

    def payload(self, j):
        """The data that came after source ``j``'s row."""
        return self.data[j][_HDR:]

    def release(self, sendreqs):
        """The call is over: the receive buffer goes back to the pool, the
        send buffers once MPI is done with ``sendreqs`` (the call's sends,
        these rows' among them). The sends of a call whose data travelled
        with its rows (pooled messages, over the eager limit from 4 KiB)
        are not tested here: the rows of the call after next do
        (:func:`_drain`), when they are done. A row alone (80 bytes, sent
        eagerly: done at once) is tested now, which costs less than
        keeping it (4 KiB calls back to back, 4-6% slower medians when it
        waited too)."""
        if self.buf is not None:
            _pool.give(self.buf)
            self.buf = None
        if sendreqs and (self.held or not _sched.test(sendreqs)):
            _draining.append((sendreqs, self.held))
        else:
            for a in self.held:
                _pool.give(a)
        self.held = []

    def drop(self, sendreqs):
        """A failed call: its sends (the rows, which every peer receives
        before it decides) finish in the background."""
        self.buf = None
        if sendreqs:
            _draining.append((sendreqs, self.held))
        self.held = []


class Report:
    """The error report of a failed agreement: every rank's message
    (``text``, a str or None; one slot per rank,
    :func:`mpigc._plan.report_slot`) by a NONBLOCKING allgather on ``comm``;
    the call's steps wait for :attr:`req`, then raise :meth:`error`.

    A blocking allgather here deadlocked: a progress step (the progress
    thread's, or a test()) that reached a call's failed agreement while an
    earlier call still owed the peers its next stage blocked in the
    allgather, holding the engine lock, so that earlier call never advanced,
    and the peers, blocked waiting for it, never reached the allgather (seen
    in CI: test_random_faults, 2 ranks; the model checker's plant
    "blocking-report" puts it back)."""

    __slots__ = ("req", "mine", "all", "make_error")

    def __init__(self, comm, size, text, make_error=None):
        self.mine = _plan.report_slot(text)
        self.all = np.zeros(_plan.REPORT_SLOT * size, np.uint8)
        self.make_error = make_error
        self.req = comm.Iallgather([self.mine, MPI.BYTE], [self.all, MPI.BYTE])

    def texts(self):
        """Every rank's message (a str or None), once :attr:`req` is done."""
        return _plan.read_report(self.all)

    def error(self):
        """``make_error(every rank's message)``, once :attr:`req` is done."""
        return self.make_error(self.texts())


def failure_report(comm, kind, v, table, rank, exc, describe):
    """The report of a failed agreement (verdict ``v`` of ``table``:
    ``"mismatch"`` or ``"failed"``), flat or hierarchical: this rank's
    :func:`mpigc._plan.report_text` (``exc``: its own error, or None;
    ``describe()``: its size, dtype and settings as texts) to every rank of
    ``comm``; its :meth:`Report.error` is :func:`mpigc._plan.report_error`'s,
    the same on every rank."""
    text = _plan.report_text(v, table, rank, exc, describe)
    return Report(comm, comm.Get_size(), text,
                  lambda texts: _plan.report_error(kind, v, texts, len(table), exc))


class Outcomes:
    """The outcomes of several parts of a call (one int64 code per part: 0
    for success, else its error's :func:`mpigc._errors.code_of`) from every
    rank of ``comm``, by one nonblocking allgather: a hierarchical call's
    slice groups, each of which every node handles. The steps wait for
    :attr:`req`, then read :attr:`table` (a row per rank:
    :func:`mpigc._plan.slice_verdict`)."""

    __slots__ = ("req", "codes", "table")

    def __init__(self, comm, codes):
        self.codes = np.ascontiguousarray(codes, np.int64)
        self.table = np.zeros((comm.Get_size(), self.codes.size), np.int64)
        self.req = comm.Iallgather(self.codes, self.table)
