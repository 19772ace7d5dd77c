"""Hierarchical collectives (hierarchy=) against the independent reference.

Nodes are emulated with ``MPIGC_NODE_SPLIT=2`` (ranks 0-1 form node 0, 2-3
node 1, ...): 4 ranks are 2 nodes of 2, 3 ranks are 2 + 1 (uneven), 1 and 2
ranks a single node. ``tests/support/reference.py``'s :class:`Hierarchical` rebuilds
every rank's inputs and the whole algorithm in numpy; results and residuals
must match bit for bit. The real emulated cluster (network namespaces) is
exercised by ``tests/cluster_test.sh``.
"""
import os
import sys

import numpy as np
import pytest
from mpi4py import MPI

import mpigc
from mpigc import _hierarchy

from conftest import assert_all, grads, raises_everywhere
from peers import await_word

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from support import reference  # noqa: E402  (tests/support/reference.py)

# ranks: nodes of 2: 1 and 2 one node, 3 nodes of 2 + 1, 4 nodes of 2 (and 4-only tests)
pytestmark = pytest.mark.ranks(1, 2, 3, 4)

SPLIT = 2
OPS = ["2bit", "1bit", {"type": "2bit", "threshold": 0.25},
       {"type": "1bit", "block_size": 16}, {"type": "2bit", "rel_threshold": 1.5},
       {"type": "fp16", "error_feedback": True}]


def _id(op):
    return op if isinstance(op, str) else "-".join(f"{v}" for v in op.values())


@pytest.fixture
def split(monkeypatch):
    monkeypatch.setenv("MPIGC_NODE_SPLIT", str(SPLIT))
    return SPLIT


def _nodes(W, k=SPLIT):
    return [list(range(a, min(a + k, W))) for a in range(0, W, k)]


def _ref(op, n, dtype, gather="compressed", comm=MPI.COMM_WORLD):
    comp = mpigc.get_compressor(op)
    return reference.Hierarchical(comp.get_config(), _nodes(comm.size), n, dtype,
                                  ef=comp.uses_feedback, gather=gather)


def _slice_states(fb, key):
    """This rank's hierarchical residuals of ``key``: {slice: state}."""
    out = {}
    for k, st in fb.state_dict().items():
        p = _hierarchy.parse_slice_key(k)
        if p is not None and p[0] == key:
            out[p[1]] = st
    return out


def _check_residuals(fb, sim, rank, key="k"):
    """This rank's residuals equal the reference's (None: they do)."""
    if sim.E is None:
        return None
    lay = _hierarchy.layout(MPI.COMM_WORLD)
    states = _slice_states(fb, key)
    # slices without elements (n < L) hold no residuals
    mine = [s for s in lay.slices_of(rank) if sim.slices[s][1] > sim.slices[s][0]]
    if sorted(states) != mine:
        return f"slices {sorted(states)}, expected {mine}"
    m = lay.node_of[rank]
    for s in mine:
        st = states[s]
        if st["worker"].tobytes() != sim.E[s][m].tobytes():
            return f"worker residual of slice {s} differs"
        own = st["owner"] if st["owner"] is not None else np.zeros(0, sim.wd)
        if own.size and own.tobytes() != sim.O[s][m].tobytes():
            return f"owner residual of slice {s} differs"
    return None


