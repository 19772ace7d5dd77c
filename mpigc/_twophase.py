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
the agreement and acted on the agreement; :class:`TwoPhase` holds the
phases' own buffers and requests, and its :meth:`TwoPhase.steps` are the
rest of the call's steps (effects of :mod:`mpigc._sched`).
"""
import struct
import zlib

import numpy as np
from mpi4py import MPI

from . import _dispatch
from . import _flatagree
from . import _plan
from . import _sched
from . import _timeline
from . import _wire
from ._backend import part
from .kernels import cpu as _cpu

__all__ = ["TwoPhase", "Gather", "pack_shards", "count_bad", "f64_bits"]


# -- what a call compresses before the agreement, and what both phases share ----------
# (functions of the call ``op``, a mpigc._collective._Op, that prepare runs
# before the agreement and the phases after it)

def f64_bits(x):
    """A float64's bits as an int64 (terngrad's scale travels in the rows so)."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _bits_f64(i):
    return struct.unpack("<d", struct.pack("<q", int(i)))[0]


def _stream(op, rank, stage):
    """terngrad's random stream: seed and key, rank, the key's call count
    (the communicator's call count for calls without state), stage."""
    calls = None if op.txn is None else op.txn.calls()
    if calls is None:
        calls = op.seq
    seed = op.comp.seed ^ (zlib.crc32(op.key.encode()) << 32)
    return _cpu.ternary_stream(seed, rank, calls, stage)


def pack_shards(op, row, scale=None):
    """Compress every shard into one send buffer (``op.sendbuf``), laid out
    as the one chunk of the call's phases (``op.prep.phases``); the bad
    counts into ``row`` (when not None)."""
    plan = op.prep.phases
    op.sendbuf = op.bufs.get("send", op.be, plan.total, np.uint8)
    kw = {}
    if op.comp.needs_global_scale:
        kw = {"scale": scale, "clip_bound": op.clip_bound, "stream": _stream(op, op.rank, 0)}
    elif op.comp.prescales_average and op.average:
        kw = {"divisor": float(op.size)}
    # every shard in one call: one kernel launch on a GPU (the host loops)
    t0 = _timeline.ON and _timeline.now()
    nbad = op.comp.encode_shards(op.x, op.e_in, op.e_out, op.sendbuf,
                                 _plan.shard_starts(op.bounds, op.n), plan.poff[0], **kw)
    if t0:
        _timeline.span("compress", t0)
    if row is not None:
        count_bad(op, row, nbad)


def _pack_scaled(op):
    """terngrad quantizes only once the rows agree, with the scale all
    ranks agreed on (the largest)."""
    if op.use_ef:
        op.e_out = op.txn.ensure_worker(lambda: op.be.empty(op.n, op.wdtype))
    else:
        op.e_out = None
    pack_shards(op, None, scale=max(_bits_f64(v) for v in op.table[:, _plan.SCALE]))


def count_bad(op, row, nbad):
    """Split the encoder's bad count ``nbad`` into the non-finite values of
    ``x + e`` (column ``NBAD``) and the finite values that the wire format
    cannot carry (column ``RANGE``); the exact count runs only when ``nbad``
    is not 0, and not at all under ``nonfinite="ignore"``."""
    if nbad == 0 or op.nonfinite == "ignore":
        row[_plan.NBAD] = nbad
        return
    nf = _dispatch.kernels(op.x).stats(op.x, op.e_in)[3]
    row[_plan.NBAD] = nf
    row[_plan.RANGE] = max(nbad - nf, 0)


