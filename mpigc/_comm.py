"""Communicators: a private duplicate per user communicator, and call tags.

mpigc never sends on the user's communicator: the first collective on a
communicator duplicates it (collectively) and caches the duplicate as an MPI
attribute of the user's communicator, so it goes away with it. Each call takes
the next sequence number of that duplicate; its messages use tags derived from
it, so concurrent nonblocking calls never match each other's messages.
"""
import os
import warnings

from mpi4py import MPI

from ._errors import DTypeError

__all__ = ["CommState", "resolve"]

_KEYVAL = None
_SEQ_MOD = 8000  # tags stay below 32767, the smallest MPI_TAG_UB allowed
_threads_set = False


class CommState:
    """The private duplicate of a communicator and its call counter."""

    __slots__ = ("comm", "size", "rank", "seq", "local_size", "local_rank", "cuda_aware")

    def __init__(self, comm):
        self.comm = comm.Dup()
        self.size = self.comm.Get_size()
        self.rank = self.comm.Get_rank()
        self.seq = 0
        local = self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.local_size = local.Get_size()
        self.local_rank = local.Get_rank()  # one GPU per node-local rank (select_device)
        local.Free()
        self.cuda_aware = None  # decided on first use by a device array (mpigc._cuda)

    def next_tags(self):
        """Tags ``(phase1, phase2)`` for the next call on this communicator."""
        base = 4 * (self.seq % _SEQ_MOD) + 1
        self.seq += 1
        return base, base + 1


def _limit_threads(local_size):
    """Cap the kernels' threads at cores / ranks-per-node, once, unless
    ``MPIGC_NUM_THREADS`` says otherwise (``0`` keeps Numba's setting)."""
    global _threads_set
    if _threads_set:
        return
    _threads_set = True
    from .kernels import cpu
    env = os.environ.get("MPIGC_NUM_THREADS")
    if env is not None:
        # no exception here: this runs on first use of a communicator, where a
        # rank that raised alone would leave the others waiting
        try:
            k = int(env)
            if k < 0:
                raise ValueError
        except ValueError:
            warnings.warn(f"MPIGC_NUM_THREADS must be an integer >= 0, got {env!r}; "
                          "ignored", stacklevel=3)
        else:
            cpu.set_max_threads(k if k > 0 else None)
            return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cpu.set_max_threads(max(1, (cores or 1) // max(1, local_size)))


def resolve(comm=None):
    """The :class:`CommState` of ``comm`` (default: ``MPI.COMM_WORLD``).

    Collective on first use of a communicator (it is duplicated then).
    """
    global _KEYVAL
    if comm is None:
        comm = MPI.COMM_WORLD
    if not isinstance(comm, MPI.Intracomm):
        raise DTypeError(f"comm: expected an mpi4py Intracomm, got {type(comm).__name__}")
    if _KEYVAL is None:
        _KEYVAL = MPI.Comm.Create_keyval()
    state = comm.Get_attr(_KEYVAL)
    if state is None:
        state = CommState(comm)
        comm.Set_attr(_KEYVAL, state)
        _limit_threads(state.local_size)
    return state
