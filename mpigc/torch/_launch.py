"""Setting up a torch job on MPI ranks: the process group, and the
broadcasts that make every rank start from rank 0's state."""
import atexit
import time

import torch
from mpi4py import MPI

from ._common import check_same, describe, resolve_comm


def _let_gloo_threads_finish():
    time.sleep(0.2)


# -- broadcast helpers ---------------------------------------------------------
def init_process_group(backend=None, *, comm=None, master_addr=None, master_port=None,
                       **kwargs):
    """``torch.distributed.init_process_group`` over the ranks of an MPI job
    (``mpirun``, ``srun``: any launcher MPI runs under), as under ``torchrun``
    (collective over ``comm``).

    Sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
    ``MASTER_ADDR`` and ``MASTER_PORT`` from the MPI job
    (:func:`mpigc.launch.torchrun_env`: the address and a free port are agreed
    over MPI), then initialises the default process group from them. A script
    written for ``torchrun`` calls this instead of
    ``torch.distributed.init_process_group`` and reads the variables as
    before; or it stays unchanged under ``python -m mpigc.launch``.

    As ``torchrun`` tears the job down when a worker fails, an exception that
    the script does not catch then aborts the MPI job on any rank, after its
    traceback and a line that names the rank
    (:func:`mpigc.launch.abort_on_exception`), instead of leaving the other
    ranks waiting in their next collective. Python calls no hook for
    ``sys.exit(n)``: a rank that exits so while the others still work aborts
    the job only under ``python -m mpigc.launch``.

    Parameters
    ----------
    backend : str, optional
        ``"nccl"`` when CUDA is available, else ``"gloo"`` (default).
    comm, master_addr, master_port
        As for :func:`mpigc.launch.torchrun_env`.
    **kwargs
        Passed on (``timeout=``, ``device_id=``, ...).

    Returns
    -------
    dict
        The variables set.

    Examples
    --------
    >>> env = mpigc.torch.init_process_group()               # doctest: +SKIP
    >>> model = DDP(model.to(device), device_ids=[int(env["LOCAL_RANK"])])  # doctest: +SKIP
    """
    from ..launch import abort_on_exception, torchrun_env
    env = torchrun_env(comm, master_addr=master_addr, master_port=master_port)
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    torch.distributed.init_process_group(backend, init_method="env://",
                                         rank=int(env["RANK"]),
                                         world_size=int(env["WORLD_SIZE"]), **kwargs)
    abort_on_exception()  # after torch's hook, which holds back what the one before it writes
    if backend == "gloo":
        # Gloo's worker threads drop a finished collective's tensors a moment
        # after its wait returns, and torch keeps the group (and the threads)
        # to the end once DDP has used it; a tensor they drop after the
        # interpreter began to shut down aborts the process. At exit, before
        # the script's objects go, they are given that moment (see
        # mpigc.launch, which does the same for the scripts it runs).
        atexit.unregister(_let_gloo_threads_finish)  # once, however many groups
        atexit.register(_let_gloo_threads_finish)
    return env


def _named_tensors(obj):
    if isinstance(obj, torch.nn.Module):
        return list(obj.named_parameters()) + list(obj.named_buffers())
    if isinstance(obj, dict):
        return [(k, v) for k, v in obj.items() if torch.is_tensor(v)]
    return list(obj)


def broadcast_parameters(module, root=0, *, comm=None):
    """Copy the parameters and buffers of ``module`` from ``root`` to every rank,
    in place (collective), so that every rank starts from the same model.

    Parameters
    ----------
    module : torch.nn.Module, dict of tensors, or iterable of ``(name, tensor)``
        CPU or CUDA tensors of any dtype.
    root : int
        The rank whose values win.
    comm : mpi4py.MPI.Intracomm, optional
        Default ``MPI.COMM_WORLD``; mpigc talks on a private duplicate.

    Raises
    ------
    MismatchError
        On every rank, when ranks hold different names, shapes or dtypes.
    """
    comm = resolve_comm(comm)
    named = _named_tensors(module)
    c = comm.Dup()  # never on the user's communicator
    try:
        check_same(c, describe(named), "broadcast_parameters")
        with torch.no_grad():
            for _, t in named:
                if t.numel() == 0:
                    continue
                host = t.detach()
                staged = host.device.type != "cpu" or not host.is_contiguous()
                if staged:
                    host = host.to("cpu", copy=True).contiguous()
                c.Bcast([host.reshape(-1).view(torch.uint8).numpy(), MPI.BYTE], root=root)
                if staged:
                    t.copy_(host)
    finally:
        c.Free()


def broadcast_optimizer_state(optimizer, root=0, *, comm=None):
    """Give every rank ``root``'s optimizer state (``optimizer.load_state_dict``);
    collective. Needed after a resume where only ``root`` read the checkpoint."""
    comm = resolve_comm(comm)
    state = optimizer.state_dict() if comm.rank == root else None
    state = comm.bcast(state, root=root)
    if comm.rank != root:
        optimizer.load_state_dict(state)
