"""iallreduce / ireduce_scatter: several requests in flight, test() and wait()."""
import numpy as np
import pytest

import mpigc

from conftest import assert_all, grads


@pytest.mark.mpi
@pytest.mark.parametrize("op", ["none", "2bit", "1bit", "terngrad", "fp16"])
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
