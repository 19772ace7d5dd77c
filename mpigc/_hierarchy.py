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

Limits: host (numpy) arrays only (``"auto"`` takes the flat path for device
arrays; ``"node"`` raises on every rank); nonblocking calls
(``iallreduce``/``ireduce_scatter``) run to completion when started (their
request is complete at once); ``op="none"`` and buffers below
``$MPIGC_MIN_COMPRESS_BYTES`` take the flat path (plain MPI sum).
"""
import json
import os
import re
import time
import zlib

import numpy as np
from mpi4py import MPI

from . import _collective, _comm, _dispatch
from ._errors import (CODES, ConfigError, DTypeError, InvalidBufferError, MismatchError,
                      MpigcError, NonFiniteError, code_of)
from .compressors import SUPPORTED_DTYPES, get_compressor, work_dtype
from .feedback import get_default_feedback, shard_bounds

__all__ = ["HIERARCHY_MODES", "Layout", "layout", "start", "slice_key", "parse_slice_key"]

HIERARCHY_MODES = ("auto", "flat", "node")
_KEYVAL = None
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

    def shared(self, nbytes):
        """Every node rank's segment (``nbytes`` at least) of a shared-memory
        window on the node, as uint8 arrays in local-rank order (collective on
        the node when it has to grow; ranks of a node always ask for the same
        size, agreed beforehand)."""
        win = getattr(self, "_win", None)
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

    def node_fence(self):
        """Stores to the shared window before it are seen by the node after it.
        The barrier is waited for politely: tested for up to 200 µs, then
        every 100 µs with the core given up in between. A rank waits here for
        its node peers to finish their part, and where ranks outnumber cores
        (tests, the emulated cluster) a spinning wait takes the core from the
        very peer it waits for: on the 2-core emulated cluster this lowered the
        CPU time of a 32 MiB 2bit call, summed over 4 ranks, from 138 to 124 ms
        (wall 72 to 64 ms, median of 15; docs/cluster.md)."""
        self._win.Sync()
        req = self.node_comm.Ibarrier()
        t0 = time.perf_counter()
        while not req.Test():
            if time.perf_counter() - t0 > 200e-6:
                time.sleep(100e-6)
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
        _KEYVAL = MPI.Comm.Create_keyval()
    cache = comm.Get_attr(_KEYVAL)
    if cache is None:
        cache = {}
        comm.Set_attr(_KEYVAL, cache)
    if exc is not None or split not in cache:
        # the user's communicator first: its node-local size caps the kernels'
        # threads (cores / ranks per node), not that of a group spanning nodes
        _comm.resolve(comm)
        lay = Layout(comm, split, exc)  # raises on every rank if any rank failed
        cache[split] = lay
    return cache[split]


# -- the call ----------------------------------------------------------------------
class _Done:
    """A call that ran to completion when it started (what Request wraps)."""

    def __init__(self, result=None, error=None):
        self.state = "done"
        self.result = result
        self.error = error

    def done_or_failed(self):
        return True

    def _settle(self):
        """Nothing to release: the call's own engine calls were waited for."""

    def finished(self):
        if self.error is not None:
            raise self.error
        return True


_CODE, _N, _DTYPE, _FP, _NCOLS = 0, 1, 2, 3, 4
_DTYPE_CODE = {np.dtype(np.float16): 1, np.dtype(np.float32): 2, np.dtype(np.float64): 3}


