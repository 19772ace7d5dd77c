"""The effects of the engine's steps: what a call's steps yield, what it
waits for (:class:`Turn`, :class:`All`, :class:`Any`, :class:`Probe`,
:class:`Received`, :class:`Job`, :class:`Calls`, :class:`Alone`, :data:`PAUSE`), and how each is
waited for: ``ready(call, block)`` is the one place that decides whether a
step blocks in MPI (with ``block``, a blocking wait that the scheduler's
rule lets block) or only tests. The scheduler (:mod:`mpigc._sched`, which
re-exports them) drives the steps; calls build the effects. Also
:func:`test` and :func:`arrived`, for steps that look at what has arrived
between effects. No state of their own."""
import time

from mpi4py import MPI

__all__ = ["Turn", "All", "all_ready", "Any", "Probe", "Received", "Job", "Calls", "Alone", "PAUSE",
           "test", "arrived"]

# With ``block`` (a blocking wait on ``call``, which the queue lets block: see
# mpigc._sched.complete) MPI effects are waited for in MPI; a progress step (``block``
# False) only tests. ``ready(call, block)`` gives ``(True, value)`` once the
# effect is met (the step receives ``value``), else ``(False, None)``. These
# methods are the only place that decides whether a step blocks.

class Turn:
    """An effect: wait until ``ok()`` holds, a condition on the queue (an
    earlier call has got far enough). Never waited for in MPI: a blocking
    wait that meets an unmet turn advances the calls before it instead."""
    __slots__ = ("ok",)

    def __init__(self, ok):
        self.ok = ok

    def ready(self, call, block):
        return self.ok(), None


class All:
    """An effect: every request of ``reqs`` (a list of ``MPI.Request``) is
    complete. A bare ``MPI.Request`` is the same as ``All([req])``."""
    __slots__ = ("reqs",)

    def __init__(self, reqs):
        self.reqs = reqs

    def ready(self, call, block):
        return all_ready(call, self.reqs, block), None


def all_ready(call, reqs, block):
    """Whether every request of ``reqs`` is complete (:class:`All`); waits
    for them with ``block``."""
    if not block:
        return MPI.Request.Testall(reqs)
    if call.polite:
        for r in reqs:
            _wait_politely(r)
    else:
        MPI.Request.Waitall(reqs)
    return True


class Any:
    """An effect: one request of ``reqs`` is complete; the step receives its
    index (``MPI.UNDEFINED`` when every request is null). A completed request
    is null from then on (mpi4py updates the objects in place)."""
    __slots__ = ("reqs",)

    def __init__(self, reqs):
        self.reqs = reqs

    def ready(self, call, block):
        if block:
            return True, MPI.Request.Waitany(self.reqs)
        i, flag = MPI.Request.Testany(self.reqs)
        return flag, i


class Probe:
    """An effect: a message from ``source`` with ``tag`` is there on
    ``comm``; the step receives ``(message, count in bytes)``, to receive
    with ``message.Irecv``."""
    __slots__ = ("comm", "source", "tag")

    def __init__(self, comm, source, tag):
        self.comm, self.source, self.tag = comm, source, tag

    def ready(self, call, block):
        st = MPI.Status()
        if block:
            msg = self.comm.Mprobe(self.source, self.tag, st)
        else:
            msg = self.comm.Improbe(self.source, self.tag, st)
            if msg is None:
                return False, None
        return True, (msg, st.Get_count(MPI.BYTE))


class Received:
    """An effect: the message from ``source`` with ``tag`` on ``comm`` is
    received into ``slot(count)`` (a buffer of its ``count`` bytes); the step
    receives ``count``. Blocking, one matched probe and its blocking receive
    (the short path's exchange, :mod:`mpigc._shortcall`: no request made);
    otherwise a matched probe that tests, then the receive's request."""
    __slots__ = ("comm", "source", "tag", "slot", "req", "count")

    def __init__(self, comm, source, tag, slot):
        self.comm, self.source, self.tag, self.slot = comm, source, tag, slot
        self.req = None

    def ready(self, call, block):
        if self.req is None:
            st = MPI.Status()
            if block:
                msg = self.comm.Mprobe(self.source, self.tag, st)
                self.count = st.Get_count(MPI.BYTE)
                msg.Recv([self.slot(self.count), self.count, MPI.BYTE])
                return True, self.count
            msg = self.comm.Improbe(self.source, self.tag, st)
            if msg is None:
                return False, None
            self.count = st.Get_count(MPI.BYTE)
            self.req = msg.Irecv([self.slot(self.count), self.count, MPI.BYTE])
        if block:
            self.req.Wait()
        elif not self.req.Test():
            return False, None
        return True, self.count


class Job:
    """An effect: work handed to another thread is over (``done``, a
    ``threading.Event``)."""
    __slots__ = ("done",)

    def __init__(self, done):
        self.done = done

    def ready(self, call, block):
        if block:
            self.done.wait()
        return self.done.is_set(), None


class Calls:
    """An effect: every call of ``calls`` (later in the queue, started by
    this one) is done."""
    __slots__ = ("calls",)

    def __init__(self, calls):
        self.calls = calls

    def ready(self, call, block):
        for sub in self.calls:
            while sub.state != "done":
                if not block:
                    sub.progress(block=False)
                    if sub.state != "done":
                        return False, None
                elif _sched.at(0) is call and _sched.at(1) is sub:
                    # nothing started before it but this call, which waits for
                    # it: blocking in MPI is safe, as for the oldest call
                    sub.progress(block=True)
                else:
                    _sched.progress_all()
        return True, None


class Alone:
    """An effect: the next step blocks in MPI itself (a blocking op="none"
    sum). It runs only in a blocking wait on this very call, first in the
    queue (the step receives True), or, once ``elsewhere()`` holds, in
    another thread (the step receives False)."""
    __slots__ = ("elsewhere",)

    def __init__(self, elsewhere=None):
        self.elsewhere = elsewhere

    def ready(self, call, block):
        if block and _sched.at(0) is call:
            return True, True
        if self.elsewhere is not None and self.elsewhere():
            return True, False
        return False, None


class _Pause:
    """An effect: a progress step stops here (the lock is held while a step
    computes: one chunk at a time); a blocking wait goes straight on. Handled
    by :meth:`mpigc._sched.PendingCall.progress` itself, never waited for."""


PAUSE = _Pause()


# Whether every request of a list is complete (never blocks; a completed
# request is null from then on): for steps that look at what has arrived
# between effects, and for the buffers of finished calls' sends. MPI's own
# function, without a Python frame around it (small calls are made of such).
test = MPI.Request.Testall


def arrived(reqs):
    """The indices of the requests of ``reqs`` completed since last asked
    (never blocks)."""
    return MPI.Request.Testsome(reqs) or []


def _wait_politely(req):
    """Wait for ``req``: tested for up to 200 µs, then every 100 µs with the
    core given up in between: where ranks outnumber cores, a spinning wait
    takes the core from the very peer it waits for (docs/cluster.md)."""
    t0 = time.perf_counter()
    while not req.Test():
        if time.perf_counter() - t0 > 200e-6:
            time.sleep(100e-6)


# at the end: the scheduler imports this module's effects (Calls and Alone
# read its queue)
from . import _sched  # noqa: E402
