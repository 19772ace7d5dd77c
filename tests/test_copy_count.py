"""kernels.cpu.copy_count_nonfinite: the values of an agreement message
copied and their non-finite values counted in one pass (issue 51, per-call
cost at 1 MiB): the copy is the bits of the input, NaN payloads, signs and
signalling NaNs included, and the count is count_nonfinite's, serial and
parallel."""
import numpy as np
import pytest

from mpigc.kernels import cpu

_HDR = 80  # where the values start in an agreement message (mpigc._plan.ROW_BYTES)


def _planted(dtype, n, seed):
    """``n`` random values of ``dtype`` with NaNs of several payloads and
    signs, infinities of both signs, the largest finite values and zeros."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n).astype(dtype)
    ut = {2: np.uint16, 4: np.uint32, 8: np.uint64}[x.dtype.itemsize]
    bits = x.view(ut)
    fin = np.finfo(dtype)
    special = [np.inf, -np.inf, np.nan, -np.nan, fin.max, -fin.max, 0.0, -0.0, fin.tiny]
    at = rng.choice(n, size=min(n, 3 * len(special)), replace=False)
    for k, i in enumerate(at):
        x[i] = special[k % len(special)]
    # NaNs with other payloads (a signalling one among them): exponent all
    # ones, a mantissa bit set
    nexp = {2: 5, 4: 8, 8: 11}[x.dtype.itemsize]
    nbits = 8 * x.dtype.itemsize
    exp = ((1 << nexp) - 1) << (nbits - 1 - nexp)
    for k, i in enumerate(rng.choice(n, size=min(n, 4), replace=False)):
        bits[i] = ut(exp | (1 << k) | ((k & 1) << (nbits - 1)))
    return x


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("n", [1, 7, 1024, 1000003])
def test_copies_the_bits_and_counts_as_count_nonfinite(dtype, n):
    x = _planted(dtype, n, n)
    msg = np.full(_HDR + x.nbytes, 0xAB, np.uint8)
    nbad = cpu.copy_count_nonfinite(x, msg[_HDR:])
    if dtype != np.float16:  # count_nonfinite (Numba) takes float32 and float64
        assert nbad == cpu.count_nonfinite(x)
    assert nbad == int(np.count_nonzero(~np.isfinite(x)))
    assert msg[_HDR:].tobytes() == x.tobytes()
    assert (msg[:_HDR] == 0xAB).all()  # nothing written before the values


def test_all_finite_counts_zero_at_every_size_the_chunks_cut():
    # sizes around the parallel cut and its chunk boundaries
    for n in (cpu.PARALLEL_MIN_ELEMENTS - 1, cpu.PARALLEL_MIN_ELEMENTS,
              cpu.PARALLEL_MIN_ELEMENTS + 33):
        x = np.arange(n, dtype=np.float32)
        out = np.empty(x.nbytes, np.uint8)
        assert cpu.copy_count_nonfinite(x, out) == 0
        assert out.tobytes() == x.tobytes()
        x[-1] = np.nan
        assert cpu.copy_count_nonfinite(x, out) == 1