def start(kind, buf, op, params, *, comm, key, average, gather, feedback, nonfinite,
          recvcounts=None, out=None, hierarchy="flat", blocking):
    """Route one collective: the flat engine, or the hierarchical path (run
    to completion now). Returns what :class:`mpigc.Request` wraps."""
    if hierarchy not in HIERARCHY_MODES:
        # decides which collective runs, so it is checked here, on this rank:
        # like the function called, it must be the same on every rank
        raise ConfigError(f"hierarchy must be one of {HIERARCHY_MODES}, got {hierarchy!r}")
    flat = hierarchy == "flat" or (hierarchy == "auto" and _dispatch.is_device_array(buf))
    if not flat:
        lay = layout(comm)
        flat = not lay.hierarchical(hierarchy)
    if flat:
        return _collective.start(kind, buf, op, params, comm=comm, key=key, average=average,
                                 gather=gather, feedback=feedback, nonfinite=nonfinite,
                                 recvcounts=recvcounts, out=out, blocking=blocking)
    call = _HierCall(lay, kind, buf, op, params, comm, key, average, gather, feedback,
                     nonfinite, recvcounts, out)
    try:
        return _Done(call.run())
    except Exception as exc:  # noqa: BLE001 - raised by wait() / test()
        if blocking:
            raise
        return _Done(error=exc)


