"""Hierarchical collectives: exact inside a node, compressed between nodes.

With ranks on M nodes, L of them on the largest node, a hierarchical call
(``hierarchy="node"``, or ``"auto"`` on a communicator that spans several
nodes with several ranks on a node) composes three steps (ALGORITHMS.md,
"Hierarchical"):

1. *intra-node reduce-scatter*, exact: the n elements are cut into L slices
   (``numpy.array_split``); on every node each slice has one handler (on a
   node of L ranks, local rank l handles slice l; a smaller node hands its
   ranks contiguous runs of slices, ``array_split(range(L), node size)``),
   which sums every node rank's values of the slice in local-rank order, in
   the work dtype (float32 for float16/float32 input, float64 for float64):
   the same bits on every run. The values travel through a shared-memory
   window of the node (``MPI.Win.Allocate_shared``): each rank stores the
   values its peers sum in its segment; a handler makes the sums of its range
   in its own segment, piece by piece just before the inter-node call
   compresses each piece (the engine's ``fill`` hook), so that with a
   pipelined inter-node call the sums overlap with the transfers.
2. *inter-node compressed allreduce*: for each slice s, the handlers of s on
   the M nodes (ordered by node) run the existing two-phase engine
   (:mod:`mpigc._collective`) on the node sums of s, in place in the window,
   with the caller's compressor and ``gather``, under the residual key
   ``"{key}@hier[{s}/{L}:{n}]"`` (a worker residual of the slice, owner
   residuals of the group's shards): flat calls with the same key keep their
   own residuals.
3. *intra-node allgather* (allreduce) of the reduced slices, read from the
   handlers' segments; for
   reduce_scatter, the group owners' shards are moved to the caller's layout
   (``array_split`` over the ranks, or ``recvcounts``) instead.

A call changes nothing unless it succeeds on every rank: the input is agreed
over the whole communicator first (sizes, dtypes, settings, the layout);
non-finite values are not looked for up front, since they make their node's
sum non-finite, which the inter-node call detects before it changes any
residual (the ranks whose input holds them are then named). The residuals the
inter-node calls replaced are put back on every rank should any group fail (a
non-finite node sum, a state error): the groups' outcomes are agreed inside
each node (an inter-node call fails on all of its group, and every node holds
a handler of every slice), and the error is raised on every rank.

Node groups come from ``Split_type(COMM_TYPE_SHARED)``, or, for tests on one
machine, from ``$MPIGC_NODE_SPLIT=k``: ranks ``0..k-1`` form node 0, ``k..2k-1``
node 1, and so on (the last node may be smaller). The layout is computed once
per communicator and value of ``$MPIGC_NODE_SPLIT`` (collectively: every rank
must call with the same setting), and cached as an attribute of the
communicator.

Nonblocking calls (``iallreduce``/``ireduce_scatter``) are nonblocking: a call
is a :class:`mpigc._hiercall._HierCall` in the engine's queue of pending calls, advanced by the
progress thread, ``test()`` and ``wait()`` like an engine call; only its
agreement rows go out when it starts. On each rank the hierarchical calls of
one communicator advance one at a time, oldest first, and every step after the
start is nonblocking MPI on communicators private to the layout, so the ranks
issue them in the same order and a progress step never blocks. Exception: the
first call of a size larger than any before grows the node's window (a
collective allocation), so it completes the earlier hierarchical calls, waits
for its agreement and grows the window before it returns.

Device (CUDA) arrays: the intra-node steps are staged through the host. The
input is copied to a pinned host buffer when the call starts (in the
caller's thread, after the producer's stream), the node's sums are made on
the host in the shared window as above, each slice's node sum is copied to
the device and reduced between the nodes by the engine's device path (CUDA
kernels, residuals in device memory, CUDA-aware MPI or staged payloads as for
a flat call), copied back to the window, and the allgathered result copied to
the caller's buffer, once. Same bits as the host path: the sums are the same
host sums, and the engine's device kernels give the bits of its host kernels.
The shared window is host memory whatever the MPI library, so the intra-node
steps are staged even where MPI takes device memory.

Limits: ``op="none"`` and buffers below ``$MPIGC_MIN_COMPRESS_BYTES`` take the
flat path (plain MPI sum).
"""
import os
import re
import threading

