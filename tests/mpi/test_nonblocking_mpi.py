"""iallreduce / ireduce_scatter: several requests in flight, test() and wait()."""
import numpy as np
import pytest

import mpigc

from conftest import assert_all, grads
from peers import await_word

# ranks: flat calls only: 2 pairs, 3 uneven shards; 4 adds nothing
pytestmark = pytest.mark.ranks(1, 2, 3)


@pytest.mark.mpi
@pytest.mark.parametrize("op", ["none", "2bit", "1bit", "terngrad", "fp16", "bf16"])
def test_many_requests_equal_blocking(comm, op):
    sizes = [1, 100, 4097, 30000]
    fb_nb, fb_b = mpigc.ErrorFeedback(), mpigc.ErrorFeedback()
    for step in range(2):
        bufs = [grads(comm.rank, n, seed=step * 10 + i) for i, n in enumerate(sizes)]
        ref = [mpigc.allreduce(b.copy(), op=op, key=f"k{i}", feedback=fb_b)
               for i, b in enumerate(bufs)]
        reqs = [mpigc.iallreduce(b, op=op, key=f"k{i}", feedback=fb_nb)
                for i, b in enumerate(bufs)]
        outs = [None] * len(reqs)
        for i in reversed(range(len(reqs))):  # complete in another order
            outs[i] = reqs[i].wait()
        same = [o.tobytes() == r.tobytes() for o, r in zip(outs, ref)]
        ok = all(same) and all(o is b for o, b in zip(outs, bufs))
        assert_all(ok and all(r.done for r in reqs), f"step {step}")


@pytest.mark.mpi
def test_test_loop_completes(comm, fb):
    x = grads(comm.rank, 50000)
    req = mpigc.iallreduce(x, op="2bit", key="t", feedback=fb)
    spins = 0
    while not req.test():
        spins += 1
        assert spins < 10_000_000
    assert_all(req.done and req.wait() is x)


@pytest.mark.mpi
def test_ireduce_scatter(comm, fb):
    x = grads(comm.rank, 1000)
    want = mpigc.reduce_scatter(x, op="1bit", key="a", feedback=mpigc.ErrorFeedback())
    got = mpigc.ireduce_scatter(x, op="1bit", key="a", feedback=fb).wait()
    assert_all(got.tobytes() == want.tobytes())


@pytest.mark.mpi
def test_error_is_raised_by_wait_on_every_rank(comm, fb):
    x = grads(comm.rank, 100)
    if comm.rank == comm.size - 1:
        x[0] = np.nan
    req = mpigc.iallreduce(x, op="2bit", key="e", feedback=fb)
    try:
        req.wait()
        got = None
    except mpigc.NonFiniteError as e:
        got = e
    assert_all(got is not None and req.done and "e" not in fb)


@pytest.mark.mpi
def test_ranks_may_wait_in_different_orders(comm, fb):
    """While one request waits, the others progress: no deadlock."""
    a, b = grads(comm.rank, 3000, seed=1), grads(comm.rank, 5000, seed=2)
    ra = mpigc.iallreduce(a, op="2bit", key="a", feedback=fb)
    rb = mpigc.iallreduce(b, op="1bit", key="b", feedback=fb)
    if comm.rank % 2:
        rb.wait(); ra.wait()
    else:
        ra.wait(); rb.wait()
    ref = mpigc.ErrorFeedback()
    wa = mpigc.allreduce(grads(comm.rank, 3000, seed=1), op="2bit", key="a", feedback=ref)
    wb = mpigc.allreduce(grads(comm.rank, 5000, seed=2), op="1bit", key="b", feedback=ref)
    assert_all(a.tobytes() == wa.tobytes() and b.tobytes() == wb.tobytes())


@pytest.mark.mpi
def test_blocking_call_between_pending_requests(comm, fb):
    a = grads(comm.rank, 2000, seed=3)
    ra = mpigc.iallreduce(a, op="2bit", key="a", feedback=fb)
    b = mpigc.allreduce(grads(comm.rank, 100, seed=4), op="2bit", key="b", feedback=fb)
    ra.wait()
    assert_all(fb.state_dict()["a"]["calls"] == 1 and b.size == 100)


@pytest.mark.mpi
def test_terngrad_streams_differ_between_keys_and_calls(comm):
    x = np.full(4096, 0.5, np.float32)
    x[0] = 1.0  # scale 1: each element kept with probability 1/2
    outs = [mpigc.allreduce(x.copy(), op="terngrad", key=k, feedback=False, gather="exact")
            for k in ("p", "q", "p")]
    assert_all(outs[0].tobytes() != outs[1].tobytes() != outs[2].tobytes()
               and outs[0].tobytes() != outs[2].tobytes())


