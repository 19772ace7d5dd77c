"""A hierarchical call on the scheduler (:class:`_HierCall`): the steps of
:mod:`mpigc._hierarchy` (an exact intra-node reduce-scatter, compressed
inter-node calls of the flat engine per slice, an intra-node allgather or
redistribution) as a generator of effects; :func:`start` starts one
(:mod:`mpigc._route` decides which calls are hierarchical)."""
import itertools
import json
import zlib
from typing import NamedTuple

import numpy as np

from . import _agree, _collective, _comm, _plan, _sched, _settings, _trace, _wire
from ._errors import StateError, code_of
from ._hierarchy import (node_sum_fill, own_sums, read_node_results, redistribute, slice_key,
                         store_for_peers)
from .compressors import work_dtype
from .feedback import get_default_feedback, shard_bounds

__all__ = ["start"]

# the agreement row of the flat calls (mpigc._plan), with the columns a
# hierarchical call fills: code, size, dtype, settings
_CODE, _N, _DTYPE, _FP = _plan.CODE, _plan.N, _plan.DTYPE, _plan.FP
_call_ids = itertools.count(1)


def start(lay, kind, buf, op, params, *, comm, key, average, gather, feedback, nonfinite,
          recvcounts, out, blocking):
    """Start one hierarchical call on layout ``lay`` (:func:`mpigc._hierarchy.layout`
    of ``comm``); returns the :class:`_HierCall`, in the engine's queue."""
    call = _HierCall(lay, kind, buf, op, params, comm, key, average, gather, feedback,
                     nonfinite, recvcounts, out)
    call.begin()
    if not blocking and call.state != "done":
        _sched.wake()
    return call


class _Args(NamedTuple):
    """A hierarchical call's arguments, as the caller gave them (its
    plain sum's flat call is given them again)."""
    key: object
    average: object
    gather: object
    feedback: object
    nonfinite: object
    recvcounts: object
    out: object


