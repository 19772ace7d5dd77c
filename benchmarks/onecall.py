# usage: onecall.py {new|old} -- the best mean time of 3000 back-to-back 4 KiB allreduce(op="none")
# calls (of 7 repetitions), slowest rank; "old" imports the mpigc package in $MPIGC_OLD_TREE
# (see benchmarks/ab.py). Run alone (python benchmarks/onecall.py new) or under mpirun.
import os, sys, time
if sys.argv[1] == "old":
    sys.meta_path = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
    sys.path.insert(0, os.environ["MPIGC_OLD_TREE"])
import numpy as np
import mpigc
from mpi4py import MPI
comm = MPI.COMM_WORLD
buf = np.zeros(1024, np.float32)
for _ in range(500):
    mpigc.allreduce(buf, op="none", key="k")
best = []
for rep in range(7):
    comm.Barrier()
    t = time.perf_counter()
    for _ in range(3000):
        mpigc.allreduce(buf, op="none", key="k")
    best.append((time.perf_counter() - t) / 3000 * 1e6)
t = comm.allreduce(min(best), op=MPI.MAX)
if comm.rank == 0:
    print(sys.argv[1], f"{t:.1f} us")
