"""The scheduler of pending calls: one queue, one lock, one rule of when a
wait may block in MPI, the progress thread, and :class:`Request`.

A call (an engine call, ``mpigc._collective._Op``, or a hierarchical call,
``mpigc._hiercall._HierCall``) is a :class:`PendingCall`: it is queued here
when it starts (:func:`enqueue`) and leaves the queue when it is done
(:func:`dequeue`). Everything that advances calls holds :data:`lock`: a
blocking call's wait and :meth:`Request.wait` (:func:`complete`),
:meth:`Request.test` and the progress thread (:func:`progress_all`).

The rule (see ``docs/engine.md``): only a wait on a call blocks in MPI, only
on the oldest pending call, and only when every call before the waited one
is on the same communicator (:func:`in_order`); otherwise it polls every
pending call. A progress step never blocks. Once several user threads have
called mpigc (:func:`note_caller`), no wait blocks in MPI at all: a thread
blocked there holds the lock, and another thread of the rank could not start
or advance the call that a peer waits for (found by the schedule search with
two threads); waits then poll, giving the lock up between polls
(:func:`poll`).

Calls read the queue through :func:`earlier`, :func:`at` and :func:`idle`,
and never change it but through :func:`enqueue` and :func:`dequeue`.
"""
import atexit
import contextlib
import os
import sys
import threading
import time
import types

from mpi4py import MPI

from . import _cuda
from . import _timeline
# the effects, re-exported: calls build them as _sched.Probe(...) and the like
from ._effects import (PAUSE, All, Alone, Any, Calls, Job, Probe, Received, Turn,  # noqa: F401
                       all_ready, arrived, test)

__all__ = ["lock", "Request", "PendingCall", "Turn", "All", "Any", "Probe", "Received", "Job",
           "Calls", "Alone", "PAUSE", "test", "arrived", "complete", "in_order", "progress_all",
           "enqueue", "dequeue", "earlier", "at", "idle", "pending", "wake",
           "note_caller", "several_threads", "may_block", "poll", "finish_pending",
           "in_progress_thread", "progress_thread_alive", "progress_thread_enabled",
           "last_trace", "hold_progress"]

# Every entry point of the engine (start, test, wait, the progress thread)
# holds this lock: the calls' state and MPI requests are touched by one thread
# at a time. Re-entrant: a blocking call's wait() runs inside start()'s caller.
lock = threading.RLock()

_pending = []  # calls started and not done, in start order
# a wait that polls sleeps on this, the lock given up meanwhile (poll); how
# many do now (under lock): the queue notifies them only when there are some
# (Condition.notify_all costs about a microsecond even without a waiter)
_changed = threading.Condition(lock)
_polling = 0
# the user threads that called mpigc: the first one's id, then True for several
_first_caller = None
_several = False


def enqueue(call):
    """Queue a call that has started (under :data:`lock`)."""
    _pending.append(call)
    if _polling:
        _changed.notify_all()


def dequeue(call):
    """Take a call that is done off the queue (under :data:`lock`; no-op
    when it is not there)."""
    if call in _pending:
        _pending.remove(call)
        if _polling:
            _changed.notify_all()
        if _timeline.ON:
            call.trace.ended(*call.trace_args())


def note_caller():
    """A user thread calls mpigc (a start, a wait, a test; before it takes
    the lock). Only at the entry points a user calls: the engine's own
    threads (the progress thread, which starts a hierarchical call's
    inter-node calls) are not user threads. Once a second thread has, waits
    stop blocking in MPI for the rest of the process (:func:`may_block`)."""
    global _first_caller, _several
    if _several:
        return
    me = threading.get_ident()
    if _first_caller is None:
        _first_caller = me
    elif me != _first_caller:
        _several = True
        _watch_first_call()


def _watch_first_call():
    """A second user thread's first call has ended the one-thread mode; the
    first thread may still be blocked in MPI holding :data:`lock` (a wait
    that began before), which nothing can interrupt. Where the lock is still
    held ``$MPIGC_FIRST_CALL_WARN_S`` seconds later (default 60; 0: no
    check), for a whole second without a break, a timer thread says on
    stderr why this rank may hang there (docs/user-guide.md, "Threading
    contract"): a silent hang becomes one that says its likely cause. Once
    per process."""
    try:
        limit = float(os.environ.get("MPIGC_FIRST_CALL_WARN_S", "60"))
    except ValueError:
        limit = 60.0
    if limit > 0:
        t = threading.Timer(limit, _warn_if_held, args=(limit,))
        t.daemon = True
        t.name = "mpigc first-call check"
        t.start()


