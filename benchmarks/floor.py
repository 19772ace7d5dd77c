# usage: mpirun -n 2 python benchmarks/floor.py [ITERS]
# The floor of a small op="none" call in Python (issue 31): what the least Python
# that keeps mpigc's guarantees costs at 2 ranks, against comm.Allreduce and mpigc's
# call. The "bare exchange" does only what any such call must: count the input's
# non-finite values, send a row of 80 bytes and the values to the peer in one
# message, probe and receive the peer's, compare the two rows, add the peer's
# values. The "collective floor" does the same with MPI's collectives instead: the
# row and its negation in one MPI_Allreduce(MAX) of 20 int64 (every field equal on
# both ranks when each max is minus the other's min), then MPI_Allreduce of the values
# in place: what a short path that handed the data to MPI after an agreement by
# collective could reach, were its decision to take it made the same on every rank
# (docs/benchmarks.md). mpigc's call (the short path, mpigc._shortcall) does that
# through the engine's own pieces (settings, rows, verdict, trace, counters). Each is timed in
# a tight loop of ITERS calls (default 3000) after a barrier, three rounds, 4 KiB
# and 64 KiB float32; prints microseconds per call and the ratios to
# comm.Allreduce on rank 0.
import sys
import time

import numpy as np
from mpi4py import MPI

import mpigc
from mpigc.kernels import cpu

comm = MPI.COMM_WORLD.Dup()
if comm.size != 2:
    sys.exit("floor.py: run it on 2 ranks (mpirun -n 2)")
ITERS = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
r, peer = comm.rank, 1 - comm.rank
HDR = 80


def bare(buf, msg, rbuf, row):
    rw = row.copy()
    rw[1] = cpu.count_nonfinite(buf)
    msg[:HDR] = rw.view(np.uint8)
    msg[HDR:] = buf.view(np.uint8)
    sreq = comm.Isend([msg, MPI.BYTE], dest=peer, tag=5)
    st = MPI.Status()
    m = comm.Mprobe(peer, 5, st)
    if st.Get_count(MPI.BYTE) != msg.size:
        raise RuntimeError("sizes differ")
    m.Recv([rbuf, MPI.BYTE])
    prow = rbuf[:HDR].view(np.int64)
    if prow[2:].tobytes() != rw[2:].tobytes() or prow[1] or rw[1]:
        raise RuntimeError("rows differ")
    np.add(buf, rbuf[HDR:].view(np.float32), out=buf)
    sreq.Wait()


def collective(buf, row, both, agreed):
    rw = row.copy()
    rw[1] = cpu.count_nonfinite(buf)
    both[:10] = rw
    np.negative(rw, out=both[10:])
    comm.Allreduce(both, agreed, op=MPI.MAX)
    if (agreed[:10] != -agreed[10:]).any() or agreed[1]:
        raise RuntimeError("rows differ")
    comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)


for nbytes in (4096, 65536):
    buf = np.zeros(nbytes // 4, np.float32)
    msg, rbuf = np.empty(HDR + nbytes, np.uint8), np.empty(HDR + nbytes, np.uint8)
    row = np.zeros(HDR // 8, np.int64)
    row[2:5] = (nbytes // 4, 11, 7)  # a size, a dtype code, settings
    both, agreed = np.empty(20, np.int64), np.empty(20, np.int64)
    fns = [("bare exchange", lambda: bare(buf, msg, rbuf, row)),
           ("collective floor", lambda: collective(buf, row, both, agreed)),
           ("mpigc none", lambda: mpigc.allreduce(buf, op="none", key="floor")),
           ("comm.Allreduce", lambda: comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM))]
    for _ in range(300):
        for _, f in fns:
            f()
    for rnd in range(3):
        t = {}
        for name, f in fns:
            comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(ITERS):
                f()
            t[name] = comm.allreduce((time.perf_counter() - t0) / ITERS * 1e6, op=MPI.MAX)
        if r == 0:
            mpi = t["comm.Allreduce"]
            print(f"{nbytes:>6} B round {rnd}: " + "  ".join(
                f"{k} {v:6.1f} us ({v / mpi:.2f}x)" for k, v in t.items()), flush=True)
if r == 0:
    print("short calls taken:", mpigc.diagnostics.counters()["short_calls"])