class _Input:
    """A hierarchical call's input and settings, checked (:meth:`adopt`, the
    checks and settings of a flat call), and its hold on its key. A rank
    whose input fails keeps what was adopted before the error (its backend,
    to release)."""

    def __init__(self, args):
        self.args = args  # the call's arguments (_Args)
        # the buffer's backend (a device one's device_id is made current by
        # the progress thread: _HierCall.device_id); the caller's buffer,
        # flat, on its side (side_flat) and in host memory (flat: the same
        # array for a host buffer, a staging copy for a device one), where
        # the intra-node steps run
        self.be = self.side_flat = self.flat = None
        self.n = self.dtype = self.settings = self.key = None
        self.limits = None  # the call's (mpigc._wire.Limits), its inter-node calls' too
        self.plain = False
        self.fb = None  # the residual store, None with feedback=False
        self.busy = None  # this call's name in the store's keys in use (_hold_key)

    def adopt(self, lay, kind, buf, op, params, row):
        """Check the input and fill this rank's agreement ``row``; raises
        what a flat call would (its code travels in the row)."""
        g = self.args
        # the limits the settings depend on, from the environment now, as a
        # flat call reads them; its inter-node calls are given them
        self.limits = _wire.read_limits()
        # (raises DTypeError where there are no CUDA kernels for a device
        # array: reported on every rank)
        self.be, a, dtype = _settings.adopt_input(kind, buf, _comm.resolve(lay.comm))
        self.flat = self.side_flat = a.reshape(a.size)  # on the host: below
        self.n = n = a.size
        self.dtype = dtype
        self.wd = np.dtype(work_dtype(dtype))
        row[_N] = n
        row[_DTYPE] = _plan.DTYPE_CODE[dtype]
        st = _settings.settings_for(kind, dtype, lay.size, op, params, g.key, g.average,
                                    g.gather, g.nonfinite, n, g.recvcounts, self.limits)
        self.comp, self.average, self.gather, self.nonfinite = (st.comp, st.average,
                                                                st.gather, st.nonfinite)
        self.bounds, self.key, self.plain = st.bounds, st.key, st.plain
        lo, hi = self.bounds[lay.rank]
        self.out, self.dout = g.out, None
        if g.out is not None:
            self.dout = self.be.adopt_out(g.out, hi - lo, dtype)  # or raises
        if g.feedback is not False:
            self.fb = get_default_feedback() if g.feedback is None else g.feedback
        self.settings = settings = dict(st.config, layout=lay.describe())
        row[_FP] = zlib.crc32(json.dumps(settings, sort_keys=True).encode())
        if not self.plain:
            # a device buffer's values to the host now (the caller's thread,
            # the GPU current; adopt waited for the stream that produced them)
            self.flat = self.be.host_copy(self.side_flat)
            if self.fb is not None:
                # (a plain call, op="none" or a small buffer, uses no residual:
                # as on the flat path, it does not hold the key)
                self._hold_key()  # last: nothing after it can fail
        # no pass over the input for non-finite values: a non-finite input makes
        # its node's sum non-finite (NaN and inf propagate through the sum), which
        # the inter-node call detects before any residual changes; the ranks
        # that hold them are named then (_input_nonfinite)

    def _hold_key(self):
        """Report the call to the residual store as a pending user of its key
        (a checkpoint raises StateError until it is done, as for a flat call,
        whose own keys are busy from its start), under a name of its own,
        ``"{key}@hier (call N)"``; StateError if a pending hierarchical call
        of the same store holds the key already (rule 3 of the nonblocking
        calls: its code travels in the row, so every rank raises it)."""
        prefix = f"{self.key}@hier (call "
        busy = self.fb.hold_name(prefix, lambda: f"{prefix}{next(_call_ids)})")
        if busy is None:
            raise StateError(f"key {self.key!r} is already used by a pending "
                             "hierarchical collective; wait for it, or use distinct "
                             "keys")
        self.busy = busy

    def release_key(self):
        if self.busy is not None:
            self.fb.release(self.busy)
            self.busy = None

    def describe(self):
        """This rank's size, dtype and settings, as texts (a mismatch's)."""
        return {"size": str(self.n), "dtype": str(self.dtype),
                "settings": json.dumps(self.settings, sort_keys=True)}

    def shard_result(self, res):
        """reduce_scatter's result ``res`` (host, the input's dtype) where the
        caller wants it: ``out``, or a new array on the side of the buffer."""
        if self.out is None:
            return self.be.to_side(res)
        self.be.put(self.dout, res)
        return self.out

    def skipped(self, kind, rank, buf):
        """The call is skipped on every rank (nonfinite="skip"): the store
        counts a skipped step; returns the NaN result (allreduce: ``buf``,
        filled with NaN)."""
        if self.fb is not None:
            self.fb.count_skipped_step()
        if kind == "allreduce":
            self.be.fill_nan(self.side_flat)
            self.be.sync()
            return buf
        lo, hi = self.bounds[rank]
        return self.shard_result(np.full(hi - lo, np.nan, self.dtype))


