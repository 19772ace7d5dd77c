"""op="auto"'s cost model of a communicator and its decision (used by
:mod:`mpigc._auto`, which resolves ``op="auto"`` at the public entry points).

The model (:class:`Model`, one per user communicator, kept as an MPI
attribute of it). Each op the calls run has a *slot* per kind of call
(``allreduce``/``reduce_scatter``; the compressor's slot also per config and
``gather``; a slot is the CRC of that label modulo :data:`NSLOTS`, or the
next free one where another label took it first: the same on every rank). A call's time is its wall time on this rank, from its start
to the moment its completion is first seen, by its ``test()`` or its
``wait()`` (``op="none"``: the plain sum; a compressor: encoding, exchange
and decoding, all in one). A nonblocking call seen done late (it completed
while the caller computed, or while another call's wait drove it) counts
longer than it took; as a slot keeps its fastest time, a late sighting
only adds to the count. Before, only a ``wait()`` that found the call
unfinished timed it: callers that poll ``test()`` first (the DDP hook, for
its timeout and watch) were never timed, and the model measured for ever.
A slot's first call is a warm-up (JIT
compilation, buffers) and not counted. Per slot and size bucket (factors of
4 from 16 KiB) a rank keeps its count of calls, their KiB and its fastest
time since the last agreement step.

Every rank decides from the same numbers: the model decides only from
*agreed* figures. Every :data:`SYNC_EVERY`-th ``op="auto"`` call on a
communicator (the 5th, the 9th, ...; every :data:`SYNC_SLOW`-th from call
:data:`SYNC_SETTLED` on; all ranks make the same sequence of calls: each
call's agreement compares its op="auto" settings, :mod:`mpigc._auto`, and
a call that failed is undone: :meth:`Model.close`) waits for the table
posted at the previous such call and, once it went through (its agreement
compared that it is such a call on every rank, and it completes before it
returns), posts this rank's new one, on the model's own duplicate of the
communicator (:meth:`Model.join`, made after the first ``op="auto"`` call
went through, so that the tables never pair with a call of a rank without
op="auto"): a nonblocking ``op="none"`` allreduce of
:data:`NSLOTS` x :data:`NBUCKETS` x 4 float64 integers (24 KiB: count,
ranks, KiB, fastest µs, summed over the ranks: exact whatever the order, so
the same on every rank), run by the engine like any call. Of the last
:data:`WINDOW` agreement steps, the model's point per slot and size is the
fastest step's (the ranks' fastest times averaged) at its mean size: a call
slowed by other load moves nothing, and old steps drop out so the model
follows a changing machine. A slot's points are fitted as
``T = A + B * bytes`` by least squares (``A``: its latency, ``1/B``: its
throughput; one size only: through the origin). A rank's own figures never
reach a decision until every rank has the same agreed table.

The decision (:meth:`Model.decide`), per call, from agreed data only:

- pinned (``auto_pin=`` or ``$MPIGC_AUTO_PIN``: ``"none"`` or
  ``"compressed"``): that op, always (its time is still measured);
- below ``$MPIGC_MIN_COMPRESS_BYTES`` a compressed op would be a plain sum
  anyway: ``"none"``;
- *measuring*: until each of the two slots has :data:`MIN_SAMPLES` agreed
  samples per rank, the calls of a series (kind, gather, compressor) alternate,
  compressor first (call 0, 2, 4, ... compressed, 1, 3, ... plain);
- *model*: the op of the smaller predicted time at this call's bytes; the
  previous decision of the series stays unless the other is predicted at
  least :data:`HYSTERESIS` faster (each switch to ``"none"`` costs a copy
  where residuals are folded: :mod:`mpigc._auto`), or while the op not
  chosen has no figures left in the window (the series does not measure
  again: its probes bring them);
- *probe*: every ``$MPIGC_AUTO_PROBE``-th call of a series (default 100; 0:
  never) runs the op the model did not choose, so that its fit stays fresh.
"""
import os
import threading
import zlib
from collections import deque
from typing import NamedTuple, Optional

