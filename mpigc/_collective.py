"""The engine behind allreduce and reduce_scatter: MPI only, no bit twiddling.

One call (``_Op``) is a generator of steps (``_Op._steps``) that yields
what it waits for, effects that the scheduler (``mpigc._sched``) waits for or
tests: a blocking call is the same generator driven to its end by ``wait()``
(the blocking functions call it at once), a nonblocking one step by step by
``test()`` and the progress thread:

1. *prepare* (local): validate the input, compress this rank's shards with
   error feedback into one send buffer. The new worker residual is written
   to a scratch buffer, so the old one survives a failed call.
2. *agree*: every rank learns every rank's status row (error code,
   non-finite count, size, dtype, a fingerprint of the settings, terngrad's
   local scale, the count of finite values beyond the wire format's range).
   Up to 16 ranks the row travels point to point, in front of the data this
   rank sends each peer where that data is known already (phase 1's
   payloads; op="none"'s values on 2 ranks), so the agreement costs no round
   of its own; beyond 16 ranks, one small allgather. Any error, mismatch,
   non-finite or out-of-range value is raised on every rank, and no residual
   and no buffer has changed. Otherwise the worker residual is committed.
   The messages: ``mpigc._agree``.
3. *reduce-scatter*: each rank sends shard j's payload to rank j (with the
   row, or after the agreement as Isend/Irecv of packed bytes); the owner
   decodes and sums the N contributions in rank order (deterministic).
4. *allgather* (allreduce only): the owner's reduced shard travels to all
   ranks, recompressed with the owner residual (``gather="compressed"``) or
   as it is (``gather="exact"``), and each rank decodes it into place.
   Steps 3 and 4, pipelined in chunks or not: ``mpigc._twophase``.

``op="none"`` skips compression and is exactly MPI_Allreduce /
MPI_Reduce_scatter with MPI.SUM after the agreement, nonblocking calls too
(``mpigc._plainsum``; a thread per communicator runs their sums:
``mpigc._reducer``; on 2 ranks, up to 1 MiB, each rank adds the values that
came with its peer's row: a + b is b + a, the same bits, but where both are
NaN, so values that are not all finite are summed by MPI:
``mpigc._plainsum.inline_commutes``). So do compressed ops on
buffers smaller than ``$MPIGC_MIN_COMPRESS_BYTES`` (default 8192 bytes; see
:func:`min_compress_bytes`): below a few KiB the fixed cost of compressing
exceeds what fewer bytes save. Such calls use and change no residual.

Device arrays (anything with ``__cuda_array_interface__``) take the same
steps on the GPU: compression, decoding and accumulation run in
``mpigc.kernels.cuda``, residuals stay in device memory, results are written
in place. MPI is given device buffers when it is CUDA-aware
(:func:`mpigc.cuda_aware_mpi`); otherwise only the packed payloads cross to
the host, through reusable pinned buffers (``op="none"``, the small-buffer
fallback and ``gather="exact"`` move full-precision values there). The
default stream is synchronised before MPI reads device memory and before a
call returns (see ``docs/gpu.md``).
"""

import numpy as np
from mpi4py import MPI

from . import _comm
from . import _early
from . import _flatagree
from . import _plan
from . import _plainsum
from . import _prepared
from . import _sched
from . import _settings
from . import _shortcall
from . import _trace
from . import _twophase
from . import _wire
from ._sched import PendingCall
from ._errors import code_of
from .feedback import get_default_feedback

__all__ = ["start"]


# the columns of the agreement table (see mpigc._plan)
_CODE, _NBAD, _SCALE, _INLINE = _plan.CODE, _plan.NBAD, _plan.SCALE, _plan.INLINE
_N, _DTYPE, _FP, _CHUNK = _plan.N, _plan.DTYPE, _plan.FP, _plan.CHUNK