@pytest.mark.mpi
@pytest.mark.parametrize("op", ["none", "2bit"])
def test_progress_at_different_times_on_different_ranks(comm, op):
    """A request that progresses on some ranks before the next one starts must
    not mix up the collectives of the two (MPI matches collectives by order)."""
    fb = mpigc.ErrorFeedback()
    a, b = np.ones(1000, np.float32), np.ones(3000, np.float32)
    kw = {"threshold": 0.5} if op == "2bit" else {}  # 2bit: MXNet's absolute mode
    ra = mpigc.iallreduce(a, op=op, key="a", feedback=fb, **kw)
    if comm.rank % 2:  # odd ranks: past a's agreement (a's reduction started) before b
        while not ra.trace.agreement_done:
            ra.test()
    past = ra.trace.path is not None  # odd ranks: a went ahead before b started
    rb = mpigc.iallreduce(b, op=op, key="b", feedback=fb, **kw)
    rb.wait()
    ra.wait()
    want = comm.size if op == "none" else 0.5
    assert_all(comm.rank % 2 == 0 or past, f"a not past its agreement: {ra.trace}")
    assert_all(np.all(a == want) and np.all(b == want), f"{a[:3]} {b[:3]}")


@pytest.mark.mpi
@pytest.mark.parametrize("fault", ["size", "readonly", "none-size"])
def test_failed_call_reached_early_does_not_block_an_earlier_one(comm, fault):
    """The last rank advances a later call to its failed agreement (test())
    while an earlier call still owes the other ranks its next stage; they
    come later and wait for that earlier call first. The failed call's error
    report must not block the last rank: it once did (a blocking allgather
    holding the engine lock) and the job hung, in CI's random-fault test.
    The earlier call completes and is right, the later one raises on every
    rank. A hang kills this rank after a deadline (faulthandler), so it
    fails instead of stalling the suite."""
    import faulthandler
    import time

    if comm.size < 2:
        pytest.skip("needs a peer that comes later")
    last = comm.rank == comm.size - 1
    n = 300_000  # fp16: > 256 KiB to each peer, sent after the agreement
    x = grads(comm.rank, n)
    want = mpigc.allreduce(x.copy(), "fp16", key="a", feedback=mpigc.ErrorFeedback())
    op = "none" if fault == "none-size" else "2bit"
    bad = grads(comm.rank, 1000 + (last and fault != "readonly"))
    if fault == "readonly" and last:
        bad.flags.writeable = False
    expected = mpigc.InvalidBufferError if fault == "readonly" else mpigc.MismatchError
    faulthandler.dump_traceback_later(120, exit=True)
    try:
        # the progress thread kept out: each rank's steps in this order
        with mpigc.diagnostics.hold_progress():
            ra = mpigc.iallreduce(x, "fp16", key="a", feedback=mpigc.ErrorFeedback())
            rc = mpigc.iallreduce(bad, op, key="c", feedback=mpigc.ErrorFeedback())
            got = None
            if last:
                while True:
                    try:
                        if rc.test():
                            break
                    except mpigc.MpigcError as e:
                        got = e
                        break
            else:
                time.sleep(0.5)  # the last rank reaches rc's agreement first
                ra.wait()
                try:
                    rc.wait()
                except mpigc.MpigcError as e:
                    got = e
            ra.wait()
    finally:
        faulthandler.cancel_dump_traceback_later()
    assert_all(isinstance(got, expected), f"got {type(got).__name__}: {got}")
    assert_all(x.tobytes() == want.tobytes(), "the earlier call's result differs")


NONE_SIZES = [1, 10, 1000, 3000, 10000, 30000, 100000, 300000]  # 2 ranks: > 1 MiB last


@pytest.mark.mpi
@pytest.mark.parametrize("kind", ["allreduce", "reduce_scatter"])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_nonblocking_none_has_the_bits_of_blocking(comm, kind, dtype):
    """op="none" is exactly MPI_Allreduce / MPI_Reduce_scatter (README), for
    iallreduce and ireduce_scatter too: the same bits as the blocking call,
    summed or averaged, at every size (issue 27, item 7: nonblocking calls
    used MPI_Iallreduce, whose sums differ in the last bits from
    MPI_Allreduce's on 3 ranks with Open MPI 5.0). Several requests at once,
    completed in reverse order."""
    bad = []
    for average in (False, True):
        xs = [grads(comm.rank, n, dtype, seed=i) for i, n in enumerate(NONE_SIZES)]
        f, fi = getattr(mpigc, kind), getattr(mpigc, "i" + kind)
        want = [np.asarray(f(x.copy(), "none", average=average)) for x in xs]
        reqs = [fi(x.copy(), "none", average=average) for x in xs]
        got = [None] * len(reqs)
        for i in reversed(range(len(reqs))):
            got[i] = np.asarray(reqs[i].wait())
        bad += [(n, average) for n, a, b in zip(NONE_SIZES, want, got)
                if a.tobytes() != b.tobytes()]
    assert_all(not bad, f"nonblocking differs from blocking at (size, average) {bad}")