class TwoPhase:
    """Phase 1 (reduce-scatter) and, for allreduce, phase 2 (the gather) of
    one call ``op``; ``inline``: phase 1's payloads came with the rows."""

    def __init__(self, op, inline):
        """After the agreement: the layout, phase 1's receives (and the
        trailers), the payloads of a call compressed before the agreement,
        and phase 2's receives once the verdict is in."""
        self.call = op
        comm, r, size, be = op.cs.comm, op.rank, op.size, op.be
        if op.chunks is None and op.sendbuf is None:
            _pack_scaled(op)  # terngrad: packed only now, with the agreed scale
        self.plan = p = op.prep.phases  # prepared once per signature
        self.cuts, self.psz, self.poff = p.cuts, p.psz, p.poff
        if p.counts == "trailer":
            self.sendbuf = op.bufs.get("send", be, p.total, np.uint8)
            self.cpack, self.verdict = 0, None  # trailers decide
        else:
            self.sendbuf = op.sendbuf  # laid out as p.poff[0]
            self.cpack, self.verdict = 1, "go"  # packed; the rows decided
        nc = len(self.cuts)
        # phase 1's receives: a slot per sender, chunk by chunk
        self.rbase, o = p.recv_slots(r)
        self.rreq1 = [[None] * size for _ in range(nc)]
        tag = op.tags[0]
        self.recvbuf = self.wire1 = None  # inline: the payloads came with the rows
        if not inline:
            self.recvbuf = op.bufs.get("recv1", be, o, np.uint8)
            self.wire1 = be.wire(self.recvbuf)
            for c in range(nc):
                m = self.psz[c][r]
                if m:
                    for k in range(1, size):  # receives first, then sends
                        j = (r - k) % size
                        b = self.rbase[c] + j * m
                        self.rreq1[c][j] = _wire.post(comm.Irecv, self.wire1[b:b + m], j, tag,
                                                      op.limits.max_count)
        if self.verdict is None:
            self.trail = _plan.new_table(size)  # every rank's row, counts filled in
            self.treq = [comm.Irecv(self.trail[j], source=j, tag=op.tags[2] + 1)
                         for j in range(size) if j != r]
        else:
            self.treq = []
            if not inline:
                self._send_chunk(0)
        lo, hi = op.bounds[r]
        self.acc = op.bufs.get("acc", be, hi - lo, op.prep.sum_dtype)
        self.c1 = self.src1 = self.nbad = 0
        self.gather = None  # phase 2 (allreduce), once the verdict is in
        if self.verdict == "go":
            self._start_gather()

    def _pack_chunk(self):
        """Compress chunk ``cpack`` (every shard's piece) and send each piece
        to its owner; after the last one, the trailer (pipelined calls)."""
        op = self.call
        comm, r, size, c = op.cs.comm, op.rank, op.size, self.cpack
        kw = {}
        if op.comp.prescales_average and op.average:
            kw = {"divisor": float(size)}
        x, ei, eo = op.x, op.e_in, op.e_out
        t0 = _timeline.ON and _timeline.now()
        for j in range(size):
            lo, hi = self.cuts[c][j]
            if hi > lo:
                if op.fill is not None:
                    op.fill(lo, hi)
                o = self.poff[c][j]
                self.nbad += op.comp.encode_into(
                    x[lo:hi], None if ei is None else ei[lo:hi],
                    None if eo is None else eo[lo:hi],
                    self.sendbuf[o:o + self.psz[c][j]], **kw)
        if t0:
            _timeline.span("compress", t0, args={"chunk": c})
        self._send_chunk(c)
        self.cpack += 1
        if self.cpack == len(self.cuts):
            row = self.trail[r]
            row[:] = op.table[r]
            count_bad(op, row, self.nbad)
            for k in range(1, size):
                op.sendreqs.append(comm.Isend(self.trail[r], dest=(r + k) % size,
                                              tag=op.tags[2] + 1))

    def _send_chunk(self, c):
        """Each of chunk ``c``'s packed pieces to its owner."""
        op = self.call
        comm, r, size = op.cs.comm, op.rank, op.size
        op.be.sync()  # the payloads are packed before MPI reads them
        send = op.be.wire(self.sendbuf, send=True)
        for k in range(1, size):
            j = (r + k) % size
            m = self.psz[c][j]
            if m:
                o = self.poff[c][j]
                op.sendreqs.append(_wire.post(comm.Isend, send[o:o + m], j, op.tags[0],
                                              op.limits.max_count))

    def _piece1(self, c, j):
        """Sender ``j``'s payload of chunk ``c`` of this rank's shard."""
        op = self.call
        r, m = op.rank, self.psz[c][op.rank]
        if j == r:
            return part(self.sendbuf, self.poff[c][r], self.poff[c][r] + m)
        if self.recvbuf is None:  # the payloads came with the rows
            return op.rows.payload(j)
        return self.recvbuf[self.rbase[c] + j * m:self.rbase[c] + (j + 1) * m]

    def _decode_phase1(self):
        """Decode-accumulate phase 1's pieces that are in: chunk by chunk,
        each chunk's in rank order (on a device, all of a chunk's with one
        launch once they are in). True if any was."""
        op = self.call
        r, size = op.rank, op.size
        lo_r = op.bounds[r][0]
        moved = False
        while self.c1 < self.cpack:  # this rank's own piece must be packed
            c = self.c1
            a, b = self.cuts[c][r]
            m = self.psz[c][r]
            acc = part(self.acc, a - lo_r, b - lo_r)
            if op.be.batch_decode:
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
                    op.be.unstage(part(self.recvbuf, base, base + size * m),
                                  part(self.wire1, base, base + size * m))
                    self.rreq1[c] = [None] * size
                if b > a:
                    # the own payload joins the received ones (m bytes apart),
                    # then one decode of all senders, summed in rank order
                    t0 = _timeline.ON and _timeline.now()
                    op.be.assign(part(self.recvbuf, base + r * m, base + (r + 1) * m),
                                 self._piece1(c, r))
                    op.comp.decode_shards(part(self.recvbuf, base, base + size * m), m, size,
                                          (0, b - a), (0,), acc, False)
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
                    if b > a:
                        t0 = _timeline.ON and _timeline.now()
                        op.comp.decode_into(self._piece1(c, j), acc, j > 0)
                        if t0:
                            _timeline.span("decode", t0, args={"chunk": c, "from": j})
                    self.src1 += 1
                    moved = True
            if b > a and op.average and not op.comp.prescales_average:
                op.be.divide(acc, size)
            self.c1 += 1
            self.src1 = 0
            moved = True
        return moved

    def _decide(self):
        """Every trailer is in: the counts decide (see the section's comment)."""
        op = self.call
        op.table[:] = self.trail
        if _plan.nonfinite_verdict(op.table, op.nonfinite).kind != "go":
            self.verdict = "stop"
            return
        self.verdict = "go"
        op.commit()
        self._start_gather()

    def _start_gather(self):
        if self.call.kind == "allreduce":
            self.gather = Gather(self.call, self.plan, self.acc)

    def steps(self):
        """Steps of a compressed call. A progress step compresses at most one
        chunk (the engine lock is held meanwhile: :data:`mpigc._sched.PAUSE`)
        and handles what has arrived; a blocking wait runs the call to its
        end, waiting in MPI only when nothing is left to compute."""
        op = self.call
        nc = len(self.cuts)
        while True:
            moved = False
            if self.cpack < nc:
                self._pack_chunk()
                moved = True
            moved |= self._decode_phase1()
            if self.verdict is None and self.cpack == nc and _sched.test(self.treq):
                self._decide()
                moved = True
            if self.verdict == "stop":
                # phase 1 was posted whole: complete it, then raise or skip
                if self.c1 == nc:
                    yield _sched.All(op.sendreqs)
                    _flatagree.nonfinite_verdict(op)
                    return
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
                    if g is not None and op.be.batch_decode:
                        g.unstage_all()
                        if op.gather != "exact":
                            g.decode_all()
                    # reduce_scatter after phase 1: only the sends are left,
                    # waited for like any step (a receiver that is waiting
                    # for an earlier call of this rank would never take them)
                    yield _sched.All(op.sendreqs)
                    if g is not None:
                        g.keep_owner()
                    op.finish(self.plan.bytes_sent(op.rank), self.acc)
                    return
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
                yield _sched.All(op.sendreqs)


