"""Run by tests/test_thread_mode.py under mpirun (2 ranks): the first call of
a rank's second user thread arrives while the first thread that called
mpigc blocks in MPI, holding the engine lock (docs/user-guide.md,
"Threading contract").

``main-first`` (the documented pattern, the test): the main thread makes
mpigc's state of communicators A and B (a call on each), then starts thread
X, which calls on B while the main thread calls on A. On rank 0 the main
thread's call on A is already blocked in MPI (rank 1's comes 0.4 s later)
when X's first call comes (0.2 s); on rank 1, X calls first. The main
thread's calls are the process's first, so its blocked call is on a
communicator whose every rank runs it in order, and completes.

``race`` (not a test: it hangs, the limitation the contract documents):
two threads race to make the process's first call, and a different one
wins on each rank; each winner makes mpigc's state of both communicators,
then blocks in MPI (rank 0's on A, rank 1's on B) on the call the other
rank's loser cannot start. (Were each thread to make its own
communicator's state, that collective would pair the threads up before
either blocks, and the run completes.) ``mpirun -n 2 python
tests/mpi/thread_first_call_job.py race [SECONDS]`` prints ``HUNG`` after
SECONDS (default 20), and before that, with ``MPIGC_FIRST_CALL_WARN_S``
below it, mpigc's warning of why each rank may hang.

Prints ``rank R: ok`` or ``rank R: HUNG`` / a wrong result."""
import os
import sys
import threading
import time

import numpy as np
from mpi4py import MPI

import mpigc

mode = sys.argv[1] if len(sys.argv) > 1 else "main-first"
comm = MPI.COMM_WORLD
rank = comm.rank
A, B = comm.Dup(), comm.Dup()
N = 1 << 18
got = {}


def call(name, c, delay):
    time.sleep(delay)
    got[name] = mpigc.allreduce(np.full(N, rank + 1, np.float32), op="none", comm=c)


if mode == "main-first":
    for c in (A, B):
        mpigc.allreduce(np.ones(4, np.float32), comm=c)
    x = threading.Thread(target=call, args=("B", B, 0.2 if rank == 0 else 0.0), daemon=True)
    x.start()
    # the main thread itself makes the call on A (a helper thread would be a
    # second user thread): run call() here, with a watchdog for a hang
    watchdog = threading.Timer(30, lambda: (print(f"rank {rank}: HUNG", flush=True),
                                            os._exit(3)))
    watchdog.daemon = True
    watchdog.start()
    call("A", A, 0.0 if rank == 0 else 0.4)
    x.join(30)
    threads = [x]
else:
    mine, other = (A, B) if rank == 0 else (B, A)

    warm = threading.Event()

    def first():
        for c in (A, B):
            mpigc.allreduce(np.ones(4, np.float32), comm=c)
        warm.set()
        call("mine", mine, 0.0)

    def second():
        warm.wait()  # the first thread's calls are the process's first
        call("other", other, 0.3)
    threads = [threading.Thread(target=first, daemon=True),
               threading.Thread(target=second, daemon=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(float(sys.argv[2]) if len(sys.argv) > 2 else 20)
if any(t.is_alive() for t in threads):
    print(f"rank {rank}: HUNG", flush=True)
    os._exit(3)
want = np.full(N, 3, np.float32)
bad = [k for k, v in got.items() if v.tobytes() != want.tobytes()]
print(f"rank {rank}: " + (f"wrong {bad}" if bad or len(got) != 2 else "ok")
      + f" several_threads {mpigc.diagnostics.several_threads()}", flush=True)