@pytest.mark.mpi
def test_nonblocking_fallback_has_the_bits_of_blocking(comm, monkeypatch):
    """The small-buffer fallback (a compressed op below
    $MPIGC_MIN_COMPRESS_BYTES: a plain MPI sum) likewise."""
    monkeypatch.setenv("MPIGC_MIN_COMPRESS_BYTES", str(1 << 30))
    bad = []
    for n in NONE_SIZES:
        x = grads(comm.rank, n, np.float64)
        a = mpigc.allreduce(x.copy(), "2bit", key="f")
        b = mpigc.iallreduce(x.copy(), "2bit", key="f").wait()
        if a.tobytes() != b.tobytes():
            bad.append(n)
    assert_all(not bad, f"nonblocking differs from blocking at sizes {bad}")


@pytest.mark.mpi
def test_nonblocking_none_returns_before_peers_start(comm):
    """iallreduce(op="none") returns at once and the request progresses (its
    sum runs in a thread of its own, never holding the engine lock): rank 0
    starts two requests, none then 2bit, then tells the last rank, which
    starts its own only on that word."""
    if comm.size < 2:
        pytest.skip("needs a peer that starts later")
    last = comm.size - 1
    x, y = grads(comm.rank, 50000), grads(comm.rank, 5000, seed=1)
    want_x = mpigc.allreduce(x.copy(), "none")
    want_y = mpigc.allreduce(y.copy(), "2bit", key="y", feedback=mpigc.ErrorFeedback())
    why = None
    fb = mpigc.ErrorFeedback()
    if comm.rank != last:
        rx = mpigc.iallreduce(x, "none")
        ry = mpigc.iallreduce(y, "2bit", key="y", feedback=fb)
        if comm.rank == 0:
            comm.send("started", dest=last, tag=78)
    else:
        token, got = await_word(comm, 0, 78)
        if not got:
            why = "rank 0 did not return from its iallreduce calls before this rank started"
        rx = mpigc.iallreduce(x, "none")
        ry = mpigc.iallreduce(y, "2bit", key="y", feedback=fb)
        if not got:
            token.wait()
    ry.wait()
    rx.wait()
    if why is None and (x.tobytes() != want_x.tobytes() or y.tobytes() != want_y.tobytes()):
        why = "results differ from the blocking calls"
    assert_all(why is None, why)


@pytest.mark.mpi
def test_reduction_thread_ends_when_idle(comm, monkeypatch):
    """The thread that runs nonblocking op="none" sums ends once idle (a
    communicator no longer used keeps no thread) and the next call starts
    another; the sums keep the bits of the blocking call."""
    import threading
    import time

    from mpi4py import MPI
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        pytest.skip("no MPI_THREAD_MULTIPLE: no reduction thread")
    monkeypatch.setenv("MPIGC_REDUCE_IDLE_S", "0.5")
    c = comm.Dup()
    x = grads(comm.rank, 200000, np.float64)  # 2 ranks: > 1 MiB, not with the rows
    want = mpigc.allreduce(x.copy(), "none", comm=c)
    why = None
    for i in range(2):
        req = mpigc.iallreduce(x.copy(), "none", comm=c)
        got = req.wait()
        ran = mpigc.diagnostics.threads(c)["reduce"]  # still there: idle for < 0.5 s
        if got.tobytes() != want.tobytes():
            why = why or f"call {i}: differs from the blocking call"
        if not ran or req.trace.sum_pieces != 1:
            why = why or f"call {i}: not summed by a reduction thread ({req.trace})"
        deadline = time.monotonic() + 3  # the default idle time, 5 s, fails
        while mpigc.diagnostics.threads(c)["reduce"] and time.monotonic() < deadline:
            time.sleep(0.02)
        if mpigc.diagnostics.threads(c)["reduce"]:
            why = why or f"call {i}: the reduction thread did not end when idle"
    c.Free()
    assert_all(why is None, why)
    assert_all(not any(t.name == "mpigc-reduce" and not t.daemon
                       for t in threading.enumerate()), "a reduction thread is not a daemon")
