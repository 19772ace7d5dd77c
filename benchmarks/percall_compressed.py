# usage: percall_compressed.py {new|old} ITERS -- median per-call time of compressed
# allreduce (2bit, 1bit, terngrad, nonblocking 2bit) at 16 KiB, 256 KiB and 4 MiB, interleaved
# per iteration, rank 0 printing; "old" imports the mpigc package in $MPIGC_OLD_TREE.
import os, sys
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
rng = np.random.default_rng(comm.rank)
for size in (16384, 262144, 4 << 20):
    buf = rng.standard_normal(size // 4).astype(np.float32)
    fns = [(op, (lambda op=op, size=size: mpigc.allreduce(buf, op=op, key=f"k{op}{size}")))
           for op in ("2bit", "1bit", "terngrad")]
    fns.append(("2bit-nb", lambda: mpigc.iallreduce(buf, op="2bit", key=f"nb{size}").wait()))
    for _ in range(5):
        for _, fn in fns:
            fn()
    ts = {k: [] for k, _ in fns}
    n = N if size < 1 << 20 else max(N // 20, 10)
    for i in range(n):
        for name, fn in fns:
            comm.Barrier()
            t = time.perf_counter()
            fn()
            ts[name].append(time.perf_counter() - t)
    if comm.rank == 0:
        print(size, " ".join(f"{k} {np.median(v)*1e6:.1f}" for k, v in ts.items()), flush=True)
