"""Run by tests/test_thread_mode.py under mpirun (4 ranks, MPIGC_NODE_SPLIT=2):
nonblocking hierarchical calls that the progress thread advances (it starts
their inter-node calls) leave the process in the one-user-thread mode;
prints ``several_threads <bool>`` on each rank."""
import time

import numpy as np
from mpi4py import MPI

import mpigc

rank = MPI.COMM_WORLD.rank
x = np.random.default_rng(rank).standard_normal(1 << 18).astype(np.float32)
mpigc.allreduce(x.copy(), "2bit", key="warm", hierarchy="node")
advanced = 0
for _ in range(5):
    req = mpigc.iallreduce(x.copy(), "2bit", key="h", hierarchy="node")
    t = time.monotonic()
    while not req.done and time.monotonic() - t < 5:
        pass  # the caller computes; the progress thread advances the call
    advanced += req.done
    req.wait()
print(f"rank {rank}: thread {mpigc.diagnostics.progress_thread_enabled()} "
      f"advanced {advanced} several_threads {mpigc.diagnostics.several_threads()}",
      flush=True)
