"""Flat against hierarchical compressed allreduce, and MPI's own Allreduce.

    mpirun -n 4 python benchmarks/bench_hierarchy.py [--mib 32] [--reps 5]

Times (median of --reps, after one warm-up call; every call ends with a
barrier-free max over ranks of its wall time), and the CPU time of a call
summed over the ranks (median; it includes MPI's busy waiting: where it is
about cores x wall time, the calls are bound by the CPU, not the links), of: ``comm.Allreduce``
(float32 sum, whatever coll component Open MPI picked), flat and
hierarchical ``2bit`` and ``1bit`` (``hierarchy="flat"`` / ``"node"``), and the
ratios. Run it on the emulated cluster (``benchmarks/cluster.sh``) to get
nodes; ``$MPIGC_NODE_SPLIT`` emulates them on one machine.
"""
import argparse
import os
import socket
import time

import numpy as np
from mpi4py import MPI

import mpigc
from mpigc import _hierarchy


def timed(comm, fn, reps):
    fn()  # warm-up: JIT, buffers, connections
    out, cpu = [], []
    for _ in range(reps):
        comm.Barrier()
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        t1, c1 = time.perf_counter(), time.process_time()
        out.append(comm.allreduce(t1 - t0, op=MPI.MAX))
        cpu.append(comm.allreduce(c1 - c0, op=MPI.SUM))
    return float(np.median(out)), min(out), float(np.median(cpu))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=float, default=32)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--ops", default="mpi,flat-2bit,node-2bit,flat-1bit,node-1bit")
    a = p.parse_args()
    comm = MPI.COMM_WORLD
    n = int(a.mib * 2**20) // 4
    g = np.random.default_rng(comm.rank).standard_normal(n).astype(np.float32)
    work = np.empty_like(g)
    lay = _hierarchy.layout(comm)
    hosts = comm.gather(socket.gethostname())
    if comm.rank == 0:
        print(f"# {comm.size} ranks, nodes {lay.node_sizes} ({len(set(hosts))} hostnames), "
              f"{a.mib:g} MiB float32, median of {a.reps}; "
              f"{os.environ.get('MPIGC_CLUSTER', 'no emulated cluster')}", flush=True)
    res = {}
    fb = mpigc.ErrorFeedback()
    for name in a.ops.split(","):
        if name == "mpi":
            def fn():
                work[...] = g
                comm.Allreduce(MPI.IN_PLACE, work, op=MPI.SUM)
        else:
            h, op = name.split("-")

            def fn(h=h, op=op):
                work[...] = g
                mpigc.allreduce(work, op, key=name, feedback=fb, hierarchy=h)
        med, best, cpu = timed(comm, fn, a.reps)
        res[name] = med
        if comm.rank == 0:
            print(f"{name:12s} median {med * 1e3:8.1f} ms  best {best * 1e3:8.1f} ms  "
                  f"cpu (all ranks) {cpu * 1e3:8.1f} ms", flush=True)
    if comm.rank == 0:
        for op in ("2bit", "1bit"):
            f, h = res.get(f"flat-{op}"), res.get(f"node-{op}")
            if f and h:
                line = f"{op}: hierarchical {f / h:.2f}x faster than flat"
                if "mpi" in res:
                    line += f"; vs comm.Allreduce: flat {res['mpi'] / f:.1f}x, " \
                            f"hierarchical {res['mpi'] / h:.1f}x"
                print(line)


if __name__ == "__main__":
    main()
