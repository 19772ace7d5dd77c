# usage: mpirun -n 2 python benchmarks/grouped.py [ITERS] [--device]
# Grouped calls (issue 31): medians over the slowest rank of interleaved calls,
#  - 64 arrays of 4 KiB, op="none": one grouped call, 64 single calls, one
#    single call on a 256 KiB buffer, one comm.Allreduce of 256 KiB and, on 2
#    ranks, the Python floor of 256 KiB (one Sendrecv with the peer, np.add);
#  - 64 arrays of 64 KiB, op="2bit": one grouped call, 64 single calls, and one
#    single call on a 4 MiB buffer.
# Prints each time and the ratios the issue names. With --device the mpigc
# calls take Numba CUDA device arrays (comm.Allreduce stays on host memory)
# and each timed call ends with cuda.synchronize(). With $MPIGC_OLD_TREE (a
# directory holding another mpigc/ package, its kernels/ copied in, as for
# benchmarks/percall.py's "both"), that package's grouped calls are timed too,
# interleaved with this one's ("old group ..."): before and after in one run.
import os
import sys
import time

import numpy as np
from mpi4py import MPI

import mpigc

old_mpigc = None
if os.environ.get("MPIGC_OLD_TREE"):
    import oldtree
    old_mpigc = oldtree.load(os.environ["MPIGC_OLD_TREE"])
comm = MPI.COMM_WORLD
args = [a for a in sys.argv[1:] if a != "--device"]
DEVICE = "--device" in sys.argv[1:]
ITERS = int(args[0]) if args else 200
rng = np.random.default_rng(comm.rank)
if DEVICE:
    from numba import cuda
    place, sync = cuda.to_device, cuda.synchronize
else:
    def place(a):
        return a

    def sync():
        pass


def timed(fns, n, warmup=5):
    for _ in range(warmup):
        for _, fn in fns:
            fn()
    ts = {k: [] for k, _ in fns}
    for i in range(n):
        # every other iteration in reverse order: no entry always runs after
        # the same one (the old tree's, last, ran 0.82x the new one's
        # identical op="none" group in fixed order)
        for name, fn in (fns if i % 2 == 0 else fns[::-1]):
            comm.Barrier()
            t = time.perf_counter()
            fn()
            sync()
            ts[name].append(time.perf_counter() - t)
    mins.update({k: comm.allreduce(np.min(v) * 1e6, op=MPI.MAX) for k, v in ts.items()})
    return {k: comm.allreduce(np.median(v) * 1e6, op=MPI.MAX) for k, v in ts.items()}


mins = {}  # the minima over the slowest rank, as timed() leaves them
load = [os.getloadavg()[0]]  # the 1-minute load at the start and at the end


small = [place(np.zeros(1024, np.float32)) for _ in range(64)]
fused = np.zeros(64 * 1024, np.float32)
fused_in = place(fused.copy())
floor = []
if comm.size == 2:  # the Python floor of a 2-rank allreduce: Sendrecv, then np.add
    tmp = np.empty_like(fused)

    def floor_256k():
        comm.Sendrecv(fused, 1 - comm.rank, recvbuf=tmp, source=1 - comm.rank)
        np.add(fused, tmp, out=fused)
    floor = [("floor 256K", floor_256k)]
t = timed(floor + [("mpi 256K", lambda: comm.Allreduce(MPI.IN_PLACE, fused, op=MPI.SUM)),
           ("group none 64x4K", lambda: mpigc.allreduce(small, op="none")),
           ("one none 256K", lambda: mpigc.allreduce(fused_in, op="none")),
           ("64 none 4K", lambda: [mpigc.allreduce(a, op="none", key=f"s{i}")
                                   for i, a in enumerate(small)])]
          + ([("old group none 64x4K", lambda: old_mpigc.allreduce(small, op="none"))]
             if old_mpigc is not None else []), ITERS)
big = [rng.standard_normal(16384).astype(np.float32) for _ in range(64)]
one = place(np.concatenate(big))
big = [place(a) for a in big]
keys = [f"b{i}" for i in range(64)]
# the old tree's members of their own: sums in place double the values at
# every call, and a third doubling per iteration overflows float32 in 1000
big_old = [a.copy() for a in big]
t.update(timed([("group 2bit 64x64K", lambda: mpigc.allreduce(big, op="2bit", key=keys)),
                ("one 2bit 4M", lambda: mpigc.allreduce(one, op="2bit", key="one")),
                ("64 2bit 64K", lambda: [mpigc.allreduce(a, op="2bit", key=f"c{i}")
                                         for i, a in enumerate(big)])]
               + ([("old group 2bit 64x64K",
                    lambda: old_mpigc.allreduce(big_old, op="2bit",
                                                key=[k + "o" for k in keys]))]
                  if old_mpigc is not None else []),
               max(ITERS // 20, 5)))
load.append(os.getloadavg()[0])
if comm.rank == 0:
    print(f"{comm.size} ranks{', device arrays' if DEVICE else ''}, medians (us) over the"
          f" slowest rank; load {load[0]:.1f} -> {load[1]:.1f}")
    for k, v in t.items():
        print(f"  {k:20s} {v:10.1f}")
    print(f"group none 64x4K / comm.Allreduce 256K: {t['group none 64x4K'] / t['mpi 256K']:.2f}x"
          " (target <= 1.5)")
    if "floor 256K" in t:
        print(f"group none 64x4K / floor 256K: {t['group none 64x4K'] / t['floor 256K']:.2f}x"
              " (target <= 1.5)")
    print(f"one none 256K / comm.Allreduce 256K: {t['one none 256K'] / t['mpi 256K']:.2f}x")
    print(f"64 single none 4K / group: {t['64 none 4K'] / t['group none 64x4K']:.1f}x")
    print(f"64 single 2bit 64K / group 2bit 64x64K: "
          f"{t['64 2bit 64K'] / t['group 2bit 64x64K']:.1f}x (target >= 5)")
    print(f"group 2bit 64x64K / one 2bit 4M: {t['group 2bit 64x64K'] / t['one 2bit 4M']:.2f}x")
    if old_mpigc is not None:
        for k in ("group none 64x4K", "group 2bit 64x64K"):
            print(f"{k}: median old {t['old ' + k]:.1f} us, new {t[k]:.1f} us "
                  f"({t[k] / t['old ' + k]:.2f}x); min old {mins['old ' + k]:.1f}, new "
                  f"{mins[k]:.1f} ({mins[k] / mins['old ' + k]:.2f}x)"
                  + (f"; / floor 256K: old {t['old ' + k] / t['floor 256K']:.2f}x, new "
                     f"{t[k] / t['floor 256K']:.2f}x" if "floor 256K" in t and "none" in k else ""))