import numpy as np

from . import _comm
from . import _route
from . import _sched
from ._errors import ConfigError
from ._sched import Request

__all__ = ["SYNC_EVERY", "SYNC_SLOW", "SYNC_SETTLED", "WINDOW", "MIN_SAMPLES", "HYSTERESIS",
           "NSLOTS", "NBUCKETS", "INDEX_MOD", "Fit", "Decision", "Model", "bucket", "fit_points",
           "post_table", "probe_every"]

SYNC_EVERY = 4     # op="auto" calls of a communicator between two agreement steps ...
SYNC_SLOW = 16     # ... and from call SYNC_SETTLED on (a model in steady state)
SYNC_SETTLED = 64
WINDOW = 16        # agreed sums kept
MIN_SAMPLES = 2    # agreed samples of each op (per rank) before the model decides
HYSTERESIS = 0.05  # the other op must be predicted this much faster to switch
NSLOTS = 64        # slots of the agreed table: a label's is the CRC of its text
NBUCKETS = 12      # sizes per slot, by factors of 4 from 4 KiB (the last: all beyond)
INDEX_MOD = 8      # a call's agreement compares its index modulo this (mpigc._auto)
_NSTAT = 4         # posted per slot and size: count, ranks, KiB (sum), min µs (sum)


def probe_every():
    """``$MPIGC_AUTO_PROBE``: every this many calls of a series, the op the
    model did not choose runs once (default 100; 0: never)."""
    text = os.environ.get("MPIGC_AUTO_PROBE", "100")
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ConfigError(f"$MPIGC_AUTO_PROBE: expected an integer >= 0, got {text!r}")
    return value

class Fit(NamedTuple):
    """A slot's fit ``T = latency + bytes / bandwidth`` (seconds, bytes/s;
    ``bandwidth`` inf when the time does not grow with the bytes) from
    ``count`` agreed samples."""
    count: int
    latency: float
    bandwidth: float

    def predict(self, nbytes):
        return self.latency + (nbytes / self.bandwidth if self.bandwidth else 0.0)


def bucket(nbytes):
    """The size bucket of a call of ``nbytes``: 0 below 16 KiB, then one per
    factor of 4, the last one holding every larger call."""
    b, lim = 0, 16 << 10
    while nbytes >= lim and b < NBUCKETS - 1:
        b, lim = b + 1, lim * 4
    return b


def fit_points(points, count):
    """The :class:`Fit` of a slot's points ``[(KiB, µs)]`` (one per size
    bucket: the fastest time seen lately there, averaged over the ranks)
    from ``count`` samples, or None without points. Least squares where
    the sizes vary; through the origin (latency 0) where all are one size;
    a negative intercept or slope is clamped to 0 (the other refitted)."""
    if not points:
        return None
    n = float(len(points))
    sx = sum(p[0] for p in points)
    sy = sum(p[1] for p in points)
    sxx = sum(p[0] * p[0] for p in points)
    sxy = sum(p[0] * p[1] for p in points)
    den = n * sxx - sx * sx
    if n >= 2 and den > 1e-9 * n * sxx:
        b = (n * sxy - sx * sy) / den
        a = (sy - b * sx) / n
        if a < 0:
            a, b = 0.0, sxy / sxx
        if b < 0:
            a, b = sy / n, 0.0
    elif sx > 0:
        a, b = 0.0, sy / sx
    else:
        a, b = sy / n, 0.0
    # µs per KiB -> seconds per byte
    per_byte = b * 1e-6 / 1024
    return Fit(int(count), a * 1e-6, 1.0 / per_byte if per_byte > 0 else float("inf"))


class Decision(NamedTuple):
    """What an ``op="auto"`` call ran and why: ``op`` (``"none"`` or the
    compressor's id), ``reason`` (``"pinned"``, ``"small"``, ``"measuring"``,
    ``"model"``, ``"probe"``), the predicted seconds of each
    (``predicted_none``, ``predicted_compressed``; None before the model has
    data) and the call's bytes."""
    op: str
    reason: str
    predicted_none: Optional[float]
    predicted_compressed: Optional[float]
    nbytes: int


