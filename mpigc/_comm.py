"""Communicators: a private duplicate per user communicator, and call tags.

mpigc never sends on the user's communicator: the first collective on a
communicator duplicates it (collectively) and caches the duplicate as an MPI
attribute of the user's communicator, so it goes away with it. Each call takes
the next sequence number of that duplicate; its messages use tags derived from
it, so concurrent nonblocking calls never match each other's messages.
"""
import os
import sys
import threading
import traceback

import numpy as np
from mpi4py import MPI

from . import _plan
from ._errors import DTypeError, MpigcError, code_of, warn_caller

__all__ = ["CommState", "resolve", "lookup", "creation_lock", "agree", "on_root",
           "internal_error"]

_KEYVAL = None
# per user communicator (by handle), a lock held while its private state is
# made: see creation_lock
_creation_locks = {}
_creation_locks_lock = threading.Lock()
_SEQ_MOD = 8000  # tags stay below 32767, the smallest MPI_TAG_UB allowed
_threads_set = False


class CommState:
    """The private duplicate of a communicator and its call counter."""

    __slots__ = ("comm", "post", "reduce", "reducer", "size", "rank", "seq", "local_size",
                 "local_rank", "cuda_aware")

    def __init__(self, comm):
        # Three duplicates. Collectives must start in the same order on every
        # rank. ``comm`` carries what a call starts when it is made (its
        # agreement) and the point-to-point data (tags keep calls apart);
        # ``post`` what calls start once their agreement is in, which happens
        # in start order but at times that differ between ranks (a blocking
        # op="none" call's reduction, the error reports). On one
        # communicator the two kinds could interleave differently on
        # different ranks. ``reduce`` carries the reductions of nonblocking
        # op="none" calls, which a thread of their own runs in start order
        # (``reducer``: mpigc._reducer.Reducer, made on first use) while
        # other threads issue the collectives of ``post``.
        self.comm = comm.Dup()
        self.post = comm.Dup()
        self.reduce = comm.Dup()
        self.reducer = None
        self.size = self.comm.Get_size()
        self.rank = self.comm.Get_rank()
        self.seq = 0
        local = self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.local_size = local.Get_size()
        self.local_rank = local.Get_rank()  # one GPU per node-local rank (select_device)
        local.Free()
        self.cuda_aware = None  # decided on first use by a device array (mpigc._cuda)
        # One plain receive from every peer before any probe: with Open MPI 5
        # (ob1 over shared memory), matched probes (MPI_Mprobe/Improbe, which
        # the agreement messages use) on a pair that has not yet completed a
        # plain receive took about 20 ms each (measured: median 20 ms before,
        # 7-12 us after one Sendrecv). Collective, once per communicator.
        if 1 < self.size <= 16:
            one, got = bytearray(1), bytearray(1)
            for k in range(1, self.size):
                self.comm.Sendrecv([one, MPI.BYTE], (self.rank + k) % self.size, 0,
                                   [got, MPI.BYTE], (self.rank - k) % self.size, 0)

    def reduction_thread(self, make):
        """The reduction thread of this communicator's nonblocking op="none"
        sums (``reducer``): ``make()`` on first use (under the engine lock)."""
        if self.reducer is None:
            self.reducer = make()
        return self.reducer

    def next_tags(self):
        """Tags ``(phase1, phase2, agreement)`` for the next call on this
        communicator."""
        base = 4 * (self.seq % _SEQ_MOD) + 1
        self.seq += 1
        return base, base + 1, base + 2


