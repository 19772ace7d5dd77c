"""The cheap call path: the agreement travels with the data.

Up to 16 ranks each rank sends its agreement row point to point in front of
the data it sends each peer (phase 1's payloads; on 2 ranks, op="none"'s
values), so a call needs no separate agreement round. These tests check that
this changes nothing of the error semantics: a bad call on one rank raises
the same error on every rank and changes nothing anywhere (buffers,
residuals, call counts), and the next call works; and that the cached
settings follow the environment.
"""
import numpy as np
import pytest
from mpi4py import MPI

import mpigc

from conftest import assert_all, grads

# ranks: flat, rows point to point at any count: 2 the pair path, 3 the general one
pytestmark = pytest.mark.ranks(1, 2, 3)

N = 3000


def _state(fb):
    out = {}
    for key, st in fb.state_dict().items():
        parts = [st["calls"]]
        for part in ("worker", "owner"):
            a = st[part]
            parts.append(None if a is None else a.tobytes())
        out[key] = tuple(parts)
    return out


def _outcome(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - compared across ranks
        return type(exc).__name__
    return None


def _inline_used(op, comm, fb, n=N):
    """Whether a good call of ``op`` carries its data in the agreement messages."""
    x = grads(comm.rank, n)
    req = mpigc.iallreduce(x, op, key="probe", feedback=fb)
    req.wait()
    return req.trace.inline


FAULTS = ["size", "nan", "int_dtype", "readonly", "settings"]


@pytest.mark.mpi
@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("op", ["2bit", "1bit", "fp16", "none"])
def test_bad_call_on_one_rank_changes_nothing_when_agreement_travels_with_data(
        comm, fault, op):
    """The last rank's call is bad; every rank raises the same class, no
    buffer, residual or call count changes, and the next call gives what it
    gives on a store that never saw the bad call."""
    if comm.size < 2:
        pytest.skip("needs a peer")
    r, last = comm.rank, comm.size - 1
    params = {"error_feedback": True} if op == "fp16" else {}
    fb, ref = mpigc.ErrorFeedback(), mpigc.ErrorFeedback()
    inline = _inline_used(op if op != "none" else "none", comm, fb)
    want_inline = op != "none" or comm.size == 2
    assert_all(inline == want_inline, f"inline path used: {inline}")
    for store in (fb, ref):
        mpigc.allreduce(grads(r, N, seed=1), op, key="k", feedback=store, **params)
    before = _state(fb)
    calls_before = mpigc.traffic()["calls"]
    x = grads(r, N, seed=2)
    kw = dict(params)
    if r == last:
        if fault == "size":
            x = grads(r, N + 1, seed=2)
        elif fault == "nan":
            x[7] = np.nan
        elif fault == "int_dtype":
            x = x.astype(np.int32)
        elif fault == "readonly":
            x.flags.writeable = False
        elif fault == "settings":
            kw["average"] = True
    keep = np.array(x, copy=True)
    name = _outcome(lambda: mpigc.allreduce(x, op, key="k", feedback=fb, **kw))
    names = comm.allgather(name)
    assert_all(name is not None and len(set(names)) == 1, f"outcomes {names}")
    assert_all(np.array_equal(x, keep, equal_nan=True), "buffer changed")
    assert_all(_state(fb) == before, "residuals or call counts changed")
    assert_all(mpigc.traffic()["calls"] == calls_before, "a call was counted")
    # nothing stray is left on the wire: the next call matches the reference
    y = mpigc.allreduce(grads(r, N, seed=3), op, key="k", feedback=fb, **params)
    z = mpigc.allreduce(grads(r, N, seed=3), op, key="k", feedback=ref, **params)
    assert_all(y.tobytes() == z.tobytes(), "the next call differs from the reference")


@pytest.mark.mpi
@pytest.mark.parametrize("limit", [None, 4096])
def test_peer_sends_data_this_rank_does_not_expect(comm, monkeypatch, limit):
    """Rank 0's buffer is just over the size whose values travel with the
    agreement, the others' just under (and the other way round): a size
    mismatch on every rank, nothing changed, no message left behind. At the
    default limit (1 MiB) and a lowered one ($MPIGC_INLINE_PLAIN_BYTES)."""
    if comm.size < 2:
        pytest.skip("needs a peer")
    if limit is not None:
        monkeypatch.setenv("MPIGC_INLINE_PLAIN_BYTES", str(limit))
    lim = (limit or 1 << 20) // 4
    for big_rank in (0, comm.size - 1):
        n = lim + 1 if comm.rank == big_rank else lim
        x = np.full(n, 1.0, np.float32)
        name = _outcome(lambda: mpigc.allreduce(x, "none"))
        assert_all(name == "MismatchError", f"got {name}")
        assert_all(np.all(x == 1.0), "buffer changed")
    y = np.full(lim, 1.0, np.float32)
    mpigc.allreduce(y, "none")
    assert_all(np.all(y == comm.size), "the next call failed")
    # the limit is where the test puts it: just under it the values travel
    # with the rows on 2 ranks, just over it they do not
    below = mpigc.diagnostics.last_trace().inline
    mpigc.allreduce(np.full(lim + 1, 1.0, np.float32), "none")
    above = mpigc.diagnostics.last_trace().inline
    assert_all(below == (comm.size == 2) and not above,
               f"inline below the limit: {below}, above: {above}")


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("n", [1, 1023, 4099, 262144, 262145])
def test_none_is_mpi_allreduce_on_both_paths(comm, dtype, n):
    """op="none" gives MPI_Allreduce's bits below and above the size whose
    values travel with the agreement (2 ranks) and at every rank count."""
    x = grads(comm.rank, n, dtype)
    want = x.astype(np.float32) if dtype == np.float16 else x.copy()
    comm.Allreduce(MPI.IN_PLACE, want, op=MPI.SUM)
    want = (want / comm.size).astype(dtype)
    got = mpigc.allreduce(x.copy(), op="none", average=True)
    assert_all(got.tobytes() == want.tobytes())


@pytest.mark.mpi
def test_cached_settings_follow_the_environment(comm, monkeypatch):
    """The same call twice, with the small-buffer cutoff changed between
    them: the second call sees the change (compressed, then plain)."""
    fb = mpigc.ErrorFeedback()
    x = grads(comm.rank, 1000)  # 4000 bytes
    monkeypatch.setenv("MPIGC_MIN_COMPRESS_BYTES", "0")
    mpigc.allreduce(x.copy(), op="2bit", key="c", feedback=fb)
    assert_all("c" in fb, "not compressed with cutoff 0")
    fb.reset()
    monkeypatch.setenv("MPIGC_MIN_COMPRESS_BYTES", "8192")
    want = np.empty_like(x)
    comm.Allreduce(x, want, op=MPI.SUM)
    got = mpigc.allreduce(x.copy(), op="2bit", key="c", feedback=fb)
    assert_all("c" not in fb and np.allclose(got, want, rtol=1e-5, atol=1e-5),
               "the cutoff change was not seen")
    monkeypatch.setenv("MPIGC_MIN_COMPRESS_BYTES", "bad")
    name = _outcome(lambda: mpigc.allreduce(x.copy(), op="2bit", key="c", feedback=fb))
    assert_all(name == "ConfigError", f"got {name}")


@pytest.mark.mpi
@pytest.mark.parametrize("pipelined", [False, True])
@pytest.mark.parametrize("fault", ["size", "nan", None])
def test_large_payloads_go_after_the_agreement(comm, monkeypatch, fault, pipelined):
    """Payloads above 256 KiB do not travel with the rows (the receives are
    posted before the sends, after the agreement), pipelined or not; the
    error semantics are the same, and a good call gives what a reference
    store gives."""
    if not pipelined:
        monkeypatch.setenv("MPIGC_CHUNK_BYTES", "0")
    n = 2_200_000 * max(1, comm.size)  # 2bit: about 550 KB per shard
    fb, ref = mpigc.ErrorFeedback(), mpigc.ErrorFeedback()
    x = grads(comm.rank, n)
    req = mpigc.iallreduce(x.copy(), "2bit", key="big", feedback=fb)
    req.wait()
    t = req.trace
    # one rank exchanges nothing: no pipeline there
    assert_all(t.path == "two-phase" and not t.inline
               and (t.chunks > 0) == (pipelined and comm.size > 1),
               f"payloads went inline, or not the path under test: {t}")
    mpigc.allreduce(x.copy(), "2bit", key="big", feedback=ref)
    before = _state(fb)
    y = grads(comm.rank, n, seed=5)
    if comm.rank == comm.size - 1 and fault == "size":
        y = grads(comm.rank, n + 1, seed=5)
    elif comm.rank == comm.size - 1 and fault == "nan":
        y[n // 2] = np.inf
    keep = y.copy()
    name = _outcome(lambda: mpigc.allreduce(y, "2bit", key="big", feedback=fb))
    names = comm.allgather(name)
    if fault is None:
        z = mpigc.allreduce(keep.copy(), "2bit", key="big", feedback=ref)
        assert_all(name is None and y.tobytes() == z.tobytes(), f"{name}")
    else:
        assert_all(name is not None and len(set(names)) == 1, f"outcomes {names}")
        assert_all(np.array_equal(y, keep), "buffer changed")
        assert_all(_state(fb) == before, "residuals or call counts changed")
