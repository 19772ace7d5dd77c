"""A plain sum (``op="none"``, the small-buffer fallback) under
``nonfinite="ignore"`` gives the bits of ``comm.Allreduce`` on every rank,
NaN payloads and signs included (issue 50, item 3).

IEEE addition commutes bit for bit except where both operands are NaN: the
CPU then returns the first operand's payload and sign. On 2 ranks the values
of a call up to ``$MPIGC_INLINE_PLAIN_BYTES`` travel with the agreement rows,
and each rank used to add its peer's values to its own: rank 0 kept rank 0's
NaN, rank 1 rank 1's. Open MPI's own sum takes no single order either
(5.0.11, 2 ranks: the higher rank's value first below 4 KiB and from 8 to
16 KiB, recursive doubling; from 4 to 8 KiB and from 16 KiB each half first
by the rank that sums it, ring), so such a call is summed by MPI. Compared
with ``comm.Allreduce`` on a private duplicate, for payloads that differ per
rank and sign, at sizes of the short path (:mod:`mpigc._shortcall`), of the
engine's inline path (blocking with the short path off, nonblocking) and
beyond the inline limit (MPI's sum from the start). Rank counts: 1, 2 (the
inline paths), 3 and 4 (MPI's sum only)."""
import numpy as np
import pytest
from mpi4py import MPI

import mpigc
from mpigc import _reducer, _wire, diagnostics
from conftest import assert_all, grads

# ranks: 1, 2 the inline paths, 3 and 4 MPI's sum (its algorithm differs by count)
pytestmark = [pytest.mark.mpi, pytest.mark.ranks(1, 2, 3, 4)]

_BITS = {np.dtype(np.float32): (np.uint32, 31, 0x7fc00000, 0x7f800000),
         np.dtype(np.float64): (np.uint64, 63, 0x7ff8000000000000, 0x7ff0000000000000)}


def _nan(dtype, payload, negative, quiet=True):
    """The bits of a NaN of ``dtype`` with ``payload`` and sign (signalling
    when not ``quiet``: quiet bit clear, payload non-zero)."""
    it, sign, qnan, inf = _BITS[np.dtype(dtype)]
    return it((int(negative) << sign) | (qnan if quiet else inf) | payload)


