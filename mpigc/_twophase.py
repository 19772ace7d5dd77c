"""The two phases of a compressed call, pipelined or not: one path.

A call is cut into chunks (``cuts[c][j]``: the range of shard j that
chunk c covers); a call that is not pipelined is one chunk of whole
shards. Phase 1 (reduce-scatter): each rank compresses chunk after
chunk and sends each piece to its owner at once; owners decode-
accumulate each chunk's pieces in rank order as they arrive (on a
device, all of a chunk's with one launch once they are in). Phase 2
(allreduce's gather): each owner recompresses chunk c of its shard with
its owner residual (or sends it exact) as soon as chunk c is reduced,
while later chunks are still arriving, and everyone puts each piece in
place as it arrives.

When the counts of non-finite and out-of-range values are known
decides the rest. Not pipelined, the one chunk was compressed before
the agreement (terngrad: its scale before, the payloads at once
after), its counts travelled in the rows, the verdict is in and the
residual committed before the call gets here; its payloads may even
have come with the rows (inline). Pipelined, nothing is compressed
before the agreement: after the last chunk each rank sends every peer
its agreement row again with the two counts filled in (the trailer, tag
tags[2] + 1); once every trailer is in, the table of trailers decides as the
agreement's table would have. On a failure every rank first
completes phase 1's transfers (all of them were posted), then raises
or skips with nothing changed; otherwise the worker residual is
committed and phase 2 starts.

Device buffers go through the backend's wire (staging buffers without
CUDA-aware MPI; the arrays themselves on the host).

The call (:class:`mpigc._collective._Op`) has compressed what it could before
the agreement (:mod:`mpigc._early`: its functions return what they
produced) and acted on the agreement; :class:`TwoPhase` holds the
phases' own buffers and requests, and its :meth:`TwoPhase.steps` are the
rest of the call's steps (effects of :mod:`mpigc._sched`). The phases are
a function of the call's prepared record (:class:`mpigc._prepared.Prepared`),
its transaction and communicator and what it bound to them
(:class:`mpigc._prepared.Bound`);
they return what they produced (the trailers' table, this rank's reduced
shard, the bytes sent, the new owner residual) to the call, which alone
commits, skips, raises and sets its result.
"""
import numpy as np
from mpi4py import MPI

from . import _plan
from . import _sched
from . import _timeline
from . import _wire
from ._backend import part
from ._early import bits_f64, count_bad, local_scale, pack_shards, put_bad, stream

__all__ = ["TwoPhase", "Gather"]