class _Input:
    """A flat call's data (:meth:`adopt`): its buffer on its backend's side,
    its prepared record (:class:`mpigc._prepared.Prepared`) and the working
    buffers re-bound from the record's pool, its residual transaction, and
    what it compressed before the agreement; and what becomes of them: the
    transaction committed or ended, the buffers given back, the result put
    where the caller wants it. The call (:class:`_Op`) decides when; a rank
    whose input fails keeps what was adopted before the error (its
    transaction, to end; its size and dtype, for its trace)."""

    def __init__(self, limits):
        # the call's limits (mpigc._wire.Limits): given by the call that
        # started this one, read by the short path, or read when it prepares
        self.limits = limits
        self.txn = None  # the residual transaction (mpigc._residual_txn.Transaction)
        self.key = None
        self.sendbuf = None  # phase 1's payloads, once packed (mpigc._twophase)
        self.x = self.e_in = self.e_out = self.clip_bound = None  # (compressed calls)
        self.none_buf = None  # the values a plain sum sums (plain calls)
        self.be = None  # the backend of the buffer's side (mpigc._backend)
        self.prep = None  # the call prepared (mpigc._prepared.Prepared)
        self.bufs = None  # its working buffers (a mpigc._prepared.BufferSet)
        # what the agreement step reads of a rank that failed early: defined
        # before anything can raise, so every rank evaluates it the same way
        self.n = self.dtype = self.nonfinite = None

    # -- 1. prepare ----------------------------------------------------------
    def adopt(self, kind, cs, group, fill, buf, op, params, key, average, gather, feedback,
              nonfinite, recvcounts, out, row):
        """Check, prepare and (a compressed call) compress the input of a
        call of ``kind`` on ``cs`` (``group``: a grouped call's members;
        ``fill``: see :class:`_Op`), filling this rank's agreement ``row``;
        raises what the row's code reports."""
        if self.limits is None:
            self.limits = _wire.read_limits()
        size, rank = cs.size, cs.rank
        if group is None:
            be, dbuf, dtype = _settings.adopt_input(kind, buf, cs)
            n = dbuf.size
        else:
            be, dtype = group.adopt(cs)
            n, recvcounts, key = sum(group.sizes), group.counts(size), group.key
        dev = be.device
        self.be = be
        self.buf = buf
        self.n = n
        self.dtype = dtype
        row[_N] = n
        row[_DTYPE] = _plan.DTYPE_CODE[dtype]

        # what the call's signature fixes, prepared once (mpigc._prepared)
        rec = self.prep = _prepared.prepare(kind, be.device, be.device_id, dtype, n,
                                            size, rank, op, params, key, average,
                                            gather, nonfinite, recvcounts, self.limits)
        st = rec.settings
        comp, plain, wdtype = rec.comp, rec.plain, rec.wdtype
        self.key = st.key
        self.nonfinite = nonfinite = st.nonfinite
        row[_FP] = st.fp
        # the call's working buffers, re-bound from the record's pool
        self.bufs = bufs = rec.buffers.take()
        if group is not None:
            # a plain allreduce uses no residual: its members simply follow
            # one another
            dbuf = group.fuse(be, bufs.get("fused", be, n, dtype), size,
                              plain and kind == "allreduce")
        self.flat = dbuf.reshape(dbuf.size)
        # before anything that can fail with a full row (a key in use):
        # every complete row says how the call is cut
        if rec.chunks is not None:
            row[_CHUNK] = len(rec.chunks)
        if fill is not None and rec.chunks is None:
            fill(0, n)  # read whole below (or by the inline path)
        lo, hi = rec.bounds[rank]
        self.out_given = out  # what reduce_scatter returns (the caller's object)
        if out is not None:
            out = be.adopt_out(out, hi - lo, dtype)  # on the side of buf
        self.out = out

        uses_state = not plain and feedback is not False
        self.use_ef = uses_state and comp.uses_feedback
        if uses_state:
            fb = get_default_feedback() if feedback is None else feedback
            if group is None:
                self.txn = fb.begin(self.key, n, wdtype, size, rank, dev,
                                    device_id=be.device_id)
            else:
                self.txn = fb.begin_group(group.keys, group.sizes, group.layout.place,
                                          group.owner_place(rank), hi - lo,
                                          wdtype, size, rank, dev,
                                          device_id=be.device_id)

        if plain:
            # MPI has no float16 sum: reduce a float32 copy
            if rec.f32_copy:
                self.none_buf = bufs.get("f32", be, n, np.float32)
                be.assign(self.none_buf, self.flat)
            else:
                self.none_buf = self.flat
            if nonfinite != "ignore":
                row[_NBAD] = be.count_nonfinite(self.none_buf)
            return
        e = _early.compress_early(rec, be, bufs, self.flat, self.txn, self.use_ef,
                                     rank, size)
        self.x, self.e_in, self.e_out = e.x, e.e_in, e.e_out
        self.clip_bound, self.sendbuf = e.clip_bound, e.sendbuf
        if e.scale is not None:
            row[_SCALE] = e.scale
        if e.bad is not None:
            _early.put_bad(row, e.bad)

    def bound(self, cs, tags, fill, table, rows, sendreqs, seq):
        """What the two phases bind (:class:`mpigc._prepared.Bound`)."""
        return _prepared.Bound(
            rec=self.prep, cs=cs, tags=tags, be=self.be, bufs=self.bufs, txn=self.txn,
            use_ef=self.use_ef, flat=self.flat, x=self.x, e_in=self.e_in, e_out=self.e_out,
            sendbuf=self.sendbuf, clip_bound=self.clip_bound, fill=fill, table=table,
            rows=rows, sendreqs=sendreqs, seq=seq, key=self.key)

    # -- the residual transaction ---------------------------------------------
    def end(self):
        """Undo the local effects of a call that will not go ahead: its key
        is free (at :meth:`settle` where the progress thread completed it)."""
        if self.txn is not None:
            # completed by the progress thread: the key stays in use until
            # the caller's test() or wait() sees the call done, as without
            # the thread (see Request.settle)
            self.txn.end(defer=_sched.in_progress_thread())

    def settle(self):
        if self.txn is not None:
            self.txn.settle()

    def commit(self, keep_replaced):
        """The call goes ahead: install the new worker residual."""
        if self.txn is not None:
            self.txn.commit(self.prep.comp.get_config(), keep_replaced)

    def phases_done(self, owner):
        """The two phases are over: the new owner residual (None: the old
        one stays) and the call's count."""
        if owner is not None:
            self.txn.set_owner(owner)
        if self.txn is not None:
            self.txn.count_call()

    def skipped(self, rank):
        """The call is skipped on every rank: the store counts a skipped
        step; returns the NaN values (:func:`mpigc._flatagree.nan_result`)."""
        if self.txn is not None:
            self.txn.skipped()
        return _flatagree.nan_result(self.prep, self.be, self.flat, rank)

    # -- the result ------------------------------------------------------------
    def release_buffers(self, result):
        """The call completed (or was skipped on every rank), every transfer
        done and its kernels synchronised: its working buffers serve a later
        call of its signature, but for its ``result`` (a failed call's are
        never given back: an MPI operation may still write them)."""
        bufs, self.bufs = self.bufs, None
        if bufs is not None:
            self.prep.buffers.give(bufs, result)

    def result(self, kind, group, rank, v):
        """The call's result: allreduce, the buffer (``v``, when not None,
        copied into it first); reduce_scatter, ``v``, this rank's shard (or
        the caller's ``out``, ``v`` copied in). A grouped call's go to its
        members."""
        be = self.be
        if kind == "allreduce":
            if v is not None and v is not self.flat:
                be.assign(self.flat, v)
            if group is not None:
                group.scatter(be, self.flat)
            return self.buf
        if group is not None:
            return group.shards(be, v, rank, lambda a: be.converted(a, self.dtype))
        if self.out is not None:
            be.assign(self.out, v)
            return self.out_given
        return v if v.dtype == self.dtype else be.converted(v, self.dtype)

    def trace_args(self):
        """The bytes, dtype and key, as far as they were adopted."""
        return {"bytes": 0 if self.n is None else self.n * self.dtype.itemsize,
                "dtype": str(self.dtype), "key": self.key}