def values(rank, size, n, dtype, seed=0):
    """Rank ``rank``'s values: numbers, and at positions spread over the
    buffer (both halves of MPI's ring on 2 ranks) one case each: a NaN on
    every rank, with a payload and sign per rank (rank 0 0x7fc00001, rank 1
    0xffc00002 in float32); a NaN on one rank, numbers on the others; inf on
    rank 0, -inf on rank 1; a signalling NaN per rank; a NaN on rank 0, inf on
    the others."""
    x = grads(rank, n, dtype, seed=seed)
    bits = x.view(_BITS[np.dtype(dtype)][0])
    at = sorted({0, n // 4, n // 2 - 1, n // 2, n // 2 + 1, 3 * n // 4, n - 2, n - 1} &
                set(range(n)))
    for i, k in enumerate(at):
        case = i % 5
        if case == 0:
            bits[k] = _nan(dtype, rank + 1, rank % 2)
        elif case == 1 and rank == k % size:
            bits[k] = _nan(dtype, 7, True)
        elif case == 2:
            x[k] = np.inf if rank == 0 else -np.inf if rank == 1 else 1.0
        elif case == 3:
            bits[k] = _nan(dtype, rank + 3, rank % 2 == 0, quiet=False)
        elif case == 4:
            if rank == 0:
                bits[k] = _nan(dtype, 5, False)
            else:
                x[k] = np.inf
    return x


@pytest.fixture(scope="module")
def dup():
    """A private duplicate of the world for the reference sums."""
    c = MPI.COMM_WORLD.Dup()
    yield c
    c.Free()


# elements: below 4 KiB, 4-8 KiB, 8-16 KiB, beyond 16 KiB (float32; float64:
# twice the bytes), the inline limit, one past it (MPI's sum from the start)
LIMIT = _wire.INLINE_PLAIN_MAX


def _sizes(dtype):
    s = np.dtype(dtype).itemsize
    return [1, 5, 600, 1500, 3000, 20000, LIMIT // s, LIMIT // s + 1]


def _want(dup, x, average):
    w = x.copy()
    dup.Allreduce(MPI.IN_PLACE, w, op=MPI.SUM)
    if average:
        with np.errstate(invalid="ignore"):  # a signalling NaN on 1 rank
            w /= dup.size
    return w


def _first(got, want):
    """Where ``got`` and ``want`` differ first, with both bit patterns."""
    it = _BITS[got.dtype][0]
    g, w = got.view(it), want.view(it)
    k = int(np.flatnonzero(g != w)[0])
    return f"element {k}: {int(g[k]):#x}, MPI {int(w[k]):#x}"


def _inline(comm, x):
    return comm.size == 2 and x.nbytes <= LIMIT


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("path", ["short", "engine", "nonblocking"])
def test_nan_payloads_are_those_of_mpi_allreduce(comm, dup, dtype, path, monkeypatch):
    """Every rank gets ``comm.Allreduce``'s bits, on the short path, the
    engine's inline path (blocking and nonblocking) and MPI's sum."""
    if path == "engine":
        monkeypatch.setenv("MPIGC_SHORT_PATH", "0")
    if path == "nonblocking" and not _reducer.Reducer.available():
        pytest.skip("no reduction thread: a nonblocking sum is MPI_Iallreduce's")
    for n in _sizes(dtype):
        for average in (False, True):
            x = values(comm.rank, comm.size, n, dtype, seed=n)
            want = _want(dup, x, average)
            if path == "nonblocking":
                req = mpigc.iallreduce(x, op="none", key="nan", average=average,
                                       nonfinite="ignore")
                got, t = req.wait(), req.trace
            else:
                got = mpigc.allreduce(x, op="none", key="nan", average=average,
                                      nonfinite="ignore")
                t = diagnostics.last_trace()
            what = f"n={n} average={average}"
            assert_all(got is x, f"{what}: not the buffer")
            assert_all(t.inline == _inline(comm, x), f"{what}: trace {t}")
            same = x.tobytes() == want.tobytes()
            assert_all(same, same or f"{what}: not MPI's bits ({_first(x, want)})")


@pytest.mark.ranks(2)  # the short path is for 2 ranks (it skips at the others)
@pytest.mark.parametrize("short", ["rank 0", "rank 1"])
def test_either_path_on_either_rank(comm, dup, short, monkeypatch):
    """One rank on the short path, its peer on the engine's: the same bits."""
    if comm.size != 2:
        pytest.skip("the short path is for 2 ranks")
    if short != f"rank {comm.rank}":
        monkeypatch.setenv("MPIGC_SHORT_PATH", "0")
    for n in (5, 1500, 20000):
        x = values(comm.rank, 2, n, np.float32, seed=3)
        want = _want(dup, x, False)
        mpigc.allreduce(x, op="none", key="nan", nonfinite="ignore")
        assert_all(x.tobytes() == want.tobytes(), f"n={n}: not MPI's bits")


def test_small_buffer_fallback_too(comm, dup, monkeypatch):
    """A compressed op below ``$MPIGC_MIN_COMPRESS_BYTES`` is a plain sum:
    the same bits."""
    monkeypatch.setenv("MPIGC_MIN_COMPRESS_BYTES", "8192")
    for n in (5, 1000):
        x = values(comm.rank, comm.size, n, np.float64, seed=4)
        want = _want(dup, x, False)
        mpigc.allreduce(x, op="2bit", key="nan2", nonfinite="ignore")
        assert_all(x.tobytes() == want.tobytes(), f"n={n}: not MPI's bits")


def test_finite_values_keep_the_inline_sum(comm, dup):
    """Finite values under ``nonfinite="ignore"`` are still added on each
    rank (no MPI sum; on the short path where this process may take it),
    with MPI's bits."""
    for n in (5, 3000):
        x = grads(comm.rank, n, np.float32, seed=5)
        want = _want(dup, x, False)
        short = diagnostics.counters()["short_calls"]
        mpigc.allreduce(x, op="none", key="fin", nonfinite="ignore")
        t = diagnostics.last_trace()
        assert_all(x.tobytes() == want.tobytes(), f"n={n}: not MPI's bits")
        if comm.size == 2:
            assert_all((t.inline, t.sum_pieces) == (True, 0), f"n={n}: trace {t}")
            taken = diagnostics.counters()["short_calls"] - short
            assert_all(taken == (not diagnostics.several_threads()), f"short calls {taken}")