class _HierCall(_sched.PendingCall):
    """One hierarchical call, held in the engine's queue of pending calls
    (``mpigc._sched``) like an engine call, with the same protocol
    (``progress``, ``done_or_failed``, ``finished``, ``result``, ``cs``).

    Its steps are a generator (:meth:`_steps`) that yields what it waits for:
    an MPI request, or engine calls (its inter-node calls). Every step after
    :meth:`begin` is nonblocking MPI on communicators private to the layout
    (``lay.comm``, the node's, the slice groups, and the engine's duplicates of
    ``lay.comm`` and the groups), so a progress step never blocks in MPI (the
    progress thread holds the engine lock while it steps). On each rank the
    hierarchical calls of one layout advance one at a time, the oldest first
    (:meth:`_head`): they issue their collectives on those communicators in the
    same order everywhere, and one call at a time uses the node's window.
    Only the agreement rows go out at :meth:`begin`, in program order, on a
    communicator of their own (``lay.agree_comm``)."""

    polite = True  # blocking waits test and sleep (see _sched._wait_politely)

    def __init__(self, lay, kind, buf, op, params, comm, key, average, gather, feedback,
                 nonfinite, recvcounts, out):
        self.lay, self.kind, self.buf, self.op, self.params = lay, kind, buf, op, params
        self.comm = comm
        self.cs = lay  # the engine orders calls by .cs; never one of its CommStates
        self.trace = _trace.CallTrace("hierarchical")  # Request.trace
        self.state = "pending"
        self.result = self.error = None
        self.x = _Input(_Args(key, average, gather, feedback, nonfinite, recvcounts, out))

    # -- the engine's protocol (PendingCall) -------------------------------------------
    def settle(self):
        """The caller saw the call done: its key is no longer in use."""
        self.x.release_key()

    def _head(self):
        """No earlier hierarchical call of this layout is pending here."""
        return not any(op.cs is self.cs for op in _sched.earlier(self))

    def _failed(self, exc):
        _comm.internal_error(exc, self.lay.comm, f"hierarchical mpigc {self.kind}")
        self.error = exc

    def _end(self):
        self.state = "done"
        if self.x.be is not None:
            self.x.be.sync()  # the last copies out of its staging buffers
            self.x.be.release()
        _sched.dequeue(self)

    def device_id(self):
        # its staging copies run in its steps, and the inter-node calls that
        # its steps start adopt the GPU current then
        return None if self.x.be is None else self.x.be.device_id

    def trace_args(self):
        x = self.x
        return f"{self.kind} (hierarchical)", {
            "bytes": 0 if x.n is None else x.n * x.dtype.itemsize, "key": x.key,
            "ranks": self.lay.size, "slices": self.lay.L,
            "error": None if self.error is None else str(self.error)}

    # -- 1. the start and the input agreement ------------------------------------------
    def begin(self):
        """Check the input, send the agreement rows and queue the call.

        The rows go out on ``lay.agree_comm`` now, in program order. The first
        call of a size larger than the node's window so far (a collective
        allocation on the node) completes the earlier hierarchical calls of
        the layout, waits for the agreement and grows the window here: every
        node rank with the same valid input does the same, at the same call.
        Meanwhile every other pending call advances (a peer may be waiting
        for one of them before it starts this call), and this call's own
        steps wait: none of them runs before the window has grown. The window
        grows outside the engine lock (a blocking collective on the node). The
        rest of the call is progressed from the queue."""
        lay, x = self.lay, self.x
        lay.ready_for_calls()
        row = _plan.new_row()
        self.exc = None
        try:
            x.adopt(lay, self.kind, self.buf, self.op, self.params, row)
        except Exception as e:  # noqa: BLE001 - reported collectively
            self.exc = e
            row[_CODE] = code_of(e)
        self.alone = lay.node_comm.Get_size() == 1
        self.need = 0
        if self.exc is None and not x.plain and not self.alone:
            self.need = x.n * x.wd.itemsize
        grow = self.need > lay.window_bytes()
        with _sched.lock:
            self.row = row  # MPI reads it until the rows are in
            rows = _agree.Rows(lay.agree_comm, lay.rank, lay.size, None, row, None, 0, None,
                               by_allgather=True)
            self.table, self.agree_req = rows.table, rows.req
            self.steps = self._steps()
            _sched.enqueue(self)
            if grow:
                self.running = True  # held: progress() passes it by
                try:
                    for op in list(_sched.earlier(self)):
                        if op.cs is lay:
                            _sched.complete(op)
                    self._await_rows()
                    grow = self._verdict().kind == "go"
                except BaseException:
                    self.running = False
                    raise
                self.running = grow
        if grow:
            # every node rank, at this call; outside the lock, as it blocks in
            # MPI: a rank's other user thread may need the lock to start the
            # call that a peer's other thread waits for before it comes here
            # (the model checker's two-thread hierarchical scenarios, seed 30
            # at 2 ranks, hung with the window grown under the lock)
            try:
                lay.shared(self.need)
            finally:
                with _sched.lock:
                    self.running = False

    def _await_rows(self):
        """Wait for the agreement rows, advancing every other pending call
        meanwhile; politely, as a blocking wait of its steps (begin() of a call that grows
        the window)."""
        _sched.poll(self.agree_req.Test)

    def _verdict(self):
        """The agreed table's verdict; no non-finite counts here: the
        inter-node calls check those."""
        return _plan.verdict(self.table, self.lay.rank, "ignore")

    # -- the steps ---------------------------------------------------------------------
    def _steps(self):
        lay, x = self.lay, self.x
        # the hierarchical calls of a layout advance one at a time, oldest first
        yield _sched.Turn(self._head)
        fence = lay.take_read_fence()
        if fence is not None:
            # the node's ranks have read the last call's results out of the window
            yield fence
        # while the rows travel: this rank's values into its segment of the
        # node's window (when it is large enough already)
        stored = self.need and lay.window_bytes() >= self.need
        if stored:
            store_for_peers(lay, lay.shared(self.need), x.flat, x.n, x.wd)
        yield self.agree_req
        v = self._verdict()  # the window is large enough then (begin)
        if v.kind != "go":  # mismatch or failed (no non-finite counts here)
            report = _agree.failure_report(lay.comm, self.kind, v, self.table, lay.rank,
                                           self.exc, x.describe)
            yield report.req
            raise report.error()
        if x.plain:
            return (yield from self._plain())
        segs, acc = yield from self._node_sums(stored)
        parts, skipped = yield from self._inter_node(segs, acc)
        if skipped is not None:  # nonfinite="skip" on every rank: NaN results
            return skipped
        if self.kind == "allreduce":
            return (yield from self._allreduce_result(segs, acc))
        return (yield from self._reduce_scatter_result(parts))

    def _plain(self):
        """Steps of op="none" and small buffers: the flat engine (a plain MPI
        sum), on the layout's own communicator (the same ranks in the same
        order)."""
        x = self.x
        sub = _collective.start(self.kind, self.buf, self.op, self.params,
                                comm=self.lay.comm, key=x.key, average=x.average,
                                gather=x.gather, feedback=x.args.feedback,
                                nonfinite=x.nonfinite, recvcounts=x.args.recvcounts,
                                out=x.args.out, blocking=False, limits=x.limits)
        yield _sched.Calls([sub])
        sub.settle()
        sub.finished()
        return sub.result

    def _node_sums(self, stored):
        """Steps of stage 1: the node's window (``segs``, None on a node of
        one rank) and this rank's range of the node's sum (``acc``). The sums
        are made in this rank's own segment (where no peer reads), slice by
        slice as the inter-node calls read them (their ``fill``), so that they
        overlap with those calls' transfers."""
        lay, x = self.lay, self.x
        if self.alone:  # a node of one rank: nothing to sum
            lo, hi = lay.element_range(lay.rank, x.n)
            return None, x.flat[lo:hi].astype(x.wd)
        segs = lay.shared(self.need)
        acc = yield from own_sums(lay, segs, x.flat, x.n, x.wd, stored)
        return segs, acc

    def _inter_node(self, segs, acc):
        """Steps of stage 2: one inter-node engine call per slice this rank
        handles, all started now, in slice order on every rank; then every
        group's outcome. Returns this rank's reduced slices on the host, in
        slice order, and None; or None and the call's result where it is
        skipped (:meth:`_group_outcome`)."""
        lay, x = self.lay, self.x
        n, wd, fb = x.n, x.wd, x.fb
        lo = lay.element_range(lay.rank, n)[0]
        sb = shard_bounds(n, lay.L)
        # one transaction on the slices' residuals (mpigc._residual_txn): if a
        # group fails, every slice's goes back to what it was
        txn = None if fb is None else fb.transaction()
        subs, parts = [], []
        for s in lay.slices_of(lay.rank):
            slo, shi = sb[s]
            v = acc[slo - lo:shi - lo]
            if shi == slo:  # fewer elements than slices: nothing to reduce
                parts.append(v.copy())
                continue
            sk = slice_key(x.key, s, lay.L, n)
            # recorded by reference: the inter-node calls keep the arrays
            # they replace (keep_replaced)
            if txn is not None:
                txn.keep(sk)
            fill = None if self.alone else node_sum_fill(lay, segs, x.flat, n, wd, slo)
            # on a device, the node's sums made now and copied there, where the
            # engine reduces them between the nodes (its residuals there)
            sv, fill = x.be.for_engine(v, fill)
            sub = _collective.start(self.kind, sv, self.op, self.params,
                                    comm=lay.groups[s], key=sk, average=False,
                                    gather=x.gather,
                                    feedback=False if fb is None else fb,
                                    nonfinite="ignore" if x.nonfinite == "ignore"
                                    else "raise", blocking=False, fill=fill,
                                    keep_replaced=True, limits=x.limits)
            subs.append((s, sub))
            parts.append((v, sub))
        if subs:
            yield _sched.Calls([sub for _, sub in subs])
            for _, sub in subs:
                sub.settle()  # this call saw them done: their keys are free
        skipped = yield from self._group_outcome(subs, txn)
        if skipped is not None:
            return None, skipped
        if txn is not None:
            txn.accept()
        # the reduced slices on the host (in the window for allreduce, where
        # the node's ranks read them); a host call's are there already
        return [x.be.to_host(p[1].result, p[0] if self.kind == "allreduce" else None)
                if isinstance(p, tuple) else p for p in parts], None

    def _group_outcome(self, subs, txn):
        """Steps: every group's outcome (:func:`_group_failures`). Where one
        failed, the slices' residuals are put back (``txn``, the transaction
        on them: None without residuals) and the call raises,
        or, where every failure is a non-finite sum under nonfinite="skip",
        returns its NaN result (None: every group succeeded)."""
        failed = yield from _group_failures(self.lay, subs)
        if failed is None:
            return None
        v, texts, cause = failed
        if txn is not None:
            txn.restore()
        if v.kind == "nonfinite":
            ranks = ""
            if self.x.nonfinite == "raise":
                ranks = yield from _input_nonfinite(self.lay.comm, self.x.flat)
            return self._nonfinite(ranks or (
                "a node's sum is not finite, or beyond the range of the wire format ("
                + _plan.report_detail(v.ranks, texts, _plan.SLICE_GROUPS) + ")"))
        raise _plan.report_error(f"{self.kind} (hierarchical)", v, texts, self.lay.L, cause,
                                 _plan.SLICE_GROUPS, "; no residual changed")

    def _allreduce_result(self, segs, acc):
        """Steps of stage 3 of allreduce: every node rank's range, reduced in
        place in its segment (the reduced slices are there), read into the
        buffer."""
        lay, x = self.lay, self.x
        if x.average:
            acc /= lay.size
        if self.alone:
            lo, hi = lay.element_range(lay.rank, x.n)
            x.flat[lo:hi] = acc
        else:
            yield from read_node_results(lay, segs, x.flat, x.n, x.wd)
        x.be.put(x.side_flat, x.flat)  # a device buffer's result, in place
        return self.buf

    def _reduce_scatter_result(self, parts):
        """Steps of stage 3 of reduce_scatter: the reduced slices to the ranks
        whose shards they hold."""
        lay, x = self.lay, self.x
        pieces = [(a, b, p) for (_, a, b), p in zip(lay.owned_ranges(lay.rank, x.n), parts)]
        res = yield from redistribute(lay, pieces, x.bounds, x.n, x.wd)
        if x.average:
            res /= lay.size
        return x.shard_result(res.astype(x.dtype, copy=False))

    def _nonfinite(self, what):
        if self.x.nonfinite == "raise":
            raise _plan.nonfinite_error(self.kind, what)
        return self.x.skipped(self.kind, self.lay.rank, self.buf)