import numpy as np
from mpi4py import MPI

from . import _comm, _sched, _timeline
from ._errors import ConfigError, DTypeError, MismatchError, MpigcError
from .feedback import shard_bounds

__all__ = ["HIERARCHY_MODES", "Layout", "layout", "slice_key", "parse_slice_key", "segment",
           "store_for_peers", "own_sums", "read_node_results", "sum_in_order", "node_sum_fill",
           "intra_reduce_scatter", "redistribute", "redistribute_ranges", "to_flat_form", "from_flat_form"]

HIERARCHY_MODES = ("auto", "flat", "node")
_KEYVAL = None
_keyval_lock = threading.Lock()  # _KEYVAL is made once, by one thread
_SLICE_KEY = re.compile(r"^(.*)@hier\[(\d+)/(\d+):(\d+)\]$", re.S)


def slice_key(key, s, L, n):
    """The residual key of slice ``s`` of ``L`` of an ``n``-element buffer."""
    return f"{key}@hier[{s}/{L}:{n}]"


def parse_slice_key(k):
    """``(key, s, L, n)`` of a slice key, or None for any other key."""
    m = _SLICE_KEY.match(k)
    if m is None:
        return None
    return m.group(1), int(m.group(2)), int(m.group(3)), int(m.group(4))


def node_split_env():
    """``$MPIGC_NODE_SPLIT`` as a positive int, None when unset or empty;
    raises ConfigError otherwise."""
    env = os.environ.get("MPIGC_NODE_SPLIT", "").strip()
    if not env:
        return None
    try:
        k = int(env)
    except ValueError:
        k = 0
    if k < 1:
        raise ConfigError(f"MPIGC_NODE_SPLIT: expected a positive integer (ranks per "
                          f"emulated node), got {env!r}")
    return k


