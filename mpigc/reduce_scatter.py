"""Compressed reduce-scatter (phase 1 and 2 of the allreduce alone)."""
from typing import Literal, Optional, Sequence, Union

import numpy as np
from mpi4py import MPI

from . import _auto
from ._sched import Request
from ._route import start
from .compressors import Compressor
from .allreduce import Buf, Key
from .feedback import ErrorFeedback

Op = Union[str, dict, Compressor]

__all__ = ["reduce_scatter", "ireduce_scatter"]


def reduce_scatter(buf: Buf, op: Op = "2bit", *,
                   recvcounts: Optional[Sequence[int]] = None,
                   out: Optional[np.ndarray] = None, comm: Optional[MPI.Intracomm] = None,
                   key: Key = None, average: bool = False,
                   feedback: Union[ErrorFeedback, bool, None] = None,
                   nonfinite: Optional[str] = None,
                   hierarchy: Literal["auto", "flat", "node"] = "flat", auto_op: Op = "2bit",
                   auto_pin: Optional[str] = None, **params) -> np.ndarray:
    """Reduce ``buf`` over all ranks and return this rank's shard of the sum.

    Each rank compresses its ``buf`` once (with error feedback under ``key``),
    sends shard j to rank j, and rank j returns the sum of the decoded
    contributions: exactly ``sum_r D(Q(x_r))`` over its shard.

    Parameters
    ----------
    buf : numpy.ndarray, a CPU array that exposes its memory (torch CPU tensor,
        buffer protocol, ``__array_interface__``, DLPack), a CUDA device array,
        or a list or tuple of them
        The input, left unchanged (it may be read-only). A list is a grouped
        call (keys as for :func:`mpigc.allreduce`'s): it returns a list of
        this rank's shard of each array, as ``numpy.array_split`` cuts it,
        and takes no ``recvcounts`` and no ``out``.
    recvcounts : sequence of int, optional
        Shard sizes per rank; default as ``numpy.array_split``.
    out : numpy.ndarray, optional
        Where to write this rank's shard (dtype of ``buf``).
    Other parameters (``op="auto"``, ``auto_op``, ``auto_pin`` too) as in
    :func:`mpigc.allreduce`; hierarchically, the group
    owners' shards are moved to this layout after the inter-node step.

    Returns
    -------
    numpy.ndarray
        This rank's reduced shard, dtype of ``buf``.
    """
    if isinstance(op, str) and op == "auto":
        return _auto.start("reduce_scatter", buf, params, auto_op=auto_op, auto_pin=auto_pin,
                           comm=comm, key=key, average=average, gather="compressed",
                           feedback=feedback, nonfinite=nonfinite, recvcounts=recvcounts,
                           out=out, hierarchy=hierarchy, blocking=True).wait()
    req = start("reduce_scatter", buf, op, params, comm=comm, key=key, average=average,
                gather="compressed", feedback=feedback, nonfinite=nonfinite,
                recvcounts=recvcounts, out=out, hierarchy=hierarchy, blocking=True)
    return Request(req).wait()


def ireduce_scatter(buf: Buf, op: Op = "2bit", *,
                    recvcounts: Optional[Sequence[int]] = None,
                    out: Optional[np.ndarray] = None,
                    comm: Optional[MPI.Intracomm] = None,
                    key: Key = None, average: bool = False,
                    feedback: Union[ErrorFeedback, bool, None] = None,
                    nonfinite: Optional[str] = None,
                    hierarchy: Literal["auto", "flat", "node"] = "flat", auto_op: Op = "2bit",
                    auto_pin: Optional[str] = None, **params) -> Request:
    """Nonblocking :func:`reduce_scatter`; ``request.wait()`` returns the shard."""
    if isinstance(op, str) and op == "auto":
        return _auto.start("reduce_scatter", buf, params, auto_op=auto_op, auto_pin=auto_pin,
                           comm=comm, key=key, average=average, gather="compressed",
                           feedback=feedback, nonfinite=nonfinite, recvcounts=recvcounts,
                           out=out, hierarchy=hierarchy, blocking=False)
    return Request(start("reduce_scatter", buf, op, params, comm=comm, key=key,
                         average=average, gather="compressed", feedback=feedback,
                         nonfinite=nonfinite, recvcounts=recvcounts, out=out,
                         hierarchy=hierarchy, blocking=False))
