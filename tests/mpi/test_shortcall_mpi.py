"""The short path of a repeated small call (mpigc._shortcall): a blocking
flat allreduce of a host float32/float64 array on 2 ranks that is a plain sum,
made while no call is pending: its row alone, then MPI's sum.

It must be invisible but for its speed: the bits of ``comm.Allreduce``, the
trace and traffic of the engine's path (a call whose values did not travel
with the rows once either rank took the short path), agreement messages
that a peer on the engine's path matches (in both roles:
``$MPIGC_SHORT_PATH=0`` on one rank), and every error raised on every rank
with nothing changed, whichever path each rank took. ``short_calls`` in
:func:`mpigc.diagnostics.counters` says that the path was taken.

Once a second thread has called mpigc the process never takes the short path
(:func:`mpigc.diagnostics.several_threads`; in the whole MPI suite, earlier
files do): these tests then check that it is not taken, and
``tests/test_shortcall.py`` runs this file alone under ``mpirun -n 2``, where
it is (``$MPIGC_TEST_EXPECT_SHORT=1`` makes sure of that)."""
import os

import numpy as np
import pytest
from mpi4py import MPI

import mpigc
from mpigc import diagnostics
from conftest import assert_all, grads, raises_everywhere

# ranks: the short path is for 2 ranks: every test skips at the other counts
pytestmark = [pytest.mark.mpi(min_size=2), pytest.mark.ranks(2)]


@pytest.fixture
def two(comm):
    if comm.size != 2:
        pytest.skip("the short path is for 2 ranks")
    return comm


def _short_calls():
    return diagnostics.counters()["short_calls"]


def _alone():
    """Whether this process may take the short path at all (see above)."""
    several = diagnostics.several_threads()
    assert not (several and os.environ.get("MPIGC_TEST_EXPECT_SHORT") == "1"), \
        "a second thread called mpigc: the short path is not tested"
    return not several


@pytest.fixture(params=["both", "rank 0", "rank 1", "neither"])
def paths(request, two, monkeypatch):
    """Which ranks may take the short path (``$MPIGC_SHORT_PATH=0`` on the
    others); returns whether this rank may."""
    mine = request.param in ("both", f"rank {two.rank}") and _alone()
    if not mine:
        monkeypatch.setenv("MPIGC_SHORT_PATH", "0")
    return mine


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("op", ["none", "2bit"])  # 2bit: the small-buffer fallback
@pytest.mark.parametrize("average", [False, True])
def test_bits_of_mpi_allreduce_on_either_path(two, paths, dtype, op, average, monkeypatch):
    monkeypatch.setenv("MPIGC_MIN_COMPRESS_BYTES", "8192")  # conftest sets 0
    shape = (7, 5) if dtype == np.float32 else (40,)
    before = _short_calls()
    sent0 = mpigc.traffic()["bytes_sent"]
    for step in range(3):
        x = grads(two.rank, 35 if shape == (7, 5) else 40, dtype, seed=step).reshape(shape)
        want = x.copy()
        two.Allreduce(MPI.IN_PLACE, want, op=MPI.SUM)
        if average:
            want /= 2
        got = mpigc.allreduce(x, op=op, key=f"s/{op}", average=average)
        assert_all(got is x and x.tobytes() == want.tobytes(), f"step {step}: not MPI's bits")
        t = diagnostics.last_trace()
        # the values travel with the rows only where both ranks sent them
        # (the engine's path on both): the short path sends its row alone
        inline = not two.allreduce(paths, op=MPI.LOR)
        assert_all((t.agreement_done, t.path, t.inline, t.sum_pieces)
                   == (True, "plain", inline, 0 if inline else 1), f"trace {t}")
    assert_all(_short_calls() - before == (3 if paths else 0), "short calls counted")
    assert_all(mpigc.traffic()["bytes_sent"] - sent0 == 3 * x.nbytes, "traffic")