class Layout:
    """Nodes, slices and groups of one communicator (see the module docstring).

    Attributes: ``size``, ``rank``; ``node_sizes`` (M entries); ``node_of``,
    ``local_of`` (per world rank); ``M``, ``L`` (largest node); ``node``,
    ``local`` (this rank's); ``comm`` (a private duplicate for the intra-node
    and redistribution traffic), ``node_comm``; ``slices_of(r)`` (the slices
    world rank r handles); ``groups`` ({slice: communicator of its handlers})."""

    def __init__(self, comm, split, exc=None):
        self.comm = comm.Dup()
        c = self.comm
        self.size, self.rank = c.Get_size(), c.Get_rank()
        # every rank must use the same rule (an emulated split or the real nodes)
        rules = c.allgather("error" if exc is not None else split)
        if exc is None and any(r != rules[0] for r in rules):
            exc = MismatchError("hierarchy: ranks disagree on MPIGC_NODE_SPLIT (" + ", ".join(
                f"rank {r}: {v}" for r, v in enumerate(rules)) + ")")
        try:
            _comm.agree(c, exc, "hierarchy layout", default=MismatchError,
                        classes={"ConfigError": ConfigError, "MismatchError": MismatchError})
        except MpigcError:
            c.Free()
            raise
        # the agreement rows of hierarchical calls, sent at their start in
        # program order (everything else a call sends, it sends when it advances)
        self.agree_comm = c.Dup()
        color = None if split is None else self.rank // split
        if split is not None:
            node_comm = c.Split(color, key=self.rank)
            leader = color * split
        else:
            node_comm = c.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
            leader = min(node_comm.allgather(self.rank))
        self.node_comm = node_comm
        self.local = node_comm.Get_rank()
        rows = c.allgather((leader, self.local))
        leaders = sorted({ld for ld, _ in rows})
        index = {ld: i for i, ld in enumerate(leaders)}
        self.node_of = [index[ld] for ld, _ in rows]
        self.local_of = [lr for _, lr in rows]
        self.M = len(leaders)
        self.node_sizes = [self.node_of.count(m) for m in range(self.M)]
        self.L = max(self.node_sizes)
        self.node = self.node_of[self.rank]
        self.members = [[r for r in range(self.size) if self.node_of[r] == m]
                        for m in range(self.M)]
        for m in range(self.M):
            self.members[m].sort(key=lambda r: self.local_of[r])
        # slices of each local rank, per node size
        self._runs = {}
        self._groups = None
        self._win, self._win_bytes = None, 0
        # posted by the node's ranks once they have read a call's results out of
        # the window; a later call writes to the window only after it completed
        self.read_fence = None
        self._calls_ready = False

    @property
    def groups(self):
        """{slice: communicator of its handlers, in node order} for this
        rank's slices; made on first use (collective: the first hierarchical
        call, the same on every rank), so flat-only communicators pay nothing."""
        if self._groups is None:
            groups = {}
            mine = self.slices_of(self.rank)
            for s in range(self.L):
                g = self.comm.Split(s if s in mine else MPI.UNDEFINED, key=self.node)
                if g != MPI.COMM_NULL:
                    groups[s] = g
            self._groups = groups
        return self._groups

    def ready_for_calls(self):
        """What hierarchical calls use, made at the first one's start (collective,
        in program order): the slice groups, and the engine's state of each
        group and of ``comm`` (the plain route), so that no call creates a
        communicator while it advances."""
        if not self._calls_ready:
            # by one thread: another one's first call on the layout waits here
            with _comm.creation_lock(self.comm):
                if not self._calls_ready:
                    _sched.finish_pending()  # collective: see _sched.finish_pending
                    for g in self.groups.values():
                        _comm.resolve(g)
                    _comm.resolve(self.comm)
                    self._calls_ready = True

    def quiesce(self):
        """Complete the pending hierarchical calls of this layout (before
        blocking collectives on its communicators outside a call)."""
        with _sched.lock:
            for op in _sched.pending():
                if op.cs is self:
                    _sched.complete(op)

    def window_bytes(self):
        """The size of each segment of the node's shared window (0: none yet)."""
        return self._win_bytes

    def shared(self, nbytes):
        """Every node rank's segment (``nbytes`` at least) of a shared-memory
        window on the node, as uint8 arrays in local-rank order (collective on
        the node when it has to grow; ranks of a node always ask for the same
        size, agreed beforehand)."""
        win = self._win
        if win is None or self._win_bytes < nbytes:
            if win is not None:
                win.Unlock_all()
                win.Free()
            self._win = win = MPI.Win.Allocate_shared(max(int(nbytes), 1), 1,
                                                      comm=self.node_comm)
            win.Lock_all(MPI.MODE_NOCHECK)
            self._win_bytes = nbytes
            self._segs = []
            for k in range(self.node_comm.Get_size()):
                mem, _ = win.Shared_query(k)
                self._segs.append(np.frombuffer(mem, np.uint8))
        return self._segs

    def take_read_fence(self):
        """The node's read fence of the last call (an MPI request, set by
        :func:`read_node_results`), or None; forgotten here, so that the
        next call waits for it once."""
        fence, self.read_fence = self.read_fence, None
        return fence

    def node_fence(self):
        """Steps (a generator of what to wait for): stores to the shared window
        before it are seen by the node after it (a nonblocking barrier)."""
        self._win.Sync()
        yield self.node_comm.Ibarrier()
        self._win.Sync()

    def runs(self, size):
        """Slices per local rank on a node of ``size`` ranks."""
        if size not in self._runs:
            self._runs[size] = [(lo, hi) for lo, hi in shard_bounds(self.L, size)]
        return self._runs[size]

    def slices_of(self, r):
        lo, hi = self.runs(self.node_sizes[self.node_of[r]])[self.local_of[r]]
        return list(range(lo, hi))

    def element_range(self, r, n):
        """The elements ``[lo, hi)`` world rank ``r`` sums on its node (its slices)."""
        sl = self.slices_of(r)
        sb = shard_bounds(n, self.L)
        return sb[sl[0]][0], sb[sl[-1]][1]

    def owned_ranges(self, r, n):
        """``[(s, lo, hi)]``: the global elements whose owner residual (and, for
        reduce_scatter, reduced value) world rank ``r`` holds, per slice."""
        sb = shard_bounds(n, self.L)
        out = []
        for s in self.slices_of(r):
            slo, shi = sb[s]
            glo, ghi = shard_bounds(shi - slo, self.M)[self.node_of[r]]
            out.append((s, slo + glo, slo + ghi))
        return out

    def hierarchical(self, mode):
        if mode == "node":
            return True
        return mode == "auto" and self.M > 1 and self.L > 1

    def describe(self):
        return {"nodes": self.M, "node_sizes": list(self.node_sizes)}


