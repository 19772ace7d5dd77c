"""ErrorFeedback.state_dict() while nonblocking calls are pending (issue 32):
as docs/user-guide.md and docs/error-feedback.md promise, it raises
StateError while a call on an existing key of the store is pending, and a
pending first call on a new key is simply not in the state yet. Run as

    mpirun -n K python -m pytest --with-mpi -q tests/mpi/test_feedback_state_mpi.py
"""
import time

import pytest

import mpigc

from conftest import assert_all, grads

# ranks: flat calls only: 2 pairs, 3 uneven shards; 4 adds nothing
pytestmark = pytest.mark.ranks(1, 2, 3)

N = 1001


def _pending_on_rank0(comm, start, check):
    """Start a call with ``start()`` on every rank, the last rank only once
    rank 0 has run ``check()`` (so rank 0's call is still pending then: it
    cannot complete before its last peer starts). Returns ``check()``'s
    result on rank 0 (None elsewhere) and the request's result."""
    last = comm.size - 1
    why = None
    if comm.rank != last or comm.size == 1:
        req = start()
        if comm.rank == 0:
            why = check(req)
            if comm.size > 1:
                comm.send("checked", dest=last, tag=78)
    else:
        token = comm.irecv(source=0, tag=78)
        while not token.test()[0]:
            time.sleep(0.01)
        req = start()
    return why, req.wait()


def _same(a, b):
    return all((a[p] is None) == (b[p] is None) and
               (a[p] is None or a[p].tobytes() == b[p].tobytes())
               for p in ("worker", "owner")) and a["calls"] == b["calls"]


@pytest.mark.mpi
def test_state_dict_leaves_out_a_pending_first_call(comm, fb):
    """A new key's first call is pending: state_dict() succeeds and holds the
    other keys, unchanged; once the call is done, the key is in the state."""
    mpigc.allreduce(grads(comm.rank, N), "2bit", key="old", feedback=fb)
    before = fb.state_dict()

    def check(req):
        try:
            st = fb.state_dict()
        except mpigc.StateError as exc:
            return f"state_dict() raised during a new key's pending first call: {exc}"
        if "new" in st and not req.done:
            return "the pending first call's key is in the state"
        if sorted(k for k in st if k != "new") != ["old"] or not _same(st["old"],
                                                                       before["old"]):
            return f"state {sorted(st)} does not hold 'old' as it was"
        return None

    why, _ = _pending_on_rank0(comm, lambda: mpigc.iallreduce(
        grads(comm.rank, N, seed=1), "2bit", key="new", feedback=fb), check)
    if why is None:
        st = fb.state_dict()
        if sorted(st) != ["new", "old"] or st["new"]["calls"] != 1:
            why = f"after the call: keys {sorted(st)}"
    assert_all(why is None, why, comm)


@pytest.mark.mpi
def test_state_dict_refuses_a_pending_call_on_an_existing_key(comm, fb):
    """A call on an existing key is pending: its residuals are being
    replaced, so state_dict() raises StateError (the state never holds a
    half-updated residual), and succeeds again once the call is done."""
    mpigc.allreduce(grads(comm.rank, N), "2bit", key="old", feedback=fb)
    mpigc.allreduce(grads(comm.rank, N), "1bit", key="other", feedback=fb)

    def check(req):
        if req.done:
            return None  # nothing pending to test (cannot happen on rank 0 of 2+)
        try:
            fb.state_dict()
        except mpigc.StateError as exc:
            return None if "'old'" in str(exc) else f"unexpected message: {exc}"
        return "state_dict() did not raise during a pending call on an existing key"

    why, _ = _pending_on_rank0(comm, lambda: mpigc.iallreduce(
        grads(comm.rank, N, seed=1), "2bit", key="old", feedback=fb), check)
    if why is None:
        st = fb.state_dict()
        if st["old"]["calls"] != 2 or st["other"]["calls"] != 1:
            why = f"after the call: calls {st['old']['calls']}, {st['other']['calls']}"
    assert_all(why is None, why, comm)
