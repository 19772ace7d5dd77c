"""The reduction threads: one per communicator, running the MPI sums of
``op="none"`` calls handed over by the engine (:mod:`mpigc._collective`)
with the blocking ``MPI_Allreduce`` / ``MPI_Reduce_scatter``, so that
nonblocking calls give the bits of blocking ones."""
import atexit
import os
import threading

from mpi4py import MPI

from . import _cuda

__all__ = ["Job", "Reducer"]


def _reduce_idle_s():
    """``$MPIGC_REDUCE_IDLE_S``: how long a reduction thread waits without
    work before it ends (default 5 seconds)."""
    try:
        return max(0.0, float(os.environ.get("MPIGC_REDUCE_IDLE_S", "5")))
    except ValueError:
        return 5.0


class Job:
    """A reduction handed to a :class:`Reducer`: ``done`` (an Event) is set
    once it ran; ``error``: what it raised, or None."""

    __slots__ = ("fn", "device", "done", "error")

    def __init__(self, fn, device):
        self.fn, self.device = fn, device
        self.done = threading.Event()
        self.error = None


class Reducer:
    """The reduction thread of one communicator (its :class:`CommState`):
    it runs the MPI sums of nonblocking ``op="none"`` calls (and of the
    small-buffer fallback) with the blocking ``MPI_Allreduce`` /
    ``MPI_Reduce_scatter``, so that they give the bits of the blocking calls,
    while the caller computes and the engine advances other calls (the
    engine lock is not held while it waits in MPI).

    One thread per communicator, on a duplicate of its own
    (``CommState.reduce``, nothing else uses it): it runs the sums in the
    order they were handed over, which is the order in which the calls acted
    on their agreements, their start order on the communicator, the same on
    every rank. A daemon thread, started by the first such call; it ends
    once it has had nothing to run for ``$MPIGC_REDUCE_IDLE_S`` seconds
    (default 5, read when the thread starts; a communicator
    that is no longer used keeps no thread) and the next sum starts it
    again. At exit it is stopped and joined when it is idle (every request
    completed, as the rules ask), before mpi4py finalizes MPI."""

    def __init__(self):
        self.jobs = []
        self.cond = threading.Condition()
        self.stopping = False
        self.busy = False
        self.thread = None
        atexit.register(self.stop)

    @staticmethod
    def available():
        """Whether nonblocking sums run in a reduction thread: it calls MPI
        while other threads may, so MPI must grant ``MPI_THREAD_MULTIPLE``
        (below that, nonblocking calls use MPI's nonblocking sums)."""
        return MPI.Query_thread() >= MPI.THREAD_MULTIPLE

    @classmethod
    def of(cls, cs):
        """The reduction thread of ``cs`` (made on first use; under the
        engine lock)."""
        return cs.reduction_thread(cls)

    def submit(self, fn, device=None):
        """Run ``fn()`` after the sums handed over before it; returns its
        :class:`Job`. ``device``: the GPU to make current first (a device
        buffer given to CUDA-aware MPI)."""
        job = Job(fn, device)
        with self.cond:
            self.jobs.append(job)
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="mpigc-reduce",
                                               daemon=True)
                self.thread.start()
            self.cond.notify()
        return job

    def _run(self):
        idle_s = _reduce_idle_s()
        while True:
            with self.cond:
                while not self.jobs and not self.stopping:
                    if not self.cond.wait(idle_s) and not self.jobs:
                        self.thread = None  # idle: the next submit starts another
                        return
                if not self.jobs:
                    return
                job = self.jobs.pop(0)
                self.busy = True
            try:
                if job.device is not None:
                    _cuda.make_current(job.device)
                job.fn()
            except BaseException as exc:  # noqa: BLE001 - raised by the call
                job.error = exc
            finally:
                with self.cond:
                    self.busy = False
                job.done.set()

    def stop(self):
        """Stop the thread and wait for it if it is idle (at exit; idempotent).
        One still inside a sum (a request never completed) is left alone: a
        daemon thread, it cannot hold the interpreter's exit."""
        with self.cond:
            self.stopping = True
            t = self.thread
            idle = not self.jobs and not self.busy
            self.cond.notify()
        if t is not None and idle:
            t.join()