def layout(comm=None):
    """The :class:`Layout` of ``comm`` (default COMM_WORLD) under the current
    ``$MPIGC_NODE_SPLIT``; collective on first use."""
    global _KEYVAL
    if comm is None:
        comm = MPI.COMM_WORLD
    if not isinstance(comm, MPI.Intracomm):
        raise DTypeError(f"comm: expected an mpi4py Intracomm, got {type(comm).__name__}")
    split, exc = None, None
    try:
        split = node_split_env()
    except ConfigError as e:
        exc = e
    if _KEYVAL is None:
        with _keyval_lock:
            if _KEYVAL is None:
                _KEYVAL = MPI.Comm.Create_keyval()
    cache = comm.Get_attr(_KEYVAL)
    if cache is not None and exc is None and split in cache:
        return cache[split]
    # made by one thread: another one's first call on comm waits for it
    with _comm.creation_lock(comm):
        cache = comm.Get_attr(_KEYVAL)
        if cache is None:
            cache = {}
            comm.Set_attr(_KEYVAL, cache)
        if exc is not None or split not in cache:
            # collective, outside the engine: the pending calls first
            # (_sched.finish_pending)
            _sched.finish_pending()
            # the user's communicator first: its node-local size caps the
            # kernels' threads (cores / ranks per node), not that of a group
            # spanning nodes
            _comm.resolve(comm)
            lay = Layout(comm, split, exc)  # raises on every rank if any rank failed
            cache[split] = lay
        return cache[split]


# -- exact intra-node steps and data movement ---------------------------------------
def segment(segs, k, n, wd):
    """Node rank ``k``'s segment of the shared window as ``n`` values of ``wd``."""
    return segs[k][:n * wd.itemsize].view(wd)


def store_for_peers(lay, segs, flat, n, wd):
    """This rank's values outside its own element range (those its node peers
    sum) into its segment, in ``wd``; its own range of the segment is where
    the node's sums of that range are made (:func:`node_sum_fill`)."""
    t0 = _timeline.ON and _timeline.now()
    lo, hi = lay.element_range(lay.rank, n)
    seg = segment(segs, lay.node_comm.Get_rank(), n, wd)
    seg[:lo] = flat[:lo]
    seg[hi:] = flat[hi:]
    if t0:
        _timeline.span("store for node peers", t0)


def own_sums(lay, segs, flat, n, wd, stored):
    """Steps: this rank's range of its segment, where the node's sums of that
    range are made (slice by slice, as the inter-node calls read them:
    :func:`node_sum_fill`), once every node rank has stored its values for
    its peers (``stored``: this rank's are in already)."""
    if not stored:
        store_for_peers(lay, segs, flat, n, wd)
    yield from lay.node_fence()
    lo, hi = lay.element_range(lay.rank, n)
    return segment(segs, lay.node_comm.Get_rank(), n, wd)[lo:hi]


def read_node_results(lay, segs, flat, n, wd):
    """Steps: every node rank's range, reduced in place in its segment, into
    ``flat``; the next call's stores then wait for every node rank's reads
    (``lay.read_fence``: a peer's new values may land where these were)."""
    yield from lay.node_fence()
    t0 = _timeline.ON and _timeline.now()
    for k, r in enumerate(lay.members[lay.node]):
        a, b = lay.element_range(r, n)
        flat[a:b] = segment(segs, k, n, wd)[a:b]
    if t0:
        _timeline.span("read node results", t0)
    lay.read_fence = lay.node_comm.Ibarrier()


