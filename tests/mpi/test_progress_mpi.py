"""Progress during compute: nonblocking calls complete while the caller
computes without making any MPI call (the progress thread).

Completion is observed, not timed: the caller spins in a pure-Python /
numpy loop and reads ``request.done`` (no ``test()``, no MPI call) until it
flips. A generous deadline only turns a request that never completes into a
failure instead of a hang; it asserts nothing about speed.
"""
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import mpigc
from mpigc import _agree

from conftest import assert_all, grads

# ranks: flat; 3 gives a rank alone in its half (none at 4); 4 adds nothing
pytestmark = pytest.mark.ranks(1, 2, 3)

DEADLINE_S = 60.0


def _compute_until_done(reqs):
    """Busy without MPI until every request says done (or the deadline):
    how many loop iterations it took, or None if the deadline passed."""
    a = np.arange(256, dtype=np.float64)
    t0, it = time.monotonic(), 0
    while not all(r.done for r in reqs):
        s = 0
        for i in range(200):  # pure Python
            s += i * i
        a = np.sqrt(a * a + 1.0)  # numpy
        it += 1
        if time.monotonic() - t0 > DEADLINE_S:
            return None
    return it


@pytest.mark.mpi
@pytest.mark.parametrize("op", ["none", "2bit", "1bit", "terngrad"])
def test_request_completes_while_caller_computes(comm, op):
    if not mpigc.diagnostics.progress_thread_enabled():
        pytest.skip("no progress thread (MPIGC_PROGRESS_THREAD=0 or MPI below "
                    "THREAD_MULTIPLE)")
    fb = mpigc.ErrorFeedback()
    xs = [grads(comm.rank, n) for n in (5000, 70000, 300001)]
    want = [mpigc.allreduce(x.copy(), op, key=f"k{i}", feedback=mpigc.ErrorFeedback(),
                            seed=1) if op == "terngrad" else
            mpigc.allreduce(x.copy(), op, key=f"k{i}", feedback=mpigc.ErrorFeedback())
            for i, x in enumerate(xs)]
    kw = {"seed": 1} if op == "terngrad" else {}
    bufs = [x.copy() for x in xs]
    reqs = [mpigc.iallreduce(b, op, key=f"k{i}", feedback=fb, **kw)
            for i, b in enumerate(bufs)]
    iters = _compute_until_done(reqs)
    done = iters is not None
    for r in reqs:  # complete them everywhere, whatever happened
        r.wait()
    assert_all(done, f"not done after {DEADLINE_S} s of compute without MPI calls")
    if op == "none":  # MPI_Iallreduce may sum in another order than MPI_Allreduce
        same = all(np.allclose(b, w, rtol=1e-5, atol=1e-5) for b, w in zip(bufs, want))
    else:
        same = all(b.tobytes() == w.tobytes() for b, w in zip(bufs, want))
    assert_all(same, "results differ from blocking calls")


@pytest.mark.mpi
def test_errors_still_raised_by_wait_on_every_rank(comm):
    """A bad call completed by the progress thread raises from wait()."""
    x = grads(comm.rank, 4000)
    if comm.rank == comm.size - 1:
        x[3] = np.nan
    req = mpigc.iallreduce(x, "2bit", key="e", feedback=mpigc.ErrorFeedback())
    _compute_until_done([req])
    try:
        req.wait()
        name = None
    except mpigc.NonFiniteError as e:
        name = type(e).__name__
    assert_all(name == "NonFiniteError", f"got {name}")


@pytest.mark.mpi
def test_key_stays_in_use_until_wait(comm):
    """A request completed by the thread keeps its key in use until the
    caller's wait(): a call on that key in between raises StateError on
    every rank, whatever the timing (as without the thread)."""
    if not mpigc.diagnostics.progress_thread_enabled():
        pytest.skip("no progress thread")
    fb = mpigc.ErrorFeedback()
    req = mpigc.iallreduce(grads(comm.rank, 5000), "2bit", key="b", feedback=fb)
    _compute_until_done([req])
    try:
        mpigc.allreduce(grads(comm.rank, 5000), "2bit", key="b", feedback=fb)
        name = None
    except mpigc.StateError as e:
        name = type(e).__name__
    req.wait()
    assert_all(name == "StateError", f"got {name}")
    mpigc.allreduce(grads(comm.rank, 5000), "2bit", key="b", feedback=fb)


