"""The short path (mpigc._shortcall) at the sizes where its passes over the
values cost most (16 KiB to just over 1 MiB: the values in the agreement
message from just over 16 KiB to 1 MiB, the row alone and MPI's sum
outside that range): MPI's bits, the trace of the path taken, and each
rank's exact non-finite count in the same NonFiniteError on both ranks with
nothing changed, "skip" filling NaN, as at small sizes
(tests/mpi/test_shortcall_mpi.py). A guard for the per-call work of issue 51
(the values copied into the message and counted in one pass,
kernels.cpu.copy_count_nonfinite; the row alone where that is faster). Run alone under ``mpirun -n 2``,
as tests/test_shortcall.py runs its MPI file, so that the short path is
taken (a process whose second thread called mpigc never takes it)."""
import os
import shutil
import subprocess
import sys

import pytest

JOB = r'''
import numpy as np
from mpi4py import MPI
import mpigc
from mpigc import diagnostics

comm = MPI.COMM_WORLD
dup = comm.Dup()
rank = comm.rank
fails = []


def check(ok, what):
    # agreed before anything else runs: a failure on one rank fails both
    if not comm.allreduce(bool(ok), op=MPI.LAND):
        fails.append(what)


def short_calls():
    return diagnostics.counters()["short_calls"]


for dtype in (np.float32, np.float64):
    item = np.dtype(dtype).itemsize
    for nbytes in (16 << 10, (16 << 10) + 8, (64 << 10) - 4096, 64 << 10, (64 << 10) + 8,
                   256 << 10, 1 << 20, (1 << 20) + 8):
        n = nbytes // item
        what = f"{np.dtype(dtype).name} n={n}"
        rng = np.random.default_rng([n, rank])
        x = rng.standard_normal(n).astype(dtype)
        want = x.copy()
        dup.Allreduce(MPI.IN_PLACE, want, op=MPI.SUM)
        before = short_calls()
        mpigc.allreduce(x, op="none", key="sizes")
        check(x.tobytes() == want.tobytes(), what + ": not MPI's bits")
        check(short_calls() == before + 1, what + ": the short path not taken")
        # the values in the agreement message from 16 KiB (exclusive) to the
        # inline limit (1 MiB); else the row alone, then MPI's sum
        t = diagnostics.last_trace()
        inline = (16 << 10) < nbytes <= (1 << 20)
        check((t.inline, t.sum_pieces) == (inline, 0 if inline else 1), f"{what}: trace {t}")
        for where in (0, 1):
            # this rank's own count of non-finite values, at both ends and
            # inside (NaN payloads, both infinities), in the error on both ranks
            y = rng.standard_normal(n).astype(dtype)
            k = 0
            if rank == where:
                bad = [np.nan, np.inf, -np.inf, -np.nan]
                at = [0, n // 3, n // 2 + 1, n - 1]
                for i, v in zip(at, bad):
                    y[i] = v
                y.view(np.uint32 if item == 4 else np.uint64)[n // 5] |= (
                    0x7F800001 if item == 4 else 0x7FF0000000000001)
                k = len(at) + 1
            keep = y.copy()
            try:
                mpigc.allreduce(y, op="none", key="sizes")
                got = None
            except mpigc.NonFiniteError as exc:
                got = str(exc)
            texts = comm.allgather(got)
            check(texts[0] is not None and texts[0] == texts[1]
                  and f"rank {where} ({comm.bcast(k, root=where)})" in texts[0],
                  f"{what}: raise on rank {where}: {texts}")
            check(y.tobytes() == keep.tobytes(), what + ": raise changed the buffer")
            mpigc.allreduce(y, op="none", key="sizes", nonfinite="skip")
            check(bool(np.isnan(y).all()), what + ": skip: not NaN everywhere")

print("FAILS" if fails else "OK", rank, fails, flush=True)
'''


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="no mpirun on PATH")
def test_large_short_calls_keep_bits_counts_and_errors(tmp_path):
    job = tmp_path / "job.py"
    job.write_text(JOB)
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.pop("MPIGC_SHORT_PATH", None)
    env.pop("MPIGC_INLINE_PLAIN_BYTES", None)
    cmd = ["timeout", "300", "mpirun", "--oversubscribe", "-n", "2", sys.executable, str(job)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=360)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-3000:]
    assert p.stdout.count("OK") == 2, p.stdout[-4000:] + p.stderr[-3000:]
