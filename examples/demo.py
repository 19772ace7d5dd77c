"""mpigc demo: one gradient-sized buffer reduced with every compressor.

Run with 4 ranks (the README's quick start)::

    mpirun --allow-run-as-root --oversubscribe -n 4 python examples/demo.py

Each rank makes a synthetic gradient (a fixed direction plus per-step noise)
and sums it over the ranks for a few steps with each op. Rank 0 prints the
bytes each rank sent (and the saving against an uncompressed bandwidth-optimal
allreduce), the relative error of the last step's result and the relative
error of the sum of all steps' results against the exact sum, which error
feedback keeps small: what one step does not deliver, a later step does.
"""
import argparse
import time

import numpy as np
from mpi4py import MPI

import mpigc


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=4 * 1024 * 1024, help="elements (float32)")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    rank, size = comm.rank, comm.size
    rng = np.random.default_rng(rank)
    direction = np.random.default_rng(1234).standard_normal(args.n).astype(np.float32)
    grads = [(0.3 * direction + 0.3 * rng.standard_normal(args.n)).astype(np.float32)
             for _ in range(args.steps)]
    exact = []
    for g in grads:
        s = np.empty_like(g)
        comm.Allreduce(g, s, op=MPI.SUM)
        exact.append(s / size)
    exact_total = np.sum(exact, axis=0)

    if rank == 0:
        print(f"mpigc {mpigc.__version__}: {size} ranks, {args.n * 4 / 2**20:.0f} MiB float32 "
              f"gradient, {args.steps} steps, average=True")
        print(f"{'op':>9} {'MiB sent/rank':>14} {'saving':>8} {'err last step':>14} "
              f"{'err of sum':>11} {'ms/step':>8}")
    base = None
    for op in ["none", "fp16", "2bit", "1bit", "terngrad"]:
        # one untimed call first: Numba compiles the kernels on first use
        mpigc.allreduce(grads[0].copy(), op=op, key="grad", average=True,
                        feedback=mpigc.ErrorFeedback())
        mpigc.reset_traffic()
        fb = mpigc.ErrorFeedback()
        total = np.zeros(args.n, np.float64)
        comm.Barrier()
        t0 = time.perf_counter()
        for g in grads:
            out = mpigc.allreduce(g.copy(), op=op, key="grad", average=True, feedback=fb)
            total += out
        dt = (time.perf_counter() - t0) / args.steps
        sent = mpigc.traffic()["bytes_sent"] / args.steps
        base = sent if op == "none" else base
        last = np.linalg.norm(out - exact[-1]) / np.linalg.norm(exact[-1])
        err_sum = np.linalg.norm(total - exact_total) / np.linalg.norm(exact_total)
        dt = comm.allreduce(dt, op=MPI.MAX)
        if rank == 0:
            print(f"{op:>9} {sent / 2**20:14.2f} {base / sent:7.1f}x {last:14.3f} "
                  f"{err_sum:11.4f} {dt * 1e3:8.1f}")
    if rank == 0:
        print("saving: bytes sent by 'none' / bytes sent; errors are relative L2 norms "
              "against the exact average")


if __name__ == "__main__":
    main()
