"""Scripts written for torchrun under mpirun: mpigc.launch.torchrun_env (the
variables torchrun sets, from the MPI job), python -m mpigc.launch, and
mpigc.torch.init_process_group."""
import os
import sys

import pytest
from mpi4py import MPI

import mpigc
import mpigc.launch

from conftest import assert_all, raises_everywhere

# ranks: one host (local = world): 2 pairs, 3 a rank neither first nor last; 4 adds nothing
pytestmark = pytest.mark.ranks(1, 2, 3)

_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
         "MASTER_PORT")


@pytest.fixture
def clean_env():
    """No torchrun variables before the test, and none left after it."""
    saved = {k: os.environ.pop(k) for k in _VARS if k in os.environ}
    yield
    for k in _VARS:
        os.environ.pop(k, None)
    os.environ.update(saved)


@pytest.mark.mpi
def test_torchrun_env_from_the_mpi_job(comm, clean_env):
    env = mpigc.launch.torchrun_env()
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    ok = (env["RANK"] == str(comm.rank) and env["WORLD_SIZE"] == str(comm.size)
          and env["LOCAL_RANK"] == str(local.rank)
          and env["LOCAL_WORLD_SIZE"] == str(local.size)
          and all(os.environ[k] == env[k] for k in _VARS)
          and env["MASTER_ADDR"] == "127.0.0.1"  # one node
          and 0 < int(env["MASTER_PORT"]) < 65536)
    local.Free()
    rendezvous = comm.allgather((env["MASTER_ADDR"], env["MASTER_PORT"]))
    assert_all(ok and len(set(rendezvous)) == 1, f"{env} {rendezvous}")


@pytest.mark.mpi
def test_rank_0_chooses_the_rendezvous(comm, clean_env):
    """MASTER_ADDR/MASTER_PORT of rank 0 (as a batch script sets them) win; a
    bad port on rank 0 raises on every rank, not only there."""
    if comm.rank == 0:
        os.environ["MASTER_PORT"] = "29533"
    env = mpigc.launch.torchrun_env(master_addr="localhost" if comm.rank == 0 else None)
    ok = env["MASTER_PORT"] == "29533" and env["MASTER_ADDR"] == "localhost"
    raises_everywhere(mpigc.ConfigError, lambda: mpigc.launch.torchrun_env(
        master_port="http" if comm.rank == 0 else None), match="MASTER_PORT")
    assert_all(ok, str(env))


_SCRIPT = '''
import os, sys
import torch, torch.distributed as dist
dist.init_process_group("gloo")  # env://, as under torchrun
t = torch.tensor([float(os.environ["RANK"]) + 1])
dist.all_reduce(t)
dist.destroy_process_group()
with open(sys.argv[1] + "." + os.environ["RANK"], "w") as f:
    f.write(f"{t.item()} {sys.argv[2:]} {__name__}")
'''


@pytest.mark.mpi
def test_launch_runs_a_torchrun_script_unchanged(comm, clean_env, tmp_path_factory):
    pytest.importorskip("torch")
    d = comm.bcast(str(tmp_path_factory.mktemp("launch")) if comm.rank == 0 else None)
    script = os.path.join(d, "train.py")
    if comm.rank == 0:
        with open(script, "w") as f:
            f.write(_SCRIPT)
    comm.Barrier()
    argv = sys.argv
    try:
        rc = mpigc.launch.main([script, os.path.join(d, "out"), "--lr=0.1"])
    finally:
        sys.argv = argv
    with open(os.path.join(d, f"out.{comm.rank}")) as f:
        got = f.read()
    want = f"{comm.size * (comm.size + 1) / 2} ['--lr=0.1'] __main__"
    assert_all(rc == 0 and got == want, f"{rc} {got!r} != {want!r}")


@pytest.mark.mpi
def test_init_process_group(comm, clean_env):
    torch = pytest.importorskip("torch")
    import mpigc.torch as mt
    env = mt.init_process_group("gloo")
    dist = torch.distributed
    try:
        t = torch.tensor([float(comm.rank)])
        dist.all_reduce(t)
        ok = (dist.get_rank() == comm.rank and dist.get_world_size() == comm.size
              and t.item() == comm.size * (comm.size - 1) / 2 and env["RANK"] == str(comm.rank))
    finally:
        dist.destroy_process_group()
    assert_all(ok)
