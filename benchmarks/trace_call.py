# usage: trace_call.py OUT.json [--op 2bit] [--size 32M] [--calls 3] [--warmup 2]
# The timeline (mpigc.timeline) of a few identical allreduce calls, one after the other with
# a barrier between them, after warm-up calls that are not recorded: each rank's file next to
# OUT.json (OUT.rank<r>.json), merged into OUT.json by rank 0. Prints each call's time on the
# slowest rank, and each rank's CPU time per call (user and system, all of its threads). Run it under mpirun (and benchmarks/fabric.sh for a shaped network).
import argparse
import resource
import time

import numpy as np
from mpi4py import MPI

import mpigc
from mpigc.bench import parse_size

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("--op", default="2bit")
ap.add_argument("--size", type=parse_size, default=32 << 20)
ap.add_argument("--calls", type=int, default=3)
ap.add_argument("--warmup", type=int, default=2)
a = ap.parse_args()
comm = MPI.COMM_WORLD
x = np.random.default_rng(comm.rank).standard_normal(a.size // 4).astype(np.float32)
buf = x.copy()
for _ in range(a.warmup):
    buf[:] = x
    mpigc.allreduce(buf, op=a.op, key="traced")
mpigc.timeline.start(a.out)
times = []
ru0 = resource.getrusage(resource.RUSAGE_SELF)
for _ in range(a.calls):
    buf[:] = x
    comm.Barrier()
    t = time.perf_counter()
    mpigc.allreduce(buf, op=a.op, key="traced")
    times.append(comm.allreduce(time.perf_counter() - t, op=MPI.MAX))
ru1 = resource.getrusage(resource.RUSAGE_SELF)
cpu = comm.gather(((ru1.ru_utime - ru0.ru_utime) / a.calls, (ru1.ru_stime - ru0.ru_stime) / a.calls),
                  root=0)
files = comm.gather(mpigc.timeline.stop(), root=0)
if comm.rank == 0:
    print("CPU per call and rank (user + system, ms): "
          + ", ".join(f"{u * 1e3:.1f} + {s * 1e3:.1f}" for u, s in cpu))
    n = mpigc.timeline.merge(files, a.out)
    print(f"{a.op} {a.size} B, {comm.size} ranks: calls {', '.join(f'{t * 1e3:.1f}' for t in times)} ms "
          f"(median {np.median(times) * 1e3:.1f}); {n} events in {a.out}")
