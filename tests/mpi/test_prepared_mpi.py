"""A call is prepared once per call signature (mpigc._prepared): a repeated
call finds its record (settings, layout, what travels with the rows) and
re-binds the record's working buffers instead of deriving them again;
``$MPIGC_PLAN_CACHE=0`` prepares every call. Calls of one signature pending
together each get buffers of their own and the bits of blocking calls."""
import numpy as np
import pytest

import mpigc
from mpigc.diagnostics import counters

from conftest import assert_all, grads

# ranks: 2 the pair paths (short path, inline values), 3 uneven shards
pytestmark = pytest.mark.ranks(2, 3)

# (op, elements, kwargs): a plain sum (short path on 2 ranks), inline
# payloads, payloads after the rows, pipelined, terngrad's agreed scale, a
# reduce-scatter, float16
CASES = [("none", 1000, {}), ("2bit", 3000, {}), ("1bit", 300_000, {}),
         ("2bit", 600_000, {}), ("terngrad", 5000, {}), ("fp16", 5000, {"rs": True}),
         ("2bit", 5000, {"dtype": np.float16}), ("none", 5000, {"dtype": np.float16}),
         ({"type": "terngrad", "error_feedback": True}, 5000, {}),
         ({"type": "2bit", "threshold": 0.5}, 3000, {})]


def _call(comm, op, n, kw, key, x=None, blocking=True, feedback=None):
    if x is None:
        x = grads(comm.rank, n).astype(kw.get("dtype", np.float32))
    fn = "reduce_scatter" if kw.get("rs") else "allreduce"
    if not blocking:
        fn = "i" + fn
    return getattr(mpigc, fn)(x, op=op, key=key, comm=comm, feedback=feedback)


def _prepared(fn):
    before = counters()["plans_prepared"]
    fn()
    return counters()["plans_prepared"] - before


@pytest.mark.mpi
@pytest.mark.parametrize("op,n,kw", CASES)
def test_a_repeated_call_is_not_prepared_again(comm, op, n, kw, monkeypatch):
    """The first call of a signature prepares it, the next ones do not; with
    ``$MPIGC_PLAN_CACHE=0`` each call does, with the same results and
    residuals."""
    monkeypatch.setenv("MPIGC_CHUNK_BYTES", "262144")  # 600_000 float32 is pipelined
    key = f"prep-{op}-{n}"
    first = _prepared(lambda: _call(comm, op, n, kw, key))
    again = _prepared(lambda: [_call(comm, op, n, kw, key) for _ in range(3)])
    assert_all(first == 1 and again == 0, f"prepared {first} then {again}", comm=comm)
    # the same key in two stores (terngrad's streams follow the key)
    fbs = [mpigc.ErrorFeedback(), mpigc.ErrorFeedback()]
    cached = [_call(comm, op, n, kw, key, feedback=fbs[0]) for _ in range(3)]
    monkeypatch.setenv("MPIGC_PLAN_CACHE", "0")
    uncached = []
    each = _prepared(lambda: uncached.extend(_call(comm, op, n, kw, key, feedback=fbs[1])
                                             for _ in range(3)))
    # (at least once each: a blocking call the short path declines is
    # prepared there and again by the engine)
    assert_all(each >= 3, f"MPIGC_PLAN_CACHE=0: prepared {each} times in 3 calls",
               comm=comm)
    same = all(np.array_equal(a, b, equal_nan=True) for a, b in zip(cached, uncached))
    wc, wu = (fb.state_dict()[key]["worker"] if key in fb.state_dict() else None
              for fb in fbs)
    same_res = wc is None and wu is None or np.array_equal(wc, wu)
    assert_all(same and same_res, "a cached and an uncached call differ", comm=comm)


@pytest.mark.mpi
@pytest.mark.parametrize("op,n,kw", [("2bit", 3000, {}), ("2bit", 600_000, {}),
                                     ("fp16", 5000, {"rs": True}),
                                     ("none", 100_000, {"dtype": np.float16})])
def test_pending_calls_of_one_signature_use_buffers_of_their_own(comm, op, n, kw,
                                                                  monkeypatch):
    """Two nonblocking calls of one signature (no residuals: feedback=False
    holds no key) pending together: distinct working buffers, and each
    gives the bits of a blocking call on its input; then a third call
    re-binds a set that a completed call gave back."""
    monkeypatch.setenv("MPIGC_CHUNK_BYTES", "262144")
    dt = kw.get("dtype", np.float32)
    xs = [(grads(comm.rank + 7 * i, n) * (i + 1)).astype(dt) for i in range(2)]
    fn = mpigc.ireduce_scatter if kw.get("rs") else mpigc.iallreduce
    blocking = mpigc.reduce_scatter if kw.get("rs") else mpigc.allreduce
    want = [blocking(x.copy(), op=op, key="pend", comm=comm, feedback=False) for x in xs]
    ins = [x.copy() for x in xs]
    # rank 0 starts both calls before any peer starts its first one (the
    # barrier), so that neither can complete there before the second starts
    # (elsewhere the progress thread may complete the first one first)
    if comm.rank:
        comm.Barrier()
    reqs, sets = [], []
    for x in ins:
        reqs.append(fn(x, op=op, key="pend", comm=comm, feedback=False))
        sets.append(reqs[-1]._op.bufs)
    if not comm.rank:
        comm.Barrier()
    got = [r.wait() for r in reqs]
    distinct = True
    if not comm.rank:
        arrays = [{id(a) for a in s.arrays.values()} for s in sets]
        distinct = sets[0] is not sets[1] and arrays[0] and not arrays[0] & arrays[1]
    same = all(np.array_equal(a, b, equal_nan=True) for a, b in zip(got, want))
    r3 = fn(xs[0].copy(), op=op, key="pend", comm=comm, feedback=False)
    rebound = comm.rank or r3._op.bufs in sets
    r3.wait()
    assert_all(distinct, "pending calls of one signature share buffers", comm=comm)
    assert_all(same, "pending calls differ from blocking ones", comm=comm)
    assert_all(rebound, "a later call did not re-bind a completed call's buffers", comm=comm)


