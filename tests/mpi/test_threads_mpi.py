"""Calls from several user threads of a rank (docs/user-guide.md, "Threading
contract": any thread may call; calls are matched by their order on each
rank).

The first call on a communicator makes mpigc's private duplicate of it
(collective). Two threads whose first calls on a new communicator start at
once must not both make one (issue 27, item 7: the duplicate was made
outside any lock, so both threads duplicated the communicator at once, which
MPI does not allow on one communicator, and the collectives of the two
duplicates paired up across threads: a hang or an abort). Each thread makes
the same call with the same values, so whichever thread's call is matched
with which on another rank, every result is the same.
"""
import threading
import time

import pytest

import mpigc
from mpigc import _comm, _hierarchy

from conftest import assert_all, grads

# ranks: MPIGC_NODE_SPLIT=2: 4 is 2 nodes of 2; 3 uneven
pytestmark = pytest.mark.ranks(1, 2, 3, 4)

N = 3000


def _slowed(monkeypatch, cls):
    """``cls.__init__`` (the making of a communicator's private state) starts
    only after 0.2 s: two threads that start at once are both inside before
    either has made it, every run."""
    orig = cls.__init__

    def slow(self, *args, **kwargs):
        time.sleep(0.2)
        orig(self, *args, **kwargs)
    monkeypatch.setattr(cls, "__init__", slow)


def _in_two_threads(fn):
    """``fn(i)`` in threads i = 0 and 1, started together; ``[result or
    exception]``, or None for a thread that did not finish in 60 s (a hang)."""
    out = [None, None]
    go = threading.Barrier(2)

    def run(i):
        go.wait()
        try:
            out[i] = ("ok", fn(i))
        except Exception as e:  # noqa: BLE001 - compared across ranks
            out[i] = ("error", e)
    ts = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    return out


def _first_calls(comm, iterations, call, state, what):
    """On ``iterations`` new communicators c: ``call(c, x)`` from two threads
    at once, each thread's first call on c; then ``state(c)`` (mpigc's
    private state of c) must be one object for both threads, and each
    thread's result that of ``call(c, x)`` from one thread. None, or what
    went wrong."""
    for it in range(iterations):
        c = comm.Dup()
        x = grads(c.rank, N, seed=it)
        got = _in_two_threads(lambda i, c=c, x=x: (call(c, x), state(c)))
        if any(g is None for g in got):
            return f"iteration {it}: a thread hung"  # its collective is stuck: c stays
        want = call(c, x)
        for i, (kind, v) in enumerate(got):
            if kind == "error":
                return f"iteration {it}, thread {i}: {type(v).__name__}: {v}"
            if v[0].tobytes() != want.tobytes():
                return f"iteration {it}, thread {i}: result differs"
        if got[0][1][1] is not got[1][1][1]:
            return f"iteration {it}: the threads got two {what}"
        c.Free()
    return None


@pytest.mark.mpi
@pytest.mark.parametrize("op", ["none", "2bit"])
def test_first_calls_from_two_threads_on_a_new_communicator(comm, monkeypatch, op):
    """Two threads start their first call on a new communicator at once: one
    private duplicate per rank (both threads get the same state), and both
    calls give the result of the same call made from one thread."""
    _slowed(monkeypatch, _comm.CommState)
    why = _first_calls(comm, 3,
                       lambda c, x: mpigc.allreduce(x.copy(), op, comm=c, feedback=False),
                       _comm.resolve, "private duplicates")
    assert_all(why is None, why, comm)


@pytest.mark.mpi
def test_first_hierarchical_calls_from_two_threads(comm, monkeypatch):
    """As above for the first hierarchical calls on a new communicator, which
    also make the layout's communicators (its duplicate, the node's, the
    slice groups): one layout per rank, and the results of one thread."""
    monkeypatch.setenv("MPIGC_NODE_SPLIT", "2")
    _slowed(monkeypatch, _comm.CommState)
    _slowed(monkeypatch, _hierarchy.Layout)
    why = _first_calls(comm, 2,
                       lambda c, x: mpigc.allreduce(x.copy(), "2bit", comm=c, feedback=False,
                                                    hierarchy="node"),
                       _hierarchy.layout, "layouts")
    assert_all(why is None, why, comm)


@pytest.mark.mpi
def test_private_state_of_two_new_communicators_from_two_threads(comm, monkeypatch):
    """Thread 0 makes mpigc's private state of one new communicator and
    thread 1 that of another, at once, and in the other order on odd ranks
    (``cuda_aware_mpi(comm)`` makes it: collective on first use). MPI allows
    collectives on two communicators from two threads in any order, and so
    does the making of the private state: one lock per communicator (a lock
    for all of them would make a rank wait for the duplicate of one
    communicator while its peer makes that of the other: a hang). The calls
    that follow are made from one thread: calls from several threads must
    start in the same order on every rank (docs/user-guide.md, "Threading
    contract"), which two racing threads do not (their calls on two
    communicators could wait for each other across the ranks)."""
    _slowed(monkeypatch, _comm.CommState)
    cs = [comm.Dup(), comm.Dup()]
    mine = cs if comm.rank % 2 == 0 else cs[::-1]
    got = _in_two_threads(lambda i: (mpigc.cuda_aware_mpi(comm=mine[i]),
                                     _comm.resolve(mine[i])))
    why = None
    if any(g is None for g in got):
        why = "a thread hung"
    elif any(what == "error" for what, _ in got):
        why = "; ".join(f"{type(v).__name__}: {v}" for what, v in got if what == "error")
    else:
        x = grads(comm.rank, N)
        want = mpigc.allreduce(x.copy(), "2bit", feedback=False)
        for i, c in enumerate(mine):
            if _comm.resolve(c) is not got[i][1][1]:
                why = why or f"communicator {i}: its private state was made twice"
        for i, c in enumerate(cs):  # in the same order on every rank
            y = mpigc.allreduce(x.copy(), "2bit", comm=c, feedback=False)
            if y.tobytes() != want.tobytes():
                why = why or f"communicator {i}: result differs"
        for c in cs:
            c.Free()
    assert_all(why is None, why, comm)