def sum_in_order(parts, out):
    """``out`` = ``parts[0] + parts[1] + ...``, added in that order (a node's
    local-rank order): every path that sums a node's values (the calls, the
    checkpoint conversions) rounds alike, bit for bit."""
    if len(parts) == 1:
        out[...] = parts[0]
        return out
    # a sum beyond the dtype's range is reported by the call (NonFiniteError,
    # naming the node sum), not as numpy's RuntimeWarning on each rank
    with np.errstate(over="ignore", invalid="ignore"):
        np.add(parts[0], parts[1], out=out)
        for p in parts[2:]:
            out += p
    return out


def node_sum_fill(lay, segs, flat, n, wd, base):
    """``fill(a, b)`` for the inter-node call of the slice that starts at
    element ``base``: elements ``[base + a, base + b)`` summed over the node's
    ranks in local-rank order, in ``wd`` (this rank's values from ``flat``,
    its peers' from their segments), into this rank's segment, which is the
    inter-node call's buffer. Called after a node fence (the peers' stores)."""
    me = lay.node_comm.Get_rank()
    L = lay.node_comm.Get_size()
    segs_wd = [segment(segs, k, n, wd) for k in range(L)]

    def fill(a, b):
        t0 = _timeline.ON and _timeline.now()
        a, b = base + a, base + b
        sum_in_order([flat[a:b] if k == me else segs_wd[k][a:b] for k in range(L)],
                     segs_wd[me][a:b])
        if t0:
            _timeline.span("node sum", t0)
    return fill


def intra_reduce_scatter(lay, x, n):
    """This rank's elements ``element_range`` summed over its node, in
    local-rank order, in ``x``'s dtype."""
    node = lay.node_comm
    L = node.Get_size()
    lo, hi = lay.element_range(lay.rank, n)
    if L == 1:
        return x[lo:hi].copy()
    ranges = [lay.element_range(r, n) for r in lay.members[lay.node]]
    scounts = [b - a for a, b in ranges]
    sdispl = [a for a, _ in ranges]
    m = hi - lo
    recv = np.empty(L * m, x.dtype)
    el = _raw_elements(x.dtype)
    node.Alltoallv([x.view(np.uint8), (scounts, sdispl), el],
                   [recv.view(np.uint8), ([m] * L, [k * m for k in range(L)]), el])
    el.Free()
    return sum_in_order([recv[k * m:(k + 1) * m] for k in range(L)], np.empty(m, x.dtype))


def _raw_elements(dtype):
    """A committed MPI datatype of one ``dtype`` value as raw bytes (free it
    after use): counts and displacements in values, not bytes, so that
    they stay within MPI's C ints up to 2**31 - 1 values, not bytes."""
    t = MPI.BYTE.Create_contiguous(np.dtype(dtype).itemsize)
    t.Commit()
    return t


def _displs(counts):
    return np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(int).tolist()


def redistribute(lay, pieces, bounds, n, dtype):
    """Steps: move ``pieces`` (``[(lo, hi, values)]``: the global element ranges
    this rank owns, ``lay.owned_ranges``) so that world rank r gets
    ``bounds[r]``, by one nonblocking all-to-all of ``dtype`` values (every
    rank knows what every other owns: no sizes travel). Returns this rank's
    ``bounds[rank]`` as one array."""
    send, scounts = [], []
    for tlo, thi in bounds:
        count = 0
        for a, b, v in pieces:
            p, q = max(a, tlo), min(b, thi)
            if q > p:
                send.append(v[p - a:q - a])
                count += q - p
        scounts.append(count)
    lo, hi = bounds[lay.rank]
    places, rcounts = [], []
    for r in range(lay.size):
        count = 0
        for _, a, b in lay.owned_ranges(r, n):
            p, q = max(a, lo), min(b, hi)
            if q > p:
                places.append((p, q))
                count += q - p
        rcounts.append(count)
    sbuf = np.concatenate(send).astype(dtype, copy=False) if send else np.empty(0, dtype)
    rbuf = np.empty(sum(rcounts), dtype)
    yield lay.comm.Ialltoallv([sbuf, (scounts, _displs(scounts))],
                              [rbuf, (rcounts, _displs(rcounts))])
    out = np.zeros(hi - lo, dtype)
    o = 0
    for p, q in places:
        out[p - lo:q - lo] = rbuf[o:o + q - p]
        o += q - p
    return out