class _Op(PendingCall):
    """One collective call (see the module docstring): its steps
    (:meth:`_steps`) and what they decide; its data is its :class:`_Input`
    (``x``)."""

    def __init__(self, kind, buf, op, params, cs, *, key, average, gather, feedback,
                 nonfinite, recvcounts, out, blocking, fill=None, keep_replaced=False,
                 group=None, pre=None, limits=None):
        self.kind = kind  # "allreduce" or "reduce_scatter"
        # a grouped call's members (mpigc._group.Group): the call reduces
        # their fused buffer, and its results go back to them
        self.group = group
        self.blocking = blocking
        # the caller keeps the worker residual this call replaces (the
        # hierarchical path may put it back if another group fails): it does
        # not go to the store's spare pool, where a later call could reuse it
        self.keep_replaced = keep_replaced
        # fill(lo, hi): writes elements [lo, hi) of buf before the engine first
        # reads them (the hierarchical path sums a node's values there just in
        # time, so that the sums overlap with the transfers of a pipelined call)
        self.fill = fill
        self.cs = cs  # the communicator's CommState (start() resolved it)
        if limits is None and pre is not None:
            limits = pre.limits
        self.x = x = _Input(limits)
        self.trace = _trace.CallTrace()  # what Request.trace shows
        self.size, self.rank = self.cs.size, self.cs.rank
        if pre is None:
            self.seq = self.cs.seq
            self.tags = self.cs.next_tags()
        else:  # the short path exchanged the rows (mpigc._shortcall.Handover)
            self.seq, self.tags = pre.seq, pre.tags
        self.state = "agree"
        self.result = None
        self.sendreqs = []
        self.rows = self.report = None
        self.local_error = None
        self.error = None
        row = _plan.new_row()
        try:
            x.adopt(kind, cs, group, fill, buf, op, params, key, average, gather, feedback,
                    nonfinite, recvcounts, out, row)
        except Exception as exc:  # noqa: BLE001 - reported collectively below
            self.local_error = exc
            row[_CODE] = code_of(exc)
            self.abandon()
        self.row = row
        if pre is None:
            self.rows = _flatagree.start_rows(self.cs, self.tags, row, x.prep,
                                              self.local_error is not None, x.none_buf,
                                              x.sendbuf, self.sendreqs)
        else:
            self.rows, self.sendreqs = pre.rows, pre.sendreqs
        self.table = self.rows.table
        self.steps = self._steps()
        _sched.enqueue(self)

    @property
    def bufs(self):
        """The call's working buffers (None once given back): its input's."""
        return self.x.bufs

    # -- 2. agree ------------------------------------------------------------
    def abandon(self):
        """Undo the local effects of a call that will not go ahead."""
        self.x.end()

    def settle(self):
        """The caller saw the call done: release a key that the progress
        thread left in use."""
        self.x.settle()

    def release_agree(self):
        """The call is over: its agreement buffers go back to the pool, the
        send buffers once MPI is done with them."""
        if self.rows is not None:
            self.rows.release(self.sendreqs)
        self.sendreqs = []

    def _drop_agree(self):
        """A failed call: its sends (the agreement messages, which every peer
        receives before it decides) finish in the background."""
        if self.rows is not None:
            self.rows.drop(self.sendreqs)
        self.sendreqs = []

    def set_result(self, v):
        """The call's result (:meth:`_Input.result`)."""
        self.result = self.x.result(self.kind, self.group, self.rank, v)

    def _finish_plain(self, v, sent, pieces):
        """The plain sum is over (:meth:`mpigc._plainsum.PlainSum.finish`):
        ``v`` holds it (allreduce: the buffer's values or a float32 copy;
        reduce_scatter: this rank's shard), ``sent`` bytes went out, in
        ``pieces`` MPI sums."""
        self.trace.summed(pieces)
        if self.x.prep.settings.average:
            self.x.be.divide(v, self.size)
        self._done(v, sent)

    def _finish(self, sent, acc, owner):
        """The two phases are over (:meth:`mpigc._twophase.TwoPhase.products`):
        ``sent`` bytes of data went out; ``acc``: this rank's reduced shard;
        ``owner``: the new owner residual (None: the old one stays)."""
        self.sendreqs = []  # complete: the steps waited for them
        self.x.phases_done(owner)
        self._done(None if self.kind == "allreduce" else acc, sent)

    def _stop(self):
        """The table's non-finite and out-of-range counts stop the call:
        raise NonFiniteError on every rank, or skip it on every rank (NaN
        results); nothing else has changed."""
        t, x = self.table, self.x
        v = _plan.nonfinite_verdict(t, x.nonfinite)
        self.abandon()
        if v.kind == "nonfinite":
            raise _flatagree.nonfinite_error(self.kind, t, x.prep.comp)
        self.set_result(x.skipped(self.rank))
        x.be.sync()
        x.release_buffers(self.result)
        self.state = "done"
        self.release_agree()

    def _done(self, v, sent):
        """The call's result: the buffer (allreduce; ``v``, when not None,
        copied into it first) or ``v`` (reduce_scatter); then its buffers go
        back."""
        x = self.x
        _wire.add_traffic(sent, x.flat.nbytes)
        self.set_result(v)
        x.be.sync()  # the kernels are asynchronous
        x.be.release()  # the staging buffers
        x.release_buffers(self.result)
        self.release_agree()
        self.abandon()
        self.state = "done"

    # -- the steps, driven by the scheduler (mpigc._sched.PendingCall) -----------
    def _failed(self, exc):
        # a failed call's fused buffer is not reused: an MPI operation may
        # still write it
        _comm.internal_error(exc, self.cs.comm, f"mpigc {self.kind}")
        self.error = exc
        self.abandon()
        self._drop_agree()

    def _end(self):
        self.state = "done"
        _sched.dequeue(self)

    def device_id(self):
        # a grouped call's backend is its members' (mpigc._group.Group.adopt)
        return None if self.x.be is None else self.x.be.device_id

    def trace_args(self):
        comp = None if self.x.prep is None else self.x.prep.comp
        name = f"{self.kind} {comp.codec_id if comp is not None else '?'}"
        return name, dict(self.x.trace_args(), ranks=self.size, blocking=self.blocking,
                          members=None if self.group is None else len(self.group.given),
                          error=None if self.error is None else str(self.error))

    def _my_turn(self):
        """Every earlier call of this communicator has acted on its agreement."""
        return not any(op.cs is self.cs and op.state == "agree"
                       for op in _sched.earlier(self))

    def _steps(self):
        rows, x = self.rows, self.x
        if rows.req is not None:  # by allgather
            yield rows.req
        if rows.sources is not None:
            # the peers' rows (and data), matched by probe (written here, not
            # as a sub-generator: small calls are made of such steps)
            comm, tag, reqs = self.cs.comm, self.tags[2], []
            for j in rows.sources:
                msg, count = yield _sched.Probe(comm, j, tag)
                reqs.append(msg.Irecv([rows.slot(j, count), count, MPI.BYTE]))
            if not _sched.test(reqs):  # a small message is in at once
                yield _sched.All(reqs)
            rows.read()
        # what follows the agreement may start collectives (the error
        # report, op="none"): every rank must start them in the same
        # order, so calls act on their agreements in the order they began
        if not self._my_turn():
            yield _sched.Turn(self._my_turn)
        self.state = "agreed"
        self.trace.agreed()
        v = _flatagree.verdict(self.table, self.rank, x.nonfinite)
        if v.kind in ("mismatch", "failed"):
            if v.kind == "mismatch":
                self.abandon()
            # the report is a collective started after the agreement
            # (cs.post), reached by every rank whatever this one holds
            self.report = _flatagree.report(self.cs, self.kind, v, self.table,
                                            self.local_error, x.prep, x.n, x.dtype)
            self.state = "report"
            yield self.report.req
            raise self.report.error()
        if v.kind != "go":
            self._stop()  # raises, or skips
            return
        rec = x.prep
        if rec.chunks is None:
            # a pipelined call's residual is committed once the counts of
            # non-finite values, known after its last chunk, agree too
            x.commit(self.keep_replaced)
        # the data travelled with the rows when every row says so
        # (a list's all(): numpy's reduction costs more than its few values)
        inline = rows.sources is not None and all(self.table[:, _INLINE].tolist())
        self.trace.went("plain" if rec.plain else "two-phase", inline)
        if rec.plain:
            # the steps of the plain sum (here, not as a sub-generator:
            # small calls are made of such steps)
            plain = _plainsum.PlainSum(self, rec, self.cs, x.be, x.none_buf, self.blocking)
            if inline and plain.add_inline(rows.payload(1 - self.rank)):
                self._finish_plain(*plain.finish())
                return
            here = (yield _sched.Alone(plain.may_hand_over)) if self.blocking else True
            self.state = "none"
            left = plain.start(here)
            if left is not None:
                yield left
            self._finish_plain(*plain.finish())
            return
        self.state = "phases"
        if rec.chunks is not None:
            self.trace.pipelined(len(rec.chunks))
            _wire.count("pipelined_calls")
        tp = _twophase.TwoPhase(x.bound(self.cs, self.tags, self.fill, self.table, rows,
                                        self.sendreqs, self.seq), inline)
        end = yield from tp.steps()
        if end == "trailers":  # a pipelined call: the trailers' counts decide
            self.table = tp.trail  # (read, never written: the rows' table stays theirs)
            if _plan.nonfinite_verdict(self.table, x.nonfinite).kind == "go":
                x.commit(self.keep_replaced)
                tp.go()
            else:
                tp.stop()
            end = yield from tp.steps()
        if end == "stopped":  # phase 1 is complete
            self._stop()
            return
        self._finish(*tp.products())


