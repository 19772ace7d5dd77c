"""Messages beyond MPI's int counts (issue 27, item 7).

MPI-3 counts are C ints, and Open MPI 5.0 has no MPI-4 large-count routines:
a payload of more than 2**31 - 1 bytes in one message (560M float64,
terngrad, gather="exact", at 2 ranks) failed after the agreement with
mpi4py's MPI_ERR_ARG, half the buffer already overwritten. The engine now
sends such a message as one element of a derived datatype of its bytes
(counted by ``mpigc.diagnostics.counters()["typed_messages"]``), and sums
op="none" calls of more elements in pieces (``CallTrace.sum_pieces``).

The default suite lowers the limit (``$MPIGC_MAX_COUNT``) so that small calls
take both paths, with many blocks or pieces per message, and checks them bit
for bit against the same calls under the real limit. ``MPIGC_TEST_LARGE=1``
runs the real thing: shards of more than 2**31 bytes (about 7 GB of memory
per rank).
"""
import os
import time

import numpy as np
import pytest

import mpigc

from conftest import assert_all, grads
from peers import state_bytes

# ranks: MPIGC_NODE_SPLIT=2: 4 is 2 nodes of 2; 2 the inline sum, 3 uneven shards
pytestmark = pytest.mark.ranks(1, 2, 3, 4)

N = 3001  # uneven shards at 2-4 ranks; pieces that end in partial blocks


def _run(comm, op, kind, gather, dtype, steps=2, nonblocking=False, hierarchy="flat",
         values=grads):
    """The results and the residuals of ``steps`` calls, and the trace of the
    last call."""
    fb = mpigc.ErrorFeedback()
    outs = []
    for s in range(steps):
        x = values(comm.rank, N, dtype, seed=s)
        f = getattr(mpigc, ("i" if nonblocking else "") + kind)
        kw = {"gather": gather} if kind == "allreduce" else {}
        res = f(x, op, key="k", feedback=fb, hierarchy=hierarchy, **kw)
        if nonblocking:
            res = res.wait()
        outs.append(np.asarray(res).tobytes())
    return outs, state_bytes(fb), mpigc.diagnostics.last_trace()


OPS = {"2bit": "2bit", "1bit": {"id": "1bit", "block_size": 64}, "terngrad": "terngrad",
       "fp16": "fp16"}


@pytest.mark.mpi
@pytest.mark.parametrize("limit", [1, 13])
@pytest.mark.parametrize("name", list(OPS))
@pytest.mark.parametrize("kind,gather,chunk", [("allreduce", "compressed", 0),
                                               ("allreduce", "exact", 0),
                                               ("allreduce", "exact", 2048),
                                               ("allreduce", "compressed", 2048),
                                               ("reduce_scatter", "compressed", 0)])
def test_messages_beyond_the_count_limit(comm, monkeypatch, typed, limit, name, kind, gather,
                                         chunk):
    """With the count limit lowered to ``limit`` bytes, every payload message
    is one element of a datatype of many blocks (and a rest): the results
    and residuals are the same bits as under the real limit, pipelined or
    not."""
    monkeypatch.setenv("MPIGC_CHUNK_BYTES", str(chunk))
    # phase 1 after the agreement, not with the rows (whose messages are small)
    monkeypatch.setenv("MPIGC_INLINE_PAYLOAD_BYTES", "0")
    dtype = np.float64 if gather == "exact" else np.float32
    ref = _run(comm, OPS[name], kind, gather, dtype)
    assert_all(typed[0] == 0, "a message of the reference run was typed")
    pipelined = chunk > 0 and name != "terngrad"  # terngrad is never pipelined
    assert_all(comm.size == 1 or (not ref[2].inline and (ref[2].chunks > 0) == pipelined),
               f"not the path under test: {ref[2]}")
    monkeypatch.setenv("MPIGC_MAX_COUNT", str(limit))
    got = _run(comm, OPS[name], kind, gather, dtype)
    assert_all(comm.size == 1 or typed[0] > 0, "no message took the typed path")
    assert_all(got[0] == ref[0], "results differ from the call under the real limit")
    assert_all(got[1] == ref[1], "residuals differ from the call under the real limit")


def _integers(rank, n, dtype, seed=0):
    """Integer values: their sums are exact in any order, so a sum in pieces
    (other messages, maybe another algorithm in MPI) has the bits of one
    sum."""
    rng = np.random.default_rng([seed, rank])
    return rng.integers(-1000, 1000, n).astype(dtype)


@pytest.mark.mpi
@pytest.mark.parametrize("nonblocking", [False, True])
@pytest.mark.parametrize("kind", ["allreduce", "reduce_scatter"])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_none_beyond_the_count_limit(comm, monkeypatch, kind, dtype, nonblocking):
    """op="none" with the limit lowered to 61 elements: the call is summed in
    pieces (allreduce: 50 slices; reduce_scatter: a reduction to its owner
    per piece of each shard), with the bits of the call summed at once."""
    ref = _run(comm, "none", kind, "compressed", dtype, nonblocking=nonblocking,
               values=_integers)
    monkeypatch.setenv("MPIGC_MAX_COUNT", "61")
    got = _run(comm, "none", kind, "compressed", dtype, nonblocking=nonblocking,
               values=_integers)
    # the values travel with the rows at 2 ranks (allreduce), except on the
    # short path up to 16 KiB (its row alone, then MPI's sum: docs/wire-format.md)
    t, inline = got[2], ref[2].inline
    assert_all(not inline or (comm.size == 2 and kind == "allreduce"), f"reference: {ref[2]}")
    assert_all(t.path == "plain" and t.inline == inline, f"not the path under test: {t}")
    assert_all(inline or comm.size == 1 or t.sum_pieces == 50, f"{t.sum_pieces} pieces")
    assert_all(ref[2].sum_pieces == (0 if inline else 1), f"reference: {ref[2]}")
    assert_all(got[0] == ref[0], "results differ from the call summed at once")


