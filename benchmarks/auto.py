"""op="auto" against "none" and "2bit" (issue 48), one run, ratios printed.

    mpirun -n 4 python benchmarks/auto.py                  # 32 MiB, shared memory
    flock /work/notes/fabric.lock benchmarks/fabric.sh --rate 1gbit -- \\
        mpirun -n 4 python benchmarks/auto.py --rounds 10

Every op reduces the same per-rank float32 buffer (its own key, its own
residuals). First ``--warmup`` calls of each op, untimed: for ``auto`` these
are its first calls, which alternate 2bit and none until its model has two
agreed samples of each per rank, then decide (about 12 calls). Then
``--rounds`` rounds, each one timed call of every op in turn (the order
rotates each round; a barrier before every call; a call's time is the
slowest rank's), so load that comes and goes hits every op alike. Printed:
median and minimum per op, the ratios of auto's median to none's, to 2bit's
and to the faster of the two, and what auto ran in the timed rounds (its
probes, every ``$MPIGC_AUTO_PROBE`` calls, included); also the paired ratio
of each round (auto's call over the faster op's call of that same round),
its median and minimum. ``--ops auto,2bit`` leaves ``none`` out (at
100 Mbit/s a ``none`` call of 32 MiB takes 16 s): the ratios are then to
``2bit`` alone. A benchmark, not a test: it asserts nothing.
"""
import argparse
import collections
import os
import time

import numpy as np
from mpi4py import MPI

import mpigc
from mpigc import _auto


def _call(op, x, comm):
    if op == "auto":
        mpigc.allreduce(x, op="auto", key="bench-auto", comm=comm)
        return _auto.last_decision()
    mpigc.allreduce(x, op=op, key=f"bench-{op}", comm=comm)
    return None


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size-mib", type=float, default=32.0)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--warmup", type=int, default=16)
    p.add_argument("--warmup-fixed", type=int, default=None,
                   help="warm-up calls of none and 2bit (default: --warmup; auto needs "
                        "about 12 to measure both)")
    p.add_argument("--ops", default="none,2bit,auto",
                   help="the ops timed, auto and at least one of none, 2bit")
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    n = int(args.size_mib * (1 << 20)) // 4
    src = np.random.default_rng([7, comm.rank]).standard_normal(n).astype(np.float32)
    x = np.empty_like(src)
    ops = [op for op in ("none", "2bit", "auto") if op in args.ops.split(",")]
    if "auto" not in ops or len(ops) < 2 or set(args.ops.split(",")) - set(ops):
        raise SystemExit(f"--ops: auto and at least one of none, 2bit, got {args.ops!r}")
    for op in ops:
        fixed = args.warmup if args.warmup_fixed is None or op == "auto" else args.warmup_fixed
        for _ in range(fixed):
            x[...] = src
            _call(op, x, comm)
    times = {op: [] for op in ops}
    ran = collections.Counter()
    last = None
    for r in range(args.rounds):
        for k in range(len(ops)):
            op = ops[(r + k) % len(ops)]
            x[...] = src
            comm.Barrier()
            t0 = time.perf_counter()
            d = _call(op, x, comm)
            t = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
            times[op].append(t)
            if d is not None:
                ran[f"{d.op} ({d.reason})"] += 1
                last = d
    if comm.rank:
        return
    med = {op: float(np.median(v)) for op, v in times.items()}
    fabric = os.environ.get("MPIGC_FABRIC", "none (shared memory)")
    load = os.getloadavg()[0]
    print(f"# benchmarks/auto.py: {comm.size} ranks, {args.size_mib:g} MiB float32, "
          f"{args.rounds} rounds after {args.warmup} warm-up calls of auto "
          f"({args.warmup if args.warmup_fixed is None else args.warmup_fixed} of the others), "
          f"fabric: {fabric}, "
          f"load {load:.1f}, {os.cpu_count()} cores")
    print(f"{'op':>6} {'median ms':>10} {'min ms':>8}")
    for op in ops:
        print(f"{op:>6} {med[op] * 1e3:>10.1f} {min(times[op]) * 1e3:>8.1f}")
    fixed = [op for op in ops if op != "auto"]
    for op in fixed:
        print(f"auto / {op:<5} = {med['auto'] / med[op]:.3f}  (minima: "
              f"{min(times['auto']) / min(times[op]):.3f})")
    best = min(fixed, key=med.get)
    print(f"auto / best  = {med['auto'] / med[best]:.3f}  (best: {best}; minima: "
          f"{min(times['auto']) / min(min(times[op]) for op in fixed):.3f})")
    paired = [a / min(times[op][i] for op in fixed) for i, a in enumerate(times["auto"])]
    print(f"auto / best per round (paired, {len(paired)} rounds): median "
          f"{float(np.median(paired)):.3f}, min {min(paired):.3f}, max {max(paired):.3f}")
    print("auto ran: " + ", ".join(f"{k} x{v}" for k, v in sorted(ran.items())))
    if last is not None and last.predicted_none is not None:
        print(f"auto's last prediction: none {last.predicted_none * 1e3:.1f} ms, "
              f"2bit {last.predicted_compressed * 1e3:.1f} ms")
    print(f"load average (1 min) at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