def start(kind, buf, op, params, *, comm, key, average, gather, feedback, nonfinite,
          recvcounts=None, out=None, blocking, fill=None, keep_replaced=False, group=None,
          short=False, limits=None):
    """Create and start one collective call; returns its ``_Op`` (``fill``,
    host buffers only, ``keep_replaced``, ``group`` and ``limits``: see
    ``_Op.__init__``), or, where ``short`` (a blocking allreduce of one
    buffer or of a group, as :mod:`mpigc._route` decides), what the short path of a
    repeated small call returns when it completed the call."""
    # a communicator's first use is collective (Dup, a Sendrecv per peer),
    # outside the engine lock: the pending calls are completed first, as a
    # peer may wait for one of them (_sched.finish_pending). The user's
    # thread was noted by mpigc._route.start: this function also starts a
    # hierarchical call's inter-node calls, in whatever thread advances it
    if not _sched.idle() and _comm.lookup(comm) is None:
        _sched.finish_pending()
    cs = _comm.resolve(comm)
    with _sched.lock:
        pre = None
        if short:
            # a repeated small call may run straight through (mpigc._shortcall)
            if group is None:
                pre = _shortcall.run(buf, op, params, cs, key, average, gather, nonfinite)
            else:
                pre = _shortcall.run_group(group, op, params, cs, average, gather, nonfinite)
            if isinstance(pre, _shortcall.Done):
                return pre
        o = _Op(kind, buf, op, params, cs, key=key, average=average, gather=gather,
                feedback=feedback, nonfinite=nonfinite, recvcounts=recvcounts, out=out,
                blocking=blocking, fill=fill, keep_replaced=keep_replaced, group=group,
                pre=pre, limits=limits)
    if not blocking and o.state != "done":
        _sched.wake()
    return o