def _limit_threads(local_size):
    """Cap the kernels' threads at cores / ranks-per-node, once, unless
    ``MPIGC_NUM_THREADS`` says otherwise (``0`` keeps Numba's setting)."""
    global _threads_set
    if _threads_set:
        return
    _threads_set = True
    from .kernels import cpu
    env = os.environ.get("MPIGC_NUM_THREADS")
    if env is not None:
        # no exception here: this runs on first use of a communicator, where a
        # rank that raised alone would leave the others waiting
        try:
            k = int(env)
            if k < 0:
                raise ValueError
        except ValueError:
            warn_caller(f"MPIGC_NUM_THREADS must be an integer >= 0, got {env!r}; "
                        "ignored")
        else:
            cpu.set_max_threads(k if k > 0 else None)
            return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cpu.set_max_threads(max(1, (cores or 1) // max(1, local_size)))


def creation_lock(comm):
    """The lock (re-entrant) under which mpigc makes its private state of the
    user communicator ``comm`` (the duplicates of :class:`CommState`, the
    hierarchical layout), so that two threads whose first calls on ``comm``
    start at once do not both make it: MPI does not allow two threads to
    duplicate one communicator at once, and two duplicates would pair up
    across threads (a hang or an abort). One lock per communicator, not one
    for all: two threads may make the private state of two communicators at
    once, in any order on any rank (MPI allows concurrent collectives on
    distinct communicators), and a single lock could make a rank wait for
    one communicator while its peer waits in the other's duplication. A
    handle that MPI reuses after a communicator was freed gets the old
    lock, which is harmless."""
    h = comm.handle
    with _creation_locks_lock:
        lock = _creation_locks.get(h)
        if lock is None:
            lock = _creation_locks[h] = threading.RLock()
        return lock


_keyval_lock = threading.Lock()  # _KEYVAL is made once, by one thread


def resolve(comm=None):
    """The :class:`CommState` of ``comm`` (default: ``MPI.COMM_WORLD``).

    Collective on first use of a communicator (it is duplicated then), by one
    thread of the process: a thread that comes while another makes it waits
    for it (:func:`creation_lock`).
    """
    global _KEYVAL
    if comm is None:
        comm = MPI.COMM_WORLD
    if not isinstance(comm, MPI.Intracomm):
        raise DTypeError(f"comm: expected an mpi4py Intracomm, got {type(comm).__name__}")
    if _KEYVAL is None:
        with _keyval_lock:
            if _KEYVAL is None:
                _KEYVAL = MPI.Comm.Create_keyval()
    state = comm.Get_attr(_KEYVAL)
    if state is None:
        with creation_lock(comm):
            state = comm.Get_attr(_KEYVAL)  # made meanwhile by another thread?
            if state is None:
                state = CommState(comm)
                comm.Set_attr(_KEYVAL, state)
                _limit_threads(state.local_size)
    return state


def lookup(comm=None):
    """The :class:`CommState` of ``comm`` (default: ``MPI.COMM_WORLD``) if
    mpigc has made it already, else None; never collective."""
    if comm is None:
        comm = MPI.COMM_WORLD
    if _KEYVAL is None or not isinstance(comm, MPI.Intracomm):
        return None
    return comm.Get_attr(_KEYVAL)


def agree(comm, exc, what, classes=None, default=None):
    """Raise on every rank if ``exc`` is set on any rank (one allgather of an
    int64 per rank when all went well). Every rank raises the class of the
    lowest failing rank's error (``classes``: ``{name: class}``, the same on
    every rank; an error of another class is raised as ``default``, else
    MpigcError), with every failing rank's message: the engine's failure
    report (:func:`mpigc._plan.report_error`), its numeric codes in the rows
    (:func:`mpigc._errors.code_of` in the table ``classes`` then ``default``)."""
    table = tuple((classes or {}).values()) + (default or MpigcError,)
    codes = np.zeros(comm.Get_size(), np.int64)
    comm.Allgather(np.array([code_of(exc, table)], np.int64), codes)
    v = _plan.failures(codes, table)
    if v is _plan.GO:
        return
    # every rank's text in the report slots of the engine's failed agreements
    slots = np.empty(_plan.REPORT_SLOT * comm.Get_size(), np.uint8)
    comm.Allgather([_plan.report_slot(_plan.error_text(exc, table)), MPI.BYTE],
                   [slots, MPI.BYTE])
    raise _plan.report_error(what, v, _plan.read_report(slots), comm.Get_size(), exc)


def on_root(comm, fn, what, *, exc=None, classes=None, default=None):
    """Run ``fn()`` on rank 0 (unless this rank already failed with ``exc``),
    raise any rank's error on every rank (:func:`agree`), and return rank 0's
    result on every rank."""
    value = None
    if exc is None and comm.Get_rank() == 0:
        try:
            value = fn()
        except Exception as e:  # noqa: BLE001 - reported collectively
            exc = e
    agree(comm, exc, what, classes, default)
    return comm.bcast(value, root=0)


def internal_error(exc, comm, what):
    """An exception that is not an :class:`MpigcError` escaped call ``what``
    on this rank: a defect, a failed allocation, an MPI error, an interrupt.
    mpigc raises its own errors on every rank together; such an exception is
    this rank's alone, and its peers would wait forever for this call's
    messages. So, where ``comm`` has peers, the job is aborted
    (``comm.Abort``) after the rank, the call and the traceback are written to
    stderr, as torch takes a process down on an asynchronous NCCL error.
    ``MPIGC_ON_INTERNAL_ERROR=raise`` raises it instead (under a debugger; the
    peers then hang). Returns when the exception is to be raised."""
    if isinstance(exc, MpigcError) or comm.Get_size() == 1:
        return
    policy = os.environ.get("MPIGC_ON_INTERNAL_ERROR", "abort").strip().lower()
    if policy == "raise":
        return
    bad = "" if policy == "abort" else (
        f" (MPIGC_ON_INTERNAL_ERROR={policy!r} is not 'abort' or 'raise': aborting)")
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    world = MPI.COMM_WORLD
    sys.stderr.write(
        f"mpigc: rank {world.Get_rank()} of {world.Get_size()} (rank {comm.Get_rank()} of "
        f"{comm.Get_size()} in the call): {type(exc).__name__} in {what}, which its peers "
        f"cannot learn of: aborting the job so that they do not wait forever{bad}. "
        f"MPIGC_ON_INTERNAL_ERROR=raise raises it instead.\n{text}")
    sys.stderr.flush()
    comm.Abort(70)
