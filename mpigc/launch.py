"""Run a training script written for ``torchrun`` under ``mpirun`` or ``srun``.

A DDP script finds its place in the job in the environment that ``torchrun``
sets: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``. Under an MPI launcher none of them is set
(Open MPI, MPICH/PMI and Slurm each name them differently). MPI itself knows
the job: :func:`torchrun_env` asks it, agrees on a rendezvous address and a
free port over MPI, and sets those variables, so the script's own
``torch.distributed.init_process_group(backend)`` (``env://``) works as it is.

Either as a launcher, the script unchanged::

    mpirun -n 8 python -m mpigc.launch train.py --batch_size=32
    srun --mpi=pmix python -m mpigc.launch train.py

or from the script, before it reads the environment::

    import mpigc.launch
    mpigc.launch.torchrun_env()

:func:`mpigc.torch.init_process_group` does this and initialises the
process group too. Nothing here imports torch.
"""
import gc
import importlib
import os
import runpy
import socket
import sys
import time

from mpi4py import MPI

from . import _comm
from ._errors import ConfigError, MpigcError

__all__ = ["torchrun_env", "main"]

_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
              "MASTER_PORT")


def _rendezvous_address(one_node, master_addr, master_port):
    """Rank 0's side: the address the others reach it at, and a free port."""
    addr = master_addr or os.environ.get("MASTER_ADDR")
    if not addr:
        addr = "127.0.0.1" if one_node else socket.gethostbyname(socket.gethostname())
    port = master_port or os.environ.get("MASTER_PORT")
    if port is None:
        with socket.socket() as s:  # a free port (as torchrun's default rendezvous)
            s.bind(("", 0))
            port = s.getsockname()[1]
    try:
        port = int(port)
    except ValueError:
        raise ConfigError(f"MASTER_PORT: expected a port number, got {port!r}") from None
    if not 0 < port < 65536:
        raise ConfigError(f"MASTER_PORT: expected a port number, got {port}")
    return addr, port


def torchrun_env(comm=None, *, master_addr=None, master_port=None):
    """Set the environment ``torchrun`` gives a script, from the MPI job
    (collective over ``comm``).

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm, optional
        The ranks of the torch job (default ``MPI.COMM_WORLD``): ``RANK`` and
        ``WORLD_SIZE`` are the rank in and size of ``comm``, ``LOCAL_RANK``
        and ``LOCAL_WORLD_SIZE`` those among its ranks on this node.
    master_addr, master_port : optional
        The rendezvous of rank 0. Default: ``$MASTER_ADDR``/``$MASTER_PORT``
        of rank 0 where set; else ``127.0.0.1`` when the job is on one node
        and rank 0's host address otherwise, and a port free on rank 0's host.

    Returns
    -------
    dict
        The variables set (as strings), the same as ``os.environ`` now holds.

    Raises
    ------
    ConfigError
        On every rank, when rank 0 cannot choose a rendezvous (a bad
        ``MASTER_PORT``, a host name that does not resolve).
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    if not isinstance(comm, MPI.Intracomm):
        raise ConfigError(f"comm: expected an mpi4py Intracomm, got {type(comm).__name__}")
    own = comm.Dup()  # not a collective of the user's
    try:
        local = own.Split_type(MPI.COMM_TYPE_SHARED, key=own.rank)
        local_rank, local_size = local.rank, local.size
        local.Free()
        one_node = own.allreduce(int(local_size == own.size), op=MPI.MIN) == 1
        addr, port = _comm.on_root(
            own, lambda: _rendezvous_address(one_node, master_addr, master_port),
            "mpigc.launch.torchrun_env", classes={"ConfigError": ConfigError},
            default=ConfigError)
    finally:
        own.Free()
    env = {"RANK": comm.rank, "WORLD_SIZE": comm.size, "LOCAL_RANK": local_rank,
           "LOCAL_WORLD_SIZE": local_size, "MASTER_ADDR": addr, "MASTER_PORT": port}
    env = {k: str(v) for k, v in env.items()}
    os.environ.update(env)
    return env


def _release_script():
    """Free what the finished script left, while the interpreter is whole.

    A Gloo process group outlives ``destroy_process_group`` once a DDP model
    has used it (torch keeps it), and its worker threads drop each finished
    collective's tensors a moment after the caller's ``wait`` returns. If that
    moment falls after the interpreter has begun to shut down, and the tensor
    was the script's (a global, like the one of a last ``all_reduce``), the
    thread asks for a GIL that no longer exists and the process aborts
    ("terminate called without an active exception"): the script's work is
    done and printed, the job fails. 4 of 40 runs of the GPT example at 2
    ranks on 2 cores did so. So the script's objects are freed here (the
    ``multiprocessing`` imported before the script keeps this launcher, not the script, as
    its ``__mp_main__``, which would hold them to the end), and the threads
    are given a moment, without the GIL, to finish with them.
    """
    gc.collect()
    if "torch.distributed" in sys.modules:
        time.sleep(0.2)


def main(argv=None):
    """``python -m mpigc.launch SCRIPT [ARGS...]``: :func:`torchrun_env`,
    then SCRIPT as ``__main__`` with ``sys.argv = [SCRIPT, ARGS...]``."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip().split("\n\n")[0] + "\n\nusage: mpirun -n N python -m "
              "mpigc.launch SCRIPT [ARGS...]")
        return 0 if argv else 2
    try:
        torchrun_env()
    except MpigcError as e:
        print(f"mpigc.launch: {e}", file=sys.stderr)
        return 1
    sys.argv = argv
    sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
    importlib.import_module("multiprocessing")  # before the script: see _release_script
    runpy.run_path(argv[0], run_name="__main__")
    _release_script()
    return 0


if __name__ == "__main__":
    sys.exit(main())
