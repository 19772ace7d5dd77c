"""iallreduce / ireduce_scatter: several requests in flight, test() and wait()."""
import numpy as np
import pytest

import mpigc

from conftest import assert_all, grads


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
        if op == "none":  # MPI_Iallreduce may sum in another order than MPI_Allreduce
            same = [np.allclose(o, r, rtol=1e-5, atol=1e-5) for o, r in zip(outs, ref)]
        else:
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
    ra = mpigc.iallreduce(a, op=op, key="a", feedback=fb)
    if comm.rank % 2:  # odd ranks: past a's agreement (a's reduction started) before b
        while ra._op.state == "agree":
            ra.test()
    rb = mpigc.iallreduce(b, op=op, key="b", feedback=fb)
    rb.wait()
    ra.wait()
    want = comm.size if op == "none" else 0.5
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

    from mpigc import _collective
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
        # the lock keeps the progress thread out: each rank's steps in this order
        with _collective._lock:
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