class _HierCall:
    def __init__(self, lay, kind, buf, op, params, comm, key, average, gather, feedback,
                 nonfinite, recvcounts, out):
        self.lay, self.kind, self.buf, self.op, self.params = lay, kind, buf, op, params
        self.comm, self.key, self.average, self.gather = comm, key, average, gather
        self.feedback, self.nonfinite = feedback, nonfinite
        self.recvcounts, self.out = recvcounts, out

    # -- 1. agree on the input, over the whole communicator --------------------------
    def _prepare(self, row):
        kind, buf = self.kind, self.buf
        if _dispatch.is_device_array(buf):
            raise InvalidBufferError(f"{kind}: hierarchy='node' takes host (numpy) arrays "
                                     "only; pass hierarchy='flat' (or 'auto') for device "
                                     "arrays")
        if not isinstance(buf, np.ndarray):
            raise DTypeError(f"{kind}: expected a numpy array or a CUDA device array, got "
                             f"{type(buf).__name__}")
        dtype = buf.dtype
        if dtype not in SUPPORTED_DTYPES or not dtype.isnative:
            raise DTypeError(f"{kind}: expected float16, float32 or float64 (native byte "
                             f"order), got {dtype}")
        if buf.size == 0:
            raise InvalidBufferError(f"{kind}: expected a non-empty array, got shape "
                                     f"{tuple(buf.shape)}")
        if not buf.flags.c_contiguous:
            raise InvalidBufferError(f"{kind}: expected a C-contiguous array; pass a "
                                     "contiguous copy and copy the result back")
        if kind == "allreduce" and not buf.flags.writeable:
            raise InvalidBufferError("allreduce: expected a writable array (it reduces in "
                                     "place), got a read-only one")
        self.flat = buf.reshape(buf.size)
        self.n = n = buf.size
        self.dtype = dtype
        self.wd = np.dtype(work_dtype(dtype))
        row[_N] = n
        row[_DTYPE] = _DTYPE_CODE[dtype]
        self.comp = comp = get_compressor(self.op, **self.params)
        if self.gather not in _collective.GATHER_MODES:
            raise ConfigError(f"gather must be one of {_collective.GATHER_MODES}, got "
                              f"{self.gather!r}")
        nonfinite = self.nonfinite
        if nonfinite is None:
            nonfinite = _collective.default_nonfinite()
        if nonfinite not in _collective.NONFINITE_POLICIES:
            raise ConfigError(f"nonfinite must be one of {_collective.NONFINITE_POLICIES}, "
                              f"got {nonfinite!r}")
        self.nonfinite = nonfinite
        key = self.key
        if key is not None and not isinstance(key, (str, int)):
            raise ConfigError(f"key must be a str or int, got {type(key).__name__}")
        self.key = f"auto/{n}/{dtype.name}" if key is None else str(key)
        W = self.lay.size
        if self.recvcounts is None:
            self.bounds = shard_bounds(n, W)
        else:
            counts = [int(c) for c in self.recvcounts]
            if len(counts) != W or min(counts) < 0 or sum(counts) != n:
                raise InvalidBufferError(
                    f"recvcounts: expected {W} non-negative counts summing to {n}, got "
                    f"{list(self.recvcounts)}")
            starts = np.concatenate([[0], np.cumsum(counts)]).tolist()
            self.bounds = list(zip(starts[:-1], starts[1:]))
        lo, hi = self.bounds[self.lay.rank]
        if self.out is not None:
            o = self.out
            if (not isinstance(o, np.ndarray) or o.dtype != dtype or o.size != hi - lo
                    or not o.flags.c_contiguous or not o.flags.writeable):
                raise InvalidBufferError(f"out: expected a writable contiguous numpy array "
                                         f"of {hi - lo} {dtype} values")
        self.fb = None
        if self.feedback is not False:
            self.fb = get_default_feedback() if self.feedback is None else self.feedback
        self.plain = comp.codec_id == "none" or \
            self.flat.nbytes < _collective.min_compress_bytes()
        settings = {"kind": kind, "comp": comp.get_config(), "key": self.key,
                    "average": bool(self.average), "gather": self.gather,
                    "nonfinite": nonfinite,
                    "bounds": None if self.recvcounts is None else self.bounds,
                    "layout": self.lay.describe(), "plain": self.plain}
        self.settings = settings
        row[_FP] = zlib.crc32(json.dumps(settings, sort_keys=True).encode())
        # no pass over the input for non-finite values: a non-finite input makes
        # its node's sum non-finite (NaN and inf propagate through the sum), which
        # the inter-node call detects before any residual changes; the ranks
        # that hold them are named then (_input_nonfinite)

    def _agree_input(self):
        lay = self.lay
        row = np.zeros(_NCOLS, np.int64)
        exc = None
        try:
            self._prepare(row)
        except Exception as e:  # noqa: BLE001 - reported collectively
            exc = e
            row[_CODE] = code_of(e)
        t = np.zeros((lay.size, _NCOLS), np.int64)
        req = lay.comm.Iallgather(row, t)
        # while the rows travel: this rank's values into its segment of the node's
        # window (scratch; only when the window is large enough already, as growing
        # it is collective and must wait for the agreement)
        self.stored = False
        if exc is None and not self.plain and lay.node_comm.Get_size() > 1 and \
                getattr(lay, "_win_bytes", 0) >= self.n * self.wd.itemsize:
            store_for_peers(lay, lay.shared(self.n * self.wd.itemsize), self.flat, self.n,
                            self.wd)
            self.stored = True
        req.Wait()
        full = t[:, _CODE] == 0
        for col, what in ((_N, "size"), (_DTYPE, "dtype"), (_FP, "settings")):
            vals = t[full, col]
            if vals.size and np.any(vals != vals[0]):
                mine = None
                if full[lay.rank]:
                    mine = {"size": self.n, "dtype": str(self.dtype),
                            "settings": json.dumps(self.settings, sort_keys=True)}[what]
                allv = lay.comm.allgather(mine)
                detail = ", ".join(f"rank {r}: {v}" for r, v in enumerate(allv)
                                   if v is not None)
                raise MismatchError(f"{self.kind}: ranks disagree on the {what} ({detail})")
        bad = np.flatnonzero(t[:, _CODE])
        if bad.size:
            msg = "" if exc is None else (str(exc) if isinstance(exc, MpigcError)
                                          else f"{type(exc).__name__}: {exc}")
            msgs = lay.comm.allgather(msg)
            cls = CODES.get(int(t[int(bad[0]), _CODE])) or MpigcError
            detail = "; ".join(f"rank {int(r)}: {msgs[int(r)]}" for r in bad)
            raise cls(f"{self.kind} failed on {len(bad)} of {lay.size} rank(s): "
                      f"{detail}") from exc

    # -- the steps ---------------------------------------------------------------------
    def run(self):
        self._agree_input()
        if self.plain:
            # op="none" and small buffers: the flat path (a plain MPI sum)
            op = _collective.start(self.kind, self.buf, self.op, self.params, comm=self.comm,
                                   key=self.key, average=self.average, gather=self.gather,
                                   feedback=self.feedback, nonfinite=self.nonfinite,
                                   recvcounts=self.recvcounts, out=self.out, blocking=True)
            return _collective.Request(op).wait()
        lay, n = self.lay, self.n
        lo, hi = lay.element_range(lay.rank, n)
        segs = lay.shared(n * self.wd.itemsize)
        alone = lay.node_comm.Get_size() == 1
        if alone:  # a node of one rank: nothing to sum
            acc = self.flat[lo:hi].astype(self.wd)
        else:
            # the node's sums of this rank's range are made in this rank's own
            # segment (where no peer reads), slice by slice as the inter-node
            # call reads them (fill): the sums overlap with its transfers
            if not self.stored:  # (stored: during the agreement)
                store_for_peers(lay, segs, self.flat, n, self.wd)
            lay.node_fence()
            acc = _seg(segs, lay.node_comm.Get_rank(), n, self.wd)[lo:hi]
        # 2. one engine call per slice this rank handles (in slice order on every
        # rank: a rank in several groups meets each group in the same order)
        sb = shard_bounds(n, lay.L)
        groups = lay.groups  # collective on first use: before any rank can skip a slice
        saved, errors, parts, cause = [], [], [], None
        for s in lay.slices_of(lay.rank):
            slo, shi = sb[s]
            v = acc[slo - lo:shi - lo]
            fill = None if alone else node_sum_fill(lay, segs, self.flat, n, self.wd, slo)
            if shi == slo:  # fewer elements than slices: nothing to reduce
                saved.append(None)
                parts.append(v.copy())
                continue
            sk = slice_key(self.key, s, lay.L, n)
            saved.append(self._snapshot(sk))
            try:
                op = _collective.start(self.kind, v, self.op, self.params,
                                       comm=groups[s], key=sk, average=False,
                                       gather=self.gather,
                                       feedback=False if self.fb is None else self.fb,
                                       nonfinite="ignore" if self.nonfinite == "ignore"
                                       else "raise", blocking=True, fill=fill)
                parts.append(_collective.Request(op).wait())
            except Exception as e:  # noqa: BLE001 - agreed below
                cause = cause or e
                errors.append((s, type(e).__name__, str(e), isinstance(e, NonFiniteError)))
                parts.append(None)
            self._keep_old(saved[-1])
        # the outcome of every group, agreed inside the node only: an inter-node
        # call fails or succeeds on all of its group, and every node has a handler
        # of every slice, so each node learns every group's outcome without a
        # collective across the nodes. Decided on the set of failed slices
        # (the same on every node), never on which rank reported them.
        failed = {}
        for errs in lay.node_comm.allgather(errors):
            for s, name, text, nonfin in errs:
                failed[s] = (name, text, nonfin)
        if failed:
            for snap in saved:
                self._restore(snap)
            if all(f[2] for f in failed.values()):
                return self._nonfinite(self._input_nonfinite() or (
                    "a node's sum is not finite, or beyond the range of the wire format ("
                    + "; ".join(f"slice {s}: {f[1]}" for s, f in sorted(failed.items()))
                    + ")"))
            name = next(f[0] for s, f in sorted(failed.items()) if not f[2])
            cls = {c.__name__: c for c in CODES.values() if c is not None}.get(
                name, MpigcError)
            raise cls(f"{self.kind} (hierarchical) failed in {len(failed)} of {lay.L} "
                      "slice group(s): " + "; ".join(
                          f"slice {s}: {f[1]}" for s, f in sorted(failed.items()))
                      + "; no residual changed") from cause
        for snap in saved:
            self._release_old(snap)
        # 3.
        if self.kind == "allreduce":
            if self.average:
                acc /= lay.size
            if alone:
                self.flat[lo:hi] = acc
            else:
                shm_allgather(lay, segs, self.flat, n, self.wd)
            return self.buf
        pieces = [(a, b, p) for (_, a, b), p in zip(lay.owned_ranges(lay.rank, n), parts)]
        lo, hi = self.bounds[lay.rank]
        res = redistribute(lay, pieces, self.bounds, n, self.wd)
        if self.average:
            res /= lay.size
        if self.out is not None:
            self.out.reshape(-1)[...] = res
            return self.out
        return res.astype(self.dtype, copy=False)

    def _input_nonfinite(self):
        """Collective, on the failure path only: "non-finite values in the
        input on rank r (count), ..." when any rank's input holds some, else
        an empty string (the node sum overflowed, or nonfinite="skip", whose
        result says nothing; the policy is agreed, so every rank skips alike)."""
        if self.nonfinite != "raise":
            return ""
        nbad = self.lay.comm.allgather(int(np.count_nonzero(~np.isfinite(self.flat))))
        if not any(nbad):
            return ""
        return "non-finite values in the input on " + ", ".join(
            f"rank {r} ({c})" for r, c in enumerate(nbad) if c)

    def _nonfinite(self, what):
        if self.nonfinite == "raise":
            raise NonFiniteError(
                f"{self.kind}: {what}; no buffer or residual changed (nonfinite='skip' "
                "fills the result with NaN instead of raising)")
        if self.fb is not None:
            self.fb.skipped_steps += 1
        if self.kind == "allreduce":
            self.flat[...] = np.nan
            return self.buf
        lo, hi = self.bounds[self.lay.rank]
        if self.out is not None:
            self.out[...] = np.nan
            return self.out
        return np.full(hi - lo, np.nan, self.dtype)

    # -- failure atomicity: the residuals an inter-node call replaced -------------------
    def _snapshot(self, sk):
        fb = self.fb
        if fb is None:
            return None
        e = fb._entries.get(sk)
        if e is None:
            return (sk, None, None, None, None, None)
        return (sk, e, e.worker, e.owner, e.calls, e.config)

    def _keep_old(self, snap):
        """The engine hands a replaced worker residual to its spare pool, where
        the next call could overwrite it: take it back until the call is agreed."""
        if snap is None or snap[2] is None:
            return
        fb, old = self.fb, snap[2]
        with fb._lock:
            for pool in fb._spares.values():
                for i, a in enumerate(pool):
                    if a is old:
                        del pool[i]
                        return

    def _release_old(self, snap):
        if snap is None or snap[2] is None or snap[1].worker is snap[2]:
            return
        self.fb._give_spare(snap[2])

    def _restore(self, snap):
        if snap is None:
            return
        sk, e, worker, owner, calls, config = snap
        fb = self.fb
        with fb._lock:
            if e is None:
                fb._entries.pop(sk, None)
            else:
                e.worker, e.owner, e.calls, e.config = worker, owner, calls, config
                fb._entries[sk] = e


