"""Bad input on any rank: a clear error on every rank, nothing changed."""
import numpy as np
import pytest

import mpigc

from conftest import assert_all, grads, raises_everywhere

# ranks: flat calls only: 2 pairs, 3 a faulty rank that is neither first nor last; 4 adds nothing
pytestmark = pytest.mark.ranks(1, 2, 3)


def _warm(comm, fb, key="w", n=1000, op="2bit"):
    """One good call, so the key has residuals; returns (buf, state)."""
    mpigc.allreduce(grads(comm.rank, n), op=op, key=key, feedback=fb)
    return fb.state_dict()


def _unchanged(before, fb):
    after = fb.state_dict()
    if before.keys() != after.keys():
        return False
    for k in before:
        for part in ("worker", "owner"):
            a, b = before[k][part], after[k][part]
            if (a is None) != (b is None) or (a is not None and a.tobytes() != b.tobytes()):
                return False
        if before[k]["calls"] != after[k]["calls"]:
            return False
    return True


def _on(rank, comm):
    return comm.rank == rank % comm.size


CASES = {
    # name: (exception, function of (comm, good buffer) -> bad argument set)
    "readonly": (mpigc.InvalidBufferError, ValueError),
    "int_dtype": (mpigc.DTypeError, TypeError),
    "not_array": (mpigc.DTypeError, TypeError),
    "empty": (mpigc.InvalidBufferError, ValueError),
    "noncontiguous": (mpigc.InvalidBufferError, ValueError),
    "bad_threshold": (mpigc.ConfigError, ValueError),
    "unknown_op": (mpigc.ConfigError, ValueError),
    "bad_gather": (mpigc.ConfigError, ValueError),
    "bad_block": (mpigc.ConfigError, ValueError),
}


def _bad_call(case, comm, fb):
    x = grads(comm.rank, 1000)
    kw = dict(op="2bit", key="w", feedback=fb)
    if _on(1, comm):
        if case == "readonly":
            x.flags.writeable = False
        elif case == "int_dtype":
            x = x.astype(np.int32)
        elif case == "not_array":
            x = x.tolist()
        elif case == "empty":
            x = x[:0]
        elif case == "noncontiguous":
            x = np.repeat(x, 2)[::2]
        elif case == "bad_threshold":
            kw["threshold"] = -1.0
        elif case == "unknown_op":
            kw["op"] = "3bit"
        elif case == "bad_gather":
            kw["gather"] = "lossless"
        elif case == "bad_block":
            kw.update(op="1bit", block_size=12)
    return lambda: mpigc.allreduce(x, **kw)


@pytest.mark.mpi
@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_on_one_rank_raises_everywhere(comm, fb, case):
    before = _warm(comm, fb)
    cls, builtin = CASES[case]
    err = raises_everywhere(cls, _bad_call(case, comm, fb))
    assert_all(isinstance(err, builtin) and f"rank {1 % comm.size}" in str(err), str(err))
    assert_all(_unchanged(before, fb), "residuals changed")
    # and the communicator still works afterwards
    y = mpigc.allreduce(np.ones(8, np.float32), op="none")
    assert_all(np.all(y == comm.size))


@pytest.mark.mpi
@pytest.mark.parametrize("what", ["size", "dtype", "threshold", "op", "key", "average",
                                  "gather"])
def test_mismatch_between_ranks(comm, fb, what):
    if comm.size == 1:
        pytest.skip("needs two ranks to disagree")
    before = _warm(comm, fb)
    n, dtype = 1000, np.float32
    kw = dict(op="2bit", key="w", feedback=fb)
    if _on(1, comm):
        if what == "size":
            n = 1001
        elif what == "dtype":
            dtype = np.float64
        elif what == "threshold":
            kw["threshold"] = 0.25
        elif what == "op":
            kw["op"] = "1bit"
        elif what == "key":
            kw["key"] = "other"
        elif what == "average":
            kw["average"] = True
        elif what == "gather":
            kw["gather"] = "exact"
    x = grads(comm.rank, n, dtype)
    x0 = x.copy()
    err = raises_everywhere(mpigc.MismatchError, lambda: mpigc.allreduce(x, **kw))
    assert_all("disagree" in str(err), str(err))
    assert_all(_unchanged(before, fb) and x.tobytes() == x0.tobytes(), "state changed")