def _group_failures(lay, subs):
    """Steps: the outcome of every slice group, agreed inside the node only
    (:class:`mpigc._agree.Outcomes`: a code per group in each rank's row): an
    inter-node call (``subs``, ``(slice, call)`` of this rank's) fails or
    succeeds on all of its group, and every node has a handler of every slice,
    so each node learns every group's outcome without a collective across the
    nodes. Decided on the set of failed slices (the same on every node), never
    on which rank reported them (:func:`mpigc._plan.slice_verdict`). None when
    every group succeeded, else ``(verdict, texts, cause)``: the texts of the
    failed slices' errors (a list by slice, from whichever node rank ran
    each), this rank's first error."""
    codes = np.zeros(lay.L, np.int64)
    texts, cause = {}, None
    for s, sub in subs:
        if sub.error is not None:
            cause = cause or sub.error
            codes[s] = code_of(sub.error)
            texts[s] = str(sub.error)
    outcomes = _agree.Outcomes(lay.node_comm, codes)
    yield outcomes.req
    v = _plan.slice_verdict(outcomes.table)
    if v is _plan.GO:
        return None
    # a node rank's texts of the groups it ran, as JSON in its report slot
    got = yield from _texts(lay.node_comm, _plan.fit_json(texts))
    for t in got:
        texts.update({int(s): x for s, x in json.loads(t).items()})
    return v, [texts.get(s) for s in range(lay.L)], cause


def _input_nonfinite(comm, flat):
    """Steps, on the failure path only: "non-finite values in the input on
    rank r (count), ..." when any rank's input (``flat``, on the host) holds
    some, else an empty string (the node sum overflowed)."""
    mine = np.array([np.count_nonzero(~np.isfinite(flat))], np.int64)
    nbad = np.zeros(comm.Get_size(), np.int64)
    yield comm.Iallgather(mine, nbad)
    return _plan.nonfinite_causes(nbad)


def _texts(comm, text):
    """Steps: every rank's ``text`` (a str, or None) by the engine's report
    (:class:`mpigc._agree.Report`)."""
    report = _agree.Report(comm, comm.Get_size(), text, None)
    yield report.req
    return report.texts()
