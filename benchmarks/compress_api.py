"""The kernel-level ``Compressor.compress(x, residual=e)`` against ``numpy.add``.

    NUMBA_NUM_THREADS=1 MPIGC_NUM_THREADS=1 python benchmarks/compress_api.py

64 MiB float32, best of 7, twice. Prints the times of ``numpy.add(x, e, out=y)``
(the memory-traffic floor of reading x and e once), of ``compress`` with the
default ``check_finite=True`` (two passes: pack and count, then pack and update
``e`` in place), of the previous form of that call (a fresh scratch residual,
then a copy into ``e``) and of ``check_finite=False`` (one in-place pass), each
as a ratio to ``numpy.add``.
"""
import time

import numpy as np

import mpigc

n = 16 << 20  # 64 MiB of float32
rng = np.random.default_rng(0)
x = rng.standard_normal(n).astype(np.float32)
e = (0.1 * rng.standard_normal(n)).astype(np.float32)
y = np.empty_like(x)
c = mpigc.get_compressor("2bit")
out = np.empty(c.payload_nbytes(n), np.uint8)


def scratch_form():
    eo = np.empty_like(e)
    c.encode_into(x, e, eo, out)
    e[...] = eo


def best(f, k=7):
    ts = []
    for _ in range(k):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return min(ts)


c.compress(x, residual=e, out=out)  # compile
scratch_form()
c.compress(x, residual=e, out=out, check_finite=False)
for _ in range(2):
    ta = best(lambda: np.add(x, e, out=y))
    tn = best(lambda: c.compress(x, residual=e, out=out))
    to = best(scratch_form)
    tf = best(lambda: c.compress(x, residual=e, out=out, check_finite=False))
    print(f"numpy.add {ta * 1e3:.1f} ms | compress(check_finite=True) {tn * 1e3:.1f} ms = "
          f"{tn / ta:.2f}x | scratch residual + copy {to * 1e3:.1f} ms = {to / ta:.2f}x | "
          f"check_finite=False {tf * 1e3:.1f} ms = {tf / ta:.2f}x")
