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

As ``torchrun`` tears the job down when a worker fails, the launcher aborts
the MPI job (``MPI_Abort``) when the script ends on one rank with an
unhandled exception (status 1, the traceback on stderr under a line that
names the rank) or with ``sys.exit(n)``, ``n`` not 0 (status ``n``): the
other ranks would otherwise wait for that one forever in their next
collective, and it for them in ``MPI_Finalize``. A clean exit stays clean.
From a script run by plain ``python``, :func:`abort_on_exception` does the
same for unhandled exceptions (not for ``sys.exit``).
"""
import atexit
import gc
import importlib
import os
import runpy
import signal
import socket
import sys
import time
import traceback

from mpi4py import MPI

from . import _comm
from ._errors import ConfigError, MpigcError

__all__ = ["torchrun_env", "abort_on_exception", "main"]

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


def _exit_status(exc):
    """The exit status of a process that ``exc`` ends, as Python gives it:
    ``sys.exit(n)`` its ``n`` (its low 8 bits; ``None`` 0, a message 1), an
    interrupt 130 (128 + SIGINT), any other exception 1."""
    if isinstance(exc, SystemExit):
        if exc.code is None:
            return 0
        return int(exc.code) & 0xFF if isinstance(exc.code, int) else 1
    if isinstance(exc, KeyboardInterrupt):
        return 128 + signal.SIGINT
    return 1


def _ranks_wait_for_this_one():
    """Whether other ranks may wait for this one: MPI is up (initialised, not
    finalized) and ``COMM_WORLD`` has other ranks."""
    return MPI.Is_initialized() and not MPI.Is_finalized() and MPI.COMM_WORLD.Get_size() > 1


def _abort_job(what, status, text=""):
    """Write ``what`` (how this rank ended), with its rank, and ``text`` (a
    traceback) to stderr in one write, flush what the script printed, and abort
    the job with ``status``: the other ranks would wait for this one forever."""
    world = MPI.COMM_WORLD
    sys.stderr.write(f"mpigc: rank {world.Get_rank()} of {world.Get_size()}: {what}: "
                     f"aborting the job (MPI_Abort, status {status}) so that the other "
                     f"ranks do not wait for this one forever\n{text}")
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed by the script
            pass
    world.Abort(status)


def _from_script(tb, script):
    """The part of traceback ``tb`` that starts in ``script`` (the launcher's
    and ``runpy``'s frames left out); all of it where the script is not in it."""
    t = tb
    while t is not None and t.tb_frame.f_code.co_filename != script:
        t = t.tb_next
    return tb if t is None else t


def _end_of_script(exc, script):
    """The script raised ``exc`` (not caught): abort the job where other ranks
    may wait for this one and the exit is not a clean one; return otherwise
    (the caller raises it on)."""
    status = _exit_status(exc)
    if status == 0 or not _ranks_wait_for_this_one():
        return
    if isinstance(exc, SystemExit):  # sys.exit("message") writes the message
        message = "" if isinstance(exc.code, int) else f"{exc.code}\n"
        _abort_job(f"{script} exited with status {status}", status, message)
    else:
        text = "".join(traceback.format_exception(type(exc), exc,
                                                  _from_script(exc.__traceback__, script)))
        _abort_job(f"unhandled {type(exc).__name__} in {script}", status, text)


class _AbortHook:
    """The ``sys.excepthook`` of :func:`abort_on_exception`: ``previous``
    writes the traceback, then the job is aborted."""

    handling = False  # an exception is on its way through these hooks

    def __init__(self, previous):
        self.previous = previous

    def __call__(self, exc_type, exc, tb):
        interactive = sys.flags.interactive or hasattr(sys, "ps1")
        if _AbortHook.handling or interactive or not _ranks_wait_for_this_one():
            self.previous(exc_type, exc, tb)  # not this one's to abort (or an outer one's)
            return
        _AbortHook.handling = True
        try:
            self.previous(exc_type, exc, tb)  # the traceback, as it would be written
        except BaseException:  # noqa: BLE001 - a broken hook must not stop the abort
            traceback.print_exception(exc_type, exc, tb)
        what, status = f"unhandled {exc_type.__name__}", _exit_status(exc)
        if sys.excepthook is self:
            _abort_job(what, status)
        else:
            # A hook installed after this one called it, and may write what
            # this one wrote only once it returns (torch.distributed's collects
            # it to prefix each line with the rank): abort at exit, when it has
            # (before MPI finalizes: atexit runs the later handler first).
            atexit.register(_abort_job, what, status)


def abort_on_exception():
    """Make an exception that nobody catches abort the MPI job on this rank.

    Installs ``sys.excepthook`` (once per process): the traceback is written
    as before (by the hook this one wraps), then a line that names the rank,
    and the job is aborted (``MPI_Abort``, status 1; 130 for an interrupt).
    Without it, under plain ``python``, the rank that raised waits in
    ``MPI_Finalize`` at exit and the others in their next collective: the job
    hangs. :func:`mpigc.torch.init_process_group` calls it;
    ``python -m mpigc.launch`` (and ``python -m mpi4py``) need none.

    Python calls no hook for ``SystemExit``: a rank that ends with
    ``sys.exit(n)`` while the others still work leaves them waiting, unless
    the script runs under ``python -m mpigc.launch`` (which aborts the job
    with status ``n`` where ``n`` is not 0). Nothing is aborted at one rank,
    at the interactive prompt, or for an exception of a thread other than the
    main one. Where a hook installed later wraps this one (as
    ``torch.distributed.init_process_group``'s does), the job is aborted at
    exit, after that hook and once Python's non-daemon threads have ended.
    """
    if not isinstance(sys.excepthook, _AbortHook):
        sys.excepthook = _AbortHook(sys.excepthook)


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
    then SCRIPT as ``__main__`` with ``sys.argv = [SCRIPT, ARGS...]``.

    Where the script ends with an exception that it does not catch, other
    than ``SystemExit`` with status 0, and ``COMM_WORLD`` has other ranks,
    the job is aborted (status 1 for an exception, ``n`` for ``sys.exit(n)``,
    130 for an interrupt) after the rank and the traceback are written to
    stderr: its peers would otherwise wait for it forever, and it for them in
    ``MPI_Finalize``. At one rank the exception is raised on, as by plain
    ``python``."""
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
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except BaseException as exc:
        _end_of_script(exc, argv[0])
        raise
    _release_script()
    return 0


if __name__ == "__main__":
    sys.exit(main())