class Gather:
    """Phase 2 of an allreduce (:class:`TwoPhase`): each owner's reduced
    shard, chunk by chunk, to every peer, recompressed with the owner
    residual (``gather="compressed"``) or as it is (``"exact"``), and every
    peer's into place in the caller's buffer."""

    def __init__(self, op, plan, acc):
        """Phase 2's receives, a piece per chunk and peer; ``acc``: this
        rank's reduced shard, filled by phase 1 chunk by chunk."""
        self.call, self.plan, self.acc, self.cuts = op, plan, acc, plan.cuts
        self.c = 0  # chunks sent
        self.obad = False  # a piece beyond the wire format: the owner residual kept
        self.reqs, self.meta = [], []  # receives, and their (chunk, sender)
        comm, r, size, cuts = op.cs.comm, op.rank, op.size, self.cuts
        tag = op.tags[1]
        if op.gather == "exact":
            isz = op.dtype.itemsize
            self.wire = wire = op.be.wire(op.flat.view(np.uint8))
            for c in range(len(cuts)):
                for k in range(1, size):
                    j = (r - k) % size
                    a, b = cuts[c][j]
                    if b > a:
                        self.meta.append((c, j))
                        self.reqs.append(_wire.post(comm.Irecv, wire[a * isz:b * isz], j, tag,
                                                    op.limits.max_count))
        else:
            self.recvbuf = op.bufs.get("recv2", op.be, self.plan.total2, np.uint8)
            self.wire = wire = op.be.wire(self.recvbuf)
            for c in range(len(cuts)):
                for k in range(1, size):
                    j = (r - k) % size
                    m = self.plan.psz2[c][j]
                    if m:
                        o = self.plan.poff2[c][j]
                        self.meta.append((c, j))
                        self.reqs.append(_wire.post(comm.Irecv, wire[o:o + m], j, tag,
                                                    op.limits.max_count))
            if op.use_ef:
                lo, hi = op.bounds[r]
                op.txn.ensure_owner(lambda: op.be.zeros(hi - lo, op.wdtype))
                self.owner_out = op.be.empty(hi - lo, op.wdtype)
        self.left = len(self.reqs)

    def send_chunk(self):
        """Phase 2 of chunk ``c`` (reduced): this owner's piece to every
        peer, recompressed with the owner residual (or exact), and into
        place here."""
        op = self.call
        comm, r, size, c = op.cs.comm, op.rank, op.size, self.c
        lo = op.bounds[r][0]
        a, b = self.cuts[c][r]
        self.c += 1
        if b == a:
            return
        t0 = _timeline.ON and _timeline.now()
        acc = part(self.acc, a - lo, b - lo)
        if op.gather == "exact":
            op.be.assign(op.flat[a:b], acc)
            isz = op.dtype.itemsize
            src, p, q = op.flat.view(np.uint8), a * isz, b * isz
        else:
            p, q = self.plan.poff2[c][r], self.plan.poff2[c][r] + self.plan.psz2[c][r]
            src = self.recvbuf
            e = eo = None
            if op.use_ef:
                e, eo = (part(op.txn.owner(), a - lo, b - lo),
                         part(self.owner_out, a - lo, b - lo))
            kw, bad = {"offset": a}, 0
            if op.comp.needs_global_scale:
                amax, bound, bad = op.comp.local_scale(acc, e)
                kw.update(scale=amax, clip_bound=bound, stream=_stream(op, r, 1))
            x = acc if acc.dtype == op.wdtype else op.be.converted(acc, op.wdtype)
            bad += op.comp.encode_into(x, e, eo, part(src, p, q), **kw)
            if bad:
                # a reduced value beyond the wire format (a sum beyond fp16's
                # or float32's range): this piece arrives non-finite
                # everywhere, and the owner residual is kept whole
                op.comp.mark_out_of_range(src[p:q], b - a)
                self.obad = True
        op.be.sync()
        op.be.stage(self.wire, src, p, q)
        if t0:
            _timeline.span("compress (gather)", t0, args={"chunk": c})
        for k in range(1, size):
            op.sendreqs.append(_wire.post(comm.Isend, self.wire[p:q], (r + k) % size,
                                          op.tags[1], op.limits.max_count))
        if op.gather != "exact" and not op.be.batch_decode:
            self._decode_piece(src[p:q], a, b)

    def _decode_piece(self, payload, a, b):
        """Decode ``payload`` into the user's buffer at ``[a, b)`` (through a
        float32 copy for float16 buffers)."""
        op = self.call
        t0 = _timeline.ON and _timeline.now()
        target = op.flat[a:b]
        if target.dtype == np.float16:
            tmp = op.be.empty(b - a, np.float32)
            op.comp.decode_into(payload, tmp, False)
            op.be.assign(target, tmp)
        else:
            op.comp.decode_into(payload, target, False)
        if t0:
            _timeline.span("decode (gather)", t0)

    def decode_all(self):
        """Every shard of a device call's gather into place with one decode
        (one chunk: the device calls are not pipelined)."""
        op = self.call
        t0 = _timeline.ON and _timeline.now()
        starts, offs = _plan.shard_starts(op.bounds, op.n), tuple(self.plan.poff2[0])
        if op.flat.dtype == np.float16:
            tmp = op.be.empty(op.n, np.float32)
            op.comp.decode_shards(self.recvbuf, 0, 1, starts, offs, tmp, False)
            op.be.assign(op.flat, tmp)
        else:
            op.comp.decode_shards(self.recvbuf, 0, 1, starts, offs, op.flat, False)
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
        op = self.call
        self.left -= 1
        if op.be.batch_decode:
            return  # off the wire with the others (unstage_all)
        c, j = self.meta[i]
        a, b = self.cuts[c][j]
        if op.gather == "exact":
            isz = op.dtype.itemsize
            op.be.unstage(op.flat.view(np.uint8)[a * isz:b * isz],
                          self.wire[a * isz:b * isz])
            return
        o, m = self.plan.poff2[c][j], self.plan.psz2[c][j]
        op.be.unstage(self.recvbuf[o:o + m], self.wire[o:o + m])
        self._decode_piece(self.recvbuf[o:o + m], a, b)

    def unstage_all(self):
        """A device call's gathered pieces off the wire, in one copy: this
        owner's own piece too, staged from the same bytes before it went out
        (one chunk: the device calls are not pipelined)."""
        op = self.call
        if op.size > 1:
            dst = op.flat.view(np.uint8) if op.gather == "exact" else self.recvbuf
            op.be.unstage(dst, self.wire)

    def keep_owner(self):
        """The call is over: the new owner residual replaces the old, unless
        a piece was beyond the wire format (the old one is kept whole)."""
        op = self.call
        if op.use_ef and not self.obad and op.gather != "exact":
            op.txn.set_owner(self.owner_out)
