# usage: mpirun -n K python benchmarks/threadmode.py [ITERS]
# What the one-thread mode saves (docs/engine.md, rule 3): blocking calls timed with
# waits that block in MPI (one user thread) against the same calls with waits that poll
# and give the engine lock up (the mode of several user threads, forced here by setting
# mpigc._sched's flag between calls; both ranks switch together). Interleaved, medians
# over the slowest rank; op="none" at 4 KiB, 64 KiB and 1 MiB, 2bit at 1 and 4 MiB.
import sys
import time

import numpy as np
from mpi4py import MPI

import mpigc
from mpigc import _sched

comm = MPI.COMM_WORLD
N = int(sys.argv[1]) if len(sys.argv) > 1 else 400


def timed(fns, n):
    ts = {k: [] for k, _ in fns}
    for i in range(n + 5):
        for name, fn in fns:
            comm.Barrier()
            t = time.perf_counter()
            fn()
            if i >= 5:
                ts[name].append(time.perf_counter() - t)
    return ts


def in_mode(fn, several):
    def g():
        _sched._several = several  # a benchmark's switch, not an API
        fn()
    return g


for size, op, n in ((4096, "none", N), (65536, "none", N), (1 << 20, "none", N // 4),
                    (1 << 20, "2bit", N // 4), (4 << 20, "2bit", N // 20)):
    buf = np.zeros(size // 4, np.float32)  # zeros: the in-place sums stay finite
    fns = [(m, in_mode(lambda: mpigc.allreduce(buf, op=op, key=f"k{size}{op}"), m == "poll"))
           for m in ("block", "poll")]
    med = {k: comm.allreduce(float(np.median(v)), op=MPI.MAX) for k, v in timed(fns, n).items()}
    if comm.rank == 0:
        print(f"{size:>8} {op:<5} block {med['block'] * 1e6:9.1f} us  poll "
              f"{med['poll'] * 1e6:9.1f} us  poll/block {med['poll'] / med['block']:.2f}",
              flush=True)
_sched._several = False