# -- exact intra-node steps and data movement ---------------------------------------
def _seg(segs, k, n, wd):
    return segs[k][:n * wd.itemsize].view(wd)


def store_for_peers(lay, segs, flat, n, wd):
    """This rank's values outside its own element range (those its node peers
    sum) into its segment, in ``wd``; its own range of the segment is where
    the node's sums of that range are made (:func:`node_sum_fill`)."""
    lo, hi = lay.element_range(lay.rank, n)
    seg = _seg(segs, lay.node_comm.Get_rank(), n, wd)
    seg[:lo] = flat[:lo]
    seg[hi:] = flat[hi:]


def node_sum_fill(lay, segs, flat, n, wd, base):
    """``fill(a, b)`` for the inter-node call of the slice that starts at
    element ``base``: elements ``[base + a, base + b)`` summed over the node's
    ranks in local-rank order, in ``wd`` (this rank's values from ``flat``,
    its peers' from their segments), into this rank's segment, which is the
    inter-node call's buffer. Called after a node fence (the peers' stores)."""
    me = lay.node_comm.Get_rank()
    L = lay.node_comm.Get_size()
    segs_wd = [_seg(segs, k, n, wd) for k in range(L)]

    def fill(a, b):
        a, b = base + a, base + b
        src = [flat[a:b] if k == me else segs_wd[k][a:b] for k in range(L)]
        out = segs_wd[me][a:b]
        np.add(src[0], src[1], out=out)
        for k in range(2, L):
            out += src[k]
    return fill