@pytest.mark.mpi
@pytest.mark.parametrize("op", ["none", "fp16", "bf16", "2bit", "1bit", "terngrad"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_raises_everywhere_and_changes_nothing(comm, fb, op, bad):
    before = _warm(comm, fb, op=op)
    x = grads(comm.rank, 1000)
    if _on(comm.size - 1, comm):
        x[17] = bad
    x0 = x.copy()
    err = raises_everywhere(mpigc.NonFiniteError,
                            lambda: mpigc.allreduce(x, op=op, key="w", feedback=fb))
    assert_all(isinstance(err, FloatingPointError) and f"rank {comm.size - 1}" in str(err))
    assert_all(_unchanged(before, fb), "residuals changed")
    assert_all(x.tobytes() == x0.tobytes(), "buffer changed")


@pytest.mark.mpi
@pytest.mark.parametrize("op", ["none", "2bit", "terngrad"])
def test_nonfinite_skip_fills_nan_and_keeps_residuals(comm, fb, op):
    before = _warm(comm, fb, op=op)
    x = grads(comm.rank, 1000)
    if _on(0, comm):
        x[3] = np.nan
    y = mpigc.allreduce(x, op=op, key="w", feedback=fb, nonfinite="skip")
    expect_skips = 0 if op == "none" else 1
    assert_all(np.all(np.isnan(y)) and fb.skipped_steps == expect_skips)
    assert_all(_unchanged(before, fb), "residuals changed")
    rs = mpigc.reduce_scatter(x, op=op, key="w", feedback=fb, nonfinite="skip")
    assert_all(np.all(np.isnan(rs)))


@pytest.mark.mpi
def test_nonfinite_policy_from_environment(comm, fb, monkeypatch):
    monkeypatch.setenv("MPIGC_NONFINITE", "skip")
    x = grads(comm.rank, 100)
    x[0] = np.inf
    y = mpigc.allreduce(x, op="2bit", key="env", feedback=fb)
    assert_all(np.all(np.isnan(y)))


@pytest.mark.mpi
def test_key_reused_with_other_size_is_a_state_error(comm, fb):
    before = _warm(comm, fb, n=1000)
    raises_everywhere(mpigc.StateError, lambda: mpigc.allreduce(
        grads(comm.rank, 500), op="2bit", key="w", feedback=fb))
    assert_all(_unchanged(before, fb))
    fb.reset("w")
    mpigc.allreduce(grads(comm.rank, 500), op="2bit", key="w", feedback=fb)
    assert_all(fb.state_dict()["w"]["n"] == 500)


@pytest.mark.mpi
def test_key_in_use_by_pending_request(comm, fb):
    x = grads(comm.rank, 1000)
    req = mpigc.iallreduce(x, op="2bit", key="p", feedback=fb)
    err = raises_everywhere(mpigc.StateError, lambda: mpigc.allreduce(
        grads(comm.rank, 1000), op="2bit", key="p", feedback=fb))
    assert_all("pending" in str(err))
    req.wait()
    assert_all(fb.state_dict()["p"]["calls"] == 1)


@pytest.mark.mpi
def test_reduce_scatter_bad_recvcounts(comm, fb):
    x = grads(comm.rank, 100)
    counts = [100] + [0] * (comm.size - 1)
    if _on(0, comm):
        counts = [1] * comm.size  # wrong sum
    raises_everywhere(mpigc.InvalidBufferError, lambda: mpigc.reduce_scatter(
        x, op="2bit", recvcounts=counts, key="rs", feedback=fb))


@pytest.mark.mpi
def test_reduce_scatter_accepts_readonly_input(comm, fb):
    x = grads(comm.rank, 100)
    x.flags.writeable = False
    mpigc.reduce_scatter(x, op="2bit", key="ro", feedback=fb)
