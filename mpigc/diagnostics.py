"""How mpigc's calls ran: for tests, debugging and tuning.

- ``Request.trace`` and :func:`last_trace`: a :class:`CallTrace` per call
  (the path it took, whether its data travelled in the agreement messages,
  its chunks, whether its agreement is over, the pieces of a plain sum);
- :func:`counters`: process-wide counts (pipelined calls, messages split
  beyond ``$MPIGC_MAX_COUNT``), inter-node calls of hierarchical calls
  included;
- :func:`threads`: whether the progress thread and a communicator's
  reduction thread are running;
- :func:`hold_progress`: keep the progress thread out for a block of code;
- :func:`progress_thread_enabled`: whether nonblocking calls progress in a
  background thread here (``$MPIGC_PROGRESS_THREAD`` and the MPI thread level);
- :func:`several_threads`: whether a second user thread has called mpigc
  (from then on, waits poll instead of blocking in MPI).

Recording costs a few attribute writes per call; nothing here makes an MPI
call. The environment variables that move the engine's internal limits
(``$MPIGC_INLINE_PLAIN_BYTES``, ``$MPIGC_INLINE_PAYLOAD_BYTES``,
``$MPIGC_MAX_COUNT``, ``$MPIGC_REDUCE_IDLE_S``) are described in
``docs/user-guide.md`` (Diagnostics).
"""
from . import _comm, _sched
from ._trace import CallTrace
from ._wire import counters
from ._sched import hold_progress, last_trace, progress_thread_enabled, several_threads

__all__ = ["CallTrace", "last_trace", "counters", "threads", "hold_progress",
           "progress_thread_enabled", "several_threads"]


def threads(comm=None):
    """Whether mpigc's background threads are running: ``{"progress": ...,
    "reduce": ...}``, the process's progress thread and the reduction thread
    of ``comm`` (default ``MPI.COMM_WORLD``; False for a communicator mpigc
    has not used). Makes no MPI call beyond reading an attribute."""
    cs = _comm.lookup(comm)
    red = None if cs is None else cs.reducer
    return {"progress": _sched.progress_thread_alive(),
            "reduce": red is not None and red.thread is not None}