def _warn_if_held(limit):
    # a lock that is given up at all (waits that poll give it up every 100 µs
    # at most) is free within a second
    if lock.acquire(timeout=1.0):
        lock.release()
        return
    rank = (MPI.COMM_WORLD.Get_rank() if MPI.Is_initialized() and not MPI.Is_finalized()
            else "?")
    sys.stderr.write(
        f"mpigc: rank {rank}: a second thread's first mpigc call came {limit:g} s ago, and "
        "the engine lock is still held (a whole second without a break), most likely by "
        "the first thread that called mpigc, waiting in MPI for a peer. If this rank hangs "
        "here, that peer probably waits for a call this rank's other thread cannot start: "
        "make the process's first mpigc call from the main thread, before starting "
        "threads that call mpigc (docs/user-guide.md, \"Threading contract\"). "
        "MPIGC_FIRST_CALL_WARN_S=0 turns this check off.\n")
    sys.stderr.flush()


def several_threads():
    """Whether a second user thread has called mpigc in this process (from
    then on, waits poll: :func:`note_caller`)."""
    return _several


def may_block():
    """Whether a wait may block in MPI, holding the lock: only while one user
    thread has called mpigc."""
    return not _several


def idle():
    """True when no call is pending."""
    return not _pending


def alone():
    """Whether a blocking call may run straight through now, blocking in MPI
    under :data:`lock` without the queue (:mod:`mpigc._shortcall`): no call
    is pending, so none can wait for this thread, and one user thread calls
    mpigc (under :data:`lock`)."""
    return not _pending and not _several


_STRAIGHT = types.SimpleNamespace(polite=False)  # a call that runs straight through


def wait_alone(effect):
    """Wait for ``effect`` now, blocking in MPI, for a call that runs
    straight through (:func:`alone` said it may); returns what a step would
    receive."""
    return effect.ready(_STRAIGHT, True)[1]


def at(i):
    """The ``i``-th pending call in start order, or None."""
    return _pending[i] if i < len(_pending) else None


def earlier(call):
    """The pending calls started before ``call``, oldest first (all of them
    when ``call`` is not queued)."""
    for op in _pending:
        if op is call:
            return
        yield op


def pending():
    """A copy of the queue, oldest first (to advance calls while iterating)."""
    return list(_pending)


_last = threading.local()


def last_trace():
    """The :class:`CallTrace` of the last collective (blocking or not) that
    this thread called, or None before its first; for a blocking call, how it
    ran. A nonblocking call's is also its request's ``trace``."""
    return getattr(_last, "trace", None)


@contextlib.contextmanager
def hold_progress():
    """A context manager: while inside, the progress thread advances no call
    of this process (it waits to enter the engine); this thread's calls,
    ``test()`` and ``wait()`` work as usual. For debugging and tests that
    need a fixed order of steps on each rank; ``op="none"`` sums already
    handed to a reduction thread still run."""
    with lock:
        yield


class Request:
    """A pending compressed collective (from ``iallreduce`` and friends).

    Call :meth:`wait` to complete it (it returns the result), or :meth:`test`
    to make progress without blocking. Errors of the call (bad input on any
    rank, mismatched ranks, non-finite gradients) are raised by ``wait`` or
    ``test`` on every rank. Every rank must start the same requests in the
    same order and complete each; they may wait for them in any order: while
    one waits, every pending request of the process makes progress.
    """

    def __init__(self, op):
        self._op = op
        _last.trace = op.trace

    @property
    def trace(self):
        """How this call ran, as far as it has got: a read-only
        :class:`CallTrace` (also :func:`mpigc.diagnostics.last_trace` for
        the last call of this thread, blocking calls included)."""
        return self._op.trace

    def test(self):
        """Make progress on every pending request; True once this one is done."""
        note_caller()
        with lock:
            progress_all()
            if self._op.state == "done":
                self._op.settle()
            return self._op.finished()

    def wait(self):
        """Complete the call and return its result."""
        op = self._op
        if op.straight:  # completed straight through, never queued: nothing to do
            return op.result
        note_caller()
        with lock:
            complete(op)
            op.settle()
            op.finished()
            return op.result

    @property
    def done(self):
        return self._op.state == "done"


