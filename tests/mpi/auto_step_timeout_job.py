"""A job for tests/test_torch_auto_timeout.py: the torch layer's timeout
holds at an ``op="auto"`` model step. Rank 0 alone makes a training step
whose bucket call is a model step of the communicator's ``op="auto"`` model
(the first call, or an agreement step: these complete inside the engine's
call); rank 1 waits outside mpigc. Rank 0 must raise the layer's StateError
after its timeout (3 s), not wait for ever inside ``iallreduce``.

    mpirun -n 2 python tests/mpi/auto_step_timeout_job.py {sync,hook} {first,step}

Each rank writes ``rank{R}.out`` in ``$JOB_OUT_DIR`` and leaves with
``os._exit(0)`` (rank 0's call stays in flight on purpose: no MPI
finalize, so mpirun's exit status is not 0)."""
import os
import sys
import time

import torch
from mpi4py import MPI

import mpigc.torch as mt
from mpigc import _auto

kind, when = sys.argv[1], sys.argv[2]
comm = MPI.COMM_WORLD
out = open(os.path.join(os.environ["JOB_OUT_DIR"], f"rank{comm.rank}.out"), "w")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 1))
if kind == "sync":
    sync = mt.GradientSync(model, op="auto", timeout=3)
    net, done = model, sync.wait
else:
    mt.init_process_group()
    net = torch.nn.parallel.DistributedDataParallel(model)
    state = mt.CommHookState(net, op="auto", timeout=3)
    net.register_comm_hook(state, mt.comm_hook)
    done = None


def step(s):
    for p in model.parameters():
        p.grad = None
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(s * 10 + comm.rank))
    net(x).sum().backward()
    if done is not None:
        done()


auto_model = _auto.model_of(comm)
s = 0
while when == "step" and (auto_model.calls < 4 or auto_model.calls % 4):
    step(s)  # every rank, until the next op="auto" call is an agreement step
    s += 1
comm.Barrier()
call = auto_model.calls  # the index of rank 0's next op="auto" call
t0, err = time.monotonic(), None
if comm.rank == 0:
    try:
        step(s)
    except Exception as e:  # noqa: BLE001 - reported below
        err = e
took = time.monotonic() - t0
out.write(f"rank {comm.rank}: call {call} err {type(err).__name__} "
          f"after {took:.0f} s: {err}\n")
out.flush()
comm.Barrier()
os._exit(0)
