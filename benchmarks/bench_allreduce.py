"""Time mpigc.allreduce for each op against comm.Allreduce, in the same run.

    mpirun --allow-run-as-root --oversubscribe -n 4 python benchmarks/bench_allreduce.py --mb 32

Each op reduces the same float32 buffer (``--mb`` MiB per rank) ``--reps``
times after a warm-up; rank 0 prints the median and best time per call (the
slowest rank's time of each repetition), the ratio to MPI's own Allreduce
(median over median) and the bytes each rank sent. On one machine the ranks
talk through shared memory, so this measures compute (compression kernels,
Python overhead), not a network: see the fabric benchmarks for that.
This is a benchmark, not a test: it asserts nothing.
"""
import argparse
import time

import numpy as np
from mpi4py import MPI

import mpigc


def timed(comm, fn, reps):
    times = []
    for _ in range(reps):
        comm.Barrier()
        t0 = time.perf_counter()
        fn()
        times.append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    return float(np.median(times)), float(np.min(times))


def main():
    ap = argparse.ArgumentParser(description="mpigc.allreduce vs MPI_Allreduce")
    ap.add_argument("--mb", type=float, default=32.0, help="MiB of float32 per rank")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--ops", default="none,fp16,2bit,1bit,terngrad")
    ap.add_argument("--gather", default="compressed", choices=["compressed", "exact"])
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    n = int(args.mb * 2**20) // 4
    x = np.random.default_rng(comm.rank).standard_normal(n).astype(np.float32)
    buf = x.copy()

    def mpi():
        buf[...] = x
        comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)

    mpi()
    base_med, base_min = timed(comm, mpi, args.reps)
    copy_med, _ = timed(comm, lambda: np.copyto(buf, x), args.reps)
    rows = []
    for op in args.ops.split(","):
        fb = mpigc.ErrorFeedback()

        def call():
            buf[...] = x
            mpigc.allreduce(buf, op=op, key="bench", feedback=fb, gather=args.gather)

        call()  # warm-up: compiles the kernels, allocates the residuals
        mpigc.reset_traffic()
        med, best = timed(comm, call, args.reps)
        sent = mpigc.traffic()["bytes_sent"] / args.reps
        rows.append((op, med - copy_med, best - copy_med, sent))
    if comm.rank == 0:
        print(f"# {comm.size} ranks, {n * 4 / 2**20:.1f} MiB float32 per rank, "
              f"gather={args.gather}, {args.reps} reps; {MPI.Get_library_version().splitlines()[0]}")
        print(f"{'op':>10} {'median ms':>10} {'best ms':>9} {'vs MPI':>8} {'MiB sent/rank':>14}")
        print(f"{'MPI':>10} {base_med * 1e3:10.2f} {base_min * 1e3:9.2f} {1.0:8.2f} "
              f"{2 * (comm.size - 1) / comm.size * n * 4 / 2**20:14.2f}")
        for op, med, best, sent in rows:
            print(f"{op:>10} {med * 1e3:10.2f} {best * 1e3:9.2f} {med / base_med:8.2f} "
                  f"{sent / 2**20:14.2f}")
        print("(times exclude the copy that refills the buffer; 'vs MPI' = median / MPI's median)")


if __name__ == "__main__":
    main()