@pytest.mark.mpi
def test_exit_with_the_thread_running_does_not_hang(comm):
    """A program that leaves requests pending at exit (its atexit stops the
    thread before mpi4py finalizes MPI) exits, on every rank."""
    if comm.rank != 0:
        return
    code = (
        "import numpy as np, mpigc\n"
        "x = np.ones(100000, np.float32)\n"
        "r = mpigc.iallreduce(x, '2bit', key='a')\n"
        "r.wait()\n"
        "r = mpigc.iallreduce(x, 'none')\n"
        "assert mpigc.diagnostics.threads()['progress']\n"
        "r.wait()\n")
    env = dict(os.environ, MPIGC_PROGRESS_THREAD="1")
    for k in [k for k in env if k.startswith(("OMPI_", "PMIX", "PRTE"))
              and "ALLOW_RUN_AS_ROOT" not in k]:
        del env[k]  # a singleton, not a member of this job
    p = subprocess.run([sys.executable, "-c", code], env=env, timeout=120,
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-2000:]


def _deadline(seconds=120):
    """A hang kills this rank (traceback on stderr) instead of the suite."""
    import faulthandler
    faulthandler.dump_traceback_later(seconds, exit=True)
    return faulthandler.cancel_dump_traceback_later


@pytest.mark.mpi
def test_blocking_mpi_sum_while_a_request_is_pending(comm):
    """A blocking op="none" call (MPI's own sum) started while a request is
    pending: whether this rank's caller or its progress thread starts the
    sum is timing, so the engine must start the same (nonblocking) MPI
    collective either way; a blocking sum on one rank against a nonblocking
    one on another hung (review of issue 15, 3 of 3 runs within 30 calls)."""
    if not mpigc.diagnostics.progress_thread_enabled():
        pytest.skip("no progress thread")
    cancel = _deadline()
    try:
        a = np.ones(1 << 17, np.float32)
        fb = mpigc.ErrorFeedback()
        ok = True
        for _ in range(20):
            time.sleep(0.01 * comm.rank)  # ranks arrive at different times
            req = mpigc.iallreduce(a, "2bit", key="A", feedback=fb)
            small = np.ones(1 << 18, np.float32)
            mpigc.allreduce(small, "none")
            req.wait()
            ok &= bool(np.all(small == comm.size))
    finally:
        cancel()
    assert_all(ok, "wrong MPI sum")


@pytest.mark.mpi
@pytest.mark.ranks(2)  # the hang it guards was a pair's (it skips at the other counts)
def test_reduce_scatter_sends_do_not_block_the_thread(comm):
    """The progress thread finishing an ireduce_scatter must not block on its
    sends (engine lock held) while the peer waits for an earlier call of
    this rank: it hung about one iteration in three (review of issue 15)."""
    if not mpigc.diagnostics.progress_thread_enabled() or comm.size != 2:
        pytest.skip("2 ranks with the progress thread")
    cancel = _deadline()
    try:
        rng = np.random.default_rng(comm.rank)
        a = rng.standard_normal(1 << 23).astype(np.float32)  # terngrad: packs after agreeing
        n = 1 << 19
        b = rng.standard_normal(n).astype(np.float32)
        counts = [1000, n - 1000]  # rank 0 -> 1: large (rendezvous), 1 -> 0: small
        want = mpigc.reduce_scatter(b.copy(), "2bit", key="R", recvcounts=counts,
                                    feedback=mpigc.ErrorFeedback())
        fb = mpigc.ErrorFeedback()
        ok = True
        for _ in range(12):
            if comm.rank == 1:
                time.sleep(0.3)
            ra = mpigc.iallreduce(a.copy(), "terngrad", key="A", feedback=fb)
            rr = mpigc.ireduce_scatter(b, "2bit", key="R", recvcounts=counts,
                                       feedback=mpigc.ErrorFeedback())
            if comm.rank == 0:
                time.sleep(0.6)  # compute while the thread works
            ra.wait()
            ok &= rr.wait().tobytes() == want.tobytes()
            comm.Barrier()
    finally:
        cancel()
    assert_all(ok, "reduce_scatter result differs")


