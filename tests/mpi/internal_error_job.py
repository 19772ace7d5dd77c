"""A defect on one rank in the middle of a call (run by
tests/test_internal_error.py): rank 1's 1bit decoder raises RuntimeError,
after the ranks agreed (packing comes before the agreement, and its failures
are already reported on every rank). The peers cannot learn of it, so mpigc
must abort the job, with the rank and the traceback on stderr, instead of
leaving them waiting forever.

    mpirun -n K python tests/mpi/internal_error_job.py MODE

MODE: ``blocking``, ``nonblocking`` (``iallreduce(...).wait()``), ``hier``
(``hierarchy="node"``, run with ``MPIGC_NODE_SPLIT=2``) or ``short`` (a small
``op="none"`` call on 2 ranks, which takes the short path of small calls,
``mpigc._shortcall``: rank 1's reading of the exchanged rows, the verdict, raises; the
short path sums with ``np.add`` itself since 9111b5a, so a planted decoder is not reached). A rank that sees the
exception prints ``raised: ...`` and goes on, as a training loop that skips a
failed step would: into a barrier, where its peers never come (with
``MPIGC_ON_INTERNAL_ERROR=raise``, the hang this prevents). At one rank,
where nobody waits, the exception is raised and the script exits 0.
"""
import sys

import numpy as np
from mpi4py import MPI

import mpigc
from mpigc.kernels import cpu

mode = sys.argv[1]
comm = MPI.COMM_WORLD
x = np.linspace(-1, 1, 100_000).astype(np.float32)
kw = {"hierarchy": "node"} if mode == "hier" else {}
mpigc.allreduce(x.copy(), op="1bit", key="k", **kw)  # a call that works first
comm.Barrier()
if comm.rank == 1 or comm.size == 1:
    if mode == "short":
        def broken(*args, **kwargs):
            raise RuntimeError("planted defect in verdict")
        mpigc._plan.verdict = broken
    else:
        def broken(*args, **kwargs):
            raise RuntimeError("planted defect in unpack_1bit_shards")
        cpu.unpack_1bit_shards = broken
try:
    if mode == "short":
        mpigc.allreduce(np.ones(100, np.float32), op="none", key="s")
    elif mode == "nonblocking":
        mpigc.iallreduce(x.copy(), op="1bit", key="k").wait()
    else:
        mpigc.allreduce(x.copy(), op="1bit", key="k", **kw)
except RuntimeError as exc:
    print(f"rank {comm.rank}: raised: {exc}", flush=True)
comm.Barrier()
print(f"rank {comm.rank}: done", flush=True)