@pytest.mark.mpi
def test_other_calls_take_the_engine_path(two):
    """float16, a nonblocking call pending, a read-only array's error, and a
    subclass of ndarray: not the short path; a size past the inline limit
    is (its values never travel with its row)."""
    before = _short_calls()
    x16 = grads(two.rank, 100, np.float16)
    mpigc.allreduce(x16, op="none")
    assert_all(_short_calls() == before, "float16 on the short path")
    big = np.ones((1 << 20) // 4 + 1, np.float32)
    mpigc.allreduce(big, op="none")
    assert_all(bool((big == 2).all()), "big")
    assert_all(_short_calls() == before + _alone(), "big not on the short path")
    before = _short_calls()
    # the progress thread held: else it may finish the nonblocking call
    # before the blocking one starts, which then finds nothing pending
    # (seen: "a short call where none should be" on rank 1, 2 runs of 7)
    with diagnostics.hold_progress():
        req = mpigc.iallreduce(np.ones(10, np.float32), op="none", key="nb")
        small = np.ones(10, np.float32)
        mpigc.allreduce(small, op="none", key="b")
        req.wait()
    assert_all(bool((small == 2).all()), "small beside a pending call")

    class Sub(np.ndarray):
        pass

    s = np.ones(10, np.float32).view(Sub)
    mpigc.allreduce(s, op="none")
    assert_all(_short_calls() == before, "a short call where none should be")
    mpigc.allreduce(small, op="none", key="b")
    assert_all(_short_calls() == before + _alone(), "the short path after them")


@pytest.mark.mpi
def test_mismatches_raise_everywhere_whichever_path(two, paths):
    r = two.rank
    cases = [
        ("size", lambda: np.ones(10 + r, np.float32), {}, "size"),
        ("dtype", lambda: np.ones(10, [np.float32, np.float64][r]), {}, "dtype"),
        ("settings", lambda: np.ones(10, np.float32), {"average": r == 1}, "settings"),
        ("op", lambda: np.ones(10, np.float32), {"op": ["none", "2bit"][r]}, "settings"),
    ]
    for what, make, kw, match in cases:
        x = make()
        keep = x.copy()
        kw = dict({"op": "none"}, **kw)
        raises_everywhere(mpigc.MismatchError, lambda: mpigc.allreduce(x, key="m", **kw),
                          match=match)
        assert_all(x.tobytes() == keep.tobytes(), f"{what}: the buffer changed")
    # and the next call goes through on either path
    y = np.full(10, 1.0 + r, np.float32)
    mpigc.allreduce(y, op="none", key="m")
    assert_all(bool((y == 3).all()), "after the mismatches")


@pytest.mark.mpi
def test_bad_input_on_one_rank_fails_everywhere(two, paths):
    """A read-only array on rank 1 fails there before anything is sent; rank 0
    (on the short path if allowed) meets its error row and raises too."""
    x = np.ones(10, np.float32)
    if two.rank == 1:
        x.flags.writeable = False
    raises_everywhere(mpigc.InvalidBufferError, lambda: mpigc.allreduce(x, op="none", key="r"),
                      match="read-only")
    assert_all(bool((x == 1).all()), "changed")
    raises_everywhere(mpigc.ConfigError,
                      lambda: mpigc.allreduce(np.ones(10, np.float32), op="none", key="r",
                                              gather="nope" if two.rank == 0 else "exact"))


@pytest.mark.mpi
@pytest.mark.parametrize("where", [0, 1])
def test_nonfinite_raise_and_skip_everywhere(two, paths, where):
    x = np.arange(10, dtype=np.float64)
    if two.rank == where:
        x[3] = np.nan
    keep = x.copy()
    raises_everywhere(mpigc.NonFiniteError, lambda: mpigc.allreduce(x, op="none", key="f"),
                      match=f"rank {where}")
    assert_all(x.tobytes() == keep.tobytes(), "raise changed the buffer")
    got = mpigc.allreduce(x, op="none", key="f", nonfinite="skip")
    assert_all(bool(np.isnan(got).all()), "skip: NaN everywhere")
    y = np.arange(10, dtype=np.float64)
    y[2] = np.inf if two.rank == where else 0
    mpigc.allreduce(y, op="none", key="f", nonfinite="ignore")
    assert_all(bool(np.isinf(y[2])), "ignore: the sum")


@pytest.mark.mpi
def test_nan_payloads_under_ignore_take_mpis_bits(two, paths):
    """nonfinite="ignore" with NaNs of different payloads and signs on both
    ranks at one index (where a + b and b + a differ): the bits of
    comm.Allreduce on either path, the short path counting the call."""
    x = np.arange(12, dtype=np.float32)
    bits = x.view(np.uint32)
    bits[4] = [0x7FC00001, 0xFFC00002][two.rank]
    bits[7] = [0x7F800003, 0x7F800000][two.rank]  # a NaN against an inf
    want = x.copy()
    two.Allreduce(MPI.IN_PLACE, want, op=MPI.SUM)
    before = _short_calls()
    mpigc.allreduce(x, op="none", key="nan", nonfinite="ignore")
    assert_all(x.tobytes() == want.tobytes(), "not MPI's bits")
    assert_all(_short_calls() - before == int(paths), "short calls counted")


@pytest.mark.mpi
def test_switch_off_reads_the_environment(two, monkeypatch):
    before = _short_calls()
    monkeypatch.setenv("MPIGC_SHORT_PATH", "0")
    mpigc.allreduce(np.ones(10, np.float32), op="none", key="e")
    assert_all(_short_calls() == before, "taken while off")
    monkeypatch.setenv("MPIGC_SHORT_PATH", "1")
    mpigc.allreduce(np.ones(10, np.float32), op="none", key="e")
    assert_all(_short_calls() == before + _alone(), "not taken while on")


@pytest.mark.mpi
def test_a_calls_sends_are_tested_by_the_call_after_next(two, paths):
    """Issue 51: a call whose values travel with its row (64 KiB, on
    either path) leaves its agreement sends untested (a test of a send the
    peer has not received is a progress call that, under load, gives the
    core away); the rows of the call after next test them and recycle
    their buffers: at most two calls' sends wait, and the messages' buffers
    come back to the pool (a few in turn, not one per call). With each
    call testing its own sends (before), none waits after a call whose
    sends were done."""
    from mpigc import _agree
    stale = list(_agree._draining)  # earlier tests' sends (done: tested below)
    bufs = set()
    for step in range(12):
        x = np.full(65536 // 4, step, np.float32)
        mpigc.allreduce(x, op="none", key="drain")
        assert_all(bool((x == 2 * step).all()), f"step {step}: the sum")
        waiting = [e for e in _agree._draining if not any(e is s for s in stale)]
        assert_all(1 <= len(waiting) <= 2, f"step {step}: {len(waiting)} calls' sends wait")
        bufs.update(id(a) for a in waiting[-1][1])
    assert_all(1 <= len(bufs) <= 4, f"{len(bufs)} message buffers for 12 calls")


# -- grouped calls (mpigc._shortcall.run_group): the members straight into the
# agreement message, the peer's values straight into the members

def _group(rank, sizes, dtype, seed):
    return [grads(rank, m, dtype, seed=seed + 7 * i) for i, m in enumerate(sizes)]


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("average", [False, True])
def test_a_group_has_the_bits_of_mpi_allreduce_on_either_path(two, paths, dtype, average,
                                                             monkeypatch):
    """Members of several shapes (one 2-d, one of one element), op="none" and
    a 2bit group under the compression threshold: each member the bits of
    comm.Allreduce of it, the engine's trace and traffic, and one short call
    per grouped call where this rank may take it."""
    monkeypatch.setenv("MPIGC_MIN_COMPRESS_BYTES", "8192")  # conftest sets 0
    sizes = (35, 1, 40, 300)
    before = _short_calls()
    sent0 = mpigc.traffic()["bytes_sent"]
    for step, op in enumerate(["none", "2bit", "none"]):
        xs = _group(two.rank, sizes, dtype, step)
        xs[0] = xs[0].reshape(7, 5)
        want = [x.copy() for x in xs]
        for w in want:
            two.Allreduce(MPI.IN_PLACE, w, op=MPI.SUM)
            if average:
                w /= 2
        got = mpigc.allreduce(xs, op=op, key=f"g/{op}", average=average)
        assert_all(got is xs and all(x.tobytes() == w.tobytes() for x, w in zip(xs, want)),
                   f"step {step}: not MPI's bits")
        t = diagnostics.last_trace()
        assert_all((t.agreement_done, t.path, t.inline, t.sum_pieces) == (True, "plain", True, 0),
                   f"trace {t}")
    assert_all(_short_calls() - before == (3 if paths else 0), "short calls counted")
    nbytes = sum(sizes) * np.dtype(dtype).itemsize
    assert_all(mpigc.traffic()["bytes_sent"] - sent0 == 3 * nbytes, "traffic")


@pytest.mark.mpi
def test_groups_the_short_path_leaves_to_the_engine(two, monkeypatch):
    """A compressed group, a float16 group, a group past the inline limit and
    a nonblocking group: the engine's path, with the right sums."""
    before = _short_calls()
    monkeypatch.setenv("MPIGC_MIN_COMPRESS_BYTES", "0")
    xs = [np.ones(100, np.float32), np.ones(50, np.float32)]
    mpigc.allreduce(xs, op="2bit", key="gc")
    monkeypatch.setenv("MPIGC_MIN_COMPRESS_BYTES", "8192")
    h = [np.ones(10, np.float16), np.ones(3, np.float16)]
    mpigc.allreduce(h, op="none")
    big = [np.ones((1 << 19) // 4, np.float32), np.ones((1 << 19) // 4 + 1, np.float32)]
    mpigc.allreduce(big, op="none")
    nb = [np.ones(10, np.float32), np.ones(3, np.float32)]
    mpigc.iallreduce(nb, op="none").wait()
    assert_all(all(bool((a == 2).all()) for a in h + big + nb), "sums")
    assert_all(_short_calls() == before, "a short call where none should be")


@pytest.mark.mpi
def test_group_mismatches_raise_everywhere_whichever_path(two, paths):
    r = two.rank
    cases = [
        ("member size", [np.ones(10, np.float32), np.ones(4 + r, np.float32)], {}, "size"),
        ("member count", [np.ones(6 - 2 * r, np.float32)] * (2 + r), {}, "settings"),
        ("members cut otherwise", [np.ones(5 + r, np.float32), np.ones(5 - r, np.float32)],
         {}, "settings"),
        ("dtype", [np.ones(10, [np.float32, np.float64][r])] * 2, {}, "dtype"),
        ("keys", [np.ones(10, np.float32)] * 2, {"key": ["a", ["b", "c"][r]]}, "settings"),
        ("average", [np.ones(10, np.float32)] * 2, {"average": r == 1}, "settings"),
    ]
    for what, xs, kw, match in cases:
        xs = [x.copy() for x in xs]
        keep = [x.tobytes() for x in xs]
        kw = dict({"op": "none", "key": "gm"}, **kw)
        raises_everywhere(mpigc.MismatchError, lambda: mpigc.allreduce(xs, **kw), match=match)
        assert_all([x.tobytes() for x in xs] == keep, f"{what}: a member changed")
    ys = [np.full(10, 1.0 + r, np.float32), np.full(3, 2.0 - r, np.float32)]
    mpigc.allreduce(ys, op="none", key="gm")
    assert_all(bool((ys[0] == 3).all() and (ys[1] == 3).all()), "after the mismatches")


@pytest.mark.mpi
def test_a_bad_member_on_one_rank_fails_everywhere(two, paths):
    xs = [np.ones(10, np.float32), np.ones(6, np.float32)]
    if two.rank == 1:
        xs[1].flags.writeable = False
    raises_everywhere(mpigc.InvalidBufferError, lambda: mpigc.allreduce(xs, op="none"),
                      match="group member 1.*read-only")
    assert_all(all(bool((x == 1).all()) for x in xs), "changed")


@pytest.mark.mpi
@pytest.mark.parametrize("where", [0, 1])
def test_a_nonfinite_member_raises_and_skips_everywhere(two, paths, where):
    xs = [np.arange(10, dtype=np.float64), np.arange(5, dtype=np.float64)]
    if two.rank == where:
        xs[1][3] = np.nan
    keep = [x.tobytes() for x in xs]
    raises_everywhere(mpigc.NonFiniteError, lambda: mpigc.allreduce(xs, op="none", key="gf"),
                      match=f"rank {where}")
    assert_all([x.tobytes() for x in xs] == keep, "raise changed a member")
    got = mpigc.allreduce(xs, op="none", key="gf", nonfinite="skip")
    assert_all(all(bool(np.isnan(x).all()) for x in got), "skip: NaN everywhere")
    ys = [np.arange(10, dtype=np.float64), np.arange(5, dtype=np.float64)]
    ys[1][2] = np.inf if two.rank == where else 0
    want = [y.copy() for y in ys]
    for w in want:
        two.Allreduce(MPI.IN_PLACE, w, op=MPI.SUM)
    mpigc.allreduce(ys, op="none", key="gf", nonfinite="ignore")
    assert_all(all(y.tobytes() == w.tobytes() for y, w in zip(ys, want)), "ignore: the sum")