class Model:
    """The online cost model of one communicator (see the module docstring)."""

    def __init__(self, window=WINDOW):
        self.lock = threading.Lock()  # the sums and the window
        # a call's agreement step and decision; a model step's call, from its
        # start to its post or join (:meth:`enter`)
        self.order = threading.RLock()
        self.book = threading.RLock()  # the calls' bookkeeping: calls, series, slots, log
        self.slots = {}        # label -> its slot (the labels this rank has seen)
        # this rank's count, KiB and fastest µs per slot and size since the last post
        self.local = _empty_local()
        self.warm = set()      # slots whose warm-up call is done
        self.window = deque(maxlen=window)
        self.agreed = {}       # slot -> (count, [(KiB, µs)]): the window's points
        self.fits = {}         # slot -> its Fit, made at each merge
        self.calls = 0         # the index of the next call (calls that failed undone)
        self.log = []          # the _Call of each call since the last that went through
        self.entry = None      # the _Call of the call deciding now (under order)
        self.pending = None    # the call of the sums posted last (its Request made at
                               # the wait: the user's last_trace stays the user's call),
                               # or the sums, given back by a step that failed
        self.series = {}       # label -> [calls, last decision]
        self.syncs = 0
        self.chan = None       # the model's own duplicate of the communicator (join)

    def slot(self, label):
        """The slot of ``label``: its CRC modulo :data:`NSLOTS`, the same on
        every rank whatever the order of first use; where a label seen
        before holds it, the next free one (the labels come in the order of
        the calls, the same on every rank)."""
        with self.book:
            i = self.slots.get(label)
            if i is None:
                taken = set(self.slots.values())
                i = zlib.crc32(repr(label).encode()) % NSLOTS
                for _ in range(NSLOTS):
                    if i not in taken:
                        break
                    i = (i + 1) % NSLOTS
                self.slots[label] = i
                if self.entry is not None:
                    self.entry.labels.append(label)  # undone with it
        return i

    def record(self, slot, nbytes, seconds):
        """This rank's time of a completed call of ``slot`` (local only)."""
        with self.lock:
            if slot not in self.warm:
                self.warm.add(slot)
                return
            row = self.local[slot, bucket(nbytes)]
            row[0] += 1
            row[1] += nbytes // 1024
            row[2] = min(row[2], max(0, round(seconds * 1e6)))

    def fit(self, label):
        return self.fits.get(self.slot(label))

    def enter(self, wait=None):
        """At each op="auto" call, under :attr:`order`, before it decides:
        its :class:`_Call` (its index; whether it is a model step: the
        first call, after which the model joins, and every SYNC_EVERY-th,
        every SYNC_SLOW-th from call SYNC_SETTLED on, an agreement step).
        An agreement step waits for the sums posted at the previous one
        (every rank posted them: they are posted only once a step went
        through, :meth:`post`) and takes them in. What the call changes
        (the index, its series' counts, new slots until :meth:`decided`,
        the sums a step took in) is undone if it fails (:meth:`close`).
        ``wait``: how the sums are waited for (the caller's wait, which may
        raise at its timeout: the sums stay posted, for the next try);
        default their request's ``wait()``."""
        with self.book:
            c = self.calls
            self.calls += 1
            e = self.entry = _Call(c, c == 0 or c % (
                SYNC_EVERY if c < SYNC_SETTLED else SYNC_SLOW) == 0)
            self.log.append(e)
        if e.step and self.pending is not None:
            try:
                sums = self._received(wait)
            except BaseException:
                self.close(e, False)
                raise
            with self.lock:
                e.merged = (list(self.window), self.agreed, self.fits, self.syncs, sums)
            self.merge(sums)
        return e

    def _received(self, wait=None):
        """The sums posted last (waited for here, by ``wait`` if given, or
        taken back from a step that failed: :meth:`close`); :attr:`pending`
        is None after, and as it was if the wait raised."""
        got = self.pending
        if not isinstance(got, np.ndarray):
            if not isinstance(got, Request):
                got = self.pending = Request(got)
            if wait is not None:
                wait(got)
            got = got.wait()
        self.pending = None
        return got

    def decided(self):
        """The call of :meth:`enter` decided: later changes are not its."""
        with self.book:
            self.entry = None

    def close(self, entry, ok):
        """The call of ``entry`` is over: it went through (``ok``, on every
        rank) or failed (on every rank its call reached: a rank whose call
        was not op="auto" never entered it). A failed call, and the failed
        calls just before it, are undone once no later call of this rank is
        in flight or went through: the model is as if they had not been
        made, as on the ranks that did not make them (a step's sums wait
        for the next step again). A call started while such a call was in
        flight is numbered differently on the ranks that made it, and its
        agreement compares the number (:func:`mpigc._auto._mark`): it fails
        on every rank, and is undone with it."""
        with self.book:
            at = next((i for i, e in enumerate(self.log) if e is entry), None)
            if at is None:
                return  # a later call went through: nothing before it is undone
            if ok:
                del self.log[:at + 1]
                return
            entry.failed = True
            while self.log and self.log[-1].failed:
                e = self.log.pop()
                self.calls = e.index
                if e.merged is not None:
                    # its step took in the sums posted last: they wait for
                    # the next step again, as on the ranks whose call there
                    # was not a step (nothing was posted since: a step that
                    # went through after it would have kept it)
                    window, agreed, fits, syncs, self.pending = e.merged
                    with self.lock:
                        self.window.clear()
                        self.window.extend(window)
                        self.agreed, self.fits, self.syncs = agreed, fits, syncs
                for label in reversed(e.labels):
                    self.slots.pop(label, None)
                for series, st in e.series.items():
                    if st is None:
                        self.series.pop(series, None)
                    else:
                        self.series[series] = st

    def post(self):
        """Post this rank's sums since the last post (an op="none" allreduce
        on :attr:`chan`, waited at the next agreement step), once an
        agreement step's call went through (its agreement compared that it
        is one on every rank, so every rank posts), before anything else
        starts: a rank waiting for the sums never waits for a rank that
        has not posted them."""
        with self.lock:
            sums = post_table(self.local)
            self.local = _empty_local()
        req = _route.start("allreduce", sums, "none", {}, comm=self.chan,
                           key="mpigc/auto-model", average=False, gather="compressed",
                           feedback=False, nonfinite="raise", hierarchy="flat",
                           blocking=False)
        self.pending = req

    def join(self, comm):
        """After the communicator's first op="auto" call went through (its
        agreement compared the op="auto" mark, a model step's on every rank): the
        model's own duplicate of ``comm`` (collective; the pending calls
        completed first, as the engine does before a communicator's first
        use), where the agreement steps post their sums from the next
        one on (the first call's own sums are empty: a warm-up). The sums
        never travel on ``comm``, where a rank without op="auto" would pair
        one of its calls with them."""
        _sched.finish_pending()
        with _comm.creation_lock(comm):
            self.chan = comm.Dup()
        # the engine's first use of it is collective too: here, where every
        # rank is, not at the first post (a rank whose models went apart
        # after a failed call would make it alone)
        _comm.resolve(self.chan)

    def settle(self):
        """Wait for the sums posted last and take them in (every rank at the
        same point of its sequence of calls: ``mpigc-bench --model``, tests;
        the next agreement step posts afresh)."""
        with self.order:
            if self.pending is not None:
                self.merge(self._received())

    def merge(self, sums):
        """Agreed sums in (every rank's, summed: integers, exact). Per slot
        and size, the model's point is the fastest of the window's agreement
        steps (each: the ranks' fastest times averaged), at its mean size:
        robust to calls slowed by other load, as benchmarks take minima."""
        t = np.asarray(sums, dtype=np.float64).reshape(NSLOTS, NBUCKETS, _NSTAT)
        with self.lock:
            self.syncs += 1
            # the slots with figures in this step (a few): the window keeps those
            self.window.append({int(k): t[k].copy()
                                for k in np.flatnonzero(t[..., 1].any(axis=1))})
            agreed = {}
            for slot in sorted(set().union(*self.window)):
                w = np.stack([step[slot] for step in self.window if slot in step])
                has = w[..., 1] > 0                  # (steps, buckets)
                y = np.where(has, w[..., 3] / np.where(has, w[..., 1], 1), np.inf)
                best = np.argmin(y, axis=0)          # the first fastest step, on every rank
                pts = [(w[best[b], b, 2] / w[best[b], b, 0], y[best[b], b])
                       for b in np.flatnonzero(has.any(axis=0))]
                agreed[slot] = (int(w[..., 0].sum()), pts)
            self.agreed = agreed
            self.fits = {slot: fit_points(pts, n) for slot, (n, pts) in agreed.items()}

    def decide(self, series, none_label, comp_label, nbytes, pin, small, op_id, size):
        """The op of this call, from agreed data only (module docstring)."""
        with self.book:
            return self._decide(series, none_label, comp_label, nbytes, pin, small, op_id,
                                size)

    def _decide(self, series, none_label, comp_label, nbytes, pin, small, op_id, size):
        e = self.entry
        if e is not None and series not in e.series:
            old = self.series.get(series)
            e.series[series] = None if old is None else list(old)
        st = self.series.setdefault(series, [0, None])
        i = st[0]
        st[0] += 1
        fn, fc = self.fit(none_label), self.fit(comp_label)
        tn = None if fn is None else fn.predict(nbytes)
        tc = None if fc is None else fc.predict(nbytes)
        if pin != "model":
            return Decision(op_id if pin == "compressed" else "none", "pinned", tn, tc,
                            nbytes)
        if small:
            return Decision("none", "small", tn, tc, nbytes)
        best = st[1]
        if best is None:
            if fn is None or fc is None or min(fn.count, fc.count) < MIN_SAMPLES * size:
                return Decision(op_id if i % 2 == 0 else "none", "measuring", tn, tc, nbytes)
            best = "none" if tn <= tc else op_id
        elif fn is None or fc is None:
            pass  # the op not chosen has no figures left in the window: its probes bring them
        elif best == "none" and tc < tn * (1 - HYSTERESIS):
            best = op_id
        elif best != "none" and tn < tc * (1 - HYSTERESIS):
            best = "none"
        st[1] = best
        p = probe_every()
        if p and i % p == p - 1:
            return Decision("none" if best != "none" else op_id, "probe", tn, tc,
                            nbytes)
        return Decision(best, "model", tn, tc, nbytes)

    def describe(self):
        """``{label: Fit}`` of every label this rank has seen with agreed samples."""
        out = {}
        for label in list(self.slots):
            f = self.fit(label)
            if f is not None:
                out[label] = f
        return out

class _Call:
    """One op="auto" call's changes to the model (:meth:`Model.enter`):
    its index, whether it is a model step, the series it changed (their
    state before it), the labels it gave slots, and a step's sums taken in
    (the model before them)."""
    __slots__ = ("index", "step", "series", "labels", "failed", "merged")

    def __init__(self, index, step):
        self.index, self.step = index, step
        self.series, self.labels, self.failed = {}, [], False
        self.merged = None  # a step's model before the sums it took in, and the sums


def _empty_local():
    t = np.zeros((NSLOTS, NBUCKETS, 3))
    t[..., 2] = np.inf
    return t


def post_table(local):
    """What a rank posts of its ``local`` table (count, KiB, fastest µs per
    slot and size): count, ranks (1 where it has samples), KiB, fastest µs,
    all integers, so that their sum over the ranks is exact in any order."""
    out = np.zeros((NSLOTS, NBUCKETS, _NSTAT))
    has = local[..., 0] > 0
    out[..., 0] = local[..., 0]
    out[..., 1] = has
    out[..., 2] = local[..., 1]
    out[..., 3] = np.where(has, local[..., 2], 0.0)
    return out.ravel()