class TwoPhase:
    """Phase 1 (reduce-scatter) and, for allreduce, phase 2 (the gather) of
    one call (``b``, :class:`mpigc._prepared.Bound`); ``inline``: phase 1's
    payloads came with the rows."""

    def __init__(self, b, inline):
        """After the agreement: the layout, phase 1's receives (and the
        trailers), the payloads of a call compressed before the agreement,
        and phase 2's receives once the verdict is in."""
        self.b = b
        rec, be = b.rec, b.be
        comm, r, size = b.cs.comm, b.cs.rank, b.cs.size
        self.rank, self.size, self.kind = r, size, rec.kind
        self.sendreqs = b.sendreqs  # the call's list of sends, extended here
        self.e_out = b.e_out
        sendbuf = b.sendbuf
        if rec.chunks is None and sendbuf is None:
            sendbuf = self._pack_scaled()  # terngrad: only now, with the agreed scale
        self.plan = p = rec.phases  # prepared once per signature
        self.cuts, self.psz, self.poff = p.cuts, p.psz, p.poff
        if p.counts == "trailer":
            self.sendbuf = b.bufs.get("send", be, p.total, np.uint8)
            self.cpack, self.verdict = 0, None  # trailers decide
        else:
            self.sendbuf = sendbuf  # laid out as p.poff[0]
            self.cpack, self.verdict = 1, "go"  # packed; the rows decided
        nc = len(self.cuts)
        # phase 1's receives: a slot per sender, chunk by chunk
        self.rbase, o = p.recv_slots(r)
        self.rreq1 = [[None] * size for _ in range(nc)]
        tag = b.tags[0]
        self.recvbuf = self.wire1 = None  # inline: the payloads came with the rows
        if not inline:
            self.recvbuf = b.bufs.get("recv1", be, o, np.uint8)
            self.wire1 = be.wire(self.recvbuf)
            for c in range(nc):
                m = self.psz[c][r]
                if m:
                    for k in range(1, size):  # receives first, then sends
                        j = (r - k) % size
                        q = self.rbase[c] + j * m
                        self.rreq1[c][j] = _wire.post(comm.Irecv, self.wire1[q:q + m], j, tag,
                                                      rec.limits.max_count)
        if self.verdict is None:
            self.trail = _plan.new_table(size)  # every rank's row, counts filled in
            self.treq = [comm.Irecv(self.trail[j], source=j, tag=b.tags[2] + 1)
                         for j in range(size) if j != r]
        else:
            self.treq = []
            if not inline:
                self._send_chunk(0)
        lo, hi = rec.bounds[r]
        self.acc = b.bufs.get("acc", be, hi - lo, rec.sum_dtype)
        self.c1 = self.src1 = self.nbad = 0
        self.resumed = False  # steps() goes on after the trailers' verdict
        self.gather = None  # phase 2 (allreduce), once the verdict is in
        if self.verdict == "go":
            self._start_gather()

    def _pack_scaled(self):
        """terngrad quantizes only once the rows agree, with the scale all
        ranks agreed on (the largest); returns the packed payloads."""
        b = self.b
        rec = b.rec
        if b.use_ef:
            self.e_out = b.txn.ensure_worker(lambda: b.be.empty(rec.n, rec.wdtype))
        else:
            self.e_out = None
        scale = max(bits_f64(v) for v in b.table[:, _plan.SCALE])
        kw = {"scale": scale, "clip_bound": b.clip_bound,
              "stream": stream(rec, b.txn, b.seq, b.key, self.rank, 0)}
        return pack_shards(rec, b.be, b.bufs, b.x, b.e_in, self.e_out, self.rank, self.size,
                           kw)[0]

    def _pack_chunk(self):
        """Compress chunk ``cpack`` (every shard's piece) and send each piece
        to its owner; after the last one, the trailer (pipelined calls)."""
        b = self.b
        rec = b.rec
        comm, r, size, c = b.cs.comm, self.rank, self.size, self.cpack
        kw = {}
        if rec.comp.prescales_average and rec.settings.average:
            kw = {"divisor": float(size)}
        x, ei, eo = b.x, b.e_in, self.e_out
        t0 = _timeline.ON and _timeline.now()
        for j in range(size):
            lo, hi = self.cuts[c][j]
            if hi > lo:
                if b.fill is not None:
                    b.fill(lo, hi)
                o = self.poff[c][j]
                self.nbad += rec.comp.encode_into(
                    x[lo:hi], None if ei is None else ei[lo:hi],
                    None if eo is None else eo[lo:hi],
                    self.sendbuf[o:o + self.psz[c][j]], **kw)
        if t0:
            _timeline.span("compress", t0, args={"chunk": c})
        self._send_chunk(c)
        self.cpack += 1
        if self.cpack == len(self.cuts):
            row = self.trail[r]
            row[:] = b.table[r]
            put_bad(row, count_bad(b.be, x, ei, rec.settings.nonfinite, self.nbad))
            for k in range(1, size):
                self.sendreqs.append(comm.Isend(self.trail[r], dest=(r + k) % size,
                                                tag=b.tags[2] + 1))

    def _send_chunk(self, c):
        """Each of chunk ``c``'s packed pieces to its owner."""
        b = self.b
        comm, r, size = b.cs.comm, self.rank, self.size
        b.be.ready_for_mpi()  # the payloads are packed before MPI reads them
        send = b.be.wire(self.sendbuf, send=True)
        for k in range(1, size):
            j = (r + k) % size
            m = self.psz[c][j]
            if m:
                o = self.poff[c][j]
                self.sendreqs.append(_wire.post(comm.Isend, send[o:o + m], j, b.tags[0],
                                                b.rec.limits.max_count))

    def _piece1(self, c, j):
        """Sender ``j``'s payload of chunk ``c`` of this rank's shard."""
        r = self.rank
        m = self.psz[c][r]
        if j == r:
            return part(self.sendbuf, self.poff[c][r], self.poff[c][r] + m)
        if self.recvbuf is None:  # the payloads came with the rows
            return self.b.rows.payload(j)
        return self.recvbuf[self.rbase[c] + j * m:self.rbase[c] + (j + 1) * m]

    def _decode_phase1(self):
        """Decode-accumulate phase 1's pieces that are in: chunk by chunk,
        each chunk's in rank order (on a device, all of a chunk's with one
        launch once they are in). True if any was."""
        b = self.b
        rec, be = b.rec, b.be
        comp, r, size = rec.comp, self.rank, self.size
        lo_r = rec.bounds[r][0]
        average = rec.settings.average
        moved = False
        while self.c1 < self.cpack:  # this rank's own piece must be packed
            c = self.c1
            a, z = self.cuts[c][r]
            m = self.psz[c][r]
            acc = part(self.acc, a - lo_r, z - lo_r)
            if be.batch_decode:
                t0 = _timeline.ON and _timeline.now()
                ok = _sched.test([q for q in self.rreq1[c] if q is not None])
                if t0:
                    _timeline.span("MPI test", t0, min_us=20)
                if not ok:
                    return moved
                base = self.rbase[c]
                if any(q is not None for q in self.rreq1[c]):
                    # every sender's piece off the wire in one copy (this
                    # rank's slot too, which the assign below writes over)
                    be.unstage(part(self.recvbuf, base, base + size * m),
                               part(self.wire1, base, base + size * m))
                    self.rreq1[c] = [None] * size
                if z > a:
                    # the own payload joins the received ones (m bytes apart),
                    # then one decode of all senders, summed in rank order
                    t0 = _timeline.ON and _timeline.now()
                    be.assign(part(self.recvbuf, base + r * m, base + (r + 1) * m),
                              self._piece1(c, r))
                    comp.decode_shards(part(self.recvbuf, base, base + size * m), m, size,
                                       (0, z - a), (0,), acc, False)
                    if t0:
                        _timeline.span("decode", t0, args={"chunk": c})
            else:
                while self.src1 < size:
                    j = self.src1
                    req = self.rreq1[c][j]
                    if req is not None:
                        t0 = _timeline.ON and _timeline.now()
                        ok = _sched.test([req])
                        if t0:
                            _timeline.span("MPI test", t0, min_us=20)
                        if not ok:
                            return moved
                        self.rreq1[c][j] = None
                    if z > a:
                        t0 = _timeline.ON and _timeline.now()
                        comp.decode_into(self._piece1(c, j), acc, j > 0)
                        if t0:
                            _timeline.span("decode", t0, args={"chunk": c, "from": j})
                    self.src1 += 1
                    moved = True
            if z > a and average and not comp.prescales_average:
                be.divide(acc, size)
            self.c1 += 1
            self.src1 = 0
            moved = True
        return moved

    def go(self):
        """The trailers' verdict is "go" (the call committed its residual):
        phase 2 starts."""
        self.verdict, self.resumed = "go", True
        self._start_gather()

    def stop(self):
        """The trailers' verdict is not "go": phase 1 completes, then the
        call raises or skips."""
        self.verdict, self.resumed = "stop", True

    def _start_gather(self):
        if self.kind == "allreduce":
            self.gather = Gather(self.b, self.plan, self.acc)

    def steps(self):
        """Steps of a compressed call (effects of :mod:`mpigc._sched`). A
        progress step compresses at most one chunk (the engine lock is held
        meanwhile: :data:`mpigc._sched.PAUSE`) and handles what has arrived;
        a blocking wait runs the call to its end, waiting in MPI only when
        nothing is left to compute. Returns ``"trailers"`` once a pipelined
        call's trailers are all in (:attr:`trail`, every rank's row with its
        counts: the caller decides, calls :meth:`go` or :meth:`stop`, and
        runs these steps again), ``"stopped"`` once phase 1 of a stopped
        call is complete, or ``"done"`` (:meth:`products`)."""
        b = self.b
        nc = len(self.cuts)
        resumed, self.resumed = self.resumed, False
        while True:
            moved = False
            if resumed:  # the pass that returned the trailers goes on
                resumed, moved = False, True
            else:
                if self.cpack < nc:
                    self._pack_chunk()
                    moved = True
                moved |= self._decode_phase1()
                if self.verdict is None and self.cpack == nc and _sched.test(self.treq):
                    return "trailers"
            if self.verdict == "stop":
                # phase 1 was posted whole: complete it, then raise or skip
                if self.c1 == nc:
                    yield _sched.All(self.sendreqs)
                    return "stopped"
            elif self.verdict == "go":
                g = self.gather
                if g is not None:
                    while g.c < self.c1:
                        g.send_chunk()
                        moved = True
                    moved |= g.arrived()
                    over = g.c == nc and not g.left
                else:
                    over = self.c1 == nc
                if over:
                    if g is not None and b.be.batch_decode:
                        g.unstage_all()
                        if b.rec.settings.gather != "exact":
                            g.decode_all()
                    # reduce_scatter after phase 1: only the sends are left,
                    # waited for like any step (a receiver that is waiting
                    # for an earlier call of this rank would never take them)
                    yield _sched.All(self.sendreqs)
                    return "done"
            if moved:
                if self.cpack < nc:
                    yield _sched.PAUSE
                continue  # nothing left to compress: handle all that is in
            # nothing to compute: wait for whichever receive completes first.
            # A phase 1 piece or a trailer stays null once completed and is
            # handled by the next pass (a null request tests complete); a
            # phase 2 piece is handled here, as a later Testsome will not
            # report it
            waiting = [q for q in self.rreq1[self.c1] if q] if self.c1 < nc else []
            waiting += [q for q in self.treq if q]
            first2 = len(waiting)
            if self.gather is not None:
                waiting += self.gather.reqs
            if any(waiting):
                i = yield _sched.Any(waiting)
                if i != MPI.UNDEFINED and i >= first2:
                    self.gather.arrived_piece(i - first2)
            else:
                yield _sched.All(self.sendreqs)

    def products(self):
        """What a call that is over produced: ``(sent, acc, owner)``, the
        bytes of data this rank sent, its reduced shard and the new owner
        residual (None: the old one stays)."""
        g = self.gather
        return (self.plan.bytes_sent(self.rank), self.acc,
                None if g is None else g.new_owner())


