"""Single-node benchmark of the mpigc CPU kernels against memory speed.

Times each kernel of ``mpigc.kernels.cpu`` on one buffer (best of several
repetitions, after a warm-up call that also triggers JIT compilation) and prints
a table: kernel, milliseconds, GB/s (bytes the kernel must read and write,
divided by the time) and the ratio to ``numpy.add(x, e, out=y)`` on a buffer of
the same size, measured in the same run. ``numpy.add`` reads two arrays and
writes one, which is what a fused "quantize x + e, write the residual" kernel
has to do, so it stands for memory speed. The "(e_out new)" rows write the
residual to a second buffer (double buffering), one more stream than in place.

Run::

    python benchmarks/bench_kernels.py --mb 64 --threads 1

The target for the ``2bit`` (both modes) and ``1bit`` fused kernels (compress + error
feedback, decode + accumulate) is a ratio of at most 1.2 on one thread. Other
processes on the machine make timings noisy: raise ``--reps`` and compare the
best-of-N numbers, not single runs.
"""
import argparse
import time

import numba
import numpy as np

from mpigc.kernels import cpu


def _best_ms(fn, reps, setup=None):
    if setup is not None:
        setup()
    fn()  # warm-up (and compilation)
    best = float("inf")
    for _ in range(reps):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=float, default=64.0,
                    help="buffer size in MB (default 64)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    ap.add_argument("--threads", type=int, default=1,
                    help="numba threads (default 1); >1 uses the parallel kernels "
                         "for buffers of at least cpu.PARALLEL_MIN_ELEMENTS")
    ap.add_argument("--reps", type=int, default=7, help="repetitions, best kept")
    ap.add_argument("--block-size", type=int, default=1024, help="1bit block size")
    ap.add_argument("--threshold", type=float, default=0.5, help="2bit threshold")
    ap.add_argument("--rel-threshold", type=float, default=1.5,
                    help="2bit relative mode: multiple of each block's RMS")
    ap.add_argument("--rel-block-size", type=int, default=1024,
                    help="2bit relative mode: block size")
    args = ap.parse_args(argv)

    numba.set_num_threads(args.threads)
    dt = np.dtype(args.dtype)
    n = int(args.mb * 1e6) // dt.itemsize
    rng = np.random.default_rng(0)
    g = rng.standard_normal(n).astype(dt)
    e0 = (rng.standard_normal(n) * 0.3).astype(dt)
    e = e0.copy()
    e_new = np.empty_like(e0)  # double-buffered residual (e_out is not e_in)
    y = np.empty_like(g)
    acc = np.zeros_like(g)
    nbytes = n * dt.itemsize
    t = args.threshold
    bs = args.block_size
    p2 = np.empty((n + 3) // 4, np.uint8)
    p1 = np.empty((n + 7) // 8, np.uint8)
    means = np.empty(2 * ((n + bs - 1) // bs), np.float32)
    h16 = np.empty(n, np.uint16)
    rc, rbs = args.rel_threshold, args.rel_block_size
    scales = np.empty((n + rbs - 1) // rbs, np.float32)
    reset = lambda: np.copyto(e, e0)  # noqa: E731  keep residuals realistic

    rows = []  # (name, ms, bytes moved)
    base = _best_ms(lambda: np.add(g, e, out=y), args.reps)
    rows.append(("numpy.add(x, e, out=y)", base, 3 * nbytes))
    cpu.pack_2bit(g, e, e, p2, t)

    def ternary():
        s, ss, amax, _ = cpu.stats(g, e)
        cpu.pack_ternary(g, e, e, p2, np.float32(amax), np.inf, 12345, 0)

    def stats():
        cpu.stats(g, e)

    cases = [
        ("2bit pack+EF (in place)", lambda: cpu.pack_2bit(g, e, e, p2, t),
         3 * nbytes + n // 4),
        ("2bit pack+EF (e_out new)", lambda: cpu.pack_2bit(g, e, e_new, p2, t),
         4 * nbytes + n // 4),
        ("2bit decode+accumulate", lambda: cpu.unpack_2bit(p2, acc, t, True),
         2 * nbytes + n // 4),
        ("2bit rel pack+EF (in place)",
         lambda: cpu.pack_2bit_rel(g, e, e, p2, scales, rc, rbs), 3 * nbytes + n // 4),
        ("2bit rel pack+EF (e_out new)",
         lambda: cpu.pack_2bit_rel(g, e, e_new, p2, scales, rc, rbs), 4 * nbytes + n // 4),
        ("2bit rel decode+accumulate",
         lambda: cpu.unpack_2bit_rel(p2, scales, acc, rbs, True), 2 * nbytes + n // 4),
        ("1bit pack+EF (in place)", lambda: cpu.pack_1bit(g, e, e, p1, means, bs),
         3 * nbytes + n // 8),
        ("1bit pack+EF (e_out new)",
         lambda: cpu.pack_1bit(g, e, e_new, p1, means, bs), 4 * nbytes + n // 8),
        ("1bit decode+accumulate", lambda: cpu.unpack_1bit(p1, means, acc, bs, True),
         2 * nbytes + n // 8),
        ("terngrad stats", stats, 2 * nbytes),
        ("terngrad stats+pack+EF", ternary, 5 * nbytes + n // 4),
        ("fp16 pack+EF (in place)", lambda: cpu.pack_fp16(g, e, e, h16, 1.0),
         3 * nbytes + 2 * n),
        ("fp16 decode+accumulate", lambda: cpu.unpack_fp16(h16, acc, True),
         2 * nbytes + 2 * n),
        ("count_nonfinite", lambda: cpu.count_nonfinite(g), nbytes),
    ]
    for name, fn, moved in cases:
        rows.append((name, _best_ms(fn, args.reps, setup=reset), moved))

    print(f"# {n} {dt.name} elements ({nbytes / 1e6:.1f} MB), "
          f"{numba.get_num_threads()} thread(s), best of {args.reps}")
    print(f"{'kernel':<28} {'ms':>9} {'GB/s':>7} {'x numpy.add':>12}")
    for name, ms, moved in rows:
        print(f"{name:<28} {ms:9.2f} {moved / ms / 1e6:7.1f} {ms / base:12.2f}")


if __name__ == "__main__":
    main()