def redistribute_ranges(lay, pieces, targets, dtype):
    """Like :func:`redistribute`, for several target ranges per rank and
    pieces that may be missing (``values`` None): ``targets[r]`` is a list of
    ``(lo, hi)``; returns one array per range of this rank (zeros where no
    piece covers it). Blocking, outside the calls (checkpoint conversions):
    the ranges travel first (a small all-to-all), then the values as raw
    bytes (one ``Alltoallv`` counted in values: :func:`_raw_elements`;
    nothing large is pickled)."""
    dtype = np.dtype(dtype)
    meta, data, counts = [], [], []
    for r in range(lay.size):
        mine, count = [], 0
        for tlo, thi in targets[r]:
            for a, b, v in pieces:
                p, q = max(a, tlo), min(b, thi)
                if q > p and v is not None:
                    mine.append((p, q))
                    data.append(np.asarray(v[p - a:q - a], dtype))
                    count += q - p
        meta.append(mine)
        counts.append(count)
    got = lay.comm.alltoall(meta)
    rcounts = [sum(q - p for p, q in g) for g in got]
    sbuf = np.concatenate(data) if data else np.empty(0, dtype)
    rbuf = np.empty(sum(rcounts), dtype)
    el = _raw_elements(dtype)
    lay.comm.Alltoallv([sbuf.view(np.uint8), (counts, _displs(counts)), el],
                       [rbuf.view(np.uint8), (rcounts, _displs(rcounts)), el])
    el.Free()
    outs = [np.zeros(hi - lo, dtype) for lo, hi in targets[lay.rank]]
    o = 0
    for g in got:
        for p, q in g:
            v, o = rbuf[o:o + q - p], o + q - p
            for (lo, hi), out in zip(targets[lay.rank], outs):
                a, b = max(p, lo), min(q, hi)
                if b > a:
                    out[a - lo:b - lo] = v[a - p:b - p]
    return outs


# -- checkpoints: the hierarchical residuals in the flat layout, and back ------------
def to_flat_form(lay, slices, n, dtype, has_worker, has_owner):
    """This rank's residuals of one key, from ``slices`` ({slice: (worker,
    owner)} of this rank) to the flat layout of the whole communicator
    (collective): a worker residual of n values in global positions (zeros
    outside this rank's slices; the sum over ranks is the total) and the owner
    residual of this rank's ``shard_bounds(n, size)`` shard."""
    lay.quiesce()
    sb = shard_bounds(n, lay.L)
    w = None
    if has_worker:
        w = np.zeros(n, dtype)
        for s, (wk, _) in slices.items():
            if wk is not None:
                lo, hi = sb[s]
                w[lo:hi] = wk
    o = None
    if has_owner:
        pieces = [(a, b, slices[s][1] if s in slices else None)
                  for s, a, b in lay.owned_ranges(lay.rank, n)]
        targets = [[b] for b in shard_bounds(n, lay.size)]
        o = redistribute_ranges(lay, pieces, targets, dtype)[0]
    return w, o


def from_flat_form(lay, worker, owner, n, dtype):
    """The inverse of :func:`to_flat_form` onto ``lay`` (collective): each
    node's worker residuals summed per slice (local-rank order) to the slice's
    handler, the owner shards moved to the group owners. Returns {slice:
    (worker, owner)} for this rank's non-empty slices."""
    lay.quiesce()
    sb = shard_bounds(n, lay.L)
    lo, hi = lay.element_range(lay.rank, n)
    acc = None
    if worker is not None:
        acc = intra_reduce_scatter(lay, np.ascontiguousarray(worker, dtype), n)
    owned = lay.owned_ranges(lay.rank, n)
    outs = None
    if owner is not None:
        flo, fhi = shard_bounds(n, lay.size)[lay.rank]
        targets = [[(a, b) for _, a, b in lay.owned_ranges(r, n)] for r in range(lay.size)]
        outs = redistribute_ranges(lay, [(flo, fhi, owner)], targets, dtype)
    res = {}
    for i, (s, _, _) in enumerate(owned):
        slo, shi = sb[s]
        if shi == slo:
            continue
        wk = None if acc is None else acc[slo - lo:shi - lo].copy()
        ow = None if outs is None else outs[i]
        res[s] = (wk, ow)
    return res
