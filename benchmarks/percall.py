# usage: percall_ab.py {new|old} ITERS  -- per-call time of mpigc.allreduce vs comm.Allreduce,
# interleaved per iteration, 2 ranks; "old" imports the mpigc package found in $MPIGC_OLD_TREE (a directory holding an mpigc/ package, its kernels/ linked in) instead of the installed one
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
if comm.rank == 0:
    print(sys.argv[1], mpigc.__file__)
for size in (4096, 65536, 1 << 20):
    buf = np.zeros(size // 4, np.float32)
    fns = [("mpi", lambda: comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)),
           ("none", lambda: mpigc.allreduce(buf, op="none", key="k"))]
    if size == 4096:  # below the default cutoff (8192 bytes): the plain fallback
        fns.append(("2bit", lambda: mpigc.allreduce(buf, op="2bit", key="k2")))
    for _ in range(20):
        for _, fn in fns:
            fn()
    ts = {k: [] for k, _ in fns}
    for i in range(N):
        for name, fn in fns:
            comm.Barrier()
            t = time.perf_counter()
            fn()
            ts[name].append(time.perf_counter() - t)
    med = {k: comm.allreduce(np.median(v) * 1e6, op=MPI.MAX) for k, v in ts.items()}
    mn = {k: comm.allreduce(np.min(v) * 1e6, op=MPI.MAX) for k, v in ts.items()}
    if comm.rank == 0:
        print(f"{size:>8} B median: " + "  ".join(
            f"{k} {v:8.1f} us ({v / med['mpi']:.2f}x)" for k, v in med.items())
            + "   min: " + "  ".join(f"{k} {v:.1f}" for k, v in mn.items()))
