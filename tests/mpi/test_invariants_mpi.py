"""The invariants of ALGORITHMS.md: conservation and convergence."""
import numpy as np
import pytest
from mpi4py import MPI

import mpigc

from conftest import assert_all, grads

# ranks: flat calls only: 2 even, 3 uneven shards; 4 adds nothing
pytestmark = pytest.mark.ranks(1, 2, 3)


def _owner_total(fb, key, comm, n):
    """The owner residuals of all ranks, concatenated in shard order."""
    st = fb.state_dict()[key]
    lo, hi = mpigc.shard_bounds(n, comm.size)[comm.rank]
    mine = st["owner"] if st["owner"] is not None else np.zeros(hi - lo)
    return np.concatenate(comm.allgather(mine))


@pytest.mark.mpi
@pytest.mark.parametrize("op", ["2bit", "1bit", {"type": "terngrad", "error_feedback": True},
                                {"type": "fp16", "error_feedback": True},
                                {"type": "bf16", "error_feedback": True},
                                {"type": "2bit", "rel_threshold": 1.5, "block_size": 64}],
                         ids=["2bit", "1bit", "terngrad-ef", "fp16-ef", "bf16-ef", "2bit-rel"])
@pytest.mark.parametrize("average", [False, True])
def test_conservation(comm, fb, op, average):
    """sum of inputs == sum of delivered results + worker + owner residuals."""
    n, N, steps = 777, comm.size, 20
    put_in = np.zeros(n)
    delivered = np.zeros(n)
    for s in range(steps):
        g = grads(comm.rank, n, np.float64, seed=s, scale=0.3)
        total = np.empty(n)
        comm.Allreduce(g, total, op=MPI.SUM)
        put_in += total / N if average else total
        delivered += mpigc.allreduce(g, op=op, key="c", feedback=fb, average=average)
    worker = np.empty(n)
    comm.Allreduce(fb.state_dict()["c"]["worker"], worker, op=MPI.SUM)
    if average:
        worker /= N
    still = worker + _owner_total(fb, "c", comm, n)
    err = np.max(np.abs(put_in - (delivered + still)))
    assert_all(err < 1e-9 * steps * N, f"conservation error {err}")


@pytest.mark.mpi
@pytest.mark.parametrize("gather", ["compressed", "exact"])
def test_conservation_exact_gather_has_no_owner_residual(comm, fb, gather):
    n = 100
    for s in range(5):
        mpigc.allreduce(grads(comm.rank, n, np.float64, seed=s), op="2bit", key="e",
                        feedback=fb, gather=gather)
    st = fb.state_dict()["e"]
    lo, hi = mpigc.shard_bounds(n, comm.size)[comm.rank]
    has_owner = st["owner"] is not None
    assert_all(has_owner == (gather == "compressed" and hi > lo))


@pytest.mark.mpi
@pytest.mark.parametrize("op", ["2bit", "1bit"])
def test_constant_gradient_converges_at_rate_t_over_steps(comm, fb, op):
    """With a constant gradient the mean delivered value approaches the true
    mean. For 2bit the error times the number of steps stays below 2t (all
    residuals lie in (-t, t)): the O(t/steps) rate. 1bit's residuals are
    bounded too, by a constant that depends on the block, so its error must
    at least keep shrinking."""
    n, t = 200, 0.5
    g = grads(comm.rank, n, np.float64, seed=99, scale=0.15)
    g = np.clip(g, -0.9 * t, 0.9 * t)
    true = np.empty(n)
    comm.Allreduce(g, true, op=MPI.SUM)
    true /= comm.size
    delivered = np.zeros(n)
    scaled_err = []
    kw = {"threshold": t} if op == "2bit" else {}  # 2bit: the absolute mode's bound
    for s in range(1, 401):
        delivered += mpigc.allreduce(g.copy(), op=op, key="k", feedback=fb, average=True,
                                     **kw)
        if s in (50, 100, 200, 400):
            scaled_err.append(np.max(np.abs(delivered / s - true)) * s)
    if op == "2bit":
        assert_all(max(scaled_err) < 2 * t, f"error*steps {scaled_err}")
    else:
        errs = [e / s for e, s in zip(scaled_err, (50, 100, 200, 400))]
        assert_all(errs[-1] < errs[0] / 2 and errs[-1] < 0.05, f"errors {errs}")


@pytest.mark.mpi
def test_2bit_worker_residual_stays_below_threshold(comm, fb):
    t = 0.5
    for s in range(20):
        g = np.clip(grads(comm.rank, 500, seed=s), -t, t)
        mpigc.allreduce(g, op="2bit", key="b", feedback=fb, threshold=t, average=True)
        st = fb.state_dict()["b"]
        ok = np.all(np.abs(st["worker"]) < t)
        if st["owner"] is not None:
            ok = ok and np.all(np.abs(st["owner"]) < t)
        assert_all(ok, f"step {s}")


@pytest.mark.mpi
def test_terngrad_is_unbiased_without_feedback(comm):
    """Averaged over many calls, terngrad's result approaches the exact sum."""
    n = 64
    g = grads(comm.rank, n, np.float64, seed=5)
    exact = np.empty(n)
    comm.Allreduce(g, exact, op=MPI.SUM)
    fb = mpigc.ErrorFeedback()
    acc = np.zeros(n)
    calls = 300
    for _ in range(calls):
        acc += mpigc.allreduce(g.copy(), op="terngrad", key="u", feedback=fb, gather="exact")
    scale = comm.allreduce(np.max(np.abs(g)), op=MPI.MAX)
    # each element is a sum of N Bernoulli-scaled terms: std <= scale*sqrt(N/calls)
    tol = 6 * scale * np.sqrt(comm.size / calls)
    assert_all(np.max(np.abs(acc / calls - exact)) < tol)