def complete(op):
    """Advance pending calls until ``op`` is done or failed (under :data:`lock`;
    raises nothing: its error stays with ``op``)."""
    if _several:
        poll(op.done_or_failed)
        return
    while not op.done_or_failed():
        first = _pending[0]
        if in_order(op):
            # every call started before this one is on its communicator,
            # so every rank completes them in the same order: finish the
            # oldest, blocking in MPI (no busy loop stealing the CPU from
            # ranks that are still computing)
            first.progress(block=True)
        else:
            progress_all()


def finish_pending():
    """Complete every pending call before this thread blocks in MPI outside
    the engine, in a collective that every rank makes in the same program
    order (a communicator's first use: its duplicates, its hierarchical
    layout). A peer may be waiting for one of the pending calls, and nothing
    would advance them while this thread blocks there without a progress
    thread: found by the model checker (tests/test_model_check.py, seed 191
    at 3 ranks), a rank in the duplication of a new communicator while the
    other two, in a blocking call, waited for its pending one. A call that is
    done on a rank owes its peers nothing more (its sends are complete), so
    a rank that has finished its calls may block. Errors stay with their
    calls."""
    with lock:
        for call in list(_pending):
            complete(call)


def poll(done):
    """Under :data:`lock`: advance every pending call without blocking until
    ``done()``, giving the lock up between rounds (at once for 200 µs, then
    for up to 100 µs at a time, waking when a call is queued or finished), so
    that other threads may start and advance calls meanwhile. What
    :func:`complete` does when several user threads call mpigc."""
    global _polling
    t0 = time.perf_counter()
    while not done():
        progress_all()
        if done():
            return
        # the lock (every level of it) given up meanwhile
        _polling += 1
        try:
            _changed.wait(0 if time.perf_counter() - t0 < 200e-6 else 100e-6)
        finally:
            _polling -= 1


def in_order(op):
    """True when every pending call up to ``op`` runs on ``op``'s communicator.
    MPI orders collectives per communicator only, so calls on several
    communicators may have been started in different orders on different
    ranks: then ``wait`` polls them all rather than block on one."""
    for p in _pending:
        if p.cs is not op.cs:
            return False
        if p is op:
            return True
    return True


def progress_all():
    """Advance every pending call without blocking (errors are kept by the
    call they belong to and raised by its own test() or wait()). The
    progress thread first makes the call's GPU current
    (:meth:`PendingCall.device_id`): a thread starts on GPU 0."""
    for op in list(_pending):
        if _driver.thread:
            dev = op.device_id()
            if dev is not None:
                _cuda.make_current(dev)
        op.progress(block=False)



class PendingCall:
    """A call in the queue: its steps are a generator (``self.steps``, set
    by the call) that yields effects, what it waits for: :class:`Turn`,
    :class:`All` (or one ``MPI.Request``), :class:`Any`, :class:`Probe`,
    :class:`Job`, :class:`Calls`, :class:`Alone`, :data:`PAUSE`. This class
    drives them (:meth:`progress`); the effects' ``ready`` methods are the one
    place that decides whether an effect is waited for, blocking in MPI, or
    tested. A blocking call is the same generator driven with ``block=True``.

    What the queue and :class:`Request` read: ``state`` ("done" at the
    end), ``error``, ``result``, ``cs`` (calls with the same ``cs`` complete
    in start order on every rank), ``progress(block)``, ``settle()`` (the
    caller saw it done: its key is free again) and ``device_id()`` (the GPU
    its steps run on). A call defines ``device_id``, ``_failed(exc)`` (its
    steps raised: undo what it can) and ``_end()`` (done: leave the queue);
    ``polite`` waits test and sleep rather than block in MPI."""

    steps = None
    waiting = None  # the effect the steps wait for
    wait_since = None  # when it was first waited for (while a timeline is recorded)
    running = False  # a step is under way (no re-entry from a nested wait)
    polite = False
    straight = False  # a call completed straight through, never queued (the short path's)

    def progress(self, block):
        """Advance; never raises (see :meth:`finished`). Blocks in MPI only
        with ``block`` (a blocking wait on this call, first in the queue)."""
        if self.state == "done":
            return True
        if self.running or self.steps is None:
            return False
        self.running = True
        try:
            value = None
            while True:
                w = self.waiting
                if w is not None:
                    if _timeline.ON and self.wait_since is None:
                        self.wait_since = _timeline.now()
                    if isinstance(w, MPI.Request):  # as All([w])
                        ok = all_ready(self, (w,), block)
                    else:
                        ok, value = w.ready(self, block)
                    if not ok:
                        return False
                    if self.wait_since is not None:
                        self.trace.waited(f"wait {type(w).__name__} ({self.state})",
                                          self.wait_since)
                        self.wait_since = None
                self.waiting = None
                w = self.steps.send(value)
                value = None
                if w is PAUSE and not block:
                    return False
                self.waiting = None if w is PAUSE else w
        except StopIteration as stop:
            if stop.value is not None:
                self.result = stop.value
            self.steps = None
            self._end()
            return True
        except BaseException as exc:  # noqa: BLE001 - kept for finished()
            self.steps = None
            self._failed(exc)
            self._end()
            return True
        finally:
            self.running = False

    def done_or_failed(self):
        return self.state == "done"

    def device_id(self):
        """The GPU this call's steps run on, the one current in the caller's
        thread when its device buffer was adopted (``device_id`` of the
        backend), or None (host memory, or nothing adopted): the progress
        thread makes it current before it advances the call
        (:func:`progress_all`), and a reduction thread before the call's
        sum. Every kind of call says (flat and grouped calls, hierarchical
        ones, the short path's), the same way."""
        raise NotImplementedError(f"{type(self).__name__} does not say its GPU")

    def trace_args(self):
        """The call's name and ``args`` in the timeline (:mod:`mpigc._timeline`)."""
        return "call", {}

    def finished(self):
        """True once done; raises the call's error (once done) if it failed."""
        if self.state != "done":
            return False
        if self.error is not None:
            raise self.error
        return True


