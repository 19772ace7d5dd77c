# usage: percall.py {new|old} ITERS [compressed]  -- per-call time of mpigc.allreduce, interleaved
# per iteration. Default: op="none" (and the 2bit plain fallback at 4 KiB) against comm.Allreduce
# at 4 KiB, 64 KiB and 1 MiB, medians and minima over the slowest rank. "compressed": the medians
# on rank 0 of 2bit, 1bit, terngrad and nonblocking 2bit at 16 KiB, 256 KiB and 4 MiB (ITERS
# calls each, ITERS / 20 at 4 MiB). "new" also times op="none" with the short path of small
# calls off (none-engine: $MPIGC_SHORT_PATH=0). "old" imports the mpigc package found in
# $MPIGC_OLD_TREE (a directory holding an mpigc/ package, its kernels/ copied in) instead of
# the installed one.
import os
import sys
if sys.argv[1] == "old":
    sys.meta_path = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
    sys.path.insert(0, os.environ["MPIGC_OLD_TREE"])
import time
import numpy as np
from mpi4py import MPI
import mpigc
comm = MPI.COMM_WORLD
N = int(sys.argv[2])
compressed = sys.argv[3:] == ["compressed"]
if comm.rank == 0:
    print(sys.argv[1], mpigc.__file__)


def timed(fns, n, warmup):
    for _ in range(warmup):
        for _, fn in fns:
            fn()
    ts = {k: [] for k, _ in fns}
    for i in range(n):
        for name, fn in fns:
            comm.Barrier()
            t = time.perf_counter()
            fn()
            ts[name].append(time.perf_counter() - t)
    return ts


if compressed:
    rng = np.random.default_rng(comm.rank)
    for size in (16384, 262144, 4 << 20):
        buf = rng.standard_normal(size // 4).astype(np.float32)
        fns = [(op, (lambda op=op, size=size: mpigc.allreduce(buf, op=op, key=f"k{op}{size}")))
               for op in ("2bit", "1bit", "terngrad")]
        fns.append(("2bit-nb", lambda size=size: mpigc.iallreduce(buf, op="2bit",
                                                                   key=f"nb{size}").wait()))
        ts = timed(fns, N if size < 1 << 20 else max(N // 20, 10), 5)
        if comm.rank == 0:
            print(size, " ".join(f"{k} {np.median(v) * 1e6:.1f}" for k, v in ts.items()),
                  flush=True)
    sys.exit(0)


def engine_path(fn):
    """``fn`` with the short path of small calls off ($MPIGC_SHORT_PATH=0,
    read at each call; setting and removing the variable is part of the
    time, a microsecond or two)."""
    def g():
        os.environ["MPIGC_SHORT_PATH"] = "0"
        try:
            fn()
        finally:
            del os.environ["MPIGC_SHORT_PATH"]
    return g


for size in (4096, 65536, 1 << 20):
    buf = np.zeros(size // 4, np.float32)
    fns = [("mpi", lambda: comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)),
           ("none", lambda: mpigc.allreduce(buf, op="none", key="k"))]
    if sys.argv[1] == "new":  # the same calls on the engine's path (no short path)
        fns.append(("none-engine", engine_path(lambda: mpigc.allreduce(buf, op="none",
                                                                       key="k"))))
    if size == 4096:  # below the default cutoff (8192 bytes): the plain fallback
        fns.append(("2bit", lambda: mpigc.allreduce(buf, op="2bit", key="k2")))
    ts = timed(fns, N, 20)
    med = {k: comm.allreduce(np.median(v) * 1e6, op=MPI.MAX) for k, v in ts.items()}
    mn = {k: comm.allreduce(np.min(v) * 1e6, op=MPI.MAX) for k, v in ts.items()}
    if comm.rank == 0:
        print(f"{size:>8} B median: " + "  ".join(
            f"{k} {v:8.1f} us ({v / med['mpi']:.2f}x)" for k, v in med.items())
            + "   min: " + "  ".join(f"{k} {v:.1f}" for k, v in mn.items()))