def shm_allgather(lay, segs, flat, n, wd):
    """Every node rank's element range, reduced in place in its segment,
    into ``flat`` (cast to its dtype)."""
    lay.node_fence()
    for k, r in enumerate(lay.members[lay.node]):
        a, b = lay.element_range(r, n)
        flat[a:b] = _seg(segs, k, n, wd)[a:b]
    # the segments are written again by the next call only after every rank read
    lay.node_fence()


def intra_reduce_scatter(lay, x, n):
    """This rank's elements ``element_range`` summed over its node, in
    local-rank order, in ``x``'s dtype."""
    node = lay.node_comm
    L = node.Get_size()
    lo, hi = lay.element_range(lay.rank, n)
    if L == 1:
        return x[lo:hi].copy()
    isz = x.dtype.itemsize
    ranges = [lay.element_range(r, n) for r in lay.members[lay.node]]
    scounts = [(b - a) * isz for a, b in ranges]
    sdispl = [a * isz for a, _ in ranges]
    m = hi - lo
    recv = np.empty(L * m, x.dtype)
    node.Alltoallv([x.view(np.uint8), (scounts, sdispl), MPI.BYTE],
                   [recv.view(np.uint8), ([m * isz] * L, [k * m * isz for k in range(L)]),
                    MPI.BYTE])
    acc = recv[:m].copy()
    for k in range(1, L):
        acc += recv[k * m:(k + 1) * m]
    return acc