# who is advancing calls now (under lock): the progress thread or the caller
_driver = types.SimpleNamespace(thread=False)


def progress_thread_enabled():
    """Whether nonblocking calls progress in a background thread.

    ``$MPIGC_PROGRESS_THREAD`` (default ``1``; ``0`` turns it off) and an MPI
    library initialised with ``MPI_THREAD_MULTIPLE`` (the thread calls MPI
    while the caller's thread may too); below that level, or with the
    variable at 0, calls progress only inside ``test()`` and ``wait()``.
    """
    env = os.environ.get("MPIGC_PROGRESS_THREAD", "1").strip()
    if env in ("0", "false", "no", "off"):
        return False
    return MPI.Is_initialized() and not MPI.Is_finalized() \
        and MPI.Query_thread() >= MPI.THREAD_MULTIPLE


def _progress_interval():
    """``$MPIGC_PROGRESS_INTERVAL_US``: how long the progress thread sleeps
    between two passes over the pending calls (default 200 microseconds)."""
    try:
        return max(0.0, float(os.environ.get("MPIGC_PROGRESS_INTERVAL_US", "200"))) * 1e-6
    except ValueError:
        return 200e-6


class _ProgressThread:
    """A daemon thread that advances pending nonblocking calls while the
    caller computes (MPI libraries without asynchronous progress, such as
    Open MPI over TCP, move data only inside MPI calls). It sleeps on a
    condition while nothing is pending, polls every ``_progress_interval``
    otherwise, and is stopped and joined at interpreter exit, before mpi4py
    finalizes MPI (its atexit handler is registered after mpi4py's, so it
    runs first)."""

    def __init__(self):
        self.thread = None
        self.cond = threading.Condition()
        self.stopping = False

    def wake(self):
        if self.thread is None:
            if self.stopping or not progress_thread_enabled():
                return
            self.thread = threading.Thread(target=self._run, name="mpigc-progress",
                                           daemon=True)
            atexit.register(self.stop)
            self.thread.start()
        with self.cond:
            self.cond.notify()

    def _run(self):
        interval = _progress_interval()
        while True:
            with self.cond:
                while not _pending and not self.stopping:
                    self.cond.wait()
            if self.stopping:
                return
            with lock:
                if self.stopping or MPI.Is_finalized():
                    return
                _driver.thread = True
                t0 = _timeline.ON and _timeline.now()
                try:
                    progress_all()
                finally:
                    _driver.thread = False
                if t0 and _timeline.now() - t0 >= 20:
                    _timeline.span("progress pass", t0, "progress")
            time.sleep(interval)

    def stop(self):
        """Stop the thread and wait for it (at exit; idempotent)."""
        self.stopping = True
        t = self.thread
        if t is not None:
            with self.cond:
                self.cond.notify()
            t.join()


_progress_thread = _ProgressThread()


def wake():
    """A nonblocking call started: start the progress thread, or wake it."""
    _progress_thread.wake()


def in_progress_thread():
    """True while the progress thread is advancing calls (under :data:`lock`)."""
    return _driver.thread


def progress_thread_alive():
    """Whether the progress thread is running (no MPI call)."""
    t = _progress_thread.thread
    return t is not None and t.is_alive()