@pytest.mark.mpi
@pytest.mark.parametrize("op", OPS, ids=_id)
@pytest.mark.parametrize("gather", ["compressed", "exact"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_allreduce_matches_reference(comm, fb, split, op, gather, dtype):
    n = 1003
    sim = _ref(op, n, dtype, gather)
    why = None
    for step in range(3):
        xs = [grads(q, n, dtype, seed=step) for q in range(comm.size)]
        want = sim.allreduce(xs)
        got = mpigc.allreduce(xs[comm.rank].copy(), op=op, key="k", feedback=fb,
                              gather=gather, hierarchy="node")
        if got.dtype != np.dtype(dtype) or got.tobytes() != want.tobytes():
            why = f"step {step}: max diff {np.max(np.abs(got.astype(float) - want))}"
            break
    if why is None and gather == "compressed":
        why = _check_residuals(fb, sim, comm.rank)
    assert_all(why is None, why, comm)


@pytest.mark.mpi
@pytest.mark.parametrize("op", ["2bit", "1bit"])
def test_average_and_tiny_sizes(comm, fb, split, op):
    why = None
    for n in (1, 2, 5, 7, 64):
        sim = _ref(op, n, np.float32)
        for step in range(2):
            xs = [grads(q, n, seed=step) for q in range(comm.size)]
            want = sim.allreduce(xs, average=True)
            got = mpigc.allreduce(xs[comm.rank].copy(), op=op, key=f"t{n}", feedback=fb,
                                  average=True, hierarchy="node")
            if got.tobytes() != want.tobytes():
                why = f"n={n} step {step}: max diff {np.max(np.abs(got - want))}"
        if why is None:
            why = _check_residuals(fb, sim, comm.rank, key=f"t{n}")
    assert_all(why is None, why, comm)


@pytest.mark.mpi
@pytest.mark.parametrize("op", ["2bit", "1bit"])
@pytest.mark.parametrize("counts", [False, True])
def test_reduce_scatter_matches_reference(comm, fb, split, op, counts):
    n, N = 1001, comm.size
    sim = _ref(op, n, np.float32)
    if counts:  # uneven, one rank empty
        recv = [0] + [n // (N - 1) + (1 if j < n % (N - 1) else 0) for j in range(N - 1)] \
            if N > 1 else [n]
    else:
        recv = None
    bounds = mpigc.shard_bounds(n, N) if recv is None else \
        list(zip(np.cumsum([0] + recv[:-1]).tolist(), np.cumsum(recv).tolist()))
    why = None
    for step in range(3):
        xs = [grads(q, n, seed=step) for q in range(N)]
        want = sim.reduce_scatter(xs)
        lo, hi = bounds[comm.rank]
        got = mpigc.reduce_scatter(xs[comm.rank], op=op, key="k", feedback=fb,
                                   recvcounts=recv, hierarchy="node")
        if got.shape != (hi - lo,) or got.tobytes() != want[lo:hi].tobytes():
            why = f"step {step}: got {got.shape}, expected {(hi - lo,)} or values differ"
            break
    if why is None:
        sim.O = None  # reduce_scatter has no owner stage
        why = _check_residuals(fb, sim, comm.rank) if sim.E is not None else None
    assert_all(why is None, why, comm)


@pytest.mark.mpi
def test_nonblocking_equals_blocking(comm, split):
    n = 777
    fb1, fb2 = mpigc.ErrorFeedback(), mpigc.ErrorFeedback()
    why = None
    for step in range(2):
        g = grads(comm.rank, n, seed=step)
        a = mpigc.allreduce(g.copy(), "2bit", key="k", feedback=fb1, hierarchy="node")
        req = mpigc.iallreduce(g.copy(), "2bit", key="k", feedback=fb2, hierarchy="node")
        b = req.wait()
        if a.tobytes() != b.tobytes():
            why = f"step {step}: iallreduce differs from allreduce"
    assert_all(why is None, why, comm)


@pytest.mark.mpi
def test_nonblocking_call_returns_before_peers_start(comm, fb, split):
    """iallreduce(hierarchy="node") returns at once: rank 0 starts its call, then
    tells the last rank, which starts its own only on that word (a call that
    waited for its peers in iallreduce would never send it). While the call is
    pending, its residual store refuses to hand out its state (StateError)."""
    n = 3000
    last = comm.size - 1
    g = grads(comm.rank, n)
    want = mpigc.allreduce(g.copy(), "2bit", key="k", feedback=mpigc.ErrorFeedback(),
                           hierarchy="node")
    why = None
    if comm.rank != last or comm.size == 1:
        req = mpigc.iallreduce(g.copy(), "2bit", key="k", feedback=fb, hierarchy="node")
        if comm.rank == 0 and comm.size > 1:
            try:
                fb.state_dict()
                why = "state_dict() of a store with a pending hierarchical call"
            except mpigc.StateError:
                pass
            comm.send("started", dest=last, tag=77)
    else:
        token, got = await_word(comm, 0, 77)
        if not got:
            why = "rank 0 did not return from iallreduce before this rank started"
        req = mpigc.iallreduce(g.copy(), "2bit", key="k", feedback=fb, hierarchy="node")
        if not got:
            token.wait()
    res = req.wait()
    if why is None and res.tobytes() != want.tobytes():
        why = "iallreduce differs from allreduce"
    assert_all(why is None, why, comm)


@pytest.mark.mpi
def test_many_pending_calls_any_wait_order(comm, split):
    """Hierarchical and flat calls in flight together, allreduce and
    reduce_scatter, waited for in reverse order: the same bits and residuals
    as the same calls made blocking one after the other. On a fresh
    communicator, with the nonblocking calls first, so that the node window
    grows at the starts of calls whose predecessors are still pending."""
    c = comm.Dup()  # a layout of its own: its node window starts empty
    calls = [("allreduce", 500, "2bit", "node"), ("allreduce", 700, "1bit", "flat"),
             ("reduce_scatter", 900, "2bit", "node"), ("allreduce", 5000, "2bit", "node"),
             ("allreduce", 20000, "1bit", "node"), ("reduce_scatter", 64, "none", "node"),
             ("allreduce", 300, "fp16", "node")]
    fb1, fb2 = mpigc.ErrorFeedback(), mpigc.ErrorFeedback()
    why = None
    if _hierarchy.layout(c).window_bytes() != 0:
        why = "the fresh layout's window is not empty"
    for step in range(2):
        xs = [grads(c.rank, n, seed=100 * step + i) for i, (_, n, _, _) in enumerate(calls)]
        reqs = []
        for i, ((kind, n, op, h), x) in enumerate(zip(calls, xs)):
            f = getattr(mpigc, "i" + kind)
            reqs.append(f(x.copy(), op, comm=c, key=f"c{i}", feedback=fb2, hierarchy=h))
        got = [None] * len(reqs)
        for i in reversed(range(len(reqs))):
            got[i] = reqs[i].wait()
        want = []
        for i, ((kind, n, op, h), x) in enumerate(zip(calls, xs)):
            f = getattr(mpigc, kind)
            want.append(f(x.copy(), op, comm=c, key=f"c{i}", feedback=fb1, hierarchy=h))
        for i, (a, b) in enumerate(zip(want, got)):
            if a.tobytes() != b.tobytes():
                why = why or f"step {step}, call {i} {calls[i]}: differs from blocking"
    s1, s2 = fb1.state_dict(), fb2.state_dict()
    if set(s1) != set(s2):
        why = why or f"residual keys differ: {sorted(s1)} vs {sorted(s2)}"
    for k in s1:
        for part in ("worker", "owner"):
            a, b = s1[k][part], s2.get(k, {}).get(part)
            if (a is None) != (b is None) or (a is not None and a.tobytes() != b.tobytes()):
                why = why or f"residual {k} {part} differs"
    assert_all(why is None, why, comm)


def _deadline(seconds=120):
    """A hang kills this rank (traceback on stderr) instead of the suite."""
    import faulthandler
    faulthandler.dump_traceback_later(seconds, exit=True)
    return faulthandler.cancel_dump_traceback_later


@pytest.mark.mpi
def test_window_growth_behind_a_pending_flat_call(comm, split, monkeypatch):
    """A nonblocking hierarchical call that grows the node window while a
    pipelined flat call is pending before it, and earlier hierarchical calls
    too: the growth must not run the call past its start (review of issue
    16: begin() finished the earlier calls through the whole queue, which
    stepped the new call through its growth; begin then ran all of it with
    waits that advanced nothing else, while the peers had returned and
    waited in the flat call: a hang within 3 iterations, every run at 3 and
    4 ranks). Results as the same calls made blocking."""
    monkeypatch.setenv("MPIGC_CHUNK_BYTES", "4096")
    cancel = _deadline()
    why = None
    try:
        for it in range(20):
            c = comm.Dup()  # a layout of its own: its window starts empty
            xs = [grads(c.rank, n, seed=10 * it + i) for i, n in enumerate((1, 70000, 1, 2))]
            plan = [("iallreduce", "a", "node"), ("ireduce_scatter", "f", "flat"),
                    ("iallreduce", "b", "node"), ("ireduce_scatter", "c", "node")]
            fb1, fb2 = mpigc.ErrorFeedback(), mpigc.ErrorFeedback()
            reqs = [getattr(mpigc, f)(x.copy(), "2bit", comm=c, key=k, feedback=fb2,
                                      hierarchy=h) for (f, k, h), x in zip(plan, xs)]
            got = [None] * 4
            for i in (2, 1, 3, 0):
                got[i] = reqs[i].wait()
            for i, ((f, k, h), x) in enumerate(zip(plan, xs)):
                want = getattr(mpigc, f[1:])(x.copy(), "2bit", comm=c, key=k, feedback=fb1,
                                             hierarchy=h)
                if want.tobytes() != got[i].tobytes():
                    why = why or f"iteration {it}, call {i}: differs from blocking"
            c.Free()
    finally:
        cancel()
    assert_all(why is None, why, comm)


@pytest.mark.mpi
def test_growing_blocking_call_advances_a_pending_request(comm, split):
    """Every rank starts a flat iallreduce, then a blocking hierarchical call
    that grows the window; rank 0 waits for the flat request before it makes
    that call (completing requests in another order on each rank is allowed).
    The growing call must keep the flat request going while it waits for its
    peers' rows (review of issue 16: it tested only its own request, and
    hung)."""
    cancel = _deadline()
    try:
        c = comm.Dup()
        mpigc.allreduce(np.ones(10, np.float32), "2bit", comm=c, key="w",
                        feedback=mpigc.ErrorFeedback(), hierarchy="node")  # a small window
        big = grads(c.rank, 1 << 20).astype(np.float32)
        small = np.ones(1000, np.float32)
        fb = mpigc.ErrorFeedback()
        req = mpigc.iallreduce(big.copy(), "2bit", comm=c, key="f", feedback=fb)
        if c.rank == 0:
            res = req.wait()
            out = mpigc.allreduce(small.copy(), "2bit", comm=c, key="h", feedback=fb,
                                  hierarchy="node")
        else:
            out = mpigc.allreduce(small.copy(), "2bit", comm=c, key="h", feedback=fb,
                                  hierarchy="node")
            res = req.wait()
        want = mpigc.allreduce(big.copy(), "2bit", comm=c, key="f",
                               feedback=mpigc.ErrorFeedback())
        ok = res.tobytes() == want.tobytes() and bool(np.all(np.isfinite(out)))
        c.Free()
    finally:
        cancel()
    assert_all(ok, "results differ", comm)


@pytest.mark.mpi
def test_auto_decides_by_layout(comm, fb, monkeypatch):
    """auto: hierarchical only with several nodes and several ranks on a node;
    the default is flat on any layout."""
    n = 512
    g = grads(comm.rank, n)
    cases = [("2", comm.size > 2), ("1", False), ("", False)]
    why = None
    for env, hier in cases:
        monkeypatch.setenv("MPIGC_NODE_SPLIT", env)
        for kw, want in (({"hierarchy": "auto"}, hier), ({}, False)):
            fb.reset()
            mpigc.allreduce(g.copy(), "2bit", key="a", feedback=fb, **kw)
            got = any(_hierarchy.parse_slice_key(k) for k in fb.keys())
            if got != want:
                why = f"MPIGC_NODE_SPLIT={env!r} {kw}: hierarchical {got}, expected {want}"
    assert_all(why is None, why, comm)


@pytest.mark.mpi
def test_error_feedback_conservation_1000_steps(comm, fb, split):
    """Summed over ranks and 10**3 steps: delivered + residuals == input."""
    n, steps = 37, 1000
    dtype = np.float64  # float64: the check is tight (1e-9)
    sim = _ref("2bit", n, dtype)
    put = np.zeros(n, np.float64)
    got_sum = np.zeros(n, np.float64)
    rng = np.random.default_rng([comm.rank, 5])
    why = None
    for step in range(steps):
        g = rng.standard_normal(n) * (1.0 + (step % 7))
        put += comm.allreduce(g)
        r = mpigc.allreduce(g.copy(), "2bit", key="c", feedback=fb, hierarchy="node")
        got_sum += r
    # the residuals of every rank, placed at their global positions
    lay = _hierarchy.layout(comm)
    states = _slice_states(fb, "c")
    mine = np.zeros(n, np.float64)
    sb = mpigc.shard_bounds(n, lay.L)
    for (s, a, b) in lay.owned_ranges(comm.rank, n):
        slo, shi = sb[s]
        mine[slo:shi] += states[s]["worker"]
        if states[s]["owner"] is not None:
            mine[a:b] += states[s]["owner"]
    resid = comm.allreduce(mine)
    err = np.max(np.abs(put - (got_sum + resid)))
    if not err < 1e-9 * max(1.0, np.max(np.abs(put))):
        why = f"conservation off by {err}"
    assert_all(why is None, why, comm)
    del sim


@pytest.mark.mpi
def test_bad_input_on_one_rank_raises_everywhere_and_changes_nothing(comm, fb, split):
    n = 600
    g = grads(comm.rank, n)
    mpigc.allreduce(g.copy(), "2bit", key="k", feedback=fb, hierarchy="node")
    before = {k: (v["worker"].tobytes(), None if v["owner"] is None else v["owner"].tobytes())
              for k, v in fb.state_dict().items()}
    last = comm.size - 1
    bad_dtype = g.astype(np.int32) if comm.rank == last else g.copy()
    raises_everywhere(mpigc.DTypeError,
                      lambda: mpigc.allreduce(bad_dtype, "2bit", key="k", feedback=fb,
                                              hierarchy="node"), comm)
    short = g[:-1].copy() if comm.rank == last else g.copy()
    if comm.size > 1:
        raises_everywhere(mpigc.MismatchError,
                          lambda: mpigc.allreduce(short, "2bit", key="k", feedback=fb,
                                                  hierarchy="node"), comm, match="size")
    nan = g.copy()
    if comm.rank == last:
        nan[3] = np.nan
    raises_everywhere(mpigc.NonFiniteError,
                      lambda: mpigc.allreduce(nan, "2bit", key="k", feedback=fb,
                                              hierarchy="node"), comm)
    after = {k: (v["worker"].tobytes(), None if v["owner"] is None else v["owner"].tobytes())
             for k, v in fb.state_dict().items()}
    assert_all(after == before, "residuals changed by a failed call", comm)
    if comm.size == 1:  # a node of one rank: no sum to overflow
        return
    # finite inputs whose node sum overflows in slice 0 only: the group of slice 0
    # fails after the other groups committed; every rank raises, nothing changed
    big = g.copy()
    big[0] = 3e38
    raises_everywhere(mpigc.NonFiniteError,
                      lambda: mpigc.allreduce(big, "2bit", key="k", feedback=fb,
                                              hierarchy="node"), comm, match="node")
    after = {k: (v["worker"].tobytes(), None if v["owner"] is None else v["owner"].tobytes())
             for k, v in fb.state_dict().items()}
    assert_all(after == before, "residuals changed by a failed call", comm)
    # and the skip policy fills NaN, residuals unchanged
    res = mpigc.allreduce(big, "2bit", key="k", feedback=fb, hierarchy="node",
                          nonfinite="skip")
    after = {k: (v["worker"].tobytes(), None if v["owner"] is None else v["owner"].tobytes())
             for k, v in fb.state_dict().items()}
    ok = bool(np.all(np.isnan(res))) and after == before
    assert_all(ok, "skip: expected NaN and no change", comm)


@pytest.mark.mpi
@pytest.mark.parametrize("kinds", [("iallreduce", "iallreduce"),
                                   ("iallreduce", "ireduce_scatter"),
                                   ("ireduce_scatter", "iallreduce")])
def test_two_pending_calls_on_one_key_raise_state_error(comm, fb, split, kinds):
    """Rule 3 of the nonblocking calls (docs/user-guide.md): a call on a key
    that a pending call of the same store uses raises StateError on every
    rank, as on the flat path. Two nonblocking hierarchical calls on the key
    "k", started one after the other: the first completes as it would
    alone, the second raises StateError everywhere and changes nothing
    (issue 27, item 7: both ran, each marking the key busy under a name of
    its own). A third call, once the first is done, runs."""
    n = 600
    g = grads(comm.rank, n)
    ref = mpigc.ErrorFeedback()
    first, second = (getattr(mpigc, k) for k in kinds)
    want = getattr(mpigc, kinds[0][1:])(g.copy(), "2bit", key="k", feedback=ref,
                                         hierarchy="node")
    x, y = g.copy(), g.copy()
    req1 = first(x, "2bit", key="k", feedback=fb, hierarchy="node")
    req2 = second(y, "2bit", key="k", feedback=fb, hierarchy="node")
    got2 = None
    try:
        req2.wait()
    except Exception as e:  # noqa: BLE001 - compared across ranks
        got2 = e
    res = req1.wait()
    why = None
    if not isinstance(got2, mpigc.StateError) or "already used" not in str(got2):
        why = f"second call: expected StateError, got {type(got2).__name__}: {got2}"
    elif res.tobytes() != want.tobytes():
        why = "the first call differs from the same call made alone"
    elif kinds[1] == "iallreduce" and y.tobytes() != g.tobytes():
        why = "the failed call changed its buffer"
    else:
        s1, s2 = ref.state_dict(), fb.state_dict()
        if set(s1) != set(s2) or any(
                (s1[k][p] is None) != (s2[k][p] is None)
                or (s1[k][p] is not None and s1[k][p].tobytes() != s2[k][p].tobytes())
                for k in s1 for p in ("worker", "owner")):
            why = "residuals differ from those of the first call alone"
    assert_all(why is None, why, comm)
    # the key is free again: the next call on it runs (and equals the reference's)
    a = mpigc.iallreduce(g.copy(), "2bit", key="k", feedback=fb, hierarchy="node").wait()
    b = mpigc.allreduce(g.copy(), "2bit", key="k", feedback=ref, hierarchy="node")
    assert_all(a.tobytes() == b.tobytes(), "the next call on the key differs", comm)


@pytest.mark.mpi
@pytest.mark.parametrize("kind", ["allreduce", "reduce_scatter"])
def test_none_takes_the_flat_path_bit_for_bit(comm, split, kind):
    """op="none" takes the flat path (a plain MPI sum, module docstring):
    blocking and nonblocking hierarchical calls give the bits of the flat
    blocking call, MPI_Allreduce / MPI_Reduce_scatter (they gave those of
    MPI_Iallreduce, which differ on 3 ranks: their sum runs as a nonblocking
    call of the layout's communicator)."""
    f, fi = getattr(mpigc, kind), getattr(mpigc, "i" + kind)
    bad = []
    for n in (10, 1000, 3000, 10000, 30000, 100000):
        x = grads(comm.rank, n, np.float64)
        want = np.asarray(f(x.copy(), "none")).tobytes()
        if np.asarray(f(x.copy(), "none", hierarchy="node")).tobytes() != want:
            bad.append((n, "blocking"))
        if np.asarray(fi(x.copy(), "none", hierarchy="node").wait()).tobytes() != want:
            bad.append((n, "nonblocking"))
    assert_all(not bad, f"hierarchical none differs from flat at {bad}", comm)


@pytest.mark.mpi
def test_settings_read_the_limits_whichever_call_came_first(comm, split, monkeypatch):
    """A hierarchical call reads ``$MPIGC_MAX_COUNT`` itself, as a flat call
    does: its settings' fingerprint names the number of MPI sums of a large
    ``op="none"`` call. It read the value the last flat call of the process
    had read, so ranks that had made different flat calls since the
    variable changed disagreed ("ranks disagree on the settings"). Found by
    the model checker (seed 133 of its hierarchical scenarios, with a planted
    cause that changed the order in which the ranks started flat calls)."""
    monkeypatch.setenv("MPIGC_MAX_COUNT", "1500")
    if comm.rank == 0:  # reads the new limit; the other ranks have not yet
        mpigc.allreduce(np.ones(4, np.float32), "none", comm=MPI.COMM_SELF)
    x = grads(comm.rank, 3001, np.float32)
    got = np.asarray(mpigc.allreduce(x.copy(), "none", hierarchy="node")).tobytes()
    want = np.asarray(mpigc.allreduce(x.copy(), "none")).tobytes()  # after: a flat call reads
    assert_all(got == want, "differs from the flat call", comm)


@pytest.mark.mpi
def test_nonfinite_ignore_passes_nan_through(comm, fb, split):
    g = grads(comm.rank, 300)
    if comm.rank == 0:
        g[5] = np.nan
    try:
        mpigc.allreduce(g, "2bit", key="i", feedback=fb, hierarchy="node",
                        nonfinite="ignore")
        # no check: the residual of slice 0 on node 0 (held by rank 0) takes the NaN
        ok, why = True, ""
        if comm.rank == 0:
            w = _slice_states(fb, "i")[0]["worker"]
            ok, why = bool(np.isnan(w).any()), "expected the NaN in rank 0's residual"
    except Exception as e:  # noqa: BLE001
        ok, why = False, f"raised {type(e).__name__}: {e}"
    assert_all(ok, why, comm)


@pytest.mark.mpi
def test_bad_hierarchy_value(comm):
    raises_everywhere(mpigc.ConfigError,
                      lambda: mpigc.allreduce(np.ones(10, np.float32), hierarchy="nodes"),
                      comm, match="hierarchy")


def _total(fb, comm, n, key="k"):
    """Sum over the ranks of ``comm`` of the worker and owner residuals of
    ``key`` at their global positions (flat or hierarchical), float64."""
    mine = np.zeros(n, np.float64)
    st = fb.state_dict()
    if key in st:
        s = st[key]
        if s["worker"] is not None:
            mine += s["worker"]
        if s["owner"] is not None:
            lo, hi = mpigc.shard_bounds(n, comm.size)[comm.rank]
            mine[lo:hi] += s["owner"]
    hs = _slice_states(fb, key)
    if hs:
        lay = _hierarchy.layout(comm)
        sb = mpigc.shard_bounds(n, lay.L)
        for s, a, b in lay.owned_ranges(comm.rank, n):
            if s in hs:
                mine[sb[s][0]:sb[s][1]] += hs[s]["worker"]
                if hs[s]["owner"] is not None:
                    mine[a:b] += hs[s]["owner"]
    return comm.allreduce(mine)


@pytest.mark.mpi
def test_checkpoint_2x2_to_1x3_and_back(comm, tmp_path_factory, monkeypatch):
    """2 nodes x 2 -> 1 node x 3 (flat there) -> 2 x 2: the residual totals are
    kept at every step, and a reload on the same layout continues bit for bit."""
    if comm.size != 4:
        pytest.skip("needs 4 ranks (2x2, then 3 of them as 1x3)")
    n, op = 1001, "2bit"
    path = comm.bcast(str(tmp_path_factory.mktemp("hck")) if comm.rank == 0 else None)
    a, b = path + "/a", path + "/b"
    monkeypatch.setenv("MPIGC_NODE_SPLIT", "2")
    fb = mpigc.ErrorFeedback()
    for step in range(3):
        mpigc.allreduce(grads(comm.rank, n, seed=step), op, key="k", feedback=fb,
                        hierarchy="auto")
    assert_all(any(_hierarchy.parse_slice_key(k) for k in fb.keys()), "not hierarchical",
               comm)
    t_a = _total(fb, comm, n)
    mpigc.save_checkpoint(a, fb, comm=comm)
    # same layout: identical state, identical next step
    fb2 = mpigc.ErrorFeedback()
    mpigc.load_checkpoint(a, fb2, comm=comm, hierarchy="auto")
    s1, s2 = fb.state_dict(), fb2.state_dict()
    same = sorted(s1) == sorted(s2) and all(
        s1[k]["worker"].tobytes() == s2[k]["worker"].tobytes() and
        (s1[k]["owner"] is None) == (s2[k]["owner"] is None) and
        (s1[k]["owner"] is None or s1[k]["owner"].tobytes() == s2[k]["owner"].tobytes())
        for k in s1)
    g = grads(comm.rank, n, seed=9)
    r1 = mpigc.allreduce(g.copy(), op, key="k", feedback=fb,
                        hierarchy="auto")
    r2 = mpigc.allreduce(g.copy(), op, key="k", feedback=fb2,
                        hierarchy="auto")
    assert_all(same and r1.tobytes() == r2.tobytes(), "reload on 2x2 not bit-identical", comm)
    # 1 node of 3 ranks: auto is flat there
    sub = comm.Split(0 if comm.rank < 3 else MPI.UNDEFINED, key=comm.rank)
    ok, why = True, ""
    if sub != MPI.COMM_NULL:
        monkeypatch.setenv("MPIGC_NODE_SPLIT", "3")
        fb3 = mpigc.ErrorFeedback()
        mpigc.load_checkpoint(a, fb3, comm=sub, hierarchy="auto")
        flat = sorted(fb3.keys()) == ["k"]
        t_b = _total(fb3, sub, n)
        ok = flat and np.allclose(t_b, t_a, rtol=1e-6, atol=1e-5)
        why = f"1x3: keys {sorted(fb3.keys())}, max diff {np.max(np.abs(t_b - t_a))}"
        mpigc.allreduce(grads(sub.rank, n, seed=4), op, key="k", feedback=fb3, comm=sub,
                        hierarchy="auto")
        t_b = _total(fb3, sub, n)
        mpigc.save_checkpoint(b, fb3, comm=sub)
        sub.Free()
    else:
        t_b = None
    assert_all(ok, why, comm)
    t_b = comm.bcast(t_b, root=0)
    # back to 2 x 2: hierarchical again, totals kept
    monkeypatch.setenv("MPIGC_NODE_SPLIT", "2")
    fb4 = mpigc.ErrorFeedback()
    mpigc.load_checkpoint(b, fb4, comm=comm, hierarchy="auto")
    hier = all(_hierarchy.parse_slice_key(k) for k in fb4.keys()) and len(fb4.keys()) > 0
    t_c = _total(fb4, comm, n)
    assert_all(hier and np.allclose(t_c, t_b, rtol=1e-6, atol=1e-5),
               f"back on 2x2: keys {fb4.keys()}, max diff {np.max(np.abs(t_c - t_b))}", comm)
    # and it runs on
    mpigc.allreduce(grads(comm.rank, n, seed=5), op, key="k", feedback=fb4,
                    hierarchy="auto")


@pytest.mark.mpi
def test_checkpoint_of_fewer_elements_than_slices(comm, fb, split, tmp_path_factory):
    """A buffer of fewer elements than a node has ranks: some ranks handle
    only empty slices and hold no residual of the key; the checkpoint still
    saves (they take part with nothing) and reloads bit for bit."""
    path = comm.bcast(str(tmp_path_factory.mktemp("hsmall")) if comm.rank == 0 else None)
    for step in range(2):
        mpigc.allreduce(grads(comm.rank, 1, seed=step), "1bit", key="s", feedback=fb,
                        hierarchy="node")
    held = comm.allgather(len(fb.keys()))
    mpigc.save_checkpoint(path + "/ck", fb, comm=comm)
    fb2 = mpigc.ErrorFeedback()
    mpigc.load_checkpoint(path + "/ck", fb2, comm=comm, hierarchy="node")
    s1, s2 = fb.state_dict(), fb2.state_dict()
    same = sorted(s1) == sorted(s2) and all(
        np.array_equal(s1[k][p], s2[k][p]) for k in s1 for p in ("worker", "owner")
        if s1[k][p] is not None)
    g = grads(comm.rank, 1, seed=5)
    r1 = mpigc.allreduce(g.copy(), "1bit", key="s", feedback=fb, hierarchy="node")
    r2 = mpigc.allreduce(g.copy(), "1bit", key="s", feedback=fb2, hierarchy="node")
    assert_all(same and r1.tobytes() == r2.tobytes(), f"keys per rank {held}", comm)


@pytest.mark.mpi
def test_checkpoint_refuses_a_key_of_two_hierarchical_layouts(comm, fb, split,
                                                             tmp_path_factory):
    """A key used hierarchically at two sizes holds residuals of two layouts:
    save_checkpoint raises StateError on every rank (one row per key), and
    saves once the stale ones are reset."""
    path = comm.bcast(str(tmp_path_factory.mktemp("h2lay")) if comm.rank == 0 else None)
    for n in (100, 200):
        mpigc.allreduce(grads(comm.rank, n), "2bit", key="k", feedback=fb, hierarchy="node")
    raises_everywhere(mpigc.StateError,
                      lambda: mpigc.save_checkpoint(path + "/ck", fb, comm=comm))
    for k in fb.keys():
        if ":100]" in k:
            fb.reset(k)
    mpigc.save_checkpoint(path + "/ck", fb, comm=comm)
    info = mpigc.load_checkpoint(path + "/ck", mpigc.ErrorFeedback(), comm=comm)
    assert_all(info["keys"] == ["k@hier"], f"keys {info['keys']}", comm)


@pytest.mark.mpi
@pytest.mark.parametrize("saved,used", [("node", "node"), ("node", "flat"), ("flat", "node")])
def test_checkpoint_config_check_covers_hierarchical_keys(comm, split, tmp_path_factory,
                                                          saved, used):
    """load_checkpoint(strict=True) refuses a key saved with another
    compressor than the one it is used with (configs= by the user's key, or
    the store's live entries), whichever form, flat or hierarchical, it was
    saved or is used in (review of issue 16: hierarchical rows, "k@hier",
    matched neither "k" in configs= nor the live "k@hier[s/L:n]" entries,
    so 2bit residuals loaded silently into a 1bit key); strict=False
    re-initialises it."""
    path = comm.bcast(str(tmp_path_factory.mktemp("hcfg")) if comm.rank == 0 else None)
    n = 1001
    fb = mpigc.ErrorFeedback()
    for step in range(2):
        mpigc.allreduce(grads(comm.rank, n, seed=step), "2bit", key="k", feedback=fb,
                        hierarchy=saved)
    mpigc.save_checkpoint(path + "/ck", fb, comm=comm)
    raises_everywhere(mpigc.MismatchError, lambda: mpigc.load_checkpoint(
        path + "/ck", mpigc.ErrorFeedback(), comm=comm, hierarchy=used,
        configs={"k": "1bit"}))
    live = mpigc.ErrorFeedback()
    mpigc.allreduce(grads(comm.rank, n, seed=7), "1bit", key="k", feedback=live,
                    hierarchy=used)
    before = live.state_dict()
    raises_everywhere(mpigc.MismatchError, lambda: mpigc.load_checkpoint(
        path + "/ck", live, comm=comm, hierarchy=used))
    after = live.state_dict()
    ok = sorted(before) == sorted(after) and all(
        np.array_equal(before[k]["worker"], after[k]["worker"]) for k in before)
    with pytest.warns(UserWarning, match="re-initialising"):
        info = mpigc.load_checkpoint(path + "/ck", live, comm=comm, hierarchy=used,
                                     strict=False)
    ok &= len(info["reinitialised"]) == 1 and live.keys() == []
    # the matching compressor loads, by the user's key
    mpigc.load_checkpoint(path + "/ck", mpigc.ErrorFeedback(), comm=comm, hierarchy=used,
                          configs={"k": "2bit"})
    assert_all(ok, f"keys {sorted(before)} -> {sorted(after)}, {info['reinitialised']}",
               comm)


@pytest.mark.mpi
@pytest.mark.parametrize("op", ["2bit", "1bit", {"type": "fp16", "error_feedback": True}],
                         ids=_id)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_pipelined_inter_node_calls_sum_just_in_time(comm, fb, split, monkeypatch, starts,
                                                     op, dtype):
    """With the inter-node calls pipelined (small MPIGC_CHUNK_BYTES), each piece
    of a node's sum is made when the engine reads it (the fill hook): results and
    residuals stay bit-identical to the reference, and the pipeline is taken
    wherever a group spans two nodes."""
    monkeypatch.setenv("MPIGC_CHUNK_BYTES", "512")
    n = 4001
    sim = _ref(op, n, dtype)
    why = None
    for step in range(3):
        xs = [grads(q, n, dtype, seed=step) for q in range(comm.size)]
        want = sim.allreduce(xs)
        got = mpigc.allreduce(xs[comm.rank].copy(), op=op, key="k", feedback=fb,
                              hierarchy="node")
        if got.tobytes() != want.tobytes():
            why = f"step {step}: max diff {np.max(np.abs(got.astype(float) - want))}"
            break
    if why is None:
        why = _check_residuals(fb, sim, comm.rank)
    lay = _hierarchy.layout(comm)
    if why is None and lay.M > 1 and starts[0] != 3 * len(lay.slices_of(comm.rank)):
        why = f"{starts[0]} pipelined inter-node calls"
    assert_all(why is None, why, comm)


@pytest.mark.mpi
def test_nonfinite_input_is_named_by_rank(comm, fb, split):
    """No pass over the input finds non-finite values up front: the node sum
    carries them to the inter-node call, and the failure names the input's rank."""
    g = grads(comm.rank, 500)
    last = comm.size - 1
    if comm.rank == last:
        g[7] = np.inf
    raises_everywhere(mpigc.NonFiniteError,
                      lambda: mpigc.allreduce(g.copy(), "2bit", key="n", feedback=fb,
                                              hierarchy="node"), comm,
                      match=f"input on rank {last} \\(1\\)")
    assert_all(not any(k == "n" or k.startswith("n@") for k in fb.keys()),
               f"residuals created: {fb.keys()}", comm)


@pytest.mark.mpi
@pytest.mark.parametrize("op", ["2bit", {"type": "terngrad", "error_feedback": True}, "1bit"],
                         ids=_id)
def test_failed_slice_group_puts_back_every_residual(comm, fb, split, op):
    """A node sum that overflows in slice 0 only: slice 0's inter-node group
    fails after the other groups committed, and the hierarchical call puts
    their residuals back. terngrad writes its worker residual once the scale
    is agreed, after the commit: it must not write over the array the call
    puts back (it did, in place: the failed call changed the residuals)."""
    if comm.size == 1:  # a node of one rank: no sum to overflow
        pytest.skip("needs a node of two ranks")
    g = grads(comm.rank, 600)
    for _ in range(2):  # residuals and owner residuals to put back
        mpigc.allreduce(g.copy(), op, key="r", feedback=fb, hierarchy="node")

    def snap():
        return _bytes(fb)

    before = snap()
    big = g.copy()
    big[0] = 3e38
    raises_everywhere(mpigc.NonFiniteError,
                      lambda: mpigc.allreduce(big, op, key="r", feedback=fb,
                                              hierarchy="node"), comm, match="node")
    after = snap()
    changed = sorted(k for k in before if after.get(k) != before[k])
    assert_all(not changed and sorted(after) == sorted(before),
               f"residuals changed by a failed call: {changed}", comm)
    # and the next call gives what it gives on a store that never saw the failure
    twin = mpigc.ErrorFeedback()
    twin.load_state_dict(fb.state_dict())
    a = mpigc.allreduce(g.copy(), op, key="r", feedback=fb, hierarchy="node")
    b = mpigc.allreduce(g.copy(), op, key="r", feedback=twin, hierarchy="node")
    assert_all(a.tobytes() == b.tobytes() and snap() == _bytes(twin),
        "the store after the failed call differs from one that never saw it", comm)


def _bytes(fb):
    """Every residual of store ``fb`` as bytes, with its call count."""
    return {k: tuple(None if v.get(f) is None else np.asarray(v[f]).tobytes()
                     for f in ("worker", "owner", "calls"))
            for k, v in fb.state_dict().items()}