@pytest.mark.mpi
def test_a_failed_call_gives_no_buffers_back(comm):
    """A call that fails on one rank (another size there) fails on every
    rank; its buffers are not given back (an MPI operation may still write
    them), and the next good call of the signature works."""
    n = 3000
    good = grads(comm.rank, n)
    _call(comm, "2bit", n, {}, "fail", x=good.copy())
    x = grads(comm.rank, n + (comm.rank == comm.size - 1))
    req = mpigc.iallreduce(x, op="2bit", key="fail", comm=comm)
    bufs = req._op.bufs
    try:
        req.wait()
        raised = False
    except mpigc.MpigcError:
        raised = True
    assert_all(raised, "a mismatched call did not raise", comm=comm)
    nxt = mpigc.iallreduce(good.copy(), op="2bit", key="fail", comm=comm)
    reused = nxt._op.bufs is bufs and bufs is not None
    nxt.wait()
    assert_all(not reused, "a failed call's buffers were re-bound", comm=comm)



@pytest.mark.mpi
@pytest.mark.parametrize("op,n,kw", [("2bit", 3000, {}), ("2bit", 600_000, {}),
                                     ("fp16", 5000, {"rs": True})])
def test_keys_of_one_geometry_share_one_buffer_set(comm, op, n, kw, monkeypatch):
    """Calls on several keys of one size, one after the other (a model's
    layers), re-bind one set of working buffers: the working memory does not
    grow with the number of keys (with a set per key it did: 3 keys of 4 MiB
    held 13.5 MiB more, docs/error-feedback.md), and each key's results and
    residuals are those of a store that saw only that key."""
    monkeypatch.setenv("MPIGC_CHUNK_BYTES", "262144")
    fb, alone = mpigc.ErrorFeedback(), mpigc.ErrorFeedback()
    sets, same = [], True
    for i in range(3):
        x = grads(comm.rank + 5 * i, n)
        fn = mpigc.ireduce_scatter if kw.get("rs") else mpigc.iallreduce
        req = fn(x.copy(), op=op, key=f"layer{i}", comm=comm, feedback=fb)
        sets.append(req._op.bufs)
        got = req.wait()
        want = _call(comm, op, n, kw, f"layer{i}", x=x.copy(), feedback=alone)
        same = same and np.array_equal(got, want, equal_nan=True)
    shared = sets[0] is not None and sets[1] is sets[0] and sets[2] is sets[0]
    states = {k: (v["worker"], v["owner"]) for k, v in fb.state_dict().items()}
    twins = {k: (v["worker"], v["owner"]) for k, v in alone.state_dict().items()}
    same = same and states.keys() == twins.keys() and all(
        all((a is None and b is None) or np.array_equal(a, b) for a, b in zip(states[k], twins[k]))
        for k in states)
    assert_all(shared, "calls on keys of one size did not re-bind one buffer set", comm=comm)
    assert_all(same, "results or residuals differ from a store of one key each", comm=comm)


@pytest.mark.mpi
def test_a_dict_op_is_keyed_by_its_items(comm):
    """A dict op of plain values is prepared once (its items are the key); a
    dict changed between calls is another signature, with the settings of
    its new items; a dict holding something other than a plain scalar is
    prepared on every call."""
    op = {"type": "2bit", "threshold": 0.5}
    x = grads(comm.rank, 3000)
    first = _prepared(lambda: mpigc.allreduce(x, op=op, key="dict-op", comm=comm))
    again = _prepared(lambda: mpigc.allreduce(x, op=dict(op), key="dict-op", comm=comm))
    op["threshold"] = 2.0  # changed in place: a new signature, and its values count
    fb = mpigc.ErrorFeedback()  # (the key's residuals there are of threshold 0.5)
    res = []
    changed = _prepared(lambda: res.append(mpigc.allreduce(x, op=op, key="dict-op",
                                                           comm=comm, feedback=fb)))
    levels = np.unique(np.abs(res[0]))
    odd = {"type": "2bit", "threshold": np.float32(0.5)}  # a numpy scalar: not plain
    each = _prepared(lambda: [mpigc.allreduce(x, op=odd, key="dict-op4", comm=comm)
                              for _ in range(2)])
    # (each >= 2: the short path, declining a call, prepares it too)
    assert_all(first == 1 and again == 0 and changed == 1 and each >= 2,
               f"prepared {first}, {again}, {changed}, {each}", comm=comm)
    # threshold 2.0: every decoded value is a sum of 0 or +-2.0 per rank
    assert_all(np.all(np.isin(levels, 2.0 * np.arange(comm.size + 1))),
               f"threshold 2.0 gave levels {levels}", comm=comm)