@pytest.mark.mpi
def test_many_rank_agreement_is_the_same_collective_everywhere(comm, monkeypatch):
    """Above 16 ranks the agreement is an allgather. A blocking call with
    nothing pending on one rank (the thread finished its request) and a
    request still pending on another must still start the same collective
    (MPI_Iallgather), or the two do not match: a hang (forced here)."""
    if not mpigc.diagnostics.progress_thread_enabled() or comm.size < 2:
        pytest.skip("2+ ranks with the progress thread")
    monkeypatch.setattr(_agree, "P2P_MAX_RANKS", 1)
    want = mpigc.allreduce(np.ones(1 << 14, np.float32), "2bit", key="B",
                           feedback=mpigc.ErrorFeedback())
    cancel = _deadline()
    try:
        a, b = np.ones(1 << 21, np.float32), np.ones(1 << 14, np.float32)
        if comm.rank == 1:
            time.sleep(0.3)
        req = mpigc.iallreduce(a, "2bit", key="A", feedback=mpigc.ErrorFeedback())
        if comm.rank == 0:
            _compute_until_done([req])  # rank 0: nothing pending at the next call
        mpigc.allreduce(b, "2bit", key="B", feedback=mpigc.ErrorFeedback())
        req.wait()
    finally:
        cancel()
    assert_all(b.tobytes() == want.tobytes(), "results differ from a call alone")


@pytest.mark.mpi
def test_first_use_of_a_communicator_while_a_call_is_pending(comm, monkeypatch):
    """A communicator's first use is collective (its duplicates), outside
    the engine. Found by the model checker (tests/test_model_check.py, seed
    191 at 3 ranks) and replayed here on real MPI with no progress thread and
    the rows by allgather (as beyond 16 ranks): a rank that blocked in the
    duplication with a request pending hung the two others, whose blocking
    op="none" sum waited for that request (a blocking sum waits for the
    calls before it); 1 run in 2 before the fix. The engine completes the
    pending calls first."""
    if comm.size < 3:
        pytest.skip("3+ ranks: a rank alone in its half")
    monkeypatch.setattr(_agree, "P2P_MAX_RANKS", 1)
    monkeypatch.setenv("MPIGC_INLINE_PAYLOAD_BYTES", "4096")
    r = comm.rank
    half = comm.Split(r % 2, r)
    fb = mpigc.ErrorFeedback()
    mpigc.allreduce(np.ones(4, np.float32), "none", comm=half, key="warm", feedback=fb)
    rng = np.random.default_rng(r)
    cancel = _deadline(60)
    try:
        for _ in range(4):
            fresh = comm.Dup()
            x, y, z = (rng.standard_normal(n).astype(np.float32) for n in (12001, 3001, 3001))
            if r == 1:
                y[5] = np.nan  # alone in its half: skipped there
            with mpigc.diagnostics.hold_progress():  # as without the progress thread
                req = mpigc.iallreduce(x, "2bit", comm=comm, key="w", feedback=fb)
                mpigc.allreduce(y, "none", comm=half, key="h", feedback=fb,
                                nonfinite="skip")
                req2 = mpigc.iallreduce(z, "fp16", comm=fresh, key="f", feedback=fb)
                req.wait()
                req2.wait()
            ones = mpigc.allreduce(np.ones(4, np.float32), "none", comm=fresh, key="after",
                                   feedback=fb)
            assert_all(np.all(ones == comm.size), "the new communicator works afterwards")
            fresh.Free()
    finally:
        cancel()
