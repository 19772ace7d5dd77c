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

Prints ``rank R: ok`` or ``rank R: HUNG`` / a wrong result. With
``$JOB_OUT_DIR`` set, each rank also writes that line to
``$JOB_OUT_DIR/rank{R}.out`` and its stderr (mpigc's warning) goes to
``rank{R}.err`` there; a rank that ends the job with a non-zero status first
waits (30 s at most) until every rank has written its line, so no rank's
line is lost when the launcher ends the job at the first rank's exit (a
test that read them from mpirun's output failed 1 time in 6)."""
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
out_dir = os.environ.get("JOB_OUT_DIR")
if out_dir:
    err = os.open(os.path.join(out_dir, f"rank{rank}.err"), os.O_WRONLY | os.O_CREAT, 0o644)
    os.dup2(err, 2)


def report(line):
    """Print ``rank R: line``, and write it to this rank's file."""
    print(f"rank {rank}: {line}", flush=True)
    if out_dir:
        path = os.path.join(out_dir, f"rank{rank}.out")
        with open(path + ".tmp", "w") as f:
            f.write(f"rank {rank}: {line}\n")
        os.replace(path + ".tmp", path)


def exit_hung():
    """Report the hang and end the job (status 3) once every rank has
    written its line: the launcher ends the others at this rank's exit."""
    report("HUNG")
    deadline = time.monotonic() + 30
    while out_dir and time.monotonic() < deadline and not all(
            os.path.exists(os.path.join(out_dir, f"rank{r}.out")) for r in range(comm.size)):
        time.sleep(0.05)
    os._exit(3)


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
    watchdog = threading.Timer(30, exit_hung)
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
    exit_hung()
want = np.full(N, 3, np.float32)
bad = [k for k, v in got.items() if v.tobytes() != want.tobytes()]
report((f"wrong {bad}" if bad or len(got) != 2 else "ok")
       + f" several_threads {mpigc.diagnostics.several_threads()}")
