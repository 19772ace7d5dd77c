"""A script that ends on one rank while the others still wait for it (run by
tests/test_launch_abort.py), under ``python -m mpigc.launch`` or under plain
``python``: ``plain`` after ``mpigc.torch.init_process_group()``,
``hook-first`` after ``mpigc.launch.abort_on_exception()`` and then
``torch.distributed.init_process_group`` (whose excepthook wraps mpigc's).

    mpirun -n K python -m mpigc.launch tests/mpi/launch_abort_job.py CASE DIR
    mpirun -n K python tests/mpi/launch_abort_job.py CASE DIR plain|hook-first

Rank 1 (rank 0 at one rank) ends the script, the others go on into a call
that needs it, so they can only end if the job is aborted:

- ``before``: rank 1 raises before its first mpigc call;
- ``during``: between the start of two nonblocking calls (``op="none"``,
  summed by the communicator's reduction thread, and ``"2bit"``, advanced by
  the progress thread) and their waits;
- ``after``: after its calls completed (the others call again);
- ``exit3``: ``sys.exit(3)`` after a call;
- ``ddp``: in the loss of the second step of a DDP model (gloo) with mpigc's
  comm hook, while the others run backward (the hook waits for its peers);
- ``clean``: nobody fails (rank 1 ends with ``sys.exit(0)``, the others by
  falling off the end).

Each rank writes its stderr to ``DIR/rank<R>.err`` (what the failing rank
writes is there whole before it aborts, whatever ``mpirun`` does with the
others' output) and, where it gets past a last call that needs every rank,
``DIR/rank<R>.done``.
"""
import os
import sys

import numpy as np
from mpi4py import MPI

import mpigc

case, out = sys.argv[1], sys.argv[2]
how = sys.argv[3] if len(sys.argv) > 3 else "launch"
comm = MPI.COMM_WORLD
rank = comm.rank
failing = comm.rank == min(1, comm.size - 1)
err = os.open(os.path.join(out, f"rank{rank}.err"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
os.dup2(err, 2)
os.close(err)

if how != "launch" or case == "ddp":
    import torch
    import torch.distributed as dist

    import mpigc.launch
    import mpigc.torch as mt
    if how == "plain":
        mt.init_process_group("gloo")  # installs the hook that aborts the job
    elif how == "hook-first":
        mpigc.launch.abort_on_exception()
        mpigc.launch.torchrun_env()
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo")  # env://, as under torchrun

x = np.linspace(-1, 1, 10_000).astype(np.float32)


def fail():
    if case == "exit3":
        sys.exit(3)
    raise RuntimeError(f"planted failure on rank {rank} ({case})")


if case == "before":
    if failing:
        fail()
    mpigc.allreduce(x.copy(), op="2bit", key="a")
elif case == "during":
    mpigc.allreduce(x.copy(), op="2bit", key="a")
    calls = [mpigc.iallreduce(x.copy(), op="none", key="s"),
             mpigc.iallreduce(x.copy(), op="2bit", key="a")]
    if failing:
        fail()
    for c in calls:
        c.wait()
elif case in ("after", "exit3"):
    mpigc.allreduce(x.copy(), op="2bit", key="a")
    mpigc.iallreduce(x.copy(), op="none", key="s").wait()
    if failing:
        fail()
    mpigc.allreduce(x.copy(), op="2bit", key="a")
elif case == "ddp":
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 1))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    state = mt.CommHookState(ddp, op="2bit", rel_threshold=1.5)
    ddp.register_comm_hook(state, mt.comm_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        opt.zero_grad()
        g = torch.Generator().manual_seed(100 * rank + step)
        loss = ddp(torch.randn(16, 32, generator=g)).square().mean()
        if step == 1 and failing:
            fail()
        loss.backward()
        opt.step()
elif case == "clean":
    mpigc.allreduce(x.copy(), op="2bit", key="a")
    mpigc.iallreduce(x.copy(), op="none", key="s").wait()
else:
    raise SystemExit(f"unknown case {case!r}")

# a call that needs every rank: the others cannot get past it once one failed
# (the nonblocking calls of "during" may complete without the failing rank's
# wait: its progress thread can finish them)
mpigc.allreduce(x.copy(), op="none", key="end")
with open(os.path.join(out, f"rank{rank}.done"), "w"):
    pass
if case == "clean" and failing:
    sys.exit(0)