class Gather:
    """Phase 2 of an allreduce (:class:`TwoPhase`): each owner's reduced
    shard, chunk by chunk, to every peer, recompressed with the owner
    residual (``gather="compressed"``) or as it is (``"exact"``), and every
    peer's into place in the caller's buffer."""

    def __init__(self, cb, plan, acc):
        """Phase 2's receives, a piece per chunk and peer, of the call
        ``cb`` (:class:`mpigc._prepared.Bound`); ``acc``: this rank's
        reduced shard, filled by phase 1 chunk by chunk."""
        self.b, self.plan, self.acc, self.cuts = cb, plan, acc, plan.cuts
        self.c = 0  # chunks sent
        self.obad = False  # a piece beyond the wire format: the owner residual kept
        self.reqs, self.meta = [], []  # receives, and their (chunk, sender)
        comm, r, size, cuts = cb.cs.comm, cb.cs.rank, cb.cs.size, self.cuts
        tag = cb.tags[1]
        if cb.rec.settings.gather == "exact":
            isz = cb.rec.dtype.itemsize
            self.wire = wire = cb.be.wire(cb.flat.view(np.uint8))
            for c in range(len(cuts)):
                for k in range(1, size):
                    j = (r - k) % size
                    a, b = cuts[c][j]
                    if b > a:
                        self.meta.append((c, j))
                        self.reqs.append(_wire.post(comm.Irecv, wire[a * isz:b * isz], j, tag,
                                                    cb.rec.limits.max_count))
        else:
            self.recvbuf = cb.bufs.get("recv2", cb.be, self.plan.total2, np.uint8)
            self.wire = wire = cb.be.wire(self.recvbuf)
            for c in range(len(cuts)):
                for k in range(1, size):
                    j = (r - k) % size
                    m = self.plan.psz2[c][j]
                    if m:
                        o = self.plan.poff2[c][j]
                        self.meta.append((c, j))
                        self.reqs.append(_wire.post(comm.Irecv, wire[o:o + m], j, tag,
                                                    cb.rec.limits.max_count))
            if cb.use_ef:
                lo, hi = cb.rec.bounds[r]
                cb.txn.ensure_owner(lambda: cb.be.zeros(hi - lo, cb.rec.wdtype))
                # double-buffered: the old owner residual is the next call's
                self.owner_out = (cb.txn.take_owner_scratch(hi - lo, cb.rec.wdtype) if hi > lo
                                  else cb.be.empty(0, cb.rec.wdtype))
        self.left = len(self.reqs)

    def send_chunk(self):
        """Phase 2 of chunk ``c`` (reduced): this owner's piece to every
        peer, recompressed with the owner residual (or exact), and into
        place here."""
        cb = self.b
        comm, r, size, c = cb.cs.comm, cb.cs.rank, cb.cs.size, self.c
        lo = cb.rec.bounds[r][0]
        a, b = self.cuts[c][r]
        self.c += 1
        if b == a:
            return
        t0 = _timeline.ON and _timeline.now()
        acc = part(self.acc, a - lo, b - lo)
        if cb.rec.settings.gather == "exact":
            cb.be.assign(cb.flat[a:b], acc)
            isz = cb.rec.dtype.itemsize
            src, p, q = cb.flat.view(np.uint8), a * isz, b * isz
        else:
            p, q = self.plan.poff2[c][r], self.plan.poff2[c][r] + self.plan.psz2[c][r]
            src = self.recvbuf
            e = eo = None
            if cb.use_ef:
                e, eo = (part(cb.txn.owner(), a - lo, b - lo),
                         part(self.owner_out, a - lo, b - lo))
            kw, bad = {"offset": a}, 0
            if cb.rec.comp.needs_global_scale:
                amax, bound, bad = local_scale(cb.rec, cb.be, acc, e)
                kw.update(scale=amax, clip_bound=bound,
                          stream=stream(cb.rec, cb.txn, cb.seq, cb.key, r, 1))
            x = acc if acc.dtype == cb.rec.wdtype else cb.be.converted(acc, cb.rec.wdtype)
            bad += cb.rec.comp.encode_into(x, e, eo, part(src, p, q), **kw)
            if bad:
                # a reduced value beyond the wire format (a sum beyond fp16's
                # or float32's range): this piece arrives non-finite
                # everywhere, and the owner residual is kept whole
                cb.rec.comp.mark_out_of_range(src[p:q], b - a)
                self.obad = True
        cb.be.ready_for_mpi()
        cb.be.stage(self.wire, src, p, q)
        if t0:
            _timeline.span("compress (gather)", t0, args={"chunk": c})
        for k in range(1, size):
            cb.sendreqs.append(_wire.post(comm.Isend, self.wire[p:q], (r + k) % size,
                                          cb.tags[1], cb.rec.limits.max_count))
        if cb.rec.settings.gather != "exact" and not cb.be.batch_decode:
            self._decode_piece(src[p:q], a, b)

    def _decode_piece(self, payload, a, b):
        """Decode ``payload`` into the user's buffer at ``[a, b)`` (through a
        float32 copy for float16 buffers)."""
        cb = self.b
        t0 = _timeline.ON and _timeline.now()
        target = cb.flat[a:b]
        if target.dtype == np.float16:
            tmp = cb.be.empty(b - a, np.float32)
            cb.rec.comp.decode_into(payload, tmp, False)
            cb.be.assign(target, tmp)
        else:
            cb.rec.comp.decode_into(payload, target, False)
        if t0:
            _timeline.span("decode (gather)", t0)

    def decode_all(self):
        """Every shard of a device call's gather into place with one decode
        (one chunk: the device calls are not pipelined)."""
        cb = self.b
        t0 = _timeline.ON and _timeline.now()
        starts, offs = _plan.shard_starts(cb.rec.bounds, cb.rec.n), tuple(self.plan.poff2[0])
        if cb.flat.dtype == np.float16:
            tmp = cb.be.empty(cb.rec.n, np.float32)
            cb.rec.comp.decode_shards(self.recvbuf, 0, 1, starts, offs, tmp, False)
            cb.be.assign(cb.flat, tmp)
        else:
            cb.rec.comp.decode_shards(self.recvbuf, 0, 1, starts, offs, cb.flat, False)
        if t0:
            _timeline.span("decode (gather)", t0)

    def arrived(self):
        """Phase 2's pieces that are in: into place. True if any was. Only
        this method and :meth:`TwoPhase.steps` complete these requests
        (each is counted once: a completed request is null from then on)."""
        if not self.left:
            return False
        t0 = _timeline.ON and _timeline.now()
        done = _sched.arrived(self.reqs)
        if t0:
            _timeline.span("MPI test", t0, min_us=20)
        for i in done:
            self.arrived_piece(i)
        return bool(done)

    def arrived_piece(self, i):
        """Phase 2's receive ``i`` completed: its piece into place (on a
        device, decoded with the others once all are in)."""
        cb = self.b
        self.left -= 1
        if cb.be.batch_decode:
            return  # off the wire with the others (unstage_all)
        c, j = self.meta[i]
        a, b = self.cuts[c][j]
        if cb.rec.settings.gather == "exact":
            isz = cb.rec.dtype.itemsize
            cb.be.unstage(cb.flat.view(np.uint8)[a * isz:b * isz],
                          self.wire[a * isz:b * isz])
            return
        o, m = self.plan.poff2[c][j], self.plan.psz2[c][j]
        cb.be.unstage(self.recvbuf[o:o + m], self.wire[o:o + m])
        self._decode_piece(self.recvbuf[o:o + m], a, b)

    def unstage_all(self):
        """A device call's gathered pieces off the wire, in one copy: this
        owner's own piece too, staged from the same bytes before it went out
        (one chunk: the device calls are not pipelined)."""
        cb = self.b
        if cb.cs.size > 1:
            dst = cb.flat.view(np.uint8) if cb.rec.settings.gather == "exact" else self.recvbuf
            cb.be.unstage(dst, self.wire)

    def new_owner(self):
        """The call is over: the new owner residual that replaces the old,
        or None where the old one is kept (no residuals, the exact gather,
        or a piece beyond the wire format: the old one kept whole)."""
        cb = self.b
        if cb.use_ef and not self.obad and cb.rec.settings.gather != "exact":
            return self.owner_out
        return None