def redistribute(lay, pieces, bounds, n, dtype):
    """Move ``pieces`` (``[(lo, hi, values)]``: global element ranges this rank
    holds, values None for zeros) so that world rank r gets ``bounds[r]``;
    returns this rank's ``bounds[rank]`` as one array of ``dtype``."""
    send = []
    for r, (tlo, thi) in enumerate(bounds):
        mine = []
        for a, b, v in pieces:
            p, q = max(a, tlo), min(b, thi)
            if q > p:
                mine.append((p, q, None if v is None else np.ascontiguousarray(
                    v[p - a:q - a])))
        send.append(mine)
    got = lay.comm.alltoall(send)
    lo, hi = bounds[lay.rank]
    out = np.zeros(hi - lo, dtype)
    for parts in got:
        for p, q, v in parts:
            if v is not None:
                out[p - lo:q - lo] = v
    return out


def redistribute_ranges(lay, pieces, targets, dtype):
    """Like :func:`redistribute`, for several target ranges per rank:
    ``targets[r]`` is a list of ``(lo, hi)``; returns one array per range of
    this rank (zeros where no piece covers it)."""
    send = []
    for r in range(lay.size):
        mine = []
        for tlo, thi in targets[r]:
            for a, b, v in pieces:
                p, q = max(a, tlo), min(b, thi)
                if q > p and v is not None:
                    mine.append((p, q, np.ascontiguousarray(v[p - a:q - a])))
        send.append(mine)
    got = lay.comm.alltoall(send)
    outs = [np.zeros(hi - lo, dtype) for lo, hi in targets[lay.rank]]
    for parts in got:
        for p, q, v in parts:
            for (lo, hi), o in zip(targets[lay.rank], outs):
                a, b = max(p, lo), min(q, hi)
                if b > a:
                    o[a - lo:b - lo] = v[a - p:b - p]
    return outs


# -- checkpoints: the hierarchical residuals in the flat layout, and back ------------
def to_flat_form(lay, slices, n, dtype, has_worker, has_owner):
    """This rank's residuals of one key, from ``slices`` ({slice: (worker,
    owner)} of this rank) to the flat layout of the whole communicator
    (collective): a worker residual of n values in global positions (zeros
    outside this rank's slices; the sum over ranks is the total) and the owner
    residual of this rank's ``shard_bounds(n, size)`` shard."""
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