@pytest.mark.mpi
@pytest.mark.parametrize("nonblocking", [False, True])
@pytest.mark.parametrize("kind", ["allreduce", "reduce_scatter"])
def test_ranks_that_cut_none_sums_differently_disagree(comm, monkeypatch, kind, nonblocking):
    """A count limit set on some ranks only: they would sum op="none" in
    another number of pieces (other collectives) than their peers and wait
    for ever. The pieces are part of the settings, so every rank raises
    MismatchError naming them, and the next call on the same buffer runs."""
    if comm.size == 1:
        pytest.skip("one rank agrees with itself")
    if comm.rank == 0:
        monkeypatch.setenv("MPIGC_MAX_COUNT", "61")
    f = getattr(mpigc, ("i" if nonblocking else "") + kind)
    x = _integers(comm.rank, N, np.float32)
    with pytest.raises(mpigc.MismatchError, match="sum_pieces"):
        r = f(x.copy(), "none")
        if nonblocking:
            r.wait()
    monkeypatch.delenv("MPIGC_MAX_COUNT", raising=False)
    got = f(x.copy(), "none")
    got = np.asarray(got.wait() if nonblocking else got)
    want = comm.allreduce(x.astype(np.float64))
    lo, hi = (0, N) if kind == "allreduce" else mpigc.shard_bounds(N, comm.size)[comm.rank]
    assert_all(np.array_equal(got, want[lo:hi].astype(np.float32)), "next call wrong")


@pytest.mark.mpi
def test_hierarchical_call_beyond_the_count_limit(comm, monkeypatch, typed):
    """The inter-node calls of a hierarchical call take the typed path too."""
    monkeypatch.setenv("MPIGC_NODE_SPLIT", "2")
    monkeypatch.setenv("MPIGC_CHUNK_BYTES", "0")
    ref = _run(comm, "2bit", "allreduce", "compressed", np.float32, hierarchy="node")
    monkeypatch.setenv("MPIGC_MAX_COUNT", "7")
    got = _run(comm, "2bit", "allreduce", "compressed", np.float32, hierarchy="node")
    assert_all(comm.size < 3 or typed[0] > 0, "no message took the typed path")
    assert_all(got[:2] == ref[:2], "differs from the call under the real limit")


# -- the real thing (opt-in) ------------------------------------------------------
LARGE = os.environ.get("MPIGC_TEST_LARGE", "") == "1"


def _pattern(rank, lo, hi, scale):
    """Values in {-scale, 0, scale} that 2bit (threshold = scale) and
    terngrad (scale = max |g| = scale) carry exactly, different per rank and
    per position (a piece misplaced by any offset shows)."""
    i = np.arange(lo, hi, dtype=np.uint64) + np.uint64(rank * 1000003)
    h = (i * np.uint64(2654435761)) >> np.uint64(11)
    return ((h % np.uint64(3)).astype(np.int8) - 1).astype(np.float64) * scale


@pytest.mark.mpi
@pytest.mark.skipif(not LARGE, reason="set MPIGC_TEST_LARGE=1 (about 7 GB per rank)")
@pytest.mark.parametrize("op,scale,chunk", [("terngrad", 1.0, None), ("2bit", 0.5, "0")])
def test_shards_beyond_2gib(comm, monkeypatch, op, scale, chunk):
    """gather="exact" on float64 shards of 2**31 + 8 MiB bytes: each owner
    sends its shard to every peer in one message above 2**31 bytes. Values
    the compressors carry exactly, so the result is the exact sum of every
    rank's values, checked piece by piece (no second buffer)."""
    if comm.size < 2:
        pytest.skip("needs a peer: one rank sends nothing")
    if chunk is not None:
        monkeypatch.setenv("MPIGC_CHUNK_BYTES", chunk)
    m = (1 << 28) + (1 << 20)  # float64 values per shard: 2**31 + 8 MiB bytes
    n = comm.size * m
    step = 1 << 24
    x = np.empty(n, np.float64)
    for a in range(0, n, step):
        x[a:a + step] = _pattern(comm.rank, a, min(n, a + step), scale)
    t0 = time.perf_counter()
    why = None
    try:
        mpigc.allreduce(x, op, feedback=False, gather="exact")
    except Exception as e:  # noqa: BLE001 - compared across ranks
        why = f"{type(e).__name__}: {e}"
    took = time.perf_counter() - t0
    if why is None:
        for a in range(0, n, step):
            b = min(n, a + step)
            want = sum(_pattern(r, a, b, scale) for r in range(comm.size))
            if not np.array_equal(x[a:b], want):
                why = f"elements [{a}, {b}) differ from the exact sum"
                break
    import resource
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"\n{op}: {n} float64 ({x.nbytes / 2**30:.2f} GiB per rank) in {took:.1f} s; "
          f"peak RSS of rank {comm.rank}: {peak:.2f} GiB")
    del x
    assert_all(why is None, why, comm)
